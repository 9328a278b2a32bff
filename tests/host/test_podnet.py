"""sidecar/host/podnet.py against real network namespaces: the process behind a connection from a
pod is found, and what cannot be proven (a copy of the pod's address in another namespace, a client
address that is the host's own) is found for nobody."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from sidecar.host import podnet
from tests.security.test_pod_tcp import pod_network
from tests.support import kill_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make network namespaces")

# In a namespace: connect to HOST:PORT from source port SOURCE, say so, then hold the connection.
CONNECT = textwrap.dedent("""
    import socket, sys, time
    host, port, source = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[4] if len(sys.argv) > 4 else "0.0.0.0", source))
    s.connect((host, port))
    print("connected", flush=True)
    time.sleep(120)
""")

# In the attacker's namespace: the pod's address and the sidecar's on its loopback, and an
# established connection between them with the pod's source port: a row that looks like the pod's.
COPY = textwrap.dedent("""
    import socket, sys, time
    pod_ip, host, port, source = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    server = socket.socket()
    server.bind((host, port))
    server.listen()
    c = socket.socket()
    c.bind((pod_ip, source))
    c.connect((host, port))
    peer, _ = server.accept()
    print("connected", flush=True)
    time.sleep(120)
""")


def in_netns(netns: str, code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", code, *args],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "connected"
    return proc


def accept_from(pod, server: socket.socket, source: int) -> tuple[subprocess.Popen, tuple, tuple]:
    client = in_netns(pod.netns, CONNECT, pod.host_ip, str(server.getsockname()[1]), str(source))
    conn, peer = server.accept()
    return client, peer, conn.getsockname()


@pytest.fixture
def listening():
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    yield server
    server.close()


def test_the_process_in_a_pods_namespace_is_found_by_its_host_pid(listening):
    with pod_network("f") as pod:
        client, peer, local = accept_from(pod, listening, 41001)
        try:
            assert peer == (pod.ip, 41001)
            found = podnet.caller(peer, local)
            assert found is not None, (peer, local)
            pid, inode = found
            assert pid == client.pid  # `ip netns exec` execs the client: its host pid
            assert os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
            assert f"socket:[{inode}]" in {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        finally:
            kill_tree(client)


def test_a_copy_of_the_pods_address_and_port_in_another_namespace_makes_it_nobodys(listening):
    """A user who can make network namespaces (an unprivileged user namespace) copies the pod's
    address and source port into one of her own: the pod's connection is ambiguous, and is
    attributed to nobody (unverified), never to her process."""
    with pod_network("g") as pod, pod_network("c") as copy:
        client, peer, local = accept_from(pod, listening, 41002)
        subprocess.run(["ip", "-n", copy.netns, "addr", "add", f"{pod.ip}/32", "dev", "lo"], check=True)
        subprocess.run(["ip", "-n", copy.netns, "addr", "add", f"{local[0]}/32", "dev", "lo"], check=True)
        fake = in_netns(copy.netns, COPY, pod.ip, local[0], str(local[1]), "41002")
        try:
            assert podnet.caller(peer, local) is None
        finally:
            kill_tree(fake)
        try:  # the copy gone, the pod's process is found again
            assert podnet.caller(peer, local) is not None
        finally:
            kill_tree(client)


def test_a_client_address_of_the_host_itself_is_nobodys():
    """A connection masqueraded to the node's address (or from a hostNetwork process) names no
    pod: the host's addresses are refused before any namespace is read."""
    with pod_network("h") as pod:
        assert pod.host_ip in podnet.host_addresses()
        assert podnet.tcp_peer((pod.host_ip, 40000), (pod.host_ip, 9402)) is None
        assert podnet.tcp_peer(("127.0.0.1", 40000), ("127.0.0.1", 9402)) is None
        assert pod.ip not in podnet.host_addresses()


def test_a_connection_already_closed_is_nobodys(listening):
    with pod_network("k") as pod:
        client, peer, local = accept_from(pod, listening, 41003)
        kill_tree(client)
        assert podnet.caller(peer, local) is None  # the listener's end is open; the client's is gone
