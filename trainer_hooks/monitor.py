"""`Monitor`: what training code calls.

    mon = Monitor()
    mon.step(step, loss=loss, grad_norm=gn, lr=3e-4, samples=64, tokens=32768, step_time_seconds=dt)
    with mon.phase("checkpoint_save", timeout=600): ...
    mon.event("checkpoint_saved", step=17, path="/ckpt/step-17")
    mon.close()

On the training thread a call appends one tuple to a bounded deque and returns: no lock, no
copy, no I/O, no formatting, no tensor access (a tensor is stored as a reference and read by
the sender thread). A step with a CUDA tensor also records a CUDA event on that tensor's stream
(about 10 us on an H200 host, no synchronisation): the sender reads the values once the event
says the GPU has computed them, never waiting behind the work queued on the GPU. Everything
else happens on the sender thread (`sender.py`). Every call swallows its own errors: the hooks
never raise into training.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from trainer_hooks import collectives, distributed, environment, exits, jobview, pauses, stacks
from trainer_hooks.errors import warn
from trainer_hooks.records import EVENT, PHASE_END, PHASE_START, PLAIN_TYPES, STEP, gpu_device
from trainer_hooks.sender import Sender, Tuning
from trainer_hooks.wire import STEP_GAP_SEND_SECONDS, THREAD_EXCEPTION_EVENT

DEFAULT_BUFFER_SIZE = 10_000
CLOSE_BUDGET_SECONDS = 0.8
_FROM_ENV: Any = object()
_time = time.time


def _nothing() -> None:
    pass


_monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()


class Monitor:
    """Progress and metrics of one rank, pushed to the node's sidecar.

    Identity defaults come from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID); the sidecar's address
    and the switches from `SIDECAR_*` variables (see `environment.py`). Explicit arguments win.
    Create it after importing torch: the registration then reports torch, CUDA and NCCL versions,
    and the pauses nobody declares become phases at once (evaluation after `model.eval()`, data
    loader waits, torch.save/load, compile: `pauses.py`; SIDECAR_INFER_PHASES=0 turns that off).

    Args:
        job_id, rank, local_rank, world_size, local_world_size, restart_count: the rank's identity.
        enabled: False (or SIDECAR_HOOKS_DISABLED=1) makes every method a no-op.
        socket, url, token: the sidecar's Unix socket, or its `http://HOST:PORT` URL and bearer token.
        flush_interval: seconds between batches (default SIDECAR_FLUSH_INTERVAL, else what the
            sidecar suggests at registration, else 0.5).
        buffer_size: records kept while the sidecar is slow or away; the oldest are dropped
            (and counted) beyond it.
        diag_dir: ignored (kept for callers of hooks 0.1): the sidecar creates the rank's
            stack-dump file and tells the hooks its path at registration.
        stack_signal: signal number for stack dumps, None to disable (default
            SIDECAR_STACK_SIGNAL, else SIGUSR2).
        environ: the environment to read (default `os.environ`).
        connect_timeout, read_timeout, max_backoff: transport tuning, in seconds.
        observe_only: ask the sidecar to detect, count and report this job's stalls but never kill
            its ranks (default SIDECAR_OBSERVE_ONLY; the sidecar's `watchdog.allow_job_observe_only`
            may refuse it).
    """

    def __init__(
        self,
        job_id: str | None = None,
        rank: int | None = None,
        *,
        local_rank: int | None = None,
        world_size: int | None = None,
        local_world_size: int | None = None,
        restart_count: int | None = None,
        enabled: bool = True,
        socket: str | None = None,
        url: str | None = None,
        token: str | None = None,
        flush_interval: float | None = None,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        diag_dir: str | None = None,
        stack_signal: int | None = _FROM_ENV,
        environ: Mapping[str, str] | None = None,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        max_backoff: float | None = None,
        observe_only: bool | None = None,
    ):
        self._live = False
        self._closed = False
        self._pid = os.getpid()
        self._buffer: deque = deque(maxlen=max(1, int(buffer_size)))
        self._append = self._buffer.append
        self._next_seq = itertools.count().__next__
        self._sender: Sender | None = None
        self._last_step_time = 0.0  # _time() of the last step: a step long after it is sent at once
        self._wake: Callable[[], None] = _nothing
        self._declared: dict[str, int] = {}  # declared phases open, by name (pauses.py infers no such phase)
        self._pauses: pauses.Inference | None = None
        self._stack_dump: stacks.StackDump | None = None
        self.identity: environment.Identity | None = None
        try:
            # A worker forked from a process that imported the hooks before torchrun's environment
            # existed (sidecar_trainer.launch) installs here, when that environment is set.
            distributed.install_when_torch_is_imported()
            env = os.environ if environ is None else environ
            if not enabled or environment.disabled(env):
                return
            collectives.enable()  # the Flight Recorder, before the process group forms (if it has not)
            self.identity = environment.identity(
                env, job_id, rank, local_rank, world_size, local_world_size, restart_count, observe_only
            )
            endpoint = environment.endpoint(env, socket, url, token)
            signum = environment.stack_signal(env) if stack_signal is _FROM_ENV else stack_signal
            self._stack_dump = stacks.install(signum)
            interval = flush_interval or environment.flush_interval(env)
            given = (("connect_timeout", connect_timeout), ("read_timeout", read_timeout), ("max_backoff", max_backoff))
            overrides: dict[str, Any] = {k: v for k, v in given if v is not None}
            self._sender = Sender(
                self._buffer,
                endpoint,
                self.identity,
                self._pid,
                self._stack_dump,
                flush_interval=interval or environment.DEFAULT_FLUSH_INTERVAL,
                adopt_server_interval=interval is None,
                tuning=Tuning(**overrides),
            )
            self._wake = self._sender.wake
            self._sender.job_view_enabled = jobview.enabled(env)
            self._sender.collectives_enabled = collectives.enabled(env)
            if pauses.enabled(env):  # eval, data waits, checkpoints, compile: phases nobody declared
                self._pauses = pauses.Inference(self)
                self._pauses.start(self._sender.wake)
                self._sender.pauses = self._pauses
            self._live = True
            _monitors.add(self)
            atexit.register(self._close_at_exit)
            self._sender.start()
            exits.install(_close_all_on_exception, _report_thread_exception)
        except Exception as e:
            self._live = False
            warn("init", "trainer_hooks: monitoring disabled, setup failed (%s: %s)", type(e).__name__, e)

    # ---------------------------------------------------------------- hot path (training thread)

    def step(self, step: Any, **metrics: Any) -> None:
        """Record that `step` finished, with its metrics (numbers or 1-element tensors; None
        skipped). Well-known keys: loss, grad_norm, lr, step_time_seconds, samples, tokens,
        iterations_per_second, samples_per_second, tokens_per_second; others are custom metrics.

        A tensor is read later, on the sender thread: pass one that is not changed in place
        afterwards (`loss.detach()`, not a running accumulator that is reset). A step with a CUDA
        tensor goes once the GPU has computed it (a CUDA event marks it): never a wait for the GPU."""
        if self._live:
            try:
                now = _time()
                record = (self._next_seq(), STEP, now, step, metrics)
                if type(step) is not int:
                    record = _mark_gpu(record)
                else:
                    for value in metrics.values():
                        if type(value) not in PLAIN_TYPES:  # a tensor perhaps
                            record = _mark_gpu(record)
                            break
                self._append(record)
                if now - self._last_step_time >= STEP_GAP_SEND_SECONDS:
                    self._wake()  # the first step after a pause goes at once: the pause has ended
                self._last_step_time = now
            except Exception:
                pass

    def phase_start(self, name: str, timeout: float | None = None) -> None:
        """A declared phase (checkpoint_save, eval, ...) begins; `timeout` is its budget in seconds."""
        if self._live:
            try:
                self._declared[name] = self._declared.get(name, 0) + 1  # before the record: pauses.py
                self._append((self._next_seq(), PHASE_START, _time(), name, timeout))
                self._wake()  # the sidecar judges the phase by its own budget from now on
            except Exception:
                pass

    def phase_end(self, name: str) -> None:
        if self._live:
            try:
                now = _time()
                self._append((self._next_seq(), PHASE_END, now, name, None))
                if self._declared.get(name):
                    self._declared[name] -= 1
                self._last_step_time = now  # the end of a phase is progress, like a step
                self._wake()
            except Exception:
                pass

    def phase(self, name: str, timeout: float | None = None) -> Phase:
        """`with mon.phase("checkpoint_save", timeout=600): ...` sends start and end (end also
        when the block raises; the exception propagates unchanged)."""
        return Phase(self, name, timeout)

    def event(self, name: str, /, **fields: Any) -> None:
        """Something happened: `checkpoint_saved` (step, path), `rendezvous_done`, `data_loaded`,
        `checkpoint_loaded` (step, source: memory or disk), the other start-up milestones of
        `wire.WELL_KNOWN_EVENTS`, or any other name."""
        if self._live:
            try:
                self._append((self._next_seq(), EVENT, _time(), name, fields))
            except Exception:
                pass

    # ---------------------------------------------------------------- life cycle

    def close(
        self, reason: str = "finished", timeout: float = CLOSE_BUDGET_SECONDS, exit_report: dict | None = None
    ) -> None:
        """Flush what is buffered, deregister and stop the sender, within about `timeout`
        seconds even when the sidecar hangs. Idempotent; also runs at interpreter exit. Called
        while an exception propagates, the deregistration carries it (`exits.py`)."""
        if self._closed:
            return
        if exit_report is None:
            try:
                exit_report = exits.in_flight()
            except Exception:
                pass
        self._closed = True
        self._live = False
        if os.getpid() != self._pid:  # a forked child: the parent owns the registration and the file
            return
        try:
            atexit.unregister(self._close_at_exit)
            if self._pauses is not None:
                self._pauses.stop()
            if self._sender is not None:
                self._sender.stop(timeout, reason, exit_report)
        except Exception as e:
            warn("close", "trainer_hooks: close failed (%s: %s)", type(e).__name__, e)
        finally:
            if self._stack_dump is not None:
                try:
                    self._stack_dump.close()
                except Exception:
                    pass

    def _close_at_exit(self) -> None:
        uncaught = None
        try:
            uncaught = exits.uncaught_at_exit()
        except Exception:
            pass
        self.close(reason="exception" if uncaught else "exit", exit_report=uncaught)

    def _declared_open(self, name: str) -> int:
        """How many phases called `name` the trainer declared and has not ended (pauses.py)."""
        return self._declared.get(name, 0)

    def _forget_after_fork(self) -> None:
        self._live = False
        self._closed = True
        self._buffer.clear()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- introspection

    @property
    def enabled(self) -> bool:
        """True while calls are recorded (not disabled, not closed, not a forked copy)."""
        return self._live

    @property
    def dropped(self) -> int:
        """Records lost so far (buffer overflow, batches the sidecar never got)."""
        return self._sender.dropped() if self._sender else 0

    @property
    def sent(self) -> int:
        """Items the sidecar accepted."""
        return self._sender.sent if self._sender else 0

    @property
    def registered(self) -> bool:
        return bool(self._sender and self._sender.registered)

    @property
    def registrations(self) -> int:
        """Successful registrations: more than 1 means the hooks re-registered."""
        return self._sender.registrations if self._sender else 0

    @property
    def sender_cpu_seconds(self) -> float:
        """CPU time the background thread used so far (encoding, sending)."""
        return self._sender.cpu_seconds if self._sender else 0.0

    @property
    def stack_dump_path(self) -> str | None:
        """The dump file the sidecar created for this rank (None before the registration
        answer, or when the sidecar gave none)."""
        return self._stack_dump.path if self._stack_dump else None


def _gpu_marker(device: Any) -> Any:
    """A CUDA event recorded now on `device`'s current stream: done (`query()`) once the GPU has
    run the work queued there so far, the step's values among it. No synchronisation."""
    torch = sys.modules["torch"]  # a CUDA tensor came from it: the hooks never import it
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _mark_gpu(record: tuple) -> tuple:
    """A step record with its readiness marker as a 6th element when its step or a metric is a
    CUDA tensor (one marker for the record, on the first such tensor's device), else `record`.
    When no marker can be made the record stays as it is: the sender reads it when it comes to it."""
    try:
        device = gpu_device(record[3], record[4])
        return record if device is None else (*record, _gpu_marker(device))
    except Exception as e:
        warn("gpu_marker", "trainer_hooks: cannot mark a step's GPU values (%s: %s)", type(e).__name__, e)
        return record


class Phase:
    """The context manager `Monitor.phase` returns."""

    __slots__ = ("_monitor", "_name", "_timeout")

    def __init__(self, monitor: Monitor, name: str, timeout: float | None):
        self._monitor, self._name, self._timeout = monitor, name, timeout

    def __enter__(self) -> Phase:
        self._monitor.phase_start(self._name, self._timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        self._monitor.phase_end(self._name)


def _close_all_on_exception(report: dict) -> None:
    """sys.excepthook: the main thread dies of `report`; tell the sidecar, briefly."""
    for monitor in list(_monitors):
        monitor.close(reason="exception", timeout=exits.EXCEPTION_BUDGET_SECONDS, exit_report=report)


def _report_thread_exception(report: dict) -> None:
    for monitor in list(_monitors):
        monitor.event(
            THREAD_EXCEPTION_EVENT, type=report["type"], message=report["message"], thread=report.get("thread")
        )


def _after_fork_in_child() -> None:
    # The sender thread does not survive fork; a DataLoader worker must not speak for the rank.
    for monitor in list(_monitors):
        monitor._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
