"""Why a rank process exited: the kernel's side of an exit (`kernel.py`: pidfd wait status,
memory-cgroup OOM kills, the kernel log), the reasons and the decision (`reasons.py`), the
tracker that watches every rank until its exit is decided (`tracker.py`), exit incidents and
the rollback hint.

May import `sidecar.ranks`, `sidecar.incidents`, `sidecar.collectors` (the XID catalogue),
`sidecar.host` and the shared top-level modules; never the watchdog or the daemon.
"""
