"""Phases the hooks infer (trainer_hooks/pauses.py, issue 29 item 2): the flags the wrappers set on
the training thread, how the sender turns them into phases (a fake clock), and a real sidecar at a
5 s floor that no longer kills a healthy rank's 8 s evaluation, 7 s data wait or 7 s torch.save,
while a plain hang is still a stall."""

from __future__ import annotations

import datetime
import io
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.hooks.helpers import rank_status
from tests.support import PYTHON, ROOT, Sidecar, kill_tree, tail, wait_until
from trainer_hooks import Monitor, errors, pauses
from trainer_hooks.attach import Attachment
from trainer_hooks.records import PHASE_END, PHASE_START


@pytest.fixture(autouse=True)
def clean_pauses() -> Iterator[None]:
    """Each test starts with torch unwrapped and the flags down, and leaves them so."""
    pauses.uninstall()
    yield
    pauses.uninstall()


class FakeMonitor:
    """What the inference reads of a Monitor: its buffer, its last progress, its declared phases."""

    def __init__(self) -> None:
        self.records: list[tuple] = []
        self._last_step_time = 0.0
        self.declared_phases: dict[str, int] = {}
        self._seq = 0

    def _append(self, record: tuple) -> None:
        self.records.append(record)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _declared_open(self, name: str) -> int:
        return self.declared_phases.get(name, 0)

    def items(self) -> list[tuple[str, str, float]]:
        """(action, name, time) of each phase record, in order."""
        out = [("start" if kind == PHASE_START else "end", name, when) for _, kind, when, name, _ in self.records]
        self.records.clear()
        return out


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def inference(*kinds: pauses.Pause) -> tuple[pauses.Inference, FakeMonitor, Clock]:
    monitor, clock = FakeMonitor(), Clock()
    return pauses.Inference(monitor, kinds, clock, install_wrappers=False), monitor, clock


def clear(pause: pauses.Pause, at: float) -> None:
    """What a wrapper does when its call returns."""
    pause.since = 0.0
    if pause.announced:
        pause.announced, pause.ended = False, at


# ---------------------------------------------------------------- flag -> phase (fake clock)


def test_a_pause_becomes_a_phase_after_a_second_with_its_own_start_time():
    data = pauses.Pause("data_load")
    inf, mon, clock = inference(data)
    mon._last_step_time = 999.0
    data.since = 1000.0
    clock.now = 1000.6
    assert not inf.poll() and mon.items() == []
    assert inf.due_in() == pytest.approx(0.4)
    clock.now = 1001.0
    assert inf.poll()
    assert mon.items() == [("start", "data_load", 1000.0)]
    assert data.announced and inf.open == {"data_load": 1000.0}
    assert inf.due_in() is None and not inf.poll()  # sent once
    clock.now = 1007.0
    clear(data, 1007.0)
    clock.now = 1007.3
    assert inf.poll()
    assert mon.items() == [("end", "data_load", 1007.0)]  # when the flag cleared, not when seen
    assert inf.open == {}


def test_a_short_pause_is_no_phase():
    data = pauses.Pause("data_load")
    inf, mon, clock = inference(data)
    data.since = 1000.0
    clock.now = 1000.9
    clear(data, 1000.9)
    clock.now = 1002.0
    assert not inf.poll() and mon.items() == [] and inf.due_in() is None


def test_an_inferred_eval_ends_at_the_next_step_and_is_not_inferred_again():
    ev = pauses.Pause("eval")
    inf, mon, clock = inference(ev)
    mon._last_step_time = 999.5
    ev.since = 1000.0  # model.eval(), and the model stays in eval mode
    clock.now = 1001.5
    inf.poll()
    assert mon.items() == [("start", "eval", 1000.0)]
    mon._last_step_time = 1008.0  # a step, no model.train()
    clock.now = 1008.2
    inf.poll()
    assert mon.items() == [("end", "eval", 1008.0)]
    clock.now = 1020.0
    assert not inf.poll() and inf.due_in() is None  # the flag is still set: steps came since


def test_eval_mode_followed_by_steps_never_becomes_a_phase():
    """A frozen backbone: `backbone.eval()` once, then training steps; pauses between steps are
    the step timeout's to judge."""
    ev = pauses.Pause("eval")
    inf, mon, clock = inference(ev)
    ev.since = 1000.0
    mon._last_step_time = 1000.05
    for now in (1001.0, 1003.0, 1010.0):
        clock.now = now
        assert not inf.poll() and inf.due_in() is None
    assert mon.items() == []


