"""`python -m sidecar_trainer --config cfg.yaml --set section.field=value ...`, usually under torchrun:

    torchrun --standalone --nproc-per-node 2 --max-restarts 2 -m sidecar_trainer --config cfg.yaml

Exit status 2 with one line on stderr for a bad configuration (checked before the rendezvous).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from sidecar_trainer.config import ConfigError, help_text, load_config, parse_set, world_size_from_env
from sidecar_trainer.startup import Startup


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sidecar_trainer", description="The bundled distributed trainer.")
    p.add_argument(
        "--config", default=os.environ.get("TRAINER_CONFIG"), help="YAML configuration file (also TRAINER_CONFIG)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one field, e.g. --set batch.global_batch_size=64 (repeatable)",
    )
    p.add_argument(
        "--final-params", metavar="PATH", help="rank 0 saves the final parameters here ({name: tensor}, torch.save)"
    )
    p.add_argument("--help-config", action="store_true", help="print every configuration field and exit")
    return p.parse_args(argv)


def setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s trainer[rank{rank}] %(levelname)s %(message)s"))
    log = logging.getLogger("sidecar_trainer")
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == "0" else logging.WARNING)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.help_config:
        sys.stdout.write(help_text())
        return 0
    try:
        cfg = load_config(args.config, parse_set(args.set))
        cfg.validate_for(world_size_from_env())
        cfg.check_imports()
    except ConfigError as e:
        print(f"trainer: config error: {e}", file=sys.stderr)
        return 2
    setup_logging()
    startup = Startup(is_main=os.environ.get("RANK", "0") == "0")
    from sidecar_trainer.train import Trainer

    startup.mark("imports_done", cpu_s=f"{time.process_time():.2f}")  # this process's own: a forked worker's is near 0
    trainer = Trainer(cfg, final_params=args.final_params, startup=startup)
    ok = False
    try:
        trainer.train()
        trainer.finish()
        ok = True
    finally:
        trainer.close(ok)
    return 0


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown once everything is written and closed. Under
    torchrun, gloo's C++ threads can still be running while Python finalizes, and the process
    then aborts ("terminate called without an active exception", SIGABRT) after training
    finished, which torchrun reports as a failed worker (seen here with FSDP2 on gloo)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_now(code)
    sys.exit(code)
