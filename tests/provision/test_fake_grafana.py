"""The Grafana stand-in answers like Grafana: 401 with a JSON message for bad credentials,
400 for payloads Grafana would reject, 412 for a stale dashboard version. Without this, the
provisioning tests could pass against a server that accepts anything."""

from __future__ import annotations

import base64

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sidecar.testing.fake_grafana import build_app

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def client():
    async with TestClient(TestServer(build_app(token=TOKEN, user="admin", password="pw"))) as c:
        yield c


async def test_health_needs_no_credentials(client):
    resp = await client.get("/api/health")
    assert resp.status == 200 and (await resp.json())["database"] == "ok"


@pytest.mark.parametrize(
    "header",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + base64.b64encode(b"admin:nope").decode()}],
)
async def test_bad_credentials_get_401_with_a_json_message(client, header):
    resp = await client.get("/api/folders/x", headers=header)
    assert resp.status == 401 and (await resp.json())["message"]


async def test_basic_auth_is_accepted(client):
    header = {"Authorization": "Basic " + base64.b64encode(b"admin:pw").decode()}
    assert (await client.get("/api/folders/x", headers=header)).status == 404


async def test_a_dashboard_without_title_is_400(client):
    resp = await client.post("/api/dashboards/db", json={"dashboard": {"uid": "d1"}}, headers=AUTH)
    assert resp.status == 400 and "title" in (await resp.json())["message"]


async def test_a_stale_dashboard_version_is_412_version_mismatch(client):
    body = {"dashboard": {"uid": "d1", "title": "D"}, "overwrite": False}
    assert (await client.post("/api/dashboards/db", json=body, headers=AUTH)).status == 200
    body["dashboard"]["version"] = 0
    resp = await client.post("/api/dashboards/db", json=body, headers=AUTH)
    assert resp.status == 412 and (await resp.json())["status"] == "version-mismatch"


async def test_an_alert_rule_whose_condition_is_not_in_data_is_400(client):
    await client.post("/api/folders", json={"uid": "f", "title": "F"}, headers=AUTH)
    await client.post(
        "/api/datasources", json={"uid": "ds", "name": "P", "type": "prometheus", "access": "proxy"}, headers=AUTH
    )
    rule = {
        "title": "R",
        "ruleGroup": "g",
        "folderUID": "f",
        "orgID": 1,
        "condition": "C",
        "for": "1m",
        "noDataState": "OK",
        "execErrState": "Error",
        "data": [
            {"refId": "A", "datasourceUid": "ds", "relativeTimeRange": {"from": 600, "to": 0}, "model": {"expr": "up"}}
        ],
    }
    resp = await client.post("/api/v1/provisioning/alert-rules", json=rule, headers=AUTH)
    assert resp.status == 400 and "condition" in (await resp.json())["message"]
    rule["condition"] = "A"
    assert (await client.post("/api/v1/provisioning/alert-rules", json=rule, headers=AUTH)).status == 201


async def test_an_alert_rule_in_a_missing_folder_is_400(client):
    rule = {
        "title": "R",
        "ruleGroup": "g",
        "folderUID": "nope",
        "orgID": 1,
        "condition": "A",
        "for": "1m",
        "noDataState": "OK",
        "execErrState": "Error",
        "data": [],
    }
    resp = await client.post("/api/v1/provisioning/alert-rules", json=rule, headers=AUTH)
    assert resp.status == 400
