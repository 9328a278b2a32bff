"""`sidecar preflight`: check a node before a training job starts on it.

Each check prints one line, PASS, WARN, FAIL or SKIP, with a hint saying what to do about
anything that is not PASS. The exit status is 0 unless a check FAILed (1); with `--strict`
a WARN fails too. A missing part of the environment (no NVIDIA driver, no InfiniBand, an
unreadable kernel log) is reported, never a crash.

Reading the node is kept apart from judging it: `read_*` functions return plain facts, the
`check_*` functions turn facts into results. The sidecar never imports torch, so torch's
versions come from a subprocess of the training environment's interpreter (`--python`).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import ctypes
import ctypes.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from sidecar.xids import HARDWARE_XIDS
from sidecar.collectors import sysfs
from sidecar.collectors.nic import IB_ACTIVE
from sidecar.collectors.nvml import GpuLost, GpuReading, NvmlSession
from sidecar.config import ConfigError, Settings, parse_hostport, settings_from_args
from sidecar.status import EXIT_HEALTHY, StatusError, Target, assess, fetch, fetch_json, resolve_target

PASS, SKIP, WARN, FAIL = "PASS", "SKIP", "WARN", "FAIL"
SEVERITY = {PASS: 0, SKIP: 0, WARN: 1, FAIL: 2}
STYLE = {PASS: "green", SKIP: "dim", WARN: "yellow", FAIL: "bold red"}
MARKER_NAME = ".sidecar-preflight-marker"
CONNECT_TIMEOUT_SECONDS = 3.0
XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "ceph", "cephfs", "beegfs",
                       "wekafs", "glusterfs", "9p", "virtiofs", "fuse")

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


@dataclass
class Result:
    check: str
    outcome: str
    detail: str
    hint: str = ""


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
        last = (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]
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
        return None, f"dmesg: {proc.stderr.strip() or 'exit status %d' % proc.returncode}"
    return proc.stdout, None


def parse_xids(log: str) -> collections.Counter[tuple[str, int]]:
    """Count of each (PCI bus id, Xid) in a kernel log."""
    return collections.Counter((m.group(1), int(m.group(2))) for m in XID_LINE.finditer(log))


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
        out.append(LinkFacts(name, d.operstate == "up", d.operstate or "unknown",
                             f"{d.speed_mbps / 1000:g} Gb/s" if d.speed_mbps else None))
    return out


def read_ib_ports(sysfs_root: str) -> list[LinkFacts]:
    out = []
    for device, port in sysfs.list_infiniband_ports(sysfs_root):
        p = sysfs.read_infiniband_port(sysfs_root, device, port)
        rate = p.rate_bytes_per_second
        out.append(LinkFacts(f"{device}/{port}", p.state_id == IB_ACTIVE, p.state or "?",
                             f"{rate * 8 / 1e9:g} Gb/s" if rate else None))
    return out


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class _Timex(ctypes.Structure):
    """struct timex of <sys/timex.h> (Linux)."""

    _fields_ = [("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
                ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
                ("constant", ctypes.c_long), ("precision", ctypes.c_long), ("tolerance", ctypes.c_long),
                ("time", _Timeval), ("tick", ctypes.c_long), ("ppsfreq", ctypes.c_long),
                ("jitter", ctypes.c_long), ("shift", ctypes.c_int), ("stabil", ctypes.c_long),
                ("jitcnt", ctypes.c_long), ("calcnt", ctypes.c_long), ("errcnt", ctypes.c_long),
                ("stbcnt", ctypes.c_long), ("tai", ctypes.c_int), ("_padding", ctypes.c_int * 11)]


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
        proc = subprocess.run(["timedatectl", "show", "-p", "NTPSynchronized", "--value"],
                              capture_output=True, text=True, timeout=10)
        if proc.returncode == 0 and proc.stdout.strip() in ("yes", "no"):
            return proc.stdout.strip() == "yes", "timedatectl"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None, how


# ---------------------------------------------------------------- checks

@dataclass
class Context:
    args: argparse.Namespace
    settings: Settings
    _nvml: NvmlFacts | None = None
    _nvml_lock: threading.Lock = field(default_factory=threading.Lock)

    def nvml(self) -> NvmlFacts:
        """NVML's facts, read once and shared by the GPU checks (which run in parallel)."""
        with self._nvml_lock:
            if self._nvml is None:
                self._nvml = read_nvml(self.settings.collectors.nvml_module)
            return self._nvml


