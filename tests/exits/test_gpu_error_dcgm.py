"""`gpu_error` where dcgm-exporter is the GPU source (`collectors.gpu_source: dcgm`): the gpu
collector is off there, but the XID event thread still runs on NVML, and NVML's process lists
still say which GPUs each rank holds, so a rank that dies after an XID on its GPU is `gpu_error`
(docs/dcgm.md, "XIDs and gpu_error"). The NVML stand-in is the fake library under pynvml."""

from __future__ import annotations

import json
import os
import signal
import time

from tests.exits.helpers import SETTINGS, exits_of, rank_env, wait_for_exit
from tests.support import Sidecar, wait_until

PROCESS_ROUNDS_SECONDS = 4.0  # 8 rounds of the 0.5 s interval: the process lists were read since


def test_in_dcgm_mode_a_rank_that_dies_soon_after_an_xid_on_its_gpu_is_gpu_error(tmp_path, ranks):
    spec = {
        "driver_version": "550.54.15",
        "cuda_driver_version": 12040,
        "gpu_count": 2,
        "xid_events": [{"gpu": 1, "xid": 79, "at_seconds": 2}],
    }
    spec_file = tmp_path / "nvml.json"
    spec_file.write_text(json.dumps(spec))
    with Sidecar(
        tmp_path / "gpu",
        *SETTINGS,
        "collectors.gpu_source=dcgm",
        "collectors.interval_seconds=0.5",
        "collectors.nvml_module=sidecar.testing.fake_nvml_lib",
        env={"SIDECAR_FAKE_NVML": str(spec_file)},
    ) as sidecar:
        on_bad = ranks(rank_env(sidecar, "xid"), "hold", name="on-bad-gpu").wait_ready()
        on_good = ranks(rank_env(sidecar, "xid", rank=1, world=2), "hold", name="on-good-gpu").wait_ready()
        spec["gpus"] = {
            "1": {"processes": [{"pid": on_bad.proc.pid, "used_memory_bytes": 1 << 30}]},
            "0": {"processes": [{"pid": on_good.proc.pid, "used_memory_bytes": 1 << 30}]},
        }
        spec_file.write_text(json.dumps(spec))
        wait_until(lambda: "XID 79 on gpu 1" in sidecar.log.read_text(), 60, what="the XID event")
        time.sleep(PROCESS_ROUNDS_SECONDS)
        assert "sidecar_gpu_" not in sidecar.metrics(), "dcgm mode exports no GPU series of its own"
        for r in (on_bad, on_good):
            os.kill(r.proc.pid, signal.SIGKILL)
            r.wait()
        assert wait_for_exit(sidecar, "xid", rank=0)["reason"] == "gpu_error"
        assert wait_for_exit(sidecar, "xid", rank=1)["reason"] == "signal"
        by_rank = {e["rank"]: e for e in exits_of(sidecar, "xid")}
        assert any("XID 79 on gpu 1 (it used)" in line for line in by_rank[0]["evidence"]), by_rank[0]
