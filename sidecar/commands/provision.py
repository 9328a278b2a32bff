"""`sidecar provision`: push the dashboards and the Prometheus datasource into Grafana, or
write them as files for those who deploy by files.

Against Grafana's HTTP API (with grafana-client, the `provision` extra: `pip install
'training-sidecar[provision]'`; `--write-files` needs none) it creates the folder if missing, creates or
updates the datasource when `--datasource-url` is given and saves every dashboard of
`dashboards/` into the folder. It compares before it writes: a second run changes nothing and
says "unchanged" for every object.

One alerting owner: by default (`--alerts prometheus`) the alerts are Prometheus's
(`alerts/*.rules.yml`, the PrometheusRules of deploy/kubernetes, routed by Alertmanager) and
Grafana only displays; rules an earlier `--alerts grafana` run made are deleted, so no alert
fires twice. `--alerts grafana` turns every alert into a Grafana-managed alert rule
(/api/v1/provisioning/alert-rules) for a Grafana that alerts on its own; then load only the
recording rules into Prometheus. `--write-files` writes the same choice as files: the
Prometheus rules file holds the alerts, or (with `--alerts grafana`) only the recording rules
next to a Grafana alerting provisioning file.

The alerts query the series of the recording rules (alerts/recording.rules.yml): load those
into the Prometheus behind the datasource either way.

Credentials never go on the command line (it shows in `ps`): a token from GRAFANA_TOKEN or
`--token-file`, or basic auth from GRAFANA_USER and GRAFANA_PASSWORD or `--basic-auth-file`
(one line `user:password`). Exit status: 0 done, 1 Grafana refused or is unreachable, 2 bad
usage or grafana-client not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from sidecar import assets
from sidecar.commands.grafana_payloads import (
    RULE_UID_PREFIX,
    ProvisionError,
    UsageError,
    contains,
    datasource_payload,
    grafana_alerting_file,
    grafana_rules,
    load_dashboards,
    load_rule_groups,
    recording_groups,
    with_datasource,
)

# The package's data (sidecar/assets): an installed wheel provisions without the repository.
DEFAULT_DASHBOARDS = assets.DASHBOARDS
DEFAULT_RULES = assets.ALERTS
GPU_SOURCES = ("sidecar", "dcgm")
# Who evaluates the alerts and sends the notifications: Prometheus (-> Alertmanager), as
# kube-prometheus-stack does, or Grafana's own alerting. Never both: every alert would fire twice.
ALERT_OWNERS = ("prometheus", "grafana")
DEFAULT_FOLDER_UID = "training-sidecar"
DEFAULT_FOLDER_TITLE = "Training sidecar"
DEFAULT_DATASOURCE_UID = "sidecar-prometheus"
DEFAULT_DATASOURCE_NAME = "Prometheus (training sidecar)"
MESSAGE = "provisioned by `sidecar provision`"
PROMETHEUS_OWNS_ALERTS = (
    "alert rules: none in Grafana; Prometheus owns the alerts (alerts/*.rules.yml or the PrometheusRules "
    "of deploy/kubernetes, routed by Alertmanager); --alerts grafana makes Grafana-managed rules instead"
)


@dataclass
class Options:
    folder_uid: str
    folder_title: str
    datasource_uid: str
    datasource_name: str
    datasource_url: str | None
    dashboards: list[dict]
    rule_groups: list[dict]
    push_dashboards: bool
    alerts_in_grafana: bool  # --alerts grafana: Grafana-managed alert rules, Prometheus records only


class Provisioner:
    """Brings Grafana to the wanted state, one object at a time, printing one line per object."""

    def __init__(self, api: Any, url: str, out: Callable[[str], None] = print):
        self.api = api
        self.url = url
        self.out = out
        self.changed = 0

    def report(self, kind: str, name: str, outcome: str) -> None:
        if outcome != "unchanged":
            self.changed += 1
        self.out(f"{kind} {name}: {outcome}")

    def call(self, what: str, fn: Callable, *args: Any, missing_ok: bool = False, **kwargs: Any) -> Any:
        """Run one API call, turning grafana-client's and niquests' errors into one line."""
        import niquests
        from grafana_client.client import (
            GrafanaBadInputError,
            GrafanaClientError,
            GrafanaException,
            GrafanaServerError,
            GrafanaTimeoutError,
            GrafanaUnauthorizedError,
        )

        try:
            return fn(*args, **kwargs)
        except GrafanaUnauthorizedError:
            raise ProvisionError(
                f"Grafana at {self.url} rejected the credentials (401 Unauthorized); "
                "check GRAFANA_TOKEN, --token-file or the basic-auth user"
            ) from None
        except GrafanaBadInputError as e:
            raise ProvisionError(f"Grafana rejected {what} (400): {_message(e)}") from None
        except GrafanaTimeoutError:
            raise ProvisionError(f"Grafana at {self.url} did not answer in time ({what})") from None
        except GrafanaServerError as e:
            raise ProvisionError(f"Grafana at {self.url} failed on {what} ({e.status_code}): {_message(e)}") from None
        except GrafanaClientError as e:
            if e.status_code == 404 and missing_ok:
                return None
            if e.status_code == 403:
                raise ProvisionError(
                    f"Grafana at {self.url} denied {what} (403 Forbidden): the token or user "
                    "needs the Editor or Admin role"
                ) from None
            if e.status_code == 412:
                raise ProvisionError(
                    f"{what} was changed in Grafana while provisioning (412 {_message(e)}); run again"
                ) from None
            raise ProvisionError(f"Grafana refused {what} ({e.status_code}): {_message(e)}") from None
        except niquests.exceptions.ConnectionError as e:
            reason = "connection refused" if "refused" in str(e).lower() else _short(e)
            raise ProvisionError(f"cannot reach Grafana at {self.url}: {reason}") from None
        except GrafanaException as e:  # a transport error grafana-client wrapped
            raise ProvisionError(f"cannot reach Grafana at {self.url}: {_short(e)}") from None
        except niquests.exceptions.RequestException as e:
            raise ProvisionError(f"cannot reach Grafana at {self.url}: {_short(e)}") from None

    # --- objects

    def check_reachable(self) -> None:
        health = self.call("the health check", self.api.client.GET, "/health")
        if not isinstance(health, dict) or health.get("database") != "ok":
            raise ProvisionError(f"Grafana at {self.url} is not healthy: {health!r}")

    def folder(self, uid: str, title: str) -> None:
        existing = self.call(f"folder {uid}", self.api.folder.get_folder, uid, missing_ok=True)
        if existing is None:
            self.call(f"folder {uid}", self.api.folder.create_folder, title, uid=uid)
            self.report("folder", uid, "created")
        elif existing.get("title") != title:
            self.call(f"folder {uid}", self.api.folder.update_folder, uid, title=title, version=existing.get("version"))
            self.report("folder", uid, "updated")
        else:
            self.report("folder", uid, "unchanged")

    def datasource(self, uid: str, name: str, url: str | None) -> None:
        existing = self.call(f"datasource {uid}", self.api.datasource.get_datasource_by_uid, uid, missing_ok=True)
        if url is None:
            if existing is None:
                raise ProvisionError(
                    f"datasource {uid} not found in Grafana; pass --datasource-url to create it "
                    "or --datasource-uid of an existing Prometheus datasource"
                )
            self.report("datasource", uid, "exists")
            return
        wanted = datasource_payload(uid, name, url)
        if existing is None:
            self.call(f"datasource {uid}", self.api.datasource.create_datasource, wanted)
            self.report("datasource", uid, "created")
        elif contains(existing, wanted):
            self.report("datasource", uid, "unchanged")
        else:
            # Keep settings someone added in Grafana (TLS, auth) next to ours.
            wanted["jsonData"] = {**(existing.get("jsonData") or {}), **wanted["jsonData"]}
            self.call(f"datasource {uid}", self.api.datasource.update_datasource_by_uid, uid, wanted)
            self.report("datasource", uid, "updated")

    def dashboard(self, dash: dict, folder_uid: str) -> None:
        uid = dash["uid"]
        what = f"dashboard {uid}"
        existing = self.call(what, self.api.dashboard.get_dashboard, uid, missing_ok=True)
        wanted = {k: v for k, v in dash.items() if k not in ("id", "version")}
        if existing is not None:
            stored = {k: v for k, v in existing.get("dashboard", {}).items() if k not in ("id", "version")}
            if stored == wanted and existing.get("meta", {}).get("folderUid") == folder_uid:
                self.report("dashboard", uid, "unchanged")
                return
            body = {**wanted, "id": existing["dashboard"].get("id"), "version": existing["dashboard"].get("version")}
        else:
            body = {**wanted, "id": None}
        # overwrite=False with the version we read: a concurrent edit in Grafana is a 412, not lost.
        self.call(
            what,
            self.api.dashboard.update_dashboard,
            {"dashboard": body, "folderUid": folder_uid, "overwrite": False, "message": MESSAGE},
        )
        self.report("dashboard", uid, "updated" if existing is not None else "created")

    def alert_rules(self, wanted: list[dict], folder_uid: str) -> None:
        """Make the folder's rules of this tool exactly `wanted` (none: Prometheus owns the alerts)."""
        existing = {
            r.get("uid"): r
            for r in self.call("the alert rules", self.api.alertingprovisioning.get_alertrules_all) or []
        }
        for rule in wanted:
            uid = rule["uid"]
            what = f"alert rule {uid}"
            if uid not in existing:
                self.call(what, self.api.alertingprovisioning.create_alertrule, rule)
                self.report("alert rule", uid, "created")
            elif contains(existing[uid], rule):
                self.report("alert rule", uid, "unchanged")
            else:
                self.call(what, self.api.alertingprovisioning.update_alertrule, uid, rule)
                self.report("alert rule", uid, "updated")
        # Rules this tool made earlier for alerts that no longer exist, or all of them when
        # Prometheus owns the alerts (an earlier `--alerts grafana` run would double every alert).
        wanted_uids = {r["uid"] for r in wanted}
        for uid, rule in existing.items():
            if (
                uid
                and uid.startswith(RULE_UID_PREFIX)
                and uid not in wanted_uids
                and rule.get("folderUID") == folder_uid
            ):
                self.call(f"alert rule {uid}", self.api.alertingprovisioning.delete_alertrule, uid)
                self.report("alert rule", uid, "deleted")

    def run(self, o: Options) -> None:
        self.check_reachable()
        self.folder(o.folder_uid, o.folder_title)
        if o.alerts_in_grafana or o.datasource_url:
            self.datasource(o.datasource_uid, o.datasource_name, o.datasource_url)
        if o.push_dashboards:
            for dash in o.dashboards:
                if o.alerts_in_grafana or o.datasource_url:  # the datasource was checked above
                    dash = with_datasource(dash, o.datasource_uid, o.datasource_name)
                self.dashboard(dash, o.folder_uid)
        if o.alerts_in_grafana:
            self.alert_rules(grafana_rules(o.rule_groups, o.folder_uid, o.datasource_uid), o.folder_uid)
        else:
            self.alert_rules([], o.folder_uid)
            self.out(PROMETHEUS_OWNS_ALERTS)


