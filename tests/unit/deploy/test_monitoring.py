"""The monitoring files: the alert rules pass `promtool check rules` and their unit tests
(deploy/monitoring/alerts.test.yaml), the PrometheusRule and the dashboard ConfigMap carry the same
content as deploy/monitoring/, the ServiceMonitor and PodMonitors (CRDs the schemas lack, checked by hand)
select the real pods and ports, and every PromQL expression of the alerts and the dashboard parses and
names only metrics the services export (docs/metrics.md, whose names must be declared in src/).

promtool comes from the Debian package `prometheus`: without it these tests fail rather than skip.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_manifests import K8S, REPO, pod_template, render, render_path

MONITORING = REPO / "deploy" / "monitoring"
ALERTS = MONITORING / "alerts.yaml"
DASHBOARD = MONITORING / "grafana" / "rlfabric.json"
COMPONENT = K8S / "components" / "monitoring"
METRICS_DOC = REPO / "docs" / "metrics.md"
MONITORING_DOC = REPO / "docs" / "monitoring.md"
SEVERITIES = {"critical", "warning", "info"}
UNIT_TESTED = {"RlfabricRunStalled", "RlfabricNoServingReplica", "RlfabricRewardHackingSuspected"}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
PROMQL_WORDS |= {"group_left", "group_right", "inf", "nan"}


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    assert path is not None, "promtool is missing: apt-get install prometheus (scripts/bootstrap.sh does)"
    return subprocess.run([path, *map(str, args)], capture_output=True, text=True, timeout=120, check=False)


# --- the metric names the services export ----------------------------------------------------------------


@functools.cache
def documented_metrics() -> tuple[frozenset[str], frozenset[str]]:
    """(every family docs/metrics.md lists, the histograms among them)."""
    text = METRICS_DOC.read_text()
    text = re.sub(r"`(rlfabric_\w+?)_(\w+)` / `_(\w+)`", r"`\1_\2` `\1_\3`", text)  # `x_a` / `_b`
    names = frozenset(re.findall(r"`(rlfabric_\w+)(?:\{[^}`]*\})?`", text))
    histograms = frozenset(re.findall(r"^\| `(rlfabric_\w+)` \| histogram \|", text, re.M))
    return names, histograms


def exported(name: str) -> bool:
    names, histograms = documented_metrics()
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return name in names or base in histograms


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers, strings, grouping clauses and
    functions left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    tokens = re.findall(r"(?<![\w.])([A-Za-z_:][\w:]*)\b(?!\s*\()", expr)
    return {t for t in tokens if t.lower() not in PROMQL_WORDS and not re.fullmatch(r"\d+[smhdwy]", t)}


def test_documented_metrics_are_declared_in_the_code() -> None:
    names, histograms = documented_metrics()
    assert len(names) > 40 and "rlfabric_coordinator_http_request_duration_seconds" in histograms
    assert "rlfabric_rollout_engine_waiting" in names
    declared = set()
    for path in (REPO / "src" / "rlfabric").rglob("*.py"):
        declared |= set(re.findall(r'"(rlfabric_\w+)"', path.read_text()))
    assert names <= declared, f"documented but not declared: {sorted(names - declared)}"


def test_metric_names_of_an_expression() -> None:
    expr = 'sum by (scorer) (rate(rlfabric_reward_items_total{status=~"a|b"}[5m])) / on (x) up offset 5m'
    assert metric_names(expr) == {"rlfabric_reward_items_total", "up"}


# --- alerts -------------------------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", ALERTS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_alert_rules_pass_their_unit_tests() -> None:
    done = promtool("test", "rules", MONITORING / "alerts.test.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    cases = yaml.safe_load((MONITORING / "alerts.test.yaml").read_text())["tests"]
    fired = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired >= UNIT_TESTED, f"no unit test fires {sorted(UNIT_TESTED - fired)}"


def test_every_alert_waits_is_graded_and_points_to_its_runbook() -> None:
    doc = MONITORING_DOC.read_text()
    rules = alert_rules()
    assert {
        "RlfabricScorerErrorRateHigh",
        "RlfabricBacklogGrowing",
        "RlfabricWeightLoadSlow",
    } | UNIT_TESTED <= {r["alert"] for r in rules}
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert f"Runbook: docs/monitoring.md#{name.lower()}" in rule["annotations"]["description"], name
        assert re.search(rf"^### {name}$", doc, re.M), f"docs/monitoring.md has no section {name}"


def test_alerts_use_only_exported_metrics() -> None:
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert all(exported(n) for n in names), (
            f"{rule['alert']}: {sorted(n for n in names if not exported(n))}"
        )


def test_prometheus_rule_carries_the_same_groups() -> None:
    rule = yaml.safe_load((COMPONENT / "prometheusrule.yaml").read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert set(rule["spec"]) == {"groups"}
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text()), "edit prometheusrule.yaml with alerts.yaml"


def test_compose_prometheus_config_is_valid() -> None:
    done = promtool("check", "config", MONITORING / "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr


# --- monitors -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu() -> list[dict[str, Any]]:
    return render("gpu")


@pytest.fixture(scope="module")
def on_base(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The component on the bare base (as an overlay without it would add it)."""
    where = tmp_path_factory.mktemp("monitoring")
    kustomization = {
        "resources": [os.path.relpath(K8S / "base", where)],
        "components": [os.path.relpath(COMPONENT, where)],
        "configMapGenerator": [{"name": "rlfabric-run", "literals": ["run.yaml=name: demo"]}],
    }
    (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render_path(where)


def monitors(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("ServiceMonitor", "PodMonitor")}


def check_monitor_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """The fields of monitoring.coreos.com/v1 ServiceMonitor / PodMonitor we use, by hand; its endpoint."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    spec = obj["spec"]
    endpoints = "endpoints" if obj["kind"] == "ServiceMonitor" else "podMetricsEndpoints"
    assert set(spec) <= {"selector", endpoints, "namespaceSelector", "jobLabel", "podTargetLabels"}
    assert set(spec["selector"]) == {"matchLabels"}
    assert all(isinstance(v, str) for v in spec["selector"]["matchLabels"].values())
    (endpoint,) = spec[endpoints]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings"}
    assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+s", endpoint["interval"])
    return dict(endpoint)


JOB_INDEX = "batch.kubernetes.io/job-completion-index"
"""The label the Job controller puts on each pod of an Indexed Job (not in the pod template)."""


def selected_pods(objects: list[dict[str, Any]], labels: dict[str, str]) -> list[dict[str, Any]]:
    labels = {k: v for k, v in labels.items() if k != JOB_INDEX}
    pods = [pod_template(o) for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]
    return [p for p in pods if labels.items() <= p["metadata"]["labels"].items()]


def container_ports(pod: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}


@pytest.mark.parametrize("render_of", ["gpu", "on_base"])
def test_monitors_select_the_real_pods_and_metrics_ports(
    render_of: str, request: pytest.FixtureRequest
) -> None:
    objects = request.getfixturevalue(render_of)
    found = monitors(objects)
    assert set(found) == {f"rlfabric-{s}" for s in ("coordinator", "reward", "rollout", "learner")}
    coordinator = found["rlfabric-coordinator"]
    assert coordinator["kind"] == "ServiceMonitor"
    endpoint = check_monitor_fields(coordinator)
    services = [o for o in objects if o["kind"] == "Service"]
    labels = coordinator["spec"]["selector"]["matchLabels"]
    (service,) = [s for s in services if labels.items() <= s["metadata"].get("labels", {}).items()]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["port"] == 8000, "the coordinator serves /metrics on its API port"
    for name in ("reward", "rollout", "learner"):
        monitor = found[f"rlfabric-{name}"]
        assert monitor["kind"] == "PodMonitor"
        endpoint = check_monitor_fields(monitor)
        pods = selected_pods(objects, monitor["spec"]["selector"]["matchLabels"])
        assert pods, f"PodMonitor rlfabric-{name} selects no pod"
        for pod in pods:
            assert container_ports(pod)[endpoint["port"]] == 9090, name


def test_learner_monitor_scrapes_only_pod_zero(gpu: list[dict[str, Any]]) -> None:
    """Only global rank 0 serves /metrics; the Job controller labels an Indexed Job's pods with their
    index, which the pod template cannot carry (so it is checked against the Job's completion mode)."""
    labels = dict(monitors(gpu)["rlfabric-learner"]["spec"]["selector"]["matchLabels"])
    assert labels.pop(JOB_INDEX) == "0"
    jobs = [
        o
        for o in gpu
        if o["kind"] == "Job" and labels.items() <= pod_template(o)["metadata"]["labels"].items()
    ]
    assert [j["metadata"]["name"] for j in jobs] == ["rlfabric-learner"]
    assert jobs[0]["spec"]["completionMode"] == "Indexed"


# --- dashboard ------------------------------------------------------------------------------------------


@functools.cache
def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def graph_panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_is_templated_by_run() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    query = variables["run_id"]["query"]["query"]
    assert query.startswith("label_values(") and query.endswith(", run_id)")
    assert all(exported(n) for n in re.findall(r"rlfabric_\w+", query))
    assert variables["datasource"]["type"] == "datasource"


def test_every_panel_has_a_title_a_unit_and_queries() -> None:
    panels = graph_panels()
    assert len(panels) >= 15
    assert len({p["id"] for p in dashboard()["panels"]}) == len(dashboard()["panels"])
    for panel in panels:
        assert panel["title"] and panel["fieldConfig"]["defaults"]["unit"], panel["id"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]


def test_dashboard_queries_parse_and_use_exported_metrics(tmp_path: Path) -> None:
    rules = []
    for panel in graph_panels():
        for target in panel["targets"]:
            expr = target["expr"].replace("$run_id", "some-run")
            names = metric_names(expr)
            assert names and all(exported(n) for n in names), f"{panel['title']}: {sorted(names)}"
            if any(n.startswith(("rlfabric_learner_", "rlfabric_coordinator_desired")) for n in names):
                assert 'run_id=~"$run_id"' in target["expr"], f"{panel['title']} ignores the run variable"
            rules.append({"record": f"panel:{panel['id']}:{target['refId']}", "expr": expr})
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    done = promtool("check", "rules", path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_configmap_is_the_dashboard(gpu: list[dict[str, Any]]) -> None:
    assert (COMPONENT / "rlfabric.json").read_text() == DASHBOARD.read_text(), "copy rlfabric.json again"
    (configmap,) = [
        o for o in gpu if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"].get("labels", {})
    ]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["rlfabric.json"]) == dashboard()


def test_compose_provisioning_loads_the_dashboard() -> None:
    provisioning = MONITORING / "grafana" / "provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "rlfabric.yaml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/var/lib/grafana/")
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus"