def test_before_the_first_step_a_pause_is_inferred_too():
    ev = pauses.Pause("eval")
    inf, mon, clock = inference(ev)
    ev.since = 1000.0  # an evaluation before training: no progress yet
    clock.now = 1001.0
    inf.poll()
    assert mon.items() == [("start", "eval", 1000.0)]


def test_no_phase_is_inferred_while_the_trainer_declared_one_of_that_name():
    ev, data = pauses.Pause("eval"), pauses.Pause("data_load")
    inf, mon, clock = inference(ev, data)
    mon.declared_phases["eval"] = 1  # with mon.phase("eval"): model.eval(); ...
    ev.since = data.since = 1000.0
    clock.now = 1005.0
    inf.poll()
    assert mon.items() == [("start", "data_load", 1000.0)]  # only the undeclared one
    assert inf.due_in() is None


def test_a_declared_phase_opened_inside_an_inferred_one_of_that_name_ends_first():
    """The sidecar ends the innermost phase of a name: the inferred end must not end the declared one."""
    ev = pauses.Pause("eval")
    inf, mon, clock = inference(ev)
    ev.since = 1000.0
    clock.now = 1001.0
    inf.poll()
    assert mon.items() == [("start", "eval", 1000.0)]
    mon.declared_phases["eval"] = 1  # the trainer declares eval now, inside ours
    clear(ev, 1003.0)  # and calls model.train() inside its block
    clock.now = 1003.5
    assert not inf.poll() and mon.items() == []  # ours waits
    mon.declared_phases["eval"] = 0  # its end (progress)
    mon._last_step_time = 1004.0
    clock.now = 1004.1
    inf.poll()
    assert mon.items() == [("end", "eval", 1003.0)]


def test_nested_pauses_start_outermost_first_and_end_innermost_first():
    ev, data = pauses.Pause("eval"), pauses.Pause("data_load")
    inf, mon, clock = inference(data, ev)
    ev.since, data.since = 1000.0, 1000.5  # a slow batch inside the evaluation
    clock.now = 1002.0
    inf.poll()
    assert mon.items() == [("start", "eval", 1000.0), ("start", "data_load", 1000.5)]
    clear(data, 1005.0)
    clear(ev, 1005.1)
    clock.now = 1005.5
    inf.poll()
    assert mon.items() == [("end", "data_load", 1005.0), ("end", "eval", 1005.1)]


def test_a_pause_that_ended_unseen_ends_its_phase_and_the_next_one_starts_anew():
    data = pauses.Pause("data_load")
    inf, mon, clock = inference(data)
    data.since = 1000.0
    clock.now = 1001.0
    inf.poll()
    mon.items()
    data.since, data.announced = 0.0, False  # cleared before the announcement reached the wrapper
    data.since = 1004.0  # the next slow batch
    clock.now = 1004.2
    inf.poll()
    assert mon.items() == [("end", "data_load", 1004.2)]  # its end unknown: when seen
    clock.now = 1005.0
    inf.poll()
    assert mon.items() == [("start", "data_load", 1004.0)]


def test_the_inference_turned_off_infers_nothing():
    data = pauses.Pause("data_load")
    inf, mon, clock = inference(data)
    data.since = 1000.0
    clock.now = 1002.0
    pauses._enabled = False
    assert inf.due_in() is None and not inf.poll() and mon.items() == []


# ---------------------------------------------------------------- the wrappers (real torch)


class FrozenNorm(nn.BatchNorm1d):
    """A norm layer that always stays in eval mode (detectron-style frozen BN)."""

    def train(self, mode: bool = True):
        return super().train(False)


def test_the_eval_flag_follows_the_outermost_train_call():
    pauses.install()
    frozen = FrozenNorm(2)
    backbone = nn.Sequential(nn.ReLU(), frozen)
    model = nn.Sequential(nn.Linear(2, 2), backbone)
    model.train()
    assert pauses.EVAL.since == 0.0  # the frozen child's train(False) is not the model's mode
    model.eval()
    first = pauses.EVAL.since
    assert first > 0
    model.eval()  # again, in an evaluation loop: the evaluation began at the first
    assert pauses.EVAL.since == first
    model.train()
    assert pauses.EVAL.since == 0.0 and model.training and backbone.training and not frozen.training
    backbone.eval()  # a submodule (a frozen backbone)
    sub = pauses.EVAL.since
    time.sleep(0.002)
    model.eval()  # then the whole model: a new switch, a new start
    assert pauses.EVAL.since > sub
    with pytest.raises(ValueError):
        model.train("yes")  # type: ignore[arg-type]  # the original's own error, unchanged
    model.train()
    assert nn.Module.train.__wrapped__ is not None  # type: ignore[attr-defined]


