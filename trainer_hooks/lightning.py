"""Lightning callback: reports steps, loss, learning rate, validation and checkpoints to the
node's sidecar.

    from trainer_hooks.lightning import SidecarCallback
    trainer = lightning.pytorch.Trainer(..., callbacks=[SidecarCallback()])

Needs `pip install lightning` (or the older `pytorch-lightning`; the callback subclasses
whichever is installed, `lightning` first). Each rank process creates its own `Monitor` at
setup (or pass `monitor=`; keyword arguments go to `Monitor`) and closes it at teardown when
it created it.

A step is an optimizer step (`trainer.global_step`): with gradient accumulation, only the
batch that advanced it is reported. The grad norm is what the module logged as `grad_norm` or
under the names of Lightning's `grad_norm` utility (`self.log_dict(grad_norm(self, norm_type=2))`
logs `grad_2.0_norm_total`). The loss is passed as the tensor Lightning returns (the
hooks read it off the training thread). Validation is the `eval` phase. Lightning calls
`on_save_checkpoint` before it writes the file, so the `checkpoint_saved` event is sent at
the next callback, once the write is done.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        # The standalone package's copy of the same class: another type to a checker.
        from pytorch_lightning import Callback  # type: ignore[assignment]
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("trainer_hooks.lightning needs Lightning: pip install lightning") from e

from trainer_hooks import distributed
from trainer_hooks.errors import guarded
from trainer_hooks.monitor import Monitor


def _batch_size(batch: Any) -> int | None:
    """Leading dimension of the batch's first tensor (shape access never syncs a device)."""
    for _ in range(3):
        if hasattr(batch, "shape"):
            return int(batch.shape[0]) if len(batch.shape) else None
        if isinstance(batch, Mapping):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, (list, tuple)):
            batch = batch[0] if batch else None
        else:
            return None
    return None


def _restart_safe() -> None:
    """Lightning sets up the process group in `fit`, after the callbacks exist: creating the
    callback (or importing this module) makes that group restart-safe under torchrun
    (`trainer_hooks.distributed`)."""
    distributed.install()  # never raises


_restart_safe()


def _grad_norm(logged: Mapping) -> Any:
    """The total grad norm the module logged: `grad_norm`, or the names of Lightning's own
    `lightning.pytorch.utilities.grad_norm` (`grad_2.0_norm_total`, another p-norm's total;
    `_step` when logged with on_step and on_epoch), the 2-norm first."""
    try:
        for key in ("grad_norm", "grad_2.0_norm_total", "grad_norm_step", "grad_2.0_norm_total_step"):
            if key in logged:
                return logged[key]
        for key in logged:
            if isinstance(key, str) and key.startswith("grad_") and key.endswith(("_norm_total", "_norm_total_step")):
                return logged[key]
    except Exception:
        pass
    return None


class SidecarCallback(Callback):
    def __init__(self, monitor: Monitor | None = None, **monitor_kwargs: Any):
        super().__init__()
        _restart_safe()
        self.monitor = monitor
        self._owns_monitor = monitor is None
        self._monitor_kwargs = monitor_kwargs
        self._last_step = -1
        self._last_step_end: float | None = None
        self._saved_step: int | None = None

    @guarded
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.monitor is None and stage == "fit":
            self.monitor = Monitor(**self._monitor_kwargs)

    @guarded
    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = trainer.global_step
        self._last_step_end = time.perf_counter()

    @guarded
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._send_saved()

    @guarded
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.monitor is None or step <= self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = step
        now = time.perf_counter()
        metrics: dict[str, Any] = {}
        if self._last_step_end is not None:
            metrics["step_time_seconds"] = now - self._last_step_end
        self._last_step_end = now
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is not None:
            metrics["loss"] = loss
        try:
            metrics["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        except (AttributeError, IndexError, KeyError, TypeError):
            pass
        grad_norm = _grad_norm(trainer.callback_metrics)
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        samples = _batch_size(batch)
        if samples:
            metrics["samples"] = samples * trainer.accumulate_grad_batches
        self.monitor.step(step, **metrics)

    @guarded
    def on_validation_start(self, trainer, pl_module) -> None:
        self._send_saved()
        if self.monitor is not None:
            self.monitor.phase_start("eval")

    @guarded
    def on_validation_end(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self.monitor.phase_end("eval")

    @guarded
    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # Lightning calls this before it writes the file: the write runs inside the phase, so
        # a long save is judged by the checkpoint budget, not the step timeout.
        if self._saved_step is None and self.monitor is not None:
            self.monitor.phase_start("checkpoint_save")
        self._saved_step = trainer.global_step

    @guarded
    def on_train_end(self, trainer, pl_module) -> None:
        self._send_saved()

    @guarded
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._send_saved()
        if stage == "fit" and self.monitor is not None and self._owns_monitor:
            self.monitor.close()
            self.monitor = None  # a later fit() starts a fresh one

    def _send_saved(self) -> None:
        if self._saved_step is not None and self.monitor is not None:
            step, self._saved_step = self._saved_step, None
            self.monitor.phase_end("checkpoint_save")
            self.monitor.event("checkpoint_saved", step=step)
