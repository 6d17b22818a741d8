"""The coordinator's REST API over a real Redis: every route, every error, restart survival, the page."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pydantic import BaseModel
from redis.asyncio import Redis

from rlfabric.contracts.metrics import append_row
from rlfabric.coordinator import runs_cli
from rlfabric.coordinator.api import HealthBody, MetricsPage, RunList, RunStatus, SubmittedRun, create_app
from rlfabric.coordinator.api_errors import ErrorBody, ValidationErrorBody
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.fleet_api import FleetBody
from rlfabric.coordinator.manager import RunManager
from rlfabric.coordinator.plan_api import PlanBody
from rlfabric.coordinator.prefs_builds import BuildList, BuildRecord
from rlfabric.coordinator.runs import RunRecord, RunStore
from rlfabric.runspec import MAX_TOKENS
from rlfabric.runtime import telemetry

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC: dict[str, Any] = {"model": {"path": "tiny"}, "dataset": {"path": "prompts.jsonl"}}


def make_config(redis_url: str, token: str | None = TOKEN, **extra: Any) -> CoordinatorServiceConfig:
    return CoordinatorServiceConfig.model_validate(
        {"api": {"token": token, "max_body_bytes": 4096}, "redis": {"url": redis_url}, **extra}
    )


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def hooks() -> dict[str, list[str]]:
    return {"submitted": [], "stopped": []}


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator")


@pytest.fixture
async def client(
    redis_url: str, redis: Redis, hooks: dict[str, list[str]], tmp_path: Path
) -> AsyncIterator[httpx.AsyncClient]:
    async def on_submit(record: RunRecord) -> None:
        hooks["submitted"].append(record.run_id)

    async def on_stop(record: RunRecord) -> None:
        hooks["stopped"].append(record.run_id)

    prefs = {"work_dir": str(tmp_path / "builds"), "store": str(tmp_path / "store"), "max_queued": 1}
    config = make_config(redis_url, prefs=prefs)
    app = create_app(config, redis, on_submit=on_submit, on_stop=on_stop)
    async with client_for(app) as c:
        yield c
    await app.state.prefs_builds.close()


async def submit(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await client.post("/v1/runs", json={**SPEC, **fields}, headers=AUTH)
    assert response.status_code == 201, response.text
    return response.json()


async def test_submit_get_and_list(client: httpx.AsyncClient, hooks: dict[str, list[str]]) -> None:
    created = await submit(client, name="alpha")
    assert created["run_id"] == "alpha" and created["state"] == "pending"
    assert hooks["submitted"] == ["alpha"]
    anonymous = await submit(client)
    status = (await client.get("/v1/runs/alpha", headers=AUTH)).json()
    assert status["state"] == "pending" and status["step"] == 0 and status["latest_metrics"] is None
    assert status["counters"]["groups_queued"] == 0 and status["warnings"] == []
    listed = (await client.get("/v1/runs", headers=AUTH)).json()["runs"]
    assert [r["run_id"] for r in listed] == [anonymous["run_id"], "alpha"]
    only = (await client.get("/v1/runs", params={"state": "running"}, headers=AUTH)).json()["runs"]
    assert only == []


async def test_requests_are_server_spans_named_by_route(client: httpx.AsyncClient) -> None:
    """HTTP semantic conventions: "{method} {route}" (the template), continuing the caller's trace."""
    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("test", exporter=exporter)
    try:
        with telemetry.span("caller") as caller:
            headers = telemetry.inject_headers(dict(AUTH))
            await client.get("/v1/runs/nope", headers=headers)
        await client.get("/no/such/route")
    finally:
        telemetry.shutdown_tracing()
    spans = {s.name: s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER}
    found = spans["GET /v1/runs/{run_id}"]
    assert found.context.trace_id == caller.get_span_context().trace_id
    assert dict(found.attributes or {}) == {
        "http.request.method": "GET",
        "http.route": "/v1/runs/{run_id}",
        "url.path": "/v1/runs/nope",
        "http.response.status_code": 404,
    }
    assert "http.route" not in (spans["GET"].attributes or {})
    assert (spans["GET"].attributes or {})["http.response.status_code"] == 404


