"""deploy/baremetal/torchrun-launch.sh for real: preflight, then the bundled trainer under
torchrun with a c10d rendezvous, its ranks reporting to a live sidecar that `sidecar status`
then shows."""

from __future__ import annotations

import json
import os

import pytest

from tests.ops.helpers import run_cli
from tests.support import PYTHON, ROOT, Sidecar, free_port, spawned, tail

STEPS = 6


@pytest.mark.slow
def test_launcher_trains_on_one_node_with_ranks_visible_in_status(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(f"""
train: {{steps: {STEPS}, log_every_steps: 2}}
batch: {{global_batch_size: 16, micro_batch_size: 8}}
data: {{kwargs: {{size: 256}}}}
parallel: {{backend: gloo}}
checkpoint: {{dir: {tmp_path / "ckpt"}, every_steps: 3}}
monitor: {{enabled: true}}
""")
    with Sidecar(tmp_path / "sidecar", "watchdog.observe_only=true") as sidecar:
        env = {
            "NNODES": "1",
            "NPROC_PER_NODE": "2",
            "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
            "RDZV_ID": "launch-test",
            "MAX_RESTARTS": "1",
            "CONFIG": str(config),
            "PYTHON": PYTHON,
            "SIDECAR_SOCKET": sidecar.socket,
            "PREFLIGHT": "1",
            "PREFLIGHT_ARGS": "--min-free-gb 0",
            "PATH": f"{os.path.dirname(PYTHON)}:{os.environ['PATH']}",
        }
        log = tmp_path / "launch.log"
        with spawned(["bash", str(ROOT / "deploy/baremetal/torchrun-launch.sh")], log, env=env) as proc:
            assert proc.wait(timeout=300) == 0, tail(log)
        text = log.read_text()
        assert "PASS  rendezvous" in text  # preflight ran first
        assert f"training finished: step={STEPS}" in text
        out = run_cli("status", "--socket", sidecar.socket, "--json")
    ranks = {r["rank"]: r for r in json.loads(out.stdout)["status"]["ranks"] if r["job_id"] == "launch-test"}
    assert sorted(ranks) == [0, 1], out.stdout
    seen = {k: (r["state"], r["step"], r["loss"] is not None) for k, r in ranks.items()}
    assert seen == {0: ("gone", STEPS, True), 1: ("gone", STEPS, True)}
