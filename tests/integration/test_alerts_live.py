"""Alerts firing end to end: a real coordinator runs a run that no rollout replica and no learner ever
serve, a real Prometheus scrapes it with the repo's alert rules, and `RlfabricNoServingReplica` and
`RlfabricRunStalled` go pending, then firing, for that run; when the run is stopped its gauges go and
both alerts resolve.

The rules are a test-only copy of deploy/monitoring/alerts.yaml with every `for:` cut to a few seconds
(the real ones wait 5 to 30 minutes); the expressions, labels and annotations are the repo's. The
Prometheus server is `prometheus_server.py`'s.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_server import Prometheus, prometheus_server

from rlfabric.local.procs import ServiceProcess
from rlfabric.tools.dashboard_preview import api

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "alerts.yaml"
RUN_ID = "stuck"
EXPECTED = {"RlfabricNoServingReplica", "RlfabricRunStalled"}
"""The alerts a run without replicas and learner must raise."""
SHORT_FOR = "for: 3s"
DEADLINE_S = 90


def short_rules(folder: Path) -> Path:
    """The repo's rules with every `for:` duration cut to `SHORT_FOR`."""
    text, count = re.subn(r"for: \d+[smh]", SHORT_FOR, ALERTS.read_text())
    assert count == text.count("- alert:"), "every alert waits: each has a for:"
    folder.mkdir(parents=True)
    path = folder / "alerts.short.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    with prometheus_server(tmp_path / "prometheus", short_rules(tmp_path / "rules")) as server:
        yield server


@pytest.fixture
def coordinator(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> Iterator[str]:
    """A coordinator process over the test Redis (no reward service, replica or learner); its URL."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    (data / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {
        **os.environ,
        "RLFABRIC_COORDINATOR__DATA_ROOTS": json.dumps([str(data)]),
        "RLFABRIC_COORDINATOR__MODEL_ROOTS": json.dumps([str(tiny_model_dir.parent)]),
    }
    argv = [sys.executable, "-m", "rlfabric.cli", "serve", "coordinator", "--port", "0", "--insecure"]
    argv += ["--set", f"redis.url={redis_url}", "--set", "log.format=text"]
    proc = ServiceProcess("coordinator", argv, log_path=tmp_path / "coordinator.log", env=env)
    url = proc.start(r"listening on (http://\S+)", timeout_s=60).group(1)
    yield url
    proc.stop()


def post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def states(prometheus: Prometheus) -> dict[str, str]:
    """alert name -> state (pending, firing) of the run's active alerts."""
    alerts = api(prometheus.url, "/api/v1/alerts", {})["alerts"]
    return {a["labels"]["alertname"]: a["state"] for a in alerts if a["labels"].get("run_id") == RUN_ID}


def wait_for(prometheus: Prometheus, done: Any) -> list[dict[str, str]]:
    """Every distinct `states` seen until `done(states)` holds (AssertionError after `DEADLINE_S`)."""
    seen: list[dict[str, str]] = []
    deadline = time.monotonic() + DEADLINE_S
    while not (seen and done(seen[-1])):
        assert time.monotonic() < deadline, f"alert states seen: {seen}"
        now = states(prometheus)
        if not seen or now != seen[-1]:
            seen.append(now)
        time.sleep(0.5)
    return seen


def test_a_run_without_replicas_or_learner_fires_and_resolves_its_alerts(
    prometheus: Prometheus, coordinator: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    prometheus.publish({"coordinator": coordinator.removeprefix("http://")})
    spec = {"name": RUN_ID, "model": {"path": str(tiny_model_dir)}}
    spec["dataset"] = {"path": str(tmp_path / "data" / "prompts.jsonl")}
    assert post(f"{coordinator}/v1/runs", spec)["run_id"] == RUN_ID

    seen = wait_for(prometheus, lambda now: all(now.get(name) == "firing" for name in EXPECTED))
    assert any(s.get(name) == "pending" for s in seen for name in EXPECTED), seen  # `for:` was waited
    firing = api(prometheus.url, "/api/v1/alerts", {})["alerts"]
    (stalled,) = [a for a in firing if a["labels"]["alertname"] == "RlfabricRunStalled"]
    assert stalled["labels"]["severity"] == "critical"
    assert RUN_ID in stalled["annotations"]["summary"]

    post(f"{coordinator}/v1/runs/{RUN_ID}/stop")
    wait_for(prometheus, lambda now: not EXPECTED & set(now))
