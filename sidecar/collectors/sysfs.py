"""Readers of the kernel's network files under sysfs, returning typed records. Each field names
the file it comes from; a file that is absent (or that the kernel refuses to read, as `speed`
on a link that is down) is None. Exporting these records is nic.py's job."""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class NetDevice:
    """/sys/class/net/<device>/"""

    device: str
    operstate: str | None = None  # operstate: "up", "down", "unknown", ...
    speed_mbps: int | None = None  # speed, Mb/s; -1 (unknown) is None
    carrier_changes: int | None = None  # carrier_changes
    rx_bytes: int | None = None  # statistics/rx_bytes
    tx_bytes: int | None = None  # statistics/tx_bytes
    rx_packets: int | None = None  # statistics/rx_packets
    tx_packets: int | None = None  # statistics/tx_packets
    rx_errors: int | None = None  # statistics/rx_errors
    tx_errors: int | None = None  # statistics/tx_errors
    rx_dropped: int | None = None  # statistics/rx_dropped
    tx_dropped: int | None = None  # statistics/tx_dropped
    problems: list[str] = field(default_factory=list)  # files that exist but could not be read


@dataclass
class InfinibandPort:
    """/sys/class/infiniband/<device>/ports/<port>/"""

    device: str
    port: str
    state_id: int | None = None  # state: "4: ACTIVE"
    state: str | None = None
    physical_state_id: int | None = None  # phys_state: "5: LinkUp"
    physical_state: str | None = None
    rate_bytes_per_second: float | None = None  # rate: "200 Gb/sec (4X HDR)"
    link_layer: str | None = None  # link_layer: "InfiniBand" or "Ethernet" (RoCE)
    rcv_data_bytes: int | None = None  # counters/port_rcv_data (4-byte words)
    xmit_data_bytes: int | None = None  # counters/port_xmit_data (4-byte words)
    link_downed: int | None = None  # counters/link_downed
    symbol_error: int | None = None  # counters/symbol_error
    rcv_errors: int | None = None  # counters/port_rcv_errors
    xmit_wait: int | None = None  # counters/port_xmit_wait
    problems: list[str] = field(default_factory=list)


_STATISTICS = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped")
_IB_COUNTERS = (
    ("rcv_data_bytes", "port_rcv_data", 4),
    ("xmit_data_bytes", "port_xmit_data", 4),
    ("link_downed", "link_downed", 1),
    ("symbol_error", "symbol_error", 1),
    ("rcv_errors", "port_rcv_errors", 1),
    ("xmit_wait", "port_xmit_wait", 1),
)
_RATE = re.compile(r"^\s*([0-9.]+)\s*([GM])b/sec")


def _read(path: Path, problems: list[str]) -> str | None:
    """A file's stripped text; None when absent or refused (EINVAL: no value in this state)."""
    try:
        with open(path, "rb") as f:  # binary: no text-layer setup for a few bytes, 60+ files a round
            return f.read().decode(errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENODEV, errno.ENOTSUP):
            problems.append(f"{path}: {e.strerror}")
        return None


def _read_int(path: Path, problems: list[str]) -> int | None:
    text = _read(path, problems)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        problems.append(f"{path}: not an integer: {text[:40]!r}")
        return None


def _numbered(text: str | None) -> tuple[int | None, str | None]:
    """ "4: ACTIVE" -> (4, "ACTIVE")."""
    if not text:
        return None, None
    number, _, name = text.partition(":")
    try:
        return int(number), name.strip() or None
    except ValueError:
        return None, text


def parse_rate(text: str | None) -> float | None:
    """ "200 Gb/sec (4X HDR)" -> 25e9 bytes per second."""
    m = _RATE.match(text or "")
    if not m:
        return None
    bits = float(m.group(1)) * (1e9 if m.group(2) == "G" else 1e6)
    return bits / 8


def list_net_devices(sysfs_root: str | Path) -> list[str]:
    try:
        return sorted(p.name for p in (Path(sysfs_root) / "class" / "net").iterdir())
    except OSError:
        return []


def read_net_device(sysfs_root: str | Path, device: str) -> NetDevice:
    base = Path(sysfs_root) / "class" / "net" / device
    d = NetDevice(device)
    d.operstate = _read(base / "operstate", d.problems)
    speed = _read_int(base / "speed", d.problems)
    d.speed_mbps = speed if speed is not None and speed >= 0 else None
    d.carrier_changes = _read_int(base / "carrier_changes", d.problems)
    for name in _STATISTICS:
        setattr(d, name, _read_int(base / "statistics" / name, d.problems))
    return d


def list_infiniband_ports(sysfs_root: str | Path) -> list[tuple[str, str]]:
    root = Path(sysfs_root) / "class" / "infiniband"
    out: list[tuple[str, str]] = []
    try:
        devices = sorted(p.name for p in root.iterdir())
    except OSError:
        return []
    for device in devices:
        try:
            ports = sorted((p.name for p in (root / device / "ports").iterdir()), key=lambda s: (len(s), s))
        except OSError:
            continue
        out.extend((device, port) for port in ports)
    return out


def read_infiniband_port(sysfs_root: str | Path, device: str, port: str) -> InfinibandPort:
    base = Path(sysfs_root) / "class" / "infiniband" / device / "ports" / port
    p = InfinibandPort(device, port)
    p.state_id, p.state = _numbered(_read(base / "state", p.problems))
    p.physical_state_id, p.physical_state = _numbered(_read(base / "phys_state", p.problems))
    p.rate_bytes_per_second = parse_rate(_read(base / "rate", p.problems))
    p.link_layer = _read(base / "link_layer", p.problems)
    for attr, name, scale in _IB_COUNTERS:
        value = _read_int(base / "counters" / name, p.problems)
        setattr(p, attr, None if value is None else value * scale)
    return p
