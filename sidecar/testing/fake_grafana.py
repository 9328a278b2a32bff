"""A stand-in for the parts of Grafana's HTTP API that `sidecar provision` uses.

Grafana cannot be installed on the test machines, so provisioning is tested against this
small aiohttp server. It follows Grafana's documented behaviour for the endpoints below:

    GET  /api/health                                  (no auth)
    GET  /api/folders/{uid}         POST /api/folders          PUT /api/folders/{uid}
    GET  /api/dashboards/uid/{uid}  POST /api/dashboards/db
    GET  /api/datasources/uid/{uid} POST /api/datasources      PUT /api/datasources/uid/{uid}
    GET  /api/v1/provisioning/alert-rules[/{uid}]  POST .../alert-rules
    PUT  /api/v1/provisioning/alert-rules/{uid}    DELETE .../alert-rules/{uid}

Authentication as Grafana does it: a bearer token (service account) or HTTP basic auth;
anything else is 401 with a JSON `message`. A read-only token (a Viewer) gets 403 on writes.
Payloads are validated against the documented shapes (400 with a message naming the
problem), dashboards honour `overwrite=false` with 412 `version-mismatch`, and every request
is recorded so tests can assert that a second provisioning run writes nothing.

Run it by hand: `python -m sidecar.testing.fake_grafana --port 3000 --token secret`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

UID_RE = re.compile(r"^[a-zA-Z0-9\-_]{1,40}$")
NO_DATA_STATES = {"Alerting", "NoData", "OK"}
EXEC_ERR_STATES = {"OK", "Alerting", "Error"}
DURATION_RE = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
WRITE_METHODS = {"POST", "PUT", "DELETE", "PATCH"}


class BadRequest(Exception):
    """A payload that Grafana would reject with 400."""


@dataclass
class GrafanaState:
    folders: dict[str, dict] = field(default_factory=dict)
    dashboards: dict[str, dict] = field(default_factory=dict)  # uid -> {"dashboard", "folderUid", "version", "id"}
    datasources: dict[str, dict] = field(default_factory=dict)
    alert_rules: dict[str, dict] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    next_id: int = 1

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def writes(self) -> list[tuple[str, str]]:
        return [r for r in self.requests if r[0] in WRITE_METHODS]


STATE = web.AppKey("state", GrafanaState)
CREDENTIALS = web.AppKey("credentials", dict)


def _error(http_status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"message": message, **extra}, status=http_status)


def _not_found(what: str) -> web.Response:
    return _error(404, f"{what} not found", status="not-found")


async def _body(request: web.Request) -> dict:
    try:
        data = await request.json()
    except Exception:
        raise BadRequest("bad request data") from None
    if not isinstance(data, dict):
        raise BadRequest("bad request data: expected a JSON object")
    return data


def _require(data: dict, key: str, kind: type | tuple, where: str) -> Any:
    value = data.get(key)
    if value is None or not isinstance(value, kind) or (isinstance(value, str) and not value.strip()):
        raise BadRequest(f"{where}: {key} is required")
    return value


# ------------------------------------------------------------------ middleware


def _authorized(request: web.Request) -> tuple[bool, str, bool]:
    """(authenticated, message if not, read-only)."""
    creds = request.app[CREDENTIALS]
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        if value and value == creds.get("token"):
            return True, "", False
        if value and value == creds.get("readonly_token"):
            return True, "", True
        return False, "Invalid API key", False
    if scheme.lower() == "basic":
        try:
            user, _, password = base64.b64decode(value).decode().partition(":")
        except Exception:
            return False, "Invalid Basic Auth Header", False
        if creds.get("user") and (user, password) == (creds.get("user"), creds.get("password")):
            return True, "", False
        return False, "Invalid username or password", False
    return False, "Unauthorized", False


@web.middleware
async def grafana_middleware(request: web.Request, handler):
    request.app[STATE].requests.append((request.method, request.path))
    if request.path != "/api/health":
        ok, message, read_only = _authorized(request)
        if not ok:
            return _error(401, message)
        if read_only and request.method in WRITE_METHODS:
            return _error(403, "You'll need additional permissions to perform this action.")
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(400, str(e))


# ------------------------------------------------------------------ handlers


async def health(request: web.Request) -> web.Response:
    return web.json_response({"commit": "fake", "database": "ok", "version": "11.3.0"})


async def get_folder(request: web.Request) -> web.Response:
    folder = request.app[STATE].folders.get(request.match_info["uid"])
    return web.json_response(folder) if folder else _not_found("folder")


async def create_folder(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = await _body(request)
    title = _require(data, "title", str, "folder")
    uid = data.get("uid") or f"f{state.new_id()}"
    if not UID_RE.match(uid):
        raise BadRequest("folder: uid contains illegal characters or is too long")
    if uid in state.folders:
        return _error(409, "a folder with the same uid already exists")
    if any(f["title"] == title for f in state.folders.values()):
        return _error(409, "a folder or dashboard in the general folder with the same name already exists")
    state.folders[uid] = {
        "id": state.new_id(),
        "uid": uid,
        "title": title,
        "url": f"/dashboards/f/{uid}/",
        "version": 1,
        "hasAcl": False,
        "canSave": True,
    }
    return web.json_response(state.folders[uid])


async def update_folder(request: web.Request) -> web.Response:
    state = request.app[STATE]
    folder = state.folders.get(request.match_info["uid"])
    if not folder:
        return _not_found("folder")
    data = await _body(request)
    title = _require(data, "title", str, "folder")
    if not data.get("overwrite") and data.get("version") != folder["version"]:
        return _error(412, "the folder has been changed by someone else", status="version-mismatch")
    folder.update(title=title, version=folder["version"] + 1)
    return web.json_response(folder)


async def get_dashboard(request: web.Request) -> web.Response:
    stored = request.app[STATE].dashboards.get(request.match_info["uid"])
    if not stored:
        return _error(404, "Dashboard not found")
    return web.json_response(
        {
            "dashboard": stored["dashboard"],
            "meta": {
                "type": "db",
                "slug": stored["slug"],
                "url": f"/d/{stored['dashboard']['uid']}/{stored['slug']}",
                "folderUid": stored["folderUid"],
                "version": stored["dashboard"]["version"],
                "provisioned": False,
            },
        }
    )


async def save_dashboard(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = await _body(request)
    dash = _require(data, "dashboard", dict, "dashboard")
    if not str(dash.get("title") or "").strip():
        raise BadRequest("Dashboard title cannot be empty")
    if not isinstance(dash.get("panels", []), list):
        raise BadRequest("dashboard: panels must be a list")
    folder_uid = data.get("folderUid") or ""
    if folder_uid and folder_uid not in state.folders:
        raise BadRequest("folder not found")
    uid = dash.get("uid") or f"d{state.new_id()}"
    if not UID_RE.match(uid):
        raise BadRequest("uid contains illegal characters or is too long")
    existing = state.dashboards.get(uid)
    overwrite = bool(data.get("overwrite"))
    if existing and not overwrite:
        if dash.get("version") != existing["dashboard"]["version"]:
            return _error(412, "The dashboard has been changed by someone else", status="version-mismatch")
    version = existing["dashboard"]["version"] + 1 if existing else 1
    dash_id = existing["dashboard"]["id"] if existing else state.new_id()
    stored = copy.deepcopy(dash)
    stored.update(uid=uid, id=dash_id, version=version)
    slug = re.sub(r"[^a-z0-9]+", "-", stored["title"].lower()).strip("-")
    state.dashboards[uid] = {"dashboard": stored, "folderUid": folder_uid, "slug": slug}
    return web.json_response(
        {"id": dash_id, "uid": uid, "url": f"/d/{uid}/{slug}", "status": "success", "version": version, "slug": slug}
    )


DATASOURCE_ACCESS = {"proxy", "direct"}


def _validate_datasource(data: dict) -> None:
    _require(data, "name", str, "datasource")
    _require(data, "type", str, "datasource")
    if data.get("access", "proxy") not in DATASOURCE_ACCESS:
        raise BadRequest("datasource: access must be proxy or direct")
    if "jsonData" in data and not isinstance(data["jsonData"], dict):
        raise BadRequest("datasource: jsonData must be an object")
    if data.get("uid") and not UID_RE.match(data["uid"]):
        raise BadRequest("datasource: uid contains illegal characters or is too long")


async def get_datasource(request: web.Request) -> web.Response:
    ds = request.app[STATE].datasources.get(request.match_info["uid"])
    return web.json_response(ds) if ds else _error(404, "Data source not found")


async def create_datasource(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = await _body(request)
    _validate_datasource(data)
    if any(d["name"] == data["name"] for d in state.datasources.values()):
        return _error(409, "data source with the same name already exists")
    uid = data.get("uid") or f"ds{state.new_id()}"
    if uid in state.datasources:
        return _error(409, "data source with the same uid already exists")
    ds = {
        "id": state.new_id(),
        "uid": uid,
        "orgId": 1,
        "name": data["name"],
        "type": data["type"],
        "access": data.get("access", "proxy"),
        "url": data.get("url", ""),
        "isDefault": bool(data.get("isDefault")),
        "basicAuth": False,
        "jsonData": data.get("jsonData", {}),
        "readOnly": False,
        "version": 1,
    }
    state.datasources[uid] = ds
    return web.json_response({"datasource": ds, "id": ds["id"], "message": "Datasource added", "name": ds["name"]})


async def update_datasource(request: web.Request) -> web.Response:
    state = request.app[STATE]
    ds = state.datasources.get(request.match_info["uid"])
    if not ds:
        return _error(404, "Data source not found")
    data = await _body(request)
    _validate_datasource(data)
    ds.update(
        name=data["name"],
        type=data["type"],
        access=data.get("access", "proxy"),
        url=data.get("url", ""),
        isDefault=bool(data.get("isDefault")),
        jsonData=data.get("jsonData", {}),
        version=ds["version"] + 1,
    )
    return web.json_response({"datasource": ds, "id": ds["id"], "message": "Datasource updated", "name": ds["name"]})


def _validate_alert_rule(state: GrafanaState, rule: dict) -> None:
    """The documented required fields of a ProvisionedAlertRule and the checks Grafana makes."""
    where = "alert rule"
    _require(rule, "title", str, where)
    _require(rule, "ruleGroup", str, where)
    folder = _require(rule, "folderUID", str, where)
    if folder not in state.folders:
        raise BadRequest(f"{where}: folder does not exist")
    if not isinstance(rule.get("orgID"), int):
        raise BadRequest(f"{where}: orgID is required")
    if rule.get("uid") and not UID_RE.match(rule["uid"]):
        raise BadRequest(f"{where}: uid contains illegal characters or is too long")
    if rule.get("noDataState") not in NO_DATA_STATES:
        raise BadRequest(f"{where}: noDataState must be one of {sorted(NO_DATA_STATES)}")
    if rule.get("execErrState") not in EXEC_ERR_STATES:
        raise BadRequest(f"{where}: execErrState must be one of {sorted(EXEC_ERR_STATES)}")
    if not isinstance(rule.get("for"), str) or not DURATION_RE.match(rule["for"]):
        raise BadRequest(f"{where}: for must be a duration")
    data = rule.get("data")
    if not isinstance(data, list) or not data:
        raise BadRequest(f"{where}: data must be a non-empty list of queries")
    ref_ids = set()
    for q in data:
        if (
            not isinstance(q, dict)
            or not q.get("refId")
            or not q.get("datasourceUid")
            or not isinstance(q.get("model"), dict)
        ):
            raise BadRequest(f"{where}: every query needs refId, datasourceUid and a model")
        rtr = q.get("relativeTimeRange")
        if not isinstance(rtr, dict) or not {"from", "to"} <= set(rtr):
            raise BadRequest(f"{where}: query {q['refId']}: relativeTimeRange needs from and to")
        if q["datasourceUid"] == "__expr__":
            if q["model"].get("type") not in ("reduce", "threshold", "math", "classic_conditions", "resample"):
                raise BadRequest(f"{where}: expression {q['refId']} has an unknown type")
            if q["model"].get("expression") not in ref_ids:
                raise BadRequest(f"{where}: expression {q['refId']} refers to an unknown query")
        elif q["datasourceUid"] not in state.datasources:
            raise BadRequest(f"{where}: data source {q['datasourceUid']} not found")
        ref_ids.add(q["refId"])
    if rule.get("condition") not in ref_ids:
        raise BadRequest(f"{where}: condition {rule.get('condition')!r} does not exist in data")
    for key in ("labels", "annotations"):
        if not isinstance(rule.get(key, {}), dict):
            raise BadRequest(f"{where}: {key} must be an object")


def _title_taken(state: GrafanaState, rule: dict, uid: str) -> bool:
    return any(
        r["title"] == rule["title"] and r["folderUID"] == rule["folderUID"] and u != uid
        for u, r in state.alert_rules.items()
    )


async def list_alert_rules(request: web.Request) -> web.Response:
    return web.json_response(list(request.app[STATE].alert_rules.values()))


async def get_alert_rule(request: web.Request) -> web.Response:
    rule = request.app[STATE].alert_rules.get(request.match_info["uid"])
    return web.json_response(rule) if rule else _error(404, "rule not found")


async def create_alert_rule(request: web.Request) -> web.Response:
    state = request.app[STATE]
    rule = await _body(request)
    _validate_alert_rule(state, rule)
    uid = rule.get("uid") or f"r{state.new_id()}"
    if uid in state.alert_rules:
        return _error(409, "rule with the same uid already exists")
    if _title_taken(state, rule, uid):
        return _error(409, "a rule with the same title already exists in this folder")
    stored = {
        **copy.deepcopy(rule),
        "uid": uid,
        "id": state.new_id(),
        "provenance": "api",
        "updated": "2026-01-01T00:00:00Z",
        "isPaused": bool(rule.get("isPaused")),
    }
    state.alert_rules[uid] = stored
    return web.json_response(stored, status=201)


async def update_alert_rule(request: web.Request) -> web.Response:
    state = request.app[STATE]
    uid = request.match_info["uid"]
    existing = state.alert_rules.get(uid)
    if not existing:
        return _error(404, "rule not found")
    rule = await _body(request)
    _validate_alert_rule(state, rule)
    if _title_taken(state, rule, uid):
        return _error(409, "a rule with the same title already exists in this folder")
    stored = {
        **copy.deepcopy(rule),
        "uid": uid,
        "id": existing["id"],
        "provenance": "api",
        "updated": "2026-01-01T00:00:01Z",
        "isPaused": bool(rule.get("isPaused")),
    }
    state.alert_rules[uid] = stored
    return web.json_response(stored)


async def delete_alert_rule(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.alert_rules.pop(request.match_info["uid"], None)
    return web.Response(status=204)


def build_app(
    token: str | None = None,
    user: str | None = None,
    password: str | None = None,
    readonly_token: str | None = None,
    state: GrafanaState | None = None,
) -> web.Application:
    app = web.Application(middlewares=[grafana_middleware])
    app[STATE] = state or GrafanaState()
    app[CREDENTIALS] = {"token": token, "user": user, "password": password, "readonly_token": readonly_token}
    app.router.add_get("/api/health", health)
    app.router.add_get("/api/folders/{uid}", get_folder)
    app.router.add_post("/api/folders", create_folder)
    app.router.add_put("/api/folders/{uid}", update_folder)
    app.router.add_get("/api/dashboards/uid/{uid}", get_dashboard)
    app.router.add_post("/api/dashboards/db", save_dashboard)
    app.router.add_get("/api/datasources/uid/{uid}", get_datasource)
    app.router.add_post("/api/datasources", create_datasource)
    app.router.add_put("/api/datasources/uid/{uid}", update_datasource)
    app.router.add_get("/api/v1/provisioning/alert-rules", list_alert_rules)
    app.router.add_post("/api/v1/provisioning/alert-rules", create_alert_rule)
    app.router.add_get("/api/v1/provisioning/alert-rules/{uid}", get_alert_rule)
    app.router.add_put("/api/v1/provisioning/alert-rules/{uid}", update_alert_rule)
    app.router.add_delete("/api/v1/provisioning/alert-rules/{uid}", delete_alert_rule)
    return app


class BackgroundServer:
    """An aiohttp application served from a background thread on a free loopback port, for
    synchronous callers (a CLI under test, a webhook receiver next to real binaries)."""

    def __init__(self, app: web.Application):
        self.app = app
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="aiohttp-background", daemon=True)

    def start(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeGrafana(BackgroundServer):
    """The Grafana stand-in on a free loopback port; `state` holds what it stored and saw."""

    def __init__(self, **credentials: str | None):
        self.state = GrafanaState()
        super().__init__(build_app(state=self.state, **credentials))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sidecar.testing.fake_grafana", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--token", help="accepted bearer token")
    p.add_argument("--user", help="accepted basic-auth user")
    p.add_argument("--password", help="accepted basic-auth password")
    args = p.parse_args(argv)
    web.run_app(build_app(args.token, args.user, args.password), host="127.0.0.1", port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
