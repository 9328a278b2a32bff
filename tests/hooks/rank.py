"""A stand-in training rank for the hooks' tests: a real process that uses `Monitor` the way a
trainer does, scripted by flags, and writes what it saw to a JSON result file.

The sidecar refuses registrations from its own ancestors (it would never signal them), so
a test process that started the sidecar cannot be the rank: this program is.

    python -m tests.hooks.rank --result OUT.json --steps 50 --sleep 0.01 [options]

Each step sleeps `--sleep` (the "work"), then calls `mon.step` with six metrics. The result
holds the loop's wall time, the slowest hook call, how long `close()` took, and the
monitor's counters after it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

from trainer_hooks import Monitor


class DuckTensor:
    """Quacks like a one-element tensor; remembers which threads read it."""

    readers: set[str] = set()

    def __init__(self, value: float):
        self.value = value

    def detach(self) -> DuckTensor:
        return self

    def item(self) -> float:
        DuckTensor.readers.add(threading.current_thread().name)
        return self.value


def wait_for(path: str | None, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--result", required=True, help="write the JSON result here")
    p.add_argument("--steps", type=int, default=20, help="steps to run; 0: until --run-until exists")
    p.add_argument("--run-until", help="with --steps 0: keep stepping until this file exists")
    p.add_argument("--first-step", type=int, default=1)
    p.add_argument(
        "--rewind-to",
        type=int,
        default=-1,
        help="after the steps, roll back to this step (a restore) and run --rewind-steps more",
    )
    p.add_argument("--rewind-steps", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.005, help="seconds of 'work' per step")
    p.add_argument("--buffer-size", type=int, default=10_000)
    p.add_argument("--nan-loss-at", type=int, default=-1, help="send loss=NaN at this step")
    p.add_argument(
        "--checkpoint-at",
        type=int,
        default=-1,
        help="at this step run a checkpoint_save phase and a checkpoint_saved event",
    )
    p.add_argument("--raise-in-phase", action="store_true", help="the checkpoint phase raises (caught here)")
    p.add_argument("--hold-in-phase", help="inside the checkpoint phase, wait for this file")
    p.add_argument("--custom-until", type=int, default=-1, help="send custom metrics c1, c2 up to this step")
    p.add_argument("--pause-after", type=int, default=-1, help="pause --pause-seconds after this step")
    p.add_argument("--pause-seconds", type=float, default=1.5)
    p.add_argument(
        "--tensors",
        choices=["none", "torch", "duck"],
        default="none",
        help="send loss and grad_norm as torch tensors or as duck-typed tensors",
    )
    p.add_argument(
        "--fork-at", type=int, default=-1, help="at this step fork a child that calls every hook (and close) and exits"
    )
    p.add_argument("--hold-until", help="after the loop, wait for this file before closing")
    p.add_argument(
        "--event-threads",
        type=int,
        default=0,
        help="threads that each send --events-per-thread events while the steps run",
    )
    p.add_argument("--events-per-thread", type=int, default=1000)
    p.add_argument(
        "--wait-sent",
        type=int,
        default=0,
        help="before closing, wait (up to 30 s) until the sidecar accepted this many items",
    )
    p.add_argument("--ready", help="touch this file once the monitor is set up")
    p.add_argument("--read-timeout", type=float, help="the monitor's read timeout (seconds)")
    return p.parse_args(argv)


def step_numbers(args: argparse.Namespace):
    if args.steps:
        yield from range(args.first_step, args.first_step + args.steps)
    else:
        step = args.first_step
        while not os.path.exists(args.run_until):
            yield step
            step += 1
    if args.rewind_to >= 0:
        yield from range(args.rewind_to, args.rewind_to + args.rewind_steps)


def main(argv: list[str]) -> int:
    args = parse(argv)
    mon = Monitor(buffer_size=args.buffer_size, read_timeout=args.read_timeout)
    result: dict = {"pid": os.getpid(), "stack_dump_path": mon.stack_dump_path, "enabled": mon.enabled}
    if args.ready:
        Path(args.ready).touch()
    torch = None
    if args.tensors == "torch":
        import torch  # noqa: F811 - only when asked: the hooks themselves never import it
    worst = 0.0
    raised: list[str] = []
    senders = [
        threading.Thread(target=send_events, args=(mon, i, args.events_per_thread)) for i in range(args.event_threads)
    ]
    start = time.perf_counter()
    for t in senders:
        t.start()
    step = 0
    for step in step_numbers(args):
        time.sleep(args.sleep)
        loss: object = 1.0 / step
        grad_norm: object = 0.5
        if step == args.nan_loss_at:
            loss = math.nan
        if torch is not None:
            loss, grad_norm = torch.tensor(loss), torch.tensor(grad_norm)
        elif args.tensors == "duck":
            loss, grad_norm = DuckTensor(loss), DuckTensor(grad_norm)
        extra = {"c1": step, "c2": -step} if step <= args.custom_until else {}
        t0 = time.perf_counter()
        mon.step(
            step, loss=loss, grad_norm=grad_norm, lr=3e-4, samples=8, tokens=256, step_time_seconds=args.sleep, **extra
        )
        worst = max(worst, time.perf_counter() - t0)
        if step == args.checkpoint_at:
            try:
                with mon.phase("checkpoint_save", timeout=60):
                    wait_for(args.hold_in_phase)
                    if args.raise_in_phase:
                        raise KeyError("disk full")
                    mon.event("checkpoint_saved", step=step, path=f"/ckpt/step-{step}")
            except KeyError as e:
                raised.append(repr(e))
        if step == args.fork_at:
            fork_child(mon, step)
        if step == args.pause_after:
            time.sleep(args.pause_seconds)
    for t in senders:
        t.join()
    result.update(elapsed=time.perf_counter() - start, worst_call=worst, last_step=step, raised=raised)
    wait_for(args.hold_until)
    deadline = time.monotonic() + 30
    while mon.sent < args.wait_sent and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.perf_counter()
    mon.close()
    result.update(
        close_seconds=time.perf_counter() - t0,
        sent=mon.sent,
        dropped=mon.dropped,
        registrations=mon.registrations,
        tensor_readers=sorted(DuckTensor.readers),
    )
    Path(args.result).write_text(json.dumps(result))
    return 0


def send_events(mon: Monitor, thread: int, count: int) -> None:
    for i in range(count):
        mon.event("progress_note", thread=thread, i=i)


def fork_child(mon: Monitor, step: int) -> None:
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker, say
        try:
            mon.step(step + 1_000_000, loss=0.0)
            mon.event("from_child")
            with mon.phase("eval"):
                pass
            mon.close()
            time.sleep(1.5)  # long enough for a sender thread, had one survived, to post
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main(sys.argv[1:]))
