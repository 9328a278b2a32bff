"""The GPU collector through the real pynvml over a fake libnvidia-ml: what it exports, and the
basic NVML outcomes (unsupported field, lost GPU, absent driver). The error scenarios of older
drivers, MIG and fields that keep failing are in test_gpu_errors.py."""

from __future__ import annotations

import pytest

from sidecar.collectors.gpu import METRICS
from tests.collectors.helpers import by_label, run, series
from tests.support import wait_until

EIGHT = {"gpu_count": 8}
ALL_GPUS = {str(i) for i in range(8)}


def test_eight_gpus_export_one_series_per_gpu_for_each_device_family(fake_gpus, gpu_collector):
    fake_gpus(EIGHT)
    result = run(gpu_collector())
    assert result.success, result.error
    per_gpu = [
        "sidecar_gpu_utilization_ratio",
        "sidecar_gpu_memory_used_bytes",
        "sidecar_gpu_temperature_celsius",
        "sidecar_gpu_power_watts",
        "sidecar_gpu_energy_joules_total",
        "sidecar_gpu_sm_clock_hertz",
        "sidecar_gpu_pcie_replay_total",
        "sidecar_gpu_remapped_rows_failed",
        "sidecar_gpu_lost",
    ]
    for name in per_gpu:
        assert set(by_label(result.families, name, "gpu")) == ALL_GPUS, name
    info = series(result.families, "sidecar_gpu_info")
    assert len(info) == 8 and all(dict(k)["uuid"].startswith("GPU-") for k in info)


def test_every_family_a_healthy_gpu_can_have_is_exported(fake_gpus, gpu_collector):
    fake_gpus(
        {
            "gpu_count": 1,
            "xid_events": [{"gpu": 0, "xid": 13}],
            "gpu": {"processes": [{"pid": 1, "used_memory_bytes": 1}]},
        }
    )
    collector = gpu_collector(ranks=lambda: [("job", 0, 1)])
    run(collector)
    wait_until(lambda: collector.xid.snapshot()[0], 10, what="the XID event")
    exported = {f.name for f in run(collector).families}
    assert exported == {s.name for s in METRICS} - {"sidecar_gpu_field_unavailable"}  # nothing is missing


def test_values_are_converted_to_base_units(fake_gpus, gpu_collector):
    fake_gpus(
        {
            "gpu_count": 1,
            "gpu": {
                "power_mw": 612_500,
                "power_limit_mw": 700_000,
                "sm_clock_mhz": 1980,
                "memory_clock_mhz": 2619,
                "utilization_gpu": 97,
                "energy_mj": 5_000,
            },
        }
    )
    families = run(gpu_collector()).families
    assert by_label(families, "sidecar_gpu_power_watts", "gpu") == {"0": 612.5}
    assert by_label(families, "sidecar_gpu_power_limit_watts", "gpu") == {"0": 700.0}
    assert by_label(families, "sidecar_gpu_sm_clock_hertz", "gpu") == {"0": 1.98e9}
    assert by_label(families, "sidecar_gpu_memory_clock_hertz", "gpu") == {"0": 2.619e9}
    assert by_label(families, "sidecar_gpu_utilization_ratio", "gpu") == {"0": 0.97}
    assert by_label(families, "sidecar_gpu_energy_joules_total", "gpu")["0"] >= 5.0


def test_energy_counter_increases_between_samples(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 1})
    collector = gpu_collector()
    first = by_label(run(collector).families, "sidecar_gpu_energy_joules_total", "gpu")["0"]
    wait_until(
        lambda: by_label(run(collector).families, "sidecar_gpu_energy_joules_total", "gpu")["0"] > first,
        10,
        interval=0.05,
        what="energy to grow",
    )


