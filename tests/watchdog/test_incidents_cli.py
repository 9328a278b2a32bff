"""`sidecar incidents` lists the records the watchdog wrote, newest first."""

from __future__ import annotations

import json
import subprocess

from sidecar.incidents.store import IncidentStore, RankSnapshot, load_incidents
from tests.support import PYTHON, ROOT, Sidecar


def write_incidents(diag, jobs):
    store = IncidentStore(diag)
    for job in jobs:
        i = store.open(
            job,
            blamed_rank=1,
            blame_reason="lowest step",
            timeout_seconds=5.0,
            observe_only=False,
            ranks=[RankSnapshot(1, 1, 4242, "stalled", 7, None, 6.0, 5.0)],
        )
        i.event("sigterm")
        i.event("exit_observed")
        i.outcome = "killed"
        store.save(i)
    return store


def sidecar(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "sidecar", "incidents", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_incidents_are_listed_newest_first(tmp_path):
    write_incidents(tmp_path, ["alpha", "beta"])
    out = sidecar("--diag-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "beta" in lines[1] and "alpha" in lines[2] and "killed" in lines[1]


def test_json_output_holds_the_full_records(tmp_path):
    write_incidents(tmp_path, ["alpha", "beta", "gamma"])
    records = json.loads(sidecar("--diag-dir", str(tmp_path), "--json", "--last", "2").stdout)
    assert [r["job_id"] for r in records] == ["gamma", "beta"]
    assert records[0]["ranks"][0]["pid"] == 4242
    assert [e["event"] for e in records[0]["timeline"]] == ["detected", "sigterm", "exit_observed"]


def test_the_diag_dir_comes_from_the_settings_when_no_sidecar_answers(tmp_path):
    write_incidents(tmp_path / "d", ["alpha"])
    out = sidecar("--socket", str(tmp_path / "none.sock"), "--set", f"diag_dir={tmp_path / 'd'}")
    assert out.returncode == 0 and "alpha" in out.stdout
    assert "no sidecar at" in out.stderr and str(tmp_path / "d") in out.stderr  # says where it looked instead


def test_the_diag_dir_is_the_running_daemons_found_by_its_socket(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    with Sidecar(tmp_path / "daemon", f"diag_dir={elsewhere}") as daemon:
        write_incidents(elsewhere, ["alpha"])
        out = sidecar("--socket", daemon.socket)
    assert out.returncode == 0 and "alpha" in out.stdout, out.stdout + out.stderr
    assert out.stderr == ""


def test_the_diag_dir_is_the_running_daemons_found_by_its_url(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    with Sidecar(tmp_path / "daemon", f"diag_dir={elsewhere}") as daemon:
        write_incidents(elsewhere, ["alpha"])
        out = sidecar("--url", daemon.url)
    assert out.returncode == 0 and "alpha" in out.stdout, out.stdout + out.stderr


def test_an_empty_directory_says_so(tmp_path):
    out = sidecar("--diag-dir", str(tmp_path))
    assert out.returncode == 0 and "no incidents" in out.stdout


def test_an_unreadable_record_is_skipped(tmp_path):
    write_incidents(tmp_path, ["alpha"])
    (tmp_path / "incidents" / "zzz-broken.json").write_text("{not json")
    assert [r["job_id"] for r in load_incidents(tmp_path)] == ["alpha"]


def test_a_summary_for_people_sits_next_to_each_record(tmp_path):
    store = write_incidents(tmp_path, ["alpha"])
    text = (tmp_path / "incidents" / (store.recent[0].id + ".txt")).read_text()
    assert "blamed    rank 1 (lowest step)" in text and "exit_observed" in text


def test_full_output_prints_each_summary_with_its_stacks(tmp_path):
    write_incidents(tmp_path, ["alpha"])
    out = sidecar("--diag-dir", str(tmp_path), "--full")
    assert out.returncode == 0 and "Incident " in out.stdout and "timeline" in out.stdout


def _story_of_three_nodes() -> dict:
    """A real coordinator's story of a hang on node-1 (rank 1 killed there; node-0 and node-2 left
    to torchrun), each node's part with its recovery's stages; node-3 took part and sent none."""
    from sidecar.jobview.coordinator import Coordinator
    from sidecar.jobview.report import NodePart
    from tests.jobview.helpers import rank, report

    c = Coordinator(lambda job: job == "j1", lost_after=15.0, verdict_wait=3.0, max_nodes=16, probe=None)
    v = c.accept(report("node-0", rank(0)))
    assert v is not None
    gone = ("restarted_by_launcher", 17.3), ("exit_observed", 18.0)  # node-0 saw them gone at its first look
    stages = {
        "node-0": ({"detect": 4.81, "dump": 0.1, "decide": None, "kill": None, "restart": 2.41, "first_step": 0.2,
                    "hang_to_training": 10.0}, [("detected", 10.0), *gone]),
        "node-1": ({"detect": 4.72, "dump": 0.12, "decide": 0.3, "kill": 0.06, "restart": 0.05, "first_step": 0.2,
                    "redo": 1.5, "hang_to_training": 9.9},
                   [("detected", 10.1), ("sigterm", 15.1), ("exit_observed", 15.16)]),
        "node-2": ({"detect": 4.9, "dump": 0.09, "decide": None, "kill": None, "restart": 0.4, "first_step": None,
                    "hang_to_training": None}, [("detected", 10.2), ("restarted_by_launcher", 15.6)]),
    }  # fmt: skip
    for i, (node, (seconds, events)) in enumerate(stages.items()):
        outcome = "killed" if node == "node-1" else "left_to_launcher"
        part = NodePart(f"inc-{node}", outcome, [{"event": e, "time": t} for e, t in events], seconds)
        c.accept(report(node, rank(i, waiting=node != "node-1"), part=part, job_incident=v.job_incident))
    c.accept(report("node-3", rank(3)))
    story = c.story("j1")
    assert story is not None
    return json.loads(json.dumps(story))  # as the CLI gets it


def test_a_jobs_story_shows_every_nodes_recovery_stages_side_by_side_with_the_slowest_starred():
    from sidecar.commands.incidents import render_story

    lines = render_story(_story_of_three_nodes(), [], "").splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("stage "))
    assert lines[head].split() == ["stage", "node-0", "node-1", "node-2", "node-3"]
    rows = {line.split()[0]: line for line in lines[head + 1 :] if line.strip()}
    cells = {name: rows[name].split()[-4:] for name in ("detect", "kill", "restart", "first_step")}
    assert cells["detect"] == ["4.810", "4.720", "4.900*", "-"]
    assert cells["kill"] == ["?", "0.060", "?", "-"]  # left to torchrun: no kill of its own; node-3 sent none
    assert cells["restart"] == ["2.410*", "0.050", "0.400", "-"]
    assert cells["first_step"] == ["0.200", "0.200", "?", "-"]
    # when each node saw its ranks gone, from the job's first SIGTERM (node-1's): node-0's agent noticed last
    gone = next(line for line in lines if line.strip().startswith("ranks gone"))
    assert gone.split()[-4:] == ["2.200*", "0.060", "0.500", "?"]
    assert list(rows).index("ranks") == list(rows).index("kill") + 1
    assert "  slowest after the kill: restart on node-0, 2.410 s" in lines
    # of the whole, what the stages a node could not see hold: node-0 10 - 7.52, node-1 9.9 - 5.45 (redo is after)
    whole = next(line for line in lines if line.strip().startswith("hang_to_training"))
    assert whole.split()[-4:] == ["10.000*", "9.900", "?", "-"]
    unseen = next(line for line in lines if line.strip().startswith("not seen"))
    assert unseen.split()[-4:] == ["2.480", "4.450*", "?", "?"]


def test_a_story_without_stages_or_with_stages_of_any_shape_prints_no_broken_table():
    from sidecar.commands.incidents import render_story
    from sidecar.commands.recovery_table import recovery_table

    story = _story_of_three_nodes()
    for node in story["nodes"].values():
        if node["part"] is not None:
            node["part"]["stages"] = {}
    assert recovery_table(story) == [] and "recovery, seconds per stage" not in render_story(story, [], "")
    story["nodes"]["node-0"]["part"]["stages"] = {"kill": "fast", "restart": [1], "detect": True, "load": 1e400}
    story["nodes"]["node-1"]["part"]["stages"] = ["kill"]
    shown = render_story(story, [], "")
    assert "recovery, seconds per stage" in shown and "slowest after the kill: load on node-0" in shown
