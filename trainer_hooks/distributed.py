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
way. `docs/architecture/restarts.md` ("Restarts and the agent's store") has the details.

The remedy is a store namespace per attempt. The restart count cannot name the attempt (agents on
different nodes count differently), so rank 0 draws a new generation number from the store and
every other rank acknowledges it with a fresh nonce: a rank accepts generation g only when rank 0's
"go" for g carries its own nonce, which a leftover key of an earlier attempt never does.

`install()` puts this into torch's `env://` and `tcp://` rendezvous handlers, so every later
`init_process_group` in the process gets it, whoever calls it. Outside torchrun, or when torchrun
gives each attempt a fresh store (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, NVIDIA's ft_launcher),
nothing changes: a plain `init_process_group`. `SIDECAR_ATTEMPT_STORE=0` turns it off.
Torch is imported only when one of these functions runs.

Importing `trainer_hooks` (and creating a `Monitor`) calls `install_when_torch_is_imported()`,
so a script that uses the hooks and a plain `torch.distributed.init_process_group` comes back
after a restart too, with no torch import of its own: when torch is imported already (it imports
torch.distributed.rendezvous, the handlers' module), it installs at once; otherwise a finder on
`sys.meta_path` installs right after torch loads that module, and then leaves. Either way before
any `init_process_group`. A group formed before the hooks were imported is not covered:
`restart_safety()` says so, and the registration tells the sidecar, which names the fix.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import secrets
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from trainer_hooks.environment import switched_on
from trainer_hooks.errors import warn

PREFIX = "trainer_hooks/attempt"
SWITCH = "SIDECAR_ATTEMPT_STORE"
_SCHEMES = ("env", "tcp")
_MARK = "_trainer_hooks_attempt_store"
_HANDLERS_MODULE = "torch.distributed.rendezvous"
_generation: int | None = None
_formed_here = False  # the default group of this process was formed through an installed handler
_install_failed = False


def needed(environ: Mapping[str, str] | None = None) -> bool:
    """True under torchrun when the workers share the agent's long-lived store (and not switched off)."""
    env = os.environ if environ is None else environ
    return (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RUN_ID" in env and switched_on(env, SWITCH)
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
        global _generation, _formed_here
        import torch.distributed as dist

        if timeout is None:
            timeout = dist.constants.default_pg_timeout
        store, rank, world_size = next(original(url, timeout=timeout, **kwargs))
        if needed() and world_size > 0 and rank >= 0:
            store, _generation = attempt_store(store, rank, world_size, timeout)
            _formed_here = True
        yield store, rank, world_size
        raise RuntimeError("trainer_hooks: re-rendezvous through the same handler is not supported")

    # changes: rendezvous-handlers (docs/changes-to-others.md)
    setattr(handler, _MARK, original)
    return handler


def install() -> bool:
    """From now on, `init_process_group` over `env://` or `tcp://` in this process uses a store
    namespace of its own attempt when it runs under torchrun with the agent's store. Idempotent.
    Returns True when the per-attempt namespace will be used; never raises."""
    global _install_failed
    try:
        if not needed():
            return False
        handlers = _handlers()
        for scheme in _SCHEMES:
            current = handlers.get(scheme)
            if current is not None and not hasattr(current, _MARK):
                # changes: rendezvous-handlers (docs/changes-to-others.md)
                handlers[scheme] = _wrap(current)
        return True
    except Exception as e:  # a torch without the handler table: plain init, said once
        _install_failed = True
        warn("attempt_store", "trainer_hooks: per-attempt store unavailable (%s: %s)", type(e).__name__, e)
        return False


def installed() -> bool:
    """Torch's `env://` handler in this process is the per-attempt one."""
    module = sys.modules.get(_HANDLERS_MODULE)
    handler = getattr(module, "_rendezvous_handlers", {}).get("env") if module else None
    return handler is not None and hasattr(handler, _MARK)


class _InstallAfterTorchLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when torch's rendezvous module is imported, it wraps the loader that
    the other finders found so that `install()` runs right after the module executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _HANDLERS_MODULE:
            return None
        _remove_finder()  # once is enough, and the finders asked below must not include this one
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenInstall(spec.loader)
        return spec


class _ThenInstall(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # changes: rendezvous-import-hook (docs/changes-to-others.md)
        self._loader.exec_module(module)
        install()

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... of the real loader
        return getattr(self._loader, name)


def _remove_finder() -> None:
    # changes: rendezvous-import-hook (docs/changes-to-others.md)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _InstallAfterTorchLoads)]


def install_when_torch_is_imported() -> None:
    """`install()` now if torch is imported, else as soon as it is (see the module docstring).
    Does nothing outside torchrun's shared store or with SIDECAR_ATTEMPT_STORE=0; never imports
    torch; never raises."""
    try:
        if not needed():
            return
        if _HANDLERS_MODULE in sys.modules:
            install()
        elif not any(isinstance(f, _InstallAfterTorchLoads) for f in sys.meta_path):
            # changes: rendezvous-import-hook (docs/changes-to-others.md)
            sys.meta_path.insert(0, _InstallAfterTorchLoads())
    except Exception as e:
        warn("attempt_store", "trainer_hooks: per-attempt store unavailable (%s: %s)", type(e).__name__, e)


def restart_safety(environ: Mapping[str, str] | None = None) -> bool | None:
    """Whether this rank's next process group survives a torchrun restart: None outside torchrun;
    True when torchrun gives each attempt a fresh store, or when the group is (or will be) formed
    in a namespace of its own attempt; False when it shares the agent's store without one (the
    remedy switched off, unavailable, or a group formed before the hooks were imported). Never raises."""
    try:
        return _restart_safety(os.environ if environ is None else environ)
    except Exception:
        return None


def _restart_safety(env: Mapping[str, str]) -> bool | None:
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return True
    if not needed(env) or _install_failed:
        return False
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "is_available", lambda: False)() and dist.is_initialized():
        return _formed_here
    return installed() or any(isinstance(f, _InstallAfterTorchLoads) for f in sys.meta_path)


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
            # changes: rendezvous-handlers (docs/changes-to-others.md)
            handlers[scheme] = getattr(current, _MARK)


def init_process_group(backend: str | None = None, **kwargs: Any) -> int | None:
    """`torch.distributed.init_process_group(backend, **kwargs)`, safe across torchrun restarts.

    Under torchrun with the agent's store (and no `store=` given) the group lives in a namespace
    of its own attempt; otherwise this is the plain call. Returns the attempt generation (None
    when no per-attempt namespace was used)."""
    import torch.distributed as dist

    global _generation, _formed_here
    _generation, _formed_here = None, False
    if kwargs.get("store") is None:
        install()
    dist.init_process_group(backend, **kwargs)
    return _generation
