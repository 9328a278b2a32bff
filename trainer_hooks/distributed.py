"""A process group that comes back after torchrun restarts the worker group.

    import trainer_hooks.distributed as thd
    thd.init_process_group("gloo")   # instead of torch.distributed.init_process_group("gloo")

or, when a framework (Lightning, Accelerate, HF Trainer) calls `init_process_group` itself:

    thd.install()                    # before the framework sets up distributed

Why: torchrun (torch 2.13, c10d rendezvous, also `--standalone`) hands its workers the address of
the agent's own TCPStore (`TORCHELASTIC_USE_AGENT_STORE=True`), which lives as long as the agent,
across restarts, and the workers use it without any per-attempt prefix. A restarted group then
finds the previous attempt's keys: gloo's full-mesh connect reads a dead peer's address
(`default_pg/0//cpu//0/<rank>`) before the new peer has written its own, and fails with
"Gloo connectFullMesh failed ... Connection refused"; NCCL's unique-id exchange reads the same
way. `docs/architecture.md` ("Restarts and the agent's store") has the details.

The remedy is a store namespace per attempt. The restart count cannot name the attempt (agents on
different nodes count differently), so rank 0 draws a new generation number from the store and
every other rank acknowledges it with a fresh nonce: a rank accepts generation g only when rank 0's
"go" for g carries its own nonce, which a leftover key of an earlier attempt never does.

`install()` puts this into torch's `env://` and `tcp://` rendezvous handlers, so every later
`init_process_group` in the process gets it, whoever calls it. Outside torchrun, or when torchrun
gives each attempt a fresh store (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, NVIDIA's ft_launcher),
nothing changes: a plain `init_process_group`. `SIDECAR_ATTEMPT_STORE=0` turns it off.
Torch is imported only when one of these functions runs.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from trainer_hooks.errors import warn

PREFIX = "trainer_hooks/attempt"
SWITCH = "SIDECAR_ATTEMPT_STORE"
_SCHEMES = ("env", "tcp")
_MARK = "_trainer_hooks_attempt_store"
_generation: int | None = None


def needed(environ: Mapping[str, str] | None = None) -> bool:
    """True under torchrun when the workers share the agent's long-lived store (and not switched off)."""
    env = os.environ if environ is None else environ
    return (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and "TORCHELASTIC_RUN_ID" in env
        and env.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")
    )


def generation() -> int | None:
    """The attempt generation this process joined (1 for the first), None before or without one."""
    return _generation


def attempt_store(base: Any, rank: int, world_size: int, timeout: timedelta) -> tuple[Any, int]:
    """A namespace of `base` that belongs to this attempt of the worker group alone, and its
    generation number (agreed by all ranks)."""
    import torch.distributed as dist

    if rank == 0:
        gen = base.add(f"{PREFIX}/generation", 1)
        base.set(f"{PREFIX}/current", str(gen))
        acks = {}
        for peer in range(1, world_size):
            key = f"{PREFIX}/{gen}/ack/{peer}"
            base.wait([key], timeout)
            acks[str(peer)] = base.get(key).decode()
        base.set(f"{PREFIX}/{gen}/go", json.dumps(acks))
        return dist.PrefixStore(f"{PREFIX}/{gen}/", base), gen
    nonce, acked = secrets.token_hex(8), None
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        gen = base.get(f"{PREFIX}/current").decode()  # waits (store timeout) in the first attempt
        if gen != acked:
            base.set(f"{PREFIX}/{gen}/ack/{rank}", nonce)
            acked = gen
        go = f"{PREFIX}/{gen}/go"
        if base.check([go]) and json.loads(base.get(go)).get(str(rank)) == nonce:
            return dist.PrefixStore(f"{PREFIX}/{gen}/", base), int(gen)
        time.sleep(0.02)
    raise TimeoutError(f"rank {rank}: no attempt generation from rank 0 within {timeout.total_seconds():.0f}s")


def _wrap(original: Any) -> Any:
    def handler(url: str, timeout: timedelta | None = None, **kwargs: Any):
        global _generation
        import torch.distributed as dist

        if timeout is None:
            timeout = dist.constants.default_pg_timeout
        store, rank, world_size = next(original(url, timeout=timeout, **kwargs))
        if needed() and world_size > 0 and rank >= 0:
            store, _generation = attempt_store(store, rank, world_size, timeout)
        yield store, rank, world_size
        raise RuntimeError("trainer_hooks: re-rendezvous through the same handler is not supported")

    setattr(handler, _MARK, original)
    return handler


def install() -> bool:
    """From now on, `init_process_group` over `env://` or `tcp://` in this process uses a store
    namespace of its own attempt when it runs under torchrun with the agent's store. Idempotent.
    Returns True when the per-attempt namespace will be used; never raises."""
    try:
        if not needed():
            return False
        handlers = _handlers()
        for scheme in _SCHEMES:
            current = handlers.get(scheme)
            if current is not None and not hasattr(current, _MARK):
                handlers[scheme] = _wrap(current)
        return True
    except Exception as e:  # a torch without the handler table: plain init, said once
        warn("attempt_store", "trainer_hooks: per-attempt store unavailable (%s: %s)", type(e).__name__, e)
        return False


def _handlers() -> dict:
    # `torch.distributed.rendezvous` the attribute is a function; the module holds the table, and
    # torch offers no public way to replace a registered handler.
    return importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers


def uninstall() -> None:
    """Put torch's own rendezvous handlers back (tests)."""
    if "torch" not in sys.modules:
        return
    handlers = _handlers()
    for scheme in _SCHEMES:
        current = handlers.get(scheme)
        if current is not None and hasattr(current, _MARK):
            handlers[scheme] = getattr(current, _MARK)


def init_process_group(backend: str | None = None, **kwargs: Any) -> int | None:
    """`torch.distributed.init_process_group(backend, **kwargs)`, safe across torchrun restarts.

    Under torchrun with the agent's store (and no `store=` given) the group lives in a namespace
    of its own attempt; otherwise this is the plain call. Returns the attempt generation (None
    when no per-attempt namespace was used)."""
    import torch.distributed as dist

    global _generation
    _generation = None
    if kwargs.get("store") is None:
        install()
    dist.init_process_group(backend, **kwargs)
    return _generation
