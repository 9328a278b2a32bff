"""The process behind a TCP connection from another network namespace of this node: a training pod
without hostNetwork (Pod Security `baseline`) pushing to its node's sidecar at `status.hostIP`.

The sidecar (host pid namespace) cannot find such a caller in its own `/proc/net/tcp`: the
connection's client end lives in the pod's network namespace. It reads each other namespace's table
through a process in it (`/proc/<pid>/net/tcp`, which shows that process's namespace), finds the row
whose local end is the client address and port the sidecar accepted from and whose remote port is
the sidecar's (a hostPort that maps to the same port, as shipped), and then the process among that
namespace's members that holds the row's socket (its inode among the process's descriptors).
identity.process_peer then opens a pidfd and checks the process still holds it, as for a local caller.

Nothing here is taken on a caller's word, and what cannot be proven is left unverified:

- a client address that is one of the host's own (the host namespace's `LOCAL` routes): the
  connection was masqueraded to the node's address by the CNI, or comes from a hostNetwork
  process, and the address and port name no process for sure (a host process may hold the same
  local address and port towards another server);
- more than one live row, across all namespaces, for the client address and port: a user who can
  make network namespaces (an unprivileged user namespace) can copy a pod's address into one of
  her own and make its connection ambiguous; ambiguous is unverified, never attributed;
- no row, or no process holding it (the client closed its end first).
"""

from __future__ import annotations

import ipaddress
import os

import psutil

from sidecar.host import procs

_LIVE = ("01", "08")  # ESTABLISHED, CLOSE_WAIT: a process still holds its end


def _netns(pid: int | str) -> int | None:
    """The inode of the process's network namespace, or None (gone, or not readable)."""
    try:
        return os.stat(f"{psutil.PROCFS_PATH}/{pid}/ns/net").st_ino
    except (OSError, ValueError):
        return None


def _namespaces() -> dict[int, list[int]]:
    """Every network namespace some process is in, with its member pids (lowest first)."""
    found: dict[int, list[int]] = {}
    try:
        pids = sorted(int(p) for p in os.listdir(psutil.PROCFS_PATH) if p.isdigit())
    except OSError:
        return found
    for pid in pids:
        ns = _netns(pid)
        if ns is not None:
            found.setdefault(ns, []).append(pid)
    return found


def host_addresses() -> set[str]:
    """The addresses of the host's network namespace (pid 1's): IPv4 `LOCAL` routes of its
    `fib_trie`, and its IPv6 interface addresses."""
    out: set[str] = set()
    try:
        with open(f"{psutil.PROCFS_PATH}/1/net/fib_trie") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    last = None
    for line in lines:
        text = line.strip()
        if text.startswith(("|--", "+--")):
            last = text[3:].split()[0]
        elif text == "/32 host LOCAL" and last is not None:
            out.add(last)
    try:
        with open(f"{psutil.PROCFS_PATH}/1/net/if_inet6") as f:
            for line in f:
                raw = line.split()[0] if line.split() else ""
                if len(raw) == 32:
                    out.add(str(ipaddress.IPv6Address(bytes.fromhex(raw))))
    except (OSError, ValueError):
        pass
    return out


def _is_host_address(host: str, addresses: set[str]) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return True  # cannot tell: taken as the host's (nothing is attributed)
    ip = ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip
    return ip.is_loopback or ip.is_unspecified or str(ip) in addresses


def tcp_peer(client: tuple, server: tuple) -> tuple[int, int] | None:
    """The process (host pid) holding the client end of a connection from another network
    namespace of this node, and that socket's inode; None when it cannot be proven (see the
    module's docstring). Scans every process: callers run it off the event loop, for
    registrations only."""
    if _is_host_address(str(client[0]), host_addresses()):
        return None
    own, host = _netns(os.getpid()), _netns(1)
    found: list[tuple[list[int], int]] = []
    for ns, members in _namespaces().items():
        if ns in (own, host):
            continue
        for pid in members[:4]:  # the first member whose table can be read speaks for the namespace
            rows = [(local, remote, state, inode) for local, remote, state, _, inode in procs.tcp_rows(pid)]
            if rows:
                break
        for local, remote, state, inode in rows:
            if state in _LIVE and inode and local[1] == client[1] and remote[1] == server[1]:
                if procs.same_host(local[0], str(client[0])):
                    found.append((members, inode))
    if len(found) != 1:
        return None
    members, inode = found[0]
    holder = next((pid for pid in members if procs.holds_socket(pid, inode)), None)
    return None if holder is None else (holder, inode)


def caller(client: tuple, server: tuple) -> tuple[int, int] | None:
    """The process behind a TCP connection from this node: in the sidecar's own network namespace
    (procs.tcp_peer), else in another one (a pod's); None when neither can be proven."""
    return procs.tcp_peer(client, server) or tcp_peer(client, server)
