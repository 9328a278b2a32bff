"""The race's script (bench/bench_race.py): the `Monitor` example of docs/guide.md with NVIDIA's heartbeat
added, as a user who tried both tools would leave it. One file, run unchanged under either
launcher: the hooks report to the sidecar (without one they drop their records and cost nothing),
and the NVRx heartbeat is sent when ft_launcher started the rank (it sets
FT_RANK_MONITOR_IPC_SOCKET; under torchrun there is no rank monitor to send it to)."""

import os

import torch
import torch.distributed as dist

from bench.cycles.chaos import Chaos
from trainer_hooks import Monitor

heartbeat = None
if os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # type: ignore[import-not-found]

    client = RankMonitorClient()
    client.init_workload_monitoring()
    heartbeat = client.send_heartbeat

dist.init_process_group("gloo")
mon, chaos, t = Monitor(), Chaos(), torch.ones(1)
for step in range(1, chaos.hang_step + 41):
    dist.all_reduce(t)
    mon.step(step, loss=1.0 / step, samples=8)
    if heartbeat is not None:
        heartbeat()
    chaos.step(step)
chaos.done()
mon.close()
dist.destroy_process_group()
