"""Row 5 of the security issue, and the pid-namespace part of the field-deployment issue: a
registration is tied to the process, not to a pid number.

Row 5 as it was done: a child of an unprivileged user connects to the socket and exits, its
pid is reused by a root process, and the user registers that pid over the dead child's
connection. The sidecar used to trust the peer credentials recorded at connect(); it must see
that the connecting process is gone. The reuse is forced inside a fresh pid namespace (sidecar
and all), where writing ns_last_pid hands out exactly the pid wanted."""

from __future__ import annotations

import psutil
import pytest

from tests.security.namespaces import in_new_pid_namespace, start_in_new_pid_namespace
from tests.security.rig import OPEN_SOCKET, attack, open_sidecar, ranks_of
from tests.support import kill_tree
from tests.support.unpriv import unprivileged_user

ROW_5 = r"""
    import pwd, select
    from tests.security.rig import OpenSidecar as Sidecar
    from tests.support.unpriv import run_as, UNPRIV_PYTHON, world_dir
    from tests.security.rig import CLIENT
    ATTACK = CLIENT + '''
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    child = os.fork()
    if child == 0:
        s.connect(SOCK)          # the peer credentials are this child's
        os._exit(0)
    os.waitpid(child, 0)
    print(child, flush=True)
    sys.stdin.readline()        # the pid now belongs to a root process
    report(reply=request("/v1/register", registration(child, "reuse", world_size=1), sock=s))
    '''
    user = pwd.getpwnam(os.environ["ATTACKER"])
    with Sidecar(world_dir(), *os.environ["SETTINGS"].split()) as sc:
        attacker = subprocess.Popen([UNPRIV_PYTHON, "-c", ATTACK], user=user.pw_uid, group=user.pw_gid,
                                    extra_groups=[], env={"SIDECAR_SOCKET": sc.socket, "PATH": "/usr/bin:/bin"},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        dead = int(attacker.stdout.readline())
        victim = process_with_pid(dead, ["sleep", "600"])
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        out = attacker.stdout.read()
        attacker.wait()
        ranks = sc.status()["ranks"]
        report(attack=json.loads(out.split("RESULT ", 1)[1]), victim_pid=victim.pid,
               victim_alive=victim.poll() is None, ranks=ranks)
        victim.kill()
"""


def test_a_registration_over_the_connection_of_an_exited_process_is_refused():
    """Row 5: without the fix, the reused pid was accepted as verified and later killed."""
    mallory = unprivileged_user("mallory")
    out = in_new_pid_namespace(ROW_5, {"ATTACKER": mallory.name, "SETTINGS": " ".join(OPEN_SOCKET)})
    status, body = out["attack"]["reply"]
    assert status == 403, out
    assert "exited" in body["error"] and str(out["victim_pid"]) in body["error"], body
    assert out["victim_alive"] and out["ranks"] == []


def test_a_user_cannot_register_a_root_process_it_started_through_a_setuid_path(spawn):
    """The caller's uid must be the registered process's: even a process the caller started
    (its descendant) is refused once it runs as someone else (here: root's `sleep`, started
    by the test and claimed by an unprivileged user who cannot be its ancestor, so the uid
    check and the ancestry check both refuse it)."""
    mallory = unprivileged_user("mallory")
    root_proc = spawn()
    with open_sidecar() as sidecar:
        out = attack(
            mallory,
            sidecar,
            f"""
            report(reply=request("/v1/register", registration({root_proc.pid}, "j", world_size=1)))
        """,
        )
    assert out["reply"][0] == 403 and root_proc.poll() is None


# ---------------------------------------------------------------- ranks in their own pid namespace

NS_SETTINGS = (
    "watchdog.startup_timeout_seconds=2",
    "watchdog.floor_seconds=3",
    "hooks_flush_interval_seconds=0.5",
    "watchdog.check_interval_seconds=0.25",
    "remediation.dump_wait_seconds=0",
    "remediation.grace_seconds=1",
)

LAUNCHER = r"""
    me = request("/v1/register", registration(os.getpid(), "pod", rank=0, world_size=2))
    child = sleeper()
    kid = request("/v1/register", registration(child.pid, "pod", rank=1, world_size=2))
    report(me=me, kid=kid, child=child.pid)
    time.sleep(600)
"""


