"""Round 2, row 8, and the lost SIGTERM: starting and stopping the daemon while a local user is
in the way.

Row 8: while the sidecar was down (a crash, an upgrade, a boot), a user bound its loopback TCP
port; every restart failed at once with "address already in use" while the squatter answered the
hooks. Now the start retries for `listen_retry_seconds`, logging who holds the port, takes it when
the squatter leaves, and fails loudly (status 1, the holder named) when it does not.

"One SIGTERM seemed lost": a stop waited for every request in flight (aiohttp's default is 60 s),
and a user holding a request half sent kept it for the idle timeout. The stop now gives requests
STOP_SECONDS, and the signal handler runs whatever the event loop is doing.
"""

from __future__ import annotations

import signal
import subprocess
import time

from tests.security.rig import open_sidecar, start_as
from tests.support import kill_tree, wait_until
from tests.support.unpriv import unprivileged_user

SQUAT = """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", {port}))
    s.listen(16)
    report(pid=os.getpid())
    time.sleep({hold})
    s.close()
    time.sleep(600)
"""


def test_row8_the_sidecar_takes_its_port_once_a_squatter_leaves():
    mallory = unprivileged_user("mallory")
    sidecar = open_sidecar("listen_retry_seconds=30")  # not started: its port is free for the squatter
    squatter, _ = start_as(mallory, sidecar, SQUAT.format(port=sidecar.port, hold=3))
    try:
        sidecar.start(timeout=60)
        log = sidecar.log.read_text()
        assert "retrying" in log and f"(uid {mallory.uid}, python3)" in log, log
    finally:
        sidecar.__exit__(None, None, None)
        kill_tree(squatter)


def test_row8_a_squatter_that_stays_makes_the_start_fail_loudly():
    mallory = unprivileged_user("mallory")
    sidecar = open_sidecar("listen_retry_seconds=2")
    squatter, info = start_as(mallory, sidecar, SQUAT.format(port=sidecar.port, hold=600))
    try:
        out = subprocess.run(sidecar.command(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith(f"sidecar: cannot listen on 127.0.0.1:{sidecar.port}: "), last
        assert "address already in use" in last.lower(), last
        assert f"held by pid {info['pid']} (uid {mallory.uid}, python3)" in out.stderr, out.stderr
    finally:
        sidecar.__exit__(None, None, None)
        kill_tree(squatter)


# A request whose body never comes: headers announce 100 bytes, 10 arrive.
HALF_SENT = """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(SOCK)
    s.sendall(b"POST /v1/push HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
              b"Content-Length: 100\\r\\n\\r\\n{{\\"job_id\\":")
    report(held=True)
    time.sleep(600)
"""


def test_sigterm_stops_the_daemon_promptly_while_a_user_holds_a_request_half_sent():
    mallory = unprivileged_user("mallory")
    with open_sidecar() as sidecar:
        holder, _ = start_as(mallory, sidecar, HALF_SENT.replace("{{", "{").replace("}}", "}"))
        try:
            time.sleep(0.5)  # the request is in its handler, waiting for the body
            start = time.monotonic()
            sidecar.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: sidecar.proc.poll() is not None, 60, what="the sidecar stopped")
            took = time.monotonic() - start
            print(f"stopped {took:.1f} s after SIGTERM")
            assert took < 8, f"the stop took {took:.1f} s"
            assert sidecar.proc.returncode == 0
        finally:
            kill_tree(holder)
