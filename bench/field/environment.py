"""What the field's pauses need from outside the job: slow storage and a starved or frozen rank.

- `SlowStorage`: FIFOs `rank<N>.pt` that a thread of the bench drains at a fixed rate, so a
  `torch.save` to one blocks in the kernel's write() as a save to slow storage does;
- `Cgroups`: a cgroup v1 cpu cgroup with a 0.1% quota (a CPU-starved but live rank) and a freezer
  cgroup (a frozen process sleeps uninterruptibly: `D` in /proc, as a rank stuck in a driver
  call or on a hung mount), each entered and left by the bench, never by the rank. `close()`
  thaws, moves every process back and removes both, whatever happened.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
CHUNK = 64 << 10
CPU_PERIOD_US = 1_000_000
CPU_QUOTA_US = 1_000  # 0.1% of a core (the least cgroup v1 allows): the rank runs 1 ms a second


class SlowStorage:
    def __init__(self, folder: Path, ranks: int, bytes_per_second: float):
        self.folder, self.rate = Path(folder), bytes_per_second
        self.folder.mkdir(parents=True, exist_ok=True)
        self.stopped = threading.Event()
        self.saved: list[tuple[int, int, float]] = []  # (rank, bytes, seconds) of each complete save
        self.threads = []
        for r in range(ranks):
            path = self.folder / f"rank{r}.pt"
            path.unlink(missing_ok=True)
            os.mkfifo(path)
            t = threading.Thread(target=self._drain, args=(r, path), daemon=True, name=f"slow-storage-{r}")
            t.start()
            self.threads.append((t, path))

    def _drain(self, rank: int, path: Path) -> None:
        while not self.stopped.is_set():
            fd = os.open(path, os.O_RDONLY)  # waits for a writer (close() opens one to end the wait)
            start, n = time.monotonic(), 0
            try:
                while not self.stopped.is_set():
                    chunk = os.read(fd, CHUNK)
                    if not chunk:
                        break
                    n += len(chunk)
                    time.sleep(max(0.0, start + n / self.rate - time.monotonic()))
            finally:
                os.close(fd)
            if n:
                self.saved.append((rank, n, time.monotonic() - start))

    def close(self) -> None:
        self.stopped.set()
        for t, path in self.threads:
            with contextlib.suppress(OSError):  # ENXIO: no reader waits
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            t.join(timeout=5)


def _own(controller: str) -> Path:
    """This process's cgroup of a v1 controller (the ranks start in it too)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return CGROUP / controller / path.lstrip("/")
    raise OSError(errno.ENOENT, f"no cgroup v1 {controller} controller")


def cgroups_unavailable() -> str | None:
    """Why the cgroup pauses cannot run here (None: they can)."""
    for controller in ("cpu", "freezer"):
        root = CGROUP / controller
        if not (root / "cgroup.procs").exists():
            return f"no cgroup v1 {controller} hierarchy at {root}"
        if not os.access(root, os.W_OK):
            return f"{root} is not writable (run as root)"
    return None


class Cgroups:
    def __init__(self, tag: str):
        name = f"bench-field-{tag}-{os.getpid()}"
        self.home = {c: _own(c) for c in ("cpu", "freezer")}
        self.cpu, self.freezer = CGROUP / "cpu" / name, CGROUP / "freezer" / name
        self.cpu.mkdir()
        self.freezer.mkdir()
        (self.cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (self.cpu / "cpu.cfs_quota_us").write_text(str(CPU_QUOTA_US))

    @staticmethod
    def _move(pid: int, group: Path) -> bool:
        try:
            (group / "cgroup.procs").write_text(str(pid))
            return True
        except OSError:  # the process is gone
            return False

    def starve(self, pid: int) -> bool:
        return self._move(pid, self.cpu)

    def feed(self, pid: int) -> None:
        self._move(pid, self.home["cpu"])

    def freeze(self, pid: int) -> bool:
        if not self._move(pid, self.freezer):
            return False
        (self.freezer / "freezer.state").write_text("FROZEN")
        return True

    def thaw(self, pid: int | None = None) -> None:
        (self.freezer / "freezer.state").write_text("THAWED")
        deadline = time.monotonic() + 10
        while (self.freezer / "freezer.state").read_text().strip() != "THAWED" and time.monotonic() < deadline:
            time.sleep(0.01)
        if pid is not None:
            self._move(pid, self.home["freezer"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.thaw()
        for group, controller in ((self.cpu, "cpu"), (self.freezer, "freezer")):
            for _ in range(50):
                with contextlib.suppress(OSError):
                    for pid in (group / "cgroup.procs").read_text().split():
                        self._move(int(pid), self.home[controller])
                    group.rmdir()
                if not group.exists():
                    break
                time.sleep(0.1)