def check_driver(ctx: Context) -> Iterable[Result]:
    nv = ctx.nvml()
    if nv.absent:
        yield Result("nvidia-driver", WARN, nv.error or "no NVIDIA driver",
                     "expected on a CPU node; on a GPU node install the driver, or in a container set "
                     "runtimeClassName nvidia / NVIDIA_VISIBLE_DEVICES=all")
        return
    if nv.error:
        yield Result("nvidia-driver", FAIL, nv.error,
                     "the driver is loaded but NVML fails: check `nvidia-smi` and dmesg for Xids; reboot the node")
        return
    yield Result("nvidia-driver", PASS, f"driver {nv.driver_version}, CUDA {nv.cuda_version or '?'}")


def check_gpu_count(ctx: Context) -> Iterable[Result]:
    nv, expected = ctx.nvml(), ctx.args.expect_gpus
    if nv.error:
        if expected:
            yield Result("gpu-count", FAIL, f"expected {expected} GPUs, NVML unusable", "see nvidia-driver")
        else:
            yield Result("gpu-count", SKIP, "NVML unusable (see nvidia-driver)")
        return
    found = len(nv.gpus) + len(nv.lost)
    if expected is not None and found != expected:
        yield Result("gpu-count", FAIL, f"{found} GPUs visible, expected {expected}",
                     "a GPU missing from NVML has usually fallen off the bus (see Xid 79): drain the node")
    elif found == 0:
        yield Result("gpu-count", WARN, "the driver is loaded but no GPU is visible",
                     "check CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES and `nvidia-smi`")
    else:
        names = sorted({g.name or "?" for g in nv.gpus})
        yield Result("gpu-count", PASS, f"{found} GPUs ({', '.join(names)})")


def _unchecked_health(g: GpuReading) -> list[str]:
    """The health facts NVML did not give for this GPU, each with the reason. Pending memory
    repairs count as checked when either mechanism answered: row remapping (Ampere and later)
    or page retirement (before), since a board has only one of them."""
    def why(*fields: str) -> str:
        reasons = ", ".join(f"{f}: {g.unavailable.get(f, 'not read')}" for f in fields)
        return reasons + ("; MIG mode is on" if g.mig_mode else "")
    out = []
    if g.remapped_rows is None and g.retired_pages_pending is None:
        out.append(f"pending row remaps or page retirements ({why('remapped_rows', 'retired_pages_pending')})")
    if g.ecc_uncorrected is None:
        out.append(f"uncorrected ECC errors ({why('ecc_uncorrected')})")
    return out


def check_gpu_health(ctx: Context) -> Iterable[Result]:
    nv = ctx.nvml()
    if nv.error or not (nv.gpus or nv.lost):
        yield Result("gpu-health", SKIP, "no GPU to check")
        return
    bad = False
    checked = 0
    for index, why in sorted(nv.lost.items()):
        bad = True
        yield Result("gpu-health", FAIL, f"GPU {index} cannot be read: {why}", "drain the node; reset or replace the GPU")
    for g in nv.gpus:
        where = f"GPU {g.gpu} ({g.pci_bus_id or '?'})"
        _, _, remap_pending, remap_failed = g.remapped_rows or (0, 0, 0, 0)
        if g.retired_pages_pending or remap_pending:
            bad = True
            yield Result("gpu-health", FAIL, f"{where}: memory {'row remap' if remap_pending else 'page retirement'} "
                         "pending", "reset the GPU (or reboot) so the retirement/remap takes effect")
        if remap_failed:
            bad = True
            yield Result("gpu-health", FAIL, f"{where}: row remapping failed", "replace the GPU")
        if g.ecc_uncorrected:
            bad = True
            yield Result("gpu-health", WARN, f"{where}: {g.ecc_uncorrected} uncorrected ECC errors over its life",
                         "fine if its pages were retired/rows remapped; a rising count means replace it")
        unchecked = _unchecked_health(g)
        if unchecked:
            yield Result("gpu-health", WARN, f"{where}: could not check {'; '.join(unchecked)}",
                         "NVML did not give these; on a MIG GPU check them with MIG off "
                         "(`nvidia-smi -q -d ROW_REMAPPER,ECC`)")
        else:
            checked += 1
    if not bad and checked:
        yield Result("gpu-health", PASS, f"{checked} GPUs: no uncorrected ECC errors, "
                     "no pending retirements or remaps")


