"""The GPU collector on drivers as they are: older generations without the newest symbols, MIG,
fields that never answer, UNKNOWN on one field, calls removed, a broken nvmlInit. All through
the real pynvml over a fake libnvidia-ml (sidecar.testing.fake_nvml_lib).

The rule under test: an error scoped to one field of one GPU removes that field for that GPU
and is reported once (`sidecar_gpu_field_unavailable` and one log line); a GPU is lost only on
GPU_IS_LOST or when its handle fails."""

from __future__ import annotations

import logging

import pytest

from sidecar.collectors import nvml, nvml_fields
from sidecar.testing import fake_nvml
from tests.collectors.helpers import by_label, run, series

ALL = {str(i) for i in range(4)}
PER_GPU = (
    "sidecar_gpu_utilization_ratio",
    "sidecar_gpu_temperature_celsius",
    "sidecar_gpu_power_watts",
    "sidecar_gpu_energy_joules_total",
    "sidecar_gpu_memory_used_bytes",
    "sidecar_gpu_sm_clock_hertz",
)


def unavailable(families) -> set[tuple[str, str, str]]:
    return {
        (dict(k)["gpu"], dict(k)["field"], dict(k)["reason"]) for k in series(families, "sidecar_gpu_field_unavailable")
    }


def field_logs(caplog, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("sidecar") and word in r.getMessage()]


def test_an_r470_driver_without_the_v3_and_v2_process_calls_keeps_every_series(fake_gpus, gpu_collector, rank_process):
    proc, child = rank_process()
    fake_gpus(
        {
            "gpu_count": 4,
            "driver_generation": "r470",
            "xid_events": [{"gpu": 2, "xid": 79}],
            "gpu": {
                "clock_event_reasons": 0x8,
                "processes": [{"pid": proc.pid, "used_memory_bytes": 1000}, {"pid": child, "used_memory_bytes": 24}],
            },
        }
    )
    collector = gpu_collector(ranks=lambda: [("job", 5, proc.pid)])
    result = run(collector)
    assert result.success, result.error
    for name in PER_GPU:
        assert set(by_label(result.families, name, "gpu")) == ALL, name
    # processes through the unversioned (v1) symbol, clock reasons through the "throttle" name
    used = series(result.families, "sidecar_gpu_process_memory_bytes")
    assert used[(("gpu", "0"), ("job_id", "job"), ("rank", "5"))] == 1024
    active = by_label(result.families, "sidecar_gpu_clock_event_active", "reason")
    assert {r for r, v in active.items() if v == 1} == {"hw_slowdown"}
    # nvmlMemory_v2 is newer than R470: the driver's reservation is counted in used, and said so
    assert unavailable(result.families) == {(g, "memory_reserved", "function_not_found") for g in ALL}
    from tests.support import wait_until

    wait_until(lambda: collector.xid.snapshot()[0], 10, what="the XID event")
    assert by_label(run(collector).families, "sidecar_gpu_last_xid", "gpu")["2"] == 79


def test_the_process_call_generation_is_found_once_per_session(fake_gpus, gpu_collector):
    lib = fake_gpus({"gpu_count": 1, "driver_generation": "r470"})
    collector = gpu_collector(xid_events=False)
    for _ in range(3):
        assert run(collector).success
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses"] == 3  # the v1 symbol, once a round
    assert "nvmlDeviceGetComputeRunningProcesses_v3" not in lib.calls  # absent symbols are never called


