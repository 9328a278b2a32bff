"""Round 2, row 12: text a rank controls never reaches a terminal raw.

A rank writes its own stack-dump file and reports its own exceptions; root reads incidents with
`sidecar incidents --full` in a terminal and tails the log. Escape sequences in that text used
to arrive intact: an OSC 52 clipboard write, a screen clear, a carriage return that overwrote a
line with a fake "evidence: none". Now every line the sidecar prints or writes for people goes
through one escaping function (sidecar/safetext.py).

Issue 28, rows 8 and 9: the job view's text. A job's coordinator is a host its owner names (she
may run a stand-in), and a rank on the coordinator's own node reaches the verdict and the story
in-process, past the wire's checks: root's `sidecar status` (every output) and `sidecar
incidents` (every mode) print what they say escaped, and the log too. Row 7's second half:
`/v1/status`, every local user's to read, carries no culprit's stack frame.
"""

from __future__ import annotations

import json
import subprocess

from tests.security.rig import attack, open_sidecar, start_as
from tests.support import PYTHON, kill_tree, wait_until
from tests.support.unpriv import unprivileged_user

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


# ---------------------------------------------------------------- issue 28, rows 8 and 9: the job view's text

# What a peer or a rank may write into the job view's text: an OSC 52 clipboard write, a screen
# clear and a cursor home (7-bit, with ESC), a carriage return that fakes a line, the same screen
# clear as one 8-bit CSI (U+009B: C1, which the wire's checks let through), a right-to-left
# override and a first-strong isolate (bidi: they reorder what a reader sees).
ESCAPES = "\x1b]52;c;ZXZpbA==\x07\x1b[2J\x1b[H\r  evidence: none\x9b2J\u202e\u2068"
C1_AND_BIDI = "\x9b2J\u202e\u2068"  # the wire refuses C0 in a verdict's names, not these
JOB_VIEW = (
    "node_name=n1",
    "hooks_flush_interval_seconds=0.5",
    "watchdog.check_interval_seconds=0.25",
    "watchdog.floor_seconds=3",
    "remediation.dump_wait_seconds=0.5",
    "remediation.grace_seconds=1",
    "job_view.verdict_wait_seconds=1",
    "job_view.report_interval_seconds=1",
)


def raw_controls(text: str) -> list[str]:
    """The characters of `text` no terminal may receive raw: ESC (and every other C0 control but
    the line feed), DEL, C1, the bidi embeddings, overrides and isolates."""
    return sorted(
        {
            f"U+{ord(ch):04X}"
            for ch in text
            if (ord(ch) < 0x20 and ch != "\n") or 0x7F <= ord(ch) <= 0x9F or "\u202a" <= ch <= "\u202e"
            or "\u2066" <= ch <= "\u2069"
        }
    )  # fmt: skip


def cli(*argv: str, tty: bool = False) -> subprocess.CompletedProcess:
    """`sidecar ARGV` as root (this test), stdout a pipe, or with `tty` a terminal (TERM=dumb:
    rich writes no escape sequence of its own, so any in the output came from the data)."""
    import os
    import pty

    command = [PYTHON, "-m", "sidecar", *argv]
    if not tty:
        return subprocess.run(command, capture_output=True, text=True, timeout=60)
    leader, follower = pty.openpty()
    env = dict(os.environ, TERM="dumb", COLUMNS="400", LINES="200")
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(command, stdout=follower, stderr=subprocess.PIPE, env=env)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the command closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    _, err = proc.communicate(timeout=60)
    # the terminal turns each line feed into CR LF: that carriage return is the terminal's
    text = out.decode(errors="replace").replace("\r\n", "\n")
    return subprocess.CompletedProcess(command, proc.returncode, text, err.decode(errors="replace"))


def assert_escaped(out: subprocess.CompletedProcess, where: str) -> None:
    for name, text in (("stdout", out.stdout), ("stderr", out.stderr)):
        assert not raw_controls(text), f"{where} wrote {raw_controls(text)} raw to {name}:\n{text!r}"
    assert not [line for line in out.stdout.splitlines() if line.strip() == "evidence: none"], f"{where}: a faked line"


