"""`bench_recovery --long --faults mixed`: the run of bench/mixed_faults.py taken apart and printed:
each fault's recovery (the anatomy table), whether each hang was killed and recovered and the healthy
pause was not, the false kills, and the goodput against the target (>= 90% with no false kill).

A kill is an incident record with a SIGTERM in its timeline, on any node. It is the injected hang's
when it comes after that hang began and before the next fault; a kill during the healthy pause, before
the first fault or after a crash (torchrun handles a crash, no stall to judge) is a false kill.

Goodput: rank 0's steps x the median healthy step time / the wall time from its first step to its
last. The healthy pause is the job's own work (every rank computing, as an evaluation does): its
steps' time counts as the job's useful time, not as loss.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from bench.mixed_faults import HANGS, Fault, MixedRun
from bench.recovery_anatomy import Anatomy, anatomy, print_anatomies
from bench.recovery_goodput import StepAccount, account

TARGET = 0.90


@dataclass
class Outcome:
    fault: Fault
    kills: list[dict] = field(default_factory=list)  # kill incidents in its window, earliest first
    recorded: list[dict] = field(default_factory=list)  # every incident in its window
    recovered: float | None = None  # its start -> rank 0's first step after it
    restarted: bool = False  # a new attempt formed in its window
    anatomy: Anatomy | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Report:
    run: MixedRun
    outcomes: list[Outcome]
    false_kills: list[tuple[str, dict]]  # (why, incident)
    spent: StepAccount
    steps: int
    goodput: float

    @property
    def judged(self) -> bool:
        """The issue's scenario: 10 minutes or more, a fault a minute or more often."""
        return self.run.minutes >= 10 and self.run.every <= 60

    @property
    def behaved(self) -> bool:
        """Every hang killed and recovered, the pause not killed, no false kill."""
        return bool(self.outcomes) and not self.false_kills and not any(o.problems for o in self.outcomes)

    @property
    def passed(self) -> bool:
        return self.judged and self.behaved and self.goodput >= TARGET


def kill_time(incident: dict) -> float | None:
    return next((e["time"] for e in incident.get("timeline", []) if e.get("event") == "sigterm"), None)


def analyse(run: MixedRun) -> Report:
    steps = [(e.fields["step"], e.time) for e in run.events if e.kind == "step" and e.fields["from_rank"] == 0]
    startup = [e for e in run.events if e.kind == "startup" and e.fields["from_rank"] == 0]
    rendezvous = [e.time for e in run.events if e.kind == "rendezvous" and e.fields["from_rank"] == 0]
    kills = sorted((i for i in run.incidents if kill_time(i) is not None), key=lambda i: kill_time(i) or 0)
    starts = [f.start if f.start is not None else f.requested for f in run.faults]
    outcomes, claimed = [], set()
    for n, f in enumerate(run.faults):
        o = Outcome(f)
        outcomes.append(o)
        o.problems += f.notes
        begin = starts[n]
        end = starts[n + 1] if n + 1 < len(starts) else float("inf")
        if f.start is None:
            o.problems.append(f"the request was never fired (asked for step {f.at_step})")
            continue
        o.recorded = [i for i in run.incidents if begin <= i["time"] < end]
        o.kills = [i for i in kills if begin <= (kill_time(i) or 0) < end]
        o.restarted = any(begin <= t < end for t in rendezvous)
        after = kill_time(o.kills[0]) if o.kills else begin
        first = next((t for s, t in steps if t > (after or begin) and (o.restarted or f.kind == "pause")), None)
        o.recovered = first - begin if first is not None else None
        last = max((s for s, t in steps if t <= begin), default=None)
        if f.kind == "pause":
            o.problems += [f"killed on {i['node']} ({i.get('hang_kind')})" for i in o.kills]
            if o.restarted:
                o.problems.append("the job restarted during the healthy pause")
            continue
        o.anatomy = anatomy(begin, last, o.kills[0] if o.kills else None, startup)
        if f.kind in HANGS:
            claimed |= {id(i) for i in o.kills}
            if not any(i["node"] == f.node and i.get("blamed_rank") == f.rank for i in o.kills):
                o.problems.append(f"not killed on its node {f.node} (rank {f.rank} blamed by no kill)")
        if o.recovered is None:
            o.problems.append("never trained again")
    false_kills = []
    for i in kills:
        if id(i) in claimed:
            continue
        t = kill_time(i) or 0
        during = next((o.fault for o in reversed(outcomes) if o.fault.start is not None and o.fault.start <= t), None)
        why = "before the first fault" if during is None else f"after fault {during.label}"
        false_kills.append((why, i))
    pauses = frozenset(f.at_step for f in run.faults if f.kind == "pause" and f.at_step is not None)
    spent = account(steps, pauses)
    trained = steps[-1][0] - steps[0][0]
    goodput = (trained * spent.healthy + spent.job_seconds) / spent.wall
    return Report(run, outcomes, false_kills, spent, trained, goodput)


