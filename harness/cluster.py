"""Several simulated nodes on this machine: one sidecar and one `torchrun` agent per node, all
agents in one c10d rendezvous, as the multi-node tests and `bench.bench_jobview` run them.

Each node has its own `node_name`, socket, TCP port and diagnostics directory; its agent's
workers find their node's sidecar through SIDECAR_SOCKET. A node can be hung in one rank
(SIGSTOP from outside, or the script's own hang), or lost whole (its sidecar, agent and ranks
SIGKILLed at once).

With `ClusterSpec(netns=True)` every node is a host of its own (harness/netns.py): its sidecar, its
agent and its ranks run in the node's network namespace, which has a management link (the sidecar
listens there, with a push token of its own; the c10d rendezvous and the workers' store; the job view's
peer requests) and a training link (gloo, pinned with GLOO_SOCKET_IFNAME). `cut_link(node)` drops
every packet on a node's training link, `restore_link(node)` ends that."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from harness import netns
from harness.job import PYTHON, SidecarClient, SidecarSpec, wait_for
from harness.processes import Processes, free_port

ROOT = Path(__file__).resolve().parent.parent


# The agents a simulated node can run, by name: (module run with -m, options before the script).
# torchrun itself; `trainer_hooks.launch`, torchrun whose agent re-forms a multi-node job faster
# (trainer_hooks/rendezvous.py); and the same with every attempt's workers forked warm.
AGENTS: dict[str, tuple[str, list[str]]] = {
    "torchrun": ("torch.distributed.run", []),
    "hooks": ("trainer_hooks.launch", []),
    "warm": ("trainer_hooks.launch", ["--warm"]),
}


@dataclass
class NodeSpec:
    name: str
    nproc: int = 1  # ranks on this node
    env: dict[str, str] = field(default_factory=dict)  # for this node's agent only
    # seconds this node's wall clock is ahead of the machine's (behind if negative): its sidecar, agent
    # and ranks all read it (harness/node_clock.c, preloaded)
    clock_offset: float = 0.0

    def clock_env(self) -> dict[str, str]:
        if not self.clock_offset:
            return {}
        return {"LD_PRELOAD": str(node_clock_library()), "NODE_CLOCK_OFFSET": f"{self.clock_offset:.6f}"}


def node_clock_library() -> Path:
    """harness/node_clock.c built once per content (the machine's C compiler), under the temp directory."""
    source = Path(__file__).with_name("node_clock.c")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    built = Path(tempfile.gettempdir()) / f"sidecar-node-clock-{digest}.so"
    if not built.exists():
        partial = built.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(partial), str(source), "-ldl"], check=True,
                           capture_output=True, text=True)  # fmt: skip
        except (OSError, subprocess.CalledProcessError) as e:
            raise RuntimeError(f"a node's clock offset needs a C compiler (cc) to build {source}: {e}") from e
        os.replace(partial, built)
    return built


@dataclass
class ClusterSpec:
    nodes: Sequence[NodeSpec]
    script: Path = ROOT / "bench" / "cycles" / "train_plain.py"
    script_args: Sequence[str] = ()
    job_id: str = "multi"
    max_restarts: int = 3
    min_nodes: int | None = None  # elastic: --nnodes MIN:MAX
    sidecar: SidecarSpec = field(default_factory=SidecarSpec)
    env: dict[str, str] = field(default_factory=dict)  # for every agent (and so every worker)
    with_sidecars: bool = True
    # a network namespace per node, with a management and a training link (harness/netns.py; root)
    netns: bool = False
    # the agents' module: torchrun itself, or `trainer_hooks.launch` (torchrun whose agent re-forms
    # a multi-node job faster: trainer_hooks/rendezvous.py)
    launcher: str = "torch.distributed.run"
    monitor_interval: float | None = None  # the agents' --monitor-interval (None: torchrun's default, 0.1 s)
    agent_args: Sequence[str] = ()  # more of the agents' options, before the script (e.g. ft_launcher's --ft-param-*)
    pythonpath: Sequence[str] = ()  # more directories on the agents' PYTHONPATH (e.g. where ft_launcher is installed)


