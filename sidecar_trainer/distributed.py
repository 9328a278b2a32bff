"""Process group set-up: torchrun's environment when present, a one-process group otherwise, so the
same code path (DDP or FSDP over a real process group) runs under `python -m sidecar_trainer` too."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

import trainer_hooks.distributed as attempt_safe
from trainer_hooks import collectives


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    size: int
    restart_count: int
    generation: int  # attempts of this job's worker group so far, agreed by all ranks (1: the first)
    backend: str
    device: torch.device
    timeout: datetime.timedelta  # of collectives (parallel.timeout_seconds)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(device_choice: str, backend_choice: str, timeout_seconds: float) -> World:
    if "RANK" not in os.environ:  # plain `python -m sidecar_trainer`: a world of one
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    backend = backend_choice if backend_choice != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_seconds)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The Flight Recorder on before the group forms (the job view judges hangs from it), unless the
    # user chose otherwise (TORCH_FR_BUFFER_SIZE, SIDECAR_COLLECTIVES=0): a forkserver-warmed worker
    # imported the hooks before torchrun's environment existed.
    collectives.enable()
    # Under torchrun the group gets a store namespace of its own attempt (trainer_hooks.distributed).
    generation = (
        attempt_safe.init_process_group(
            backend, rank=rank, world_size=size, timeout=timeout, device_id=device if device.type == "cuda" else None
        )
        or 1
    )
    return World(
        rank=dist.get_rank(),
        local_rank=local_rank,
        size=dist.get_world_size(),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        generation=generation,
        backend=backend,
        device=device,
        timeout=timeout,
    )


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