# Mallory's own coordinator: every answer a verdict whose names carry C1 and bidi controls (the
# wire refuses C0 there), and a story, which nothing parses, full of escape sequences.
def lying_coordinator(port: int) -> str:
    import json
    import time

    verdict = {
        "job_id": "evil", "job_incident": f"lie{C1_AND_BIDI}-1", "version": 7, "opened": time.time(),
        "culprit": {"rank": 0, "node": "n1", "step": 3, "phase": f"fwd{C1_AND_BIDI}",
                    "stack_top": f"wait{C1_AND_BIDI} (x.py:1)", "reason": f"a lie{C1_AND_BIDI}",
                    "kind": "rank_spinning", "evidence": "stacks"},
        "nodes": 2, "dumped": 2, "lost_nodes": [f"m{C1_AND_BIDI}2"], "not_dumped": [],
    }  # fmt: skip
    story = {
        "verdict": {**verdict, "job_id": f"evil{ESCAPES}", "culprit": {**verdict["culprit"], "stack_top": ESCAPES,
                    "node": f"n1{ESCAPES}", "collective": {"pg": ESCAPES, "ops": {ESCAPES: [0]}, "nodes": [ESCAPES]}}},
        "nodes": {f"m1{ESCAPES}": {"part": {"incident": ESCAPES, "outcome": ESCAPES},
                                   "ranks": [{"rank": 1, "state": ESCAPES, "step": 3, "waiting": True,
                                              "stack_top": ESCAPES, "collectives": ESCAPES}]}},
        "timeline": [{"time": time.time(), "node": ESCAPES, "event": ESCAPES}],
    }  # fmt: skip
    return f"""
        import hashlib, hmac, http.server, threading
        VERDICT, STORY = json.loads({json.dumps(verdict)!r}), json.loads({json.dumps(story)!r})
        KEY = "ab" * 32  # her job's key, her choice: her sidecar signs its reports with it
        class Liar(http.server.BaseHTTPRequestHandler):
            def answer(self, payload):
                body = json.dumps(payload).encode()
                nonce = self.headers.get("X-Sidecar-Peer", "::").split(":")[1]
                digest = hashlib.sha256(body).hexdigest().encode()
                signed = hmac.new(KEY.encode(), b"\\n".join([b"reply", nonce.encode(), digest]), hashlib.sha256)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Sidecar-Peer-Reply", signed.hexdigest())
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.answer({{"ok": True, "verdict": VERDICT}})
            def do_GET(self):
                if "/story" in self.path:
                    self.answer({{"ok": True, "story": STORY}})
                else:
                    self.answer({{"ok": True, "verdict": VERDICT}})
            def log_message(self, *a):
                pass
        server = http.server.ThreadingHTTPServer(("127.0.0.1", {port}), Liar)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        rank = sleeper()
        status, body = request("/v1/register", registration(rank.pid, "evil", world_size=2))
        assert status == 200, body
        items = [{{"type": "step", "step": s}} for s in (1, 2, 3)]
        items.append({{"type": "event", "name": "job_coordinator",
                       "fields": {{"url": "http://127.0.0.1:{port}", "node": "m1", "key": KEY}}}})
        status, body = request("/v1/push", {{"job_id": "evil", "rank": 0, "pid": rank.pid, "items": items}})
        assert status == 200, body
        report(pid=rank.pid)
        time.sleep(600)
    """


