"""Separate hosts on one machine: a network namespace per simulated node, with two links each.

    root namespace                      node i's namespace (`ip netns`)
    bridge <b>m 10.213.M.1/24  <--veth-->  mgmt   10.213.M.(i+2)/24   sidecar, c10d store, job view
    bridge <b>t (no address)   <--veth-->  train  10.213.M+1.(i+2)/24  gloo (GLOO_SOCKET_IFNAME=train)

Each namespace also gets a sysfs of its own (`sysfs_root(i)`, mounted from inside it: its
`class/net` lists `lo`, `mgmt` and `train`), for its sidecar's `collectors.sysfs_root`, so that a
node's NIC metrics and an incident's `links` show that node's links, not the root namespace's.

The management bridge holds the only address of these subnets in the root namespace, so the test
process reaches every node's sidecar; the training subnet exists inside the namespaces alone, and
nothing is routed off this machine (no forwarding, no default route in a namespace). A node's
training link is cut with `tc qdisc add dev X root pfifo limit 0` on both ends of its veth (every
packet sent on it is dropped; this kernel has no netem), and restored by deleting the qdiscs.

Needs root (`ip`, `tc`, `nsenter`, `mount`). Names carry the owner's pid (`sj<pid hex>-<n>...`),
so that a network left behind by a process that died without cleaning up is removed by the next
one; the pair of subnets is chosen under a file lock among those no root-namespace interface holds.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import subprocess
from pathlib import Path

PREFIX = "sj"  # names of everything made here: sj<pid hex>-<n>-...
NETNS_DIR = Path("/run/netns")
LOCK = Path("/tmp/sidecar-demo-netns.lock")
MOUNTS = Path("/run/sidecar-demo-netns")  # <netns name>/sys: each namespace's own sysfs
SUBNET_BASE = "10.213"  # 10.213.M.0/24 management and 10.213.M+1.0/24 training, M even
MGMT_IF, TRAIN_IF = "mgmt", "train"  # the links' names inside each namespace
_counter = itertools.count()
_NAME = re.compile(rf"^{PREFIX}([0-9a-f]+)-")


def available() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "nsenter", "mount"):
        if not any(Path(d, tool).exists() for d in os.environ.get("PATH", "/usr/sbin:/usr/bin").split(":")):
            return f"{tool} is not installed"
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unmount(directory: Path) -> None:
    sysfs = directory / "sys"
    if os.path.ismount(sysfs):
        _run("umount", "-l", str(sysfs), check=False)
    for d in (sysfs, directory):
        try:
            d.rmdir()
        except OSError:
            pass


def sweep() -> None:
    """Remove the namespaces, links and mounts of owners that no longer run."""
    for directory in MOUNTS.iterdir() if MOUNTS.is_dir() else []:
        m = _NAME.match(directory.name)
        if m is not None and not _alive(int(m.group(1), 16)):
            _unmount(directory)
    names = [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.is_dir() else []
    links = [line.split(":")[1].strip().split("@")[0] for line in _run("ip", "-o", "link", "show").stdout.splitlines()]
    for name in names + links:
        m = _NAME.match(name)
        if m is None or _alive(int(m.group(1), 16)):
            continue
        if name in names:
            _run("ip", "netns", "delete", name, check=False)
        else:  # a bridge, or the root end of a veth whose namespace lingers
            _run("ip", "link", "delete", name, check=False)


def _taken_subnets() -> set[int]:
    taken = set()
    for line in _run("ip", "-o", "-4", "addr", "show").stdout.splitlines():
        m = re.search(rf"inet {re.escape(SUBNET_BASE)}\.(\d+)\.", line)
        if m:
            taken.add(int(m.group(1)))
    return taken


class Network:
    """The namespaces and links of one simulated cluster; `close()` removes them all (also when
    `create()` failed half-way)."""

    def __init__(self, nodes: int):
        self.nodes = nodes
        self.tag = f"{PREFIX}{os.getpid():x}-{next(_counter):x}"
        self.subnet: int | None = None  # M: management 10.213.M.0/24, training 10.213.M+1.0/24
        self.netns = [f"{self.tag}-n{i}" for i in range(nodes)]
        self.bridges = (f"{self.tag}-bm", f"{self.tag}-bt")
        self.made_netns: list[str] = []
        self.made_links: list[str] = []
        self.cut: set[int] = set()
        for name in [*self.bridges, *(self.veth(i, k) for i in range(nodes) for k in "mt")]:
            if len(name) > 15:
                raise ValueError(f"interface name {name!r} is longer than 15 characters")

    # ------------------------------------------------------------ names and addresses

    def veth(self, node: int, kind: str) -> str:
        """The root-namespace end of node's management (`m`) or training (`t`) link."""
        return f"{self.tag}-{node}{kind}"

    def mgmt_addr(self, node: int) -> str:
        assert self.subnet is not None
        return f"{SUBNET_BASE}.{self.subnet}.{node + 2}"

    def train_addr(self, node: int) -> str:
        assert self.subnet is not None
        return f"{SUBNET_BASE}.{self.subnet + 1}.{node + 2}"

    def sysfs_root(self, node: int) -> str:
        """A sysfs seen from node's namespace (its own network devices)."""
        return str(MOUNTS / self.netns[node] / "sys")

    def enter(self, node: int) -> list[str]:
        """The prefix of a command that runs in node's namespace (its network only: the same
        files, pids and mounts as here)."""
        return ["nsenter", f"--net={NETNS_DIR / self.netns[node]}", "--"]

    # ------------------------------------------------------------ life cycle

    def create(self) -> Network:
        with open(LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep()
            taken = _taken_subnets()
            free = [m for m in range(0, 254, 2) if m not in taken and m + 1 not in taken]
            if not free:
                raise RuntimeError(f"no free pair of subnets in {SUBNET_BASE}.0.0/16")
            self.subnet = free[0]
            bm, bt = self.bridges
            for bridge in (bm, bt):
                _run("ip", "link", "add", bridge, "type", "bridge")
                self.made_links.append(bridge)
            # the address claims the subnet for the lock's next holder
            _run("ip", "addr", "add", f"{SUBNET_BASE}.{self.subnet}.1/24", "dev", bm)
        for bridge in (bm, bt):
            _run("ip", "link", "set", bridge, "up")
        for i, ns in enumerate(self.netns):
            _run("ip", "netns", "add", ns)
            self.made_netns.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            for kind, inside, bridge, addr in (("m", MGMT_IF, bm, self.mgmt_addr(i)),
                                               ("t", TRAIN_IF, bt, self.train_addr(i))):  # fmt: skip
                outside = self.veth(i, kind)
                _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
                _run("ip", "link", "set", outside, "master", bridge, "up")
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", inside)
                _run("ip", "-n", ns, "link", "set", inside, "up")
            Path(self.sysfs_root(i)).mkdir(parents=True, exist_ok=True)
            # mounted from inside: sysfs shows the network devices of the mounting namespace
            _run(*self.enter(i), "mount", "-t", "sysfs", "sysfs", self.sysfs_root(i))
        return self

    def close(self) -> None:
        # The veths first: a namespace outlives its name while sockets of its dead processes linger
        # (TCP retransmitting to a peer that is gone), and its links with it.
        for i in range(len(self.made_netns)):
            for kind in "mt":
                _run("ip", "link", "delete", self.veth(i, kind), check=False)
        for ns in reversed(self.made_netns):
            _unmount(MOUNTS / ns)
            _run("ip", "netns", "delete", ns, check=False)
        for link in reversed(self.made_links):
            _run("ip", "link", "delete", link, check=False)
        self.made_netns.clear()
        self.made_links.clear()
        self.cut.clear()

    def __enter__(self) -> Network:
        try:
            return self.create()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ hurting

    def cut_link(self, node: int) -> None:
        """Every packet sent on node's training link is dropped, at both ends."""
        _run("tc", "qdisc", "replace", "dev", self.veth(node, "t"), "root", "pfifo", "limit", "0")
        _run(*self.enter(node), "tc", "qdisc", "replace", "dev", TRAIN_IF, "root", "pfifo", "limit", "0")
        self.cut.add(node)

    def restore_link(self, node: int) -> None:
        _run("tc", "qdisc", "delete", "dev", self.veth(node, "t"), "root", check=False)
        _run(*self.enter(node), "tc", "qdisc", "delete", "dev", TRAIN_IF, "root", check=False)
        self.cut.discard(node)

    def counters(self, node: int, kind: str = "t") -> dict[str, int]:
        """Bytes and packets through the root end of node's link (`t` training, `m` management)."""
        stats = Path("/sys/class/net") / self.veth(node, kind) / "statistics"
        return {
            name: int((stats / name).read_text())
            for name in ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "tx_dropped")
            if (stats / name).exists()
        }

    def exists(self) -> bool:
        """Whether anything of this network is still there."""
        listed = {p.name for p in NETNS_DIR.iterdir()} if NETNS_DIR.is_dir() else set()
        if listed & set(self.netns) or any((MOUNTS / ns).exists() for ns in self.netns):
            return True
        links = [*self.bridges, *(self.veth(i, k) for i in range(self.nodes) for k in "mt")]
        return any(_run("ip", "link", "show", name, check=False).returncode == 0 for name in links)