def describe(i: dict) -> str:
    return (
        f"{i['node']}: {i.get('hang_kind') or i.get('kind')}, blamed rank {i.get('blamed_rank')}"
        f"{' on ' + i['blamed_node'] if i.get('blamed_node') else ''}, {i.get('outcome')} ({i.get('path', '')})"
    )


def print_report(r: Report, launcher: str) -> None:
    run = r.run
    print(
        f"\nmixed faults: the bundled trainer ({launcher} launcher) on {run.nodes} simulated nodes x 1 rank, a "
        f"fault every {run.every:g}s for {run.minutes:g} min ({len(run.faults)} faults), floor {run.floor:g}s, "
        f"healthy pause {2 * run.floor:g}s"
    )
    if not r.judged:
        print(
            f"  ({run.minutes:g} min with a fault every {run.every:g}s is not the issue's 10 minutes at one fault a "
            "minute: the figures are shown, the goodput target is not judged)"
        )
    rows = [(f"{o.fault.index + 1} {o.fault.kind} r{o.fault.rank}", o.anatomy) for o in r.outcomes if o.anatomy]
    if rows:
        print_anatomies([(label, a) for label, a in rows if a is not None], r.spent.healthy)
    print("\neach fault: what the sidecars recorded and did")
    for o in r.outcomes:
        f = o.fault
        again = f"training again after {o.recovered:.2f}s" if o.recovered is not None else "NOT training again"
        if f.kind == "pause" and o.recovered is not None:
            again = f"stepping again after {o.recovered:.2f}s"
        if f.kind == "pause":
            kind = ", ".join(sorted({str(i.get("hang_kind")) for i in o.recorded})) or "none"
            said = f"{len(o.recorded)} incident records (kinds: {kind}), {len(o.kills)} kills, " + (
                "a restart" if o.restarted else "no restart"
            )
        elif f.kind == "crash":
            said = f"{len(o.kills)} kills (torchrun restarts a crash), {len(o.recorded)} incident records"
        else:
            kinds = ", ".join(sorted({f"{i.get('hang_kind')}@{i['node']}" for i in o.kills})) or "none"
            said = f"killed by {len(o.kills)} node(s) ({kinds})"
        verdict = "ok" if not o.problems else "PROBLEM: " + "; ".join(o.problems)
        print(f"  {f.label:<26} {said}; {again}: {verdict}")
    print(f"\nfalse kills (a kill no injected hang caused): {len(r.false_kills)}")
    for why, i in r.false_kills:
        print(f"  {why}: {describe(i)}")
    s = r.spent
    pause_seconds = s.job_seconds + s.healthy * sum(1 for f in run.faults if f.kind == "pause")
    print(
        f"\ngoodput: {r.goodput:.1%} of {s.wall:.0f}s wall time on useful steps ({r.steps} steps x {s.healthy:.3f}s "
        f"median step; {len(run.faults)} faults; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} at "
        f"the end on {os.cpu_count()} CPUs)"
    )
    print(
        f"  the healthy pause is the job's own work (every rank computing outside any collective, as an evaluation "
        f"does): its {pause_seconds:.1f}s count as useful time, not as loss"
    )
    steal = "unknown" if run.steal is None else f"{run.steal:.1%}"
    print(
        f"  the {s.wall:.0f}s: useful {r.goodput * s.wall:.1f}s (of which the pause {pause_seconds:.1f}s), faults "
        f"and their recoveries {s.fault_seconds:.1f}s, steps slower than the median {s.slow_seconds:.1f}s (CPU time "
        f"taken by the hypervisor meanwhile: {steal})"
    )
    for node, live in sorted(run.live.items()):
        if live and sum(live.values()) > 0:
            print(
                f"  {node}'s sidecar's own goodput (sidecar_job_seconds_total): "
                f"{live.get('productive', 0.0) / sum(live.values()):.1%} productive of {sum(live.values()):.0f}s"
            )
    if run.left_behind:
        print(f"  signalled processes still alive at the end (killed by the bench): {', '.join(run.left_behind)}")
    problems = sum(1 for o in r.outcomes if o.problems)
    verdict = "PASS" if r.passed else "FAIL"
    if not r.judged:
        verdict = "not judged (not the issue's 10 minutes at a fault a minute); behaviour " + (
            "ok" if r.behaved else "FAIL"
        )
    print(
        f"target: goodput >= {TARGET:.0%} with zero false kills, every hang killed and recovered, the pause not "
        f"killed: {r.goodput:.1%}, {len(r.false_kills)} false kills, {problems} faults with a problem: {verdict}"
    )
    print("  anchors: torchft 82% at one failure a minute; ByteRobust 97% ETTR and DLRover 95% with faults hours apart")
