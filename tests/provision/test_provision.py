"""`sidecar provision` against the Grafana stand-in: payloads in Grafana's documented shapes,
idempotent runs, clear one-line errors, and the file mode."""

from __future__ import annotations

import os
import subprocess

import pytest
import tomllib
import yaml

from sidecar import cli
from sidecar.commands import provision
from sidecar.testing.fake_grafana import FakeGrafana
from tests.support import PYTHON, ROOT, free_port

TOKEN = "glsa_test_token"
PROM_URL = "http://prometheus:9090"


@pytest.fixture
def grafana():
    with FakeGrafana(token=TOKEN, user="admin", password="s3cret", readonly_token="viewer") as g:
        yield g


def run(argv: list[str], environ: dict[str, str]) -> int:
    args = cli.build_parser(["provision"]).parse_args(["provision", *argv])
    return provision.main(args, environ=environ)


def token_env(grafana, token: str = TOKEN) -> dict[str, str]:
    return {"GRAFANA_URL": grafana.url, "GRAFANA_TOKEN": token}


def dashboards() -> list[dict]:
    return provision.load_dashboards(ROOT / "dashboards")


def alert_names() -> list[str]:
    from alerts.build import all_alerts

    return [a.name for a in all_alerts()]


def test_first_run_creates_folder_datasource_and_dashboards(grafana, capsys):
    assert run(["--datasource-url", PROM_URL], token_env(grafana)) == 0
    s = grafana.state
    assert s.folders["training-sidecar"]["title"] == "Training sidecar"
    assert s.datasources["sidecar-prometheus"]["url"] == PROM_URL
    assert s.datasources["sidecar-prometheus"]["type"] == "prometheus"
    assert set(s.dashboards) == {d["uid"] for d in dashboards()}
    assert all(d["folderUid"] == "training-sidecar" for d in s.dashboards.values())
    out = capsys.readouterr().out
    assert "folder training-sidecar: created" in out
    assert "dashboard sidecar-training-job: created" in out


def test_by_default_no_alert_rule_is_created_in_grafana(grafana, capsys):
    assert run(["--datasource-url", PROM_URL], token_env(grafana)) == 0
    assert grafana.state.alert_rules == {}
    assert "Prometheus owns the alerts" in capsys.readouterr().out


def test_alerts_grafana_creates_a_grafana_managed_rule_per_alert(grafana, capsys):
    assert run(["--datasource-url", PROM_URL, "--alerts", "grafana"], token_env(grafana)) == 0
    assert sorted(r["title"] for r in grafana.state.alert_rules.values()) == sorted(alert_names())
    assert "alert rule sidecar-rank-stalled: created" in capsys.readouterr().out


def test_the_default_run_deletes_the_rules_an_earlier_alerts_grafana_run_made(grafana, capsys):
    run(["--datasource-url", PROM_URL, "--alerts", "grafana"], token_env(grafana))
    someone_elses = dict(grafana.state.alert_rules["sidecar-rank-stalled"], uid="team-rule", title="Theirs")
    grafana.state.alert_rules["team-rule"] = someone_elses
    capsys.readouterr()
    assert run([], token_env(grafana)) == 0
    assert set(grafana.state.alert_rules) == {"team-rule"}
    assert "alert rule sidecar-rank-stalled: deleted" in capsys.readouterr().out


def test_second_run_writes_nothing_and_says_unchanged(grafana, capsys):
    assert run(["--datasource-url", PROM_URL], token_env(grafana)) == 0
    writes_before = len(grafana.state.writes())
    capsys.readouterr()
    assert run(["--datasource-url", PROM_URL], token_env(grafana)) == 0
    assert len(grafana.state.writes()) == writes_before
    lines = capsys.readouterr().out.splitlines()
    objects = [line for line in lines if not line.startswith(("done", "alert rules: none"))]
    assert objects and all(line.endswith(": unchanged") for line in objects), lines
    assert lines[-1] == "done: everything unchanged"


