"""The XID source of the dcgm GPU source (sidecar/collectors/gpu_events.py): without the GPU
metrics, it still waits for XID events and reads which GPUs each rank's tree holds, through the
real pynvml over the fake NVML library."""

from __future__ import annotations

import pytest

from sidecar.collectors import gpu_events
from tests.collectors.helpers import FAKE
from tests.support import make_settings, wait_until


@pytest.fixture
def events():
    made: list[gpu_events.GpuEvents] = []

    def make(ranks) -> gpu_events.GpuEvents:
        e = gpu_events.GpuEvents(FAKE, ranks)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_it_sees_xids_and_the_gpus_of_a_rank_and_its_children(fake_gpus, events, rank_process):
    proc, child_pid = rank_process()
    fake_gpus(
        {
            "gpu_count": 2,
            "xid_events": [{"gpu": 1, "xid": 79}],
            "gpus": {
                "0": {"processes": [{"pid": child_pid, "used_memory_bytes": 24}]},
                "1": {"processes": [{"pid": proc.pid, "used_memory_bytes": 1000}]},
            },
        }
    )
    source = events(lambda: [("run-42", 3, proc.pid)])
    source.refresh()
    assert source.rank_gpus == {("run-42", 3): {"0", "1"}}
    wait_until(lambda: source.last_xids(), 10, what="the XID event")
    assert source.last_xids()["1"][0] == 79


def test_without_a_driver_it_has_nothing_and_does_not_fail(events):
    source = events(lambda: [])
    source.refresh()  # the fake module is not installed: pynvml finds no library
    assert source.rank_gpus == {} and source.last_xids() == {}


@pytest.mark.parametrize(
    "settings, runs",
    [
        ({"collectors.gpu_source": "dcgm"}, True),
        ({"collectors.gpu_source": "sidecar"}, False),  # the gpu collector gives XIDs itself
        ({"collectors.gpu_source": "dcgm", "collectors.xid_events": False}, False),
        ({"collectors.gpu_source": "dcgm", "collectors.enabled": ["node"]}, False),
    ],
)
def test_it_runs_only_where_dcgm_exporter_is_the_gpu_source(tmp_path, settings, runs):
    source = gpu_events.build(make_settings(tmp_path, settings), lambda: [])
    assert (source is not None) is runs
