"""What a trainer checkpoint holds, and how the ranks keep it: in host memory every step, on
disk in the background, and resume from the newer of the two.

After a step that is due, each rank copies its state on the training thread (the tensors, and
nothing else: `capture`) and hands the copy to two background lanes (background.py):

- memory, every `checkpoint.memory_every_steps`: the copy as one file per rank in shared memory
  (snapshot_store.py), which outlives a killed process; a restart loads it without touching
  the disk. A step whose gradient norm is not finite is never snapshotted (its weights are bad).
- disk, every `checkpoint.every_steps` and at the last step: the same copy as `step-N/`, over a
  gloo process group of its own (so its collectives never interleave with training's):
    model.pt        (ddp, written by rank 0) model and optimizer state
    model/          (fsdp) the same, sharded, written by torch.distributed.checkpoint
    rank-R.pt       (every rank) step, data position, LR scheduler, and the rank's RNG states
    manifest.json, COMMIT   see sidecar_trainer/checkpoint_store.py
  Everything loads with `torch.load(weights_only=True)`.

Training waits for the lanes only where correctness needs it. Before a step's gradient
all-reduce, for the previous memory snapshot: no rank can then complete a step while a peer
still lacks the snapshot before it, so the ranks' newest snapshots differ by one at most and a
common one always exists (snapshot_store.py keeps two). At a step due on disk, for the previous
disk copy (inside a `checkpoint_save` phase, so the sidecar's watchdog knows): one at a time, in
the same order on every rank. A failed disk copy raises there, as a failed save always did.
A failed memory snapshot never stops training, whatever it raised (a full tmpfs gives ENOSPC, or
a RuntimeError out of torch.save after a short write: issue 28, row 4, where a user who filled
/dev/shm stopped every attempt of the job): the store removes what it wrote, the first failure is
logged with the room left, the step is not snapshotted, and after `MEMORY_FAILURES_OFF` failures
in a row this process writes no more snapshots (a warning says so). Disk copies go on, and a
restart resumes from the newest step every rank still holds intact, else from the disk.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sidecar_trainer import rng
from sidecar_trainer.background import Lane
from sidecar_trainer.checkpoint_store import CheckpointStore, FileDigest, digest_file, write_stream
from sidecar_trainer.config import CheckpointConfig
from sidecar_trainer.data import DataPosition
from sidecar_trainer.distributed import World
from sidecar_trainer.faults import FaultInjector
from sidecar_trainer.snapshot_store import SnapshotStore, job_key

log = logging.getLogger("sidecar_trainer")

_LOCAL = "dtensor_local"  # how a DTensor shard travels in a memory snapshot: {_LOCAL: local tensor}
MEMORY_FAILURES_OFF = 3  # failed memory snapshots in a row after which a process writes no more


@dataclass
class Resumed:
    step: int
    position: DataPosition
    source: str  # "memory" | "disk"
    path: Path | None  # the disk checkpoint's directory


@dataclass(frozen=True)
class State:
    """A copy of everything a rank needs to resume after `step`, detached from the live objects."""

    step: int
    model: dict
    optimizer: dict
    rank: dict  # step, world_size, data position, scheduler, rng


def _copied(value: Any) -> Any:
    """`value` with every tensor copied to the host (DTensors keep their layout); containers copied."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "to_local"):  # a DTensor (imported only here: 1.8 s, and only FSDP has them)
            from torch.distributed.tensor import DTensor

            shard: Any = value
            local = shard.to_local().detach().to("cpu", copy=True)
            return DTensor.from_local(
                local, shard.device_mesh, shard.placements, shape=shard.shape, stride=shard.stride()
            )
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return copy.deepcopy(value)


def _local(value: Any) -> Any:
    """`value` for torch.save into a memory snapshot: DTensors as their local shard, marked."""
    if isinstance(value, torch.Tensor) and hasattr(value, "to_local"):
        return {_LOCAL: value.to_local()}
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def _distributed(value: Any, like: Any, device: torch.device) -> Any:
    """Undo `_local` for one value, with the layout of the live DTensor `like`."""
    if isinstance(value, dict) and set(value) == {_LOCAL}:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            value[_LOCAL].to(device), like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
        )
    return value