@dataclass
class Node:
    spec: NodeSpec
    workdir: Path
    port: int
    socket: str
    sidecar: subprocess.Popen | None = None
    agent: subprocess.Popen | None = None
    host: str = "127.0.0.1"  # where its sidecar listens (its management address, with netns)
    index: int = 0

    @property
    def client(self) -> SidecarClient:
        client = SidecarClient(self.port)
        client.url = f"http://{self.host}:{self.port}"
        return client

    def status(self) -> dict:
        return self.client.status() or {}

    def ranks(self) -> list[dict]:
        return self.status().get("ranks", [])

    def incidents(self, kind: str | None = "stall") -> list[dict]:
        """Incident records of this node's diagnostics directory, oldest first."""
        directory = self.workdir / "diag" / "incidents"
        records = []
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
            with contextlib.suppress(OSError, ValueError):
                records.append(json.loads(path.read_text()))
        return [r for r in records if kind is None or r.get("kind", "stall") == kind]


class Cluster:
    """Start with `with Cluster(spec, workdir) as cluster:`; every process is killed on exit."""

    def __init__(self, spec: ClusterSpec, workdir: Path):
        self.spec = spec
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs = Processes(self.workdir)
        self.rdzv_port = free_port()
        self.nodes = [
            Node(n, self.workdir / n.name, free_port(), str(self.workdir / n.name / "sidecar.sock"), index=i)
            for i, n in enumerate(spec.nodes)
        ]
        self.network = netns.Network(len(self.nodes)) if spec.netns else None
        # Beyond loopback a sidecar needs a push token; each node makes up its own, as each pod of the
        # DaemonSet does without the optional Secret: the job view needs none shared (its keys are the
        # jobs' own, sidecar/jobview/auth.py).
        self.tokens = {n.spec.name: secrets.token_hex(16) for n in self.nodes} if spec.netns else {}

    # ------------------------------------------------------------ life cycle

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Every process killed, then the namespaces and links removed."""
        try:
            self.procs.close()
        finally:
            if self.network is not None:
                self.network.close()

    def start(self) -> None:
        if self.network is not None:
            self.network.create()
            for node in self.nodes:
                node.host = self.network.mgmt_addr(node.index)
        for node in self.nodes:
            node.workdir.mkdir(parents=True, exist_ok=True)
            if self.spec.with_sidecars:
                token = self.tokens.get(node.spec.name)
                env = {**({"SIDECAR_TOKEN": token} if token else {}), **node.spec.clock_env()} or None
                node.sidecar = self.procs.start(f"{node.spec.name}-sidecar", self.sidecar_command(node), env=env)
        for node in self.nodes if self.spec.with_sidecars else []:
            if not wait_for(node.client.ready, 60):
                raise RuntimeError(f"sidecar of {node.spec.name} did not start: see {self.log(node, 'sidecar')}")
        for node in self.nodes:
            path = os.pathsep.join([str(ROOT), *self.spec.pythonpath])
            env = {**self.spec.env, **node.spec.env, **node.spec.clock_env(), "PYTHONPATH": path}
            if self.network is not None:
                env["GLOO_SOCKET_IFNAME"] = netns.TRAIN_IF
            if self.spec.with_sidecars:
                env["SIDECAR_SOCKET"] = node.socket
            else:
                env["SIDECAR_HOOKS_DISABLED"] = "1"
            node.agent = self.procs.start(f"{node.spec.name}-torchrun", self.agent_command(node), env=env)

    def sidecar_command(self, node: Node) -> list[str]:
        cmd = self.spec.sidecar.command(node.workdir, node.port, node.socket)
        cmd[cmd.index("--listen") + 1] = f"{node.host}:{node.port}"
        if self.network is not None:  # its NIC metrics and incidents' `links`: the node's own links
            cmd += ["--set", f"collectors.sysfs_root={self.network.sysfs_root(node.index)}"]
        return self.enter(node) + cmd + ["--set", f"node_name={node.spec.name}"]

    def enter(self, node: Node) -> list[str]:
        """The prefix of a command that runs on the node's own network (nothing without netns)."""
        return self.network.enter(node.index) if self.network is not None else []

    def agent_command(self, node: Node) -> list[str]:
        n = len(self.nodes)
        nnodes = f"{self.spec.min_nodes}:{n}" if self.spec.min_nodes else str(n)
        conf = ["last_call_timeout=2"] if self.spec.min_nodes else []
        hosts: list[str] = []
        if self.network is not None:
            # the first node serves the rendezvous on its management address; each agent names its
            # own, which rank 0's agent hands the workers as MASTER_ADDR (the store stays off the
            # training link)
            conf.append(f"is_host={int(node.index == 0)}")
            hosts = ["--local-addr", node.host]
        return self.enter(node) + [
            PYTHON, "-m", self.spec.launcher, "--nnodes", nnodes, "--nproc-per-node", str(node.spec.nproc),
            "--max-restarts", str(self.spec.max_restarts), "--rdzv-id", self.spec.job_id,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.nodes[0].host}:{self.rdzv_port}",
            *(["--rdzv-conf", ",".join(conf)] if conf else []), *hosts,
            *(["--monitor-interval", str(self.spec.monitor_interval)] if self.spec.monitor_interval else []),
            *self.spec.agent_args, str(self.spec.script), *self.spec.script_args,
        ]  # fmt: skip

    def log(self, node: Node, what: str) -> Path:
        return self.procs.log(f"{node.spec.name}-{what}")

    # ------------------------------------------------------------ watching and hurting

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.spec.name == name)

    def rank_pid(self, rank: int) -> int | None:
        """The pid of a global rank, as its node's sidecar has it registered (live only)."""
        for node in self.nodes:
            for r in node.ranks():
                if r.get("rank") == rank and r.get("state") != "gone":
                    return r.get("pid")
        return None

    def wait_steps(self, step: int, timeout: float = 120.0) -> bool:
        """Until every node's sidecar has every local rank past `step`."""

        def reached() -> bool:
            for node in self.nodes:
                ranks = [r for r in node.ranks() if r.get("state") != "gone"]
                if len(ranks) < node.spec.nproc or any((r.get("step") or 0) < step for r in ranks):
                    return False
            return True

        return wait_for(reached, timeout, 0.2)

    def rendezvous_host(self) -> str | None:
        """The node whose agent serves the c10d rendezvous store (the agent that bound the
        endpoint's port first): losing it ends the rendezvous for everyone."""
        if self.network is not None:
            return self.nodes[0].spec.name  # is_host: the first node's agent serves it
        for node in self.nodes:
            if node.agent is None:
                continue
            with contextlib.suppress(psutil.Error):
                for p in [psutil.Process(node.agent.pid), *psutil.Process(node.agent.pid).children(recursive=True)]:
                    for c in p.net_connections(kind="tcp"):
                        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.rdzv_port:
                            return node.spec.name
        return None

    def stop_rank(self, rank: int) -> int:
        """SIGSTOP a rank from outside (a frozen process); returns its pid."""
        pid = self.rank_pid(rank)
        if pid is None:
            raise RuntimeError(f"rank {rank} is not registered live on any node")
        os.kill(pid, signal.SIGSTOP)
        return pid

    def cut_link(self, name: str) -> None:
        """Every packet sent on the node's training link is dropped, at both ends (netns only):
        its gloo traffic stops, its management link (sidecar, store) still works."""
        if self.network is None:
            raise RuntimeError("cut_link needs ClusterSpec(netns=True)")
        self.network.cut_link(self.node(name).index)

    def restore_link(self, name: str) -> None:
        if self.network is None:
            raise RuntimeError("restore_link needs ClusterSpec(netns=True)")
        self.network.restore_link(self.node(name).index)

    def lose_node(self, name: str) -> None:
        """The whole node goes at once: its sidecar, its agent and every rank, SIGKILLed."""
        node = self.node(name)
        victims = []
        for proc in (node.agent, node.sidecar):
            if proc is None:
                continue
            with contextlib.suppress(psutil.Error):
                victims.append(psutil.Process(proc.pid))
                victims += psutil.Process(proc.pid).children(recursive=True)
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)

    def wait_agents(self, timeout: float) -> list[int | None]:
        """Wait until every live agent exits; their return codes (None: still running)."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.agent is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.agent.wait(timeout=max(0.1, deadline - time.monotonic()))
        return [n.agent.poll() if n.agent is not None else None for n in self.nodes]
