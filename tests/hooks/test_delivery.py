"""What a rank sends reaches a real sidecar: steps, metrics, phases, events, non-finite values."""

from __future__ import annotations

import http.client
import json
import math
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.hooks.helpers import TOKEN, RankProcess, metric_value, rank_env, rank_status, run_rank
from tests.support import wait_until


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("sidecar", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def test_steps_and_metrics_arrive_in_status_and_metrics(sidecar, tmp_path: Path, ranks):
    rank = RankProcess(tmp_path, rank_env(sidecar, "delivery-steps"), "--steps", "30")
    ranks.append(rank)
    seen = wait_until(
        lambda: (r := rank_status(sidecar, "delivery-steps")) and r["step"] == 30 and r,
        30,
        what="step 30 in /v1/status",
    )
    assert seen["pid"] == rank.pid
    assert seen["loss"] == 1 / 30 and seen["grad_norm"] == 0.5 and seen["lr"] == 3e-4
    assert seen["state"] != "gone"
    text = sidecar.metrics()
    labels = {"job_id": "delivery-steps", "rank": "0"}
    assert metric_value(text, "sidecar_training_step", **labels) == 30
    assert metric_value(text, "sidecar_training_loss", **labels) == 1 / 30
    assert metric_value(text, "sidecar_training_tokens_per_second", **labels) > 0
    result = rank.finish()
    assert result["sent"] == 30 and result["dropped"] == 0 and result["registrations"] == 1


def test_close_deregisters_the_rank(sidecar, tmp_path: Path):
    run_rank(tmp_path, rank_env(sidecar, "delivery-close"), "--steps", "3")
    wait_until(
        lambda: (r := rank_status(sidecar, "delivery-close")) and r["state"] == "gone", 10, what="rank gone after close"
    )


def test_phase_is_current_while_its_block_runs(sidecar, tmp_path: Path, ranks):
    inside = tmp_path / "leave-phase"
    rank = RankProcess(
        tmp_path,
        rank_env(sidecar, "delivery-phase"),
        "--steps",
        "5",
        "--checkpoint-at",
        "5",
        "--hold-in-phase",
        str(inside),
    )
    ranks.append(rank)
    wait_until(
        lambda: (r := rank_status(sidecar, "delivery-phase")) and r["phase"] == "checkpoint_save",
        30,
        what="phase checkpoint_save in /v1/status",
    )
    assert (
        metric_value(sidecar.metrics(), "sidecar_training_phase", job_id="delivery-phase", phase="checkpoint_save") == 1
    )
    inside.touch()
    wait_until(lambda: rank_status(sidecar, "delivery-phase")["phase"] is None, 10, what="phase ended")
    rank.finish()


def test_checkpoint_event_arrives(sidecar, tmp_path: Path, ranks):
    rank = RankProcess(tmp_path, rank_env(sidecar, "delivery-event"), "--steps", "12", "--checkpoint-at", "7")
    ranks.append(rank)
    wait_until(
        lambda: metric_value(sidecar.metrics(), "sidecar_training_last_checkpoint_step", job_id="delivery-event") == 7,
        30,
        what="last checkpoint step 7",
    )
    rank.finish()


def test_phase_ends_when_its_block_raises(sidecar, tmp_path: Path, ranks):
    rank = RankProcess(
        tmp_path, rank_env(sidecar, "delivery-raise"), "--steps", "4", "--checkpoint-at", "2", "--raise-in-phase"
    )
    ranks.append(rank)
    wait_until(lambda: (r := rank_status(sidecar, "delivery-raise")) and r["step"] == 4, 30, what="step 4")
    assert rank_status(sidecar, "delivery-raise")["phase"] is None
    assert rank.finish()["raised"] == ["KeyError('disk full')"]


def test_nan_loss_arrives_as_nonfinite_not_as_a_rejected_batch(sidecar, tmp_path: Path, ranks):
    rank = RankProcess(tmp_path, rank_env(sidecar, "delivery-nan"), "--steps", "10", "--nan-loss-at", "10")
    ranks.append(rank)
    wait_until(lambda: (r := rank_status(sidecar, "delivery-nan")) and r["step"] == 10, 30, what="step 10")
    text = sidecar.metrics()
    assert metric_value(text, "sidecar_training_nonfinite_total", job_id="delivery-nan", metric="loss") == 1
    assert math.isnan(metric_value(text, "sidecar_training_loss", job_id="delivery-nan"))
    result = rank.finish()
    assert result["sent"] == 10 and result["dropped"] == 0


def test_torch_tensor_metrics_arrive_as_numbers(sidecar, tmp_path: Path, ranks):
    rank = RankProcess(tmp_path, rank_env(sidecar, "delivery-torch"), "--steps", "5", "--tensors", "torch")
    ranks.append(rank)
    seen = wait_until(lambda: (r := rank_status(sidecar, "delivery-torch")) and r["step"] == 5 and r, 60, what="step 5")
    assert abs(seen["loss"] - 0.2) < 1e-6 and seen["grad_norm"] == 0.5
    assert rank.finish()["dropped"] == 0


def test_tensors_are_read_on_the_sender_thread_not_the_training_thread(sidecar, tmp_path: Path):
    result = run_rank(tmp_path, rank_env(sidecar, "delivery-duck"), "--steps", "5", "--tensors", "duck")
    assert result["tensor_readers"] == ["trainer_hooks-sender"]
    assert result["sent"] == 5


def test_tcp_push_works_with_the_token_and_is_refused_without(sidecar, tmp_path: Path):
    env = rank_env(None, "delivery-tcp", SIDECAR_URL=sidecar.url, SIDECAR_TOKEN=TOKEN)
    result = run_rank(tmp_path, env, "--steps", "5")
    assert result["sent"] == 5 and result["registrations"] == 1
    refused = run_rank(tmp_path, rank_env(None, "delivery-notoken", SIDECAR_URL=sidecar.url), "--steps", "5")
    assert refused["registrations"] == 0 and refused["sent"] == 0


def test_rejected_batch_is_dropped_and_later_batches_arrive(sidecar, tmp_path: Path):
    # Steps 1-5 carry two custom metrics, one more than the sidecar allows (429 limit_exceeded);
    # after a pause, steps 6-10 carry none. The pause outlasts the 2 s flush, so steps 2-5 go out
    # before it ends (step 1, the first, and step 6, the first after the pause, go out at once).
    result = run_rank(
        tmp_path,
        rank_env(sidecar, "delivery-rejected"),
        "--steps",
        "10",
        "--custom-until",
        "5",
        "--pause-after",
        "5",
        "--pause-seconds",
        "2.5",
    )
    assert result["dropped"] == 5 and result["sent"] == 5
    seen = rank_status(sidecar, "delivery-rejected")
    assert seen["step"] == 10 and seen["dropped"] == 5


def test_unknown_rank_answer_makes_the_hooks_register_again(sidecar, tmp_path: Path, ranks):
    rank = RankProcess(tmp_path, rank_env(sidecar, "delivery-409"), "--steps", "0", "--sleep", "0.02")
    ranks.append(rank)
    wait_until(lambda: (r := rank_status(sidecar, "delivery-409")) and (r["step"] or 0) >= 5, 30, what="steps")
    # Someone allowed to (the rank's launcher, over the Unix socket) forgets the rank: its
    # pushes get 409. Over TCP that takes the rank's session, which only the rank has.
    body = json.dumps({"job_id": "delivery-409", "rank": 0, "pid": rank.pid, "reason": "test"}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(
            urllib.request.Request(sidecar.url + "/v1/deregister", data=body, headers=headers), timeout=10
        )
    assert refused.value.code == 409
    conn = UnixHTTPConnection(sidecar.socket)
    conn.request("POST", "/v1/deregister", body, {"Content-Type": "application/json"})
    assert conn.getresponse().status == 200
    conn.close()
    wait_until(
        lambda: (r := rank_status(sidecar, "delivery-409")) and r["state"] != "gone", 30, what="rank registered again"
    )
    result = rank.finish()
    assert result["registrations"] == 2


def test_steps_rolled_back_by_the_trainer_still_arrive(sidecar, tmp_path: Path):
    # Steps 1-10, then a restore to step 4 and steps 4-8 (a rollback after a loss spike).
    result = run_rank(tmp_path, rank_env(sidecar, "delivery-rewind"), "--steps", "10", "--rewind-to", "4")
    assert result["sent"] == 15 and result["dropped"] == 0 and result["registrations"] == 2
    assert rank_status(sidecar, "delivery-rewind")["step"] == 8


def test_hooks_called_from_several_threads_lose_nothing(sidecar, tmp_path: Path):
    # 200 steps on the main thread while 4 threads send 2000 events each.
    result = run_rank(
        tmp_path,
        rank_env(sidecar, "delivery-threads"),
        "--steps",
        "200",
        "--sleep",
        "0.001",
        "--event-threads",
        "4",
        "--events-per-thread",
        "2000",
        "--buffer-size",
        "20000",
        "--wait-sent",
        str(200 + 4 * 2000),
    )
    assert result["sent"] == 200 + 4 * 2000 and result["dropped"] == 0
    assert rank_status(sidecar, "delivery-threads")["step"] == 200


def test_forked_child_does_not_speak_for_the_rank(sidecar, tmp_path: Path, ranks):
    # At step 5 the rank forks a child that steps to 1000005, sends an event and a phase,
    # and closes (which would deregister the rank), then lives on for a while.
    rank = RankProcess(tmp_path, rank_env(sidecar, "forked"), "--steps", "10", "--fork-at", "5")
    ranks.append(rank)
    wait_until(lambda: (r := rank_status(sidecar, "forked")) and r["step"] == 10, 30, what="step 10")
    seen = rank_status(sidecar, "forked")
    assert seen["pid"] == rank.pid and seen["state"] != "gone"
    result = rank.finish()
    assert result["sent"] == 10 and result["registrations"] == 1
