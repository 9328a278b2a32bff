"""Process group set-up: torchrun's environment when present, a one-process group otherwise, so the
same code path (DDP or FSDP over a real process group) runs under `python -m trainer` too."""
from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    size: int
    restart_count: int
    generation: int  # attempts of this job's worker group so far, agreed by all ranks (1: the first)
    backend: str
    device: torch.device

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


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> tuple[dist.Store, int]:
    """A store namespace that belongs to this attempt of the worker group alone.

    Under torchrun's c10d rendezvous the workers share the agent's TCPStore across restarts, and
    the process group's keys from the previous attempt are still there: a restarted gloo group
    then reads a dead peer's address and fails or hangs (torch 2.13, seen here). The restart count
    cannot name the attempt, since agents on different nodes count differently (a node whose workers
    hung, not failed, restarts without counting). So rank 0 draws a new generation number and every
    other rank acknowledges it with a fresh nonce: a rank accepts generation g only when rank 0's
    "go" for g carries its own nonce, which a leftover key of an earlier attempt never does.
    """
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=(rank == 0 and not use_agent_store), timeout=timeout)
    if rank == 0:
        gen = base.add("trainer/generation", 1)
        base.set("trainer/current", str(gen))
        acks = {}
        for peer in range(1, world_size):
            key = f"trainer/{gen}/ack/{peer}"
            base.wait([key], timeout)
            acks[str(peer)] = base.get(key).decode()
        base.set(f"trainer/{gen}/go", json.dumps(acks))
        return dist.PrefixStore(f"trainer/{gen}/", base), gen
    nonce, acked = secrets.token_hex(8), None
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        gen = base.get("trainer/current").decode()
        if gen != acked:
            base.set(f"trainer/{gen}/ack/{rank}", nonce)
            acked = gen
        if base.check([f"trainer/{gen}/go"]) and json.loads(base.get(f"trainer/{gen}/go")).get(str(rank)) == nonce:
            return dist.PrefixStore(f"trainer/{gen}/", base), int(gen)
        time.sleep(0.05)
    raise TimeoutError(f"rank {rank}: no generation from rank 0 within {timeout.total_seconds():.0f}s")


def init(device_choice: str, backend_choice: str, timeout_seconds: float) -> World:
    if "RANK" not in os.environ:  # plain `python -m trainer`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    backend = backend_choice if backend_choice != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_seconds)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, generation = attempt_store(rank, size, timeout) if "TORCHELASTIC_RUN_ID" in os.environ else (None, 1)
    dist.init_process_group(backend, store=store, rank=rank if store else -1, world_size=size if store else -1,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    return World(rank=dist.get_rank(), local_rank=local_rank, size=dist.get_world_size(),
                 restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), generation=generation,
                 backend=backend, device=device)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