class Items(Dataset):
    def __init__(self, fail_at: int = -1):
        self.seen: list[float] = []
        self.fail_at = fail_at

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> torch.Tensor:
        self.seen.append(pauses.DATA.since)
        if i == self.fail_at:
            raise KeyError(i)
        return torch.zeros(1)


def test_a_data_loader_batch_sets_the_flag_only_while_it_is_fetched():
    pauses.install()
    items = Items()
    for _ in DataLoader(items, batch_size=1):
        assert pauses.DATA.since == 0.0
    assert len(items.seen) == 3 and all(s > 0 for s in items.seen)
    assert pauses.DATA.since == 0.0  # cleared after StopIteration too
    failing = Items(fail_at=1)
    with pytest.raises(KeyError):
        list(DataLoader(failing, batch_size=1))
    assert pauses.DATA.since == 0.0


def test_a_data_loader_with_workers_sets_the_flag_while_the_training_thread_waits():
    pauses.install()
    loader = DataLoader(Items(), batch_size=1, num_workers=1)
    it = iter(loader)
    assert type(it).__name__ == "_MultiProcessingDataLoaderIter"
    assert type(it).__next__ is sys.modules["torch.utils.data.dataloader"]._BaseDataLoaderIter.__next__
    assert len(list(it)) == 3 and pauses.DATA.since == 0.0


def test_checkpoint_calls_set_their_flag_and_nested_ones_pass_through():
    pauses.install()
    seen = {}

    class Probe:
        def __reduce__(self):
            seen["save"] = pauses.SAVE.since
            inner = io.BytesIO()
            torch.save([1], inner)  # torch.save inside a save: the outer one times it
            seen["after_inner"] = pauses.SAVE.since
            return (list, ())

    buf = io.BytesIO()
    torch.save({"probe": Probe()}, buf)
    assert seen["save"] > 0 and seen["after_inner"] == seen["save"]
    assert pauses.SAVE.since == 0.0
    buf.seek(0)
    torch.load(buf, weights_only=False)
    assert pauses.LOAD.since == 0.0


def test_wrappers_are_installed_once_and_attach_declares_instead():
    pauses.install()
    wrapped_save, wrapped_train = torch.save, nn.Module.train
    assert getattr(wrapped_save, pauses.MARK)
    pauses._done.clear()
    pauses.install()  # again (a second Monitor): no wrapper around a wrapper
    assert torch.save is wrapped_save and nn.Module.train is wrapped_train
    assert not hasattr(torch.save.__wrapped__, pauses.MARK)  # type: ignore[attr-defined]

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def phase_start(self, name, timeout=None):
            self.calls.append(("start", name, pauses.SAVE.since))

        def phase_end(self, name):
            self.calls.append(("end", name))

        def event(self, name, **fields):
            self.calls.append(("event", name))

    recorder = Recorder()
    attachment = Attachment(recorder)  # type: ignore[arg-type]
    attachment._patch(torch, "save", "checkpoint_save", saved_event=True)
    assert torch.save.__wrapped__ is wrapped_save.__wrapped__  # type: ignore[attr-defined]  # replaced, not wrapped
    torch.save([1], io.BytesIO())
    assert recorder.calls == [
        ("start", "checkpoint_save", 0.0),
        ("end", "checkpoint_save"),
        ("event", "checkpoint_saved"),
    ]
    attachment._undo.pop()()
    assert torch.save is wrapped_save


def test_a_wrapper_error_turns_the_inference_off_with_one_warning(monkeypatch, caplog):
    pauses.install()
    monkeypatch.setattr(errors, "_last", {})  # the warning is rate-limited per key

    def broken() -> float:
        raise OSError("no clock")

    monkeypatch.setattr(pauses, "_time", broken)
    model = nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
        assert model.eval() is model  # training goes on
        model.train()
        list(DataLoader(Items(), batch_size=1))
    assert not pauses._enabled
    assert [r for r in caplog.records if "phase inference off" in r.getMessage()]
    inf, _, _ = inference(pauses.Pause("eval"))
    assert inf.due_in() is None


