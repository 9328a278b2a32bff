"""`python -m sidecar_trainer.launch`: torchrun for the bundled trainer, whose restarted workers
start in a fraction of a second because they are forked from a process that imported everything.

    python -m sidecar_trainer.launch --standalone --nproc-per-node 8 --max-restarts 3 \
        -m sidecar_trainer --config cfg.yaml

takes torchrun's command line unchanged (it is torchrun: `torch.distributed.run`, its agent,
rendezvous and restarts), with `torchrun` replaced and `-m sidecar_trainer` as the script.

Why: torchrun starts every worker of every attempt as a new interpreter, which imports torch and,
through the first optimizer, torch._dynamo (the optimizers' `_disable_dynamo` wrappers import it
on first use): about 3.5 s per restart on an idle 2-core machine, most of the time between a
kill and the first step again. Here the workers run the trainer as a function (torchrun's own
`--run-path`) started by multiprocessing's `forkserver` method, whose server imports those
modules once, when the first attempt starts (`set_forkserver_preload`); every attempt's workers
are forks of it, torch already in memory. Forking before any CUDA call is safe (the server never
touches a device). The server is a child of torchrun's agent and lives as long as it; workers are
not process group leaders, so the sidecar signals each rank with its descendants.

Its agent re-forms a job faster after a restart, as `python -m trainer_hooks.launch`'s does
(trainer_hooks/rendezvous.py: half a second off every rendezvous, and on several nodes the
rendezvous' one-second polls).
"""

from __future__ import annotations

import importlib
import multiprocessing
import sys
import threading
from pathlib import Path

from trainer_hooks import crashloop, rendezvous

# What the server imports once for all attempts: torch, what the first optimizer step and DDP
# would import (torch._dynamo), FSDP2 and DTensor, the trainer (its entry point and the demo model too:
# where no bytecode is written, PYTHONDONTWRITEBYTECODE, each worker would compile them) and the hooks.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "sidecar_trainer.train",
    "sidecar_trainer.__main__",
    "sidecar_trainer.demo",
    "trainer_hooks",
]
TRAINER = "sidecar_trainer"
WORKER = Path(__file__).with_name("forked_worker.py")


def torchrun_argv(argv: list[str]) -> list[str]:
    """torchrun's arguments that run the trainer's workers as forked functions, from the command
    line given to this launcher (SystemExit 2 when its script is not `-m sidecar_trainer`)."""
    import torch.distributed.run as torchrun

    args = torchrun.parse_args(argv)
    if not (args.module and args.training_script == TRAINER):
        print(
            f"python -m sidecar_trainer.launch runs the bundled trainer only: end the command with -m {TRAINER} "
            f"[ARGS] (got {args.training_script!r}); use torchrun for other scripts",
            file=sys.stderr,
        )
        sys.exit(2)
    script_at = len(argv) - len(args.training_script_args) - 1
    options = [a for a in argv[:script_at] if a not in ("-m", "--module")]
    return [*options, "--run-path", "--start-method", "forkserver", str(WORKER), *argv[script_at + 1 :]]


def main(argv: list[str] | None = None) -> None:
    import torch.distributed.run as torchrun

    forwarded = torchrun_argv(list(sys.argv[1:] if argv is None else argv))
    multiprocessing.set_forkserver_preload(PRELOAD)
    rendezvous.install()
    crashloop.install()  # a worker the sidecar ended (exit 93): no restart, the launcher exits 93
    # The agent reports a function worker's failure with its traceback, and torch's log formatter
    # imports torch._dynamo for that (2-3 s here, at the first restart); import it while the
    # first attempt starts instead.
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True).start()
    crashloop.run(lambda: torchrun.main(forwarded), "python -m sidecar_trainer.launch")


if __name__ == "__main__":
    main()
