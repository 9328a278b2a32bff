"""The trainer's configuration sections (model, data, batch, optim, train, eval, parallel,
checkpoint, monitor, faults): one dataclass each, documented per field and checked in
`__post_init__` (sidecar_trainer/config.py holds the top-level `Config` and the loading)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from sidecar_trainer.config_checks import _at_least, _check, _import_path, _one_of, doc, fail


@dataclass
class ModelConfig:
    factory: str = field(
        default="sidecar_trainer.demo:build_model",
        metadata=doc(
            "Import path `package.module:factory` of the model. Called as factory(**kwargs); returns an "
            "nn.Module whose forward(inputs, targets) returns the scalar loss of a micro-batch."
        ),
    )
    kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata=doc("Keyword arguments for the model factory (e.g. {hidden: 64, dropout: 0.1} for the demo)."),
    )

    def __post_init__(self) -> None:
        _import_path("model.factory", self.factory)  # importing waits for Config.check_imports


@dataclass
class DataConfig:
    factory: str = field(
        default="sidecar_trainer.demo:build_dataset",
        metadata=doc(
            "Import path `package.module:factory` of the dataset. Called as factory(seed=train.seed, "
            "**kwargs); returns a map-style dataset whose items are (inputs, targets). Sample i must "
            "depend only on the seed and i (exact resume relies on it); seed + 1 must give held-out samples "
            "of the same task (evaluation uses it)."
        ),
    )
    kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata=doc("Keyword arguments for the dataset factory (e.g. {size: 4096, features: 32} for the demo)."),
    )
    num_workers: int = field(
        default=0, metadata=doc("DataLoader worker processes per rank (0 loads in the training process).")
    )
    delay_seconds: float = field(
        default=0.0,
        metadata=doc(
            "Extra seconds spent fetching each step's batches: makes demo and test steps last long enough "
            "to watch (0.05-0.2 s)."
        ),
    )

    def __post_init__(self) -> None:
        _import_path("data.factory", self.factory)
        _at_least("data.num_workers", self.num_workers, 0)
        _at_least("data.delay_seconds", self.delay_seconds, 0)


@dataclass
class BatchConfig:
    global_batch_size: int = field(
        default=64,
        metadata=doc(
            "Samples per optimizer step over all ranks. Must equal micro_batch_size x grad_accum_steps x "
            "world_size; the data order does not depend on the world size."
        ),
    )
    micro_batch_size: int = field(default=8, metadata=doc("Samples per forward/backward on one rank."))
    grad_accum_steps: int | None = field(
        default=None,
        metadata=doc(
            "Micro-batches accumulated per optimizer step. Derived from the two sizes and the world size; "
            "an explicit value must agree with them."
        ),
    )

    def __post_init__(self) -> None:
        _at_least("batch.global_batch_size", self.global_batch_size, 1)
        _at_least("batch.micro_batch_size", self.micro_batch_size, 1)
        if self.grad_accum_steps is not None:
            _at_least("batch.grad_accum_steps", self.grad_accum_steps, 1)

    def accumulation_for(self, world_size: int) -> int:
        """grad_accum_steps for this world size, or ConfigError naming the numbers that disagree."""
        per_step = self.micro_batch_size * world_size
        if self.grad_accum_steps is not None:
            total = per_step * self.grad_accum_steps
            _check(
                "batch",
                total == self.global_batch_size,
                f"global_batch_size={self.global_batch_size} != micro_batch_size {self.micro_batch_size} "
                f"x grad_accum_steps {self.grad_accum_steps} x world_size {world_size} (= {total})",
            )
            return self.grad_accum_steps
        _check(
            "batch",
            self.global_batch_size % per_step == 0,
            f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size "
            f"{self.micro_batch_size} x world_size {world_size} (= {per_step})",
        )
        return self.global_batch_size // per_step


@dataclass
class OptimConfig:
    lr: float = field(
        default=1e-2,
        metadata=doc("Peak learning rate of AdamW. The default suits the demo MLP; transformers want ~3e-4."),
    )
    weight_decay: float = field(default=0.01, metadata=doc("AdamW weight decay."))
    warmup_steps: int = field(default=0, metadata=doc("Steps of linear warm-up from 0 to lr."))
    schedule: str = field(
        default="cosine",
        metadata=doc("After warm-up: `constant`, or `cosine` decay to min_lr_ratio x lr at train.steps."),
    )
    min_lr_ratio: float = field(
        default=0.1, metadata=doc("Final learning rate of the cosine schedule, as a share of lr.")
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata=doc("Clip the global gradient norm to this value (0: never clip; the norm is still reported)."),
    )

    def __post_init__(self) -> None:
        _at_least("optim.lr", self.lr, 0)
        _at_least("optim.weight_decay", self.weight_decay, 0)
        _at_least("optim.warmup_steps", self.warmup_steps, 0)
        _one_of("optim.schedule", self.schedule, ("constant", "cosine"))
        _check("optim.min_lr_ratio", 0 <= self.min_lr_ratio <= 1, f"must be in [0, 1], got {self.min_lr_ratio}")
        _at_least("optim.max_grad_norm", self.max_grad_norm, 0)


@dataclass
class TrainConfig:
    steps: int = field(default=100, metadata=doc("Optimizer steps to train for (the run's end)."))
    seed: int = field(
        default=0, metadata=doc("Seed of everything: model initialisation, data order, per-rank dropout streams.")
    )
    device: str = field(
        default="auto", metadata=doc("`auto` (cuda:LOCAL_RANK when CUDA is available, else cpu), `cpu` or `cuda`.")
    )
    deterministic: bool = field(
        default=True, metadata=doc("Ask torch for deterministic kernels (needed for bitwise-exact resume on GPU).")
    )
    log_every_steps: int = field(default=10, metadata=doc("Rank 0 logs step, loss and it/s every this many steps."))
    nonfinite_loss_limit: int = field(
        default=0,
        metadata=doc(
            "Stop with FloatingPointError after this many consecutive steps with a NaN or infinite loss, before "
            "more checkpoints are saved from bad weights (0: never; checking reads the loss every step, a device "
            "sync on GPU). A copy to `checkpoint.dir` already under way (of an earlier step) is finished first, "
            "for up to 60 s. The sidecar names such an exit `exception/nonfinite` and the checkpoint to resume from."
        ),
    )

    def __post_init__(self) -> None:
        _at_least("train.steps", self.steps, 1)
        _at_least("train.nonfinite_loss_limit", self.nonfinite_loss_limit, 0)
        _one_of("train.device", self.device, ("auto", "cpu", "cuda"))
        _at_least("train.log_every_steps", self.log_every_steps, 1)


@dataclass
class EvalConfig:
    every_steps: int = field(
        default=0, metadata=doc("Evaluate every this many steps (0: never), inside a declared `eval` phase.")
    )
    batches: int = field(
        default=4,
        metadata=doc(
            "Micro-batches per rank per evaluation, from a held-out copy of the dataset (seed train.seed + 1)."
        ),
    )
    timeout_seconds: float | None = field(
        default=None,
        metadata=doc("Budget announced to the sidecar's watchdog for the eval phase (empty: the sidecar's own)."),
    )

    def __post_init__(self) -> None:
        _at_least("eval.every_steps", self.every_steps, 0)
        _at_least("eval.batches", self.batches, 1)
        if self.timeout_seconds is not None:
            _check("eval.timeout_seconds", self.timeout_seconds > 0, f"must be > 0, got {self.timeout_seconds}")


@dataclass
class DDPOptions:
    bucket_cap_mb: float = field(default=25.0, metadata=doc("DDP gradient bucket size in MiB."))
    find_unused_parameters: bool = field(
        default=False, metadata=doc("Let DDP tolerate parameters that get no gradient (costs a graph walk per step).")
    )

    def __post_init__(self) -> None:
        _check("parallel.ddp.bucket_cap_mb", self.bucket_cap_mb > 0, f"must be > 0, got {self.bucket_cap_mb}")


@dataclass
class FSDPOptions:
    reshard_after_forward: bool = field(
        default=True,
        metadata=doc("FSDP2: free gathered parameters after forward (less memory, one more all-gather in backward)."),
    )
    shard_children: bool = field(
        default=True,
        metadata=doc("FSDP2: shard each direct child module separately before the root (overlaps communication)."),
    )


@dataclass
class ParallelConfig:
    strategy: str = field(
        default="ddp",
        metadata=doc(
            "`ddp` (DistributedDataParallel) or `fsdp` (FSDP2 fully_shard + torch.distributed.checkpoint). "
            "Only the option block of the chosen strategy may be given."
        ),
    )
    backend: str = field(
        default="auto", metadata=doc("Process group backend: `auto` (nccl with CUDA, else gloo), `gloo` or `nccl`.")
    )
    timeout_seconds: float = field(
        default=600.0,
        metadata=doc("Collective timeout of the process group. A hung peer fails the others after this long."),
    )
    ddp: DDPOptions | None = field(default=None, metadata=doc("Options of strategy ddp."))
    fsdp: FSDPOptions | None = field(default=None, metadata=doc("Options of strategy fsdp."))

    def __post_init__(self) -> None:
        _one_of("parallel.strategy", self.strategy, ("ddp", "fsdp"))
        _one_of("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        _check("parallel.timeout_seconds", self.timeout_seconds > 0, f"must be > 0, got {self.timeout_seconds}")
        for other in ("ddp", "fsdp"):
            if other != self.strategy and getattr(self, other) is not None:
                fail(
                    f"parallel.{other}",
                    f"options of strategy {other} given but parallel.strategy is "
                    f"{self.strategy}; remove the block or set parallel.strategy={other}",
                )
        if self.strategy == "ddp" and self.ddp is None:
            self.ddp = DDPOptions()
        if self.strategy == "fsdp" and self.fsdp is None:
            self.fsdp = FSDPOptions()


@dataclass
class CheckpointConfig:
    dir: str = field(
        default="",
        metadata=doc(
            "Directory of `step-N/` checkpoints, seen by all ranks (shared across nodes). Empty: no checkpoints."
        ),
    )
    every_steps: int = field(
        default=50,
        metadata=doc(
            "Copy to `dir` every this many steps (and always at the last step), in the background: training "
            "waits only when the previous copy has not finished by the time the next is due."
        ),
    )
    keep_last: int = field(
        default=3, metadata=doc("Complete checkpoints to keep; older ones are deleted after a newer one is committed.")
    )
    resume: bool = field(
        default=True,
        metadata=doc(
            "Resume at start from the newest state every rank holds, a memory snapshot or the newest complete "
            "checkpoint in `dir` (torchrun restarts rely on it)."
        ),
    )
    memory_every_steps: int = field(
        default=1,
        metadata=doc(
            "Snapshot each rank's state into host shared memory every this many steps (0: never), so that a "
            "restart on the same node resumes there without redoing steps or reading `dir`. The training "
            "thread copies the tensors (model and optimizer state); a background thread writes the file. "
            "Needs `dir` (the snapshots belong to its job)."
        ),
    )
    memory_dir: str = field(
        default="/dev/shm",
        metadata=doc(
            "tmpfs directory of the memory snapshots, in a 0700 subdirectory of the user's own under a random "
            "name (`sidecar-trainer-<uid>.<random>`). Must be root's or the user's, and sticky if others may "
            "write it, as /dev/shm is. Holds at most two snapshots per rank, each the rank's model and optimizer "
            "state (its shard under FSDP); removed when the job finishes. A snapshot that does not fit is "
            "skipped (three in a row: no more for the process); training and disk checkpoints go on."
        ),
    )

    def __post_init__(self) -> None:
        _at_least("checkpoint.every_steps", self.every_steps, 1)
        _at_least("checkpoint.keep_last", self.keep_last, 1)
        _at_least("checkpoint.memory_every_steps", self.memory_every_steps, 0)
        _check(
            "checkpoint.memory_dir",
            bool(self.memory_dir),
            "must name a directory (memory_every_steps=0 turns snapshots off)",
        )


@dataclass
class MonitorConfig:
    enabled: bool = field(
        default=True,
        metadata=doc(
            "Report steps, phases and events to the node sidecar through `trainer_hooks.Monitor` "
            "(a no-op when no sidecar listens)."
        ),
    )


FAULT_KINDS = (
    "none",
    "sigkill",
    "sigstop",
    "loop",
    "sleep",
    "dataloader",
    "sigkill_in_checkpoint",
    "cuda_oom",
    "nan_loss",
)


@dataclass
class FaultConfig:
    kind: str = field(
        default="none",
        metadata=doc(
            "Injected fault: `none`; `sigkill` (the rank SIGKILLs itself at the start of step at_step); "
            "`sigstop` (it SIGSTOPs itself there); `loop` (endless pure-Python busy loop after the forward "
            "of step at_step, before its all-reduce); `sleep` (time.sleep(sleep_seconds) at the same place: "
            "the other ranks block in the all-reduce); `dataloader` (fetching the batches of step at_step "
            "never returns); `sigkill_in_checkpoint` (at the first checkpoint save with step >= at_step the "
            "rank writes half of its file, then SIGKILLs itself before the commit); `cuda_oom` (raises "
            "torch.OutOfMemoryError as the CUDA allocator does, at the same place as `loop`); `nan_loss` (its loss "
            "of step at_step is NaN, so are the gradients and, after the all-reduce, every rank's weights)."
        ),
    )
    rank: int = field(default=0, metadata=doc("Global rank that injects the fault."))
    at_step: int = field(default=1, metadata=doc("Step (1-based) at which the fault fires."))
    only_first_attempt: bool = field(
        default=True,
        metadata=doc(
            "Fire only in the first attempt (TORCHELASTIC_RESTART_COUNT == 0 and the job's first worker-group "
            "generation), so the restarted run heals."
        ),
    )
    sleep_seconds: float = field(default=1e6, metadata=doc("How long kind `sleep` sleeps."))
    checkpoint_delay_seconds: float = field(
        default=0.0,
        metadata=doc(
            "Every rank sleeps this long inside every checkpoint_save phase (any kind, every attempt): "
            "makes a declared phase outlast the watchdog's step timeout."
        ),
    )

    request_file: str = field(
        default="",
        metadata=doc(
            "Path of a JSON fault request, looked at (one stat) at the start of every step; empty: none. A "
            'request {"id", "kind": deadlock | spin | pause, "rank": R or "all", "at_step", "seconds"} is fired '
            "by the rank it names (every rank with `all`, all at the same at_step, which must lie ahead) at the "
            "start of step at_step: `deadlock` (two threads take two locks in opposite orders), `spin` (a "
            "pure-Python busy loop in the main thread), `pause` (seconds of evaluation-like compute outside any "
            "collective, undeclared; then training goes on). Each rank takes a request once (a one-rank "
            "request is renamed away to `<file>.<id>.rank<R>.taken`; for `all`, each rank creates that "
            "marker), so a restarted worker does not fire it again; any attempt may take one. Write it "
            "atomically (sidecar_trainer.fault_requests.write_request). The directory must exist."
        ),
    )

    def __post_init__(self) -> None:
        _one_of("faults.kind", self.kind, FAULT_KINDS)
        if self.request_file:
            _check(
                "faults.request_file",
                os.path.isabs(self.request_file),
                f"must be an absolute path (every rank reads it), got {self.request_file!r}",
            )
            _check(
                "faults.request_file",
                not self.request_file.endswith("/") and not os.path.isdir(self.request_file),
                f"must name a file, not a directory: {self.request_file!r}",
            )
            parent = os.path.dirname(self.request_file)
            _check("faults.request_file", os.path.isdir(parent), f"its directory {parent!r} does not exist")
        _at_least("faults.rank", self.rank, 0)
        _at_least("faults.at_step", self.at_step, 1)
        _at_least("faults.sleep_seconds", self.sleep_seconds, 0)
        _at_least("faults.checkpoint_delay_seconds", self.checkpoint_delay_seconds, 0)
