"""Field pauses: healthy jobs that pause as real jobs do, and what the watchdog does about them, next to
the same run's real hangs and how fast it kills those.

    python -m bench.bench_field_pauses --quick     # floor 5 s, pauses 8 s: 4 kinds x 2 integrations, the hangs (6 min)
    python -m bench.bench_field_pauses             # both settings, every kind and integration (make bench, ~40 min)
    python -m bench.bench_field_pauses --setting lowered --pause cpu_starved --integration attach --no-hangs

Each job is a real sidecar and a real `torchrun --standalone` job (2 ranks, gloo on the CPU) of a
user's DDP loop (bench/field/loop.py) that pauses `--repeat` times (default 2) in one way, with
nothing declared to the sidecar:
  eval         model.eval() + torch.no_grad() forward passes, no optimizer step
  checkpoint   torch.save to slow storage (a FIFO drained at size/pause bytes a second), then a barrier
  data_wait    a DataLoader whose worker waits on storage for the first item of an epoch
  warmup       a long first step (the second in a second launch of the job: a resubmission)
  barrier      rank 0 alone prepares a data shard while rank 1 waits in a barrier
  cpu_starved  rank 1 in a cgroup v1 cpu cgroup with a 0.1% quota: live, crawling
  dstate       rank 1 frozen (cgroup v1 freezer: uninterruptible sleep, D) for the pause, then thawed
Integrations: `monitor` (a script with trainer_hooks.Monitor, mon.step per step), `attach` (the
script unmodified, under `python -m trainer_hooks.attach`), and, for `eval` only (their own evaluation
loops, which their SidecarCallbacks declare), `hf` (a Hugging Face Trainer) and `lightning`.
Settings: `shipped` (the sidecar's defaults: watchdog floor 30 s; pauses 35 s) and `lowered` (floor
5 s; pauses 8 s). Both raise only the storm cap, so that every kill happens and is counted.

The hangs (rank 1 of a Monitor script, one per restart attempt): `sigstop`, `deadlock` (two threads,
two locks in opposite orders), `busy` (a Python loop), `collective` (rank 1 SIGSTOPped inside an
all-reduce its peer then waits in).

What the watchdog did comes from the sidecar's own log lines ("-> suspect", "-> stalled", "busy,
not hung", "false alarm: ... progressed again by itself") and its incidents (/v1/status, polled
every second; the record's timeline for SIGTERM). A pause counts as suspect, stalled, killed,
... when any rank had that verdict between its start and 3 s after its end. Targets: no pause
killed (a kill a healthy job did not need is the worst outcome), every hang killed.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import time

from bench import scratch
from bench.field.environment import cgroups_unavailable
from bench.field.job import INTEGRATIONS, KINDS, SLACK_SECONDS, Result, Setting, Spec, run_job

SETTINGS = {"lowered": Setting("lowered", 5.0, 8.0), "shipped": Setting("shipped", None, 35.0)}
PAUSES = ("eval", "checkpoint", "data_wait", "warmup", "barrier", "cpu_starved", "dstate")
QUICK_PAUSES = ("eval", "checkpoint", "data_wait", "barrier")
HANGS = ("sigstop", "deadlock", "busy", "collective")
VERDICTS = ("suspect", "stalled", "busy", "false_alarm")


def killed(incident: dict) -> bool:
    return incident.get("outcome") == "killed" or any(
        e.get("event") == "sigterm" and e.get("ranks") for e in incident.get("timeline", [])
    )


def pause_rows(r: Result) -> tuple[dict, dict]:
    """Per pause kind: how many pauses, and how many of them had each verdict; and the verdicts
    outside every pause (start-up, restarts)."""
    windows = r.windows()
    inside = lambda t: next((w for w in windows if w[2] <= t <= w[3] + SLACK_SECONDS), None)  # noqa: E731
    hits: dict[int, set[str]] = {w[0]: set() for w in windows}
    outside: dict[str, int] = {}
    for e in (e for e in r.events if e.what != "healthy"):
        w = inside(e.time)
        if w is None:
            outside[e.what] = outside.get(e.what, 0) + 1
        else:
            hits[w[0]].add(e.what)
    for i in r.incidents:
        w, what = inside(i["time"]), "killed" if killed(i) else f"not killed: {i.get('outcome')}"
        if w is None:
            outside[what] = outside.get(what, 0) + 1
        else:
            hits[w[0]].add(what)
    row = {"pauses": len(windows)}
    for verdicts in hits.values():
        for v in verdicts:
            row[v] = row.get(v, 0) + 1
    return row, outside


def hang_rows(r: Result) -> list[dict]:
    """Per hang: the hang -> first suspect, first stalled, SIGTERM, and -> every rank training again."""
    rows = []
    firsts: dict[int, list[float]] = {}
    for rec in r.records:
        if rec["kind"] == "first_step":
            firsts.setdefault(rec["attempt"], []).append(rec["time"])
    for h in (rec for rec in r.records if rec["kind"] == "hang"):
        t0, attempt = h["time"], h["attempt"]
        after = [a for a in firsts if a > attempt and len(firsts[a]) >= 2]
        back = max(firsts[min(after)]) if after else None
        until = back if back is not None else float("inf")
        stalled = min((e.time for e in r.events if e.what == "stalled" and t0 <= e.time <= until), default=None)
        first = {"stalled": stalled, "suspect": _suspect(r, t0, stalled if stalled is not None else until)}
        incident = next((i for i in r.incidents if t0 - 1 <= i["time"] <= until), None)
        term = next((e["time"] for e in (incident or {}).get("timeline", []) if e.get("event") == "sigterm"), None)
        rows.append({
            "hang": h["hang"], "suspect": _after(first["suspect"], t0), "stalled": _after(first["stalled"], t0),
            "sigterm": _after(term, t0), "outcome": (incident or {}).get("outcome", "no incident"),
            "back": _after(back, t0), "killed": bool(incident and killed(incident)),
        })  # fmt: skip
    return rows


def _suspect(r: Result, t0: float, until: float) -> float | None:
    """The first turn to suspect after t0 that no return to healthy undid before `until`."""
    held: dict[int, float] = {}
    for e in sorted((e for e in r.events if t0 <= e.time <= until), key=lambda e: e.time):
        if e.what == "suspect":
            held.setdefault(e.rank, e.time)
        elif e.what == "healthy":
            held.pop(e.rank, None)
    return min(held.values(), default=None)


def _after(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def plan(args: argparse.Namespace) -> list[Spec]:
    settings = args.setting or (["lowered"] if args.quick else ["lowered", "shipped"])
    pauses = args.pause or list(QUICK_PAUSES if args.quick else PAUSES)
    integrations = args.integration or list(INTEGRATIONS[:2] if args.quick else INTEGRATIONS)
    specs = []
    for name in settings:
        setting = SETTINGS[name]
        for kind in pauses:
            specs += [Spec(i, setting, [kind] * args.repeat) for i in integrations if kind in KINDS.get(i, PAUSES)]
        if not args.no_hangs:
            specs.append(Spec("monitor", setting, hangs=list(args.hang or HANGS)))
    return specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_field_pauses", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"floor 5 s only, pauses {', '.join(QUICK_PAUSES)}")
    p.add_argument("--setting", action="append", choices=sorted(SETTINGS), help="default: both (--quick: lowered)")
    p.add_argument("--pause", action="append", choices=PAUSES, help="pause kinds (default all; --quick: 4)")
    p.add_argument("--integration", action="append", choices=INTEGRATIONS, help="default all (--quick: 2)")
    p.add_argument("--hang", action="append", choices=HANGS, help="hang kinds (default all)")
    p.add_argument("--no-hangs", action="store_true", help="no hang job")
    p.add_argument("--repeat", type=int, default=2, help="pauses of each kind per job (default 2)")
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs, incidents)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up on SIGTERM as on Ctrl-C
    why = cgroups_unavailable()
    specs = plan(args)
    if why:
        print(f"cpu_starved and dstate: skipped ({why})")
        specs = [s for s in specs if not {"cpu_starved", "dstate"} & set(s.pauses)]
    root, started = scratch.make("bench-field-pauses-"), time.monotonic()
    results: list[Result] = []
    try:
        for n, spec in enumerate(specs):
            what = spec.pauses[0] if spec.pauses else "hangs"
            r = run_job(spec, root / f"{n:02d}-{spec.setting.name}-{what}-{spec.integration}", why is None)
            results.append(r)
            print(f"{spec.setting.name:<8} {what:<12} {spec.integration:<8} rc={r.returncode} {r.wall_seconds:5.1f} s",
                  flush=True)  # fmt: skip
    except KeyboardInterrupt:
        print("interrupted")
        return 130
    finally:
        scratch.leave(root, args.keep)
    return report(results, time.monotonic() - started)


def report(results: list[Result], seconds: float) -> int:
    print("\nHealthy pauses: how many of the pauses had each verdict (any rank, from the sidecar's log and incidents)")
    print(f"{'setting':<9}{'pause':<13}{'integration':<12}{'pauses':>7}{'suspect':>9}{'stalled':>9}{'killed':>8}"
          f"{'busy':>6}{'resumed':>9}  {'finished':<9}outside pauses")  # fmt: skip
    pause_kills, unfinished = 0, []
    for r in results:
        if not r.spec.pauses:
            continue
        row, outside = pause_rows(r)
        pause_kills += row.get("killed", 0)
        if r.returncode != 0:
            unfinished.append(r)
        other = sorted(k for k in row if k.startswith("not killed"))
        extra = ", ".join(f"{k} {v}" for k, v in sorted(outside.items())) or "-"
        print(f"{r.spec.setting.name:<9}{r.spec.pauses[0]:<13}{r.spec.integration:<12}{row['pauses']:>7}"
              f"{row.get('suspect', 0):>9}{row.get('stalled', 0):>9}{row.get('killed', 0):>8}{row.get('busy', 0):>6}"
              f"{row.get('false_alarm', 0):>9}  {'yes' if r.returncode == 0 else f'rc={r.returncode}':<9}{extra}"
              + (f"; {', '.join(f'{k} {row[k]}' for k in other)}" if other else ""))  # fmt: skip
    hangs = [(r, h) for r in results if r.spec.hangs for h in hang_rows(r)]
    if hangs:
        print("\nReal hangs (rank 1 of a Monitor script): hang -> first verdict, SIGTERM, every rank training again")
        print(f"{'setting':<9}{'hang':<12}{'-> suspect':>11}{'-> stalled':>11}{'-> SIGTERM':>11}{'-> training':>12}"
              "  outcome")  # fmt: skip
        for r, h in hangs:
            print(f"{r.spec.setting.name:<9}{h['hang']:<12}{_s(h['suspect']):>11}{_s(h['stalled']):>11}"
                  f"{_s(h['sigterm']):>11}{_s(h['back']):>12}  {h['outcome']}")  # fmt: skip
    expected = sum(len(r.spec.hangs) for r in results)
    hangs_killed = sum(h["killed"] for _, h in hangs)
    stalls = [h["stalled"] for _, h in hangs if h["stalled"] is not None]
    median = f"; median hang -> stalled {statistics.median(stalls):.1f} s" if stalls else ""
    print(f"\npauses killed: {pause_kills} (target 0); hangs killed: {hangs_killed}/{expected} (target all){median}; "
          f"jobs that did not finish: {len(unfinished)}; {seconds:.0f} s in all")  # fmt: skip
    ok = pause_kills == 0 and hangs_killed == expected and not unfinished
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