def test_row8_a_coordinator_she_runs_reaches_roots_status_incidents_and_log_only_escaped():
    """Mallory points her own job at a coordinator she runs. Its verdict (C1 and bidi in the job
    incident, the culprit's phase, frame and reason, a lost node) lands in this node's job view
    and, once her rank stalls, in its incident; its story (anything at all) is what root's
    `sidecar incidents --job` prints. Every command root runs, and the log, show it escaped."""
    from tests.support import free_port

    mallory = unprivileged_user("mallory")
    with open_sidecar(*JOB_VIEW) as sidecar:
        rank, info = start_as(mallory, sidecar, lying_coordinator(free_port()))
        try:
            wait_until(
                lambda: any(i["job_id"] == "evil" and i["outcome"] != "pending" for i in sidecar.status()["incidents"]),
                60,
                what="her stalled job's incident, with the lying verdict adopted",
            )
            assert sidecar.status()["jobs"]["evil"]["verdict"]["job_incident"] == f"lie{C1_AND_BIDI}-1"
            socket = ("--socket", sidecar.socket)
            for argv, tty in (
                (("status", *socket), False),
                (("status", *socket), True),
                (("status", "--json", *socket), False),
                (("status", "--check", "node", *socket), False),
                (("incidents", *socket), False),
                (("incidents", "--full", *socket), False),
                (("incidents", "--job", "evil", *socket), False),
                (("incidents", "--job", "evil", *socket), True),
                (("incidents", "--job", "evil", "--json", *socket), False),
            ):
                out = cli(*argv, tty=tty)
                where = "sidecar " + " ".join(a for a in argv if a != sidecar.socket) + (" (a terminal)" if tty else "")
                assert out.returncode in (0, 1), f"{where}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
                assert_escaped(out, where)
                if argv[:2] == ("status", "--socket"):
                    assert "lie\\x9b2J\\u202e\\u2068-1" in out.stdout, f"{where}:\n{out.stdout}"  # visible, escaped
                if argv[:3] == ("incidents", "--job", "evil") and "--json" not in argv:
                    assert "\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J" in out.stdout, f"{where}:\n{out.stdout}"
            log = sidecar.log.read_text(errors="replace")
            assert not raw_controls(log), f"the log holds {raw_controls(log)} raw"
        finally:
            kill_tree(rank)


# Row 9: mallory's own rank, on the node that coordinates its job (the in-process path: its
# report reaches the coordinator without the wire's checks), writes escapes into its own frame.
DUMP_FRAME_WITH_ESCAPES = f"""
    import signal
    job = "ansi-job"
    status, body = request("/v1/register", registration(os.getpid(), job, world_size=2, stack_dump={{"signal": 10}}))
    assert status == 200, body
    path, offer = body["stack_dump"]["path"], body["job_view"]
    evil = {ESCAPES!r}
    def on_dump(*_):
        with open(path, "a") as f:
            f.write("Current thread 0x1 (most recent call first):\\n"
                    f'  File "/home/m/ab{{evil}}cd/train_secret_frame.py", line 42 in secret_frame_fn{{evil}}\\n')
    signal.signal(10, on_dump)
    items = [{{"type": "step", "step": s}} for s in (1, 2, 3)]
    items.append({{"type": "event", "name": "job_coordinator", "fields": offer}})  # url, node, the job's key
    status, body = request("/v1/push", {{"job_id": job, "rank": 0, "pid": os.getpid(), "items": items}})
    assert status == 200, body
    report(registered=200)
    time.sleep(600)
"""


