"""Where a job incident's recovery time went, node by node: `sidecar incidents --job` prints each
node's recovery stages side by side (one column per node) from the coordinator's story, and so
does `bench/bench_jobview.py`.

Each node measures its own recovery (sidecar/watchdog/recovery.py, the incident's `recovery`
section: seconds per stage, `null` when the node could not see it) and sends the stages with its
part of the job incident; the story holds them under `nodes.<node>.part.stages`. A node left to
torchrun sends no kill of its own, so one more row comes from the story's timeline: when each
node saw its ranks gone, counted from the job's first SIGTERM (wall clocks of different nodes:
as far apart as the nodes' clocks are). A stage whose ends a node could not see (no
`rendezvous_done` or `checkpoint_loaded` event from a user's script) is `?`; the last row says
how much of the whole (hang -> first step) those stages hold.

A story is what a peer answered: any shape prints (what does not fit shows as `?` or `-`); the
caller escapes each line (safetext.printable).
"""

from __future__ import annotations

from typing import Any

from sidecar.commands.verdict import dict_at

# What each stage of watchdog/recovery.py ends at, for people; a stage not named here prints bare.
ENDS = {
    "detect": "hang -> detected",
    "dump": "-> stacks dumped",
    "decide": "-> kill sent",
    "kill": "-> ranks gone",
    "restart": "-> new ranks started",
    "rendezvous": "-> process group formed",
    "load": "-> checkpoint loaded",
    "first_step": "-> first step",
    "redo": "-> back at the hang's step",
    "hang_to_training": "hang -> first step, in all",
}
TOTAL = "hang_to_training"  # the recovery's hang_to_training_seconds: the stages up to the first step
UNSEEN_ROW = "not seen"
BEFORE_KILL = frozenset({"detect", "dump", "decide"})  # the sidecars' part, not the restart's
AFTER_FIRST_STEP = frozenset({"redo", TOTAL})  # training again already, or the whole
GONE_ROW = "ranks gone"
GONE_EVENTS = ("exit_observed", "restarted_by_launcher")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _gone_after_kill(story: dict) -> dict[str, float]:
    """Per node, seconds from the job's first SIGTERM (any node's) to its own ranks seen gone."""
    timeline = story.get("timeline")
    events = [e for e in timeline if isinstance(e, dict)] if isinstance(timeline, list) else []
    kills = [t for e in events if e.get("event") == "sigterm" and (t := _number(e.get("time"))) is not None]
    if not kills:
        return {}
    first_kill = min(kills)
    gone: dict[str, float] = {}
    for e in events:
        t, node = _number(e.get("time")), e.get("node")
        if e.get("event") in GONE_EVENTS and t is not None and isinstance(node, str) and t >= first_kill:
            gone[node] = min(gone.get(node, t), t)
    return {node: t - first_kill for node, t in gone.items()}


def stage_columns(story: dict) -> tuple[list[str], list[str], dict[str, dict[str, float | None]]]:
    """(nodes, stage names in the nodes' order, node -> stage -> seconds) of a story; a node
    without stages (no part yet, an older node) has an empty column."""
    nodes_obj = dict_at(story, "nodes")
    nodes = sorted(str(n) for n in nodes_obj)
    names: list[str] = []
    table: dict[str, dict[str, float | None]] = {}
    for node in nodes:
        stages = dict_at(dict_at(dict_at(nodes_obj, node), "part"), "stages")
        table[node] = {}
        for name, seconds in stages.items():
            name = str(name)
            if name not in names:
                names.append(name)
            table[node][name] = _number(seconds)
    return nodes, names, table


def recovery_table(story: dict | None) -> list[str]:
    """The table's lines (unescaped), or none when no node sent its stages yet. The slowest node of
    each row is starred; the last line names the slowest stage after the kill and its node."""
    if not isinstance(story, dict):
        return []
    nodes, names, table = stage_columns(story)
    if not names:
        return []
    gone = _gone_after_kill(story)
    rows: list[tuple[str, str, dict[str, float | None]]] = [
        (name, ENDS.get(name, ""), {node: table[node].get(name) for node in nodes}) for name in names
    ]
    if gone:  # after the kill stage (the culprit's node), before the restart
        at = next((i for i, (n, _, _) in enumerate(rows) if n not in BEFORE_KILL), len(rows))
        at += 1 if at < len(rows) and rows[at][0] == "kill" else 0
        rows.insert(at, (GONE_ROW, "after the job's first SIGTERM", {node: gone.get(node) for node in nodes}))
    if TOTAL in names:  # of the whole, what no stage the node could see holds (a ? above it)
        unseen: dict[str, float | None] = {}
        for node in nodes:
            total, parts = table[node].get(TOTAL), [s for n, s in table[node].items() if n not in AFTER_FIRST_STEP]
            unseen[node] = (
                round(max(0.0, total - sum(s for s in parts if s is not None)), 3) if total is not None else None
            )
        rows.append((UNSEEN_ROW, "of it, in stages marked ?", unseen))
    width = max(9, *(len(n) for n in nodes))
    label = max(len(n) for n, _, _ in rows)
    gloss = max(len(g) for _, g, _ in rows)
    lines = [
        "",
        "  recovery, seconds per stage on each node (* the slowest node of a stage; ? not seen, - not sent)",
        f"  {'stage':<{label}}  {'':<{gloss}}  " + "  ".join(f"{n:>{width}}" for n in nodes),
    ]
    slowest: tuple[float, str, str] | None = None
    for name, end, cells in rows:
        known = {n: s for n, s in cells.items() if s is not None}
        top = max(known.values()) if len(set(known.values())) > 1 else None  # a tie of all: no star
        shown = []
        for node in nodes:
            s = cells.get(node)
            if s is None:
                text = "?" if name in table[node] or name in (GONE_ROW, UNSEEN_ROW) else "-"
            else:
                text = f"{s:.3f}" + ("*" if top is not None and s == top else " ")
            shown.append(f"{text:>{width}}")
            after_kill = name not in BEFORE_KILL | AFTER_FIRST_STEP | {UNSEEN_ROW}
            if s is not None and after_kill and (slowest is None or s > slowest[0]):
                slowest = (s, name, node)
        lines.append(f"  {name:<{label}}  {end:<{gloss}}  " + "  ".join(shown))
    if slowest is not None:
        lines.append(f"  slowest after the kill: {slowest[1]} on {slowest[2]}, {slowest[0]:.3f} s")
    return lines
