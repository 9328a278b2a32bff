"""Watch an unmodified training script: `python -m trainer_hooks.attach script.py [args...]`.

Under torchrun, put it in front of the script with torchrun's `-m`:

    torchrun --standalone --nproc-per-node 8 --max-restarts 3 -m trainer_hooks.attach train.py --lr 3e-4

(`-m trainer_hooks.attach -m package.module args...` runs a module instead of a file.) The script
runs as `__main__` with its own `sys.argv`, exactly as `python script.py` would run it, and the
rank is watched with no code change:

- it registers with the node's sidecar at start (a `Monitor`, identity from torchrun's environment);
- every optimizer step is a step (torch's global `register_optimizer_step_post_hook`): the step
  number is the most steps any one optimizer has taken, with the step time and the first param
  group's learning rate;
- `torch.save` / `torch.load` and `torch.distributed.checkpoint.save` / `load` run inside the
  `checkpoint_save` / `checkpoint_load` phases (judged by their own budgets, not the step timeout),
  and a finished save sends `checkpoint_saved` with the step (these wrappers replace the Monitor's
  own, which infer a checkpoint phase only for a save or load of a second or more: `pauses.py`);
- evaluation (`model.eval()` until `model.train()` or the next step), data loader waits and
  compilation of a second or more are inferred phases, as for any Monitor (`pauses.py`);
- the process group is restart-safe (`trainer_hooks.distributed.install()`).

Without touching the command line: `SIDECAR_ATTACH=1` and the directory that
`python -m trainer_hooks.attach --pythonpath` prints on PYTHONPATH attach every torchrun worker
at start (`autoattach/sitecustomize.py`).

With no sidecar reachable the Monitor drops its records, as it always does: training runs as it
would without the wrapper. `SIDECAR_HOOKS_DISABLED=1` runs the script with nothing attached.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import time
from collections.abc import Callable
from typing import Any

from trainer_hooks import distributed, environment, pauses
from trainer_hooks.errors import warn
from trainer_hooks.monitor import Monitor

USAGE = "usage: python -m trainer_hooks.attach (SCRIPT | -m MODULE) [ARGS...] | --pythonpath"


def step_metrics(optimizer: Any, last: float | None) -> tuple[dict[str, Any], float]:
    """What an optimizer step tells without touching the training tensors: the time since the
    previous step (`last`, a perf_counter reading, None at the first) and the learning rate of
    the first parameter group. Returns the metrics and the reading to pass next time."""
    now = time.perf_counter()
    metrics: dict[str, Any] = {}
    if last is not None:
        metrics["step_time_seconds"] = now - last
    try:
        metrics["lr"] = float(optimizer.param_groups[0]["lr"])
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        pass
    return metrics, now


class Attachment:
    """What the wrapper hooks into torch; `close()` takes it all out again."""

    def __init__(self, monitor: Monitor):
        self.monitor = monitor
        self._counts: dict[int, int] = {}
        self._step = 0
        self._last: float | None = None
        self._depth = 0  # checkpoint calls in progress, any thread
        self._undo: list[Callable[[], None]] = []

    # ---------------------------------------------------------------- steps

    def on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            key = id(optimizer)
            count = self._counts.get(key, 0) + 1
            self._counts[key] = count
            if count <= self._step:  # a second optimizer catching up within the same step
                return
            self._step = count
            metrics, self._last = step_metrics(optimizer, self._last)
            self.monitor.step(count, **metrics)
        except Exception:
            pass

    # ---------------------------------------------------------------- checkpoint phases

    def _phased(self, original: Callable, phase: str, saved_event: bool) -> Callable:
        attachment = self

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if attachment._depth:  # dcp.save calls torch.save inside, from its writer threads too:
                return original(*args, **kwargs)  # one phase for the whole
            attachment._depth += 1
            attachment.monitor.phase_start(phase)
            try:
                result = original(*args, **kwargs)
            finally:
                attachment._depth -= 1
                attachment.monitor.phase_end(phase)
            if saved_event:
                target = args[1] if len(args) > 1 else kwargs.get("f", kwargs.get("checkpoint_id"))
                fields: dict[str, Any] = {"step": attachment._step}
                if isinstance(target, (str, os.PathLike)):
                    fields["path"] = os.fspath(target)
                attachment.monitor.event("checkpoint_saved", **fields)
            return result

        return wrapper

    def _patch(self, owner: Any, name: str, phase: str, saved_event: bool = False) -> None:
        current = getattr(owner, name, None)
        if current is None or hasattr(current, pauses.ATTACH_MARK):
            return
        # The Monitor's own wrapper (pauses.py: a phase only for a long save) gives way to this one.
        original = current.__wrapped__ if getattr(current, pauses.MARK, False) else current
        wrapper = self._phased(original, phase, saved_event)
        # changes: attach-checkpoint-phases (docs/changes-to-others.md)
        setattr(wrapper, pauses.ATTACH_MARK, phase)
        setattr(owner, name, wrapper)
        self._undo.append(lambda: setattr(owner, name, current))

    # ---------------------------------------------------------------- life cycle

    def install(self) -> Attachment:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        # changes: optimizer-step-hook (docs/changes-to-others.md)
        handle = register_optimizer_step_post_hook(self.on_optimizer_step)
        self._undo.append(handle.remove)
        self._patch(torch, "save", "checkpoint_save", saved_event=True)
        self._patch(torch, "load", "checkpoint_load")
        try:
            import torch.distributed.checkpoint as dcp
        except Exception:  # a torch without distributed
            pass
        else:
            self._patch(dcp, "save", "checkpoint_save", saved_event=True)
            self._patch(dcp, "load", "checkpoint_load")
            self._patch(dcp, "async_save", "checkpoint_save")
        return self

    def close(self) -> None:
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:
                pass
        self.monitor.close()


def attach(environ: dict | None = None) -> Attachment | None:
    """Hook the current process into the sidecar (what the wrapper does before the script).
    Returns None when the hooks are disabled or torch is missing; never raises."""
    env = os.environ if environ is None else environ
    if environment.disabled(env):
        return None
    os.environ.setdefault("SIDECAR_ATTACHED_PID", str(os.getpid()))  # the env switch: not again
    try:
        import torch  # noqa: F401  (before the Monitor, so the registration names its versions)

        distributed.install()
        monitor = Monitor(environ=env)
        return Attachment(monitor).install()
    except Exception as e:
        warn("attach", "trainer_hooks.attach: not attached (%s: %s)", type(e).__name__, e)
        return None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--pythonpath"]:  # the directory of the SIDECAR_ATTACH=1 switch (autoattach/)
        print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "autoattach"))
        return 0
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    if args[0] == "-m":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        attach()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script, rest = args[0], args[1:]
    if not os.path.isfile(script):
        print(f"trainer_hooks.attach: no such script: {script}", file=sys.stderr)
        return 2
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would have it
    attach()
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
