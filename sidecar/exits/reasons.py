"""Why did the rank die: every exit of a registered rank gets one reason from a bounded set,
decided from evidence the sidecar can trust, and is counted, shown and (unless clean) recorded
as an incident.

Reasons (`REASONS`; the `reason` label of `sidecar_rank_exits_total`):

    finished                       a clean exit: status 0, or deregistered as finished
    watchdog                       the sidecar's own remediation killed it
    oom_killed                     the kernel's OOM killer (SIGKILL + the kernel log naming
                                   the pid, or the memory cgroup's oom_kill counter rising)
    gpu_error                      it died within exits.gpu_error_window_seconds of a hardware
                                   XID (collectors/xid.py HARDWARE_XIDS: reset or reboot the GPU)
                                   on a GPU it was seen using
    gpu_app_fault                  the same with any other XID (13, 31, 43, ...): an application
                                   fault, which any GPU user's own kernel can cause; the job's bug,
                                   not the hardware's, so no alert drains the node for it
    exception/cuda_oom             its own report: torch.OutOfMemoryError
    exception/collective_timeout   a collective or store timed out (gloo, NCCL, c10d)
    exception/communication        another communication error (a peer closed the connection,
                                   an NCCL error or abort)
    exception/nonfinite            a NaN/Inf guard raised
    exception/other                any other exception
    signal                         killed by a signal neither we nor the OOM killer sent
    nonzero_exit                   a non-zero exit status without an exception report
    unknown                        no evidence at all (no report, status not readable)

Trust: the kernel's facts (wait status through a pidfd, cgroup counters and the kernel log, see
exit_evidence.py) and the sidecar's own actions outrank what a rank says. The exception report
arrives with the rank's deregistration over a verified connection, so a rank can only describe
its own exit, and nothing in it is ever opened or executed: it is classified by type names and
message text only, and kept, clipped, as evidence.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

from sidecar.collectors.xid import HARDWARE_XIDS
from sidecar.exits import kernel
from sidecar.ranks.protocol import ExitReport

EXCEPTION_KINDS = ("cuda_oom", "collective_timeout", "communication", "nonfinite", "other")
REASONS = (
    "finished",
    "watchdog",
    "oom_killed",
    "gpu_error",
    "gpu_app_fault",
    *(f"exception/{k}" for k in EXCEPTION_KINDS),
    "signal",
    "nonzero_exit",
    "unknown",
)
# Reasons that usually follow another rank's failure rather than cause one: within a job's
# exits decided together they come after the others (the incident names the first as the cause).
CONSEQUENCES = frozenset({"exception/communication", "signal", "nonzero_exit", "unknown"})

# --------------------------------------------------------------- exception classes

_CUDA_OOM_TYPES = {"torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError"}
_COMM_TYPES = {
    "torch.distributed.DistBackendError",
    "torch.distributed.DistNetworkError",
    "torch.distributed.DistStoreError",
    "torch.distributed.DistError",
}
_CUDA_OOM_TEXT = re.compile(r"CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED", re.I)
# What torch 2.13 raises: gloo "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting
# 3000ms for recv operation to complete" (a RuntimeError), NCCL's watchdog "Watchdog caught
# collective operation timeout: WorkNCCL(...) ran for ... milliseconds before timing out", the
# c10d store's DistStoreError "wait timeout after ...", monitored barriers.
_COLLECTIVE_TIMEOUT_TEXT = re.compile(
    r"Timed out waiting \d+ms for (recv|send) operation|collective operation "
    r"timeout|timed out in monitoredBarrier",
    re.I,
)
_TIMEOUT_TEXT = re.compile(r"timed? ?out|timeout", re.I)
_COMM_TEXT = re.compile(
    r"Connection (closed|reset) by peer|NCCL (error|communicator)|ncclSystemError|"
    r"ncclInternalError|ncclRemoteError|ncclUnhandledCudaError|ProcessGroupNCCL|"
    r"ProcessGroupGloo|communicator was aborted|gloo/transport|c10d",
    re.I,
)
_NONFINITE_TEXT = re.compile(r"non-?finite|\b(nan|inf)\b|returned nan values", re.I)


def exception_kind(report: ExitReport) -> str:
    """One of EXCEPTION_KINDS from the report's type names and the first line of its message."""
    types = set(report.types) | {report.type}
    text = report.message
    if types & _CUDA_OOM_TYPES or _CUDA_OOM_TEXT.search(text):
        return "cuda_oom"
    comm = bool(types & _COMM_TYPES) or bool(_COMM_TEXT.search(text))
    if _COLLECTIVE_TIMEOUT_TEXT.search(text) or (comm and _TIMEOUT_TEXT.search(text)):
        return "collective_timeout"
    if comm:
        return "communication"
    if any("nonfinite" in t.lower().replace("_", "") for t in types) or _NONFINITE_TEXT.search(text):
        return "nonfinite"
    return "other"