@pytest.mark.parametrize("reason", ["not_ready", "no_permission"])
def test_a_field_that_fails_every_round_is_reported_once_and_not_asked_again(fake_gpus, gpu_collector, caplog, reason):
    lib = fake_gpus(
        {
            "gpu_count": 4,
            "gpus": {
                "1": {"errors": {"nvmlDeviceGetTotalEnergyConsumption": reason, "nvmlDeviceGetRemappedRows": reason}}
            },
        }
    )
    collector = gpu_collector(xid_events=False)
    caplog.set_level(logging.INFO)
    collector.session.health_seconds = 3600  # health once: a failed health field must not void the cache
    results = [run(collector) for _ in range(4)]
    assert all(r.success for r in results), results[-1].error
    last = results[-1].families
    assert set(by_label(last, "sidecar_gpu_energy_joules_total", "gpu")) == ALL - {"1"}
    assert set(by_label(last, "sidecar_gpu_remapped_rows_failed", "gpu")) == ALL - {"1"}
    assert set(by_label(last, "sidecar_gpu_temperature_celsius", "gpu")) == ALL
    assert unavailable(last) == {("1", "energy", reason), ("1", "remapped_rows", reason)}
    assert lib.calls["nvmlDeviceGetTotalEnergyConsumption"] == 4 * 4 - 3  # gpu 1: the first round only
    assert lib.calls["nvmlDeviceGetRemappedRows"] == 4  # the health read, once per GPU
    assert len(field_logs(caplog, "energy")) == 1


def test_a_failing_field_is_asked_again_after_its_retry_time(fake_gpus, gpu_collector, monkeypatch):
    fake_gpus({"gpu_count": 1, "gpu": {"errors": {"nvmlDeviceGetPowerUsage": "not_ready"}}})
    collector = gpu_collector(xid_events=False)
    assert not by_label(run(collector).families, "sidecar_gpu_power_watts", "gpu")
    fake_nvml.update({"gpu_count": 1})  # the board is ready now
    assert not by_label(run(collector).families, "sidecar_gpu_power_watts", "gpu")  # not yet due
    monkeypatch.setattr(nvml_fields, "RETRY_FAILED_SECONDS", 0.0)
    collector.session.fields[0].unavailable["power"].retry_at = 0.0
    result = run(collector)
    assert by_label(result.families, "sidecar_gpu_power_watts", "gpu") == {"0": 612.0}
    assert unavailable(result.families) == set()


def test_unknown_on_one_field_removes_that_field_not_the_gpu(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 4, "gpus": {"1": {"errors": {"nvmlDeviceGetPowerUsage": "unknown"}}}})
    result = run(gpu_collector(xid_events=False))
    assert result.success, result.error
    assert by_label(result.families, "sidecar_gpu_lost", "gpu") == dict.fromkeys(ALL, 0.0)
    assert set(by_label(result.families, "sidecar_gpu_power_watts", "gpu")) == ALL - {"1"}
    assert set(by_label(result.families, "sidecar_gpu_temperature_celsius", "gpu")) == ALL
    assert unavailable(result.families) == {("1", "power", "unknown")}


def test_gpu_is_lost_on_one_field_marks_the_gpu_lost(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 4, "gpus": {"3": {"errors": {"nvmlDeviceGetClockInfo": "gpu_is_lost"}}}})
    result = run(gpu_collector(xid_events=False))
    assert not result.success and "gpu 3" in result.error
    assert by_label(result.families, "sidecar_gpu_lost", "gpu")["3"] == 1.0
    assert set(by_label(result.families, "sidecar_gpu_power_watts", "gpu")) == ALL - {"3"}


def test_a_mig_gpu_reports_what_mig_hides_and_keeps_the_rest(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 2, "gpus": {"0": {"mig_mode": [1, 1]}}})
    result = run(gpu_collector(xid_events=False))
    assert result.success, result.error
    assert set(by_label(result.families, "sidecar_gpu_utilization_ratio", "gpu")) == {"1"}
    assert set(by_label(result.families, "sidecar_gpu_temperature_celsius", "gpu")) == {"0", "1"}
    assert set(by_label(result.families, "sidecar_gpu_memory_used_bytes", "gpu")) == {"0", "1"}
    assert {(g, f) for g, f, r in unavailable(result.families) if r == "not_supported"} == {
        ("0", "utilization"),
        ("0", "encoder_utilization"),
        ("0", "decoder_utilization"),
        ("0", "remapped_rows"),
        ("0", "retired_pages_single_bit"),
        ("0", "retired_pages_double_bit"),
        ("0", "retired_pages_pending"),
    }


