"""Every service's /metrics, scraped from real servers, passes `promtool check metrics` and our naming rules.

The reward service, a rollout replica (reference engine, tiny model) and the environment service run as
`rlfabric serve` processes with their metrics on a free port; the coordinator runs as a process too, over
the test Redis. Each is asked to do some work first, so that labelled families have samples. The learner's
step gauges are checked from a full metrics row (a learner process needs a whole run).

promtool comes from the Debian package `prometheus` (scripts/bootstrap.sh installs it): without it these
tests fail rather than skip, so that a CI machine lacking it cannot pass them silently.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rlfabric.local.ports import free_port
from rlfabric.local.procs import ServiceProcess
from rlfabric.reward.client import RewardClient
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

TOKEN = "metrics-lint-token"
METRICS_LINE = r"metrics on (http://\S+)"
UNIT_WORDS = {"seconds": ("duration", "latency", "seconds", "time"), "bytes": ("bytes", "size", "memory")}


def promtool() -> str:
    path = shutil.which("promtool")
    assert path is not None, "promtool is missing: apt-get install prometheus (scripts/bootstrap.sh does)"
    return path


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def families(text: str) -> dict[str, tuple[str, str]]:
    """name -> (type, help) of each family in an exposition."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    return {name: (kind, helps.get(name, "")) for name, kind in types.items()}


def convention_problems(name: str, kind: str, text: str) -> list[str]:
    """What promtool does not check: `_total` on counters (and only there), no `_fraction`/`_percent`,
    `_ratio` on a 0-1 share, the unit last where the name or help speaks of one."""
    problems = []
    base = name.removesuffix("_total")
    if (kind == "counter") != name.endswith("_total"):
        problems.append("_total is for counters, and every counter")
    if re.search(r"_(fraction|percent|pct)(_|$)", name) or name.endswith("_usage"):
        problems.append("a share is _ratio (0-1), not a fraction, percent or usage")
    if re.search(r"\b(fraction|share)\b", text, re.I) and not base.endswith("_ratio"):
        problems.append("its help says it is a share: end it in _ratio")
    for unit, words in UNIT_WORDS.items():
        if any(w in base.split("_") for w in words) and not base.endswith(f"_{unit}"):
            problems.append(f"name speaks of {unit}: end it in _{unit}")
    if re.search(r"_(ms|milliseconds|minutes|kb|mb|mib|gb)(_|$)", base):
        problems.append("base units only (seconds, bytes)")
    return problems


def check_exposition(text: str, expect: set[str]) -> None:
    """promtool's lint and our conventions over every family; `expect` must all be present."""
    run = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True)
    assert run.returncode == 0, f"promtool check metrics:\n{run.stdout}{run.stderr}"
    found = families(text)
    assert expect <= set(found), f"missing families: {sorted(expect - set(found))}"
    problems = {
        name: p
        for name, (kind, help_text) in found.items()
        if name.startswith("rlfabric_")
        and not name.endswith("_created")  # prometheus_client's creation time of a counter or histogram
        and (p := convention_problems(name, kind, help_text))
    }
    assert not problems, problems
    assert all(found_kind != "untyped" for found_kind, _ in found.values())


def start(name: str, argv: list[str], tmp: Path, env: dict[str, str]) -> tuple[ServiceProcess, str, str]:
    """(process, address, metrics url) of `rlfabric serve ...` started with its metrics on a free port."""
    cmd = [sys.executable, "-m", "rlfabric.cli", "serve", *argv, "--set", "server.metrics_port=0"]
    proc = ServiceProcess(name, cmd, log_path=tmp / f"{name}.log", env={**os.environ, **env})
    metrics = proc.start(METRICS_LINE, timeout_s=120).group(1)
    address = proc.wait_for(r"listening on (\S+)", timeout_s=120).group(1)
    return proc, address, metrics


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("metrics-lint")