async def test_status_shows_progress_counters_metrics_and_warnings(
    client: httpx.AsyncClient, redis: Redis
) -> None:
    await submit(client, name="beta")
    store = RunStore(redis)
    await store.set_state("beta", "running")
    await store.update_progress("beta", step=10, policy_version=10)
    await store.incr("beta", "groups_queued", 12)
    for step in range(1, 11):
        collapsed = 1.0 if step <= 5 else 0.001
        await append_row(store.redis, "beta", {"step": step, "reward_mean": 0.5, "entropy": collapsed})
    status = (await client.get("/v1/runs/beta", headers=AUTH)).json()
    assert (status["state"], status["step"], status["policy_version"]) == ("running", 10, 10)
    assert status["counters"]["groups_queued"] == 12
    assert status["latest_metrics"]["step"] == 10
    assert any("entropy collapse" in w for w in status["warnings"])


async def test_metrics_series_round_trip(client: httpx.AsyncClient, redis: Redis) -> None:
    await submit(client, name="gamma")
    rows = [{"step": s, "reward_mean": s / 10, "kl": 0.01 * s} for s in range(1, 6)]
    for row in rows:  # as the learner writes them
        await redis.xadd("rlfabric:gamma:metrics", {"row": json.dumps(row)})
    page = (await client.get("/v1/runs/gamma/metrics", headers=AUTH)).json()
    assert [{k: v for k, v in r.items() if k != "_id"} for r in page["rows"]] == rows
    assert page["last_id"] == page["rows"][-1]["_id"]
    since = page["rows"][2]["_id"]
    later = (await client.get("/v1/runs/gamma/metrics", params={"since": since}, headers=AUTH)).json()
    assert [r["step"] for r in later["rows"]] == [4, 5]
    empty = (
        await client.get("/v1/runs/gamma/metrics", params={"since": page["last_id"]}, headers=AUTH)
    ).json()
    assert empty["rows"] == [] and empty["last_id"] == page["last_id"]
    bad = await client.get("/v1/runs/gamma/metrics", params={"since": "x"}, headers=AUTH)
    assert bad.status_code == 422


async def test_stop(client: httpx.AsyncClient, redis: Redis, hooks: dict[str, list[str]]) -> None:
    await submit(client, name="pending-one")
    stopped = await client.post("/v1/runs/pending-one/stop", headers=AUTH)
    assert stopped.status_code == 202 and stopped.json()["state"] == "stopped"
    assert hooks["stopped"] == ["pending-one"]
    again = await client.post("/v1/runs/pending-one/stop", headers=AUTH)
    assert again.status_code == 409 and "finished" in again.json()["detail"]
    await submit(client, name="running-one")
    await RunStore(redis).set_state("running-one", "running")
    flagged = (await client.post("/v1/runs/running-one/stop", headers=AUTH)).json()
    assert flagged["state"] == "running" and flagged["stop_requested"] is True


async def test_unknown_run_is_404(client: httpx.AsyncClient) -> None:
    for method, path in (
        ("GET", "/v1/runs/nope"),
        ("GET", "/v1/runs/nope/metrics"),
        ("POST", "/v1/runs/nope/stop"),
    ):
        response = await client.request(method, path, headers=AUTH)
        assert response.status_code == 404, (method, path)
        assert "nope" in response.json()["detail"]


async def test_duplicate_name_is_409(client: httpx.AsyncClient) -> None:
    await submit(client, name="dup")
    response = await client.post("/v1/runs", json={**SPEC, "name": "dup"}, headers=AUTH)
    assert response.status_code == 409 and "dup" in response.json()["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"dataset": {"path": "p.jsonl"}}, "body.model"),
        ({**SPEC, "model": {}}, "body.model.path"),
        ({**SPEC, "rollout": {"sampling": {"temperature": -1}}}, "body.rollout.sampling.temperature"),
        ({**SPEC, "algorithm": {"advantage": "nope"}}, "body.algorithm.advantage"),
        ({**SPEC, "tpyo": 1}, "body.tpyo"),
        ({**SPEC, "name": "bad name!"}, "body.name"),
    ],
)
async def test_invalid_spec_is_422_naming_the_field(client: httpx.AsyncClient, body: Any, field: str) -> None:
    response = await client.post("/v1/runs", json=body, headers=AUTH)
    assert response.status_code == 422
    answer = response.json()
    assert field in answer["message"]
    assert any(".".join(map(str, e["loc"])) == field for e in answer["detail"])


