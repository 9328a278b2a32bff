"""What `sidecar preflight` reads from the node, as plain facts: NVML (with the GPU
collector's own session and device reader), the training environment's torch (from a
subprocess of its interpreter: the sidecar never imports torch), the kernel log's Xids, NICs,
InfiniBand ports and the NVIDIA GPUs on the PCI bus from sysfs, the clock's synchronisation
(adjtimex(2) through a ctypes `struct timex`) and mounts. The checks (`gpu_checks`, `node_checks`) judge them.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.collectors import sysfs
from sidecar.collectors.nic import IB_ACTIVE
from sidecar.collectors.nvml import GpuLost, GpuReading, NvmlSession

XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")

TORCH_PROBE = r"""
import json
out = {}
import torch
out["torch"] = torch.__version__
out["cuda"] = torch.version.cuda
out["cuda_available"] = bool(torch.cuda.is_available())
out["device_count"] = torch.cuda.device_count() if out["cuda_available"] else 0
try:
    v = torch.cuda.nccl.version()
    out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
except Exception:
    out["nccl"] = None
print(json.dumps(out))
"""


# ---------------------------------------------------------------- facts: NVML


@dataclass
class NvmlFacts:
    """What NVML says, read with the GPU collector's own session and device reader."""

    error: str | None = None  # NVML unusable: no driver, no library, or broken
    absent: bool = False  # unusable because there is no driver or library (a CPU node), not broken
    driver_version: str | None = None
    cuda_version: str | None = None  # the newest CUDA the driver supports, "12.4"
    gpus: list[GpuReading] = field(default_factory=list)
    lost: dict[int, str] = field(default_factory=dict)  # index -> why the device cannot be read


def read_nvml(module_name: str) -> NvmlFacts:
    session = NvmlSession(module_name)
    try:
        if not session.start():
            if session.broken:  # NVML present but broken: worth a FAIL, not a crash
                return NvmlFacts(error=f"NVML present but failing: {session.broken}")
            return NvmlFacts(error="no NVIDIA driver (NVML library or driver not found)", absent=True)
    except Exception as e:
        return NvmlFacts(error=f"NVML present but failing: {e}")
    try:
        facts = NvmlFacts(driver_version=session.driver_version, cuda_version=session.cuda_version)
        for index in range(session.count):
            try:
                facts.gpus.append(session.read(index))
            except GpuLost as e:
                facts.lost[index] = str(e)
        return facts
    finally:
        session.close()


# ---------------------------------------------------------------- facts: torch, kernel log, sysfs


@dataclass
class TorchFacts:
    python: str
    error: str | None = None
    torch: str | None = None
    cuda: str | None = None  # the CUDA torch was built for; None on a CPU build
    nccl: str | None = None
    cuda_available: bool = False
    device_count: int = 0


def read_torch(python: str, timeout: float) -> TorchFacts:
    facts = TorchFacts(python)
    try:
        proc = subprocess.run([python, "-c", TORCH_PROBE], capture_output=True, text=True, timeout=timeout)
    except OSError as e:  # absent or not executable
        facts.error = f"cannot run {python}: {e.strerror or e}"
        return facts
    except subprocess.TimeoutExpired:
        facts.error = f"importing torch took over {timeout:g}s"
        return facts
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        facts.error = f"torch not importable by {python}: {last}"
        return facts
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        facts.error = f"unexpected output from {python}: {proc.stdout[-200:]!r}"
        return facts
    for key in ("torch", "cuda", "nccl", "cuda_available", "device_count"):
        setattr(facts, key, data.get(key, getattr(facts, key)))
    return facts


def read_kernel_log(path: str | None) -> tuple[str | None, str | None]:
    """(text, error): the kernel log from `path`, else from `dmesg`."""
    if path:
        try:
            return Path(path).read_text(errors="replace"), None
        except OSError as e:
            return None, f"cannot read {path}: {e.strerror}"
    try:
        proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=20, errors="replace")
    except FileNotFoundError:
        return None, "dmesg is not installed"
    except subprocess.TimeoutExpired:
        return None, "dmesg did not answer"
    if proc.returncode != 0:
        return None, f"dmesg: {proc.stderr.strip() or f'exit status {proc.returncode}'}"
    return proc.stdout, None