def test_unsupported_fields_are_skipped_without_marking_failure(fake_gpus, gpu_collector):
    fake_gpus(
        {
            "gpu_count": 8,
            "gpus": {
                "2": {
                    "errors": {
                        "nvmlDeviceGetPowerUsage": "not_supported",
                        "nvmlDeviceGetRemappedRows": "not_supported",
                        "nvmlDeviceGetTotalEccErrors": "not_supported",
                    }
                }
            },
        }
    )
    result = run(gpu_collector())
    assert result.success, result.error
    assert set(by_label(result.families, "sidecar_gpu_power_watts", "gpu")) == ALL_GPUS - {"2"}
    assert set(by_label(result.families, "sidecar_gpu_remapped_rows_failed", "gpu")) == ALL_GPUS - {"2"}
    assert "2" in by_label(result.families, "sidecar_gpu_temperature_celsius", "gpu")
    unavailable = {
        (dict(k)["gpu"], dict(k)["field"], dict(k)["reason"])
        for k in series(result.families, "sidecar_gpu_field_unavailable")
    }
    assert unavailable == {
        ("2", "power", "not_supported"),
        ("2", "remapped_rows", "not_supported"),
        ("2", "ecc_corrected", "not_supported"),
        ("2", "ecc_uncorrected", "not_supported"),
        ("2", "ecc_volatile_corrected", "not_supported"),
        ("2", "ecc_volatile_uncorrected", "not_supported"),
    }


def test_links_the_board_does_not_have_are_skipped(fake_gpus, gpu_collector):
    fake_gpus(
        {
            "gpu_count": 2,
            "gpu": {"nvlink_links": 4, "nvlink_down": [2], "nvlink_link_errors": {"1": {"crc_flit": 12}}},
            "gpus": {"1": {"nvlink_links": 0}},
        }
    )
    result = run(gpu_collector())
    assert result.success, result.error
    up = series(result.families, "sidecar_gpu_nvlink_up")
    assert {(dict(k)["gpu"], dict(k)["link"]): v for k, v in up.items()} == {
        ("0", "0"): 1.0,
        ("0", "1"): 1.0,
        ("0", "2"): 0.0,
        ("0", "3"): 1.0,
    }
    errors = series(result.families, "sidecar_gpu_nvlink_errors_total")
    assert errors[(("gpu", "0"), ("link", "1"), ("type", "crc_flit"))] == 12
    assert len(errors) == 4 * 4


def test_a_lost_gpu_is_skipped_and_the_run_is_a_partial_failure(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 8, "gpus": {"5": {"errors": {"*": "gpu_is_lost"}}}})
    result = run(gpu_collector())
    assert not result.success
    assert "gpu 5" in result.error and "lost" in result.error.lower()
    assert set(by_label(result.families, "sidecar_gpu_utilization_ratio", "gpu")) == ALL_GPUS - {"5"}
    assert by_label(result.families, "sidecar_gpu_lost", "gpu")["5"] == 1.0
    assert not any(dict(k)["gpu"] == "5" for k in series(result.families, "sidecar_gpu_info"))


def test_a_lost_gpu_that_comes_back_is_exported_again(fake_gpus, gpu_collector):
    spec = {"gpu_count": 2, "gpus": {"1": {"errors": {"*": "gpu_is_lost"}}}}
    fake_gpus(spec)
    collector = gpu_collector(xid_events=False)
    assert not run(collector).success
    from sidecar.testing import fake_nvml

    fake_nvml.update({"gpu_count": 2})  # the device recovers; the driver session stays
    result = run(collector)
    assert result.success and by_label(result.families, "sidecar_gpu_lost", "gpu") == {"0": 0.0, "1": 0.0}


def test_a_gpu_whose_handle_cannot_be_had_is_lost(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 2, "gpus": {"1": {"errors": {"nvmlDeviceGetHandleByIndex": "no_permission"}}}})
    result = run(gpu_collector(xid_events=False))
    assert not result.success and "gpu 1" in result.error
    assert by_label(result.families, "sidecar_gpu_lost", "gpu") == {"0": 0.0, "1": 1.0}


def test_no_driver_means_no_series_and_success(fake_gpus, gpu_collector):
    fake_gpus({"init_error": "driver_not_loaded", "gpu_count": 8})
    collector = gpu_collector()
    result = run(collector)
    assert result.success and result.families == []
    assert collector.versions() == ("", "")


def test_no_library_means_no_series_and_success(fake_gpus, gpu_collector):
    fake_gpus({"init_error": "library_not_found"})
    result = run(gpu_collector())
    assert result.success and result.families == []


def test_an_nvml_module_that_is_not_installed_means_no_series_and_success():
    from sidecar.collectors.gpu import GpuCollector

    result = run(GpuCollector("no_such_nvml_module", lambda: []))
    assert result.success and result.families == []


