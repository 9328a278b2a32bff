"""Run one cycle script under real torchrun next to a real sidecar and read what happened.

Attempts 0..cycles-1 of the job hang (rank 1 SIGSTOPs itself after step CYCLE_HANG_STEP); the
sidecar detects the stall, kills the node's worker group, torchrun starts the next attempt; the
last attempt trains to the end. A cycle "came back" when every rank of the next attempt ran its
first step; its recovery time is hang -> that step (the slowest rank's).

`launcher="ft_launcher"` runs NVIDIA's ft_launcher (nvidia-resiliency-ext) instead of torchrun,
for comparison, when it is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.job import SidecarClient, SidecarSpec, wait_for
from harness.processes import Processes, free_port

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("plain", "readme", "hf", "lightning", "unmodified")
SCRIPTS = {name: ROOT / "bench" / "cycles" / f"train_{name}.py" for name in NAMES}
ATTACHED = {"unmodified"}  # run through `-m trainer_hooks.attach` (zero-code attach)


# Fast cycles: a 2 s step floor, quick dumps, a 1 s grace, no storm cap in the way.
def fast_sidecar() -> SidecarSpec:
    return SidecarSpec(
        floor_seconds=2.0,
        dump_wait_seconds=0.5,
        grace_seconds=1.0,
        extra=[
            "remediation.max_per_window=1000",
            "remediation.max_per_window_node=1000",
            "hooks_flush_interval_seconds=0.25",
        ],
    )


@dataclass
class Cycles:
    script: str
    launcher: str
    cycles: int
    returncode: int | None
    came_back: int  # hangs followed by a next attempt in which every rank trained
    recover_seconds: list[float] = field(default_factory=list)  # per cycle that came back
    incidents: int = 0  # remediations the sidecar recorded
    finished: bool = False  # the last attempt trained to the end on every rank
    wall_seconds: float = 0.0
    log: Path | None = None
    hangs: int = 0  # attempts that hung on purpose
    lost_attempts: int = 0  # restarts in which the group never trained (e.g. died in init_process_group)
    # attempt -> the store generations its ranks' groups formed in (chaos.py; None: without the remedy)
    generations: dict[int, set] = field(default_factory=dict)

    def own_namespaces(self) -> bool:
        """Every attempt that trained formed its group in a store namespace of its own: all its
        ranks in one generation, a newer one than the attempt before (the restart remedy was in
        effect each time, which a lucky run without it could not show)."""
        seen = [self.generations[a] for a in sorted(self.generations)]
        if not seen or any(len(g) != 1 or None in g for g in seen):
            return False
        order = [next(iter(g)) for g in seen]
        return all(a < b for a, b in zip(order, order[1:], strict=False))

    @property
    def median(self) -> float | None:
        return statistics.median(self.recover_seconds) if self.recover_seconds else None

    def line(self) -> str:
        med = f"{self.median:.2f} s" if self.median is not None else "-"
        worst = f"{max(self.recover_seconds):.2f} s" if self.recover_seconds else "-"
        return (
            f"{self.script:<10} {self.launcher:<11} came back {self.came_back}/{self.cycles}  "
            f"(hangs {self.hangs}, restarts that never trained {self.lost_attempts})  "
            f"hang->training median {med}, max {worst}  finished={self.finished}  "
            f"own namespaces={'yes' if self.own_namespaces() else 'no'}  "
            f"rc={self.returncode}  ({self.wall_seconds:.0f} s)"
        )


def launcher_command(launcher: str, script: Path, nproc: int, max_restarts: int, attach: bool = False) -> list[str]:
    if launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run"]
    elif launcher == "ft_launcher":
        head = [
            sys.executable,
            "-c",
            "import sys; from nvidia_resiliency_ext.fault_tolerance.launcher import main; "
            "sys.argv[0] = 'ft_launcher'; sys.exit(main())",
            "--ft-param-rank_heartbeat_timeout=1000000",
            "--ft-param-initial_rank_heartbeat_timeout=1000000",
        ]
    else:
        raise ValueError(launcher)
    tail = ["-m", "trainer_hooks.attach", str(script)] if attach else [str(script)]
    return head + ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), *tail]


def read_records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def summarise(records: list[dict], cycles: int, nproc: int) -> tuple[int, list[float], bool]:
    hangs = {r["attempt"]: r["time"] for r in records if r["kind"] == "hang"}
    firsts: dict[int, dict[int, float]] = {}
    for r in records:
        if r["kind"] == "first_step":
            firsts.setdefault(r["attempt"], {})[r["rank"]] = r["time"]
    came_back, recover = 0, []
    for attempt in range(cycles):
        if attempt not in hangs:
            continue
        # the next attempt in which every rank trained (a spurious extra restart in between is allowed)
        later = [a for a in sorted(firsts) if a > attempt and len(firsts[a]) == nproc]
        if later and (attempt + 1 not in hangs or later[0] <= min(a for a in hangs if a > attempt)):
            came_back += 1
            recover.append(max(firsts[later[0]].values()) - hangs[attempt])
    last = max(firsts, default=-1)
    done = {r["rank"] for r in records if r["kind"] == "done" and r["attempt"] == last}
    return came_back, recover, len(done) == nproc


def run_cycles(
    script: str,
    workdir: Path,
    cycles: int = 10,
    nproc: int = 2,
    hang_step: int = 20,
    launcher: str = "torchrun",
    sidecar: bool = True,
    timeout: float = 600.0,
    hang_mode: str = "stop",
    extra_env: dict | None = None,
    attach: bool | None = None,
) -> Cycles:
    """Run `script` (a key of SCRIPTS) through `cycles` hangs; returns what came back."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    record_path = workdir / "cycles.jsonl"
    record_path.unlink(missing_ok=True)
    shutil.rmtree(workdir / "diag", ignore_errors=True)
    env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "CYCLE_LOG": str(record_path),
        "CYCLE_HANGS": str(cycles),
        "CYCLE_HANG_STEP": str(hang_step),
        "CYCLE_HANG_MODE": hang_mode,
        "CYCLE_WORKDIR": str(workdir),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    for key, value in (extra_env or {}).items():  # PYTHONPATH entries go in front
        env[key] = os.pathsep.join([value, env[key]]) if key == "PYTHONPATH" else value
    start = time.monotonic()
    with Processes(workdir) as procs:
        port, sock = free_port(), str(workdir / "sidecar.sock")
        if sidecar:
            spec = fast_sidecar()
            procs.start("sidecar", spec.command(workdir, port, sock))
            client = SidecarClient(port)
            if not wait_for(client.ready, 30):
                raise RuntimeError(f"sidecar did not start: {procs.log('sidecar').read_text()[-2000:]}")
            env["SIDECAR_SOCKET"] = sock
        else:
            env["SIDECAR_HOOKS_DISABLED"] = "1"
        job = procs.start(
            "job",
            launcher_command(
                launcher, SCRIPTS[script], nproc, cycles + 2, attach=script in ATTACHED if attach is None else attach
            ),
            env=env,
        )
        deadline = time.monotonic() + timeout
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        rc = job.poll()
        if rc is None:
            procs.stop(job)
    records = read_records(record_path)
    came_back, recover, finished = summarise(records, cycles, nproc)
    incidents = len(list((workdir / "diag" / "incidents").glob("*.json"))) if sidecar else 0
    trained = {r["attempt"] for r in records if r["kind"] == "first_step"}
    last = max((r["attempt"] for r in records), default=-1)
    return Cycles(
        script,
        launcher,
        cycles,
        rc,
        came_back,
        recover,
        incidents,
        finished,
        time.monotonic() - start,
        workdir / "job.log",
        hangs=sum(1 for r in records if r["kind"] == "hang"),
        lost_attempts=sum(1 for a in range(last + 1) if a not in trained),
        generations=generations(records),
    )


def generations(records: list[dict]) -> dict[int, set]:
    out: dict[int, set] = {}
    for r in records:
        if r["kind"] == "first_step":
            out.setdefault(r["attempt"], set()).add(r.get("generation"))
    return out
