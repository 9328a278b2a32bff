"""The GPU checks of `sidecar preflight`: the NVIDIA driver, the GPUs' count and health, the
kernel log's Xids, and the training environment's torch against the driver."""

from __future__ import annotations

import re
from collections.abc import Iterable

from sidecar.collectors.nvml import GpuReading
from sidecar.collectors.xid import HARDWARE_XIDS
from sidecar.preflight.facts import parse_xids, read_kernel_log, read_pci_gpus, read_torch
from sidecar.preflight.results import FAIL, PASS, SKIP, WARN, Context, Result


def check_driver(ctx: Context) -> Iterable[Result]:
    """NVML usable; without NVML, a FAIL where the PCI bus has NVIDIA GPUs (a broken or missing
    driver), a WARN on a node without any (a CPU node)."""
    nv = ctx.nvml()
    if nv.absent:
        root = ctx.settings.collectors.sysfs_root
        on_bus = read_pci_gpus(root)
        if on_bus:
            shown = ", ".join(on_bus[:4]) + (f" and {len(on_bus) - 4} more" if len(on_bus) > 4 else "")
            yield Result(
                "nvidia-driver",
                FAIL,
                f"{len(on_bus)} NVIDIA GPUs on the PCI bus ({shown}, {root}/bus/pci) but "
                f"{nv.error or 'no NVIDIA driver'}",
                "the driver is not loaded or does not match its library: `nvidia-smi`, `lsmod | grep nvidia`, "
                "dmesg (NVRM); in a container set runtimeClassName nvidia / NVIDIA_VISIBLE_DEVICES=all",
            )
            return
        yield Result(
            "nvidia-driver",
            WARN,
            nv.error or "no NVIDIA driver",
            f"and no NVIDIA GPU on the PCI bus ({root}/bus/pci): expected on a CPU node",
        )
        return
    if nv.error:
        yield Result(
            "nvidia-driver",
            FAIL,
            nv.error,
            "the driver is loaded but NVML fails: check `nvidia-smi` and dmesg for Xids; reboot the node",
        )
        return
    yield Result("nvidia-driver", PASS, f"driver {nv.driver_version}, CUDA {nv.cuda_version or '?'}")


def check_gpu_count(ctx: Context) -> Iterable[Result]:
    """Against --expect-gpus, else the sidecar's collectors.expected_gpus when set."""
    nv, expected = ctx.nvml(), ctx.args.expect_gpus
    if expected is None and ctx.settings.collectors.expected_gpus:
        expected = ctx.settings.collectors.expected_gpus
    if nv.error:
        if expected:
            yield Result("gpu-count", FAIL, f"expected {expected} GPUs, NVML unusable", "see nvidia-driver")
        else:
            yield Result("gpu-count", SKIP, "NVML unusable (see nvidia-driver)")
        return
    found = len(nv.gpus) + len(nv.lost)
    if expected is not None and found != expected:
        yield Result(
            "gpu-count",
            FAIL,
            f"{found} GPUs visible, expected {expected}",
            "a GPU missing from NVML has usually fallen off the bus (see Xid 79): drain the node",
        )
    elif found == 0:
        yield Result(
            "gpu-count",
            WARN,
            "the driver is loaded but no GPU is visible",
            "check CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES and `nvidia-smi`",
        )
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
        yield Result(
            "gpu-health", FAIL, f"GPU {index} cannot be read: {why}", "drain the node; reset or replace the GPU"
        )
    for g in nv.gpus:
        where = f"GPU {g.gpu} ({g.pci_bus_id or '?'})"
        _, _, remap_pending, remap_failed = g.remapped_rows or (0, 0, 0, 0)
        if g.retired_pages_pending or remap_pending:
            bad = True
            yield Result(
                "gpu-health",
                FAIL,
                f"{where}: memory {'row remap' if remap_pending else 'page retirement'} pending",
                "reset the GPU (or reboot) so the retirement/remap takes effect",
            )
        if remap_failed:
            bad = True
            yield Result("gpu-health", FAIL, f"{where}: row remapping failed", "replace the GPU")
        if g.ecc_uncorrected:
            bad = True
            yield Result(
                "gpu-health",
                WARN,
                f"{where}: {g.ecc_uncorrected} uncorrected ECC errors over its life",
                "fine if its pages were retired/rows remapped; a rising count means replace it",
            )
        unchecked = _unchecked_health(g)
        if unchecked:
            yield Result(
                "gpu-health",
                WARN,
                f"{where}: could not check {'; '.join(unchecked)}",
                "NVML did not give these; on a MIG GPU check them with MIG off (`nvidia-smi -q -d ROW_REMAPPER,ECC`)",
            )
        else:
            checked += 1
    if not bad and checked:
        yield Result("gpu-health", PASS, f"{checked} GPUs: no uncorrected ECC errors, no pending retirements or remaps")


def check_xids(ctx: Context) -> Iterable[Result]:
    log, error = read_kernel_log(ctx.args.kernel_log)
    if log is None:
        yield Result(
            "xid",
            WARN,
            f"kernel log not readable ({error})",
            "run as root (or with CAP_SYSLOG), or pass --kernel-log FILE; "
            "the sidecar's sidecar_gpu_xid_errors_total counts Xids from its start",
        )
        return
    counts = parse_xids(log)
    if not counts:
        yield Result("xid", PASS, "no NVIDIA Xid errors in the kernel log since boot")
        return
    text = ", ".join(
        f"Xid {xid} on {bus} x{n}" + (f" ({HARDWARE_XIDS[xid]})" if xid in HARDWARE_XIDS else "")
        for (bus, xid), n in sorted(counts.items())
    )
    if any(xid in HARDWARE_XIDS for _, xid in counts):
        yield Result("xid", FAIL, text, "hardware Xids: drain the node, reset the GPU, replace it if they return")
    else:
        yield Result(
            "xid",
            WARN,
            text,
            "application Xids (13, 31, 43: faulting kernels) are mostly bugs of a "
            "previous job; check they are not recurring",
        )


def check_torch(ctx: Context) -> Iterable[Result]:
    if ctx.args.skip_torch:
        yield Result("torch", SKIP, "not checked (--skip-torch): importing torch takes seconds")
        return
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
        yield Result(
            "torch-cuda",
            FAIL,
            f"torch is built for CUDA {t.cuda}, the driver supports up to {nv.cuda_version}",
            "upgrade the driver, or install a torch built for an older CUDA",
        )
    elif not t.cuda_available:
        yield Result(
            "torch-cuda",
            FAIL,
            "torch cannot use the GPUs (torch.cuda.is_available() is False)",
            "check the device files and CUDA_VISIBLE_DEVICES in the training environment",
        )
    elif nv.cuda_version and _version_tuple(t.cuda) > _version_tuple(nv.cuda_version):
        # Same major version: runs through CUDA minor version compatibility, minus PTX JIT.
        yield Result(
            "torch-cuda",
            WARN,
            f"torch is built for CUDA {t.cuda}, newer than the driver's {nv.cuda_version}",
            "works through minor version compatibility except for kernels "
            "JIT-compiled from PTX (Triton, torch.compile); upgrade the driver to be safe",
        )
    elif not t.nccl:
        yield Result("torch-cuda", WARN, "torch has no NCCL", "multi-GPU training will fall back to gloo")
    else:
        yield Result("torch-cuda", PASS, f"torch sees {t.device_count} GPUs, NCCL {t.nccl}")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])