def check_xids(ctx: Context) -> Iterable[Result]:
    log, error = read_kernel_log(ctx.args.kernel_log)
    if log is None:
        yield Result("xid", WARN, f"kernel log not readable ({error})",
                     "run as root (or with CAP_SYSLOG), or pass --kernel-log FILE; "
                     "the sidecar's sidecar_gpu_xid_errors_total counts Xids from its start")
        return
    counts = parse_xids(log)
    if not counts:
        yield Result("xid", PASS, "no NVIDIA Xid errors in the kernel log since boot")
        return
    text = ", ".join(f"Xid {xid} on {bus} x{n}" + (f" ({HARDWARE_XIDS[xid]})" if xid in HARDWARE_XIDS else "")
                     for (bus, xid), n in sorted(counts.items()))
    if any(xid in HARDWARE_XIDS for _, xid in counts):
        yield Result("xid", FAIL, text, "hardware Xids: drain the node, reset the GPU, replace it if they return")
    else:
        yield Result("xid", WARN, text, "application Xids (13, 31, 43: faulting kernels) are mostly bugs of a "
                     "previous job; check they are not recurring")


def check_torch(ctx: Context) -> Iterable[Result]:
    t = read_torch(ctx.args.python, ctx.args.torch_timeout)
    if t.error:
        yield Result("torch", WARN, t.error, "pass --python with the training environment's interpreter")
        return
    build = f"CUDA {t.cuda}" if t.cuda else "CPU build"
    yield Result("torch", PASS, f"torch {t.torch} ({build}, NCCL {t.nccl or 'none'}) in {t.python}")
    nv = ctx.nvml()
    if nv.error or not nv.gpus:
        return
    if not t.cuda:
        yield Result("torch-cuda", FAIL, "GPUs present but torch is a CPU build", "install a CUDA build of torch")
    elif nv.cuda_version and _version_tuple(t.cuda)[:1] > _version_tuple(nv.cuda_version)[:1]:
        yield Result("torch-cuda", FAIL, f"torch is built for CUDA {t.cuda}, the driver supports up to "
                     f"{nv.cuda_version}", "upgrade the driver, or install a torch built for an older CUDA")
    elif not t.cuda_available:
        yield Result("torch-cuda", FAIL, "torch cannot use the GPUs (torch.cuda.is_available() is False)",
                     "check the device files and CUDA_VISIBLE_DEVICES in the training environment")
    elif nv.cuda_version and _version_tuple(t.cuda) > _version_tuple(nv.cuda_version):
        # Same major version: runs through CUDA minor version compatibility, minus PTX JIT.
        yield Result("torch-cuda", WARN, f"torch is built for CUDA {t.cuda}, newer than the driver's "
                     f"{nv.cuda_version}", "works through minor version compatibility except for kernels "
                     "JIT-compiled from PTX (Triton, torch.compile); upgrade the driver to be safe")
    elif not t.nccl:
        yield Result("torch-cuda", WARN, "torch has no NCCL", "multi-GPU training will fall back to gloo")
    else:
        yield Result("torch-cuda", PASS, f"torch sees {t.device_count} GPUs, NCCL {t.nccl}")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def check_nics(ctx: Context) -> Iterable[Result]:
    root = ctx.settings.collectors.sysfs_root
    nics = read_nics(root, ctx.settings.collectors.nic_exclude)
    if not nics:
        yield Result("nics", WARN, f"no network interface in {root}/class/net (after collectors.nic_exclude)",
                     "in a container, mount the host's /sys and set collectors.sysfs_root")
        return
    yield links_result("nics", nics, "not up: check the cable/switch port "
                       "or exclude unused ones with collectors.nic_exclude")


def check_infiniband(ctx: Context) -> Iterable[Result]:
    ports = read_ib_ports(ctx.settings.collectors.sysfs_root)
    if not ports:
        yield Result("infiniband", SKIP, "no InfiniBand/RoCE devices")
        return
    yield links_result("infiniband", ports, "not ACTIVE: NCCL skips them; "
                       "check `ibstat`, the cable and the subnet manager")


