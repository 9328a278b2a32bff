"""Protocol 5: a rank's collective record (`collectives`) and its whole Flight Recorder dump
(`fr_dump`) as an attacker's input (docs/security.md, "Collective records and Flight Recorder
dumps").

A push may now carry the rank's Flight Recorder summary, which the watchdog and the job view judge
(a culprit, or `collective_stuck`/`collective_mismatch`, on which every node of the job kills its
own ranks of that job), and a whole dump that root writes into the incident directory as pickles
an operator loads with `fr_trace`. Each attack runs as a throw-away unprivileged user against a
real sidecar:

1. oversized or malformed records and dumps are refused (4xx naming the field), nothing is kept,
   the sidecar serves on and does not grow;
2. the dump pickles root writes hold plain values only, belong to root, are not writable by
   others, and no user can plant anything where they are written;
3. another user's job: no push for it, no forged record signals its processes, and a record
   that comes from one's own job never leads to a signal outside it; a forged peer report cannot
   keep a real hang from being remediated;
4. op and process-group names cannot reach a terminal raw (refused, or escaped where printed).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import pickletools
import secrets
import subprocess
import time
import unicodedata
from pathlib import Path
from textwrap import dedent

import psutil
import pytest

from sidecar.safetext import printable, unsafe
from tests.security.rig import CLIENT, LoopProbe, attack, next_result, open_sidecar, ranks_of, result_of, start_as
from tests.support import PYTHON, Sidecar, http_get, kill_tree, wait_until
from tests.support.unpriv import UNPRIV_PYTHON, User, run_as, run_as_sync, unprivileged_user

STALLS = (
    "node_name=n1",
    "watchdog.startup_timeout_seconds=2",
    "watchdog.floor_seconds=3",
    "hooks_flush_interval_seconds=0.5",
    "watchdog.check_interval_seconds=0.25",
    "remediation.dump_wait_seconds=0.5",
    "remediation.grace_seconds=1",
    "job_view.verdict_wait_seconds=1",
    "job_view.report_interval_seconds=1",
    "job_view.lost_after_seconds=5",
    "job_view.launcher_grace_seconds=6",
)


# ---------------------------------------------------------------- users that go with the test


def _processes_of(uid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if p.info["uids"].real == uid:
                out.append(p)
    return out


def _remove_user(user: User) -> None:
    """Kill what the test left running as `user` (a uid made for this test alone: every process
    of it is one the test started), then delete the user and its group."""
    leftovers = _processes_of(user.uid)
    for p in leftovers:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(leftovers, timeout=10)
    subprocess.run(["userdel", user.name], capture_output=True, check=False)


@pytest.fixture
def users():
    """Two fresh unprivileged users (alice, the victim; mallory, the attacker), removed with
    everything they still run when the test ends, passed or failed."""
    tag = secrets.token_hex(3)
    made: list[User] = []
    try:
        made.append(unprivileged_user(f"cra{tag}"))
        made.append(unprivileged_user(f"crm{tag}"))
        yield made[0], made[1]
    finally:
        for user in made:
            _remove_user(user)


# ---------------------------------------------------------------- what the attacks send

# A sender of protocol 5 as a script of the attacker's: N ranks (its own sleeping children) of one
# job register and step to 3, then stop stepping. Like the hooks' thread, each rank keeps pushing
# (no items) with its collective record, RECORD(i), and answers the sidecar's `want` with its whole
# dump, DUMP(i); both functions come before this code (None: nothing of that kind). It reports once
# every rank sent its dump or had its record refused (`refused`: those answers). COORDINATE:
# rank 0 names this node's sidecar as the job's coordinator, as rank 0's hooks do.
STALLING_JOB = """
    job, n = os.environ["JOB"], int(os.environ.get("RANKS", "2"))
    ranks = [sleeper() for _ in range(n)]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(60)
    conn.connect(SOCK)
    offer = None
    for i, r in enumerate(ranks):
        status, body = request("/v1/register", registration(r.pid, job, rank=i, world_size=n), sock=conn)
        assert status == 200, body
        offer = offer or body.get("job_view")
        items = [{"type": "step", "step": s} for s in (1, 2, 3)]
        if i == 0 and os.environ.get("COORDINATE"):
            items.append({"type": "event", "name": "job_coordinator",
                          "fields": {"url": offer["url"], "node": offer["node"]}})
        status, body = request("/v1/push", {"job_id": job, "rank": i, "pid": r.pid, "items": items}, sock=conn)
        assert status == 200, body
    answers, dumped = {}, set()
    def push(i, with_dump):
        body = {"job_id": job, "rank": i, "pid": ranks[i].pid, "items": []}
        record = RECORD(i)
        if record is not None:
            body["collectives"] = record
        if with_dump and DUMP(i) is not None:
            body["fr_dump"] = DUMP(i)
        return request("/v1/push", body, sock=conn)
    reported, refused, gone = False, {}, set()
    while True:
        for i in range(n):
            status, body = push(i, False)
            if status == 409:  # unknown: killed and forgotten before a round reached it (a loaded machine)
                gone.add(i)
            elif status != 200:  # its record refused: a rank that cannot answer
                refused.setdefault(i, [status, body])
            elif isinstance(body, dict) and "fr_dump" in body.get("want", []) and i not in dumped:
                dumped.add(i)
                answers[i] = push(i, True)
        if len(dumped | set(refused) | gone) == n and not reported:
            report(pids=[r.pid for r in ranks], answers=answers, refused=refused, gone=sorted(gone - dumped))
            reported = True
        time.sleep(float(os.environ.get("ROUND_SECONDS", "0.2")))
"""


def start_stalling_job(
    user: User, sidecar: Sidecar, job: str, functions: str, ranks: int = 2, timeout: float = 60, **env: str
):
    """STALLING_JOB as `user`: (its process, what it reported once every rank sent its dump)."""
    setup = f"os.environ.update({{'JOB': {job!r}, 'RANKS': {str(ranks)!r}, **{env!r}}})\n"
    return start_as(user, sidecar, setup + dedent(functions) + dedent(STALLING_JOB), timeout=timeout)


# A record of one process group (default_pg, members 0..n-1): every rank entered collective #7
# (OP(i), ten seconds ago) and completed #6. OP the same for all: a stuck collective; different:
# a desync (collective_mismatch).
RECORD_IN_7 = """
    def RECORD(i):
        now = time.time()
        return {"time": now, "groups": [{"pg": "0", "desc": "default_pg", "size": n, "ranks": list(range(n)),
                "enqueued": 7, "started": 7, "completed": 6,
                "pending": [{"seq": 7, "op": OP(i), "sizes": [[1000]], "created": now - 10, "state": "scheduled"}]}]}