def nspid(host_pid: int) -> list[int]:
    with open(f"/proc/{host_pid}/status") as f:
        line = next(row for row in f if row.startswith("NSpid:"))
    return [int(x) for x in line.split()[1:]]


def test_a_rank_in_its_own_pid_namespace_registers_and_is_known_by_its_host_pid():
    """The pod's pid 1 registers itself (a container whose entrypoint is the trainer), and as a
    launcher registers its child; the sidecar records their host pids."""
    with open_sidecar(*NS_SETTINGS) as sidecar:
        proc, init, out = start_in_new_pid_namespace(LAUNCHER, sidecar.hook_env())
        try:
            assert out["me"][0] == 200 and out["kid"][0] == 200, out
            ranks = ranks_of(sidecar, "pod")
            assert ranks[0]["pid"] == init and nspid(init)[-1] == 1
            assert psutil.Process(ranks[1]["pid"]).ppid() == init and nspid(ranks[1]["pid"])[-1] == out["child"]
            assert {r["state"] for r in ranks.values()} == {"starting"}
        finally:
            kill_tree(proc)


CLAIMS = r"""
    sibling = sleeper()
    claim = CLIENT + '''
    s = int(sys.argv[1])
    report(sibling=request("/v1/register", registration(s, "pod", world_size=1)),
           init=request("/v1/register", registration(1, "pod", world_size=1)),
           nobody=request("/v1/register", registration(4000000, "pod", world_size=1)))
    '''
    out = subprocess.run([sys.executable, "-c", claim, str(sibling.pid)], capture_output=True, text=True)
    print(out.stdout, flush=True)
    sibling.kill()
"""


def test_a_process_in_a_namespace_claiming_a_pid_not_its_own_is_refused():
    with open_sidecar(*NS_SETTINGS) as sidecar:
        out = in_new_pid_namespace(CLAIMS, sidecar.hook_env())
        for name, claimed in (("sibling", None), ("init", 1), ("nobody", 4000000)):
            status, body = out[name]
            assert status == 403 and body["code"] == "pid_mismatch", (name, out[name])
            if claimed is not None:
                assert f"pid: {claimed}" in body["error"], body
        assert ranks_of(sidecar, "pod") == {}


REUSE_IN_NS = r"""
    rank = subprocess.Popen([sys.executable, "-c", CLIENT + '''
    report(reply=request("/v1/register", registration(os.getpid(), "pod", world_size=1)))
    '''], stdout=subprocess.PIPE, text=True)
    first = rank.communicate()[0]
    # The rank has exited; its namespace pid now names another process, which pushes as it
    # and then just lives on past the start-up timeout.
    newcomer = process_with_pid(rank.pid, [sys.executable, "-c", CLIENT + '''
    report(push=request("/v1/push", {"job_id": "pod", "rank": 0, "pid": os.getpid(),
                                     "items": [{"type": "step", "step": 5}]}))
    time.sleep(600)
    '''], stdout=subprocess.DEVNULL)
    time.sleep(5)
    report(first=json.loads(first.split("RESULT ", 1)[1]), reused=rank.pid, newcomer_alive=newcomer.poll() is None)
    time.sleep(600)
"""


@pytest.mark.slow
def test_pid_reuse_inside_a_namespace_is_never_signalled():
    with open_sidecar(*NS_SETTINGS) as sidecar:
        proc, _, out = start_in_new_pid_namespace(REUSE_IN_NS, sidecar.hook_env(), timeout=90)
        try:
            assert out["first"]["reply"][0] == 200, out
            assert out["newcomer_alive"], "the process that reused the rank's pid was signalled"
            ranks = ranks_of(sidecar, "pod")
            assert ranks[0]["state"] == "gone" and ranks[0]["step"] is None, ranks
            assert sidecar.status()["incidents"] == []
        finally:
            kill_tree(proc)


# ---------------------------------------------------------------- round 2, row 5: over TCP

