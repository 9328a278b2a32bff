"""The sidecar's own alerts (self.rules.yml): failing collectors, version skew across a job's nodes,
an unfit node, an observe-only watchdog."""

# ruff: noqa: E501
# (declarative tables: PromQL expressions read, and are copied, whole)

from __future__ import annotations

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.promql import Alert, Group


def group(cfg: MixinConfig) -> Group:
    return Group(
        "sidecar-self",
        [
            Alert(
                "SidecarCollectorFailing",
                "sidecar_scrape_collector_success == 0",
                "warning",
                "Collector {{ $labels.collector }} failing on {{ $labels.instance }}",
                "The collector's last runs failed; its metrics are missing or partial. `sidecar status` shows the error.",
                for_="10m",
            ),
            Alert(
                "SidecarVersionSkew",
                "\nor ".join(
                    f"label_replace(count by (namespace, cluster, job_id) (count by (namespace, cluster, job_id, {c}_version) (sidecar_versions_info)) > 1,"
                    f' "component", "{c}", "", "")'
                    for c in ("driver", "cuda", "torch", "nccl")
                ),
                "warning",
                "{{ $labels.component }} versions differ across the nodes of job {{ $labels.job_id }}",
                "The nodes of this job run different {{ $labels.component }} versions: a classic cause of hangs "
                "and numerical drift.",
                for_="10m",
            ),
            Alert(
                "SidecarNodeUnfit",
                "max by (cluster, instance, reason) (sidecar_node_unfit_reason) == 1",
                "critical",
                "Node {{ $labels.instance }} cannot run a job ({{ $labels.reason }})",
                "Something on this node outlives its jobs ({{ $labels.reason }}: processes alive after SIGKILL, GPU "
                "memory held by processes of gone ranks, GPUs missing, or no usable NVML): a job or restart placed here "
                "would fail or hang. Drain the node (kubectl cordon/drain, or scontrol update state=drain) and see "
                "`sidecar status` on it.",
                for_="1m",
            ),
            Alert(
                "SidecarWatchdogObserveOnly",
                "sidecar_watchdog_observe_only == 1",
                "info",
                "Watchdog observe-only on {{ $labels.instance }}",
                "The watchdog on this node reports stalls but never remediates them.",
                for_="1h",
            ),
        ],
    )
