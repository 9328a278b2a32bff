"""Series per node, measured on a real sidecar shaped like a training node: 8 GPUs (NVML
stand-in, 18 NVLinks each), 8 registered ranks reporting every well-known training metric,
4 NICs and 2 InfiniBand ports (a sysfs tree). docs/scale.md quotes these numbers; the test
keeps the total under the budget stated there.

Run with `-s` to print the table by family."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.support import ROOT, Sidecar, spawned, wait_until
from trainer_hooks.environment import Endpoint
from trainer_hooks.transport import post

FIXTURE_SYS = ROOT / "tests" / "collectors" / "fixtures" / "sys"
GPUS, RANKS, NICS, IB_PORTS = 8, 8, 4, 2
JOB = "scale-job"


def budget_from_doc() -> int:
    m = re.search(r"budget: \*\*(\d[\d,]*) series per node\*\*", (ROOT / "docs" / "scale.md").read_text())
    assert m, "docs/scale.md states no per-node budget"
    return int(m.group(1).replace(",", ""))


def node_sysfs(root: Path) -> Path:
    """/sys with NICS Ethernet interfaces and IB_PORTS InfiniBand ports, cloned from the fixtures."""
    net = root / "class" / "net"
    for i in range(NICS):
        shutil.copytree(FIXTURE_SYS / "class" / "net" / "ens1f0np0", net / f"ens{i}f0np0")
    shutil.copytree(FIXTURE_SYS / "class" / "net" / "lo", net / "lo")
    for i in range(IB_PORTS):
        shutil.copytree(FIXTURE_SYS / "class" / "infiniband" / "mlx5_0", root / "class" / "infiniband" / f"mlx5_{i}")
    return root


def family(line: str) -> str:
    name = re.split(r"[{ ]", line, maxsplit=1)[0]
    return re.sub(r"_(total|created)$", "", name)


def register_and_push(endpoint: Endpoint, rank: int, pid: int) -> None:
    reg = {
        "job_id": JOB,
        "rank": rank,
        "local_rank": rank,
        "world_size": RANKS,
        "local_world_size": RANKS,
        "restart_count": 0,
        "pid": pid,
        "step": None,
        "phase": None,
        "versions": {"torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3", "python": "3.11.7"},
        "hooks_version": "0.1.0",
    }
    reply = post(endpoint, "/v1/register", json.dumps(reg).encode())
    assert reply.status == 200, (reply.status, reply.error)
    now = time.time()
    items = [
        {
            "type": "step",
            "step": s,
            "time": now + s * 0.1,
            "metrics": {
                "loss": 2.0,
                "grad_norm": 1.0,
                "lr": 3e-4,
                "step_time_seconds": 0.1,
                "samples": 8,
                "tokens": 4096,
            },
        }
        for s in range(1, 4)
    ]
    items += [
        {"type": "phase", "name": "checkpoint_save", "action": "start", "time": now + 1},
        {"type": "phase", "name": "checkpoint_save", "action": "end", "time": now + 1.1},
        {"type": "event", "name": "checkpoint_saved", "time": now + 1.1, "fields": {"step": 3, "path": "/c"}},
    ]
    reply = post(
        endpoint,
        "/v1/push",
        json.dumps({"job_id": JOB, "rank": rank, "pid": pid, "dropped": 0, "items": items}).encode(),
    )
    assert reply.status == 200, reply.status


@pytest.mark.slow
def test_series_per_node_stay_within_the_documented_budget(tmp_path):
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"gpu_count": GPUS}))
    sysfs = node_sysfs(tmp_path / "sys")
    with contextlib.ExitStack() as stack:
        # Observe-only with long timeouts: nothing here is ever signalled.
        sidecar = stack.enter_context(
            Sidecar(
                tmp_path / "sidecar",
                "collectors.nvml_module=sidecar.testing.fake_nvml_lib",
                f"collectors.sysfs_root={sysfs}",
                "watchdog.observe_only=true",
                "watchdog.startup_timeout_seconds=3600",
                "watchdog.floor_seconds=3600",
                "watchdog.ceiling_seconds=3600",
                "remediation.dump_stacks=false",
                f"checkpoint_dir={tmp_path}",
                env={"SIDECAR_FAKE_NVML": str(nvml)},
            )
        )
        ranks = [stack.enter_context(spawned(["sleep", "600"], tmp_path / f"rank{r}.log")) for r in range(RANKS)]
        endpoint = Endpoint(socket_path=sidecar.socket)
        for rank, proc in enumerate(ranks):
            register_and_push(endpoint, rank, proc.pid)

        def complete() -> str | None:
            text = sidecar.metrics()
            ready = (
                "sidecar_process_resident_memory_bytes" in text
                and "sidecar_infiniband_port_up" in text
                and f'gpu="{GPUS - 1}"' in text
            )
            return text if ready else None

        text = wait_until(complete, 60, interval=0.5, what="every collector's series")
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    by_family = Counter(family(line) for line in series)
    print(f"\n{len(series)} series on a node with {GPUS} GPUs, {RANKS} ranks, {NICS} NICs, {IB_PORTS} IB ports")
    for name, count in by_family.most_common():
        print(f"{count:6d}  {name}")
    assert len(series) <= budget_from_doc()
    assert "sidecar_metrics_series_dropped 0.0" in series  # the reference node loses nothing to the budget


def test_the_documented_budget_is_the_default_series_limit():
    from sidecar.config import LimitSettings

    assert LimitSettings().max_series == budget_from_doc()