def _message(e: Exception) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict) and response.get("message"):
        return str(response["message"])
    return _short(e)


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


# ------------------------------------------------------------------ credentials


def _read_secret(path: str, what: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror}") from None
    if not value:
        raise UsageError(f"{what} {path} is empty")
    return value


def credential(args: argparse.Namespace, environ: dict[str, str]) -> str | tuple[str, str]:
    """A token, or (user, password), from the files or the environment; never from flags."""
    if args.token_file and args.basic_auth_file:
        raise UsageError("give either --token-file or --basic-auth-file, not both")
    if args.token_file:
        return _read_secret(args.token_file, "token file")
    if args.basic_auth_file:
        user, sep, password = _read_secret(args.basic_auth_file, "basic-auth file").partition(":")
        if not sep or not user:
            raise UsageError(f"basic-auth file {args.basic_auth_file} must hold one line user:password")
        return user, password
    if environ.get("GRAFANA_TOKEN", "").strip():
        return environ["GRAFANA_TOKEN"].strip()
    if environ.get("GRAFANA_USER") and "GRAFANA_PASSWORD" in environ:
        return environ["GRAFANA_USER"], environ["GRAFANA_PASSWORD"]
    raise UsageError(
        "no Grafana credentials: set GRAFANA_TOKEN or --token-file, "
        "or GRAFANA_USER and GRAFANA_PASSWORD or --basic-auth-file"
    )


