"""What a trainer checkpoint holds and how the ranks save and load it together.

`step-N/` contains
  model.pt        (ddp, written by rank 0) model and optimizer state
  model/          (fsdp) the same, sharded, written by torch.distributed.checkpoint
  rank-R.pt       (every rank) step, data position, LR scheduler, and the rank's RNG states
  manifest.json, COMMIT   see sidecar_trainer/checkpoint_store.py
Everything loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sidecar_trainer import rng
from sidecar_trainer.checkpoint_store import CheckpointStore, FileDigest, digest_file, write_stream
from sidecar_trainer.config import CheckpointConfig
from sidecar_trainer.data import DataPosition
from sidecar_trainer.distributed import World
from sidecar_trainer.faults import FaultInjector

log = logging.getLogger("sidecar_trainer")


@dataclass
class Resumed:
    step: int
    position: DataPosition
    path: Path


class Checkpointer:
    def __init__(
        self, cfg: CheckpointConfig, world: World, strategy: str, seed: int, faults: FaultInjector, monitor
    ) -> None:
        self.cfg, self.world, self.strategy, self.seed = cfg, world, strategy, seed
        self.store = CheckpointStore(cfg.dir, cfg.keep_last)
        self.faults, self.monitor = faults, monitor

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.dir)

    def due(self, step: int, last_step: int) -> bool:
        return self.enabled and (step % self.cfg.every_steps == 0 or step == last_step)

    # ------------------------------------------------------------ save (collective)

    def save(self, step: int, model: nn.Module, optimizer, scheduler, position: DataPosition) -> Path:
        started = time.monotonic()
        with self.monitor.phase("checkpoint_save"):
            self.faults.checkpoint_delay()
            if self.world.is_main:
                self.store.root.mkdir(parents=True, exist_ok=True)
                self.store.begin(step)
            dist.barrier()  # the empty temp directory exists for everybody
            tmp = self.store.temp_for(step)
            files = self._write_model(tmp, model, optimizer)
            rank_state = {
                "step": step,
                "world_size": self.world.size,
                "data": position.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng.capture(),
            }
            name = f"rank-{self.world.rank}.pt"
            files[name] = write_stream(
                tmp / name, partial(torch.save, rank_state), self.faults.checkpoint_interrupt(step)
            )
            gathered: list = [None] * self.world.size
            dist.all_gather_object(gathered, files)
            path = self.store.path_for(step)
            if self.world.is_main:
                merged = {k: v for per_rank in gathered for k, v in per_rank.items()}
                self.store.commit(
                    step,
                    merged,
                    meta={"world_size": self.world.size, "strategy": self.strategy, "torch": torch.__version__},
                )
                pruned = self.store.prune(step)
                log.info(
                    "checkpoint saved: step=%d path=%s seconds=%.3f%s",
                    step,
                    path,
                    time.monotonic() - started,
                    f" pruned={len(pruned)}" if pruned else "",
                )
            dist.barrier()
        self.monitor.event("checkpoint_saved", step=step, path=str(path))
        return path

    def _write_model(self, tmp: Path, model: nn.Module, optimizer) -> dict[str, FileDigest]:
        if self.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / "model"))
            if not self.world.is_main:
                return {}
            return {f"model/{p.name}": digest_file(p) for p in sorted((tmp / "model").iterdir())}
        if not self.world.is_main:  # DDP replicas are identical: one copy is enough
            return {}
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        return {"model.pt": write_stream(tmp / "model.pt", partial(torch.save, state))}

    # ------------------------------------------------------------ load (collective)

    def load_latest(self, model: nn.Module, optimizer, scheduler) -> Resumed | None:
        if not (self.enabled and self.cfg.resume):
            return None
        choice: list[tuple[int, str, Any] | None] = [None]
        if self.world.is_main:
            found = self.store.latest_complete()
            choice = [(found.step, str(found.path), self.store.manifest(found.path)["meta"]) if found else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        step, path, meta = choice[0][0], Path(choice[0][1]), choice[0][2]
        if meta.get("strategy") != self.strategy:
            raise RuntimeError(
                f"checkpoint {path} was written with parallel.strategy={meta.get('strategy')}; "
                f"resume it with that strategy (this run uses {self.strategy})"
            )
        started = time.monotonic()
        with self.monitor.phase("checkpoint_load"):
            self._read_model(path, model, optimizer)
            rank_file = path / f"rank-{self.world.rank}.pt"
            if rank_file.exists():
                state = torch.load(rank_file, weights_only=True)
                rng.restore(state["rng"])
            else:  # the world grew: this rank has no saved streams of its own
                log.warning(
                    "checkpoint: %s has no %s (saved by a smaller world); model, optimizer and data "
                    "position restored, RNG streams re-seeded: resume is not bitwise exact",
                    path,
                    rank_file.name,
                )
                state = torch.load(path / "rank-0.pt", weights_only=True)
                rng.seed_rank(self.seed + step, self.world.rank)
            scheduler.load_state_dict(state["scheduler"])
            dist.barrier()
        if self.world.is_main:
            log.info("checkpoint loaded: step=%d path=%s seconds=%.3f", step, path, time.monotonic() - started)
        self.monitor.event("checkpoint_loaded", step=step)
        return Resumed(step, DataPosition.from_state_dict(state["data"]), path)

    def _read_model(self, path: Path, model: nn.Module, optimizer) -> None:
        if self.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
            dcp.load(state, checkpoint_id=str(path / "model"))
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)  # loaded in place
            return
        state = torch.load(path / "model.pt", map_location=self.world.device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
