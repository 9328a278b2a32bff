"""The field's faults in rotation, one a minute, on simulated nodes: `python -m bench.bench_recovery
--long --nodes 3 --faults mixed` runs them (bench/recovery_mixed.py takes the run apart and prints it).

The bundled trainer (`python -m sidecar_trainer.launch`, memory snapshots every step, one DataLoader
worker per rank) on `nodes` simulated nodes (harness/cluster.py: one sidecar and one agent each, one
c10d rendezvous, one rank per node). From the first step on, once a minute, the next fault of `KINDS`
hits the next rank (the victim moves across nodes and kinds):

  stop        the rank SIGSTOPped from outside (a frozen process)
  deadlock    two threads of the rank take two locks in opposite orders (a fault request)
  spin        a pure-Python busy loop in the rank's main thread (a fault request)
  crash       the rank SIGKILLed (torchrun sees the exit; no sidecar needed)
  dataloader  the rank's DataLoader worker SIGSTOPped (the rank waits on it)
  pause       every rank computes for twice the watchdog floor, outside any collective, undeclared:
              a healthy pause that must not be killed (a fault request for every rank)

The in-process faults go through the trainer's `faults.request_file` (sidecar_trainer/fault_requests.py).
The sidecars' storm caps are lifted, so every kill happens and is counted.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from harness.cluster import Cluster, ClusterSpec, NodeSpec
from harness.job import LogEvent, SidecarSpec, TrainerLog
from sidecar_trainer.fault_requests import FaultRequest, write_request

KINDS = ("stop", "deadlock", "spin", "crash", "dataloader", "pause")
HANGS = ("stop", "deadlock", "spin", "dataloader")  # the sidecar must detect and kill these
IN_PROCESS = ("deadlock", "spin", "pause")  # fault requests: the trainer fires them at a step
GRACE_SECONDS = 5.0
STEP_DELAY_SECONDS = 0.1  # data.delay_seconds: no step is shorter
FAULT_EVERY_SECONDS = 60.0
STEPS_AHEAD = {"deadlock": 5, "spin": 5, "pause": 15}  # how far ahead of rank 0's last step a request fires


@dataclass
class Fault:
    index: int
    kind: str
    rank: int | None  # None: every rank
    node: str | None  # the victim rank's node when it was hit
    requested: float  # Unix time the bench acted (signal sent, request written)
    at_step: int | None = None  # a request's step
    pid: int | None = None  # the process signalled
    fired: float | None = None  # a request: when the rank logged that it fired it
    rank_pid: int | None = None  # the victim rank's process
    notes: list[str] = field(default_factory=list)

    @property
    def start(self) -> float | None:
        """When the fault began: the signal, or the request's firing."""
        return self.fired if self.kind in IN_PROCESS else self.requested

    @property
    def label(self) -> str:
        who = "all ranks" if self.rank is None else f"rank {self.rank}" + (f"@{self.node}" if self.node else "")
        return f"{self.index + 1} {self.kind} {who}"


@dataclass
class MixedRun:
    minutes: float
    every: float  # seconds between faults
    floor: float
    nodes: int
    faults: list[Fault]
    events: list[LogEvent]  # every node's trainer log, in time order
    incidents: list[dict]  # every node's incident records (with "node"), in time order
    exit_codes: list[int | None]
    live: dict[str, dict[str, float]]  # node -> sidecar_job_seconds_total{state}
    steal: float | None
    workdir: Path
    left_behind: list[str] = field(default_factory=list)  # signalled processes still alive at the end