def links_result(check: str, links: list, down_hint: str) -> Result:
    """PASS listing every link (name, state, speed), or WARN naming the ones that are down."""
    text = ", ".join(f"{link.name} {link.state}" + (f" {link.speed}" if link.speed else "") for link in links)
    down = [link.name for link in links if not link.up]
    if down:
        return Result(check, WARN, text, f"{', '.join(down)} {down_hint}")
    return Result(check, PASS, text)


def _is_local_address(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def _port_free(host: str, port: int) -> bool:
    try:
        with socket.create_server((host, port), reuse_port=False):
            return True
    except OSError:
        return False


def check_rendezvous(ctx: Context) -> Iterable[Result]:
    endpoint = ctx.args.rdzv_endpoint
    if not endpoint:
        yield Result("rendezvous", SKIP, "no --rdzv-endpoint given")
        return
    try:
        host, port = parse_hostport(endpoint, "--rdzv-endpoint")
    except ConfigError as e:
        yield Result("rendezvous", FAIL, str(e), "expected HOST:PORT, the value given to torchrun --rdzv-endpoint")
        return
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_SECONDS):
            pass
    except socket.gaierror as e:
        yield Result("rendezvous", FAIL, f"cannot resolve {host} ({e.strerror})", "check DNS / the endpoint's host name")
    except ConnectionRefusedError:
        if _is_local_address(host):
            if _port_free(host, port):
                yield Result("rendezvous", PASS, f"{endpoint} is this node and the port is free: "
                             "torchrun here will host the c10d store")
            else:
                yield Result("rendezvous", FAIL, f"{endpoint} is this node but the port is taken",
                             "another process holds the port; pick another --rdzv-endpoint port")
        else:
            yield Result("rendezvous", WARN, f"{endpoint}: connection refused (reachable host, nothing listens yet)",
                         f"fine before the job starts: the c10d store starts with torchrun on {host}")
    except (socket.timeout, TimeoutError):
        yield Result("rendezvous", FAIL, f"{endpoint}: no answer within {CONNECT_TIMEOUT_SECONDS:g}s",
                     "a firewall or security group drops the port, or the host is down; open it between nodes")
    except OSError as e:
        yield Result("rendezvous", FAIL, f"{endpoint}: {e.strerror or e}", "check routing between the nodes")
    else:
        yield Result("rendezvous", PASS, f"{endpoint} accepts connections")


def _mount_of(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) holding `path`."""
    import psutil
    path = path.resolve()
    mounts = {p.mountpoint: p.fstype for p in psutil.disk_partitions(all=True)}
    for candidate in [path, *path.parents]:
        if str(candidate) in mounts:
            return str(candidate), mounts[str(candidate)]
    return "/", mounts.get("/", "?")


def _write_probe(directory: Path) -> str | None:
    """None if a file can be created, written, synced and removed in `directory`; else why not."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".sidecar-preflight-") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_shared_dir(ctx: Context) -> Iterable[Result]:
    shared = ctx.args.shared_dir
    if not shared:
        yield Result("shared-storage", SKIP, "no --shared-dir given")
        return
    path = Path(shared)
    if not path.is_dir():
        yield Result("shared-storage", FAIL, f"{path} is not a directory", "mount the shared filesystem there")
        return
    mountpoint, fstype = _mount_of(path)
    shared_fs = any(fstype == t or fstype.startswith(t + ".") for t in NETWORK_FILESYSTEMS)
    where = f"{path} on {mountpoint} ({fstype})"
    problem = _write_probe(path)
    if problem:
        yield Result("shared-storage", FAIL, f"{where}: not writable ({problem})", "fix the mount's permissions")
    elif mountpoint == "/" or not shared_fs:
        yield Result("shared-storage", WARN, f"{where}: writable, but not a network filesystem",
                     "is the shared filesystem mounted? use --shared-marker to prove all nodes see the same files")
    else:
        yield Result("shared-storage", PASS, f"{where}: mounted and writable")
    if ctx.args.shared_marker:
        yield _check_marker(path, ctx.args.shared_marker)


