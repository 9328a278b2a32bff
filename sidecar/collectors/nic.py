"""Network metrics: Ethernet interfaces (with node_exporter's meaning, so existing node rules
carry over) and InfiniBand / RoCE ports, from sysfs. A node without InfiniBand has no
`sidecar_infiniband_*` series; that is not a failure."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from prometheus_client.core import Metric

from sidecar.collectors import sysfs
from sidecar.collectors.base import BuildContext, PartialFailure
from sidecar.metric import spec

NAME = "nic"
DEVICE_LABELS = ("device",)
PORT_LABELS = ("device", "port")

RECEIVE_BYTES = spec(NAME, "network_receive_bytes", "counter", "Bytes received (statistics/rx_bytes).", DEVICE_LABELS)
TRANSMIT_BYTES = spec(NAME, "network_transmit_bytes", "counter", "Bytes sent (statistics/tx_bytes).", DEVICE_LABELS)
RECEIVE_PACKETS = spec(NAME, "network_receive_packets", "counter", "Packets received.", DEVICE_LABELS)
TRANSMIT_PACKETS = spec(NAME, "network_transmit_packets", "counter", "Packets sent.", DEVICE_LABELS)
RECEIVE_ERRS = spec(NAME, "network_receive_errs", "counter", "Receive errors.", DEVICE_LABELS)
TRANSMIT_ERRS = spec(NAME, "network_transmit_errs", "counter", "Transmit errors.", DEVICE_LABELS)
RECEIVE_DROP = spec(NAME, "network_receive_drop", "counter", "Received packets dropped.", DEVICE_LABELS)
TRANSMIT_DROP = spec(NAME, "network_transmit_drop", "counter", "Packets dropped on send.", DEVICE_LABELS)
UP = spec(NAME, "network_up", "gauge", "1 when the interface's operstate is up.", DEVICE_LABELS)
SPEED = spec(
    NAME, "network_speed_bytes", "gauge", "Link speed in bytes per second (absent when unknown).", DEVICE_LABELS
)
CARRIER_CHANGES = spec(NAME, "network_carrier_changes", "counter", "Times the link went up or down.", DEVICE_LABELS)

IB_STATE = spec(
    NAME,
    "infiniband_port_state_id",
    "gauge",
    "Logical port state (1 down, 2 init, 3 armed, 4 active, 5 active_defer).",
    PORT_LABELS,
)
IB_PHYSICAL_STATE = spec(
    NAME,
    "infiniband_port_physical_state_id",
    "gauge",
    "Physical port state (2 polling, 3 disabled, 5 link_up, 7 phy_test ...).",
    PORT_LABELS,
)
IB_UP = spec(NAME, "infiniband_port_up", "gauge", "1 when the port is ACTIVE and its link is up.", PORT_LABELS)
IB_RATE = spec(NAME, "infiniband_rate_bytes_per_second", "gauge", "Port link rate.", PORT_LABELS)
IB_RECEIVED = spec(NAME, "infiniband_port_data_received_bytes", "counter", "Data received by the port.", PORT_LABELS)
IB_TRANSMITTED = spec(NAME, "infiniband_port_data_transmitted_bytes", "counter", "Data sent by the port.", PORT_LABELS)
IB_LINK_DOWNED = spec(NAME, "infiniband_link_downed", "counter", "Times the link went down after errors.", PORT_LABELS)
IB_SYMBOL_ERROR = spec(NAME, "infiniband_symbol_error", "counter", "Minor link errors on a physical lane.", PORT_LABELS)
IB_RECEIVE_ERRORS = spec(
    NAME, "infiniband_port_receive_errors", "counter", "Packets received with errors.", PORT_LABELS
)
IB_TRANSMIT_WAIT = spec(
    NAME,
    "infiniband_port_transmit_wait",
    "counter",
    "Ticks the port had data to send but no credits (congestion).",
    PORT_LABELS,
)
IB_INFO = spec(
    NAME,
    "infiniband_port",
    "info",
    "InfiniBand port facts; value 1.",
    ["device", "port", "link_layer", "state", "physical_state"],
)

METRICS = (
    RECEIVE_BYTES,
    TRANSMIT_BYTES,
    RECEIVE_PACKETS,
    TRANSMIT_PACKETS,
    RECEIVE_ERRS,
    TRANSMIT_ERRS,
    RECEIVE_DROP,
    TRANSMIT_DROP,
    UP,
    SPEED,
    CARRIER_CHANGES,
    IB_INFO,
    IB_STATE,
    IB_PHYSICAL_STATE,
    IB_UP,
    IB_RATE,
    IB_RECEIVED,
    IB_TRANSMITTED,
    IB_LINK_DOWNED,
    IB_SYMBOL_ERROR,
    IB_RECEIVE_ERRORS,
    IB_TRANSMIT_WAIT,
)

_NET_FIELDS = (
    (RECEIVE_BYTES, "rx_bytes"),
    (TRANSMIT_BYTES, "tx_bytes"),
    (RECEIVE_PACKETS, "rx_packets"),
    (TRANSMIT_PACKETS, "tx_packets"),
    (RECEIVE_ERRS, "rx_errors"),
    (TRANSMIT_ERRS, "tx_errors"),
    (RECEIVE_DROP, "rx_dropped"),
    (TRANSMIT_DROP, "tx_dropped"),
    (CARRIER_CHANGES, "carrier_changes"),
)
_IB_FIELDS = (
    (IB_STATE, "state_id"),
    (IB_PHYSICAL_STATE, "physical_state_id"),
    (IB_RATE, "rate_bytes_per_second"),
    (IB_RECEIVED, "rcv_data_bytes"),
    (IB_TRANSMITTED, "xmit_data_bytes"),
    (IB_LINK_DOWNED, "link_downed"),
    (IB_SYMBOL_ERROR, "symbol_error"),
    (IB_RECEIVE_ERRORS, "rcv_errors"),
    (IB_TRANSMIT_WAIT, "xmit_wait"),
)

IB_ACTIVE, IB_LINK_UP = 4, 5


class NicCollector:
    name = NAME
    metrics = METRICS

    def __init__(self, sysfs_root: str | Path = "/sys", exclude: str = "", max_nics: int = 64):
        self.sysfs_root = sysfs_root
        self.exclude = re.compile(exclude) if exclude else None
        self.max_nics = max_nics

    def devices(self) -> list[str]:
        names = [d for d in sysfs.list_net_devices(self.sysfs_root) if not (self.exclude and self.exclude.search(d))]
        return names[: self.max_nics]

    def collect(self) -> Iterable[Metric]:
        nics = [sysfs.read_net_device(self.sysfs_root, d) for d in self.devices()]
        ports = [
            sysfs.read_infiniband_port(self.sysfs_root, d, p)
            for d, p in sysfs.list_infiniband_ports(self.sysfs_root)[: self.max_nics]
        ]
        families = [f for f in (*self._net_families(nics), *self._ib_families(ports)) if f.samples]
        problems = [msg for nic in nics for msg in nic.problems] + [msg for port in ports for msg in port.problems]
        if problems:
            raise PartialFailure("; ".join(problems[:5]), families)
        return families

    @staticmethod
    def _net_families(nics: list[sysfs.NetDevice]) -> list[Metric]:
        fields = [(s.family(), attr) for s, attr in _NET_FIELDS]
        up, speed = UP.family(), SPEED.family()
        for nic in nics:
            for family, attr in fields:
                value = getattr(nic, attr)
                if value is not None:
                    family.add_metric([nic.device], value)
            if nic.operstate is not None:
                up.add_metric([nic.device], 1.0 if nic.operstate == "up" else 0.0)
            if nic.speed_mbps is not None:
                speed.add_metric([nic.device], nic.speed_mbps * 1e6 / 8)
        return [*(f for f, _ in fields), up, speed]

    @staticmethod
    def _ib_families(ports: list[sysfs.InfinibandPort]) -> list[Metric]:
        info, up = IB_INFO.family(), IB_UP.family()
        fields = [(s.family(), attr) for s, attr in _IB_FIELDS]
        for port in ports:
            labels = [port.device, port.port]
            info.add_metric(
                labels + [port.link_layer or "", (port.state or "").lower(), (port.physical_state or "").lower()], {}
            )
            for family, attr in fields:
                value = getattr(port, attr)
                if value is not None:
                    family.add_metric(labels, value)
            if port.state_id is not None:
                up.add_metric(
                    labels, 1.0 if port.state_id == IB_ACTIVE and port.physical_state_id in (IB_LINK_UP, None) else 0.0
                )
        return [info, up, *(f for f, _ in fields)]


def link_facts(collector: NicCollector) -> dict[str, list[dict]]:
    """What a stuck collective's incident attaches of this node's links (sidecar/watchdog): each
    NIC's state, carrier changes, errors and drops, each InfiniBand/RoCE port's state, link-downed,
    symbol and receive errors and transmit waits, as read now (counters since boot)."""
    nics = [sysfs.read_net_device(collector.sysfs_root, d) for d in collector.devices()]
    ports = [
        sysfs.read_infiniband_port(collector.sysfs_root, d, p)
        for d, p in sysfs.list_infiniband_ports(collector.sysfs_root)[: collector.max_nics]
    ]
    keep = ("operstate", "carrier_changes", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped")
    ib_keep = ("state", "physical_state", "link_downed", "symbol_error", "rcv_errors", "xmit_wait")
    return {
        "nics": [{"device": n.device, **{k: getattr(n, k) for k in keep}} for n in nics],
        "ib_ports": [{"device": p.device, "port": p.port, **{k: getattr(p, k) for k in ib_keep}} for p in ports],
    }


def build(context: BuildContext) -> NicCollector:
    cfg = context.settings.collectors
    return NicCollector(cfg.sysfs_root, cfg.nic_exclude, cfg.max_nics)