def test_a_second_alerts_grafana_run_leaves_the_alert_rules_unchanged(grafana, capsys):
    assert run(["--datasource-url", PROM_URL, "--alerts", "grafana"], token_env(grafana)) == 0
    writes_before = len(grafana.state.writes())
    capsys.readouterr()
    assert run(["--datasource-url", PROM_URL, "--alerts", "grafana"], token_env(grafana)) == 0
    assert len(grafana.state.writes()) == writes_before
    assert "alert rule sidecar-rank-stalled: unchanged" in capsys.readouterr().out


def test_a_dashboard_edited_in_grafana_is_put_back(grafana, capsys):
    run(["--datasource-url", PROM_URL], token_env(grafana))
    stored = grafana.state.dashboards["sidecar-node-hardware"]["dashboard"]
    stored["title"] = "edited by hand"
    capsys.readouterr()
    assert run([], token_env(grafana)) == 0
    assert grafana.state.dashboards["sidecar-node-hardware"]["dashboard"]["title"] == "Node hardware"
    assert "dashboard sidecar-node-hardware: updated" in capsys.readouterr().out


def test_a_changed_datasource_url_is_updated_keeping_other_settings(grafana, capsys):
    run(["--datasource-url", PROM_URL], token_env(grafana))
    grafana.state.datasources["sidecar-prometheus"]["jsonData"]["tlsSkipVerify"] = True
    assert run(["--datasource-url", "http://other:9090", "--no-dashboards"], token_env(grafana)) == 0
    ds = grafana.state.datasources["sidecar-prometheus"]
    assert ds["url"] == "http://other:9090" and ds["jsonData"]["tlsSkipVerify"] is True
    assert "datasource sidecar-prometheus: updated" in capsys.readouterr().out


def test_alert_rules_have_grafanas_provisioning_shape(grafana):
    run(["--datasource-url", PROM_URL, "--alerts", "grafana"], token_env(grafana))
    rule = grafana.state.alert_rules["sidecar-rank-stalled"]
    assert rule["folderUID"] == "training-sidecar" and rule["ruleGroup"] == "sidecar-training"
    assert rule["condition"] == "C" and rule["for"] == "2m" and rule["orgID"] == 1
    assert rule["labels"] == {"severity": "critical"}
    assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
    a, b, c = rule["data"]
    assert a["datasourceUid"] == "sidecar-prometheus" and "sidecar_rank_state" in a["model"]["expr"]
    assert a["model"]["instant"] is True
    assert (b["model"]["type"], b["model"]["expression"], b["model"]["reducer"]) == ("reduce", "A", "last")
    assert (c["model"]["type"], c["model"]["expression"]) == ("threshold", "B")
    assert c["model"]["conditions"][0]["evaluator"] == {"type": "gt", "params": [0]}


@pytest.mark.system
def test_converted_alert_queries_are_valid_promql(tmp_path):
    from tests.alerts.realstack import Prometheus

    groups = provision.load_rule_groups(ROOT / "alerts")
    rules = provision.grafana_rules(groups, "f", "ds")
    with Prometheus(tmp_path).running() as prom:
        for rule in rules:
            answer = prom.query(rule["data"][0]["model"]["expr"])
            assert answer["status"] == "success", (rule["title"], answer.get("error"))


def test_rules_it_made_for_removed_alerts_are_deleted(grafana, capsys):
    run(["--datasource-url", PROM_URL, "--alerts", "grafana"], token_env(grafana))
    old = dict(grafana.state.alert_rules["sidecar-rank-stalled"], uid="sidecar-retired-alert", title="Retired")
    grafana.state.alert_rules["sidecar-retired-alert"] = old
    capsys.readouterr()
    assert run(["--alerts", "grafana"], token_env(grafana)) == 0
    assert "sidecar-rank-stalled" in grafana.state.alert_rules
    assert "sidecar-retired-alert" not in grafana.state.alert_rules
    assert "alert rule sidecar-retired-alert: deleted" in capsys.readouterr().out