def test_driver_and_cuda_versions_are_reported(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 1, "driver_version": "550.54.15", "cuda_driver_version": 12040})
    collector = gpu_collector()
    run(collector)
    assert collector.versions() == ("550.54.15", "12.4")


def test_clock_event_reasons_are_decoded_into_labels(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 1, "gpu": {"clock_event_reasons": 0x4 | 0x40}})
    active = by_label(run(gpu_collector()).families, "sidecar_gpu_clock_event_active", "reason")
    assert {r for r, v in active.items() if v == 1} == {"sw_power_cap", "hw_thermal_slowdown"}
    assert len(active) == 9


def test_memory_error_counters(fake_gpus, gpu_collector):
    fake_gpus(
        {
            "gpu_count": 1,
            "gpu": {
                "ecc_corrected": 7,
                "ecc_uncorrected": 1,
                "retired_pages_double_bit": 2,
                "remapped_rows": [3, 1, 1, 0],
            },
        }
    )
    families = run(gpu_collector()).families
    assert by_label(families, "sidecar_gpu_ecc_errors_total", "type") == {"corrected": 7, "uncorrected": 1}
    assert by_label(families, "sidecar_gpu_retired_pages", "cause") == {"single_bit": 0, "double_bit": 2}
    assert by_label(families, "sidecar_gpu_remapped_rows", "type") == {"correctable": 3, "uncorrectable": 1}
    assert by_label(families, "sidecar_gpu_remapped_rows_pending", "gpu") == {"0": 1}


def test_health_counters_are_reread_at_most_every_health_interval(fake_gpus, gpu_collector):
    from sidecar.testing import fake_nvml

    fake_gpus({"gpu_count": 1, "gpu": {"ecc_uncorrected": 0, "temperature_celsius": 60}})
    collector = gpu_collector(xid_events=False)
    run(collector)
    fake_nvml.update({"gpu_count": 1, "gpu": {"ecc_uncorrected": 3, "temperature_celsius": 70}})
    families = run(collector).families
    assert by_label(families, "sidecar_gpu_temperature_celsius", "gpu") == {"0": 70}  # read every round
    assert by_label(families, "sidecar_gpu_ecc_errors_total", "type")["uncorrected"] == 0  # not yet due
    collector.session.health_seconds = 0.0
    assert by_label(run(collector).families, "sidecar_gpu_ecc_errors_total", "type")["uncorrected"] == 3


def test_xid_events_are_counted_per_gpu_and_xid(fake_gpus, gpu_collector):
    from sidecar.testing import fake_nvml

    fake_gpus({"gpu_count": 8, "xid_events": [{"gpu": 3, "xid": 79}, {"gpu": 3, "xid": 79}, {"gpu": 0, "xid": 13}]})
    collector = gpu_collector()
    run(collector)
    fake_nvml.inject_xid(7, 48)
    wait_until(lambda: sum(collector.xid.snapshot()[0].values()) == 4, 10, what="4 XID events")
    families = run(collector).families
    counts = {(dict(k)["gpu"], dict(k)["xid"]): v for k, v in series(families, "sidecar_gpu_xid_errors_total").items()}
    assert counts == {("3", "79"): 2, ("0", "13"): 1, ("7", "48"): 1}
    last = by_label(families, "sidecar_gpu_last_xid", "gpu")
    assert last["3"] == 79 and last["7"] == 48 and last["1"] == 0
    assert set(by_label(families, "sidecar_gpu_last_xid_timestamp_seconds", "gpu")) == {"0", "3", "7"}


def test_xid_events_are_not_watched_when_switched_off(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 2, "xid_events": [{"gpu": 0, "xid": 79}]})
    collector = gpu_collector(xid_events=False)
    families = run(collector).families
    assert collector.xid is None
    assert not series(families, "sidecar_gpu_xid_errors_total") and not series(families, "sidecar_gpu_last_xid")


def test_gpus_without_event_support_are_not_watched(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 2, "gpus": {"1": {"xid_supported": False}}})
    collector = gpu_collector()
    result = run(collector)
    assert result.success
    assert set(by_label(result.families, "sidecar_gpu_last_xid", "gpu")) == {"0"}


