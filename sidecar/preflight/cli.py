"""`sidecar preflight`: check a node before a training job starts on it.

Each check prints one line, PASS, WARN, FAIL or SKIP, with a hint saying what to do about
anything that is not PASS. The exit status is 0 unless a check FAILed (1); with `--strict`
a WARN fails too. A missing part of the environment (no NVIDIA driver, no InfiniBand, an
unreadable kernel log) is reported, never a crash.

Reading the node (`facts`) is kept apart from judging it (`gpu_checks`, `node_checks`,
`peers`): `read_*` functions return plain facts, the `check_*` functions turn facts into
results.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict

from sidecar.config import ConfigError, settings_from_args
from sidecar.preflight.gpu_checks import check_driver, check_gpu_count, check_gpu_health, check_torch, check_xids
from sidecar.preflight.node_checks import (
    check_checkpoint_disk,
    check_clock,
    check_infiniband,
    check_nics,
    check_rendezvous,
    check_shared_dir,
    check_sidecar,
)
from sidecar.preflight.peers import check_peers
from sidecar.preflight.results import FAIL, PASS, SKIP, WARN, Context, Result, exit_code

STYLE = {PASS: "green", SKIP: "dim", WARN: "yellow", FAIL: "bold red"}


CHECKS: list[Callable[[Context], Iterable[Result]]] = [
    check_driver,
    check_gpu_count,
    check_gpu_health,
    check_xids,
    check_torch,
    check_nics,
    check_infiniband,
    check_rendezvous,
    check_shared_dir,
    check_checkpoint_disk,
    check_clock,
    check_sidecar,
    check_peers,
]


def _results(check: Callable[[Context], Iterable[Result]], ctx: Context) -> list[Result]:
    return list(check(ctx))


def run_checks(ctx: Context) -> Iterable[Result]:
    """Run every check in parallel (torch's import and network timeouts dominate); yield the
    results in the order of CHECKS as soon as each is done."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(CHECKS)) as pool:
        futures = [(check, pool.submit(_results, check, ctx)) for check in CHECKS]
        for check, future in futures:
            try:
                yield from future.result()
            except Exception as e:  # a bug in one check must not hide the others
                yield Result(
                    check.__name__.removeprefix("check_"),
                    FAIL,
                    f"the check crashed: {type(e).__name__}: {e}",
                    "please report this",
                )


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "exit status: 0 nothing failed (warnings allowed), 1 a check failed (or warned, with --strict), 2 bad arguments"
    )
    parser.add_argument(
        "--config",
        help="the sidecar's YAML settings (nvml_module, sysfs_root, checkpoint_dir, "
        "nic_exclude are used; also SIDECAR_CONFIG)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    parser.add_argument(
        "--expect-gpus",
        type=int,
        metavar="N",
        help="fail unless exactly N GPUs are visible (default: the collectors.expected_gpus setting, when set)",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the training environment's interpreter, for torch/CUDA/NCCL versions (default: this one)",
    )
    parser.add_argument(
        "--torch-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long importing torch may take (default 120)",
    )
    parser.add_argument(
        "--skip-torch",
        action="store_true",
        help="do not import torch (the torch and torch-cuda checks): the slowest check, seconds per run",
    )
    parser.add_argument("--kernel-log", metavar="FILE", help="read Xids from FILE instead of `dmesg`")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="the c10d rendezvous endpoint to reach")
    parser.add_argument("--shared-dir", metavar="DIR", help="shared storage that must be mounted and writable")
    parser.add_argument(
        "--shared-marker",
        metavar="write:TOKEN|check:TOKEN",
        help="write a marker file with TOKEN in --shared-dir (one node), or check it is there "
        "(the others): proves every node sees the same storage",
    )
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR", help="checkpoint directory (default: checkpoint_dir setting)"
    )
    parser.add_argument(
        "--min-free-gb", type=float, default=20.0, help="free space needed for checkpoints (default 20)"
    )
    parser.add_argument(
        "--peers",
        metavar="URL,URL",
        help="other nodes' sidecars (http://host:9402); fail on driver/CUDA/torch/NCCL skew",
    )
    parser.add_argument(
        "--socket", help="this node's sidecar socket (also SIDECAR_SOCKET): checked, and compared with --peers"
    )
    parser.add_argument("--url", help="this node's sidecar URL (also SIDECAR_URL), instead of the socket")
    parser.add_argument("--strict", action="store_true", help="WARN fails too (exit 1)")
    parser.add_argument("--json", action="store_true", help="print {exit_code, results: [...]} as JSON")


def _printer(json_mode: bool):
    if json_mode:
        return lambda result: None
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.text import Text

        console = Console(highlight=False)

        def show(r: Result) -> None:
            line = Text.assemble((f"{r.outcome:<4}", STYLE[r.outcome]), f"  {r.check:<16} {r.detail}")
            if r.hint and r.outcome in (WARN, FAIL):
                line.append(f"\n{'':22}hint: {r.hint}", style="dim")
            console.print(line)

        return show

    def show_plain(r: Result) -> None:
        print(f"{r.outcome:<4}  {r.check:<16} {r.detail}", flush=True)
        if r.hint and r.outcome in (WARN, FAIL):
            print(f"{'':22}hint: {r.hint}", flush=True)

    return show_plain


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        print(f"sidecar preflight: {e}", file=sys.stderr)
        return 2
    show = _printer(args.json)
    results = []
    for result in run_checks(Context(args, settings)):
        results.append(result)
        show(result)
    code = exit_code(results, args.strict)
    if args.json:
        print(json.dumps({"exit_code": code, "results": [asdict(r) for r in results]}, indent=2))
    else:
        counts = {o: sum(r.outcome == o for r in results) for o in (PASS, WARN, FAIL, SKIP)}
        print(
            f"preflight: {', '.join(f'{n} {o.lower()}' for o, n in counts.items())}"
            f" -> exit {code}{' (strict)' if args.strict else ''}"
        )
    return code
