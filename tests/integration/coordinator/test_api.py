"""The coordinator's REST API over a real Redis: every route, every error, restart survival, the page."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from rlfabric.coordinator import runs_cli
from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.runs import RunRecord, RunStore

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC: dict[str, Any] = {"model": {"path": "tiny"}, "dataset": {"path": "prompts.jsonl"}}


def make_config(redis_url: str, token: str | None = TOKEN) -> CoordinatorServiceConfig:
    return CoordinatorServiceConfig.model_validate(
        {"api": {"token": token, "max_body_bytes": 4096}, "redis": {"url": redis_url}}
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
    redis_url: str, redis: Redis, hooks: dict[str, list[str]]
) -> AsyncIterator[httpx.AsyncClient]:
    async def on_submit(record: RunRecord) -> None:
        hooks["submitted"].append(record.run_id)

    async def on_stop(record: RunRecord) -> None:
        hooks["stopped"].append(record.run_id)

    app = create_app(make_config(redis_url), redis, on_submit=on_submit, on_stop=on_stop)
    async with client_for(app) as c:
        yield c


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
        await store.append_metrics("beta", {"step": step, "reward_mean": 0.5, "entropy": collapsed})
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
