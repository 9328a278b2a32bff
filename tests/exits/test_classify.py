"""The decision rules, on real exceptions (torch's own types and messages, through the hooks'
report and the wire parser) and on evidence combinations. Torch is imported by the tests that
raise its types, not at collection (every test worker collects this module)."""

from __future__ import annotations

import functools
import json
import os
import signal

import pytest

from sidecar.exits.reasons import Evidence, decide, exception_kind
from sidecar.ranks import protocol
from trainer_hooks import exits as hook_exits

GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 3000ms for recv operation to complete"
)  # torch 2.13, seen in tests/exits/test_torchrun.py
NCCL_WATCHDOG = (
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
    "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out."
)


def wire(exc: BaseException) -> protocol.ExitReport:
    """What the sidecar gets: the hooks' report of `exc`, through JSON and the parser."""
    try:
        raise exc
    except BaseException as e:
        body = {"job_id": "j", "rank": 0, "pid": 1234, "reason": "exception", "exit": hook_exits.report(e)}
    return protocol.parse_deregistration(json.loads(json.dumps(body))).exit


def torch_error(name: str, message: str) -> BaseException:
    """torch.distributed's, torch's or a builtin exception type `name`, as torch raises it."""
    import builtins

    import torch
    import torch.distributed as dist

    return getattr(next(where for where in (dist, torch, builtins) if hasattr(where, name)), name)(message)


