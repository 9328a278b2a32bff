"""Hugging Face Accelerate: a tracker that every process reports through.

    from accelerate import Accelerator
    from trainer_hooks.accelerate import SidecarTracker
    accelerator = Accelerator(log_with=[SidecarTracker()])
    ...
    accelerator.log({"loss": loss.item()}, step=step)   # as with any tracker
    accelerator.end_training()

Needs `pip install accelerate`. Accelerate runs `Accelerator.log` on the main process only,
but the watchdog must see every rank make progress. So the tracker (created by the script on
every process) counts this process's optimizer steps itself, through torch's global optimizer
step hook: Accelerate's optimizer wrapper calls the real `step()` only when gradients are
synchronised and not skipped by the fp16 scaler, so a hook call is a real optimizer step. What
`accelerator.log` passes (on the main process) rides along with the step it belongs to: there a
finished step is held back until the next step or log call; other processes send it at once.
Well-known keys map to the sidecar's names
(`loss`, `grad_norm`, `lr`/`learning_rate`, `samples`, `tokens`, ...); other numbers are custom
metrics. `end_training()` (or `finish()`) closes the Monitor.

The process group Accelerate forms is made restart-safe (`trainer_hooks.distributed`).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

try:
    from accelerate.tracking import GeneralTracker
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("trainer_hooks.accelerate needs Hugging Face Accelerate: pip install accelerate") from e

from trainer_hooks import distributed
from trainer_hooks.attach import step_metrics
from trainer_hooks.errors import guarded
from trainer_hooks.monitor import Monitor

distributed.install()  # Accelerator() forms the group; the script imports this module first

ALIASES = {"learning_rate": "lr", "train_loss": "loss", "train/loss": "loss", "grad_norm": "grad_norm"}


class SidecarTracker(GeneralTracker):
    name = "sidecar"
    requires_logging_directory = False
    main_process_only = False  # every process reports (its log() runs only where Accelerate calls it)

    def __init__(self, monitor: Monitor | None = None, **monitor_kwargs: Any):
        super().__init__()
        distributed.install()
        self.monitor = monitor if monitor is not None else Monitor(**monitor_kwargs)
        self._owns_monitor = monitor is None
        self._step = 0
        self._last: float | None = None
        self._pending: tuple[int, dict] | None = None
        self._handle = None
        # Accelerate calls log() on the main process (global rank 0) only: elsewhere a step has
        # nothing to wait for. A step still held at exit goes out before the Monitor closes.
        self._hold = int(os.environ.get("RANK", "0") or 0) == 0
        atexit.register(self._send_pending)
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            # changes: optimizer-step-hook (docs/changes-to-others.md)
            self._handle = register_optimizer_step_post_hook(self._on_optimizer_step)
        except Exception:
            pass

    @property
    def tracker(self) -> Monitor:
        return self.monitor

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            self._send_pending()
            self._step += 1
            metrics, self._last = step_metrics(optimizer, self._last)
            self._pending = (self._step, metrics)
            if not self._hold:
                self._send_pending()
        except Exception:
            pass

    @guarded
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        numbers = {
            ALIASES.get(k, k): v
            for k, v in (values or {}).items()
            if isinstance(k, str) and (isinstance(v, (int, float)) and not isinstance(v, bool) or hasattr(v, "item"))
        }
        if self._pending is not None:
            self._pending[1].update(numbers)
            self._send_pending()

    @guarded
    def finish(self) -> None:
        self._send_pending()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        atexit.unregister(self._send_pending)
        if self._owns_monitor:
            self.monitor.close()

    def _send_pending(self) -> None:
        if self._pending is not None:
            step, metrics = self._pending
            self._pending = None
            self.monitor.step(step, **metrics)
