"""The NVML stand-in keeps NVML's rules, so code tested against it behaves the same on a GPU node."""

from __future__ import annotations

import json
import os
import time

import pynvml
import pytest

from sidecar.testing import fake_nvml as nv


def test_calls_before_init_raise_uninitialized(fake_gpus):
    fake_gpus({"gpu_count": 1})
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()


def test_errors_are_pynvmls_own_classes(fake_gpus):
    fake_gpus({"gpu_count": 1, "gpu": {"errors": {"nvmlDeviceGetPowerUsage": "gpu_is_lost"}}})
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost) as err:
        nv.nvmlDeviceGetPowerUsage(handle)
    assert err.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    assert nv.NVMLError_NotSupported is pynvml.NVMLError_NotSupported


def test_a_handle_not_from_this_library_is_an_invalid_argument(fake_gpus):
    fake_gpus({"gpu_count": 2})
    nv.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetTemperature(object(), pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(2)


def test_handles_stop_working_after_shutdown(fake_gpus):
    fake_gpus({"gpu_count": 1})
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetUUID(handle)


def test_without_a_spec_the_library_is_missing(fake_gpus, monkeypatch):
    monkeypatch.delenv(nv.ENV_VAR, raising=False)
    fake_gpus(None)
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        nv.nvmlInit()


def test_no_driver_mode(fake_gpus):
    fake_gpus({"init_error": "driver_not_loaded"})
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        nv.nvmlInit()


def test_energy_grows_with_power(fake_gpus):
    fake_gpus({"gpu_count": 1, "gpu": {"power_mw": 500_000, "energy_mj": 0}})
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    first = nv.nvmlDeviceGetTotalEnergyConsumption(handle)
    time.sleep(0.05)
    assert nv.nvmlDeviceGetTotalEnergyConsumption(handle) >= first + 500_000 * 0.05


def test_an_event_wait_without_events_times_out(fake_gpus):
    fake_gpus({"gpu_count": 1})
    nv.nvmlInit()
    events = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, events)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait_v2(events, 20)


def test_xid_events_are_delivered_with_the_device_and_xid(fake_gpus):
    fake_gpus({"gpu_count": 2, "xid_events": [{"gpu": 1, "xid": 79, "at_seconds": 0.05}]})
    nv.nvmlInit()
    events = nv.nvmlEventSetCreate()
    for i in range(2):
        nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(i), pynvml.nvmlEventTypeXidCriticalError, events)
    data = nv.nvmlEventSetWait_v2(events, 5000)
    assert nv.nvmlDeviceGetIndex(data.device) == 1 and data.eventData == 79
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError


def test_the_spec_file_is_reread_when_it_changes(fake_gpus, tmp_path, monkeypatch):
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"gpu_count": 1, "gpu": {"temperature_celsius": 50}}))
    monkeypatch.setenv(nv.ENV_VAR, str(path))
    fake_gpus(None)
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 50
    path.write_text(json.dumps({"gpu_count": 1, "gpu": {"temperature_celsius": 81}}))
    os.utime(path, (time.time() + 5, time.time() + 5))
    nv._state.checked_at = float("-inf")  # skip the half-second re-check interval
    assert nv.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 81


def test_an_unknown_error_name_in_the_spec_is_reported_clearly(fake_gpus):
    fake_gpus({"init_error": "on_fire"})
    with pytest.raises(ValueError, match="on_fire"):
        nv.nvmlInit()
