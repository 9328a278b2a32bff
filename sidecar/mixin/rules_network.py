"""The network alerts (network.rules.yml): InfiniBand ports down or in error."""

# ruff: noqa: E501
# (declarative tables: PromQL expressions read, and are copied, whole)

from __future__ import annotations

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.promql import Alert, Group


def group(cfg: MixinConfig) -> Group:
    T = cfg.thresholds
    return Group(
        "sidecar-network",
        [
            Alert(
                "SidecarInfinibandPortDown",
                "sidecar_infiniband_port_up == 0\n"
                "unless on (cluster, instance, device, port) sidecar_infiniband_port_physical_state_id == 3",
                "critical",
                "InfiniBand {{ $labels.device }} port {{ $labels.port }} down on {{ $labels.instance }}",
                "The port is not ACTIVE and was not disabled on purpose (physical state 3, Disabled, is ignored).",
                for_="2m",
            ),
            Alert(
                "SidecarInfinibandPortErrors",
                "sum by (cluster, instance, device, port) (\n"
                "  increase(sidecar_infiniband_symbol_error_total[10m])\n"
                "  + increase(sidecar_infiniband_port_receive_errors_total[10m])\n"
                f") > {T['ib_errors_per_10m']}\n"
                "or sum by (cluster, instance, device, port) (increase(sidecar_infiniband_link_downed_total[10m])) > 0",
                "warning",
                "InfiniBand {{ $labels.device }} port {{ $labels.port }} errors on {{ $labels.instance }}",
                "The port counts symbol or receive errors, or its link went down and came back (flapping).",
            ),
        ],
    )