def grafana_url(args: argparse.Namespace, environ: dict[str, str]) -> str:
    url = args.url or environ.get("GRAFANA_URL", "")
    if not url:
        raise UsageError("no Grafana URL: pass --url or set GRAFANA_URL")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--url: expected http(s)://HOST[:PORT][/PATH], got {url!r}")
    if parts.username or parts.password:
        raise UsageError("--url must not hold credentials (they show in `ps`); use GRAFANA_TOKEN or a file")
    return url.rstrip("/")


# ------------------------------------------------------------------ files


def _write(path: Path, text: str, out: Callable[[str], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.read_text() == text:
        out(f"file {path}: unchanged")
        return
    path.write_text(text)
    out(f"file {path}: written")


def write_files(out_dir: Path, o: Options, dashboards_path: str, out: Callable[[str], None] = print) -> None:
    """Grafana file provisioning (a dashboard provider and, with --datasource-url, a datasource),
    the dashboards, and one Prometheus rules file with every group; with `--alerts grafana` the
    alerts go to a Grafana alerting provisioning file instead and the rules file records only."""
    provider = {
        "apiVersion": 1,
        "providers": [
            {
                "name": o.folder_uid,
                "orgId": 1,
                "folder": o.folder_title,
                "folderUid": o.folder_uid,
                "type": "file",
                "disableDeletion": False,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 60,
                "options": {"path": dashboards_path, "foldersFromFilesStructure": False},
            }
        ],
    }
    _write(
        out_dir / "grafana" / "provisioning" / "dashboards" / f"{o.folder_uid}.yaml",
        yaml.safe_dump(provider, sort_keys=False),
        out,
    )
    if o.datasource_url:
        ds = datasource_payload(o.datasource_uid, o.datasource_name, o.datasource_url)
        ds["orgId"] = 1
        ds["editable"] = False
        _write(
            out_dir / "grafana" / "provisioning" / "datasources" / f"{o.folder_uid}.yaml",
            yaml.safe_dump({"apiVersion": 1, "datasources": [ds]}, sort_keys=False),
            out,
        )
    else:
        out("datasource: skipped (no --datasource-url); the dashboards ask for a Prometheus datasource")
    for dash in o.dashboards:
        if o.datasource_url:
            dash = with_datasource(dash, o.datasource_uid, o.datasource_name)
        _write(out_dir / "grafana" / "dashboards" / f"{dash['uid']}.json", json.dumps(dash, indent=2) + "\n", out)
    if o.alerts_in_grafana:
        alerting = grafana_alerting_file(o.rule_groups, o.folder_uid, o.folder_title, o.datasource_uid)
        _write(
            out_dir / "grafana" / "provisioning" / "alerting" / f"{o.folder_uid}.yaml",
            yaml.safe_dump(alerting, sort_keys=False, width=120),
            out,
        )
        groups, what = recording_groups(o.rule_groups), "Recording rules (Grafana owns the alerts)"
    else:
        groups, what = o.rule_groups, "Recording and alerting rules"
    _write(
        out_dir / "prometheus" / "training-sidecar.rules.yml",
        f"# {what} of the training sidecar (generated from alerts/).\n"
        + yaml.safe_dump({"groups": groups}, sort_keys=False, width=120),
        out,
    )


# ------------------------------------------------------------------ command line


MISSING_CLIENT = (
    "talking to Grafana needs grafana-client, which the daemon's install leaves out: "
    "pip install 'training-sidecar[provision]' (--write-files works without it)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # No prefix matching: `--token SECRET` must fail, not become `--token-file SECRET`.
    parser.allow_abbrev = False
    parser.add_argument("--url", help="Grafana's base URL, e.g. http://grafana:3000 (also GRAFANA_URL)")
    parser.add_argument(
        "--token-file", metavar="PATH", help="file holding a service-account token (or set GRAFANA_TOKEN)"
    )
    parser.add_argument(
        "--basic-auth-file",
        metavar="PATH",
        help="file holding one line user:password (or set GRAFANA_USER and GRAFANA_PASSWORD)",
    )
    parser.add_argument("--folder-uid", default=DEFAULT_FOLDER_UID, help="folder for dashboards and alert rules")
    parser.add_argument("--folder-title", default=DEFAULT_FOLDER_TITLE, help="the folder's title")
    parser.add_argument(
        "--datasource-url", metavar="URL", help="create or update a Prometheus datasource pointing at this URL"
    )
    parser.add_argument(
        "--datasource-uid",
        default=DEFAULT_DATASOURCE_UID,
        help="uid of the Prometheus datasource the alert rules query (created with --datasource-url)",
    )
    parser.add_argument("--datasource-name", default=DEFAULT_DATASOURCE_NAME, help="name of the created datasource")
    parser.add_argument("--dashboards-dir", type=Path, default=DEFAULT_DASHBOARDS, help="dashboard JSON files")
    parser.add_argument("--rules-dir", type=Path, default=DEFAULT_RULES, help="Prometheus *.rules.yml files")
    parser.add_argument("--no-dashboards", action="store_true", help="leave the dashboards alone")
    parser.add_argument(
        "--alerts",
        choices=ALERT_OWNERS,
        default="prometheus",
        help="who owns the alerts: prometheus (default: Grafana gets no alert rules, and those an earlier "
        "`--alerts grafana` run made are deleted; load alerts/*.rules.yml or the PrometheusRules) or grafana "
        "(Grafana-managed alert rules; Prometheus then needs only the recording rules)",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each answer")
    parser.add_argument(
        "--write-files",
        metavar="DIR",
        type=Path,
        help="write Grafana provisioning files, dashboards and a Prometheus rules file to DIR "
        "instead of calling Grafana",
    )
    parser.add_argument(
        "--gpu-source",
        choices=GPU_SOURCES,
        default="sidecar",
        help="with --write-files: whose GPU series the rules file maps onto the names the dashboards "
        "and GPU alerts read: the sidecar's own, or dcgm-exporter's (docs/dcgm.md)",
    )
    parser.add_argument(
        "--dashboards-path",
        default="/var/lib/grafana/dashboards/training-sidecar",
        help="with --write-files: where Grafana will find the dashboard files",
    )


def _options(args: argparse.Namespace) -> Options:
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout}")
    alerts_in_grafana = args.alerts == "grafana"
    if args.no_dashboards and not alerts_in_grafana and not args.datasource_url:
        raise UsageError("nothing to do: --no-dashboards without --datasource-url or --alerts grafana")
    return Options(
        folder_uid=args.folder_uid,
        folder_title=args.folder_title,
        datasource_uid=args.datasource_uid,
        datasource_name=args.datasource_name,
        datasource_url=args.datasource_url,
        dashboards=[] if args.no_dashboards else load_dashboards(args.dashboards_dir),
        rule_groups=(
            load_rule_groups(args.rules_dir, args.gpu_source if args.write_files else None)
            if (alerts_in_grafana or args.write_files)
            else []
        ),
        push_dashboards=not args.no_dashboards,
        alerts_in_grafana=alerts_in_grafana,
    )


def main(args: argparse.Namespace, environ: dict[str, str] | None = None) -> int:
    environ = dict(os.environ if environ is None else environ)
    try:
        options = _options(args)
        if args.write_files:
            write_files(args.write_files, options, args.dashboards_path)
            return 0
        url = grafana_url(args, environ)
        cred = credential(args, environ)
    except UsageError as e:
        print(f"sidecar provision: error: {e}", file=sys.stderr)
        return 2
    try:
        from grafana_client import GrafanaApi
    except ImportError:
        print(f"sidecar provision: error: {MISSING_CLIENT}", file=sys.stderr)
        return 2
    # grafana-client appends "api" to the URL's path as is: a sub-path needs its trailing slash.
    api = GrafanaApi.from_url(url + "/" if urlsplit(url).path else url, credential=cred, timeout=args.timeout)
    provisioner = Provisioner(api, url)
    try:
        provisioner.run(options)
    except ProvisionError as e:
        print(f"sidecar provision: error: {e}", file=sys.stderr)
        return 1
    except UsageError as e:
        print(f"sidecar provision: error: {e}", file=sys.stderr)
        return 2
    print(f"done: {provisioner.changed} change(s)" if provisioner.changed else "done: everything unchanged")
    return 0
