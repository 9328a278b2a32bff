"""A faster re-rendezvous for torchrun's agent (issue 32, item 2), patched into the agent process by
the launchers (`python -m trainer_hooks.launch`, `python -m sidecar_trainer.launch`); never into a
worker.

Where a multi-node restart's time goes (bench_jobview's per-node recovery stages): on one node the
agent's stage `restart` (its ranks gone -> the next attempt's ranks started) takes 0.28 s, on each
of three simulated nodes 2.1-2.3 s. The difference is torch's dynamic rendezvous
(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py): an agent that joined the next round
while its peers have not yet, or that waits to see the round complete, is told to SYNC, sleeps a
fixed second (`_delay(seconds=1)`) and reads the shared state again, and that read is served from
a copy cached for another second (`_BackendRendezvousStateHolder(cache_duration=1)`). One node
completes the round alone on its first read; with several, the last to join marks the round
complete and the others see it only when their cached copy expires: 1-2 s per restart, however
fast they all arrived (measured with the agents' rendezvous log: all three joined within 0.11 s,
then "can't complete rendezvous: not enough participants" every 0.1 s for 1.8 s on the two
earlier ones while the third had marked the round complete). `fast_polls` makes both the wait and
the cache `seconds` (default POLL_SECONDS); every other delay (the first join's random skew,
keep-alives, timeouts) is left as torch has it.

The cost: each waiting agent reads the rendezvous state from the c10d store 1/`seconds` times a
second instead of once, during a rendezvous only (a few seconds per restart). At 0.1 s that is 10
small reads a second per node: nothing for tens of nodes; for thousands of nodes, set
SIDECAR_RDZV_POLL_SECONDS=1 (torch's own pace) or a value in between.

`fast_event_names` (moved from sidecar_trainer/launch.py) takes another 0.5 s off every
rendezvous: torch names each event after the calling method with `inspect.stack()`, which reads the
source of every frame (0.1-0.15 s a call, twice per event, whether or not anything listens).

Both return False and change nothing on a torch without the function they replace
(docs/changes-to-others.md lists them and how to turn them off).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.1  # the SYNC wait of a joined agent (torch: 1 s)
POLL_ENV = "SIDECAR_RDZV_POLL_SECONDS"  # 1 restores torch's pace; 0 or unset: POLL_SECONDS
TORCH_SYNC_SECONDS = 1  # the wait torch asks for between two reads of the rendezvous state


def poll_seconds(environ: dict[str, str] | None = None) -> float:
    """The SYNC wait from SIDECAR_RDZV_POLL_SECONDS (0.01-1 s), else POLL_SECONDS; a bad value is
    named on stderr and the default used (a launcher never fails over it)."""
    raw = (os.environ if environ is None else environ).get(POLL_ENV, "").strip()
    if not raw:
        return POLL_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.01 <= value <= TORCH_SYNC_SECONDS:
        print(f"{POLL_ENV}={raw!r}: not a number of seconds in [0.01, 1]; using {POLL_SECONDS}", file=sys.stderr)
        return POLL_SECONDS
    return value


def fast_polls(seconds: float | None = None) -> bool:
    """Make the agent's SYNC wait between two reads of the rendezvous state `seconds` (default:
    `poll_seconds()`) instead of torch's 1 s. False, changing nothing, without torch's `_delay`."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return False
    original = getattr(dynamic_rendezvous, "_delay", None)
    if not callable(original):
        return False
    holder = getattr(dynamic_rendezvous, "_BackendRendezvousStateHolder", None)
    if holder is None:
        return False
    wait = poll_seconds() if seconds is None else seconds
    torch_delay: Callable[..., Any] = getattr(original, "__wrapped__", original)
    torch_init: Callable[..., None] = getattr(holder.__init__, "__wrapped__", holder.__init__)

    def __init__(self: Any, backend: Any, settings: Any, cache_duration: float = TORCH_SYNC_SECONDS) -> None:
        torch_init(self, backend, settings, wait if cache_duration == TORCH_SYNC_SECONDS else cache_duration)

    __init__.__wrapped__ = torch_init  # type: ignore[attr-defined]
    # changes: agent-rendezvous (docs/changes-to-others.md)
    holder.__init__ = __init__

    def _delay(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple) and seconds == TORCH_SYNC_SECONDS:
            seconds = wait
        torch_delay(seconds=seconds)

    _delay.__wrapped__ = torch_delay  # type: ignore[attr-defined]
    # changes: agent-rendezvous (docs/changes-to-others.md)
    dynamic_rendezvous._delay = _delay
    return True


def _frame_function_name(depth: int = 2) -> str:
    """What torch's `dynamic_rendezvous.get_method_name(depth)` returns, read from the frame
    itself: the name of the function `depth` frames up from this one."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def fast_event_names() -> bool:
    """Make the agent's rendezvous name its events without `inspect.stack()` (the same name, read
    from the frame). False, changing nothing, when this torch has no such function."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return False
    if not callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        return False
    # changes: agent-rendezvous (docs/changes-to-others.md)
    dynamic_rendezvous.get_method_name = _frame_function_name
    return True


def install() -> dict[str, bool]:
    """Both, in the agent, before torchrun's main runs; what each did."""
    return {"fast_polls": fast_polls(), "fast_event_names": fast_event_names()}
