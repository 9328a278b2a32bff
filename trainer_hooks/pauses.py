"""Phases the hooks infer: a healthy job's pauses that nobody declared.

A rank that evaluates for 8 s (`model.eval()`, forward passes, no optimizer step), waits 7 s on its
data loader, or writes a checkpoint for a minute makes no step meanwhile; at a 5 s floor the watchdog
would call that a hang unless the trainer declared the phase (`mon.phase("eval")`). So the hooks
watch for these pauses themselves, with wrappers that only write a flag on the training thread:

- `eval`: set by the outermost `torch.nn.Module.train(False)` (what `.eval()` calls) on a module
  that was training, or the first one; cleared by the outermost `.train(True)` on any module;
- `data_load`: set on entering a DataLoader iterator's `__next__` (`_BaseDataLoaderIter`), cleared
  on leaving it;
- `checkpoint_save`, `checkpoint_load`: set on entering `torch.save`, `torch.load`,
  `torch.distributed.checkpoint.save`, `async_save`, `load`, cleared on leaving them;
- `compile`: torch._dynamo's compile-start and compile-end callbacks.

The hooks' own sender thread reads the flags (`Inference.poll`, every `CHECK_SECONDS`). A flag
becomes a phase, sent as a declared one would be (`PHASE_START` with the flag's own start time; no
budget: the sidecar's `watchdog.phase_timeouts` apply), once it has been set for
`INFER_AFTER_SECONDS` with no progress (no step, no end of a declared phase) since it was set; the
sender wakes for that moment and pushes at once. The phase ends (`PHASE_END`) when the flag clears
or at the next progress, whichever comes first: a frozen-backbone `backbone.eval()` followed by
training steps, or a torch.save in a background thread while the training thread steps, never
becomes a phase. A flag cleared after its phase was
sent wakes the sender, so the end goes at once.

Declared phases come first: a phase is not inferred while the trainer has declared one of the
same name, and an inferred phase whose name the trainer declared inside it ends only after that
declared one (the sidecar ends the innermost phase of a name).

On the training thread a wrapper costs an attribute write or two and, for data and checkpoints,
two `time.time()` calls (`python -m bench.bench_hooks --pauses`). A wrapper never raises: an error
of its own turns the inference off, with one warning. `SIDECAR_INFER_PHASES=0` installs nothing.
The wrappers are installed once per process by the first `Monitor` (torch must be imported; a
module imported later is wrapped by the sender thread at its next cycle) and stay; with no live
Monitor they only write their flags.

Not inferred: `torch.no_grad()` evaluation without `.eval()`; a pause inside a module's own
`train` override that never calls `Module.train`; checkpoints written through a reference taken
before the wrappers were installed (`from torch import save` in a module imported earlier).
Under `python -m trainer_hooks.attach` the checkpoint functions are declared phases instead
(attach.py replaces these wrappers with its own).

The price: a rank that hangs inside one of these pauses (a deadlocked data loader, a collective
that never returns during evaluation, a frozen process mid-save) is judged by that phase's budget
(`watchdog.phase_timeouts`: data_load 1800 s, eval 3600 s, ...) instead of the step timeout.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from trainer_hooks.environment import switched_on
from trainer_hooks.errors import warn
from trainer_hooks.records import PHASE_END, PHASE_START

INFER_AFTER_SECONDS = 1.0  # a flag set this long with no progress since is a phase
CHECK_SECONDS = 0.25  # how often the sender looks at the flags between its flushes
SWITCH = "SIDECAR_INFER_PHASES"
MARK = "_trainer_hooks_pause"  # on every wrapper installed here
ATTACH_MARK = "_trainer_hooks_phase"  # on attach.py's declaring wrappers
_MIN_WAIT = 0.05
_time = time.time


class Pause:
    """One kind of pause: its flag (written on the training thread, read by the sender)."""

    __slots__ = ("name", "since", "ended", "announced")

    def __init__(self, name: str):
        self.name = name
        self.since = 0.0  # time.time() the flag was set; 0.0: not set
        self.ended = 0.0  # when the flag last cleared, written only while `announced`
        self.announced = False  # a sender sent its phase: the clear records `ended` and wakes it

    def __repr__(self) -> str:
        return f"Pause({self.name!r}, since={self.since}, announced={self.announced})"


EVAL = Pause("eval")
DATA = Pause("data_load")
SAVE = Pause("checkpoint_save")
LOAD = Pause("checkpoint_load")
COMPILE = Pause("compile")
PAUSES = (EVAL, DATA, SAVE, LOAD, COMPILE)

_wakers: tuple[Callable[[], None], ...] = ()  # the live inferences' sender wakes
_enabled = True  # False after a wrapper failed: the senders stop inferring
_train_depth = 0  # Module.train calls in progress (the recursion over children)


def enabled(environ: Mapping[str, str]) -> bool:
    """False when SIDECAR_INFER_PHASES switches the inference off."""
    return switched_on(environ, SWITCH)


def _ended(pause: Pause) -> None:
    """A flag whose phase was sent cleared: note when, and wake the senders (the rare path)."""
    try:
        pause.announced = False
        pause.ended = _time()
        for wake in _wakers:
            wake()
    except Exception as e:
        _failed("waking the sender", e)


def _failed(where: str, e: BaseException) -> None:
    global _enabled
    _enabled = False
    warn("pauses", "trainer_hooks: phase inference off, %s failed (%s: %s)", where, type(e).__name__, e)


# ---------------------------------------------------------------- wrappers (training thread)


def _wrap_train(original: Callable) -> Callable:
    @functools.wraps(original)
    def train(self: Any, mode: bool = True) -> Any:
        global _train_depth
        if _train_depth:  # a child of the module being switched (also through its own train override)
            return original(self, mode)
        try:
            was_training = self.training
        except Exception:  # a module without the attribute: the original raises its own error
            was_training = True
        _train_depth = 1
        try:
            result = original(self, mode)
        finally:
            _train_depth = 0
        try:
            pause = EVAL
            if mode:
                if pause.since:
                    pause.since = 0.0
                    if pause.announced:
                        _ended(pause)
            elif was_training or not pause.since:  # a real switch to eval, not eval() again
                pause.since = _time()
        except Exception as e:
            _failed("Module.train", e)
        return result

    return train


def _wrap_next(original: Callable) -> Callable:
    pause = DATA

    @functools.wraps(original)
    def __next__(self: Any) -> Any:
        if pause.since:  # an iterator inside another's __next__, or a second thread: the outer one times it
            return original(self)
        try:
            pause.since = _time()
        except Exception as e:
            _failed("DataLoader __next__", e)
            return original(self)
        try:
            return original(self)
        finally:
            pause.since = 0.0
            if pause.announced:
                _ended(pause)

    return __next__


def _wrap_checkpoint(original: Callable, pause: Pause) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if SAVE.since or LOAD.since or DATA.since:  # dcp.save calls torch.save inside, also from its
            return original(*args, **kwargs)  # writer threads; a torch.load in a Dataset is a data wait
        try:
            pause.since = _time()
        except Exception as e:
            _failed(pause.name, e)
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            pause.since = 0.0
            if pause.announced:
                _ended(pause)

    return wrapper


def _compile_start(args: Any = None) -> None:
    # torch._dynamo calls it once for the outermost compilation in progress (its own counter).
    try:
        if not COMPILE.since:
            COMPILE.since = _time()
    except Exception:
        pass


def _compile_end(args: Any = None) -> None:
    try:
        COMPILE.since = 0.0
        if COMPILE.announced:
            _ended(COMPILE)
    except Exception:
        pass


# ---------------------------------------------------------------- installation


# (module, owner attribute path or "", attribute, wrapper factory): patched once each, when the module is loaded
def _targets() -> tuple[tuple[str, str, str, Callable[[Callable], Callable]], ...]:
    return (
        ("torch.nn.modules.module", "Module", "train", _wrap_train),
        ("torch.utils.data.dataloader", "_BaseDataLoaderIter", "__next__", _wrap_next),
        ("torch", "", "save", lambda f: _wrap_checkpoint(f, SAVE)),
        ("torch", "", "load", lambda f: _wrap_checkpoint(f, LOAD)),
        ("torch.distributed.checkpoint", "", "save", lambda f: _wrap_checkpoint(f, SAVE)),
        ("torch.distributed.checkpoint", "", "load", lambda f: _wrap_checkpoint(f, LOAD)),
        ("torch.distributed.checkpoint", "", "async_save", lambda f: _wrap_checkpoint(f, SAVE)),
    )


_done: set[tuple[str, str, str]] = set()
_undo: list[Callable[[], None]] = []


def install() -> bool:
    """Wrap what is loaded and not wrapped yet (from any thread; never imports torch). True when
    everything is installed, including the compile callbacks (nothing left to retry)."""
    complete = True
    for module_name, owner_name, attr, factory in _targets():
        key = (module_name, owner_name, attr)
        if key in _done:
            continue
        module = sys.modules.get(module_name)
        owner = getattr(module, owner_name, None) if owner_name else module
        current = getattr(owner, attr, None) if owner is not None else None
        if current is None:  # not imported (yet), or importing right now
            complete = False
            continue
        _done.add(key)
        if getattr(current, MARK, False) or getattr(current, ATTACH_MARK, None):
            continue  # wrapped already: by an earlier install, or declared by attach.py
        wrapper = factory(current)
        # changes: pause-wrappers (docs/changes-to-others.md)
        setattr(wrapper, MARK, True)
        setattr(owner, attr, wrapper)
        _undo.append(functools.partial(setattr, owner, attr, current))
    return _install_compile() and complete


def _install_compile() -> bool:
    """Register the compile callbacks with torch._dynamo once it is loaded, and again after
    `torch._dynamo.reset()` cleared them. Never imports torch._dynamo (over a second)."""
    module = sys.modules.get("torch._dynamo.callback")
    handler = getattr(module, "callback_handler", None)
    if handler is None:
        return False
    starts = getattr(handler, "start_callbacks", None)
    if isinstance(starts, list) and _compile_start not in starts:
        # changes: compile-callbacks (docs/changes-to-others.md)
        handler.register_start_callback(_compile_start)
        handler.register_end_callback(_compile_end)
        if not any(u.func is _unregister_compile for u in _undo if isinstance(u, functools.partial)):
            _undo.append(functools.partial(_unregister_compile, handler))
    return False  # a reset may clear them again: keep checking (a list lookup per cycle)


def _unregister_compile(handler: Any) -> None:
    for remove, callback in (
        (handler.remove_start_callback, _compile_start),
        (handler.remove_end_callback, _compile_end),
    ):
        try:
            remove(callback)
        except ValueError:
            pass


def uninstall() -> None:
    """Put back what `install` replaced (tests; the wrappers are otherwise left in place)."""
    global _enabled
    while _undo:
        try:
            _undo.pop()()
        except Exception:
            pass
    _done.clear()
    for pause in PAUSES:
        pause.since, pause.ended, pause.announced = 0.0, 0.0, False
    _enabled = True


def _after_fork_in_child() -> None:
    global _wakers, _train_depth
    _wakers, _train_depth = (), 0
    for pause in PAUSES:
        pause.announced = False


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------- inference (sender thread)


class Progressing(Protocol):
    """What the inference reads of its Monitor."""

    _last_step_time: float  # the rank's last progress: a step or the end of a declared phase

    def _append(self, record: tuple) -> None: ...
    def _next_seq(self) -> int: ...
    def _declared_open(self, name: str) -> int: ...


class Inference:
    """One Monitor's inferred phases: `poll()` on its sender thread turns the flags into phase
    records in the Monitor's buffer; `due_in()` says when the sender must look next."""

    def __init__(
        self,
        monitor: Progressing,
        pauses: tuple[Pause, ...] = PAUSES,
        clock: Callable[[], float] = time.time,
        install_wrappers: bool = True,
    ):
        self.monitor = monitor
        self.pauses = pauses
        self.clock = clock
        self._open: dict[str, float] = {}  # name -> the flag's `since` of the phase sent
        self._installed = not install_wrappers
        self._wake: Callable[[], None] | None = None

    def start(self, wake: Callable[[], None]) -> None:
        """Install the wrappers (what is loaded now) and have their clears wake `wake`."""
        global _wakers
        self._wake = wake
        _wakers = (*_wakers, wake)
        self._install()

    def stop(self) -> None:
        global _wakers
        _wakers = tuple(w for w in _wakers if w is not self._wake)

    def _install(self) -> None:
        if not self._installed:
            try:
                self._installed = install()
            except Exception as e:
                self._installed = True
                _failed("installing the wrappers", e)

    def _due(self, pause: Pause, progress: float) -> float:
        """When `pause`'s flag becomes a phase (0.0: it does not)."""
        since = pause.since
        if not since or progress > since or self.monitor._declared_open(pause.name):
            return 0.0
        if pause.name in self._open:  # sent already, or an older one still waits for its end
            return 0.0
        return since + INFER_AFTER_SECONDS

    def due_in(self) -> float | None:
        """Seconds until a flag set now becomes a phase, or None when none will."""
        if not _enabled:
            return None
        try:
            progress = self.monitor._last_step_time
            due = [d for d in (self._due(p, progress) for p in self.pauses) if d]
        except Exception as e:
            _failed("the inference", e)
            return None
        return max(_MIN_WAIT, min(due) - self.clock()) if due else None

    def poll(self, install: bool = True) -> bool:
        """Append the ends of inferred phases that ended and the starts of those now due; True
        when something was appended. `install`: also wrap what was imported since (each flush)."""
        if install:
            self._install()
        if not _enabled or not (self._open or any(p.since for p in self.pauses)):
            return False
        try:
            return self._poll()
        except Exception as e:
            _failed("the inference", e)
            return False

    def _poll(self) -> bool:
        monitor, now = self.monitor, self.clock()
        progress = monitor._last_step_time
        by_name = {p.name: p for p in self.pauses}
        appended = False
        for name, since in sorted(self._open.items(), key=lambda kv: -kv[1]):  # innermost first
            pause = by_name[name]
            cleared = pause.since != since
            if not cleared and progress <= since:
                continue
            if monitor._declared_open(name):  # declared inside ours: the sidecar ends the innermost first
                continue
            ends = [t for t in (pause.ended if cleared else 0.0, progress) if t >= since and t > 0]
            at = min(ends) if ends else now
            monitor._append((monitor._next_seq(), PHASE_END, min(at, now), name, None))
            del self._open[name]
            appended = True
        due = sorted((p.since, p.name, p) for p in self.pauses if (d := self._due(p, progress)) and d <= now)
        for since, name, pause in due:
            monitor._append((monitor._next_seq(), PHASE_START, since, name, None))
            self._open[name] = since
            pause.announced = True
            if pause.since != since:  # cleared meanwhile: its wrapper saw no announcement
                pause.announced = False
            appended = True
        return appended

    @property
    def open(self) -> dict[str, float]:
        """The inferred phases sent and not ended: name -> start time."""
        return dict(self._open)