# The client C connects over TCP and forks P, which inherits the connection; helpers started
# after P hold many descriptors, so a scan of every process's descriptors (the old lookup) takes
# a while after it has seen P. C registers P's pid; P exits right after the lookup has seen it,
# and root's process gets P's pid before the sidecar opens a pidfd for "the caller".
ROW_5_TCP = r"""
    import pwd
    from tests.security.rig import OpenSidecar as Sidecar
    from tests.support.unpriv import UNPRIV_PYTHON, world_dir
    ATTACK = CLIENT + '''
    import resource
    s = socket.create_connection(("127.0.0.1", int(os.environ["PORT"])))
    r, w = os.pipe()
    p = os.fork()
    if p == 0:                              # P: holds the connection until told to go
        os.read(r, 1)
        os._exit(0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if os.fork() == 0:                      # helpers after P, 30 of them with ~20,000 descriptors each
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 1)
        s.close()
        try:
            for _ in range(hard - 64):
                os.dup(null)
        except OSError:
            pass
        for _ in range(29):
            if os.fork() == 0:
                break
        time.sleep(600)
        os._exit(0)
    time.sleep(1.5)
    body = json.dumps(registration(p, "reuse", world_size=1)).encode()
    s.sendall(b"POST /v1/register HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
              b"Content-Length: %d\\r\\n\\r\\n%s" % (len(body), body))
    time.sleep(0.3)                         # the lookup has seen P by now, and goes on scanning
    os.write(w, b"x")
    os.waitpid(p, 0)
    print(p, flush=True)
    sys.stdin.readline()                    # P's pid now belongs to a root process
    s.settimeout(60)
    raw = b""
    while b"\\r\\n\\r\\n" not in raw:
        raw += s.recv(65536)
    head, _, rest = raw.partition(b"\\r\\n\\r\\n")
    length = int([l for l in head.split(b"\\r\\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
    while len(rest) < length:
        rest += s.recv(65536)
    report(reply=[int(head.split()[1]), json.loads(rest)])
    '''
    user = pwd.getpwnam(os.environ["ATTACKER"])
    with Sidecar(world_dir(), *os.environ["SETTINGS"].split()) as sc:
        attacker = subprocess.Popen([UNPRIV_PYTHON, "-c", ATTACK], user=user.pw_uid, group=user.pw_gid,
                                    extra_groups=[], env={"PORT": str(sc.port), "PATH": "/usr/bin:/bin"},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    start_new_session=True)
        gone = int(attacker.stdout.readline())
        victim = process_with_pid(gone, ["sleep", "600"])
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        out = attacker.stdout.readline()
        time.sleep(6)                       # past the start-up timeout of a rank registered then
        log = open(sc.log).read()
        report(attack=json.loads(out.split("RESULT ", 1)[1]), victim_pid=victim.pid,
               victim_alive=victim.poll() is None,
               as_root=[l for l in log.splitlines() if f"pid {victim.pid} uid 0" in l])
        victim.kill()
"""


def test_row5_a_tcp_caller_whose_pid_was_reused_by_root_is_not_taken_for_root():
    """Round 2, row 5: the TCP client is looked up by its socket, then a pidfd is opened for the
    pid found. A client that exited in between, its pid reused by root, used to be registered as
    uid 0 and its "hang" killed root's process. The sidecar now checks, with the pidfd open,
    that the process still holds the connection's socket."""
    mallory = unprivileged_user("mallory")
    out = in_new_pid_namespace(ROW_5_TCP, {"ATTACKER": mallory.name, "SETTINGS": " ".join(OPEN_SOCKET + NS_SETTINGS)})
    assert out["victim_alive"], out
    assert out["as_root"] == [], out["as_root"]


def test_a_process_that_does_not_hold_the_tcp_connection_is_not_taken_for_its_caller(spawn):
    """The check that closes round 2's row 5, on its own: the lookup finds the socket's holder
    (and the socket's inode); once a pidfd is open, a process that does not hold that socket,
    whatever its pid, is refused."""
    import os
    import socket

    import pytest

    from sidecar.host import identity, procs

    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            found = procs.tcp_peer(accepted.getpeername(), accepted.getsockname())
            assert found == (os.getpid(), os.fstat(client.fileno()).st_ino)
            peer = identity.process_peer(*found)
            assert peer is not None and peer.pid == os.getpid()
            with pytest.raises(identity.IdentityError, match="does not hold the connection"):
                identity.process_peer(spawn().pid, found[1])
