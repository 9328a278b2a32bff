"""Fault requests: in-process faults asked for while the job runs (`faults.request_file`).

A benchmark or a drill writes a JSON file (atomically: `write_request`)

    {"id": "f3", "kind": "deadlock", "rank": 2, "at_step": 840, "seconds": 10}

and the rank it addresses (`"rank": "all"`: every rank) fires the fault at the start of step
`at_step` (no `at_step`: the next step). Kinds (`REQUEST_KINDS`):

- `deadlock`: the main thread and a second thread take two locks in opposite orders and block
  on each other forever (a real lock-order deadlock: no CPU, a still stack);
- `spin`: an endless pure-Python busy loop in the main thread (CPU, a still stack);
- `pause`: `seconds` of evaluation-like compute (forward passes of a small model, no collective,
  no declared phase), then the step goes on: a healthy pause. With `"rank": "all"` every rank
  pauses at the same step, which must still lie ahead when a rank reads the request (a rank that
  reads it late skips it and logs why: pausing alone would make its peers wait on it).

A request is taken once per rank, so that a restarted worker does not fire it again: a request for
one rank is renamed away by that rank (`<file>.<id>.rank<R>.taken`: the file is gone once taken),
one for every rank stays and each rank creates that marker exclusively. A malformed request is
logged and ignored (it never raises into training).

Cost: unset, nothing; set, one `os.stat` per step (the file is read only when its inode, size or
mtime changed).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("sidecar_trainer")

REQUEST_KINDS = ("deadlock", "spin", "pause")


class BadRequest(ValueError):
    """A request file that cannot be fired; the message says which field and why."""


@dataclass(frozen=True)
class FaultRequest:
    id: str
    kind: str
    rank: int | None  # None: every rank
    at_step: int | None  # None: the next step
    seconds: float = 0.0

    @classmethod
    def parse(cls, data: object) -> FaultRequest:
        if not isinstance(data, dict):
            raise BadRequest(f"expected a JSON object, got {type(data).__name__}")
        rid, kind, rank = data.get("id"), data.get("kind"), data.get("rank")
        if not isinstance(rid, str) or not rid or not rid.replace("-", "").replace("_", "").isalnum():
            raise BadRequest(f"id: expected a non-empty string of letters, digits, - and _, got {rid!r}")
        if kind not in REQUEST_KINDS:
            raise BadRequest(f"kind: expected one of {', '.join(REQUEST_KINDS)}, got {kind!r}")
        if rank != "all" and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise BadRequest(f'rank: expected a rank >= 0 or "all", got {rank!r}')
        at_step = data.get("at_step")
        if at_step is not None and (not isinstance(at_step, int) or isinstance(at_step, bool) or at_step < 1):
            raise BadRequest(f"at_step: expected a step >= 1, got {at_step!r}")
        if rank == "all" and at_step is None:
            raise BadRequest("at_step: a request for every rank needs the step they all start it at")
        seconds = data.get("seconds", 0.0)
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 86400:
            raise BadRequest(f"seconds: expected a number of seconds in [0, 86400), got {seconds!r}")
        if kind == "pause" and not seconds:
            raise BadRequest("seconds: a pause needs its length")
        return cls(rid, kind, None if rank == "all" else rank, at_step, float(seconds))

    def to_json(self) -> str:
        out: dict[str, object] = {"id": self.id, "kind": self.kind, "rank": "all" if self.rank is None else self.rank}
        if self.at_step is not None:
            out["at_step"] = self.at_step
        if self.seconds:
            out["seconds"] = self.seconds
        return json.dumps(out)


def write_request(path: str | os.PathLike, request: FaultRequest) -> None:
    """Put `request` at `path` atomically (a temporary file renamed over it): a rank never reads half of one."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(request.to_json())
    os.replace(tmp, path)


def taken_marker(path: str | os.PathLike, request_id: str, rank: int) -> str:
    """Where rank `rank` records that it took request `request_id` (a one-rank request: the file itself, renamed)."""
    return f"{os.fspath(path)}.{request_id}.rank{rank}.taken"


class RequestWatch:
    """Per rank: looks at the request file at the start of every step, takes what is addressed to it
    once, and fires it at its step."""

    def __init__(self, path: str, rank: int) -> None:
        self.path, self.rank = path, rank
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) of the file last read
        self._pending: FaultRequest | None = None

    def step_start(self, step: int) -> None:
        self._look(step)
        request = self._pending
        if request is not None and (request.at_step is None or step >= request.at_step):
            self._pending = None
            fire(request, self.rank, step)

    def _look(self, step: int) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        signature = (st.st_ino, st.st_size, st.st_mtime_ns)
        if signature == self._seen:
            return
        self._seen = signature
        try:
            with open(self.path) as f:
                request = FaultRequest.parse(json.load(f))
        except FileNotFoundError:  # taken by its rank between the stat and the open
            return
        except (OSError, ValueError) as e:  # BadRequest and JSON errors are ValueErrors
            log.warning("fault request %s ignored: %s", self.path, e)
            return
        if request.rank is not None and request.rank != self.rank:
            return
        if not self._take(request):
            return
        if request.rank is None and request.at_step is not None and step > request.at_step:
            log.warning(
                "fault request %s (%s on every rank at step %d) skipped on rank %d: read at step %d, too late",
                request.id,
                request.kind,
                request.at_step,
                self.rank,
                step,
            )
            return
        self._pending = request

    def _take(self, request: FaultRequest) -> bool:
        """Take the request once: False when this rank (an earlier attempt of it) already did."""
        marker = taken_marker(self.path, request.id, self.rank)
        try:
            if request.rank is None:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            else:
                if os.path.exists(marker):
                    return False
                os.rename(self.path, marker)
        except (FileExistsError, FileNotFoundError):
            return False
        except OSError as e:
            log.warning("fault request %s ignored: cannot take it (%s)", self.path, e)
            return False
        return True


def fire(request: FaultRequest, rank: int, step: int) -> None:
    log.warning(
        "fault injection: %s on rank %d at step %d (pid %d; request %s)",
        request.kind,
        rank,
        step,
        os.getpid(),
        request.id,
    )
    if request.kind == "deadlock":
        deadlock()
    elif request.kind == "spin":
        spin()
    else:
        pause(request.seconds)
        log.warning(
            "fault request %s: pause of %.1fs done on rank %d at step %d", request.id, request.seconds, rank, step
        )


def deadlock() -> None:
    """Two threads, two locks, opposite orders: each holds one and waits for the other, forever."""
    first, second = threading.Lock(), threading.Lock()
    holds_second = threading.Event()

    def other() -> None:
        with second:
            holds_second.set()
            with first:  # never: the main thread holds it
                pass

    with first:
        threading.Thread(target=other, name="fault-deadlock", daemon=True).start()
        holds_second.wait()
        with second:  # never: the other thread holds it
            pass


def spin() -> None:
    n = 0
    while True:  # pure Python, holds the GIL between bytecodes: a livelock, not a sleep
        n = (n + 1) % 1_000_003


def pause(seconds: float) -> None:
    """`seconds` of evaluation-like work: forward passes of a small model under no_grad, on this
    process's CPU, touching no collective and declaring no phase. Draws nothing from the global
    RNG (the model is built inside `fork_rng`), so training computes what it would have."""
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.LayerNorm(128), nn.Linear(128, 64), nn.Tanh())
    batch = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    deadline = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < deadline:
            batch = model(batch)