def _check_marker(directory: Path, spec: str) -> Result:
    mode, _, token = spec.partition(":")
    marker = directory / MARKER_NAME
    if mode not in ("write", "check") or not token:
        return Result("shared-marker", FAIL, f"bad --shared-marker {spec!r}", "use write:TOKEN or check:TOKEN")
    if mode == "write":
        body = {"token": token, "hostname": socket.gethostname(), "time": time.time()}
        try:
            marker.write_text(json.dumps(body) + "\n")
        except OSError as e:
            return Result("shared-marker", FAIL, f"cannot write {marker}: {e.strerror}", "fix the mount's permissions")
        return Result("shared-marker", PASS, f"wrote {marker} with token {token!r}",
                      f"run `sidecar preflight --shared-dir {directory} --shared-marker check:{token}` on the other nodes")
    try:
        body = json.loads(marker.read_text())
    except OSError as e:
        return Result("shared-marker", FAIL, f"no marker at {marker} ({e.strerror})",
                      "this node does not see the files the writing node wrote: not the same storage, "
                      "or `write:` has not run yet")
    except ValueError:
        return Result("shared-marker", FAIL, f"{marker} is not a marker file", "rerun write:TOKEN on one node")
    if not isinstance(body, dict) or body.get("token") != token:
        found = body.get("token") if isinstance(body, dict) else None
        return Result("shared-marker", FAIL, f"{marker} holds token {found!r}, not {token!r}",
                      "a stale marker, or a different filesystem mounted at this path")
    return Result("shared-marker", PASS, f"token {token!r} written by {body.get('hostname', '?')} is visible here")


def check_checkpoint_disk(ctx: Context) -> Iterable[Result]:
    directory = Path(ctx.args.checkpoint_dir or ctx.settings.checkpoint_dir).absolute()
    existing = next((p for p in [directory, *directory.parents] if p.exists()), Path("/"))
    usage = shutil.disk_usage(existing)
    free_gb = usage.free / 1e9
    note = "" if existing == directory else f" (does not exist yet; {existing} checked)"
    if not os.access(existing, os.W_OK):
        yield Result("checkpoint-disk", FAIL, f"{directory}{note}: not writable by this user",
                     "fix permissions; checkpoints would fail at the first save")
    elif free_gb < ctx.args.min_free_gb:
        yield Result("checkpoint-disk", FAIL, f"{directory}{note}: {free_gb:.1f} GB free, below {ctx.args.min_free_gb:g} GB",
                     "free space or lower the number of checkpoints kept")
    else:
        yield Result("checkpoint-disk", PASS, f"{directory}{note}: {free_gb:.1f} GB free "
                     f"(>= {ctx.args.min_free_gb:g} GB)")


def check_clock(ctx: Context) -> Iterable[Result]:
    synced, how = read_clock_sync()
    if synced is None:
        yield Result("clock", WARN, f"synchronisation unknown ({how})", "check chrony/ntpd by hand (chronyc tracking)")
    elif synced:
        yield Result("clock", PASS, f"synchronised ({how})")
    else:
        yield Result("clock", WARN, f"not synchronised ({how})",
                     "start chrony or ntpd: skewed clocks make logs, incidents and dashboards disagree across nodes")


def check_sidecar(ctx: Context) -> Iterable[Result]:
    """The node's own sidecar: without it the job runs unwatched (the hooks drop quietly)."""
    target = resolve_target(ctx.args.socket, ctx.args.url)
    try:
        status = fetch_json(target, "/v1/status")
    except StatusError as e:
        yield Result("sidecar", WARN, f"{e}: the job would run without metrics or the watchdog",
                     "start it (systemctl start sidecar / the DaemonSet), or point --socket/--url at it")
        return
    verdict = assess(status)
    if verdict.exit_code == EXIT_HEALTHY:
        yield Result("sidecar", PASS, f"sidecar {status.get('version', '?')} at {target} is healthy")
    else:
        yield Result("sidecar", WARN, f"sidecar at {target} is degraded: {'; '.join(verdict.problems)}",
                     "see `sidecar status`")


# ---------------------------------------------------------------- peers: version skew

