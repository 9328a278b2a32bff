"""Exit reports are a rank's claim about itself: another local user cannot put an exception in
someone else's mouth, and what a user claims about its own rank is kept as text, clipped and
without control characters, never acted on."""

from __future__ import annotations

import json
import os
import signal

from tests.exits.helpers import RANK, exits_of, incidents, rank_env, wait_for_exit
from tests.security.rig import attack, open_sidecar
from tests.support import PYTHON, spawned, tail, wait_until
from tests.support.unpriv import unprivileged_user

OOM_REPORT = {
    "type": "torch.OutOfMemoryError",
    "types": ["torch.OutOfMemoryError"],
    "message": "CUDA out of memory",
    "traceback": [],
}


def test_another_user_cannot_report_an_exception_for_someone_elses_rank(tmp_path):
    mallory = unprivileged_user("m")
    with open_sidecar() as sidecar:
        env = {**rank_env(sidecar, "victim"), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        ready = tmp_path / "victim.ready"
        with spawned(
            [PYTHON, RANK, "--mode", "hold", "--ready", str(ready)], tmp_path / "victim.log", env=env
        ) as victim:
            wait_until(lambda: ready.exists() or victim.poll() is not None, 120, what="victim ready")
            assert victim.poll() is None, tail(tmp_path / "victim.log")
            result = attack(
                mallory,
                sidecar,
                f"""
                body = {{"job_id": "victim", "rank": 0, "pid": {victim.pid}, "reason": "exception",
                         "exit": {json.dumps(OOM_REPORT)}}}
                report(reply=request("/v1/deregister", body))
            """,
            )
            status, answer = result["reply"]
            assert status in (403, 409), answer
            assert [r["state"] for r in sidecar.status()["ranks"] if r["job_id"] == "victim"] != ["gone"]
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()
        exit_ = wait_for_exit(sidecar, "victim")
        assert exit_["reason"] == "signal", "the forged report changed nothing"
        (recorded,) = exits_of(sidecar, "victim")
        assert "exception" not in recorded


def test_a_users_claim_about_its_own_rank_is_clipped_text(tmp_path):
    mallory = unprivileged_user("m")
    with open_sidecar() as sidecar:
        result = attack(
            mallory,
            sidecar,
            r"""
            status, answer = request("/v1/register", registration(os.getpid(), "mallory", world_size=1))
            report_body = {"type": "\x1b[31mEvil\x07", "types": ["x" * 5_000] * 50,
                           "message": "/etc/shadow\x1b]0;owned\x07" + "m" * 100_000,
                           "traceback": ["/root/.ssh/id_rsa:1 in \x1b[2J"] * 100}
            body = {"job_id": "mallory", "rank": 0, "pid": os.getpid(), "reason": "exception",
                    "session": answer.get("session"), "exit": report_body}
            report(registered=status, dereg=request("/v1/deregister", body))
            sys.exit(1)
        """,
        )
        assert result["registered"] == 200 and result["dereg"][0] == 200, result
        wait_for_exit(sidecar, "mallory", timeout=60)
        (incident,) = [i for i in incidents(sidecar, "exit") if i["job_id"] == "mallory"]
        (recorded,) = incident["exits"]
        assert recorded["reason"] == "exception/other", recorded
        text = open(incident["path"][:-5] + ".txt").read()
        assert "\x1b" not in text and "\x07" not in text
        assert len(recorded["exception"]["message"]) <= 512 and len(recorded["exception"]["traceback"]) <= 12
        assert os.path.getsize(incident["path"]) < 64 * 1024


# ---------------------------------------------------------------- round 2, row 11

HOLD_A_RANK = """
    rank = sleeper()
    status, body = request("/v1/register", registration(rank.pid, "app-fault", world_size=1))
    report(reply=[status, body], pid=rank.pid)
    rank.wait()
"""


def test_row11_an_application_fault_xid_before_a_rank_dies_is_not_a_gpu_error(tmp_path):
    """XID 31 (a kernel's illegal memory access) is the application's fault, and any GPU user
    can cause it with their own kernel. A rank that died right after one used to be `gpu_error`,
    which feeds the "drain the node, replace the GPU" alert; now `gpu_app_fault`. Hardware XIDs
    (sidecar/collectors/xid.py HARDWARE_XIDS) stay `gpu_error` (tests/exits/test_exit_reasons.py)."""
    import time

    from tests.security.rig import start_as
    from tests.support import kill_tree

    mallory = unprivileged_user("mallory")
    spec = {"driver_version": "550.54.15", "gpu_count": 2, "xid_events": [{"gpu": 1, "xid": 31, "at_seconds": 2}]}
    spec_file = tmp_path / "nvml.json"
    spec_file.write_text(json.dumps(spec))
    with open_sidecar(
        "collectors.nvml_module=sidecar.testing.fake_nvml_lib", env={"SIDECAR_FAKE_NVML": str(spec_file)}
    ) as sidecar:
        holder, out = start_as(mallory, sidecar, HOLD_A_RANK)
        try:
            assert out["reply"][0] == 200, out
            spec["gpus"] = {"1": {"processes": [{"pid": out["pid"], "used_memory_bytes": 1 << 30}]}}
            spec_file.write_text(json.dumps(spec))
            wait_until(
                lambda: (
                    'sidecar_gpu_xid_errors_total{gpu="1",xid="31"}' in sidecar.metrics()
                    and 'sidecar_gpu_process_memory_bytes{gpu="1",job_id="app-fault",rank="0"}' in sidecar.metrics()
                ),
                60,
                what="the XID and the rank on its GPU",
            )
            time.sleep(1.5)  # one more exit-tracker poll after the collector round
            os.kill(out["pid"], signal.SIGKILL)
            exit_ = wait_for_exit(sidecar, "app-fault")
            assert exit_["reason"] == "gpu_app_fault", exit_
            (recorded,) = exits_of(sidecar, "app-fault")
            assert any("XID 31 on gpu 1 (it used)" in line for line in recorded["evidence"]), recorded
        finally:
            kill_tree(holder)