def cluster_spec(workdir: Path, nodes: int, floor: float, steps: int, faults: int) -> ClusterSpec:
    sidecar = SidecarSpec(
        floor_seconds=floor,
        grace_seconds=GRACE_SECONDS,
        # one fault a minute is the scenario, not a restart storm: every kill happens and is counted
        extra=["remediation.max_per_window=1000", "remediation.max_per_window_node=1000"],
    )
    trainer = {
        "train.steps": steps,
        "train.log_every_steps": 1,
        "checkpoint.dir": str(workdir / "ckpt"),
        "checkpoint.every_steps": 20,
        "data.delay_seconds": STEP_DELAY_SECONDS,
        "data.num_workers": 1,  # a DataLoader worker process per rank, for the `dataloader` fault
        "data.kwargs": "{size: 1000000}",  # one epoch for the whole run: its worker lives as long as the attempt
        "batch.global_batch_size": 8 * nodes,
        "batch.micro_batch_size": 8,
        "faults.request_file": str(workdir / "fault-request.json"),
    }
    args: list[str] = []
    for key, value in trainer.items():
        args += ["--set", f"{key}={value}"]
    return ClusterSpec(
        [NodeSpec(f"node-{i}", 1) for i in range(nodes)],
        script=Path("sidecar_trainer"),  # after agent_args' -m: the bundled trainer as a module
        agent_args=["-m"],
        script_args=args,
        job_id="mixed",
        max_restarts=faults + 5,
        sidecar=sidecar,
        launcher="sidecar_trainer.launch",
    )


def live_rank(cluster: Cluster, rank: int) -> tuple[str, int] | None:
    """(node, pid) of a global rank registered live and healthy on its node's sidecar."""
    for node in cluster.nodes:
        for r in node.ranks():
            if r.get("rank") == rank and r.get("state") == "healthy":
                return node.spec.name, r["pid"]
    return None


def dataloader_workers(pid: int) -> list[psutil.Process]:
    """The rank's DataLoader worker processes: its children (forked, so its command line; no multiprocessing
    helper such as a resource tracker)."""
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return []
    out = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if not any("resource_tracker" in part for part in child.cmdline()):
                out.append(child)
    return out


class Injector:
    """Hits the running job with one fault; remembers every process it signalled."""

    def __init__(self, cluster: Cluster, request_file: Path, floor: float):
        self.cluster, self.request_file, self.floor = cluster, request_file, floor
        self.signalled: list[psutil.Process] = []

    def ready(self) -> bool:
        """Every rank registered and healthy: the job trains (not between an attempt and the next)."""
        want = sum(n.spec.nproc for n in self.cluster.nodes)
        healthy = sum(1 for n in self.cluster.nodes for r in n.ranks() if r.get("state") == "healthy")
        return healthy >= want

    def hit(self, index: int, kind: str, rank: int, last_step: int) -> Fault | None:
        now = time.time()
        if kind == "pause":
            at = last_step + STEPS_AHEAD[kind]
            write_request(self.request_file, FaultRequest(f"f{index}", kind, None, at, 2 * self.floor))
            return Fault(index, kind, None, None, now, at_step=at)
        where = live_rank(self.cluster, rank)
        if where is None:
            return None
        node, pid = where
        if kind in IN_PROCESS:
            at = last_step + STEPS_AHEAD[kind]
            write_request(self.request_file, FaultRequest(f"f{index}", kind, rank, at))
            return Fault(index, kind, rank, node, now, at_step=at, pid=pid, rank_pid=pid)
        if kind == "dataloader":
            workers = dataloader_workers(pid)
            if not workers:
                return None
            target = workers[0]
        else:
            target = psutil.Process(pid)
        with contextlib.suppress(psutil.Error):
            target.create_time()  # cached: the process' identity for the clean-up
            target.send_signal(signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
            if kind != "crash":
                self.signalled.append(target)
            return Fault(index, kind, rank, node, time.time(), pid=target.pid, rank_pid=pid)
        return None

    def rescue(self, fault: Fault, seconds: float) -> None:
        """The job made no step for `seconds` after `fault`: the product did not recover it. SIGKILL the
        victim rank so that the run goes on, and say so (the fault's notes: a problem in the report)."""
        fault.notes.append(f"no step for {seconds:.0f}s after it: not recovered; the bench SIGKILLed the rank to go on")
        with contextlib.suppress(psutil.Error, TypeError):
            psutil.Process(fault.rank_pid).send_signal(signal.SIGKILL)

    def leftovers(self) -> list[str]:
        """Signalled processes still alive (the same process: pid and start time): each SIGKILLed."""
        left = []
        for p in self.signalled:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"pid {p.pid} ({p.status()})")
                    p.send_signal(signal.SIGKILL)
        return left