def test_fields_hidden_by_mig_come_back_when_mig_is_turned_off(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 1, "gpu": {"mig_mode": [1, 1]}})
    collector = gpu_collector(xid_events=False)
    assert not by_label(run(collector).families, "sidecar_gpu_utilization_ratio", "gpu")
    fake_nvml.update({"gpu_count": 1, "gpu": {"mig_mode": [0, 0]}})  # MIG off, long before any retry time
    collector.session.health_seconds = 0.0
    run(collector)  # the health read sees the MIG mode change
    result = run(collector)
    assert by_label(result.families, "sidecar_gpu_utilization_ratio", "gpu") == {"0": 0.97}
    assert set(by_label(result.families, "sidecar_gpu_remapped_rows_failed", "gpu")) == {"0"}
    assert unavailable(result.families) == set()


def test_an_unsupported_field_is_asked_again_after_a_while(fake_gpus, gpu_collector, monkeypatch):
    lib = fake_gpus({"gpu_count": 1, "gpu": {"errors": {"nvmlDeviceGetPcieReplayCounter": "not_supported"}}})
    collector = gpu_collector(xid_events=False)
    collector.session.health_seconds = 0.0
    run(collector)
    run(collector)
    assert lib.calls["nvmlDeviceGetPcieReplayCounter"] == 1
    monkeypatch.setattr(nvml_fields, "RETRY_UNSUPPORTED_SECONDS", 0.0)
    collector.session.fields[0].unavailable["pcie_replay"].retry_at = 0.0
    fake_nvml.update({"gpu_count": 1})
    assert by_label(run(collector).families, "sidecar_gpu_pcie_replay_total", "gpu") == {"0": 0}


@pytest.mark.parametrize(
    "removed", [["nvmlDeviceGetTemperature"], ["nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"]]
)
def test_the_temperature_call_removed(fake_gpus, gpu_collector, removed):
    fake_gpus({"gpu_count": 2, "missing_functions": removed, "gpu": {"temperature_celsius": 66}})
    result = run(gpu_collector(xid_events=False))
    assert result.success, result.error
    temperature = by_label(result.families, "sidecar_gpu_temperature_celsius", "gpu")
    if len(removed) == 1:  # the versioned call answers instead
        assert temperature == {"0": 66, "1": 66} and unavailable(result.families) == set()
    else:
        assert temperature == {}
        assert unavailable(result.families) == {
            ("0", "temperature", "function_not_found"),
            ("1", "temperature", "function_not_found"),
        }
    assert set(by_label(result.families, "sidecar_gpu_power_watts", "gpu")) == {"0", "1"}


def test_an_nvml_that_fails_to_initialize_is_logged_once_and_fails_each_run(
    fake_gpus, gpu_collector, caplog, monkeypatch
):
    monkeypatch.setattr(nvml, "RETRY_ABSENT_SECONDS", 0.0)  # nvmlInit is attempted on every run
    fake_gpus({"init_error": "lib_rm_version_mismatch", "gpu_count": 8})
    collector = gpu_collector()
    caplog.set_level(logging.INFO)
    results = [run(collector) for _ in range(3)]
    assert all(not r.success and "mismatch" in r.error.lower() for r in results)
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_nvml_that_starts_working_is_used(fake_gpus, gpu_collector, monkeypatch):
    monkeypatch.setattr(nvml, "RETRY_ABSENT_SECONDS", 0.0)
    fake_gpus({"init_error": "lib_rm_version_mismatch", "gpu_count": 2})
    collector = gpu_collector(xid_events=False)
    assert not run(collector).success
    fake_nvml.update({"gpu_count": 2})  # the node was rebooted into a matching driver
    result = run(collector)
    assert result.success and set(by_label(result.families, "sidecar_gpu_power_watts", "gpu")) == {"0", "1"}
