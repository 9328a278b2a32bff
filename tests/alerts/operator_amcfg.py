"""What the Prometheus Operator makes of an AlertmanagerConfig object (monitoring.coreos.com/v1alpha1)
in the Alertmanager configuration it writes, for the fields the sidecar's object uses. No operator
runs here, so this follows its code: prometheus-operator/prometheus-operator, pkg/alertmanager/amcfg.go
at commit 6adcebc5076c34f4f55f8f5f7b1e528929373ac7 (0.93):

- `convertRoute`, `convertInhibitRule`, `convertMatchersV2`: camelCase fields to the Alertmanager's,
  each matcher `{name, matchType, value}` to the text `name<matchType>"value"` (Matcher.String);
  receiver names become `<namespace>/<name>/<receiver>` (makeNamespacedString), in routes too;
- `AddAlertmanagerConfigs`: the object's inhibit rules appended to the configuration's, its route
  put first among the root route's routes, with `continue: true` (continueToNextRoute);
- the enforcer of the Alertmanager's `alertmanagerConfigMatcherStrategy.type`: `OnNamespace` (the
  default) appends `namespace="<the object's namespace>"` to the route's matchers and to both sides of
  every inhibit rule (namespaceEnforcer); `OnNamespaceExceptForAlertmanagerNamespace` does so except
  for objects in the Alertmanager's own namespace (otherNamespaceEnforcer); `None` never does.
"""

from __future__ import annotations

import copy

STRATEGIES = ("OnNamespace", "OnNamespaceExceptForAlertmanagerNamespace", "None")
_ROUTE_FIELDS = {
    "groupBy": "group_by",
    "groupWait": "group_wait",
    "groupInterval": "group_interval",
    "repeatInterval": "repeat_interval",
    "continue": "continue",
}


def _matcher(m: dict) -> str:
    value = m.get("value", "").replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'{m["name"]}{m["matchType"]}"{value}"'


def _route(route: dict, prefix: str) -> dict:
    out: dict = {}
    if route.get("receiver"):
        out["receiver"] = prefix + route["receiver"]
    for field, key in _ROUTE_FIELDS.items():
        if field in route:
            out[key] = route[field]
    if route.get("matchers"):
        out["matchers"] = [_matcher(m) for m in route["matchers"]]
    if route.get("routes"):
        out["routes"] = [_route(r, prefix) for r in route["routes"]]
    unknown = set(route) - {"receiver", "matchers", "routes", *_ROUTE_FIELDS}
    assert not unknown, f"fields this emulation does not carry: {unknown}"
    return out


def _receiver(receiver: dict, prefix: str) -> dict:
    unknown = set(receiver) - {"name", "webhookConfigs"}
    assert not unknown, f"integrations this emulation does not carry: {unknown}"
    out: dict = {"name": prefix + receiver["name"]}
    if receiver.get("webhookConfigs"):
        out["webhook_configs"] = [
            {"url": h["url"], **({"send_resolved": h["sendResolved"]} if "sendResolved" in h else {})}
            for h in receiver["webhookConfigs"]
        ]
    return out


def apply(config: dict, obj: dict, strategy: str, alertmanager_namespace: str) -> dict:
    """`config` (the Alertmanager's own, from its Secret) with `obj` added as the operator adds it."""
    assert strategy in STRATEGIES, strategy
    namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    prefix = f"{namespace}/{name}/"
    enforce = strategy == "OnNamespace" or (
        strategy == "OnNamespaceExceptForAlertmanagerNamespace" and namespace != alertmanager_namespace
    )
    own = f'namespace="{namespace}"'
    spec = obj["spec"]
    out = copy.deepcopy(config)
    for rule in spec.get("inhibitRules", []):
        converted = {
            "source_matchers": [_matcher(m) for m in rule.get("sourceMatch", [])],
            "target_matchers": [_matcher(m) for m in rule.get("targetMatch", [])],
            "equal": list(rule.get("equal", [])),
        }
        if enforce:
            for side in ("source_matchers", "target_matchers"):
                if own not in converted[side]:
                    converted[side].append(own)
        out.setdefault("inhibit_rules", []).append(converted)
    if spec.get("route"):
        route = _route(spec["route"], prefix)
        if enforce:
            route["matchers"] = [*route.get("matchers", []), own]
        route["continue"] = True
        out["route"]["routes"] = [route, *out["route"].get("routes", [])]
        out.setdefault("receivers", []).extend(_receiver(r, prefix) for r in spec.get("receivers", []))
    return out