# --------------------------------------------------------------- evidence and decision


@dataclass
class Evidence:
    """Everything known about one exit when it is decided."""

    deregistered: str | None = None  # the reason the rank gave when it deregistered
    report: ExitReport | None = None  # its exception, from its hooks
    status: int | None = None  # wait status, from the kernel
    status_source: str | None = None  # "pidfd" | "zombie"
    remediated_by: str | None = None  # the watchdog incident whose remediation signalled it
    oom_cgroup: str | None = None  # "oom_kill 0 -> 1 in /sys/fs/cgroup/memory/..." when it rose
    oom_kernel_log: str | None = None  # the kernel's "Killed process <pid>" line
    xid: tuple[str, int, float] | None = None  # (gpu, xid, unix time) on a GPU the rank used
    xid_unused_gpu: tuple[str, int, float] | None = None  # an XID in the window on another GPU
    thread_exception: str | None = None  # "Type: message" of the latest thread that died of one


def decide(ev: Evidence) -> tuple[str, list[str]]:
    """(reason, evidence lines for people)."""
    lines = []
    status = ev.status
    if status is not None:
        lines.append(f"kernel ({ev.status_source}): {kernel.describe_status(status)}")
    if ev.deregistered:
        lines.append(f"the rank deregistered ({ev.deregistered})")
    if ev.report is not None:
        lines.append(
            f"the rank's hooks reported {ev.report.type}: {ev.report.message}"
            + (f" (thread {ev.report.thread})" if ev.report.thread else "")
        )
    if ev.thread_exception:
        lines.append(f"a thread of the rank died earlier of {ev.thread_exception}")
    if ev.oom_kernel_log:
        lines.append(f"kernel log: {ev.oom_kernel_log}")
    if ev.oom_cgroup:
        lines.append(f"memory cgroup: {ev.oom_cgroup}")
    for xid in (ev.xid, ev.xid_unused_gpu):
        if xid is not None:
            used = "it used" if xid is ev.xid else "it was not seen using"
            lines.append(
                f"XID {xid[1]} on gpu {xid[0]} ({used}) at {time.strftime('%H:%M:%S', time.gmtime(xid[2]))} UTC"
            )
    signalled = killed = False
    if status is not None and os.WIFSIGNALED(status):
        signalled, killed = True, os.WTERMSIG(status) == signal.SIGKILL
    if ev.remediated_by:
        lines.insert(0, f"the sidecar's remediation (incident {ev.remediated_by}) signalled it")
        return "watchdog", lines
    if status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "finished", lines
    if status is None and ev.deregistered in ("finished", "exit") and ev.report is None:
        return "finished", lines  # no status to say otherwise; "exit": its interpreter shut down
    if (killed or status is None) and ev.oom_kernel_log:
        return "oom_killed", lines
    if killed and ev.oom_cgroup:
        return "oom_killed", lines
    if ev.xid is not None:
        return ("gpu_error" if ev.xid[1] in HARDWARE_XIDS else "gpu_app_fault"), lines
    if ev.report is not None:
        return f"exception/{exception_kind(ev.report)}", lines
    if signalled:
        return "signal", lines
    if status is not None:
        return "nonzero_exit", lines
    lines.append("no exit status (kernel without PIDFD_INFO_EXIT, or another pid namespace) and no report")
    return "unknown", lines
