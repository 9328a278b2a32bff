"""The structs of nvml.h that the fake libnvidia-ml fills, declared from the header's layout
(not borrowed from pynvml, so a layout mismatch between the two would show in the tests)."""

from __future__ import annotations

from ctypes import (
    Structure,
    Union,
    c_char,
    c_double,
    c_int,
    c_int64,
    c_longlong,
    c_uint,
    c_uint32,
    c_ulong,
    c_ulonglong,
    c_ushort,
    c_void_p,
    sizeof,
)


class Memory_v1(Structure):
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class Memory_v2(Structure):
    _fields_ = [
        ("version", c_uint),
        ("total", c_ulonglong),
        ("reserved", c_ulonglong),
        ("free", c_ulonglong),
        ("used", c_ulonglong),
    ]


class Utilization(Structure):
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


class PciInfo(Structure):
    _fields_ = [
        ("busIdLegacy", c_char * 16),
        ("domain", c_uint),
        ("bus", c_uint),
        ("device", c_uint),
        ("pciDeviceId", c_uint),
        ("pciSubSystemId", c_uint),
        ("busId", c_char * 32),
    ]


class ProcessInfo_v1(Structure):
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong)]


class ProcessInfo_v2(Structure):  # also v3's layout
    _fields_ = [
        ("pid", c_uint),
        ("usedGpuMemory", c_ulonglong),
        ("gpuInstanceId", c_uint),
        ("computeInstanceId", c_uint),
    ]


class EventData(Structure):
    _fields_ = [
        ("device", c_void_p),
        ("eventType", c_ulonglong),
        ("eventData", c_ulonglong),
        ("gpuInstanceId", c_uint),
        ("computeInstanceId", c_uint),
    ]


class ViolationTime(Structure):
    _fields_ = [("referenceTime", c_ulonglong), ("violationTime", c_ulonglong)]


class Value(Union):
    _fields_ = [
        ("dVal", c_double),
        ("uiVal", c_uint),
        ("ulVal", c_ulong),
        ("ullVal", c_ulonglong),
        ("sllVal", c_longlong),
        ("siVal", c_int),
        ("usVal", c_ushort),
    ]


class FieldValue(Structure):
    _fields_ = [
        ("fieldId", c_uint32),
        ("scopeId", c_uint32),
        ("timestamp", c_int64),
        ("latencyUsec", c_int64),
        ("valueType", c_int),
        ("nvmlReturn", c_int),
        ("value", Value),
    ]


class Temperature_v1(Structure):
    _fields_ = [("version", c_uint), ("sensorType", c_uint), ("temperature", c_int)]


def struct_version(struct: type, version: int) -> int:
    """NVML_STRUCT_VERSION(name, ver): the struct's size with the version in the top byte."""
    return sizeof(struct) | (version << 24)


MEMORY_V2 = struct_version(Memory_v2, 2)
TEMPERATURE_V1 = struct_version(Temperature_v1, 1)
NOT_AVAILABLE_ULL = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for unsigned long long
