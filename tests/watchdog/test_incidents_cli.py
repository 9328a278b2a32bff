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