def test_process_memory_is_attributed_to_the_rank_and_its_children(fake_gpus, gpu_collector, rank_process):
    proc, child_pid = rank_process()
    fake_gpus(
        {
            "gpu_count": 2,
            "gpus": {
                "0": {
                    "processes": [
                        {"pid": proc.pid, "used_memory_bytes": 1000},
                        {"pid": child_pid, "used_memory_bytes": 24},
                        {"pid": 999_999_999, "used_memory_bytes": 5},
                    ]
                },
                "1": {"processes": [{"pid": 999_999_998, "used_memory_bytes": 7}]},
            },
        }
    )
    collector = gpu_collector(ranks=lambda: [("run-42", 3, proc.pid)])
    used = series(run(collector).families, "sidecar_gpu_process_memory_bytes")
    assert used == {(("gpu", "0"), ("job_id", "run-42"), ("rank", "3")): 1024}


def test_the_real_pynvml_on_a_machine_without_a_driver_means_no_series():
    import ctypes.util

    from sidecar.collectors.gpu import GpuCollector

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has the NVIDIA driver")
    collector = GpuCollector("pynvml", lambda: [])
    result = run(collector)
    collector.close()
    assert result.success and result.families == []


def test_dcgm_parity_fields_are_exported_in_base_units(fake_gpus, gpu_collector):
    fake_gpus(
        {
            "gpu_count": 1,
            "gpu": {
                "memory_temperature_celsius": 71,
                "memory_total_bytes": 80 * 2**30,
                "memory_used_bytes": 50 * 2**30,
                "memory_reserved_bytes": 2**30,
                "pcie_tx_kbps": 1000,
                "pcie_rx_kbps": 3000,
                "encoder_utilization": 12,
                "decoder_utilization": 34,
                "ecc_volatile_corrected": 5,
                "ecc_corrected": 9,
                "violation_ns": {"power": 2_500_000_000, "thermal": 1_000_000},
            },
        }
    )
    result = run(gpu_collector(xid_events=False))
    assert result.success, result.error
    f = result.families
    assert by_label(f, "sidecar_gpu_memory_temperature_celsius", "gpu") == {"0": 71}
    assert by_label(f, "sidecar_gpu_memory_reserved_bytes", "gpu") == {"0": 2**30}
    assert by_label(f, "sidecar_gpu_memory_free_bytes", "gpu") == {"0": 29 * 2**30}
    assert by_label(f, "sidecar_gpu_memory_used_bytes", "gpu") == {"0": 50 * 2**30}
    assert by_label(f, "sidecar_gpu_pcie_throughput_bytes_per_second", "direction") == {
        "transmit": 1000 * 1024,
        "receive": 3000 * 1024,
    }
    assert by_label(f, "sidecar_gpu_encoder_utilization_ratio", "gpu") == {"0": 0.12}
    assert by_label(f, "sidecar_gpu_decoder_utilization_ratio", "gpu") == {"0": 0.34}
    assert by_label(f, "sidecar_gpu_ecc_volatile_errors_total", "type") == {"corrected": 5, "uncorrected": 0}
    assert by_label(f, "sidecar_gpu_ecc_errors_total", "type") == {"corrected": 9, "uncorrected": 0}
    violation = by_label(f, "sidecar_gpu_clock_violation_seconds_total", "policy")
    assert violation["power"] == pytest.approx(2.5) and violation["thermal"] == pytest.approx(0.001)
    assert set(violation) == {"power", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability"}


def test_a_healthy_gpu_costs_at_most_twelve_nvml_calls_per_round_between_health_reads(fake_gpus, gpu_collector):
    lib = fake_gpus({"gpu_count": 8, "gpu": {"processes": [{"pid": 1, "used_memory_bytes": 1}]}})
    collector = gpu_collector(xid_events=False)
    run(collector)  # the first round also reads static facts and health
    before = sum(lib.calls.values())
    run(collector)
    per_gpu = (sum(lib.calls.values()) - before) / 8
    assert per_gpu <= 12, dict(lib.calls)  # 11: 10 calls, +1 for the second call of a non-empty process list


def test_every_per_gpu_family_names_the_fields_it_comes_from():
    from sidecar.collectors.gpu import CONDITIONAL, FIELDS_OF, INFO, LOST

    assert {s.name for s in METRICS} == set(FIELDS_OF) | set(CONDITIONAL) | {INFO.name, LOST.name}
