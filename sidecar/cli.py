"""The `sidecar` console script. Each subcommand lives in its own module, imported lazily,
exposing `add_arguments(parser)` and `main(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

from sidecar import __version__

# What `sidecar --help` says, for the people who run it (the docstring above is for developers).
DESCRIPTION = (
    "The training node sidecar: GPU, network, process and training-progress metrics for Prometheus, "
    "and a watchdog that dumps the stacks of hung PyTorch ranks and kills their worker group so "
    "torchrun restarts it."
)
EPILOG = (
    "Run `sidecar COMMAND --help` for a command's options. Operating it: docs/operator-guide.md; "
    "every setting: docs/configuration.md (`sidecar config-doc`)."
)

SUBCOMMANDS = {
    "run": ("sidecar.daemon.app", "run the daemon (metrics, push API, watchdog)"),
    "status": ("sidecar.commands.status", "show this node's health at a glance"),
    "incidents": ("sidecar.commands.incidents", "list the watchdog's incident records"),
    "drill": (
        "sidecar.commands.drill",
        "kill-and-resume drill on a live job: stop one rank, report detection, kill and resume (root only)",
    ),
    "preflight": ("sidecar.preflight.cli", "check this node before a job starts"),
    "provision": (
        "sidecar.commands.provision",
        "push the dashboards and the datasource to Grafana (alert rules only with --alerts grafana)",
    ),
    "deploy-gen": (
        "sidecar.commands.deploygen",
        "generate the deploy files from the rules and dashboards (--write DIR: the whole tree)",
    ),
    "metrics-doc": ("sidecar.daemon.metrics_doc", "write the metrics reference (docs/metrics.md)"),
    "config-doc": ("sidecar.commands.config_doc", "write the settings reference (docs/configuration.md)"),
    "slurm-epilog": ("sidecar.commands.slurm", "after a Slurm job: what of it is left on this node (docs/slurm.md)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sidecar", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"sidecar {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Import only the module that runs: `sidecar status` must not pay for aiohttp's server.
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