async def test_cross_field_rule_is_422_with_its_message(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/runs", json={**SPEC, "rollout": {"sampling": {"n": 1}}}, headers=AUTH)
    assert response.status_code == 422 and "rollout.sampling.n" in response.json()["message"]


async def test_malformed_json_is_422(client: httpx.AsyncClient) -> None:
    headers = {**AUTH, "Content-Type": "application/json"}
    response = await client.post("/v1/runs", content=b"{not json", headers=headers)
    assert response.status_code == 422


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
async def test_v1_needs_the_token(client: httpx.AsyncClient, headers: dict[str, str]) -> None:
    for method, path in (("GET", "/v1/runs"), ("GET", "/v1/runs/x"), ("POST", "/v1/runs/x/stop")):
        response = await client.request(method, path, headers=headers)
        assert response.status_code == 401, (method, path)
        assert response.headers["www-authenticate"] == "Bearer"
    assert (await client.post("/v1/runs", json=SPEC, headers=headers)).status_code == 401


async def test_no_token_configured_means_open(redis_url: str, redis: Redis) -> None:
    async with client_for(create_app(make_config(redis_url, token=None), redis)) as c:
        assert (await c.post("/v1/runs", json=SPEC)).status_code == 201
        assert (await c.get("/v1/runs")).status_code == 200


async def test_body_over_the_limit_is_413(client: httpx.AsyncClient) -> None:
    big = {**SPEC, "dataset": {"path": "p" * 5000}}
    announced = await client.post("/v1/runs", json=big, headers=AUTH)
    assert announced.status_code == 413

    async def chunks() -> AsyncIterator[bytes]:  # streamed: no Content-Length
        for _ in range(10):
            yield b" " * 1000

    streamed = await client.post(
        "/v1/runs", content=chunks(), headers={**AUTH, "Content-Type": "application/json"}
    )
    assert streamed.status_code == 413
    assert "4096" in streamed.json()["detail"]


async def test_runs_survive_an_app_restart(redis_url: str) -> None:
    config = make_config(redis_url)
    first = create_app(config)  # owns its Redis client
    async with first.router.lifespan_context(first), client_for(first) as c:
        created = await submit(c, name="durable")
        await c.post("/v1/runs/durable/stop", headers=AUTH)
    second = create_app(config)
    async with second.router.lifespan_context(second), client_for(second) as c:
        status = (await c.get("/v1/runs/durable", headers=AUTH)).json()
        assert status["run_id"] == created["run_id"] and status["state"] == "stopped"
        assert status["spec"] == created["spec"]
        assert [r["run_id"] for r in (await c.get("/v1/runs", headers=AUTH)).json()["runs"]] == ["durable"]


async def test_submit_hook_failure_marks_the_run_failed(redis_url: str, redis: Redis) -> None:
    async def broken(_: RunRecord) -> None:
        raise RuntimeError("no replicas")

    app = create_app(make_config(redis_url), redis, on_submit=broken)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
        response = await c.post("/v1/runs", json={**SPEC, "name": "doomed"}, headers=AUTH)
        assert response.status_code == 500
    record = await RunStore(redis).get("doomed")
    assert record.state == "failed" and "no replicas" in (record.error or "")


async def test_public_routes_need_no_token(client: httpx.AsyncClient) -> None:
    health = await client.get("/healthz")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    await submit(client, name="m")
    metrics = await client.get("/metrics")
    assert metrics.status_code == 200 and "text/plain" in metrics.headers["content-type"]
    assert 'rlfabric_coordinator_api_runs_total{action="submit"}' in metrics.text
    docs = await client.get("/docs")
    assert docs.status_code == 200
    schema = (await client.get("/openapi.json")).json()
    assert {"/v1/runs", "/v1/runs/{run_id}", "/v1/runs/{run_id}/metrics", "/v1/runs/{run_id}/stop"} <= set(
        schema["paths"]
    )


async def test_healthz_is_503_without_redis() -> None:
    config = make_config("redis://127.0.0.1:1/0")
    app = create_app(config)
    async with app.router.lifespan_context(app), client_for(app) as c:
        response = await c.get("/healthz")
    assert response.status_code == 503 and response.json()["status"] == "unavailable"


async def test_run_page_is_self_contained(client: httpx.AsyncClient) -> None:
    response = await client.get("/runs/alpha")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    assert 'data-run-id="alpha"' in page
    assert 'createElement("canvas")' in page and 'getContext("2d")' in page
    for key in (
        "reward_mean",
        "eval_reward_mean",
        "kl",
        "entropy",
        "response_length_mean",
        "clip_fraction",
        "tokens_per_s",
        "rollout_busy_fraction",
        "staleness_mean",
    ):
        assert key in page
    assert "/v1/runs/" in page and "/metrics" in page and "2000" in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page


async def test_run_page_escapes_the_run_id(client: httpx.AsyncClient) -> None:
    page = (await client.get('/runs/"><img src=x onerror=alert(1)>')).text
    assert "<img" not in page and "&quot;&gt;&lt;img" in page


# --- the `rlfabric runs` CLI against a real server on loopback ------------------------------------------


@pytest.fixture
def served(redis_url: str) -> Iterator[str]:
    """The app under uvicorn on an ephemeral loopback port, in a thread this fixture stops; yields its URL."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(make_config(redis_url)), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="rlfabric runs")
    runs_cli.add_arguments(parser)
    return runs_cli.run(parser.parse_args(list(argv)))


def test_cli_submit_list_status_stop(served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text('[model]\npath = "tiny"\n\n[dataset]\npath = "p.jsonl"\n')
    auth = ("--url", served, "--token", TOKEN)
    assert cli("submit", str(run_file), "--name", "cli-run", *auth) == 0
    assert capsys.readouterr().out.strip() == "cli-run"
    assert cli("list", "--json", *auth) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == ["cli-run"]
    assert cli("status", "cli-run", "--json", *auth) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "pending"
    assert cli("list", *auth) == 0 and "cli-run" in capsys.readouterr().out
    assert cli("stop", "cli-run", *auth) == 0 and "stopped" in capsys.readouterr().out
    assert cli("status", "cli-run", *auth) == 0 and "stopped" in capsys.readouterr().out


def test_cli_errors(served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"dataset": {"path": "p.jsonl"}}))
    assert cli("submit", str(bad), "--url", served, "--token", TOKEN) == 1
    assert "body.model: Field required" in capsys.readouterr().err
    assert cli("status", "nope", "--url", served, "--token", TOKEN) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert cli("list", "--url", served, "--token", "wrong") == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert cli("list", "--url", "http://127.0.0.1:1", "--token", TOKEN) == 2
    assert cli("submit", str(tmp_path / "missing.toml"), "--url", served) == 2


# --- attacks: paths outside the roots, file contents in errors, absurd sizes, lax types, bad stream ids --


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """tmp/{data/prompts.jsonl, data/creds.json, models/m/, secrets/aws.json, data/escape -> secrets}."""
    for folder in ("data", "models/m", "secrets"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "data" / "prompts.jsonl").write_text('{"prompt": "say x"}\n')
    (tmp_path / "data" / "creds.json").write_text('{"aws_secret_access_key": "wJalrXUtnFEMI"}\n')
    (tmp_path / "secrets" / "aws.json").write_text('{"aws_secret_access_key": "wJalrXUtnFEMI"}\n')
    (tmp_path / "data" / "escape").symlink_to(tmp_path / "secrets")
    return tmp_path


@pytest.fixture
async def confined(redis_url: str, redis: Redis, tree: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The app with data_roots = [tmp/data] and model_roots = [tmp/models], its runs driven by the real
    RunManager (so a submitted run loads its dataset)."""
    roots = {"data_roots": [str(tree / "data")], "model_roots": [str(tree / "models")]}
    config = make_config(redis_url, **roots)
    manager = RunManager(config, redis)
    app = create_app(config, redis, on_submit=manager.on_submit, on_stop=manager.on_stop)
    async with client_for(app) as c:
        yield c
    for task in manager.tasks.values():
        task.cancel()


def paths(tree: Path, dataset: str = "data/prompts.jsonl", **model: str) -> dict[str, Any]:
    model_paths = {"path": str(tree / "models" / "m"), **{k: str(tree / v) for k, v in model.items()}}
    return {"model": model_paths, "dataset": {"path": str(tree / dataset)}}


@pytest.mark.parametrize(
    ("dataset", "model", "field"),
    [
        ("secrets/aws.json", {}, "body.dataset.path"),  # exists, outside
        ("secrets/missing.json", {}, "body.dataset.path"),  # does not exist, outside: the same answer
        ("data/../secrets/aws.json", {}, "body.dataset.path"),
        ("data/escape/aws.json", {}, "body.dataset.path"),  # a symlink in the root pointing out
        ("data/prompts.jsonl", {"path": "secrets"}, "body.model.path"),
        ("data/prompts.jsonl", {"reference_path": "models/../secrets"}, "body.model.reference_path"),
        ("data/prompts.jsonl", {"critic_path": "data/escape"}, "body.model.critic_path"),
    ],
)
async def test_paths_outside_the_roots_are_422_naming_the_field(
    confined: httpx.AsyncClient, tree: Path, dataset: str, model: dict[str, str], field: str
) -> None:
    response = await confined.post("/v1/runs", json=paths(tree, dataset, **model), headers=AUTH)
    assert response.status_code == 422, response.text
    answer = response.json()
    assert [".".join(map(str, e["loc"])) for e in answer["detail"]] == [field]
    assert answer["detail"][0]["type"] == "path_not_allowed"
    assert "aws" not in response.text and "missing" not in response.text and str(tree) not in response.text
    assert (await confined.get("/v1/runs", headers=AUTH)).json()["runs"] == []  # nothing was stored


async def test_probing_outside_the_roots_learns_nothing(confined: httpx.AsyncClient, tree: Path) -> None:
    """An existing and a missing file outside the roots get byte-identical answers."""
    there = await confined.post("/v1/runs", json=paths(tree, "secrets/aws.json"), headers=AUTH)
    absent = await confined.post("/v1/runs", json=paths(tree, "secrets/nope.json"), headers=AUTH)
    assert (there.status_code, there.content) == (absent.status_code, absent.content)


async def test_paths_inside_the_roots_and_hub_ids_are_accepted(
    confined: httpx.AsyncClient, tree: Path
) -> None:
    body = paths(tree, "data/prompts.jsonl", reference_path="models/m/../m")
    assert (await confined.post("/v1/runs", json={**body, "name": "inside"}, headers=AUTH)).status_code == 201
    hub = {**body, "name": "hub", "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}}
    assert (await confined.post("/v1/runs", json=hub, headers=AUTH)).status_code == 201


async def wait_final(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status = (await client.get(f"/v1/runs/{run_id}", headers=AUTH)).json()
        if status["state"] in ("failed", "completed", "stopped"):
            return dict(status)
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id} did not finish: {status}")


async def test_a_run_on_a_foreign_json_file_fails_without_its_keys(
    confined: httpx.AsyncClient, tree: Path
) -> None:
    """The attack: a one-line JSON file (inside the roots) as the dataset; the run's error used to list its
    top-level keys. Now it names the field and the problem only."""
    body = {**paths(tree, "data/creds.json"), "name": "probe"}
    assert (await confined.post("/v1/runs", json=body, headers=AUTH)).status_code == 201
    status = await wait_final(confined, "probe")
    assert status["state"] == "failed"
    assert status["error"].startswith("dataset.prompt_field") and "row 1" in status["error"]
    assert "aws_secret_access_key" not in status["error"] and "wJalr" not in status["error"]


@pytest.mark.parametrize(
    ("section", "fields", "field"),
    [
        (
            "model",
            {"path": "tiny", "max_model_len": 197_000_000_000_000_000_000_000},
            "body.model.max_model_len",
        ),
        ("train", {"groups_per_step": 47_000_000_000_000}, "body.train.groups_per_step"),
        ("train", {"micro_batch_size": True}, "body.train.micro_batch_size"),  # was coerced to 1
        ("train", {"steps": "10"}, "body.train.steps"),
        ("train", {"seed": 2**70}, "body.train.seed"),
        ("optim", {"lr": "0.1"}, "body.optim.lr"),
        ("rollout", {"dynamic_sampling": 1}, "body.rollout.dynamic_sampling"),
        ("rollout", {"sampling": {"n": 4.0}}, "body.rollout.sampling.n"),
    ],
)
async def test_absurd_sizes_and_lax_types_are_422(
    client: httpx.AsyncClient, section: str, fields: dict[str, Any], field: str
) -> None:
    response = await client.post("/v1/runs", json={**SPEC, section: fields}, headers=AUTH)
    assert response.status_code == 422, response.text
    assert [".".join(map(str, e["loc"])) for e in response.json()["detail"]] == [field]


async def test_sizes_at_the_bound_are_accepted(client: httpx.AsyncClient) -> None:
    model = {"path": "tiny", "max_model_len": MAX_TOKENS}
    assert (await client.post("/v1/runs", json={**SPEC, "model": model}, headers=AUTH)).status_code == 201
    over = {**model, "max_model_len": MAX_TOKENS + 1}
    assert (await client.post("/v1/runs", json={**SPEC, "model": over}, headers=AUTH)).status_code == 422


@pytest.mark.parametrize(
    "since",
    [
        "99999999999999999999999-0",  # the 500 (Redis: Invalid stream ID)
        "18446744073709551616-0",  # 2**64
        "1-18446744073709551616",
        "x",
        "-",
        "+",
        "1-2-3",
        "",
        "1" * 42,
    ],
)
async def test_since_that_is_not_a_stream_id_is_422_naming_since(
    client: httpx.AsyncClient, since: str
) -> None:
    await submit(client, name="s")
    response = await client.get("/v1/runs/s/metrics", params={"since": since}, headers=AUTH)
    assert response.status_code == 422, response.text
    assert [e["loc"] for e in response.json()["detail"]] == [["query", "since"]]
    assert "query.since" in response.json()["message"]


@pytest.mark.parametrize("since", ["18446744073709551615-18446744073709551615", "18446744073709551615", "0"])
async def test_since_at_the_ends_of_the_range_is_answered(
    client: httpx.AsyncClient, redis: Redis, since: str
) -> None:
    await submit(client, name="ends")
    await append_row(redis, "ends", {"step": 1})
    response = await client.get("/v1/runs/ends/metrics", params={"since": since}, headers=AUTH)
    assert response.status_code == 200, response.text
    assert len(response.json()["rows"]) == (1 if since == "0" else 0)


async def test_run_ids_are_bounded(client: httpx.AsyncClient) -> None:
    for path in ("/v1/runs/" + "a" * 65, "/v1/runs/bad%20id", "/v1/runs/-x/metrics", "/v1/runs/.x/stop"):
        method = "POST" if path.endswith("/stop") else "GET"
        response = await client.request(method, path, headers=AUTH)
        assert response.status_code == 422, path
        assert response.json()["detail"][0]["loc"] == ["path", "run_id"]


# --- the OpenAPI document against what the app answers ---------------------------------------------------

BODY_MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m
    for m in (ErrorBody, ValidationErrorBody, HealthBody, RunRecord, RunList, RunStatus, MetricsPage)
}
BODY_MODELS.update({m.__name__: m for m in (BuildRecord, BuildList, PlanBody, SubmittedRun, FleetBody)})
"""The document's schema names -> the models that check a response body."""

TOO_LARGE = {"Content-Length": "5000", "Content-Type": "application/json"}


async def streamed() -> AsyncIterator[bytes]:
    """A body over the limit (4096 bytes) without Content-Length: 413 once the route reads past it."""
    for _ in range(5):
        yield b" " * 1000


PIPELINE = {"name": "probe", "source": {"kind": "file", "path": "examples/prefs/pairs.jsonl"}}
"""A pipeline without judges: its build only reads, cleans and writes (prefs.max_queued = 1)."""


async def prefs_probes(
    call: Any, oversize: dict[str, Any], run_auth: dict[str, str]
) -> dict[tuple[str, str], list[httpx.Response]]:
    """The answers of the /v1/prefs routes: the first build is still running when the second comes (429);
    a run's token (`run_auth`) is refused (403)."""
    queued = await call("POST", "/v1/prefs/builds", json=PIPELINE)
    build = f"/v1/prefs/builds/{queued.json()['build_id']}"
    return {
        ("post", "/v1/prefs/builds"): [
            queued,
            await call("POST", "/v1/prefs/builds", json=PIPELINE),
            await call("POST", "/v1/prefs/builds", {}, json=PIPELINE),
            await call("POST", "/v1/prefs/builds", run_auth, json=PIPELINE),
            await call("POST", "/v1/prefs/builds", **oversize),
            await call("POST", "/v1/prefs/builds", content=streamed()),
            await call(
                "POST", "/v1/prefs/builds", json={**PIPELINE, "source": {"kind": "file", "path": "/etc"}}
            ),
        ],
        ("get", "/v1/prefs/builds"): [
            await call("GET", "/v1/prefs/builds"),
            await call("GET", "/v1/prefs/builds", {}),
            await call("GET", "/v1/prefs/builds", run_auth),
            await call("GET", "/v1/prefs/builds", **oversize),
            await call("GET", "/v1/prefs/builds", params={"limit": 0}),
        ],
        ("get", "/v1/prefs/builds/{build_id}"): [
            await call("GET", build),
            await call("GET", build, {}),
            await call("GET", build, run_auth),
            await call("GET", build, **oversize),
            await call("GET", "/v1/prefs/builds/" + "0" * 16),
            await call("GET", "/v1/prefs/builds/nope"),
        ],
    }


async def probes(client: httpx.AsyncClient) -> dict[tuple[str, str], list[httpx.Response]]:
    """Each route of the document, by (method, path template), and its answers to requests meant to draw
    every status it can give: success, no token, another run's token, a body over the limit, an unknown
    run, an invalid input, a conflict."""
    done = await submit(client, name="done")
    other = {"Authorization": f"Bearer {done['run_token']}"}
    await client.post("/v1/runs/done/stop", headers=AUTH)
    await submit(client, name="live")

    async def call(
        method: str, path: str, headers: dict[str, str] | None = None, **kw: Any
    ) -> httpx.Response:
        return await client.request(method, path, headers=AUTH if headers is None else headers, **kw)

    oversize = {"content": b"x" * 5000, "headers": {**AUTH, **TOO_LARGE}}
    return {
        ("post", "/v1/runs"): [
            await call("POST", "/v1/runs", json={**SPEC, "name": "new"}),
            await call("POST", "/v1/runs", {}, json=SPEC),
            await call("POST", "/v1/runs", other, json={**SPEC, "name": "by-a-run"}),
            await call("POST", "/v1/runs", **oversize),
            await call("POST", "/v1/runs", content=streamed()),
            await call("POST", "/v1/runs", json={**SPEC, "name": "live"}),
            await call("POST", "/v1/runs", json={**SPEC, "model": {"path": "/etc"}}),
            await call("POST", "/v1/runs", json={**SPEC, "train": {"steps": True}}),
        ],
        ("get", "/v1/runs"): [
            await call("GET", "/v1/runs"),
            await call("GET", "/v1/runs", {}),
            await call("GET", "/v1/runs", **oversize),
            await call("GET", "/v1/runs", params={"limit": 0}),
            await call("GET", "/v1/runs", params={"state": "nope"}),
        ],
        ("get", "/v1/runs/{run_id}"): [
            await call("GET", "/v1/runs/live"),
            await call("GET", "/v1/runs/live", {}),
            await call("GET", "/v1/runs/live", other),
            await call("GET", "/v1/runs/live", **oversize),
            await call("GET", "/v1/runs/nope"),
            await call("GET", "/v1/runs/bad%20id"),
        ],
        ("get", "/v1/runs/{run_id}/metrics"): [
            await call("GET", "/v1/runs/live/metrics"),
            await call("GET", "/v1/runs/live/metrics", {}),
            await call("GET", "/v1/runs/live/metrics", other),
            await call("GET", "/v1/runs/live/metrics", **oversize),
            await call("GET", "/v1/runs/nope/metrics"),
            await call("GET", "/v1/runs/live/metrics", params={"since": "99999999999999999999999-0"}),
            await call("GET", "/v1/runs/live/metrics", params={"limit": 0}),
        ],
        ("get", "/v1/runs/{run_id}/plan"): [
            await call("GET", "/v1/runs/live/plan"),
            await call("GET", "/v1/runs/live/plan", {}),
            await call("GET", "/v1/runs/live/plan", other),
            await call("GET", "/v1/runs/live/plan", **oversize),
            await call("GET", "/v1/runs/nope/plan"),
            await call("GET", "/v1/runs/bad%20id/plan"),
        ],
        ("post", "/v1/runs/{run_id}/stop"): [
            await call("POST", "/v1/runs/live/stop"),
            await call("POST", "/v1/runs/live/stop", {}),
            await call("POST", "/v1/runs/live/stop", other),
            await call("POST", "/v1/runs/live/stop", **oversize),
            await call("POST", "/v1/runs/nope/stop"),
            await call("POST", "/v1/runs/done/stop"),
            await call("POST", "/v1/runs/" + "a" * 65 + "/stop"),
        ],
        ("get", "/v1/fleets/{fleet}"): [
            await call("GET", "/v1/fleets/shared"),
            await call("GET", "/v1/fleets/shared", {}),
            await call("GET", "/v1/fleets/shared", other),
            await call("GET", "/v1/fleets/shared", **oversize),
            await call("GET", "/v1/fleets/bad%20name"),
        ],
        **await prefs_probes(call, oversize, other),
        ("get", "/healthz"): [await call("GET", "/healthz", {}), await call("GET", "/healthz", **oversize)],
        ("get", "/metrics"): [await call("GET", "/metrics", {}), await call("GET", "/metrics", **oversize)],
        ("get", "/runs/{run_id}"): [
            await call("GET", "/runs/live", {}),
            await call("GET", "/runs/live", **oversize),
            await call("GET", "/runs/" + "a" * 65, {}),
        ],
    }


def check_body(answer: httpx.Response, documented: dict[str, Any], components: dict[str, Any]) -> None:
    """The answer's media type is documented for its status, and a JSON body validates against the
    document's schema for it and as the model of that name."""
    content = documented.get("content", {})
    media = answer.headers["content-type"].split(";")[0]
    assert media in content, (answer.request.url, answer.status_code, media, list(content))
    schema = content[media]["schema"]
    if media == "application/json":
        # the document's refs (#/components/...) resolve against this root
        Draft202012Validator({**schema, "components": components}).validate(answer.json())
    if "$ref" in schema:
        BODY_MODELS[schema["$ref"].rsplit("/", 1)[1]].model_validate(answer.json())


async def unhealthy() -> httpx.Response:
    """/healthz of an app whose Redis is gone: the 503."""
    app = create_app(make_config("redis://127.0.0.1:1/0"))
    async with app.router.lifespan_context(app), client_for(app) as c:
        return await c.get("/healthz")


async def test_openapi_lists_every_answer_of_every_route(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    answers = await probes(client)
    answers[("get", "/healthz")].append(await unhealthy())
    routes = {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert routes == set(answers)  # a route added without probes fails here
    for (method, path), responses in answers.items():
        documented = document["paths"][path][method]["responses"]
        seen = {str(r.status_code) for r in responses}
        assert seen == set(documented), (method, path, sorted(seen), sorted(documented))
        for answer in responses:
            check_body(answer, documented[str(answer.status_code)], document["components"])


async def test_healthz_names_the_kind_of_error_not_the_address() -> None:
    answer = await unhealthy()
    assert answer.json() == {"status": "unavailable", "redis": "ConnectionError"}
