"""What a Slurm job left on this node, for the Slurm epilog (deploy/slurm/epilog.sh; docs/slurm.md).

After a job ends, slurmd runs the Epilog on each of its nodes; a non-zero exit drains the node. This
command asks the node's sidecar (`/v1/status`) whether anything of the job outlived it, waiting up
to `--wait` seconds for the sidecar to see the job's processes go (Slurm has just killed them):

- a rank of the job whose process the sidecar still sees alive: in the job's cgroup (`job_<id>`,
  the rank's `slurm_job_id` in /v1/status), or registered under the job's id (the hooks' job id:
  torchrun's `--rdzv-id`, which the sbatch example sets to SLURM_JOB_ID.<suffix>);
- GPU memory above `--gpu-memory-budget-mib` on a GPU the job had (`--gpus`, from SLURM_JOB_GPUS),
  read by a GPU collector round that ran after the epilog started;
- the node verdict's findings about what outlives jobs (sidecar/fitness.py: `unkillable`,
  `gpu_held`). `gpu_missing` and `nvml_unavailable` are the health check's to report
  (deploy/slurm/healthcheck.sh), not the job's.

Exit status: 0 nothing left, 1 something left (one line each, naming the rank, pid or GPU), 2 no
sidecar or a broken answer. Run as `python -m sidecar.commands.slurm` (it keeps the subcommand
protocol, `add_arguments` and `main`, for `sidecar/cli.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.commands.client import DEFAULT_TIMEOUT_SECONDS, StatusError, fetch_json, resolve_endpoint
from sidecar.commands.verdict import EXIT_DEGRADED, EXIT_HEALTHY, EXIT_UNREACHABLE, dict_at, dicts_at
from sidecar.safetext import printable

JOB_FINDINGS = ("unkillable", "gpu_held")  # fitness reasons that are what a job left behind
POLL_SECONDS = 0.5
MIB = 1 << 20


def job_gpus(raw: str | None) -> set[str] | None:
    """The GPUs to check from a Slurm list ("0,1,3"): None means every GPU ("all"), an empty set none."""
    text = (raw or "").strip()
    if text.lower() == "all":
        return None
    return {part.strip() for part in text.split(",") if part.strip()}


def of_slurm_job(rank_job: str, job_id: str) -> bool:
    """Whether a rank's job id is the Slurm job's: its id itself, or `<id>.<suffix>` (train.sbatch's
    default torchrun --rdzv-id, a random suffix no other user can register first)."""
    return rank_job == job_id or rank_job.startswith(job_id + ".")


def leftover_ranks(status: Mapping[str, Any], job_id: str, uid: int | None = None) -> list[str]:
    """The job's ranks still alive: registered under the job's id, or in the job's cgroup whatever
    their job id (`slurm_job_id`, which the sidecar reads from the kernel); with `uid` (SLURM_JOB_UID)
    only those whose process runs as the job's user: another user's process registered under the
    job's id is not the job's."""
    return [
        f"rank {r.get('rank')} of job {r.get('job_id')} (pid {r.get('pid')}, {r.get('state')}) is still alive"
        for r in sorted(dicts_at(status, "ranks"), key=lambda r: str(r.get("rank")))
        if (of_slurm_job(str(r.get("job_id")), job_id) or r.get("slurm_job_id") == job_id)
        and r.get("state") != "gone"
        and (uid is None or r.get("uid") == uid)
    ]


def gpu_reading_age(status: Mapping[str, Any]) -> float | None:
    """Seconds since the GPU collector last finished; None when there is no GPU collector round."""
    gpu = dict_at(dict_at(status, "collectors"), "gpu")
    age = gpu.get("age_seconds")
    return float(age) if isinstance(age, (int, float)) and not isinstance(age, bool) else None


def held_gpu_memory(status: Mapping[str, Any], gpus: set[str] | None, budget_bytes: int) -> list[str]:
    found = []
    for g in dicts_at(status, "gpus"):
        if gpus is not None and str(g.get("gpu")) not in gpus:
            continue
        used = g.get("memory_used_bytes")
        if isinstance(used, int) and used > budget_bytes:
            found.append(
                f"GPU {g.get('gpu')} ({g.get('uuid') or '?'}) holds {used / MIB:.0f} MiB after the job "
                f"(budget {budget_bytes / MIB:.0f} MiB)"
            )
    return found


def unfit_findings(status: Mapping[str, Any]) -> list[str]:
    return [
        f"node unfit ({f.get('reason')}): {f.get('text')}"
        for f in dicts_at(dict_at(status, "fitness"), "findings")
        if f.get("reason") in JOB_FINDINGS
    ]


def leftovers(
    status: Mapping[str, Any], job_id: str, gpus: set[str] | None, budget_bytes: int, gpu_fresh: bool,
    uid: int | None = None,
) -> list[str]:  # fmt: skip
    """Everything the job left, one line each. GPU memory counts only from a fresh reading (one the
    GPU collector took after the job ended); a stale one may show the job's own memory."""
    found = leftover_ranks(status, job_id, uid)
    if gpu_fresh:
        found += held_gpu_memory(status, gpus, budget_bytes)
    return found + unfit_findings(status)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "exit status: 0 nothing of the job is left, 1 something is (named), 2 no sidecar or a broken answer"
    parser.add_argument("--job", default=os.environ.get("SLURM_JOB_ID"), help="the ended job's id (SLURM_JOB_ID)")
    parser.add_argument(
        "--uid",
        default=os.environ.get("SLURM_JOB_UID") or None,
        help="the job's user's uid (default SLURM_JOB_UID): only ranks running as it are the job's",
    )
    parser.add_argument(
        "--gpus",
        default=os.environ.get("SLURM_JOB_GPUS", ""),
        help="the job's GPUs, by index, comma-separated (default SLURM_JOB_GPUS; 'all': every GPU; empty: none)",
    )
    parser.add_argument(
        "--gpu-memory-budget-mib",
        type=float,
        default=1024.0,
        help="GPU memory a GPU of the job may still hold (default 1024 MiB)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the sidecar to see the job's processes go (default 10)",
    )
    parser.add_argument("--socket", help="the sidecar's Unix socket (also SIDECAR_SOCKET)")
    parser.add_argument("--url", help="the sidecar's HTTP address (also SIDECAR_URL)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help=f"seconds to wait for each answer of the sidecar (default {DEFAULT_TIMEOUT_SECONDS:g})",
    )