def test_torch_out_of_memory_is_cuda_oom():
    report = wire(torch_error("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert report.type == "torch.OutOfMemoryError" and "RuntimeError" in report.types
    assert exception_kind(report) == "cuda_oom"


@pytest.mark.parametrize(
    "exc",
    [
        ("RuntimeError", GLOO_TIMEOUT),
        ("DistBackendError", NCCL_WATCHDOG),
        ("DistStoreError", "wait timeout after 30000ms, keys: /default_pg/0//cuda//0"),
    ],
    ids=["gloo", "nccl", "store"],
)
def test_collective_timeouts_as_torch_raises_them(exc):
    assert exception_kind(wire(torch_error(*exc))) == "collective_timeout"


@pytest.mark.parametrize(
    "exc",
    [
        (
            "RuntimeError",
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:23456",
        ),
        ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"),
        ("DistNetworkError", "Connection reset by peer"),
    ],
    ids=["gloo-peer-gone", "nccl-error", "network"],
)
def test_other_communication_errors(exc):
    assert exception_kind(wire(torch_error(*exc))) == "communication"


def test_torchs_own_nonfinite_guard_is_nonfinite():
    import torch

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([float("nan"), 1.0])
    with pytest.raises(RuntimeError) as caught:
        torch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert exception_kind(wire(caught.value)) == "nonfinite"


@pytest.mark.parametrize(
    "exc", [ValueError("bad config"), KeyError("x"), RuntimeError("DataLoader timed out after 30 seconds")]
)
def test_everything_else_is_other(exc):
    assert exception_kind(wire(exc)) == "other", "a timeout outside torch.distributed is not a collective one"


def test_the_report_is_bounded():
    def deep(n):
        if n == 0:
            raise RuntimeError("x" * 10_000 + "\nsecond line")
        deep(n - 1)

    with pytest.raises(RuntimeError) as caught:
        deep(50)
    report = hook_exits.report(caught.value)
    assert len(report["message"]) == hook_exits.MAX_TEXT and "second line" not in report["message"]
    assert len(report["traceback"]) == hook_exits.MAX_FRAMES
    assert report["traceback"][-1].endswith("in deep")
    assert len(json.dumps(report)) < 10_000


def test_the_parser_clips_and_refuses_wrong_types():
    huge = {"type": "E" * 5000, "types": ["E"] * 100, "message": "m" * 5000, "traceback": ["f"] * 100}
    report = protocol.parse_deregistration({"job_id": "j", "rank": 0, "pid": 5, "exit": huge}).exit
    assert len(report.type) == protocol.EXIT_MAX_TEXT and len(report.types) == protocol.EXIT_MAX_TYPES
    assert len(report.traceback) == protocol.EXIT_MAX_FRAMES
    for bad in ({"type": 5}, {"types": "x"}, {"traceback": [1]}, []):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_deregistration({"job_id": "j", "rank": 0, "pid": 5, "exit": bad})


# ---------------------------------------------------------------- precedence

KILLED = signal.SIGKILL  # a wait status of a SIGKILLed process is the signal number
EXIT_1 = 1 << 8


@functools.cache
def oom() -> protocol.ExitReport:
    return wire(torch_error("OutOfMemoryError", "CUDA out of memory"))


def test_our_own_kill_comes_first():
    ev = Evidence(status=signal.SIGTERM, status_source="pidfd", remediated_by="inc-1", report=oom())
    assert decide(ev)[0] == "watchdog"


def test_a_zero_status_is_finished_whatever_the_rank_said():
    assert decide(Evidence(status=0, status_source="pidfd", report=oom(), deregistered="failed"))[0] == "finished"


def test_the_kernels_oom_kill_outranks_the_report_and_needs_sigkill():
    cgroup = "oom_kill 0 -> 1 in /sys/fs/cgroup/memory/x"
    assert decide(Evidence(status=KILLED, status_source="pidfd", oom_cgroup=cgroup))[0] == "oom_killed"
    assert (
        decide(Evidence(status=EXIT_1, status_source="pidfd", oom_cgroup=cgroup, report=oom()))[0]
        == "exception/cuda_oom"
    ), "a rank that exited by itself was not the OOM killer's victim"


def test_an_xid_on_its_gpu_outranks_the_report():
    ev = Evidence(status=EXIT_1, status_source="pidfd", report=oom(), xid=("3", 79, 1.0))
    assert decide(ev)[0] == "gpu_error"


def test_an_application_fault_xid_is_not_a_gpu_error():
    """13, 31, 43: the application's own fault (any GPU user can cause one), not the hardware's."""
    for xid in (13, 31, 43):
        assert decide(Evidence(status=KILLED, status_source="pidfd", xid=("0", xid, 1.0)))[0] == "gpu_app_fault"


def test_without_a_report_the_status_decides():
    assert decide(Evidence(status=signal.SIGTERM, status_source="pidfd"))[0] == "signal"
    assert decide(Evidence(status=EXIT_1, status_source="pidfd"))[0] == "nonzero_exit"
    assert decide(Evidence())[0] == "unknown"
    assert decide(Evidence(deregistered="finished"))[0] == "finished"
    assert os.WIFSIGNALED(KILLED)


# ---------------------------------------------------------------- rollback hint across restarts


def _rank(restart: int, checkpoints, nonfinite):
    from sidecar.ranks.model import Rank

    r = Rank(
        job_id="j",
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        pid=100 + restart,
        pid_start_time=1.0,
        restart_count=restart,
    )
    r.checkpoints.extend(checkpoints)
    r.first_nonfinite_loss = nonfinite
    return r


def test_the_hint_skips_a_checkpoint_saved_after_the_loss_went_bad_even_after_a_restart():
    from sidecar.exits.rollback import RollbackMemory

    memory = RollbackMemory()
    # attempt 0: checkpoints at 4 and 8, NaN from step 9 on, and the checkpoint at 12 saved from NaN weights
    first = _rank(0, [(4, "/c/step-4", 40.0), (8, "/c/step-8", 80.0), (12, "/c/step-12", 120.0)], (9, 90.0))
    assert memory.hint(first) == {"first_nonfinite_loss_step": 9, "checkpoint_step": 8, "checkpoint_path": "/c/step-8"}
    # attempt 1 resumed from the poisoned step 12 and goes NaN at 13: still step 8
    second = _rank(1, [], (13, 130.0))
    assert memory.hint(second) == {"first_nonfinite_loss_step": 9, "checkpoint_step": 8, "checkpoint_path": "/c/step-8"}


def test_no_hint_without_a_nonfinite_loss():
    from sidecar.exits.rollback import RollbackMemory

    assert RollbackMemory().hint(_rank(0, [(4, "/c/step-4", 40.0)], None)) is None


# ---------------------------------------------------------------- the kernel's counters, both layouts


@pytest.mark.parametrize(
    "version,name,text",
    [
        (2, "memory.events", "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n"),
        (1, "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
    ],
)
def test_oom_kill_counters_of_cgroup_v2_and_v1(tmp_path, version, name, text):
    from sidecar.exits.kernel import MemoryCgroup

    (tmp_path / name).write_text(text)
    cgroup = MemoryCgroup(str(tmp_path), os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), version)
    try:
        assert cgroup.oom_kills() == int(text.split("oom_kill ")[1].split()[0])
        (tmp_path / name).unlink()
        (tmp_path / name).symlink_to("/proc/self/status")
        assert cgroup.oom_kills() is None, "a symlink is never followed"
    finally:
        cgroup.close()


def test_the_memory_cgroup_of_a_live_process_is_the_kernels(spawn):
    from sidecar.exits.kernel import memory_cgroup_of
    from sidecar.host import procs

    p = spawn()
    cgroup = memory_cgroup_of(p.pid, procs.start_time(p.pid))
    if cgroup is None:
        pytest.skip("no memory cgroup hierarchy mounted here")
    try:
        assert str(p.pid) in open(os.path.join(cgroup.path, "cgroup.procs")).read().split()
        assert cgroup.oom_kills() is not None
    finally:
        cgroup.close()
    assert memory_cgroup_of(p.pid, 12345.0) is None, "another process by now: nothing opened"