def test_row9_escapes_in_her_own_dump_reach_root_escaped_on_the_coordinator_node_and_no_other_user():
    """Mallory's stalled rank's innermost frame carries escape sequences; its node is the job's
    coordinator, so the frame reaches the verdict and the story unchecked. Root's commands print
    it escaped (`sidecar incidents --job` shows the frame, `sidecar status` names the culprit
    and points there); `/v1/status`, which every local user reads, carries no frame at all
    (row 7: alice, another user, must not read mallory's innermost frame)."""
    mallory, alice = unprivileged_user("mallory"), unprivileged_user("alice")
    with open_sidecar(*JOB_VIEW) as sidecar:
        rank, out = start_as(mallory, sidecar, DUMP_FRAME_WITH_ESCAPES)
        try:
            assert out["registered"] == 200, out
            socket = ("--socket", sidecar.socket)

            def story() -> str:
                shown = cli("incidents", "--job", "ansi-job", *socket)
                return shown.stdout if "secret_frame_fn" in shown.stdout else ""

            wait_until(story, 60, interval=0.5, what="the story naming her frame")
            for argv, tty in (
                (("incidents", "--job", "ansi-job", *socket), False),
                (("incidents", "--job", "ansi-job", *socket), True),
                (("status", *socket), False),
                (("status", *socket), True),
                (("incidents", "--full", *socket), False),
            ):
                shown = cli(*argv, tty=tty)
                where = "sidecar " + " ".join(a for a in argv if a != sidecar.socket) + (" (a terminal)" if tty else "")
                assert shown.returncode in (0, 1), f"{where}: exit {shown.returncode}\n{shown.stdout}\n{shown.stderr}"
                assert_escaped(shown, where)
                if argv[0] == "incidents" and "--job" in argv:
                    assert "secret_frame_fn\\x1b]52;c;ZXZpbA==\\x07" in shown.stdout, f"{where}:\n{shown.stdout}"
                if argv[0] == "status":  # the culprit, no frame; where root finds the frame
                    assert "rank 0 on n1" in shown.stdout and "secret_frame" not in shown.stdout, shown.stdout
                    assert "sidecar incidents --job ansi-job" in shown.stdout, shown.stdout
            # Any local user reads /v1/status (the socket, loopback TCP): the job's culprit, never its frame.
            seen = attack(alice, sidecar, 'report(status=request("/v1/status", None, method="GET"))')["status"]
            assert seen[0] == 200, seen
            job = seen[1]["jobs"]["ansi-job"]
            assert job["verdict"]["culprit"]["rank"] == 0 and job["verdict"]["culprit"]["node"] == "n1", job
            for doc, who in ((seen[1], "alice over the socket"), (sidecar.status(), "loopback TCP")):
                assert "secret_frame" not in json.dumps(doc), f"{who} reads the frame in /v1/status"
        finally:
            kill_tree(rank)


# ---------------------------------------------------------------- the same, function by function (no root needed)


def hostile_status() -> dict:
    """A /v1/status document with ESCAPES in every string a rank, a peer or the node could set."""
    e = ESCAPES
    return {
        "version": f"0.1{e}", "health": "degraded", "problems": [f"rank j{e}/0 stalled"],
        "node": {"name": f"n1{e}", "kernel": f"k{e}", "os": f"o{e}", "checkpoint_dir": f"/c{e}"},
        "ranks": [{"job_id": f"j{e}", "rank": 0, "state": "stalled", "phase": f"p{e}", "exit_reason": f"x{e}"}],
        "jobs": {f"j{e}": {"coordinator": f"c{e}", "reachable": True, "verdict": {
            "job_incident": f"i{e}", "culprit": {"rank": 0, "node": f"n{e}", "step": 3, "kind": f"k{e}"}}}},
        "collectors": {f"c{e}": {"success": False, "error": f"e{e}"}},
        "incidents": [{"time": 0, "job_id": f"j{e}", "blamed_rank": 0, "summary": f"s{e}", "path": f"/p{e}"}],
        "fitness": {"fit": False, "reasons": [f"r{e}"], "findings": [{"reason": f"r{e}", "text": f"t{e}"}]},
        "exits": {"last": {"job_id": f"j{e}", "rank": 0, "reason": f"x{e}", "time": 0}},
        "gpus": [{"gpu": "0", "name": f"g{e}", "clock_events": [f"c{e}"]}],
        "nics": [{"device": f"d{e}", "up": True}],
        "infiniband": [{"device": f"m{e}", "port": f"1{e}", "state": f"s{e}", "up": False}],
        "watchdog": {"observe_only": False, "shadow": {f"w{e}": {
            "observe_only": True, "would_kill": 1, "false_alarms": 1, "floor_killing_none_seconds": 7.5,
            "phases": {f"q{e}": {"false_alarms": 1, "longest_pause_seconds": 7.25}},
            "learned_budgets_seconds": {f"l{e}": 10.9}}}},
    }  # fmt: skip