def test_compile_start_and_end_set_the_compile_flag():
    dynamo = pytest.importorskip("torch._dynamo")
    pauses.install()
    handler = dynamo.callback.callback_handler
    assert pauses._compile_start in handler.start_callbacks
    seen: list[float] = []
    handler.register_start_callback(lambda args: seen.append(pauses.COMPILE.since))  # after ours
    try:
        fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
        fn(torch.ones(3))
    finally:
        handler.start_callbacks.pop()
    assert seen and seen[0] > 0  # set while dynamo compiles
    assert pauses.COMPILE.since == 0.0  # cleared at its end
    dynamo.reset()  # clears every callback: the next install registers ours again
    assert pauses._compile_start not in handler.start_callbacks
    pauses.install()
    assert pauses._compile_start in handler.start_callbacks


# ---------------------------------------------------------------- a Monitor's sender


def quiet_monitor(tmp_path: Path, **environ: str) -> Monitor:
    """A monitor whose sidecar is absent: what it records stays in its buffer."""
    return Monitor(job_id="pauses", rank=0, world_size=1, socket=str(tmp_path / "absent.sock"), flush_interval=5.0,
                   stack_signal=None, environ=environ)  # fmt: skip


def phase_records(mon: Monitor) -> list[tuple[str, str, float]]:
    return [(kind, name, when) for _, kind, when, name, _ in list(mon._buffer) if kind in (PHASE_START, PHASE_END)]


def test_a_monitors_sender_wakes_for_an_inferred_start_within_about_a_second(tmp_path: Path):
    mon = quiet_monitor(tmp_path)
    try:
        model = nn.Linear(2, 2)
        mon.step(1)
        time.sleep(0.3)
        started = time.time()
        model.eval()
        found = wait_until(lambda: phase_records(mon), 5, interval=0.02, what="an inferred eval start")
        seen = time.time() - started
        assert found == [(PHASE_START, "eval", pauses.EVAL.since)]
        assert 1.0 <= seen < 2.0, seen  # the flush interval is 5 s: the sender woke for it
        model.train()
        ended = wait_until(lambda: phase_records(mon)[1:], 2, interval=0.02, what="its end")
        assert ended[0][:2] == (PHASE_END, "eval") and time.time() - started < 2.5  # the clear woke it
    finally:
        mon.close(timeout=0.2)


def test_declared_phases_are_counted_and_the_switch_turns_the_inference_off(tmp_path: Path):
    mon = quiet_monitor(tmp_path)
    try:
        assert mon._pauses is not None and torch.save.__dict__.get(pauses.MARK)
        with mon.phase("eval"):
            with mon.phase("eval"):
                assert mon._declared_open("eval") == 2
        assert mon._declared_open("eval") == 0
        mon.phase_end("eval")  # an end without a start
        assert mon._declared_open("eval") == 0
    finally:
        mon.close(timeout=0.2)
    pauses.uninstall()
    off = quiet_monitor(tmp_path, SIDECAR_INFER_PHASES="0")
    try:
        assert off._pauses is None and off._sender is not None and off._sender.pauses is None
        assert not hasattr(torch.save, pauses.MARK) and not hasattr(nn.Module.train, pauses.MARK)
    finally:
        off.close(timeout=0.2)


# ---------------------------------------------------------------- a real sidecar at a 5 s floor

FLOOR = 5.0
SETTINGS = (
    f"watchdog.floor_seconds={FLOOR}",
    "watchdog.check_interval_seconds=0.25",
    "remediation.dump_wait_seconds=0.5",
    "remediation.grace_seconds=1",
    "remediation.py_spy=false",
)


@pytest.fixture(scope="module")
def watching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A sidecar that kills stalled ranks, shared by the module's end-to-end tests (a job each)."""
    with Sidecar(tmp_path_factory.mktemp("sidecar"), *SETTINGS) as s:
        yield s


def stalls(sidecar: Sidecar, job: str) -> list[str]:
    return [
        ln
        for ln in sidecar.log.read_text(errors="replace").splitlines()
        if f"rank {job}/0" in ln and "-> stalled" in ln
    ]


