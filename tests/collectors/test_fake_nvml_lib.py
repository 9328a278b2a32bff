"""The fake libnvidia-ml keeps the C library's rules, seen through the real pynvml: return codes,
missing symbols per driver generation, struct versions, the two-call size protocol."""

from __future__ import annotations

import ctypes

import pynvml
import pytest

from sidecar.testing import fake_nvml_lib


def test_pynvml_loads_the_fake_library_and_reads_through_its_own_wrappers(fake_gpus):
    fake_gpus({"gpu_count": 2, "driver_version": "535.183.01"})
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 2 and pynvml.nvmlSystemGetDriverVersion() == "535.183.01"
    handle = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert isinstance(handle, pynvml.c_nvmlDevice_t) and pynvml.nvmlDeviceGetIndex(handle) == 1
    assert pynvml.nvmlDeviceGetPciInfo(handle).busId == "00000000:28:00.0"


def test_calls_before_init_answer_uninitialized(fake_gpus):
    fake_gpus({"gpu_count": 1})
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_a_handle_the_library_did_not_give_is_an_invalid_argument(fake_gpus):
    fake_gpus({"gpu_count": 1})
    pynvml.nvmlInit()
    forged = ctypes.cast(ctypes.c_void_p(0x1234), pynvml.c_nvmlDevice_t)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetPowerUsage(forged)


def test_an_old_generation_lacks_the_newer_symbols(fake_gpus):
    fake_gpus({"gpu_count": 1, "driver_generation": "r470"})
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLLibraryMismatchError):  # pynvml's unversioned wrapper calls _v3
        pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
    assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle) == 0


def test_a_struct_of_the_wrong_version_is_refused(fake_gpus):
    fake_gpus({"gpu_count": 1})
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).reserved > 0
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(handle, version=0x01000028)


def test_process_lists_use_the_two_call_size_protocol(fake_gpus):
    lib = fake_gpus(
        {
            "gpu_count": 1,
            "gpu": {"processes": [{"pid": 7, "used_memory_bytes": 70}, {"pid": 8, "used_memory_bytes": None}]},
        }
    )
    pynvml.nvmlInit()
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(7, 70), (8, None)]  # NOT_AVAILABLE -> None
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 2


def test_a_failure_inside_the_fake_is_unknown_not_success(fake_gpus, monkeypatch):
    lib = fake_gpus({"gpu_count": 1})
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    monkeypatch.setattr(fake_nvml_lib.model, "nvmlDeviceGetPowerUsage", lambda h: 1 / 0)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetPowerUsage(handle)
    assert lib.faults and "ZeroDivisionError" in lib.faults[0]
    lib.faults.clear()


def test_uninstalled_pynvml_looks_for_the_real_library_again(fake_gpus):
    import ctypes.util

    fake_gpus({"gpu_count": 1})
    fake_nvml_lib.uninstall()
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has the NVIDIA driver")
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        pynvml.nvmlInit()