def main(args: argparse.Namespace) -> int:
    if not args.job:
        print("sidecar slurm epilog: no job id (--job or SLURM_JOB_ID)", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        uid = None if args.uid in (None, "") else int(args.uid)
    except ValueError:
        print(f"sidecar slurm epilog: --uid (SLURM_JOB_UID) must be a number, got {args.uid!r}", file=sys.stderr)
        return EXIT_UNREACHABLE
    endpoint = resolve_endpoint(args.socket, args.url)
    gpus = job_gpus(args.gpus)
    budget = int(args.gpu_memory_budget_mib * MIB)
    started = time.monotonic()
    deadline = started + max(0.0, args.wait)
    while True:
        try:
            status = fetch_json(endpoint, "/v1/status", args.timeout)
        except StatusError as e:
            print(printable(f"unknown: {e}"), flush=True)
            return EXIT_UNREACHABLE
        age = gpu_reading_age(status)
        fresh = age is not None and age < time.monotonic() - started
        found = leftovers(status, str(args.job), gpus, budget, fresh, uid)
        settled = fresh or age is None or not status.get("gpus") or gpus == set()
        if (not found and settled) or time.monotonic() >= deadline:
            break
        time.sleep(POLL_SECONDS)
    if not found:
        print(printable(f"job {args.job}: nothing left"), flush=True)
        return EXIT_HEALTHY
    for line in found:
        print(printable(line), flush=True)
    return EXIT_DEGRADED


def run(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sidecar.commands.slurm", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(run())
