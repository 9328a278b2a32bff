"""`python -m trainer_hooks.launch`: torchrun for any script, whose agent re-forms a multi-node job
faster after a restart (trainer_hooks/rendezvous.py: the rendezvous' one-second SYNC waits and its
`inspect.stack()` event names), and, with `--warm`, whose restarted workers start warm.

    python -m trainer_hooks.launch --nnodes 3 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint node-0:29400 --rdzv-id job-7 --max-restarts 3 train.py --lr 0.1
    python -m trainer_hooks.launch --warm --preload transformers --standalone \\
        --nproc-per-node 8 --max-restarts 3 train.py --lr 0.1

takes torchrun's command line unchanged (it is torchrun, `torch.distributed.run`: its agent,
rendezvous, restarts and workers), with the agent patched first. Without `--warm` nothing changes
in the workers. SIDECAR_RDZV_POLL_SECONDS sets the rendezvous wait (default 0.1; 1 is torch's own
pace).

`--warm` (or SIDECAR_WARM=1): every attempt's workers are forks of one server that imported torch,
torch._dynamo, torch.nn.parallel, trainer_hooks and the `--preload` modules once, each running the
script as `python script.py` would (trainer_hooks/warm.py says what is kept: fresh globals,
`__main__`, argv, sys.path[0], torchrun's environment, exit status; CUDA is never initialised
before the fork). torchrun runs them as `--run-path --start-method forkserver`.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import sys
import threading

from trainer_hooks import crashloop, rendezvous, warm

PROG = "python -m trainer_hooks.launch"


def parser() -> argparse.ArgumentParser:
    """torchrun's own parser, with the warm options."""
    import torch.distributed.run as torchrun

    p = torchrun.get_args_parser()
    p.prog = PROG
    p.description = "torchrun (Torch Distributed Elastic Training Launcher), its agent's rendezvous made faster."
    group = p.add_argument_group("warm restarts (trainer_hooks)")
    group.add_argument(
        "--warm",
        action="store_true",
        help=f"start every attempt's workers as forks of a server that imported torch and the --preload "
        f"modules once (also {warm.ENV}=1); the script keeps its semantics (a new __main__, argv, "
        f"sys.path[0], torchrun's environment, exit status); CUDA is never initialised before the fork",
    )
    group.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MOD[,MOD...]",
        help=f"with --warm: more modules the server imports (the script's heavy ones: transformers, "
        f"lightning, your model code; never one that touches the GPU at import); always: {', '.join(warm.PRELOAD)}",
    )
    return p


def _ours(token: str) -> bool:
    """A token of the warm options (argparse accepts unambiguous prefixes of an option)."""
    name = token.split("=", 1)[0]
    return len(name) > 3 and name.startswith("--") and ("--warm".startswith(name) or "--preload".startswith(name))


def fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def torchrun_argv(argv: list[str]) -> tuple[list[str], list[str] | None, str | None]:
    """torchrun's arguments for the command line given to this launcher; in warm mode also the
    forkserver's preload list and the agent's new sys.path[0] (the script's directory, where the
    server finds the script's own modules; None for `-m`). Exits 2 on a command it cannot run."""
    args = parser().parse_args(argv)
    script_at = len(argv) - len(args.training_script_args) - 1
    options, i = [], 0
    while i < script_at:
        token = argv[i]
        if _ours(token):
            i += 2 if "=" not in token and "--preload".startswith(token) else 1  # --preload MOD
            continue
        options.append(token)
        i += 1
    if not (args.warm or warm.env_on()):
        if args.preload:
            fail("--preload needs --warm")
        return options + argv[script_at:], None, None
    if args.no_python:
        fail("--warm runs a Python script: drop --no-python")
    unsafe = warm.interpreter_problem()
    if unsafe:
        fail(unsafe)
    problem = warm.target_problem(args.module, args.training_script)
    if problem:
        fail(problem)
    preload = warm.preload_list(args.preload)
    path0 = None
    if not args.module and not getattr(sys.flags, "safe_path", False):
        path0 = os.path.dirname(os.path.abspath(args.training_script))
    saved = sys.path[:]
    try:
        if path0 is not None:
            sys.path[0] = path0
        missing = warm.missing_module(preload)
    finally:
        sys.path[:] = saved
    if missing:
        fail(f"--preload: no module named {missing!r}")
    options = [a for a in options if a not in ("-m", "--module", "--run-path", "--run_path")]
    target = ["-m"] if args.module else []
    forwarded = [*options, "--run-path", "--start-method", "forkserver", warm.WORKER, *target, *argv[script_at:]]
    return forwarded, preload, path0


def main(argv: list[str] | None = None) -> None:
    import torch.distributed.run as torchrun

    forwarded, preload, path0 = torchrun_argv(list(sys.argv[1:] if argv is None else argv))
    rendezvous.install()
    crashloop.install()  # a worker the sidecar ended (exit 93): no restart, the launcher exits 93
    if path0 is not None:  # the workers' sys.path is the agent's: [script's directory, ...] as `python script.py`
        sys.path[0] = path0
    if preload is not None:
        # changes: warm-workers (docs/changes-to-others.md)
        multiprocessing.set_forkserver_preload(preload)
        # The agent reports a function worker's failure with its traceback, and torch's log
        # formatter imports torch._dynamo for that (2-3 s, at the first restart): import it now.
        threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True).start()
    crashloop.run(lambda: torchrun.main(forwarded), PROG)


if __name__ == "__main__":
    main()