class Checkpointer:
    def __init__(
        self, cfg: CheckpointConfig, world: World, strategy: str, seed: int, faults: FaultInjector, monitor
    ) -> None:
        self.cfg, self.world, self.strategy, self.seed = cfg, world, strategy, seed
        self.store = CheckpointStore(cfg.dir, cfg.keep_last)
        self.faults, self.monitor = faults, monitor
        self.memory: SnapshotStore | None = None
        if self.enabled and cfg.memory_every_steps:
            key = job_key(os.environ.get("TORCHELASTIC_RUN_ID", ""), cfg.dir)
            # Each node's local rank 0 finds or makes the user's directory first; the node's other
            # ranks then find that one instead of each making its own (snapshot_store.py).
            if world.local_rank != 0:
                dist.barrier()
            self.memory = SnapshotStore.open(cfg.memory_dir, key, world.rank)
            if world.local_rank == 0:
                dist.barrier()
        self._memory_lane = Lane("memory-snapshot")
        self._disk_lane = Lane("checkpoint-persist")
        self._group: Any = None  # the disk lane's process group, formed at its first use
        self._memory_failures = 0  # in all
        self._memory_failed_in_a_row = 0
        self._memory_off = False  # set by the memory lane after MEMORY_FAILURES_OFF failures in a row
        self.disk_step: int | None = None  # the newest complete checkpoint on disk at start

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.dir)

    def due(self, step: int, last_step: int) -> bool:
        """Step `step` goes to disk."""
        return self.enabled and (step % self.cfg.every_steps == 0 or step == last_step)

    def memory_due(self, step: int) -> bool:
        return self.memory is not None and not self._memory_off and step % self.cfg.memory_every_steps == 0

    # ------------------------------------------------------------ the training thread

    def capture(self, step: int, model: nn.Module, optimizer, scheduler, position: DataPosition) -> State:
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
        else:
            model_sd, optim_sd = model.state_dict(), optimizer.state_dict()
        rank_state = {
            "step": step,
            "world_size": self.world.size,
            "data": position.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng.capture(),
        }
        return State(step, _copied(model_sd), _copied(optim_sd), _copied(rank_state))

    def after_resume(self, resumed: Resumed, model: nn.Module, optimizer, scheduler) -> None:
        """A resume from memory a full interval ahead of the disk copies it to disk at once: the
        node may not keep its memory until the next step due on disk."""
        if resumed.source == "memory" and resumed.step - (self.disk_step or 0) >= self.cfg.every_steps:
            self.persist(self.capture(resumed.step, model, optimizer, scheduler, resumed.position))

    def before_gradient_sync(self) -> None:
        """Call before the step's gradient all-reduce: the previous memory snapshot is sealed."""
        self._memory_lane.wait()

    def after_step(
        self, step: int, last_step: int, model: nn.Module, optimizer, scheduler, position: DataPosition, grad_norm
    ) -> None:
        """Snapshot and persist what is due after optimizer step `step`."""
        to_memory = self.memory_due(step) and bool(torch.isfinite(grad_norm))
        to_disk = self.due(step, last_step)
        if not (to_memory or to_disk):
            return
        state = self.capture(step, model, optimizer, scheduler, position)
        if to_memory:
            self._memory_lane.submit(partial(self._write_memory, state))
        if to_disk:
            self.persist(state)

    def persist(self, state: State) -> None:
        """Hand `state` to the disk lane, once the previous copy is on disk."""
        if self._disk_lane.busy:
            with self.monitor.phase("checkpoint_save"):
                waited = self._disk_lane.wait()
            if self.world.is_main and waited >= 0.1:
                log.info("checkpoint: step %d waited %.2fs for the previous save to finish", state.step, waited)
        self._disk_lane.wait()
        if self._group is None:  # every rank reaches its first persist at the same step
            self._group = dist.new_group(backend="gloo", timeout=self.world.timeout)
        self._disk_lane.submit(partial(self._save, state))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every snapshot and disk copy handed over so far is written (TimeoutError
        after `timeout` seconds, if given)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        self._memory_lane.wait(left())
        if self._disk_lane.busy:
            with self.monitor.phase("checkpoint_save"):
                self._disk_lane.wait(left())
        self._disk_lane.wait(left())

    def settle(self, timeout: float) -> bool:
        """Before a controlled stop: let the snapshot and the disk copy in flight, both of states
        from before the stop, finish within `timeout` seconds (the peers are alive: a copy's
        commit waits for theirs). False, and a warning, when they did not or failed."""
        try:
            self.flush(timeout)
        except Exception as e:  # the stop goes on: its own error is the one that matters
            log.warning("checkpoint: the save in flight did not finish before the stop (%s: %s)", type(e).__name__, e)
            return False
        return True

    def close(self, finished: bool) -> None:
        """After the last step: a finished job's memory snapshots go (the disk has its end)."""
        if finished and self.memory is not None:
            self.flush()
            dist.barrier()  # every rank has the final disk copy committed: nobody needs memory now
            self.memory.remove()
            if self.world.is_main:
                log.info("memory snapshots removed: %s", self.memory.dir)

    # ------------------------------------------------------------ memory (its lane)

    def _write_memory(self, state: State) -> None:
        assert self.memory is not None
        payload = {"model": _local(state.model), "optimizer": _local(state.optimizer), "rank": state.rank}
        meta = {"world_size": self.world.size, "strategy": self.strategy}
        try:
            self.memory.write(state.step, partial(torch.save, payload), meta)
        except Exception as e:  # a full tmpfs, say: the disk copies still protect the run
            self._memory_failed(state.step, e)
        else:
            self._memory_failed_in_a_row = 0

    def _memory_failed(self, step: int, error: Exception) -> None:
        assert self.memory is not None
        self._memory_failures += 1
        self._memory_failed_in_a_row += 1
        try:
            room = f"{shutil.disk_usage(self.memory.dir).free / 2**20:.1f} MiB free in {self.memory.dir.parent.parent}"
        except OSError:
            room = f"{self.memory.dir} unreadable"
        why = f"{type(error).__name__}: {error}"
        if self._memory_failures == 1:
            log.warning(
                "memory snapshot of step %d failed (%s; %s): not taken, its partial file removed; training goes "
                "on and the disk checkpoints are unaffected",
                step,
                why,
                room,
            )
        if self._memory_failed_in_a_row >= MEMORY_FAILURES_OFF:
            self._memory_off = True
            log.warning(
                "memory snapshots off for this process: %d failed in a row (the last of step %d: %s; %s); "
                "a restart resumes from the newest intact snapshot every rank holds, else from the disk",
                self._memory_failed_in_a_row,
                step,
                why,
                room,
            )

    # ------------------------------------------------------------ disk (its lane, collective on its group)

    def _save(self, state: State) -> Path:
        started, step, group = time.monotonic(), state.step, self._group
        self.faults.checkpoint_delay()
        if self.world.is_main:
            self.store.root.mkdir(parents=True, exist_ok=True)
            self.store.begin(step)
        dist.barrier(group=group)  # the empty temp directory exists for everybody
        tmp = self.store.temp_for(step)
        files = self._write_model(tmp, state)
        name = f"rank-{self.world.rank}.pt"
        files[name] = write_stream(tmp / name, partial(torch.save, state.rank), self.faults.checkpoint_interrupt(step))
        gathered: list = [None] * self.world.size
        dist.all_gather_object(gathered, files, group=group)
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
        dist.barrier(group=group)  # committed: only now may any rank say so
        self.monitor.event("checkpoint_saved", step=step, path=str(path))
        return path

    def _write_model(self, tmp: Path, state: State) -> dict[str, FileDigest]:
        if self.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp

            dcp.save(
                {"model": state.model, "optimizer": state.optimizer},
                checkpoint_id=str(tmp / "model"),
                process_group=self._group,
            )
            if not self.world.is_main:
                return {}
            return {f"model/{p.name}": digest_file(p) for p in sorted((tmp / "model").iterdir())}
        if not self.world.is_main:  # DDP replicas are identical: one copy is enough
            return {}
        state_dict = {"model": state.model, "optimizer": state.optimizer}
        return {"model.pt": write_stream(tmp / "model.pt", partial(torch.save, state_dict))}

    # ------------------------------------------------------------ load (collective, training thread)

    def load_latest(self, model: nn.Module, optimizer, scheduler) -> Resumed | None:
        """Resume from the newest state every rank holds: a memory snapshot, or the newest complete
        checkpoint on disk, whichever is newer (memory on a tie); None to start afresh."""
        if not (self.enabled and self.cfg.resume):
            return None
        started = time.monotonic()
        # What each rank holds in memory, and (rank 0) the step of the newest checkpoint on disk
        # that looks committed; its files' checksums are read only if the disk is the choice.
        newest_on_disk = None
        if self.world.is_main:
            newest_on_disk = next((c.step for c in self.store.scan(verify=False) if c.problem is None), None)
        held: list = [None] * self.world.size
        dist.all_gather_object(held, (self._memory_steps(), newest_on_disk))
        self.disk_step = held[0][1]
        common = sorted(set.intersection(*(set(steps) for steps, _ in held)), reverse=True)
        hint = self.disk_step
        newer = [s for s in common if hint is None or s >= hint]
        resumed = self._resume_from_memory(newer, model, optimizer, scheduler)
        if resumed:
            return self._loaded(resumed, started)
        choice: list = [None]
        if self.world.is_main:
            found = self.store.latest_complete()
            choice = [(found.step, str(found.path), self.store.manifest(found.path)["meta"]) if found else None]
        dist.broadcast_object_list(choice, src=0)
        self.disk_step = choice[0][0] if choice[0] else None
        # The newest committed-looking checkpoint may have failed its checksums: a memory snapshot
        # newer than the one that passed beats it.
        older = [s for s in common if hint is not None and s < hint and (choice[0] is None or s >= choice[0][0])]
        resumed = self._resume_from_memory(older, model, optimizer, scheduler)
        if resumed:
            return self._loaded(resumed, started)
        if choice[0] is None:
            return None
        step, path, meta = choice[0][0], Path(choice[0][1]), choice[0][2]
        if meta.get("strategy") != self.strategy:
            raise RuntimeError(
                f"checkpoint {path} was written with parallel.strategy={meta.get('strategy')}; "
                f"resume it with that strategy (this run uses {self.strategy})"
            )
        with self.monitor.phase("checkpoint_load"):
            position = self._read_disk(step, path, model, optimizer, scheduler)
            dist.barrier()
        return self._loaded(Resumed(step, position, "disk", path), started)

    def _resume_from_memory(self, steps: list[int], model: nn.Module, optimizer, scheduler) -> Resumed | None:
        """Load the newest of `steps` (held by every rank) whose snapshot is intact on every rank."""
        for step in steps:
            problem = self.memory.check(step) if self.memory else "no memory store"
            problems: list = [None] * self.world.size
            dist.all_gather_object(problems, problem)
            if any(problems):
                if self.world.is_main:
                    why = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
                    log.warning("checkpoint: memory snapshot of step %d unusable (%s)", step, why)
                continue
            with self.monitor.phase("checkpoint_load"):
                position = self._read_memory(step, model, optimizer, scheduler)
                dist.barrier()
            return Resumed(step, position, "memory", None)
        return None

    def _loaded(self, resumed: Resumed, started: float) -> Resumed:
        if self.world.is_main:
            where = f"path={resumed.path}" if resumed.path else f"dir={self.memory.dir if self.memory else None}"
            log.info(
                "checkpoint loaded: step=%d source=%s %s seconds=%.3f",
                resumed.step,
                resumed.source,
                where,
                time.monotonic() - started,
            )
        return resumed

    def _memory_steps(self) -> list[int]:
        """This rank's sealed snapshots that this world can resume from, newest first."""
        if self.memory is None:
            return []
        want = {"world_size": self.world.size, "strategy": self.strategy}
        return [s for s in self.memory.steps() if (self.memory.seal(s) or {}).get("meta") == want]

    def _read_memory(self, step: int, model: nn.Module, optimizer, scheduler) -> DataPosition:
        assert self.memory is not None
        saved = torch.load(self.memory.payload(step), map_location=self.world.device, weights_only=True)
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            live, _ = get_state_dict(model, optimizer)  # the layout each shard belongs to
            model_sd = {k: _distributed(v, live[k], self.world.device) for k, v in saved["model"].items()}
            optim_sd = saved["optimizer"]
            for fqn, entry in optim_sd["state"].items():
                optim_sd["state"][fqn] = {k: _distributed(v, live[fqn], self.world.device) for k, v in entry.items()}
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        else:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
        rng.restore(saved["rank"]["rng"])
        scheduler.load_state_dict(saved["rank"]["scheduler"])
        return DataPosition.from_state_dict(saved["rank"]["data"])

    def _read_disk(self, step: int, path: Path, model: nn.Module, optimizer, scheduler) -> DataPosition:
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
        return DataPosition.from_state_dict(state["data"])

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
