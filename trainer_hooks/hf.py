"""Hugging Face `Trainer` callback: reports steps, loss, learning rate, grad norm, samples,
tokens (when `include_num_input_tokens_seen` is on), evaluation and checkpoints to the node's
sidecar.

    from trainer_hooks.hf import SidecarCallback
    trainer = Trainer(..., callbacks=[SidecarCallback()])

Needs `pip install transformers`. Each rank process creates its own `Monitor` at train begin
(or pass `monitor=`; keyword arguments go to `Monitor`) and closes it at train end when it
created it.

The Trainer reports a step's loss and grad norm in `on_log`, which runs after `on_step_end`
of the same step; the sidecar wants each step once, with its metrics. So a finished step is
held back until the next callback (the next step's begin, evaluation, save, train end) and
sent then, carrying whatever `on_log` added. Evaluation is the `eval` phase: it starts at
the first prediction step and ends at `on_evaluate`.
"""

from __future__ import annotations

import os
import time
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("trainer_hooks.hf needs Hugging Face transformers: pip install transformers") from e

from trainer_hooks import distributed
from trainer_hooks.errors import guarded
from trainer_hooks.monitor import Monitor


def _restart_safe() -> None:
    """The Trainer sets up the process group when `TrainingArguments` is created, before any
    callback exists: importing this module makes that group restart-safe under torchrun
    (`trainer_hooks.distributed`)."""
    distributed.install()  # never raises


_restart_safe()

# Trainer log keys -> the sidecar's well-known metric names.
LOG_KEYS = {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "lr"}


class SidecarCallback(TrainerCallback):
    def __init__(self, monitor: Monitor | None = None, **monitor_kwargs: Any):
        _restart_safe()
        self.monitor = monitor
        self._owns_monitor = monitor is None
        self._monitor_kwargs = monitor_kwargs
        self._pending: tuple[int, dict] | None = None
        self._last_step_end: float | None = None
        self._in_eval = False
        self._in_save = False
        self._tokens_seen: float | None = None

    # ---------------------------------------------------------------- training

    @guarded
    def on_train_begin(self, args, state, control, **kwargs):
        if self.monitor is None:
            self.monitor = Monitor(**self._monitor_kwargs)
        self._last_step_end = time.perf_counter()
        self._tokens_seen = getattr(state, "num_input_tokens_seen", None)

    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        self._send_pending()

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        self._send_pending()
        now = time.perf_counter()
        metrics: dict[str, Any] = {"samples": args.per_device_train_batch_size * args.gradient_accumulation_steps}
        if self._last_step_end is not None:
            metrics["step_time_seconds"] = now - self._last_step_end
        self._last_step_end = now
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:
            try:
                metrics["lr"] = optimizer.param_groups[0]["lr"]
            except (AttributeError, IndexError, KeyError, TypeError):
                pass
        tokens = self._tokens(args, state)
        if tokens:
            metrics["tokens"] = tokens
        self._pending = (state.global_step, metrics)
        # DefaultFlowCallback (always first) has decided by now; the Trainer saves right after
        # logging and evaluating, and calls on_save only once the checkpoint is written. Opening
        # the phase here puts the whole save under its budget instead of the step timeout.
        if getattr(control, "should_save", False) and not self._in_save and self.monitor is not None:
            self.monitor.phase_start("checkpoint_save")
            self._in_save = True

    @guarded
    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or self._pending is None or self._pending[0] != state.global_step:
            return
        metrics = self._pending[1]
        for key, name in LOG_KEYS.items():
            value = logs.get(key)
            if isinstance(value, (int, float)):
                metrics[name] = value

    # ---------------------------------------------------------------- evaluation and checkpoints

    @guarded
    def on_prediction_step(self, args, state, control, **kwargs):
        if not self._in_eval and self.monitor is not None:
            self._send_pending()
            self.monitor.phase_start("eval")
            self._in_eval = True

    @guarded
    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.monitor is None:
            return
        self._send_pending()
        if self._in_eval:
            self.monitor.phase_end("eval")
            self._in_eval = False
        # the numeric results (eval_loss, ...), within the protocol's 16 fields per event
        fields = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and k != "step"}
        self.monitor.event("evaluated", step=state.global_step, **dict(list(fields.items())[:15]))

    @guarded
    def on_save(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        self._send_pending()
        if self._in_save:
            self.monitor.phase_end("checkpoint_save")
            self._in_save = False
        self.monitor.event(
            "checkpoint_saved",
            step=state.global_step,
            path=os.path.join(args.output_dir, f"checkpoint-{state.global_step}"),
        )

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        self._send_pending()
        if self._in_save and self.monitor is not None:
            self.monitor.phase_end("checkpoint_save")
            self._in_save = False
        if self.monitor is not None and self._owns_monitor:
            self.monitor.close()
            self.monitor = None  # a later train() starts a fresh one

    def _tokens(self, args, state) -> float | None:
        """This rank's share of the tokens of the step, from `state.num_input_tokens_seen` (counted
        when `TrainingArguments(include_num_input_tokens_seen=...)` enables it). The Trainer sums
        it over all processes, so each rank reports the step's total / world size."""
        seen = getattr(state, "num_input_tokens_seen", None)
        if not isinstance(seen, (int, float)) or isinstance(seen, bool):
            return None
        previous, self._tokens_seen = self._tokens_seen, seen
        if previous is None or seen <= previous:
            return None
        return (seen - previous) / max(1, int(getattr(args, "world_size", 1) or 1))

    def _send_pending(self) -> None:
        if self._pending is not None and self.monitor is not None:
            step, metrics = self._pending
            self._pending = None
            self.monitor.step(step, **metrics)
