"""The training loop: build everything from the config, resume, train, close."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from sidecar_trainer import distributed, rng
from sidecar_trainer.checkpoint import Checkpointer
from sidecar_trainer.config import Config, import_factory
from sidecar_trainer.data import DataPosition, StepBatches
from sidecar_trainer.faults import FaultInjector
from sidecar_trainer.monitoring import open_monitor
from sidecar_trainer.startup import Startup

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

log = logging.getLogger("sidecar_trainer")

# The non-finite loss guard's stop waits this long at most for the checkpoint copy in flight.
SETTLE_BEFORE_STOP_SECONDS = 60.0


def lr_lambda(cfg: Config):
    warmup, total, schedule, floor = cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.schedule, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:  # `step` counts optimizer steps already taken
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def parameters_digest(model: nn.Module) -> tuple[str, dict[str, torch.Tensor]]:
    """sha256 of all parameters' bytes in named_parameters() order, and the full tensors (collective
    under FSDP: every rank must call it)."""
    h = hashlib.sha256()
    full: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):  # an FSDP2 DTensor shard
            t = t.full_tensor()
        t = t.cpu().contiguous()
        full[name] = t
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest(), full


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Trainer:
    def __init__(self, cfg: Config, final_params: str | None = None, startup: Startup | None = None) -> None:
        self.cfg, self.final_params = cfg, final_params
        self.startup = startup or Startup(is_main=os.environ.get("RANK", "0") == "0")
        if cfg.train.deterministic:  # cuBLAS reads it when its first handle is created
            # changes: deterministic-cublas (docs/changes-to-others.md)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # Before the rendezvous, so that the sidecar hears when the process group is formed.
        self.monitor = open_monitor(cfg.monitor.enabled)
        self.world = distributed.init(cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_seconds)
        self.startup.mark(
            "process_group_formed",
            self.monitor,
            **{f"{name}_time": round(t, 3) for name, t in self.startup.times.items()},
        )
        self.accum = cfg.validate_for(self.world.size)
        if self.world.is_main:
            log.info(
                "rendezvous done: world_size=%d backend=%s restart_count=%d generation=%d strategy=%s "
                "device=%s grad_accum_steps=%d",
                self.world.size,
                self.world.backend,
                self.world.restart_count,
                self.world.generation,
                cfg.parallel.strategy,
                self.world.device,
                self.accum,
            )
        self.monitor.event("rendezvous_done")
        self.faults = FaultInjector(cfg.faults, self.world.rank, self.world.restart_count, self.world.generation)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.model, self.wrapped = self._build_model()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.dataset = import_factory("data.factory", cfg.data.factory)(seed=cfg.train.seed, **cfg.data.kwargs)
        if self.world.is_main:
            log.info(
                "data loaded: samples=%d steps_per_epoch=%d global_batch=%d micro_batch=%d",
                len(self.dataset),
                len(self.dataset) // cfg.batch.global_batch_size,
                cfg.batch.global_batch_size,
                cfg.batch.micro_batch_size,
            )
        self.monitor.event("data_loaded")
        self.startup.mark("model_built", self.monitor)
        self.checkpointer = Checkpointer(
            cfg.checkpoint, self.world, cfg.parallel.strategy, cfg.train.seed, self.faults, self.monitor
        )
        self.heldout: list | None = None  # built on the first evaluation
        self.step = 0
        position = DataPosition()
        resumed = self.checkpointer.load_latest(self.model, self.optimizer, self.scheduler)
        if resumed:
            self.step, position = resumed.step, resumed.position
            self.startup.mark("checkpoint_loaded", self.monitor, step=resumed.step, source=resumed.source)
            if self.world.is_main:
                log.info(
                    "resumed from step %d (epoch %d, step %d of the epoch) at restart %d from %s",
                    self.step,
                    position.epoch,
                    position.step_in_epoch,
                    self.world.restart_count,
                    resumed.source,
                )
            self.checkpointer.after_resume(resumed, self.model, self.optimizer, self.scheduler)
        self.data = StepBatches(
            self.dataset,
            seed=cfg.train.seed,
            global_batch=cfg.batch.global_batch_size,
            micro_batch=cfg.batch.micro_batch_size,
            accum=self.accum,
            rank=self.world.rank,
            world_size=self.world.size,
            num_workers=cfg.data.num_workers,
            delay_seconds=cfg.data.delay_seconds,
            position=position,
        )

    def _build_model(self) -> tuple[nn.Module, nn.Module]:
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        model = import_factory("model.factory", cfg.model.factory)(**cfg.model.kwargs).to(self.world.device)
        rng.seed_rank(cfg.train.seed, self.world.rank)
        if cfg.parallel.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fsdp = cfg.parallel.fsdp
            assert fsdp is not None  # ParallelConfig fills the chosen strategy's options
            if fsdp.shard_children:
                for child in model.children():
                    fully_shard(child, reshard_after_forward=fsdp.reshard_after_forward)
            fully_shard(model, reshard_after_forward=fsdp.reshard_after_forward)
            return model, model
        opts = cfg.parallel.ddp
        assert opts is not None  # ParallelConfig fills the chosen strategy's options
        ddp = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[self.world.local_rank] if self.world.device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            find_unused_parameters=opts.find_unused_parameters,
        )
        return model, ddp

    def _micro_step(self, step: int, batch, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients are only reduced on the step's last one."""
        inputs, targets = (t.to(self.world.device, non_blocking=True) for t in batch)
        if isinstance(self.wrapped, nn.parallel.DistributedDataParallel):
            sync = contextlib.nullcontext() if last else self.wrapped.no_sync()
        else:  # FSDP2
            cast("FSDPModule", self.wrapped).set_requires_gradient_sync(last)  # fully_shard made it one
            sync = contextlib.nullcontext()
        with sync:
            loss = self.wrapped(inputs, targets) / self.accum
            if last:
                self.checkpointer.before_gradient_sync()
                self.faults.before_allreduce(step)
                loss = self.faults.poison(step, loss)
            loss.backward()
        return loss.detach()

    def train(self) -> None:
        cfg, world = self.cfg, self.world
        last_step = cfg.train.steps
        self.wrapped.train()
        self.first_step = self.step + 1
        window_start, window_steps = time.monotonic(), 0
        nonfinite_steps = 0
        while self.step < last_step:
            step = self.step + 1
            started = time.perf_counter()
            self.faults.step_start(step)
            batches, position = self.faults.fetch(step, self.data.next_step)
            loss = functools.reduce(
                torch.add, [self._micro_step(step, b, i == len(batches) - 1) for i, b in enumerate(batches)]
            )
            max_norm = cfg.optim.max_grad_norm or float("inf")
            grad_norm = _local(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step = step
            samples = cfg.batch.micro_batch_size * self.accum
            self.monitor.step(
                step,
                loss=loss,
                grad_norm=grad_norm,
                lr=lr,
                samples=samples,
                step_time_seconds=time.perf_counter() - started,
            )
            window_steps += 1
            if step == self.first_step:
                self.startup.mark("first_step", self.monitor, step=step)
                if world.is_main:
                    log.info("startup took %s", self.startup.summary())
            if cfg.train.nonfinite_loss_limit:
                nonfinite_steps = 0 if bool(torch.isfinite(loss)) else nonfinite_steps + 1
                if nonfinite_steps >= cfg.train.nonfinite_loss_limit:
                    # The copy in flight holds a state from before this step: commit it first, so
                    # that it is on disk (and reported) for the restart and the rollback hint.
                    self.checkpointer.settle(SETTLE_BEFORE_STOP_SECONDS)
                    raise FloatingPointError(
                        f"non-finite loss for {nonfinite_steps} consecutive steps (step {step}): "
                        "stopping before checkpoints are saved from bad weights"
                    )
            if world.is_main and (step % cfg.train.log_every_steps == 0 or step == last_step):
                elapsed = time.monotonic() - window_start
                log.info(
                    "step %d/%d loss=%.4f grad_norm=%.4f lr=%.3g it/s=%.2f samples/s=%.1f",
                    step,
                    last_step,
                    loss.item(),
                    grad_norm.item(),
                    lr,
                    window_steps / elapsed,
                    window_steps * cfg.batch.global_batch_size / elapsed,
                )
                window_start, window_steps = time.monotonic(), 0
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0:
                self.evaluate(step)
            self.checkpointer.after_step(
                step, last_step, self.model, self.optimizer, self.scheduler, position, grad_norm
            )

    def _heldout_batches(self) -> list:
        """This rank's share of the first eval.batches x world_size micro-batches of a held-out copy."""
        cfg = self.cfg
        dataset = import_factory("data.factory", cfg.data.factory)(seed=cfg.train.seed + 1, **cfg.data.kwargs)
        micro, world = cfg.batch.micro_batch_size, self.world.size
        starts = range(self.world.rank * micro, len(dataset) - micro + 1, world * micro)
        return [default_collate([dataset[j] for j in range(i, i + micro)]) for i in starts[: cfg.eval.batches]]

    @torch.no_grad()
    def evaluate(self, step: int) -> float:
        """Mean loss over held-out micro-batches of all ranks. Draws no random numbers (dropout is
        off), so evaluating never changes what training computes."""
        started = time.monotonic()
        with self.monitor.phase("eval", timeout=self.cfg.eval.timeout_seconds):
            self.wrapped.eval()
            if self.heldout is None:
                self.heldout = self._heldout_batches()
            total = torch.zeros((), device=self.world.device)
            for inputs, targets in self.heldout:
                total += self.wrapped(inputs.to(self.world.device), targets.to(self.world.device))
            total /= len(self.heldout)
            dist.all_reduce(total)
            loss = total.item() / self.world.size
            self.wrapped.train()
        if self.world.is_main:
            log.info("eval: step=%d loss=%.4f seconds=%.3f", step, loss, time.monotonic() - started)
        return loss

    def finish(self) -> str:
        self.checkpointer.flush()  # the last step's disk copy is committed before the run says it ended
        digest, full = parameters_digest(self.model)
        if self.world.is_main:
            if self.final_params:
                Path(self.final_params).parent.mkdir(parents=True, exist_ok=True)
                torch.save(full, self.final_params)
            log.info("training finished: step=%d params_sha256=%s", self.step, digest)
        # Nobody tears the group down while a peer still talks to it (gloo aborts the process then).
        dist.barrier()
        return digest

    def close(self, ok: bool) -> None:
        try:
            if ok:
                self.checkpointer.close(finished=True)
        except Exception as e:  # the run's end is on disk already: leftovers are not worth a failed exit
            log.warning("checkpoint: could not remove the memory snapshots (%s: %s)", type(e).__name__, e)
        with contextlib.suppress(Exception):
            self.monitor.close(reason="finished" if ok else "failed")
        distributed.close()