"""


def with_floor(seconds: float) -> tuple[str, ...]:
    return (*(s for s in STALLS if not s.startswith("watchdog.floor_seconds")), f"watchdog.floor_seconds={seconds:g}")


def incident_of(sidecar: Sidecar, job: str, timeout: float = 30) -> dict:
    """The job's incident record (the full `.json`), once its remediation ended; `outcome_now`: the
    outcome `/v1/status` gives (the file's is the same unless writing it failed)."""

    def ended():
        return next(
            (
                i
                for i in sidecar.status()["incidents"]
                if i["job_id"] == job and i["outcome"] not in (None, "", "pending")
            ),
            None,
        )

    brief = wait_until(ended, timeout, interval=0.2, what=f"an ended incident of job {job}")
    record = json.loads(Path(brief["path"]).read_text())
    record["outcome_now"] = brief["outcome"]  # the sidecar's, should the file lag behind
    return record


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def rss(sidecar: Sidecar) -> int:
    return psutil.Process(sidecar.proc.pid).memory_info().rss


def healthz(sidecar: Sidecar) -> int:
    return http_get(sidecar.url + "/healthz", timeout=10)[0]


# ---------------------------------------------------------------- 1. refused whole, nothing kept

# Each push carries a step (4) and one bad field: refused whole (the step included), 4xx naming it.
REFUSED = r"""
    rank = sleeper()
    status, body = request("/v1/register", registration(rank.pid, "bad", world_size=1))
    assert status == 200, body
    assert request("/v1/push", {"job_id": "bad", "rank": 0, "pid": rank.pid,
                                "items": [{"type": "step", "step": s} for s in (1, 2, 3)]})[0] == 200
    now = time.time()
    def group(**kw):
        g = {"pg": "0", "desc": "default_pg", "size": 2, "ranks": [0, 1], "enqueued": 5, "started": 5,
             "completed": 4, "pending": [{"seq": 5, "op": "all_reduce", "sizes": [[1000]], "created": now - 5}]}
        g.update(kw)
        return g
    def entry(**kw):
        e = {"seq": 5, "op": "all_reduce", "sizes": [[1000]], "created": now - 5}
        e.update(kw)
        return e
    def record(*groups, **kw):
        r = {"time": now, "groups": list(groups)}
        r.update(kw)
        return r
    def dump(**kw):
        d = {"version": "2.10", "pg_config": {}, "entries": []}
        d.update(kw)
        return d
    pad = "x" * 1024
    CASES = {
        "too many groups": {"collectives": record(*[group(pg=str(i)) for i in range(17)])},
        "a group named twice": {"collectives": record(group(), group())},
        "65 member ranks": {"collectives": record(group(ranks=list(range(65))))},
        "5 pending": {"collectives": record(group(pending=[entry(seq=i) for i in range(5)]))},
        "5 shapes": {"collectives": record(group(pending=[entry(sizes=[[1]] * 5)]))},
        "9 dimensions": {"collectives": record(group(pending=[entry(sizes=[[1] * 9])]))},
        "a 2**70 dimension": {"collectives": record(group(pending=[entry(sizes=[[2 ** 70]])]))},
        "a negative dimension": {"collectives": record(group(pending=[entry(sizes=[[-1]])]))},
        "nested shapes": {"collectives": record(group(pending=[entry(sizes=[[[[[[[1]]]]]]])]))},
        "a 2**64 sequence": {"collectives": record(group(enqueued=2 ** 64))},
        "a boolean sequence": {"collectives": record(group(completed=True))},
        "an op of 65 characters": {"collectives": record(group(pending=[entry(op="a" * 65)]))},
        "an empty op": {"collectives": record(group(pending=[entry(op="")]))},
        "ESC in an op": {"collectives": record(group(pending=[entry(op="\x1b]52;c;ZXZpbA==\x07")])) },
        "CSI (U+009B) in a pg": {"collectives": record(group(pg="\x9b2J"))},
        "RLO (U+202E) in a desc": {"collectives": record(group(desc="gpj.\u202eexe"))},
        "a newline in a state": {"collectives": record(group(pending=[entry(state="x\n  evidence: none")]))},
        "a record time of 1e300": {"collectives": record(group(), time=1e300)},
        "a record that is a list": {"collectives": [group()]},
        "a 900 KiB fr_dump": {"fr_dump": dump(entries=[{"f": pad * 3} for _ in range(256)],
                                              pg_config={"pad": "y" * (130 * 1024)})},
        "an fr_dump of 257 entries": {"fr_dump": dump(entries=[{} for _ in range(257)])},
        "an fr_dump entry that is a string": {"fr_dump": dump(entries=["cos\nsystem\n(S'id'\ntR."])},
        "an fr_dump that is a string": {"fr_dump": "\x80\x04\x95\x1f\x00cposix\nsystem\n"},
        "an fr_dump whose version is a number": {"fr_dump": dump(version=2.1)},
    }
    replies = {}
    for name, extra in CASES.items():
        body = {"job_id": "bad", "rank": 0, "pid": rank.pid, "items": [{"type": "step", "step": 4}]}
        body.update(extra)
        replies[name] = [request("/v1/push", body), len(json.dumps(body))]
    # Not JSON at all: bare constants and nesting past the parser's depth, in either field.
    base = '{"job_id": "bad", "rank": 0, "pid": %d, "items": [{"type": "step", "step": 4}], ' % rank.pid
    raws = {
        "NaN in a record": base + '"collectives": {"time": NaN, "groups": []}}',
        "Infinity in an fr_dump": base + '"fr_dump": {"version": "x", "entries": [{"t": -Infinity}]}}',
        "100,000 nested arrays in an fr_dump": base + '"fr_dump": {"entries": [{"t": ' + "[" * 100000
                                              + "]" * 100000 + '}]}}',
    }
    for name, text in raws.items():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(SOCK)
        data = text.encode()
        sock.sendall(b"POST /v1/push HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
        head, _, rest = raw.partition(b"\r\n\r\n")
        replies[name] = [[int(head.split()[1]), json.loads(rest)], len(data)]
    report(pid=rank.pid, replies=replies)
    time.sleep(600)
"""

# What each refusal must name (the field, or for what is not JSON at all, what is wrong).
NAMES = {
    "too many groups": "collectives.groups",
    "a group named twice": "collectives.groups",
    "65 member ranks": "collectives.groups[0].ranks",
    "5 pending": "collectives.groups[0].pending",
    "5 shapes": "collectives.groups[0].pending[0].sizes",
    "9 dimensions": "collectives.groups[0].pending[0].sizes[0]",
    "a 2**70 dimension": "collectives.groups[0].pending[0].sizes[0]",
    "a negative dimension": "collectives.groups[0].pending[0].sizes[0]",
    "nested shapes": "collectives.groups[0].pending[0].sizes[0]",
    "a 2**64 sequence": "collectives.groups[0].enqueued",
    "a boolean sequence": "collectives.groups[0].completed",
    "an op of 65 characters": "collectives.groups[0].pending[0].op",
    "an empty op": "collectives.groups[0].pending[0].op",
    "ESC in an op": "collectives.groups[0].pending[0].op",
    "CSI (U+009B) in a pg": "collectives.groups[0].pg",
    "RLO (U+202E) in a desc": "collectives.groups[0].desc",
    "a newline in a state": "collectives.groups[0].pending[0].state",
    "a record time of 1e300": "collectives.time",
    "a record that is a list": "collectives",
    "a 900 KiB fr_dump": "fr_dump",
    "an fr_dump of 257 entries": "fr_dump.entries",
    "an fr_dump entry that is a string": "fr_dump.entries",
    "an fr_dump that is a string": "fr_dump",
    "an fr_dump whose version is a number": "fr_dump",
    "NaN in a record": "NaN",
    "Infinity in an fr_dump": "Infinity",
    "100,000 nested arrays in an fr_dump": "not valid JSON",
}


def test_malformed_records_and_dumps_are_refused_by_name_and_nothing_is_kept(users):
    """Every bad record or dump: 4xx with a JSON error naming the field, the push refused whole
    (its step too), no record kept (no per-group series, no collectives in the incident), no dump
    kept (no `.fr` directory), and the sidecar serving on."""
    _, mallory = users
    with open_sidecar(*STALLS) as sidecar:
        rank, out = start_as(mallory, sidecar, REFUSED, timeout=60)
        try:
            replies = out["replies"]
            assert set(replies) == set(NAMES), sorted(set(replies) ^ set(NAMES))
            for name, ((status, body), size) in replies.items():
                print(f"{name}: {status} {body} ({size} bytes)")
                assert 400 <= status < 500 and isinstance(body, dict), (name, status, body)
                assert NAMES[name] in body["error"], (name, body)
            assert replies["a 900 KiB fr_dump"][1] > 900 * 1024
            assert replies["a 900 KiB fr_dump"][0][0] == 413
            assert healthz(sidecar) == 200
            assert ranks_of(sidecar, "bad")[0]["step"] == 3  # not one of the refused pushes' step 4
            assert 'job_id="bad"' not in "".join(
                line for line in sidecar.metrics().splitlines() if line.startswith("sidecar_rank_collective")
            )
            record = incident_of(sidecar, "bad")
            assert record["fr_dumps"] is None and not list((sidecar.workdir / "diag" / "incidents").glob("*.fr"))
            assert all(not r.get("collectives") for r in record["ranks"]), record["ranks"]
            assert record["evidence"] != "collectives", record
        finally:
            kill_tree(rank)


def start_interactive(user: User, sidecar: Sidecar, code: str) -> subprocess.Popen:
    """`code` (after the rig's CLIENT) as `user`, with a pipe to its stdin: it waits there for the
    test between two stages. The caller stops it (kill_tree)."""
    return run_as(
        user,
        [UNPRIV_PYTHON, "-c", CLIENT + dedent(code)],
        env={"SIDECAR_SOCKET": sidecar.socket},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def go(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


# 150 refused pushes of 450 to 900 KiB each: a 900 KiB dump, nesting past the parser's depth, a
# bare NaN in a record beside 800 KiB of padding, a record past its bounds beside the same.
MANY_REFUSED = r"""
    import re
    rank = sleeper()
    status, body = request("/v1/register", registration(rank.pid, "flood", world_size=1))
    assert status == 200, body
    pad = "p" * (800 * 1024)
    head = '{"job_id": "flood", "rank": 0, "pid": %d, "items": [{"type": "step", "step": 1}], ' % rank.pid
    bodies = [
        head + '"fr_dump": {"version": "2.10", "entries": [], "pad": "' + "z" * (900 * 1024) + '"}}',
        head + '"fr_dump": {"entries": [{"t": ' + "[" * 400000 + "]" * 50000 + "}]}}",
        head + '"pad": "' + pad + '", "collectives": {"time": 1, "groups": [{"pg": "0", "enqueued": NaN}]}}',
        head + '"pad": "' + pad + '", "collectives": {"time": 1, "groups": ['
             + ", ".join('{"pg": "%d"}' % i for i in range(17)) + "]}}",
    ]
    def flood(n):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)
        sock.connect(SOCK)
        codes = {}
        for i in range(n):
            data = bodies[i % len(bodies)].encode()
            sock.sendall(b"POST /v1/push HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            raw = b""
            while b"\r\n\r\n" not in raw:
                raw += sock.recv(65536)
            header, _, rest = raw.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", header).group(1))
            while len(rest) < length:
                rest += sock.recv(65536)
            codes[header.split()[1].decode()] = codes.get(header.split()[1].decode(), 0) + 1
        sock.close()
        return codes
    flood(12)  # the parser's and the allocator's first taste
    report(warm=True)
    sys.stdin.readline()
    codes = flood(150)
    status, body = request("/v1/push", {"job_id": "flood", "rank": 0, "pid": rank.pid,
                                        "items": [{"type": "step", "step": 1}]})
    report(codes=codes, after=[status, body])
    time.sleep(600)
"""


def test_a_flood_of_refused_records_and_dumps_neither_grows_nor_stops_the_sidecar(users):
    _, mallory = users
    with open_sidecar() as sidecar:
        proc = start_interactive(mallory, sidecar, MANY_REFUSED)
        try:
            assert next_result(proc, 60) == {"warm": True}
            before = rss(sidecar)
            with LoopProbe(sidecar) as probe:
                go(proc)
                out = next_result(proc, 120)
            after = rss(sidecar)
            print(f"150 refused pushes: {out['codes']}; sidecar RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB; "
                  f"longest /healthz wait {probe.worst:.3f}s over {probe.samples} probes")  # fmt: skip
            assert sum(out["codes"].values()) == 150 and set(out["codes"]) <= {"400", "413"}, out["codes"]
            assert out["after"][0] == 200, out["after"]  # the same rank's next good push is taken
            assert not probe.failures and healthz(sidecar) == 200
            assert after - before < 24 * 2**20, f"the sidecar grew {(after - before) / 2**20:.0f} MiB"
        finally:
            kill_tree(proc)


# A healthy rank's dumps that nobody asked for (the hooks send one only when the sidecar's answer
# asks, at an incident): 48 ranks of one user, ~460 KiB each, with their steps.
UNASKED_DUMPS = r"""
    n = 48
    dump = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[]"}},
            "entries": [{"record_id": i, "frames": [{"name": "f%d" % j, "filename": "x" * 110, "line": j}
                                                    for j in range(12)]} for i in range(256)]}
    ranks = [sleeper() for _ in range(n)]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(SOCK)
    for i, r in enumerate(ranks):
        status, body = request("/v1/register", registration(r.pid, "unasked", rank=i, world_size=n), sock=conn)
        assert status == 200, body
        request("/v1/push", {"job_id": "unasked", "rank": i, "pid": r.pid, "items": [{"type": "step", "step": 1}]},
                sock=conn)
    report(size=len(json.dumps(dump, separators=(",", ":"))))
    sys.stdin.readline()
    codes, wants = {}, []
    for i, r in enumerate(ranks):
        status, body = request("/v1/push", {"job_id": "unasked", "rank": i, "pid": r.pid,
                                            "items": [{"type": "step", "step": 2}], "fr_dump": dump}, sock=conn)
        codes[status] = codes.get(status, 0) + 1
        wants.append(body.get("want") if isinstance(body, dict) else None)
    report(codes=codes, wants=[w for w in wants if w])
    time.sleep(600)
"""


def test_dumps_nobody_asked_for_are_not_kept(users):
    """The sidecar keeps a rank's whole dump in memory (up to 512 KiB) until the rank is replaced
    or 600 s after it is gone: only an incident needs it, and only a rank that was asked (a push's
    `want`) should have one kept. 48 unasked dumps of ~460 KiB: ~21 MiB if kept."""
    _, mallory = users
    with open_sidecar() as sidecar:
        proc = start_interactive(mallory, sidecar, UNASKED_DUMPS)
        try:
            size = next_result(proc, 60)["size"]
            time.sleep(0.5)
            before = rss(sidecar)
            go(proc)
            out = next_result(proc, 120)
            time.sleep(0.5)
            after = rss(sidecar)
            grown = (after - before) / 2**20
            print(f"48 unasked dumps of {size / 1024:.0f} KiB: {out}; sidecar RSS {before / 2**20:.1f} -> "
                  f"{after / 2**20:.1f} MiB (+{grown:.1f})")  # fmt: skip
            assert not out["wants"], out  # healthy ranks: nobody asked
            assert grown < 12, f"the sidecar grew {grown:.1f} MiB: it keeps dumps nobody asked for"
        finally:
            kill_tree(proc)


# Dumps that were asked for, 128 ranks of one user at ~480 KiB each: written into the incident.
BIG_DUMPS = """
    import functools
    def RECORD(i):
        return None
    @functools.lru_cache(maxsize=None)
    def DUMP(i):
        frames = [{"name": f"f{j}", "filename": "x" * 115, "line": j} for j in range(12)]
        return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[]"}},
                "entries": [{"record_id": e, "rank": i, "frames": frames} for e in range(256)]}
"""


@pytest.mark.slow  # 16 s: a 10 s floor before the incident
def test_writing_an_incidents_dumps_does_not_hold_the_event_loop(users):
    """An incident writes every dump the job's ranks sent as a pickle: json.loads, pickle.dumps
    and the write of up to 512 KiB each, 256 ranks per user. Done on the event loop, it holds
    /healthz, pushes and the watchdog of every user (docs/security.md, "The event loop")."""
    _, mallory = users
    with open_sidecar(*with_floor(10)) as sidecar:
        # 128 ranks' 512 KiB dumps after a 10 s floor: past 60 s once beside the suite at five workers,
        # past 180 s once while their pushes went every 0.2 s (640 a second: most of the test's CPU).
        # The dumps are asked for at the ranks' suspect time, 5 s before the incident takes them.
        job, out = start_stalling_job(
            mallory, sidecar, "bigdumps", BIG_DUMPS, ranks=128, timeout=180, ROUND_SECONDS="1"
        )
        try:
            assert set(map(lambda a: a[0], out["answers"].values())) == {200}, out["answers"]
            with LoopProbe(sidecar) as probe:
                record = incident_of(sidecar, "bigdumps", timeout=40)
                time.sleep(1)
            written = list(Path(record["fr_dumps"] or "/nonexistent").glob("rank_*"))
            print(f"{len(written)} dumps written ({len(out['gone'])} ranks gone before a round reached them); "
                  f"longest /healthz wait {probe.worst:.3f}s over {probe.samples} probes")  # fmt: skip
            # only dumps sent after the sidecar asked count (the ranks that pushed again in time)
            assert len(written) >= 32, len(written)
            assert probe.worst < 0.5, f"the event loop was held {probe.worst:.2f}s while the dumps were written"
        finally:
            kill_tree(job)


# ---------------------------------------------------------------- 2. the pickles root writes

MARK = "/tmp/sidecar-fr-dump-executed"

# A dump built to look like what an unpickler would run: pickle opcodes in strings, the names of
# the functions a payload calls, the dunder names pickle and jsonpickle use, every byte value, lone
# surrogates, numbers past 64 bits.
EVIL_DUMP = {
    "version": "2.10",
    "pg_config": {"0": {"name": "cos\nsystem\n(S'touch " + MARK + "'\ntR.", "desc": "__reduce__", "ranks": "[0, 1]"}},
    "pg_status": {"0": {"last_enqueued_collective": 7, "last_completed_collective": 6}},
    "entries": [
        {
            "record_id": 0,
            "collective_seq_id": 7,
            "profiling_name": "c__builtin__\neval\n(Vprint(1)\ntR.",
            "__reduce__": ["os.system", ["touch " + MARK]],
            "__reduce_ex__": "subprocess.Popen",
            "__class__": "posix.system",
            "py/object": "os.system",
            "py/reduce": [{"py/function": "os.system"}, {"py/tuple": ["touch " + MARK]}],
            "__setstate__": {"__dict__": {"x": 1}},
            "frames": [
                {
                    "name": "os.system",
                    "filename": "\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93.",
                    "line": 1,
                }
            ],
            "bytes": "".join(map(chr, range(256))),
            "wide": "\U0001f600\ud800\udfff",
            "big": 2**63,
            "negative": -(2**100),
            "float": 1e308,
            "nested": [[[[{"a": [None, True, False, 0.5]}]]]],
        }
    ],
}

EVIL_DUMPS = f"""
    EVIL = json.loads({json.dumps(EVIL_DUMP)!r})
    def RECORD(i):
        return None
    def DUMP(i):
        return dict(EVIL, rank=i)
"""

# Opcodes that name or call anything: a dump's pickle must hold none of them.
CALLING = {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2",
           "EXT4", "PERSID", "BINPERSID"}  # fmt: skip


class PlainValuesOnly(pickle.Unpickler):
    """Loads a pickle that holds plain values; anything that would import or call is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the pickle names {module}.{name}")


def escaped(value):
    """The dump as the sidecar keeps it: every string (keys too) as `printable` escapes it."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, list):
        return [escaped(v) for v in value]
    if isinstance(value, dict):
        return {printable(k): escaped(v) for k, v in value.items()}
    return value


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings(v)


def plain_load(data: bytes):
    return PlainValuesOnly(io.BytesIO(data)).load()


TRY_TO_WRITE = """
    import errno
    DIAG, FR = sys.argv[1], sys.argv[2]
    tries = {
        "create a file in diag/": lambda: open(os.path.join(DIAG, "x"), "x"),
        "create a file in incidents/": lambda: open(os.path.join(DIAG, "incidents", "x.fr"), "x"),
        "plant a symlink in incidents/": lambda: os.symlink("/etc", os.path.join(DIAG, "incidents", "next.fr")),
        "plant a directory in incidents/": lambda: os.mkdir(os.path.join(DIAG, "incidents", "next.fr")),
        "plant a symlink in the .fr directory": lambda: os.symlink("/etc/shadow", os.path.join(FR, "rank_9")),
        "replace rank_0": lambda: os.rename(os.path.join(FR, "rank_1"), os.path.join(FR, "rank_0")),
        "remove rank_0": lambda: os.unlink(os.path.join(FR, "rank_0")),
        "open rank_0 for writing": lambda: open(os.path.join(FR, "rank_0"), "r+b"),
        "read rank_0": lambda: open(os.path.join(FR, "rank_0"), "rb").read(),
        "rename the .fr directory": lambda: os.rename(FR, FR + ".old"),
    }
    out = {}
    for name, attempt in tries.items():
        try:
            attempt()
            out[name] = "done"
        except OSError as e:
            out[name] = errno.errorcode.get(e.errno, str(e.errno))
    report(**out)
"""


def try_to_write(user: User, sidecar: Sidecar, fr_dir: str) -> dict:
    """TRY_TO_WRITE as `user`: what each attempt got (`done`, or the errno's name)."""
    proc = run_as_sync(
        user,
        [UNPRIV_PYTHON, "-c", CLIENT + dedent(TRY_TO_WRITE), str(sidecar.workdir / "diag"), fr_dir],
        env={"SIDECAR_SOCKET": sidecar.socket},
    )
    return result_of(proc)


def test_the_dump_pickles_hold_plain_values_belong_to_root_and_cannot_be_redirected(users):
    """The user's own 2-rank job stalls; each rank answers the sidecar's `want` with a dump built
    to look like a pickle payload. Root writes `rank_0`, `rank_1`: each loads with an unpickler
    that refuses every global, holds exactly the JSON the rank sent, names and calls nothing;
    root's files, 0600 (incident_file_mode), in root's directories that the user can neither
    write nor plant a symlink in, before or after."""
    _, mallory = users
    with contextlib.suppress(FileNotFoundError):
        os.unlink(MARK)
    with open_sidecar(*STALLS) as sidecar:
        before = try_to_write(mallory, sidecar, str(sidecar.workdir / "diag" / "incidents" / "none.fr"))
        job, out = start_stalling_job(mallory, sidecar, "frjob", EVIL_DUMPS)
        try:
            assert {k: v[0] for k, v in out["answers"].items()} == {"0": 200, "1": 200}, out["answers"]
            record = incident_of(sidecar, "frjob")
            assert record["fr_dumps"], record
            fr = Path(record["fr_dumps"])
            files = sorted(p.name for p in fr.iterdir())
            assert files == ["rank_0", "rank_1"], files
            for rank, name in enumerate(files):
                data = (fr / name).read_bytes()
                assert not {op.name for op, _, _ in pickletools.genops(data)} & CALLING
                loaded = plain_load(data)
                assert loaded == escaped(json.loads(json.dumps(dict(EVIL_DUMP, rank=rank)))), name
                assert not [t for t in strings(loaded) if unsafe(t)], name  # issue 43 row 7: nothing raw
                st = (fr / name).lstat()
                assert (st.st_uid, st.st_gid, oct(st.st_mode)) == (0, 0, oct(0o100600)), (name, st)
                assert st.st_nlink == 1
            assert not os.path.exists(MARK)
            for d in (sidecar.workdir / "diag", fr.parent, fr):
                st = d.lstat()
                assert st.st_uid == 0 and not st.st_mode & 0o022 and d.is_dir() and not d.is_symlink(), (d, st)
            after = try_to_write(mallory, sidecar, str(fr))
            print("before the incident:", before, "\nafter:", after)
            assert before["create a file in diag/"] == "EACCES" and after["create a file in diag/"] == "EACCES"
            for name in ("create a file in incidents/", "plant a symlink in incidents/",
                         "plant a directory in incidents/"):  # fmt: skip
                assert before[name] in ("EACCES", "ENOENT") and after[name] == "EACCES", (name, before, after)
            for name, result in after.items():
                assert result in ("EACCES", "EPERM"), (name, result)
            assert sorted(p.name for p in fr.iterdir()) == ["rank_0", "rank_1"]
        finally:
            kill_tree(job)


DEEP_DUMP = """
    sys.setrecursionlimit(200000)
    def RECORD(i):
        return None
    DEEPEST = []
    def nested(depth):
        return json.loads("[" * depth + "]" * depth)
    def DUMP(i):
        # the deepest dump the API accepts, found by asking it (a too-deep one is refused: bad_json)
        if not DEEPEST:
            lo, hi = 1, 20000
            while lo < hi:
                mid = (lo + hi + 1) // 2
                status, _ = request("/v1/push", {"job_id": job, "rank": i, "pid": ranks[i].pid, "items": [],
                                                 "fr_dump": {"version": "x", "entries": [{"t": nested(mid)}]}})
                lo, hi = (mid, hi) if status == 200 else (lo, mid - 1)
            DEEPEST.append(lo)
        return {"version": "x", "entries": [{"t": nested(DEEPEST[0])}], "depth": DEEPEST[0]}
"""


def test_the_deepest_dump_the_api_accepts_does_not_stop_the_remediation(users):
    """A dump nested as deep as the API's parser allows passed every check, but pickling it in
    `save_fr_dumps` raised RecursionError, which only OSError and ValueError were caught for: the
    remediation failed and the user's hung job was never killed nor restarted (its own harm; but
    "bad input never crashes anything", and a real job may nest deeply too)."""
    _, mallory = users
    with open_sidecar(*STALLS) as sidecar:
        job, out = start_stalling_job(mallory, sidecar, "deepdump", DEEP_DUMP)
        try:
            assert {k: v[0] for k, v in out["answers"].items()} == {"0": 200, "1": 200}, out["answers"]
            record = incident_of(sidecar, "deepdump")
            print(record["outcome_now"], record["notes"])
            assert record["outcome_now"] == "killed", (record["outcome_now"], record["notes"])
            assert not any(alive(pid) for pid in out["pids"])
        finally:
            kill_tree(job)


# ---------------------------------------------------------------- 3. another user's job

# Alice's healthy 2-rank job, coordinated by this node: steps every 0.3 s, each push with her
# record (nothing in flight).
ALICE_HEALTHY = """
    job = "alice-job"
    ranks = [sleeper(), sleeper()]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(SOCK)
    offer = None
    for i, r in enumerate(ranks):
        status, body = request("/v1/register", registration(r.pid, job, rank=i, world_size=2), sock=conn)
        assert status == 200, body
        offer = offer or body["job_view"]
    step, told = 0, False
    while True:
        step += 1
        now = time.time()
        for i, r in enumerate(ranks):
            record = {"time": now, "groups": [{"pg": "0", "desc": "default_pg", "size": 2, "ranks": [0, 1],
                      "enqueued": step, "started": step, "completed": step, "pending": []}]}
            items = [{"type": "step", "step": step}]
            if i == 0 and not told:
                items.append({"type": "event", "name": "job_coordinator",
                              "fields": {"url": offer["url"], "node": offer["node"]}})
            status, body = request("/v1/push", {"job_id": job, "rank": i, "pid": r.pid, "items": items,
                                                "collectives": record}, sock=conn)
            assert status == 200, body
        if not told:
            told = True
            report(pids=[r.pid for r in ranks])
        time.sleep(0.3)
"""

# Mallory, against alice's job: join it, push her ranks' record, and report a fake node of it
# whose ranks hold a desync and a stuck collective, for 5 s (refused: the peer routes answer root
# on the socket and the job's key over TCP).
FORGE_FOR_ALICE = """
    now = time.time()
    def forged_record(op, enqueued=7):
        return {"time": now, "groups": [{"pg": "0", "desc": "default_pg", "size": 4, "ranks": [0, 1, 2, 3],
                "enqueued": enqueued, "started": enqueued, "completed": 6,
                "pending": [{"seq": 7, "op": op, "sizes": [[4]], "created": now - 30, "state": "started"}]}]}
    mine = sleeper()
    out = {}
    out["join"] = request("/v1/register", registration(mine.pid, "alice-job", rank=3, world_size=4))
    out["take alice's rank 1"] = request("/v1/register", registration(mine.pid, "alice-job", rank=1, world_size=2,
                                                                      restart_count=5))
    out["push as alice's rank"] = request("/v1/push", {"job_id": "alice-job", "rank": 0, "pid": PIDS[0], "items": [],
                                                      "collectives": forged_record("barrier", 999999)})
    out["push as alice's rank, own pid"] = request("/v1/push", {"job_id": "alice-job", "rank": 0, "pid": mine.pid,
                                                               "items": [],
                                                               "collectives": forged_record("barrier", 999999)})
    def view(rank, op):
        return {"rank": rank, "local_rank": rank - 2, "state": "stalled", "step": 1, "phase": None,
                "progress_age_seconds": 60.0, "waiting": True, "stack_top": None,
                "collectives": forged_record(op), "collectives_age": 0.1}
    forged = {"job_id": "alice-job", "node": "evil", "world_size": 4, "time": now,
              "ranks": [view(2, "all_reduce"), view(3, "barrier")]}
    out["peer report"] = request("/v1/jobs/alice-job/report", forged)
    end = time.time() + 5
    while time.time() < end:
        forged["time"] = time.time()
        request("/v1/jobs/alice-job/report", forged)
        time.sleep(0.3)
    report(**out)
"""


def collective_series(sidecar: Sidecar, job: str) -> list[str]:
    return [
        line for line in sidecar.metrics().splitlines()
        if line.startswith("sidecar_rank_collective_") and f'job_id="{job}"' in line
    ]  # fmt: skip


def test_another_user_cannot_push_a_record_for_a_job_she_does_not_own(users):
    """Mallory cannot join alice's job (403 job_owned), nor push her ranks' record (403), nor report
    a fake node of it claiming a desync (403): alice's ranks make progress, are never taken for
    stalled, keep their own record, and nothing is signalled."""
    alice, mallory = users
    with open_sidecar(*STALLS) as sidecar:
        victim, info = start_as(alice, sidecar, ALICE_HEALTHY)
        try:
            out = attack(mallory, sidecar, f"PIDS = {info['pids']!r}\n" + dedent(FORGE_FOR_ALICE), timeout=60)
            print(json.dumps(out, indent=1)[:3000])
            assert out["join"][0] == 403 and out["join"][1]["code"] == "job_owned", out["join"]
            assert out["take alice's rank 1"][0] in (403, 409), out["take alice's rank 1"]
            assert out["push as alice's rank"][0] == 403, out["push as alice's rank"]
            assert out["push as alice's rank, own pid"][0] in (403, 409), out["push as alice's rank, own pid"]
            assert out["peer report"][0] == 403, out["peer report"]
            time.sleep(1)
            assert all(alive(pid) for pid in info["pids"]), "alice's process was signalled"
            mine = ranks_of(sidecar, "alice-job")
            assert {r: v["state"] for r, v in mine.items()} == {0: "healthy", 1: "healthy"}, mine
            assert not [i for i in sidecar.status()["incidents"] if i["job_id"] == "alice-job"]
            transitions = [line for line in sidecar.log.read_text().splitlines()
                           if "rank alice-job/" in line and "-> stalled" in line]  # fmt: skip
            assert not transitions, transitions
            series = collective_series(sidecar, "alice-job")
            assert series and not [line for line in series if "999999" in line], series
        finally:
            kill_tree(victim)


@pytest.mark.parametrize(
    "kind, ops",
    [("collective_mismatch", ("all_reduce", "barrier")), ("collective_stuck", ("all_reduce", "all_reduce"))],
)
def test_a_collective_verdict_from_ones_own_job_signals_only_that_job(users, kind, ops):
    """Mallory's own 2-rank job, coordinated by this node like alice's, claims ranks 0 and 1 (the
    numbers alice's ranks have) are in a desync or a stuck collective: on that kind every node
    kills its own ranks of the job; here, mallory's two processes and nothing else."""
    alice, mallory = users
    with open_sidecar(*STALLS) as sidecar:
        victim, info = start_as(alice, sidecar, ALICE_HEALTHY)
        functions = (
            f"OPS = {ops!r}\ndef OP(i):\n    return OPS[i]\n" + dedent(RECORD_IN_7) + "def DUMP(i):\n    return None\n"
        )
        job, out = start_stalling_job(mallory, sidecar, "evil", functions, COORDINATE="1")
        try:
            record = incident_of(sidecar, "evil")
            print(record["summary"])
            assert (record["hang_kind"], record["evidence"]) == (kind, "collectives"), record["summary"]
            signalled = {pid for e in record["timeline"] if e["event"] == "sigterm" for pid in e.get("pids", [])}
            assert signalled == set(out["pids"]), (signalled, out["pids"])
            assert not any(alive(pid) for pid in out["pids"])
            assert all(alive(pid) for pid in info["pids"]), "alice's process was signalled"
            mine = ranks_of(sidecar, "alice-job")
            assert {r: v["state"] for r, v in mine.items()} == {0: "healthy", 1: "healthy"}, mine
            assert not [i for i in sidecar.status()["incidents"] if i["job_id"] == "alice-job"]
        finally:
            kill_tree(job)
            kill_tree(victim)


# Alice's rank hangs (test_job_view.HANGING_RANK: coordinated by this node); a fake node of alice's
# job keeps reporting that its two ranks disagree at sequence #7, one op being `op`.
def forged_desync(op: str) -> bytes:
    def view(rank: int) -> dict:
        now = time.time()
        return {"rank": rank, "local_rank": rank - 1, "state": "stalled", "step": 3, "phase": None,
                "progress_age_seconds": 9.0, "waiting": True, "stack_top": None, "collectives_age": 0.1,
                "collectives": {"time": now, "groups": [{"pg": "0", "desc": "default_pg", "size": 3,
                    "ranks": [0, 1, 2], "enqueued": 7, "started": 7, "completed": 6,
                    "pending": [{"seq": 7, "op": op if rank == 1 else "barrier", "sizes": [[4]],
                                 "created": now - 30}]}]}}  # fmt: skip

    body = {"job_id": "victim", "node": "evil", "world_size": 3, "time": time.time(), "ranks": [view(1), view(2)]}
    return json.dumps(body).encode()


@pytest.mark.parametrize("op", ["all_reduce", "\ud800"], ids=["plain op", "lone surrogate op"])
def test_a_forged_desync_report_cannot_keep_a_real_hang_from_being_remediated(users, op):
    """A peer of the job (it holds the job's key: a node of alice's own job, or whoever reads the
    job's store) reports a desync: a lie may mislabel the record or delay the kill by the launcher
    grace, never stop it. A forged desync makes alice's node kill her hung rank at once (no
    culprit: every node acts on its own ranks). A lone surrogate in one op name (accepted by
    parse_collectives: not a control character) went into the verdict's reason, then alice's
    incident; rendering it raised UnicodeEncodeError in IncidentStore.save: her remediation
    failed, the episode stayed open, and her hung rank was never killed. Mallory, who holds no key
    of alice's job, is refused on the socket and over TCP alike."""
    import threading

    from sidecar.jobview import auth
    from tests.security.test_job_view import FAST, post, start_job

    alice, mallory = users
    with open_sidecar(*FAST) as sidecar:
        victim, info = start_job(alice, sidecar, "victim")
        path, stop = "/v1/jobs/victim/report", threading.Event()
        first: list[int] = []

        def forge() -> None:
            while not stop.is_set():
                body = forged_desync(op)
                header, _ = auth.sign_request(info["offer"]["key"], "POST", path, body, "n1")
                first.append(post(sidecar.port, path, body, {auth.REQUEST_HEADER: header})[0])
                stop.wait(0.5)

        forger = threading.Thread(target=forge, daemon=True)
        try:
            out = attack(mallory, sidecar, f"""
                body = {forged_desync(op)!r}
                report(socket=request("{path}", json.loads(body))[0],
                       tcp=tcp({sidecar.port}, "POST", "{path}", body)[0])
            """)  # fmt: skip
            assert (out["socket"], out["tcp"]) == (403, 401), out
            forger.start()
            started = time.monotonic()
            killed = True
            try:
                # floor 3 + verdict 1 + grace 6, generously (a loaded machine)
                wait_until(lambda: not alive(info["pid"]), 45, what="alice's hung rank killed")
            except TimeoutError:
                killed = False
            stop.set()
            forger.join(10)
            assert first and first[0] in (200, 400), first  # signed: accepted, or the op refused
            if not killed:
                record = next(i for i in sidecar.status()["incidents"] if i["job_id"] == "victim")
                pytest.fail(f"alice's hung rank was never killed: {record['outcome']}: {record['summary']!r}")
            # the rank is gone; the sidecar records the outcome once it has seen it gone (a moment later)
            record = incident_of(sidecar, "victim")
            print(f"{time.monotonic() - started:.1f}s: {record['outcome_now']}: {record['summary']!r}")
            assert record["outcome_now"] == "killed", record
        finally:
            stop.set()
            kill_tree(victim)


# ---------------------------------------------------------------- 4. names that reach a terminal

# What a record's names may not carry raw to an operator's terminal or editor: C0 and C1 controls
# (ESC starts a sequence, U+009B is a one-character CSI), the bidirectional controls (the Unicode
# property Bidi_Control: U+202E reverses what follows, U+061C is a mark like U+200F), the Unicode
# line and paragraph separators (a line break to str.splitlines and Unicode-aware viewers), and
# lone surrogates (not text at all: no UTF-8 encoder takes them, Python's print included).
ODD = {
    "ESC": "\x1b]52;c;ZXZpbA==\x07",
    "CSI (U+009B)": "\x9b2J",
    "RLO (U+202E)": "\u202e",
    "ALM (U+061C)": "\u061c",
    "LS (U+2028)": "\u2028  evidence: none",
    "lone surrogate (U+D800)": "\ud800",
}
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def raw_controls(text: str) -> list[str]:
    """The characters of `text` (newlines aside) that must not reach a terminal raw."""
    return sorted(
        {
            repr(c)
            for c in text
            if c != "\n" and (unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp") or c in BIDI_CONTROLS)
        }
    )


ODD_NAMES = """
    rank = sleeper()
    status, body = request("/v1/register", registration(rank.pid, "odd", world_size=2))
    assert status == 200, body
    def record(pg="0", desc="default_pg", op="all_reduce", state="scheduled"):
        now = time.time()
        return {"time": now, "groups": [{"pg": pg, "desc": desc, "size": 2, "ranks": [0, 1], "enqueued": 7,
                "started": 7, "completed": 6,
                "pending": [{"seq": 7, "op": op, "sizes": [[4]], "created": now - 5, "state": state}]}]}
    replies = {}
    for field in ("op", "pg", "desc", "state"):
        replies[field] = request("/v1/push", {"job_id": "odd", "rank": 0, "pid": rank.pid, "items": [],
                                              "collectives": record(**{field: "x" + ODD + "y"})})
    report(replies=replies)
"""

WHERE = {
    "op": "collectives.groups[0].pending[0].op",
    "pg": "collectives.groups[0].pg",
    "desc": "collectives.groups[0].desc",
    "state": "collectives.groups[0].pending[0].state",
}


@pytest.mark.parametrize("odd", list(ODD.values()), ids=list(ODD))
def test_names_with_terminal_controls_are_refused_by_name(users, odd):
    _, mallory = users
    with open_sidecar() as sidecar:
        out = attack(mallory, sidecar, f"ODD = {odd!r}\n" + dedent(ODD_NAMES), timeout=60)
        accepted = {field: reply for field, reply in out["replies"].items() if reply[0] == 200}
        assert not accepted, f"{odd!r} accepted in {sorted(accepted)}"
        for field, (status, body) in out["replies"].items():
            assert status == 400 and WHERE[field] in body["error"], (field, status, body)


# One rank of the user's job per odd text, each rank's op and group description holding its text: a
# desync whose reason quotes the ops (where the API accepted them).
ODD_RECORDS = """
    def RECORD(i):
        now = time.time()
        return {"time": now, "groups": [{"pg": "0", "desc": "tp" + ODDS[i], "size": n, "ranks": list(range(n)),
                "enqueued": 7, "started": 7, "completed": 6,
                "pending": [{"seq": 7, "op": "op" + ODDS[i], "sizes": [[4]], "created": now - 10}]}]}
    def DUMP(i):
        return {"version": "2.10", "pg_config": {"0": {"desc": "tp" + ODDS[i]}}, "entries": [{"op": ODDS[i]}]}
"""


def run_root(*argv: str) -> tuple[int, str]:
    """A `sidecar` command as root, piped (plain text, as in a log or `| less`): its exit status
    and its output, undecodable bytes kept visible as lone surrogates."""
    proc = subprocess.run([PYTHON, "-m", "sidecar", *argv], capture_output=True, timeout=60)
    return proc.returncode, (proc.stdout + proc.stderr).decode("utf-8", errors="surrogateescape")


@pytest.mark.parametrize(
    "odds",
    [[v for k, v in ODD.items() if "surrogate" not in k], ["", ODD["lone surrogate (U+D800)"]]],
    ids=["controls, bidi and separators", "a lone surrogate"],
)
def test_odd_names_are_printed_escaped_wherever_the_sidecar_prints_them(users, odds):
    """Whatever names the API let in reach no terminal raw: `sidecar incidents` (`--full` and the
    table), the incident's `.txt`, `sidecar status`, the sidecar's log. Each command must also
    run: a lone surrogate in an incident's summary made `sidecar status` die (UnicodeEncodeError)
    for root, whoever's job it was, as long as the incident was among the last ones shown."""
    _, mallory = users
    with open_sidecar(*STALLS) as sidecar:
        functions = f"ODDS = {odds!r}\n" + dedent(ODD_RECORDS)
        job, out = start_stalling_job(mallory, sidecar, "oddjob", functions, ranks=len(odds))
        try:
            record = incident_of(sidecar, "oddjob")
            print(record["outcome_now"], repr(record["summary"]), out["refused"])
            diag = str(sidecar.workdir / "diag")
            shown = {
                "sidecar incidents --full": run_root("incidents", "--full", "--diag-dir", diag),
                "sidecar incidents": run_root("incidents", "--diag-dir", diag),
                "sidecar status": run_root("status", "--socket", sidecar.socket),
            }
            for path in Path(diag, "incidents").glob("*oddjob.txt"):
                shown[path.name] = (0, path.read_bytes().decode("utf-8", errors="surrogateescape"))
            shown["the sidecar's log"] = (0, sidecar.log.read_bytes().decode("utf-8", errors="surrogateescape"))
            # `sidecar status` exits 1 for a degraded node (a rank still stalled): a crash is a traceback
            problems = {
                where: f"exit {code}: {text[-300:]}"
                for where, (code, text) in shown.items()
                if code not in (0, 1) or (code and where != "sidecar status") or "Traceback (most recent" in text
            }
            problems.update({where: raw_controls(text) for where, (_, text) in shown.items() if raw_controls(text)})
            if (record["outcome_now"], record["outcome"]) != ("killed", "killed"):
                problems["the remediation"] = (record["outcome_now"], record["outcome"], record["notes"])
            assert not problems, json.dumps(problems, indent=1)
        finally:
            kill_tree(job)