def parse_xids(log: str) -> collections.Counter[tuple[str, int]]:
    """Count of each (PCI bus id, Xid) in a kernel log."""
    return collections.Counter((m.group(1), int(m.group(2))) for m in XID_LINE.finditer(log))


NVIDIA_VENDOR = "0x10de"
# Drivers that hand a device to a virtual machine: such a GPU is not this node's to use.
PASSTHROUGH_DRIVERS = ("vfio-pci", "pci-stub")


def read_pci_gpus(sysfs_root: str) -> list[str]:
    """The PCI addresses of the NVIDIA GPUs on the bus (vendor 0x10de, class 0x03xxxx: display and
    3D controllers; NVSwitches are bridges, 0x0680), whatever driver is loaded, less those bound to a
    passthrough driver for a VM. Sysfs lists them before and without the NVIDIA driver."""
    out = []
    for device in sorted((Path(sysfs_root) / "bus" / "pci" / "devices").glob("*")):
        try:
            vendor = (device / "vendor").read_text().strip().lower()
            pci_class = (device / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor != NVIDIA_VENDOR or not pci_class.startswith("0x03"):
            continue
        driver = device / "driver"
        if driver.exists() and os.path.basename(os.path.realpath(driver)) in PASSTHROUGH_DRIVERS:
            continue
        out.append(device.name)
    return out


@dataclass
class LinkFacts:
    name: str  # eth0, or mlx5_0/1 for an InfiniBand port
    up: bool
    state: str
    speed: str | None = None


def read_nics(sysfs_root: str, exclude: str) -> list[LinkFacts]:
    pattern = re.compile(exclude) if exclude else None
    out = []
    for name in sysfs.list_net_devices(sysfs_root):
        if pattern and pattern.search(name):
            continue
        d = sysfs.read_net_device(sysfs_root, name)
        out.append(
            LinkFacts(
                name,
                d.operstate == "up",
                d.operstate or "unknown",
                f"{d.speed_mbps / 1000:g} Gb/s" if d.speed_mbps else None,
            )
        )
    return out


def read_ib_ports(sysfs_root: str) -> list[LinkFacts]:
    out = []
    for device, port in sysfs.list_infiniband_ports(sysfs_root):
        p = sysfs.read_infiniband_port(sysfs_root, device, port)
        rate = p.rate_bytes_per_second
        out.append(
            LinkFacts(
                f"{device}/{port}",
                p.state_id == IB_ACTIVE,
                p.state or "?",
                f"{rate * 8 / 1e9:g} Gb/s" if rate else None,
            )
        )
    return out


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class _Timex(ctypes.Structure):
    """struct timex of <sys/timex.h> (Linux)."""

    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time", _Timeval),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_padding", ctypes.c_int * 11),
    ]


TIME_ERROR, STA_UNSYNC = 5, 0x0040


def read_clock_sync() -> tuple[bool | None, str]:
    """(synchronised, how we know). The kernel's NTP state via adjtimex(2) (read-only, works
    in containers), else `timedatectl`; (None, why) when neither answers."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        tx = _Timex()
        state = libc.adjtimex(ctypes.byref(tx))
        if state >= 0:
            synced = state != TIME_ERROR and not tx.status & STA_UNSYNC
            return synced, f"adjtimex: max error {tx.maxerror / 1000:g} ms"
        how = f"adjtimex: {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as e:
        how = f"adjtimex unavailable ({e})"
    try:
        proc = subprocess.run(
            ["timedatectl", "show", "-p", "NTPSynchronized", "--value"], capture_output=True, text=True, timeout=10
        )
        if proc.returncode == 0 and proc.stdout.strip() in ("yes", "no"):
            return proc.stdout.strip() == "yes", "timedatectl"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None, how


# ---------------------------------------------------------------- facts: mounts


def mount_of(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) holding `path`."""
    import psutil

    path = path.resolve()
    mounts = {p.mountpoint: p.fstype for p in psutil.disk_partitions(all=True)}
    for candidate in [path, *path.parents]:
        if str(candidate) in mounts:
            return str(candidate), mounts[str(candidate)]
    return "/", mounts.get("/", "?")


def write_probe(directory: Path) -> str | None:
    """None if a file can be created, written, synced and removed in `directory`; else why not."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".sidecar-preflight-") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e.strerror or str(e)
    return None