def run(
    workdir: Path,
    minutes: float,
    floor: float,
    nodes: int = 3,
    every: float = FAULT_EVERY_SECONDS,
    kinds: tuple[str, ...] = KINDS,
    progress=print,
) -> MixedRun:
    """The job with a fault every `every` seconds for `minutes` minutes (the last fault `minutes` minutes
    after the first step), the next of `kinds` each time, then trained to its end."""
    from bench.recovery_goodput import cpu_times, live_goodput, steal_share

    workdir.mkdir(parents=True, exist_ok=True)
    count = int(minutes * 60 // every)
    # At least `minutes` minutes and a tail (45 s at one fault a minute) of steps even at the fastest
    # step (its data delay): the last fault always comes, and the job then ends by itself.
    steps = int((minutes * 60 + max(10.0, min(45.0, 0.75 * every))) / STEP_DELAY_SECONDS)
    spec = cluster_spec(workdir, nodes, floor, steps, count)
    faults: list[Fault] = []
    events: list[LogEvent] = []
    steal_before = cpu_times()
    with Cluster(spec, workdir) as cluster:
        logs = [TrainerLog(cluster.log(n, "torchrun")) for n in cluster.nodes]
        injector = Injector(cluster, workdir / "fault-request.json", floor)
        first: float | None = None
        next_at: float | None = None
        last_step, stepped = 0, 0.0
        rescue_after = max(30.0, 6 * floor + GRACE_SECONDS)  # no fault's recovery takes this long
        deadline = time.monotonic() + minutes * 60 * 3 + 300
        try:
            while time.monotonic() < deadline:
                for log in logs:
                    new = log.poll()
                    events += new
                    for e in new:
                        if e.kind == "step" and e.fields["from_rank"] == 0:
                            last_step, first, stepped = e.fields["step"], first or e.time, e.time
                hit = faults[-1] if faults else None
                if hit is not None and hit.rank is not None and not hit.notes:
                    still = time.time() - max(stepped, hit.requested)
                    if still > rescue_after:
                        injector.rescue(hit, still)
                        progress(f"  {time.strftime('%H:%M:%S')} fault {hit.label}: {hit.notes[-1]}")
                if first is not None and next_at is None:
                    next_at = first + every
                if all(n.agent is not None and n.agent.poll() is not None for n in cluster.nodes):
                    break
                if next_at is not None and len(faults) < count and time.time() >= next_at and injector.ready():
                    i = len(faults)
                    kind, rank = kinds[i % len(kinds)], (i + i // len(kinds)) % nodes
                    fault = injector.hit(i, kind, rank, last_step)
                    if fault is not None:
                        faults.append(fault)
                        next_at = fault.requested + every
                        progress(f"  {time.strftime('%H:%M:%S')} fault {fault.label} (step {last_step})")
                time.sleep(0.2)
        finally:
            left = injector.leftovers()
        for log in logs:
            events += log.poll()
        codes = cluster.wait_agents(5)
        live = {n.spec.name: live_goodput(n.client) for n in cluster.nodes}
        incidents = [dict(i, node=n.spec.name) for n in cluster.nodes for i in n.incidents(kind=None)]
    events.sort(key=lambda e: e.time)
    for f in faults:
        if f.kind in IN_PROCESS:
            f.fired = next(
                (
                    e.time
                    for e in events
                    if e.kind == "fault"
                    and e.fields["kind"] == f.kind
                    and e.fields["step"] == f.at_step
                    and (f.rank is None or e.fields["rank"] == f.rank)
                ),
                None,
            )
    return MixedRun(
        minutes,
        every,
        floor,
        nodes,
        faults,
        events,
        sorted(incidents, key=lambda i: i["time"]),
        codes,
        live,
        steal_share(steal_before, cpu_times()),
        workdir,
        left,
    )
