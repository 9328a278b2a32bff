"""A rank that dies the way a test asks: a real process with the real hooks (unless --no-hooks),
often under real torchrun.

    python tests/exits/exit_rank.py --mode MODE [--steps N] [--ready FILE]

Modes:
    finish        N steps, close the monitor, exit 0
    hold          N steps, then keep stepping slowly until killed (with --checkpoint-until M:
                  reporting a checkpoint every second step up to M first)
    hang          N steps, then stop stepping (a hang the watchdog kills)
    cuda_oom      N steps, then raise torch.OutOfMemoryError as the CUDA caching allocator does
    gloo_timeout  two ranks with a 3 s gloo timeout: rank 1 stalls, rank 0's all_reduce times out
    allocate      move into the memory cgroup named by EXIT_TEST_CGROUP, then allocate until killed
    user_hook     install its own sys.excepthook (it writes --marker), then raise ValueError
    nan           steps with checkpoints (every second step, up to --checkpoint-until), the loss goes
                  NaN from --nan-step (default 5), a guard raises
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ready", help="touch this file once the steps are sent")
    p.add_argument("--marker", help="user_hook: the user's excepthook writes here")
    p.add_argument("--go", help="wait for this file before the fatal act")
    p.add_argument("--no-hooks", action="store_true")
    p.add_argument("--nan-step", type=int, default=5)
    p.add_argument("--checkpoint-until", type=int, help="nan, hold: the last step that reports a checkpoint")
    return p.parse_args()


def main() -> None:
    args = parse()
    if args.mode == "allocate" and os.environ.get("EXIT_TEST_CGROUP"):
        with open(os.path.join(os.environ["EXIT_TEST_CGROUP"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    torch = None
    if args.mode in ("cuda_oom", "gloo_timeout"):
        import torch  # noqa: F811  (before the Monitor: it reports torch's version)
    mon = None
    if not args.no_hooks:
        from trainer_hooks import Monitor

        mon = Monitor(flush_interval=0.2)
    if args.mode == "user_hook":
        previous = sys.excepthook

        def users_hook(tp, value, tb):
            with open(args.marker, "w") as f:
                f.write(f"{tp.__name__}: {value}")
            previous(tp, value, tb)

        sys.excepthook = users_hook

    loss = 2.0
    for step in range(1, args.steps + 1):
        last = args.checkpoint_until if args.checkpoint_until is not None else args.steps
        if (
            args.mode in ("nan", "hold")
            and step % 2 == 0
            and step <= last
            and (args.mode == "nan" or args.checkpoint_until)
        ):
            mon.event("checkpoint_saved", step=step, path=f"/ckpt/step-{step}")
        if args.mode == "nan":
            loss = float("nan") if step >= args.nan_step else loss * 0.9
        if mon is not None:
            mon.step(step, loss=loss, step_time_seconds=0.05)
        time.sleep(0.05)
    time.sleep(0.6)  # one flush: the sidecar has the steps
    if args.ready:
        open(args.ready, "w").close()
    while args.go and not os.path.exists(args.go):
        time.sleep(0.05)

    if args.mode == "finish":
        mon.close()
        return
    if args.mode == "hold":
        step = args.steps
        while True:
            step += 1
            if mon is not None:
                mon.step(step, loss=loss, step_time_seconds=0.5)
            time.sleep(0.5)
    if args.mode == "hang":
        time.sleep(3600)
    if args.mode == "cuda_oom":
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.02 GiB is free.\nOf the allocated memory 70.00 GiB is allocated by PyTorch"
        )
    if args.mode == "gloo_timeout":
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
        if dist.get_rank() == 1:
            time.sleep(3600)  # the straggler: it never joins the all_reduce
        dist.all_reduce(torch.ones(4))
    if args.mode == "allocate":
        hoard = []
        while True:
            hoard.append(bytearray(16 << 20))
            for i in range(0, len(hoard[-1]), 4096):
                hoard[-1][i] = 1
    if args.mode == "user_hook":
        raise ValueError("the user's own failure")
    if args.mode == "nan":
        raise FloatingPointError(f"loss is nan at step {args.steps}: non-finite loss guard")
    raise SystemExit(f"unknown mode {args.mode}")


if __name__ == "__main__":
    main()