# Fields whose difference across nodes breaks or endangers a job FAIL; the others WARN.
SKEW_FAILS = frozenset({"driver_version", "cuda_version", "torch_version", "nccl_version", "torch_cuda_version"})
# The same fact under its names in the sources: `/v1/status` node fields, the ranks'
# registered `versions` (`cuda` there is the CUDA torch was built for), and the labels of
# `sidecar_versions_info` on `/metrics`.
RANK_VERSION_FIELDS = {"torch": "torch_version", "nccl": "nccl_version", "cuda": "torch_cuda_version",
                       "python": "python_version"}


def node_versions(status: dict, metrics_text: str | None) -> dict[str, set[str]]:
    """The versions one sidecar knows, as {field: values}. Several jobs may give a field
    several values; a value absent from one source is not a difference."""
    out: dict[str, set[str]] = {}

    def add(name: str, value: Any) -> None:
        if value not in (None, ""):
            out.setdefault(name, set()).add(str(value))

    add("sidecar_version", status.get("version"))
    node = status.get("node") if isinstance(status.get("node"), dict) else {}
    for key in ("driver_version", "cuda_version", "kernel", "os"):
        add(key, node.get(key))
    for r in status.get("ranks") or []:
        if isinstance(r, dict) and isinstance(r.get("versions"), dict):
            for key, value in r["versions"].items():
                add(RANK_VERSION_FIELDS.get(key, f"{key}_version"), value)
    if metrics_text:
        from prometheus_client.parser import text_string_to_metric_families
        try:
            for family in text_string_to_metric_families(metrics_text):
                for sample in family.samples:
                    if sample.name == "sidecar_versions_info":
                        for key, value in sample.labels.items():
                            if key != "job_id":
                                add(key, value)
        except ValueError:
            pass  # an unparsable exposition leaves only the status fields
    return out


def compare_versions(nodes: dict[str, dict[str, set[str]]]) -> list[Result]:
    """One result per field whose values differ between nodes, naming field, values and nodes."""
    results = []
    fields = sorted({f for versions in nodes.values() for f in versions})
    for name in fields:
        by_value: dict[str, list[str]] = {}
        for node, versions in nodes.items():
            for value in sorted(versions.get(name, ())):
                by_value.setdefault(value, []).append(node)
        if len(by_value) > 1:
            text = "; ".join(f"{value} on {', '.join(who)}" for value, who in sorted(by_value.items()))
            results.append(Result("version-skew", FAIL if name in SKEW_FAILS else WARN, f"{name} differs: {text}",
                                  "align drivers, CUDA and torch on every node before starting"))
    return results


def _label(target: Target, status: dict) -> str:
    node = status.get("node") if isinstance(status.get("node"), dict) else {}
    host = node.get("hostname")
    return f"{host} ({target})" if host else str(target)


def check_peers(ctx: Context) -> Iterable[Result]:
    peers = [p.strip() for p in (ctx.args.peers or "").split(",") if p.strip()]
    if not peers:
        yield Result("version-skew", SKIP, "no --peers given")
        return
    targets = [Target.of_url(p) for p in peers]
    local = resolve_target(ctx.args.socket, ctx.args.url)
    nodes: dict[str, dict[str, set[str]]] = {}
    for target in [local, *targets]:
        try:
            status = fetch_json(target, "/v1/status")
        except StatusError as e:
            if target is local:
                continue  # this node's sidecar need not run yet; compare the peers
            yield Result("peers", FAIL, str(e), "is the peer's sidecar running and its port open to this node?")
            continue
        try:
            metrics = fetch(target, "/metrics").decode("utf-8", "replace")
        except StatusError:
            metrics = None
        nodes[_label(target, status)] = node_versions(status, metrics)
    if len(nodes) < 2:
        yield Result("version-skew", WARN, f"only {len(nodes)} sidecar(s) answered; nothing to compare",
                     "list reachable sidecars in --peers")
        return
    skew = compare_versions(nodes)
    yield from skew
    if not skew:
        yield Result("version-skew", PASS, f"{len(nodes)} nodes report the same versions "
                     f"({', '.join(sorted({f for v in nodes.values() for f in v}))})")


CHECKS: list[Callable[[Context], Iterable[Result]]] = [
    check_driver, check_gpu_count, check_gpu_health, check_xids, check_torch, check_nics, check_infiniband,
    check_rendezvous, check_shared_dir, check_checkpoint_disk, check_clock, check_sidecar, check_peers,
]