def stalled_times(sidecar: Sidecar, job: str) -> list[float]:
    out = []
    for line in stalls(sidecar, job):
        stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
        assert stamp is not None, line
        out.append(datetime.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def incidents(sidecar: Sidecar, job: str) -> list[dict]:
    return [i for i in sidecar.status()["incidents"] if i["job_id"] == job]


def moments(log: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in log.read_text().splitlines():
        what, when = line.split()
        out.setdefault(what, float(when))
    return out


def run_pause(sidecar: Sidecar, tmp_path: Path, job: str, pause: str, seconds: float, infer: bool = True,
              limit: float = 60.0) -> tuple[int | None, dict[str, float], dict[str, float]]:  # fmt: skip
    """Run tests/hooks/pause_rank.py to its end (or `limit`), watching the sidecar's view of it:
    its exit code, the first time the sidecar showed each phase, and the rank's own moments."""
    log, out = tmp_path / f"{job}.moments", tmp_path / f"{job}.out"
    # Started as torchrun would (a launcher that restarts it), so a stall is killed; the hooks' flush
    # interval is the sidecar's default, 2 s.
    env = {**os.environ, **sidecar.hook_env(), "PYTHONPATH": str(ROOT), "SIDECAR_FLUSH_INTERVAL": "2",
           "TORCHELASTIC_RUN_ID": job, "TORCHELASTIC_MAX_RESTARTS": "3",
           "SIDECAR_INFER_PHASES": "1" if infer else "0"}  # fmt: skip
    cmd = [PYTHON, "-m", "tests.hooks.pause_rank", "--job", job, "--log", str(log), "--pause", pause,
           "--seconds", str(seconds)]  # fmt: skip
    phases: dict[str, float] = {}
    with open(out, "wb") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + limit
        while proc.poll() is None and time.monotonic() < deadline:
            r = rank_status(sidecar, job)
            if r and r.get("phase") and r["phase"] not in phases:
                phases[r["phase"]] = time.time()
            time.sleep(0.1)
        rc = proc.poll()
    finally:
        kill_tree(proc)
    print(f"{job}: exit {rc}, phases seen {phases}, moments {moments(log) if log.exists() else {}}\n{tail(out, 10)}")
    return rc, phases, moments(log) if log.exists() else {}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pause", "seconds", "phase"),
    [("eval", 8.0, "eval"), ("data", 7.0, "data_load"), ("save", 7.0, "checkpoint_save")],
)
def test_a_healthy_pause_longer_than_the_floor_is_no_stall(watching, tmp_path: Path, pause, seconds, phase):
    """A rank stepping every 50 ms pauses `seconds` at a 5 s floor, declaring nothing: the hooks
    infer the phase, its start reaches the sidecar about a second into the pause (before, each of
    these was a stall and a kill: see the SIDECAR_INFER_PHASES=0 test), and no stall is declared."""
    job = f"pause-{pause}"
    rc, phases, at = run_pause(watching, tmp_path, job, pause, seconds)
    assert stalls(watching, job) == [] and incidents(watching, job) == []
    assert rc == 0 and "done" in at
    assert phase in phases, phases
    late = phases[phase] - at["pause_start"]
    print(f"{phase}: shown by the sidecar {late:.2f} s into the pause")
    assert 0.9 <= late <= 2.5, late  # INFER_AFTER_SECONDS, the push, the status poll


@pytest.mark.slow
def test_without_the_inference_an_eval_pause_is_a_stall(watching, tmp_path: Path):
    """The same 8 s evaluation with SIDECAR_INFER_PHASES=0: declared stalled at the floor, killed."""
    job = "pause-eval-off"
    rc, phases, at = run_pause(watching, tmp_path, job, "eval", 8.0, infer=False)
    assert stalls(watching, job) and incidents(watching, job)
    assert rc != 0 and "done" not in at and phases == {}


@pytest.mark.slow
def test_a_hang_outside_any_inferred_phase_is_still_a_stall(watching, tmp_path: Path):
    """A sleep in the training loop, the model in train mode: no flag is set, the floor applies."""
    job = "pause-hang"
    rc, phases, at = run_pause(watching, tmp_path, job, "hang", 30.0, limit=25.0)
    declared = stalled_times(watching, job)
    assert declared and incidents(watching, job) and rc is not None and rc != 0 and phases == {}
    last_step = max(v for k, v in at.items() if k.startswith("step"))
    assert FLOOR <= declared[0] - last_step <= FLOOR + 3.5, declared[0] - last_step