def test_sidecar_status_escapes_every_field_in_the_table_the_terminal_and_the_node_check():
    import io

    from rich.console import Console

    from sidecar.commands.client import Endpoint
    from sidecar.commands.status import Reading, build_screen, node_check, render_plain, render_rich
    from sidecar.commands.verdict import assess

    doc = hostile_status()
    screen = build_screen(doc)
    plain = render_plain(screen)
    terminal = Console(file=io.StringIO(), width=400, color_system=None, force_terminal=False)
    terminal.print(render_rich(screen))
    _, check = node_check(Reading(Endpoint(socket="/x"), doc, verdict=assess(doc)))
    _, unknown = node_check(Reading(Endpoint(socket="/x"), error=f"no sidecar{ESCAPES}"))
    for where, text in (
        ("the table", plain),
        ("the terminal", terminal.file.getvalue()),
        ("--check node", check),
        ("--check node, unknown", unknown),
    ):
        assert not raw_controls(text), f"{where}: {raw_controls(text)} raw in\n{text!r}"
        assert "\\x1b]52;c;ZXZpbA==\\x07" in text, f"{where}: the text is not there, escaped:\n{text}"
    for field in ("n1", "j", "p", "x", "c", "i", "e", "s", "/p", "g", "d", "r", "t", "w", "q", "l"):  # each, escaped
        assert f"{field}\\x1b]52;c;ZXZpbA==" in plain, field
    assert "rank 0 on n\\x1b]52" in plain and "sidecar incidents --job j\\x1b]52" in plain, plain


def test_a_story_of_any_shape_prints_escaped_and_never_stops_the_command():
    """The story is what the job's coordinator answered (a host the job's owner may run): each
    field may be missing, of another type, or full of escapes."""
    from sidecar.commands.incidents import render_story

    e = ESCAPES
    stories: list[dict] = [
        {"verdict": e, "nodes": [e], "timeline": e},
        {"verdict": {"opened": e, "culprit": {"collective": {"ops": [e], "nodes": e, "late": e}}, "lost_nodes": e},
         "nodes": {e: e}, "timeline": [e, {"time": e}]},
        {"verdict": {"opened": 1e300, "culprit": e, "lost_nodes": [e, 1]},
         "nodes": {e: {"part": e, "ranks": e}, "b": {"part": {"outcome": [e]}, "ranks": [e, {"waiting": e}]}},
         "timeline": [{"time": 1e300, "node": [e], "event": {e: e}}]},
        {"verdict": {"job_incident": e, "culprit": {"rank": e, "node": e, "stack_top": e, "reason": e,
                     "collective": {"ops": {e: [e]}, "op": e, "pg": e, "late": [e]}}},
         "nodes": {e: {"part": {"incident": e, "outcome": e}, "ranks": [{"stack_top": e, "collectives": e,
                                                                          "waiting": True}]}},
         "timeline": [{"time": 0, "node": e, "event": e}]},
    ]  # fmt: skip
    for story in stories:
        shown = render_story(story, [{"id": e, "summary": e}], e)
        assert not raw_controls(shown), f"{raw_controls(shown)} raw in\n{shown!r}"
        assert "\\x1b]52;c;ZXZpbA==" in shown, shown
    assert not raw_controls(render_story(None, [], f"unreachable{e}"))


def test_status_document_carries_no_stack_frame_of_a_verdicts_culprit():
    """Row 7: `/v1/status` is every local user's to read; the culprit's frame is root's
    (`sidecar incidents --job`). Rank, node, step and kind stay."""
    from sidecar.daemon.status_document import jobs_section

    class Reporter:
        def status(self) -> dict:
            culprit = {"rank": 1, "node": "n2", "step": 7, "kind": "rank_late", "stack_top": "secret (a.py:1)"}
            return {"j": {"coordinator": "n1", "verdict": {"job_incident": "i", "culprit": culprit}},
                    "k": {"coordinator": "n1", "verdict": None}}  # fmt: skip

    jobs = jobs_section(Reporter())
    assert "secret" not in json.dumps(jobs)
    assert jobs["j"]["verdict"]["culprit"] == {"rank": 1, "node": "n2", "step": 7, "kind": "rank_late"}
    assert jobs["k"]["verdict"] is None and jobs_section(None) == {}
