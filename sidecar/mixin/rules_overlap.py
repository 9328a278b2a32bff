"""The alerts that kube-prometheus-stack's own rules repeat (overlap.rules.yml)."""

# ruff: noqa: E501
# (declarative tables: PromQL expressions read, and are copied, whole)

from __future__ import annotations

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.promql import Alert, Group


def group(cfg: MixinConfig) -> Group:
    """Alerts that kube-prometheus-stack's own rules repeat: node_exporter's NodeNetworkReceiveErrs and
    NodeNetworkTransmitErrs (SidecarNicErrors), NodeFilesystemSpaceFillingUp and
    NodeFilesystemAlmostOutOfSpace (the checkpoint disk, a filesystem of the node), and TargetDown
    (SidecarDown). A file of their own (overlap.rules.yml, the PrometheusRule `sidecar-overlap`), so that
    the kube-prometheus-stack overlays leave them out and a Prometheus without those rules (bare
    metal, the Kubernetes base) keeps them (docs/operator-guide.md#alerts-kube-prometheus-stack-already-has)."""
    T, selectors = cfg.thresholds, cfg.selectors
    return Group(
        "sidecar-overlap",
        [
            Alert(
                "SidecarDown",
                f"up{{{selectors['sidecar_targets']}}} == 0",
                "warning",
                "Sidecar on {{ $labels.instance }} is down",
                "Prometheus cannot scrape the sidecar: this node has no metrics and no stall watchdog.",
                for_="3m",
            ),
            Alert(
                "SidecarNicErrors",
                "sum by (cluster, instance, device) (\n"
                "  rate(sidecar_network_receive_errs_total[5m]) + rate(sidecar_network_transmit_errs_total[5m])\n"
                f") > {T['nic_errors_per_second']}\n"
                "or sum by (cluster, instance, device) (increase(sidecar_network_carrier_changes_total[15m]))"
                f" > {T['nic_carrier_changes_per_15m']}",
                "warning",
                "NIC {{ $labels.device }} errors on {{ $labels.instance }}",
                "The interface counts receive/transmit errors, or its carrier keeps flapping.",
                for_="5m",
            ),
            Alert(
                "SidecarCheckpointDiskFillingUp",
                f"predict_linear(sidecar_checkpoint_filesystem_avail_bytes[6h], {T['disk_predict_hours']} * 3600) < 0\n"
                f"and sidecar_checkpoint_filesystem_avail_bytes / sidecar_checkpoint_filesystem_size_bytes < {T['disk_filling_free_ratio']}",
                "warning",
                "Checkpoint disk on {{ $labels.instance }} fills up",
                f"At the current rate the checkpoint filesystem on {{{{ $labels.instance }}}} runs out of space within "
                f"{T['disk_predict_hours']} hours.",
                for_="30m",
            ),
            Alert(
                "SidecarCheckpointDiskAlmostFull",
                "sidecar_checkpoint_filesystem_avail_bytes / sidecar_checkpoint_filesystem_size_bytes"
                f" < {T['disk_almost_full_free_ratio']}",
                "critical",
                "Checkpoint disk on {{ $labels.instance }} almost full",
                f"Less than {int(float(T['disk_almost_full_free_ratio']) * 100)}% of the checkpoint filesystem on "
                "{{ $labels.instance }} is free: the next checkpoint save may fail.",
                for_="5m",
            ),
        ],
    )