def test_basic_auth_from_a_file_works(grafana, tmp_path):
    secret = tmp_path / "grafana-auth"
    secret.write_text("admin:s3cret\n")
    assert run(["--datasource-url", PROM_URL, "--basic-auth-file", str(secret)], {"GRAFANA_URL": grafana.url}) == 0
    assert grafana.state.dashboards


def test_token_from_a_file_works(grafana, tmp_path):
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    assert run(["--datasource-url", PROM_URL, "--token-file", str(secret), "--url", grafana.url], {}) == 0


def test_a_wrong_token_is_one_error_line_and_exit_1(grafana, capsys):
    assert run(["--datasource-url", PROM_URL], token_env(grafana, "wrong")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "401" in err[0] and "credentials" in err[0], err
    assert not grafana.state.writes()


def test_wrong_basic_auth_is_one_error_line_and_exit_1(grafana, capsys):
    env = {"GRAFANA_URL": grafana.url, "GRAFANA_USER": "admin", "GRAFANA_PASSWORD": "nope"}
    assert run([], env) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_read_only_token_is_one_error_line_and_exit_1(grafana, capsys):
    assert run(["--datasource-url", PROM_URL], token_env(grafana, "viewer")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "403" in err[0], err


def test_unreachable_grafana_is_one_error_line_and_exit_1(capsys):
    env = {"GRAFANA_URL": f"http://127.0.0.1:{free_port()}", "GRAFANA_TOKEN": TOKEN}
    assert run(["--timeout", "5"], env) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach Grafana" in err[0] and "refused" in err[0], err


def test_missing_datasource_without_url_is_a_clear_error(grafana, capsys):
    assert run(["--alerts", "grafana"], token_env(grafana)) == 1
    assert "--datasource-url" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, env, message",
    [
        ([], {"GRAFANA_TOKEN": TOKEN}, "no Grafana URL"),
        ([], {"GRAFANA_URL": "http://g:3000"}, "no Grafana credentials"),
        ([], {"GRAFANA_URL": "http://admin:pw@g:3000", "GRAFANA_TOKEN": TOKEN}, "must not hold credentials"),
        (["--token-file", "/nonexistent/token"], {"GRAFANA_URL": "http://g:3000"}, "cannot read token file"),
        (["--no-dashboards"], {"GRAFANA_URL": "http://g:3000", "GRAFANA_TOKEN": TOKEN}, "nothing to do"),
    ],
)
def test_bad_usage_exits_2_with_one_line(argv, env, message, capsys):
    assert run(argv, env) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_token_flag_does_not_exist(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser(["provision"]).parse_args(["provision", "--token", "x"])
    assert e.value.code == 2


@pytest.mark.system
def test_write_files_produces_grafana_provisioning_and_prometheus_rules(tmp_path, capsys):
    out = tmp_path / "out"
    assert run(["--write-files", str(out), "--datasource-url", PROM_URL], {}) == 0
    provider = yaml.safe_load((out / "grafana/provisioning/dashboards/training-sidecar.yaml").read_text())
    assert provider["apiVersion"] == 1 and provider["providers"][0]["type"] == "file"
    ds = yaml.safe_load((out / "grafana/provisioning/datasources/training-sidecar.yaml").read_text())
    assert ds["datasources"][0]["url"] == PROM_URL and ds["datasources"][0]["type"] == "prometheus"
    assert {p.name for p in (out / "grafana/dashboards").glob("*.json")} == {f"{d['uid']}.json" for d in dashboards()}
    rules = out / "prometheus/training-sidecar.rules.yml"
    check = subprocess.run(["/usr/bin/promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    capsys.readouterr()
    assert run(["--write-files", str(out), "--datasource-url", PROM_URL], {}) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.endswith(": unchanged") for line in lines), lines


def _rules_file(out) -> list[dict]:
    return [
        r
        for g in yaml.safe_load((out / "prometheus/training-sidecar.rules.yml").read_text())["groups"]
        for r in g["rules"]
    ]


def test_write_files_by_default_keeps_the_alerts_in_prometheus_and_writes_no_grafana_alerting(tmp_path):
    out = tmp_path / "out"
    assert run(["--write-files", str(out)], {}) == 0
    assert sorted(r["alert"] for r in _rules_file(out) if "alert" in r) == sorted(alert_names())
    assert not (out / "grafana/provisioning/alerting").exists()


def test_write_files_with_alerts_grafana_writes_the_api_paths_rules_and_prometheus_records_only(grafana, tmp_path):
    out = tmp_path / "out"
    assert run(["--write-files", str(out), "--alerts", "grafana"], {}) == 0
    assert run(["--datasource-url", PROM_URL, "--alerts", "grafana"], token_env(grafana)) == 0
    alerting = yaml.safe_load((out / "grafana/provisioning/alerting/training-sidecar.yaml").read_text())
    assert alerting["apiVersion"] == 1
    assert {g["folder"] for g in alerting["groups"]} == {"Training sidecar"}
    by_uid = {r["uid"]: (g["name"], r) for g in alerting["groups"] for r in g["rules"]}
    assert set(by_uid) == set(grafana.state.alert_rules)  # the file and the API path agree
    for uid, (group, rule) in by_uid.items():
        pushed = grafana.state.alert_rules[uid]
        assert pushed["ruleGroup"] == group
        assert {k: pushed[k] for k in rule} == rule
    records = _rules_file(out)
    assert records and all("record" in r for r in records)
    check = subprocess.run(
        ["/usr/bin/promtool", "check", "rules", str(out / "prometheus/training-sidecar.rules.yml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_console_script_runs_provision(tmp_path):
    out = subprocess.run(
        [PYTHON, "-m", "sidecar", "provision", "--write-files", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "prometheus/training-sidecar.rules.yml").exists()


# `sidecar ARGS...` in an interpreter where importing grafana_client fails as it does where the
# package is not installed (the daemon's install, without the `provision` extra).
WITHOUT_GRAFANA_CLIENT = """
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "grafana_client":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
from sidecar.cli import main
sys.exit(main(sys.argv[1:]))
"""


def without_grafana_client(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-c", WITHOUT_GRAFANA_CLIENT, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_without_grafana_client_provision_exits_2_naming_the_extra_to_install():
    out = without_grafana_client("provision", "--url", f"http://127.0.0.1:{free_port()}", env={"GRAFANA_TOKEN": TOKEN})
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("sidecar provision: error: ")
    assert "pip install 'training-sidecar[provision]'" in out.stderr


def test_without_grafana_client_write_files_still_works(tmp_path):
    out = without_grafana_client("provision", "--write-files", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "prometheus/training-sidecar.rules.yml").exists()


def test_grafana_client_is_installed_only_with_the_provision_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("grafana-client")]
    assert [d for d in project["optional-dependencies"]["provision"] if d.startswith("grafana-client")]


def test_dashboards_preselect_the_provisioned_datasource(grafana):
    run(["--datasource-url", PROM_URL], token_env(grafana))
    variables = grafana.state.dashboards["sidecar-training-job"]["dashboard"]["templating"]["list"]
    ds = next(v for v in variables if v["name"] == "datasource")
    assert ds["current"]["value"] == "sidecar-prometheus"


def test_a_dashboard_saved_by_someone_else_meanwhile_is_not_overwritten(grafana):
    from grafana_client import GrafanaApi

    run(["--datasource-url", PROM_URL], token_env(grafana))
    api = GrafanaApi.from_url(grafana.url, credential=TOKEN)
    read = api.dashboard.get_dashboard

    def read_then_someone_saves(uid):
        answer = read(uid)
        stored = grafana.state.dashboards[uid]["dashboard"]
        stored.update(version=stored["version"] + 1, title="saved by a colleague")
        return answer

    api.dashboard.get_dashboard = read_then_someone_saves
    changed = dict(dashboards()[0], description="new text")
    with pytest.raises(provision.ProvisionError, match="412"):
        provision.Provisioner(api, grafana.url, out=lambda line: None).dashboard(changed, "training-sidecar")
    assert grafana.state.dashboards[changed["uid"]]["dashboard"]["title"] == "saved by a colleague"
