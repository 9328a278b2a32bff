"""Round 2, row 12: text a rank controls never reaches a terminal raw.

A rank writes its own stack-dump file and reports its own exceptions; root reads incidents with
`sidecar incidents --full` in a terminal and tails the log. Escape sequences in that text used
to arrive intact: an OSC 52 clipboard write, a screen clear, a carriage return that overwrote a
line with a fake "evidence: none". Now every line the sidecar prints or writes for people goes
through one escaping function (sidecar/safetext.py).
"""

from __future__ import annotations

import subprocess

from tests.security.rig import attack, open_sidecar, start_as
from tests.support import PYTHON, kill_tree, wait_until
from tests.unpriv import unprivileged_user

STALLS = (
    "watchdog.startup_timeout_seconds=2",
    "watchdog.floor_seconds=3",
    "hooks_flush_interval_seconds=0.5",
    "watchdog.check_interval_seconds=0.25",
    "remediation.dump_wait_seconds=1",
    "remediation.grace_seconds=1",
)

EVIL = '"\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\x1b[H\\r  evidence: none\\u202e"'
RAW = ("\x1b", "\x07", "\r", "\u202e")

# Row 12 as done: the rank's own dump file, written from its dump-signal handler, then it hangs.
DUMP_WITH_ESCAPES = f"""
    import signal
    status, body = request("/v1/register", registration(os.getpid(), "ansi", world_size=1,
                                                        stack_dump={{"signal": 10}}))
    path = body["stack_dump"]["path"]
    def on_dump(*_):
        with open(path, "a") as f:
            f.write("Current thread 0x1 (most recent call first):\\n  " + {EVIL} + "\\n")
    signal.signal(10, on_dump)
    report(registered=status)
    time.sleep(600)
"""

# The same in a report: an exception that ended one of its threads, then the rank dies.
THREAD_EXCEPTION_WITH_ESCAPES = f"""
    status, body = request("/v1/register", registration(os.getpid(), "ansi-exit", world_size=1))
    fields = {{"type": {EVIL}, "message": "boom\\n  evidence: none"}}
    request("/v1/push", {{"job_id": "ansi-exit", "rank": 0, "pid": os.getpid(),
                         "items": [{{"type": "event", "name": "thread_exception", "fields": fields}}]}})
    report(registered=status)
    sys.exit(3)
"""


def incidents_full(sidecar) -> str:
    out = subprocess.run(
        [PYTHON, "-m", "sidecar", "incidents", "--full", "--diag-dir", str(sidecar.workdir / "diag")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def assert_printable(text: str, where: str) -> None:
    for raw in RAW:
        assert raw not in text, f"{where} holds {raw!r} raw"
    assert not [line for line in text.splitlines() if line.strip() == "evidence: none"], f"{where}: a faked line"


def test_row12_a_dump_file_full_of_escape_sequences_is_printed_escaped():
    mallory = unprivileged_user("mallory")
    with open_sidecar(*STALLS) as sidecar:
        rank, out = start_as(mallory, sidecar, DUMP_WITH_ESCAPES)
        try:
            assert out["registered"] == 200, out
            wait_until(lambda: rank.poll() is not None, 60, what="the hung rank remediated")
            wait_until(
                lambda: any(i["outcome"] == "killed" for i in sidecar.status()["incidents"]),
                30,
                what="the incident",
            )
            shown = incidents_full(sidecar)
            assert "\\x1b]52;c;" in shown, shown  # the dump is there, escaped
            assert_printable(shown, "sidecar incidents --full")
            (summary,) = (sidecar.workdir / "diag" / "incidents").glob("*ansi.txt")
            assert_printable(summary.read_text(), "the incident summary")
        finally:
            kill_tree(rank)


def test_row12_an_exception_report_full_of_escape_sequences_is_logged_and_recorded_escaped():
    mallory = unprivileged_user("mallory")
    with open_sidecar() as sidecar:
        out = attack(mallory, sidecar, THREAD_EXCEPTION_WITH_ESCAPES)
        assert out["registered"] == 200, out
        wait_until(
            lambda: any(i["job_id"] == "ansi-exit" for i in sidecar.status()["incidents"]),
            30,
            what="the exit incident",
        )
        shown = incidents_full(sidecar)
        assert "a thread of the rank died earlier of" in shown and "\\x1b[2J" in shown, shown
        assert_printable(shown, "sidecar incidents --full")
        log = sidecar.log.read_text(errors="replace")
        assert "a thread of the rank died earlier of" in log
        assert_printable(log, "the sidecar's log")
