"""What the kernel says about a rank's exit, read by the sidecar itself (never from a path a
rank names): its wait status through a pidfd, OOM kills counted by its memory cgroup, and
the kernel log's "Killed process" lines.

- Exit status. The sidecar is not the rank's parent (torchrun is), so `waitid` cannot be used.
  A pidfd opened at registration (while the process is verified by its start time) pins the
  process; once its parent reaps it, `PIDFD_GET_INFO` with `PIDFD_INFO_EXIT` (Linux 6.15) gives
  the wait status to whoever holds the pidfd. Older kernels: field 52 of /proc/<pid>/stat while
  the process is still an unreaped zombie; otherwise the status is unknown.
- OOM kills. The memory cgroup the kernel reports for the process (/proc/<pid>/cgroup, read at
  registration) is opened as a directory descriptor, component by component with O_NOFOLLOW
  under the cgroup mount (sidecar/host/cgroups.py), and kept: its `oom_kill` counter (cgroup v2 `memory.events`, v1
  `memory.oom_control`) is read then and again after the exit.
- The kernel log (/dev/kmsg, where readable): "Killed process <pid>" after the process started
  names the OOM killer's victim exactly.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import signal
import struct

from sidecar.host import cgroups, identity, procs
from sidecar.host.identity import PidFd

PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(0xFF, 11, struct pidfd_info) with the 64-byte first version
PIDFD_INFO_EXIT = 1 << 3
# mask, cgroupid, pid tgid ppid ruid rgid euid egid suid sgid fsuid fsgid, exit_code (64 bytes)
_PIDFD_INFO = struct.Struct("QQ11Ii")
MAX_KMSG_RECORDS = 100_000
_KILLED = re.compile(r"Killed process (\d+) ")


# ---------------------------------------------------------------- exit status


def open_pidfd(pid: int, start_time: float | None) -> PidFd | None:
    """A pidfd for the process `pid` started at `start_time`, or None (not running, another
    process by now, or no pidfd support). Checked after opening: the pidfd pins the process,
    so a matching start time then means it names the registered one."""
    if start_time is None or pid <= 1:
        return None
    try:
        pidfd = identity.open_pidfd(pid)
    except identity.IdentityError:
        return None
    if pidfd is None or not procs.is_same_process(pid, start_time):
        return None  # a PidFd closes its descriptor when dropped
    return pidfd


def pidfd_exit_status(fd: int) -> int | None:
    """The wait status of the exited, reaped process behind `fd`; None while it runs or is
    not reaped yet, or on a kernel without PIDFD_INFO_EXIT."""
    buf = bytearray(_PIDFD_INFO.size)
    struct.pack_into("Q", buf, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(fd, PIDFD_GET_INFO, buf)
    except OSError:
        return None
    fields = _PIDFD_INFO.unpack(buf)
    return fields[-1] if fields[0] & PIDFD_INFO_EXIT else None


def zombie_exit_status(pid: int, start_time: float | None, procfs: str = "/proc") -> int | None:
    """The wait status of an unreaped zombie (field 52 of /proc/<pid>/stat), or None."""
    try:
        with open(f"{procfs}/{int(pid)}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2 :].split()
        if fields[0] != b"Z" or int(fields[19]) / procs._CLOCK_TICKS != start_time:
            return None
        return int(fields[49])
    except (OSError, ValueError, IndexError):
        return None


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal_name(os.WTERMSIG(status))}" + (" (core dumped)" if os.WCOREDUMP(status) else "")
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return f"wait status {status:#x}"


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# ---------------------------------------------------------------- memory cgroup


class MemoryCgroup(cgroups.CgroupDir):
    """The open memory cgroup of a rank (sidecar/host/cgroups.py opened it)."""

    def oom_kills(self) -> int | None:
        text = self.read("memory.events" if self.version == 2 else "memory.oom_control")
        if text is None:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return None


def memory_cgroup_of(pid: int, start_time: float | None, procfs: str = "/proc") -> MemoryCgroup | None:
    """The memory cgroup the kernel reports for `pid`, opened, or None. Where cgroup v1's
    memory controller is mounted (as on hosts with the legacy layout) it holds the counter;
    otherwise the unified (v2) hierarchy. The process must be listed in the directory's
    cgroup.procs, and still be the registered process afterwards."""
    found = cgroups.cgroup_of(pid, "memory", procfs)
    if found is None:
        return None
    if not procs.is_same_process(pid, start_time):
        found.close()
        return None
    return MemoryCgroup(found.path, found.fd, found.version)


# ---------------------------------------------------------------- kernel log


def kmsg_oom_victims(pids: set[int], since: dict[int, float], path: str = "/dev/kmsg") -> dict[int, str]:
    """pid -> the kernel log line that says the OOM killer killed it, for each of `pids` with
    such a line after its start (`since`: seconds from boot, as procs.start_time). Empty when
    the log is not readable."""
    found: dict[int, str] = {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return found
    try:
        for _ in range(MAX_KMSG_RECORDS):
            try:
                record = os.read(fd, 8192)
            except OSError as e:
                if e.errno == errno.EPIPE:  # overwritten while we read: carry on with the next
                    continue
                break
            if not record:
                break
            head, _, message = record.decode(errors="replace").partition(";")
            m = _KILLED.search(message)
            if not m:
                continue
            pid = int(m.group(1))
            fields = head.split(",")
            if pid in pids and len(fields) > 2 and fields[2].isdigit() and int(fields[2]) / 1e6 >= since.get(pid, 0):
                found[pid] = message.strip().splitlines()[0][:300]
    finally:
        os.close(fd)
    return found
