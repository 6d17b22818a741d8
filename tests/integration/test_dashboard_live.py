"""The Grafana dashboard's queries against live data: a real Prometheus scrapes a short `rlfabric up` run.

`rlfabric up` runs the demo (tiny model, transformers engine) as real processes; each prints the URL of
its /metrics (the coordinator serves it on its API port), and the test hands those to a real `prometheus`
on loopback through a file_sd targets file (scrape and rule evaluation every second, the repo's
deploy/monitoring/alerts.yaml as its rules). Once the run is over, every target `expr` of every panel in
deploy/monitoring/grafana/rlfabric.json, with `$run_id` set to the run, is asked of Prometheus over the
run's span: each panel outside `MAY_BE_EMPTY` must have data from each of its targets (a metric missing
or misnamed fails here), and the alert rules must have loaded and evaluated without an error. Then
`python -m rlfabric.tools.dashboard_preview` draws the dashboard from the same Prometheus.

The Prometheus server is `prometheus_server.py`'s (the Debian package's binary: without it the test fails).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_server import Prometheus, prometheus_server

from rlfabric.tools.dashboard_preview import api, load_panels, query_range, run_variables

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "monitoring" / "grafana" / "rlfabric.json"
ALERTS = ROOT / "deploy" / "monitoring" / "alerts.yaml"
RUN_ID = "demo"
"""The run id `rlfabric up` gives the built-in demo."""
STEPS = 20
ENDPOINT = re.compile(r"rlfabric \w+ (?:metrics on|listening on) (http://[^/\s]+)")
"""A service's start line naming its /metrics (`... metrics on URL/metrics`), or the coordinator's HTTP
API (which serves /metrics); the gRPC services' "listening on" lines name no scheme."""
MAY_BE_EMPTY = {
    "Reward (train mean) and eval reward": {"rlfabric_learner_eval_reward_mean"},  # no eval in the span
    "Scorer errors per second": "all",
    "Coordinator HTTP 5xx per second": "all",
    "gRPC errors per second": "all",
}
"""Panels (or, by metric, some of their targets) a healthy short run may leave without data: errors that
did not happen, an evaluation that may fall outside the scraped span."""
NO_RULE_ERROR = ""
UNBUFFERED = {"PYTHONUNBUFFERED": "1"}


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    with prometheus_server(tmp_path / "prometheus", ALERTS) as server:
        yield server


def endpoints(logs: Path) -> dict[str, str]:
    """service -> host:port of its /metrics, from the start lines in `rlfabric up`'s logs so far."""
    found = {}
    for log in sorted(logs.glob("*.log")):
        if match := ENDPOINT.search(log.read_text(errors="replace")):
            found[log.stem] = match.group(1).removeprefix("http://")
    return found


def run_up(run_dir: Path, prometheus: Prometheus) -> tuple[float, float]:
    """`rlfabric up` on the demo, its services' metrics handed to Prometheus as they start; (start, end)."""
    cmd = [sys.executable, "-m", "rlfabric.cli", "up", "--run-dir", str(run_dir), "--steps", str(STEPS)]
    cmd += ["--engine", "transformers", "--no-progress"]
    output = run_dir.parent / "up.out"
    start = time.time()
    with output.open("w") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ | UNBUFFERED)
        published = follow(up, run_dir / "logs", prometheus, deadline=start + 600)
    assert up.returncode == 0, output.read_text()[-3000:]
    assert {"coordinator", "learner", "reward", "rollout-0"} <= set(published), published
    return start, time.time()


def follow(
    up: subprocess.Popen[bytes], logs: Path, prometheus: Prometheus, deadline: float
) -> dict[str, str]:
    """Hands each service's /metrics to Prometheus as it starts, until `up` ends (or is ended at the
    deadline); returns what was published."""
    published: dict[str, str] = {}
    try:
        while up.poll() is None and time.time() < deadline:
            found = endpoints(logs) if logs.is_dir() else {}
            if found != published:
                prometheus.publish(found)
                published = found
            time.sleep(0.2)
    finally:
        if up.poll() is None:
            up.terminate()
        up.wait(timeout=120)
    return published


def must_have_data(title: str, expr: str) -> bool:
    allowed = MAY_BE_EMPTY.get(title, set())
    return allowed != "all" and not any(metric in expr for metric in allowed)


def test_every_dashboard_panel_has_data_from_a_live_run(prometheus: Prometheus, tmp_path: Path) -> None:
    url = prometheus.url
    start, end = run_up(tmp_path / "run", prometheus)
    panels = load_panels(json.loads(DASHBOARD.read_text()), run_variables(RUN_ID))
    assert len(panels) >= 15

    empty = [
        (panel.title, target.expr)
        for panel in panels
        for target in panel.targets
        if must_have_data(panel.title, target.expr) and not query_range(url, target.expr, start, end, 1.0)
    ]
    assert empty == [], "dashboard queries without data:\n" + "\n".join(f"{t}: {e}" for t, e in empty)

    rules = [rule for group in api(url, "/api/v1/rules", {})["groups"] for rule in group["rules"]]
    assert len(rules) == ALERTS.read_text().count("- alert:")
    assert {(r["name"], r.get("lastError", NO_RULE_ERROR)) for r in rules if r["health"] != "ok"} == set()

    png = tmp_path / "dashboard.png"
    preview = [sys.executable, "-m", "rlfabric.tools.dashboard_preview", "--prometheus", url]
    preview += ["--dashboard", str(DASHBOARD), "--run-id", RUN_ID, "--out", str(png)]
    subprocess.run(preview, check=True, timeout=120)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 50_000  # a grid of drawn plots, not an empty canvas
