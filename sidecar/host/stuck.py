"""What a process that outlived SIGKILL is doing, as the kernel tells it.

Its state (D: uninterruptible sleep, usually a driver or filesystem call that does not return;
stopped by a signal or a tracer; a zombie its parent does not reap), the kernel function it waits
in (/proc/<pid>/wchan) and its kernel stack (/proc/<pid>/stack: root with CAP_SYS_ADMIN only, and
some kernels hide it: then `kernel_stack_error` says so), the signals pending for it (a pending
SIGKILL means it dies as soon as it runs again), its freezer cgroup (cgroup v1 `freezer.state`,
v2 `cgroup.events`: a frozen process handles no signal, SIGKILL included, until thawed), and the
GPU device files it holds open (/proc/<pid>/fd links to /dev/nvidia*).

Everything is read from the kernel's own files under procfs and the cgroup mount, each read
bounded; nothing is opened by a name a process chose (the cgroup path goes through
sidecar/host/cgroups.py). A file that cannot be read leaves its field empty.
"""

from __future__ import annotations

import os
import signal
from dataclasses import asdict, dataclass, field

import psutil

from sidecar.host import cgroups
from sidecar.safetext import printable

STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible sleep",
    "Z": "zombie",
    "T": "stopped",
    "t": "stopped by a tracer",
    "X": "dead",
    "I": "idle",
    "P": "parked",
    "W": "paging",
}
MAX_STACK_LINES = 32
MAX_FDS = 4096  # descriptors looked at for GPU device files
MAX_GPU_FILES = 32
GPU_DEVICE_PREFIX = "/dev/nvidia"


@dataclass
class StuckProcess:
    pid: int
    name: str = ""  # its comm, with anything unprintable escaped (a process names itself)
    state: str = ""  # "D (uninterruptible sleep)"
    ppid: int | None = None
    tracer_pid: int | None = None  # who traces it, when someone does
    wchan: str | None = None  # the kernel function it sleeps in
    kernel_stack: list[str] = field(default_factory=list)
    kernel_stack_error: str | None = None  # why there is no kernel stack
    pending_signals: list[str] = field(default_factory=list)
    freezer: str | None = None  # "FROZEN in /sys/fs/cgroup/freezer/job" when it has a freezer cgroup
    gpu_files: list[str] = field(default_factory=list)  # GPU device files it holds open
    gpu_memory_bytes: dict[str, int] = field(default_factory=dict)  # gpu -> bytes, from NVML (the caller's)

    @property
    def frozen(self) -> bool:
        return self.freezer is not None and self.freezer.split()[0] in ("FROZEN", "FREEZING")

    def why(self) -> str:
        """One line: why it did not die."""
        parts = [self.state or "state unknown"]
        if self.frozen:
            parts.append(f"its freezer cgroup is {self.freezer} (no signal is handled until it is thawed)")
        if self.state.startswith("Z"):
            parts.append(f"its parent pid {self.ppid} does not reap it")
        if self.tracer_pid:
            parts.append(f"traced by pid {self.tracer_pid}")
        if self.wchan:
            parts.append(f"waiting in {self.wchan}")
        if "SIGKILL" in self.pending_signals:
            parts.append("SIGKILL pending")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["why"] = self.why()
        return out


def _read(path: str, limit: int = 4096) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return None


def signal_names(mask: int) -> list[str]:
    out = []
    for bit in range(64):
        if mask >> bit & 1:
            try:
                out.append(signal.Signals(bit + 1).name)
            except ValueError:
                out.append(f"signal {bit + 1}")
    return out


def describe(pid: int, procfs: str | None = None) -> StuckProcess:
    """The kernel's facts of `pid`, as far as they can be read (an exited process gives an
    almost empty record: the caller checks liveness itself)."""
    procfs = procfs or psutil.PROCFS_PATH
    base = f"{procfs}/{int(pid)}"
    p = StuckProcess(pid)
    stat = _read(f"{base}/stat")
    if stat is not None and ")" in stat:
        p.name = printable(stat[stat.find("(") + 1 : stat.rfind(")")])
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields:
            p.state = f"{fields[0]} ({STATES.get(fields[0], 'unknown')})"
        if len(fields) > 1 and fields[1].isdigit():
            p.ppid = int(fields[1])
    status = _read(f"{base}/status", 16384) or ""
    pending = 0
    for line in status.splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "TracerPid" and value.isdigit() and int(value):
            p.tracer_pid = int(value)
        elif key in ("SigPnd", "ShdPnd"):
            try:
                pending |= int(value, 16)
            except ValueError:
                pass
    p.pending_signals = signal_names(pending)
    wchan = _read(f"{base}/wchan", 256)
    if wchan and wchan.strip() not in ("", "0"):
        p.wchan = printable(wchan.strip())
    p.kernel_stack, p.kernel_stack_error = _kernel_stack(base)
    p.freezer = freezer_state(pid, procfs)
    p.gpu_files = gpu_files(base)
    return p


def _kernel_stack(base: str) -> tuple[list[str], str | None]:
    try:
        with open(f"{base}/stack", "rb") as f:
            text = f.read(16384).decode(errors="replace")
    except PermissionError:
        return [], "unreadable: /proc/<pid>/stack needs root with CAP_SYS_ADMIN"
    except OSError as e:
        return [], f"unreadable: {e.strerror or e}"
    lines = [printable(line.split("] ", 1)[-1].strip()) for line in text.splitlines() if line.strip()]
    if not lines:
        return [], "empty (the kernel hides stacks, or the process is running)"
    return lines[:MAX_STACK_LINES], None


def freezer_state(pid: int, procfs: str) -> str | None:
    """ "FROZEN in <cgroup>" (or FREEZING, THAWED) for the freezer cgroup of `pid`; None when it
    has none (the root cgroup, which cannot be frozen, has no state file)."""
    found = cgroups.cgroup_of(pid, "freezer", procfs)
    if found is None:
        return None
    try:
        if found.version == 1:
            text = found.read("freezer.state")
            state = text.strip() if text is not None else None
        else:
            events = found.read("cgroup.events")
            frozen = events is not None and "frozen 1" in events.splitlines()
            state = None if events is None else "FROZEN" if frozen else "THAWED"
            if state == "THAWED" and (found.read("cgroup.freeze") or "").strip() == "1":
                state = "FREEZING"
        return None if state is None else f"{printable(state) or 'unknown'} in {printable(found.path)}"
    finally:
        found.close()


def gpu_files(base: str) -> list[str]:
    """The GPU device files (/dev/nvidia*) among the open descriptors under `base`/fd."""
    try:
        names = os.listdir(f"{base}/fd")[:MAX_FDS]
    except OSError:
        return []
    found = set()
    for name in names:
        try:
            target = os.readlink(f"{base}/fd/{name}")
        except OSError:
            continue
        if target.startswith(GPU_DEVICE_PREFIX):
            found.add(printable(target))
            if len(found) >= MAX_GPU_FILES:
                break
    return sorted(found)
