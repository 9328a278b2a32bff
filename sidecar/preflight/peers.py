"""`sidecar preflight --peers`: the versions this node's and the peers' sidecars report
(drivers, CUDA, torch, NCCL, ...), compared; a difference that breaks a job FAILs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sidecar.commands.client import Endpoint, StatusError, fetch, fetch_json, resolve_endpoint
from sidecar.preflight.results import FAIL, PASS, SKIP, WARN, Context, Result

# Fields whose difference across nodes breaks or endangers a job FAIL; the others WARN.
SKEW_FAILS = frozenset({"driver_version", "cuda_version", "torch_version", "nccl_version", "torch_cuda_version"})
# The same fact under its names in the sources: `/v1/status` node fields, the ranks'
# registered `versions` (`cuda` there is the CUDA torch was built for), and the labels of
# `sidecar_versions_info` on `/metrics`.
RANK_VERSION_FIELDS = {
    "torch": "torch_version",
    "nccl": "nccl_version",
    "cuda": "torch_cuda_version",
    "python": "python_version",
}


def node_versions(status: dict, metrics_text: str | None) -> dict[str, set[str]]:
    """The versions one sidecar knows, as {field: values}. Several jobs may give a field
    several values; a value absent from one source is not a difference."""
    out: dict[str, set[str]] = {}

    def add(name: str, value: Any) -> None:
        if value not in (None, ""):
            out.setdefault(name, set()).add(str(value))

    add("sidecar_version", status.get("version"))
    node = status.get("node")
    node = node if isinstance(node, dict) else {}
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
            results.append(
                Result(
                    "version-skew",
                    FAIL if name in SKEW_FAILS else WARN,
                    f"{name} differs: {text}",
                    "align drivers, CUDA and torch on every node before starting",
                )
            )
    return results


def _label(endpoint: Endpoint, status: dict) -> str:
    node = status.get("node")
    node = node if isinstance(node, dict) else {}
    host = node.get("hostname")
    return f"{host} ({endpoint})" if host else str(endpoint)


def check_peers(ctx: Context) -> Iterable[Result]:
    peers = [p.strip() for p in (ctx.args.peers or "").split(",") if p.strip()]
    if not peers:
        yield Result("version-skew", SKIP, "no --peers given")
        return
    endpoints = [Endpoint.of_url(p) for p in peers]
    local = resolve_endpoint(ctx.args.socket, ctx.args.url)
    nodes: dict[str, dict[str, set[str]]] = {}
    for endpoint in [local, *endpoints]:
        try:
            status = fetch_json(endpoint, "/v1/status")
        except StatusError as e:
            if endpoint is local:
                continue  # this node's sidecar need not run yet; compare the peers
            yield Result("peers", FAIL, str(e), "is the peer's sidecar running and its port open to this node?")
            continue
        try:
            metrics = fetch(endpoint, "/metrics").decode("utf-8", "replace")
        except StatusError:
            metrics = None
        nodes[_label(endpoint, status)] = node_versions(status, metrics)
    if len(nodes) < 2:
        yield Result(
            "version-skew",
            WARN,
            f"only {len(nodes)} sidecar(s) answered; nothing to compare",
            "list reachable sidecars in --peers",
        )
        return
    skew = compare_versions(nodes)
    yield from skew
    if not skew:
        yield Result(
            "version-skew",
            PASS,
            f"{len(nodes)} nodes report the same versions "
            f"({', '.join(sorted({f for v in nodes.values() for f in v}))})",
        )