def run_checks(ctx: Context) -> Iterable[Result]:
    """Run every check in parallel (torch's import and network timeouts dominate); yield the
    results in the order of CHECKS as soon as each is done."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(CHECKS)) as pool:
        futures = [(check, pool.submit(lambda c=check: list(c(ctx)))) for check in CHECKS]
        for check, future in futures:
            try:
                yield from future.result()
            except Exception as e:  # a bug in one check must not hide the others
                yield Result(check.__name__.removeprefix("check_"), FAIL, f"the check crashed: {type(e).__name__}: {e}",
                             "please report this")


def exit_code(results: list[Result], strict: bool) -> int:
    worst = max((SEVERITY[r.outcome] for r in results), default=0)
    return 1 if worst == 2 or (strict and worst == 1) else 0


# ---------------------------------------------------------------- the command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("exit status: 0 nothing failed (warnings allowed), 1 a check failed (or warned, "
                     "with --strict), 2 bad arguments")
    parser.add_argument("--config", help="the sidecar's YAML settings (nvml_module, sysfs_root, checkpoint_dir, "
                        "nic_exclude are used; also SIDECAR_CONFIG)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    parser.add_argument("--expect-gpus", type=int, metavar="N", help="fail unless exactly N GPUs are visible")
    parser.add_argument("--python", default=sys.executable,
                        help="the training environment's interpreter, for torch/CUDA/NCCL versions (default: this one)")
    parser.add_argument("--torch-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="how long importing torch may take (default 120)")
    parser.add_argument("--kernel-log", metavar="FILE", help="read Xids from FILE instead of `dmesg`")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="the c10d rendezvous endpoint to reach")
    parser.add_argument("--shared-dir", metavar="DIR", help="shared storage that must be mounted and writable")
    parser.add_argument("--shared-marker", metavar="write:TOKEN|check:TOKEN",
                        help="write a marker file with TOKEN in --shared-dir (one node), or check it is there "
                             "(the others): proves every node sees the same storage")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="checkpoint directory (default: checkpoint_dir setting)")
    parser.add_argument("--min-free-gb", type=float, default=20.0, help="free space needed for checkpoints (default 20)")
    parser.add_argument("--peers", metavar="URL,URL",
                        help="other nodes' sidecars (http://host:9402); fail on driver/CUDA/torch/NCCL skew")
    parser.add_argument("--socket", help="this node's sidecar socket (also SIDECAR_SOCKET): checked, and "
                        "compared with --peers")
    parser.add_argument("--url", help="this node's sidecar URL (also SIDECAR_URL), instead of the socket")
    parser.add_argument("--strict", action="store_true", help="WARN fails too (exit 1)")
    parser.add_argument("--json", action="store_true", help="print {exit_code, results: [...]} as JSON")


def _printer(json_mode: bool):
    if json_mode:
        return lambda result: None
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.text import Text
        console = Console(highlight=False)

        def show(r: Result) -> None:
            line = Text.assemble((f"{r.outcome:<4}", STYLE[r.outcome]), f"  {r.check:<16} {r.detail}")
            if r.hint and r.outcome in (WARN, FAIL):
                line.append(f"\n{'':22}hint: {r.hint}", style="dim")
            console.print(line)
        return show

    def show_plain(r: Result) -> None:
        print(f"{r.outcome:<4}  {r.check:<16} {r.detail}", flush=True)
        if r.hint and r.outcome in (WARN, FAIL):
            print(f"{'':22}hint: {r.hint}", flush=True)
    return show_plain


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        print(f"sidecar preflight: {e}", file=sys.stderr)
        return 2
    show = _printer(args.json)
    results = []
    for result in run_checks(Context(args, settings)):
        results.append(result)
        show(result)
    code = exit_code(results, args.strict)
    if args.json:
        print(json.dumps({"exit_code": code, "results": [asdict(r) for r in results]}, indent=2))
    else:
        counts = {o: sum(r.outcome == o for r in results) for o in (PASS, WARN, FAIL, SKIP)}
        print(f"preflight: {', '.join(f'{n} {o.lower()}' for o, n in counts.items())}"
              f" -> exit {code}{' (strict)' if args.strict else ''}")
    return code