@pytest.fixture(scope="module")
def reward(scratch: Path) -> Iterator[tuple[str, str]]:
    argv = ["reward", "--port", "0", "--set", "workers=1", "--set", "log.format=text"]
    proc, address, metrics = start("reward", argv, scratch, {"RLFABRIC_REWARD__TOKEN": TOKEN})
    yield address, metrics
    assert proc.stop() == 0


def test_promtool_is_installed() -> None:
    assert Path(promtool()).is_file()


def test_reward_metrics(reward: tuple[str, str]) -> None:
    address, metrics = reward
    with RewardClient(address, timeout_s=30, token=TOKEN) as client:
        client.score(
            [{"id": "a", "prompt": "q", "completion": "\\boxed{1}", "reference": "1"}], "math_verify"
        )
    text = scrape(metrics)
    check_exposition(text, {"rlfabric_reward_items_total", "rlfabric_grpc_server_handled_total"})


def test_rollout_metrics(scratch: Path, tiny_model_dir: Path, redis_url: str) -> None:
    argv = [
        "rollout",
        "--model",
        str(tiny_model_dir),
        "--engine",
        "transformers",
        "--port",
        "0",
        "--insecure",
    ]
    for setting in ("run_id=lint", f"redis.url={redis_url}", "replica_id=r0", "log.format=text"):
        argv += ["--set", setting]
    proc, address, metrics = start("rollout", argv, scratch, {})
    try:
        proc.wait_for(r"serving version", timeout_s=120)
        with grpc.insecure_channel(address) as channel:
            request = rollout_pb2.GenerateRequest(
                request_id="lint",
                prompts=[rollout_pb2.GeneratePrompt(prompt_id="p", prompt=common_pb2.Prompt(text="hi"))],
                sampling=rollout_pb2.SamplingParams(n=1, max_tokens=4, temperature=1.0),
            )
            list(rollout_pb2_grpc.RolloutServiceStub(channel).Generate(request, timeout=60))
        expect = {"rlfabric_rollout_kv_cache_usage_ratio", "rlfabric_rollout_busy_ratio"}
        check_exposition(scrape(metrics), expect | {"rlfabric_rollout_generated_tokens_total"})
    finally:
        assert proc.stop() == 0


def test_environment_metrics(scratch: Path) -> None:
    proc, _, metrics = start(
        "environment", ["environment", "--port", "0"], scratch, {"RLFABRIC_ENVIRONMENT__TOKEN": TOKEN}
    )
    try:
        check_exposition(scrape(metrics), {"rlfabric_environment_sessions_open"})
    finally:
        assert proc.stop() == 0


def test_coordinator_metrics(scratch: Path, redis_url: str) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "rlfabric.cli", "serve", "coordinator", "--port", str(port)]
    argv += ["--set", f"redis.url={redis_url}", "--insecure"]
    proc = ServiceProcess("coordinator", argv, log_path=scratch / "coordinator.log")
    proc.start(r"listening on (http://\S+)", timeout_s=120)
    base = f"http://127.0.0.1:{port}"
    try:
        scrape(f"{base}/healthz")
        with pytest.raises(urllib.error.HTTPError):
            scrape(f"{base}/v1/runs/no-such-run")
        text = scrape(f"{base}/metrics")
    finally:
        proc.stop()  # uvicorn ends on SIGTERM by the signal
    check_exposition(text, {"rlfabric_coordinator_http_requests_total"})
    assert 'route="/healthz",status="200"' in text
    assert 'route="/v1/runs/{run_id}"' in text and "no-such-run" not in text  # the template, not the path
    assert "rlfabric_reward_" not in text, "the coordinator exports only what it measures"


def test_learner_gauges() -> None:
    from rlfabric.learner.gauges import GAUGES, export_row
    from rlfabric.runtime.metrics import metrics_response

    export_row("lint", {key: 0.5 for key in GAUGES})
    text = metrics_response()[0].decode()
    check_exposition(text, {g._name for g in GAUGES.values()})
    assert "rlfabric_learner_step_metric" not in text
