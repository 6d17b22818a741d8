"""Per-run API tokens over the real coordinator app and a real Redis: a run's own token reads and stops its
run and nothing else; the operator's token keeps full access; the run token is shown once and stored only
as a digest; the `rlfabric runs` CLI takes either token."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from rlfabric.contracts import keys
from rlfabric.coordinator import runs_cli
from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.api_auth import ANOTHER_RUN, OPERATOR_ONLY
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.runs import TOKEN_DIGEST_FIELD

OPERATOR = "operator-token"
SPEC: dict[str, Any] = {"model": {"path": "tiny"}, "dataset": {"path": "prompts.jsonl"}}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def make_config(redis_url: str, token: str | None = OPERATOR) -> CoordinatorServiceConfig:
    return CoordinatorServiceConfig.model_validate({"api": {"token": token}, "redis": {"url": redis_url}})


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator")


@pytest.fixture
async def client(redis_url: str, redis: Redis) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(create_app(make_config(redis_url), redis)) as c:
        yield c


async def submit(client: httpx.AsyncClient, name: str, token: str = OPERATOR) -> httpx.Response:
    return await client.post("/v1/runs", json={**SPEC, "name": name}, headers=bearer(token))


@pytest.fixture
async def tokens(client: httpx.AsyncClient) -> dict[str, str]:
    """Runs A and B, submitted with the operator's token: each run's own token."""
    found = {}
    for name in ("A", "B"):
        answer = await submit(client, name)
        assert answer.status_code == 201, answer.text
        found[name] = answer.json()["run_token"]
    return found


ROUTES = (
    ("GET", "/v1/runs/{}"),
    ("GET", "/v1/runs/{}/metrics"),
    ("GET", "/v1/runs/{}/plan"),
    ("POST", "/v1/runs/{}/stop"),
)
"""Every route of one run; stop last (it changes the run)."""


async def test_a_run_token_reads_and_stops_its_own_run(
    client: httpx.AsyncClient, tokens: dict[str, str]
) -> None:
    expected = {"GET": 200, "POST": 202}
    for method, path in ROUTES:
        answer = await client.request(method, path.format("A"), headers=bearer(tokens["A"]))
        assert answer.status_code == expected[method], (method, path, answer.text)
    status = (await client.get("/v1/runs/A", headers=bearer(tokens["A"]))).json()
    assert status["stop_requested"] and status["stop_reason"] == "api"


async def test_a_run_token_on_another_run_is_403_naming_why(
    client: httpx.AsyncClient, tokens: dict[str, str]
) -> None:
    for method, path in ROUTES:
        for run_id in ("B", "no-such-run"):
            answer = await client.request(method, path.format(run_id), headers=bearer(tokens["A"]))
            assert answer.status_code == 403, (method, path, run_id)
            assert answer.json() == {"detail": ANOTHER_RUN}
    untouched = (await client.get("/v1/runs/B", headers=bearer(OPERATOR))).json()
    assert untouched["state"] == "pending" and not untouched["stop_requested"]


async def test_the_list_shows_a_run_token_its_own_run_and_the_operator_all(
    client: httpx.AsyncClient, tokens: dict[str, str]
) -> None:
    async def listed(token: str, **params: Any) -> list[str]:
        answer = await client.get("/v1/runs", headers=bearer(token), params=params)
        assert answer.status_code == 200, answer.text
        return [r["run_id"] for r in answer.json()["runs"]]

    assert await listed(tokens["A"]) == ["A"]
    assert await listed(tokens["B"]) == ["B"]
    assert await listed(OPERATOR) == ["B", "A"]
    assert await listed(tokens["A"], state="pending") == ["A"]
    assert await listed(tokens["A"], state="running") == []


async def test_submitting_needs_the_operator_token(client: httpx.AsyncClient, tokens: dict[str, str]) -> None:
    answer = await submit(client, "C", tokens["A"])
    assert answer.status_code == 403 and answer.json() == {"detail": OPERATOR_ONLY}
    assert (await client.get("/v1/runs/C", headers=bearer(OPERATOR))).status_code == 404


@pytest.mark.parametrize(
    "wrong",
    [
        "wrong",
        "A.not-the-secret",
        "A.",
        "no-such-run.secret",
        "bad id.secret",
        OPERATOR + "x",
        "",
    ],
)
async def test_a_wrong_token_is_401(client: httpx.AsyncClient, tokens: dict[str, str], wrong: str) -> None:
    for method, path in (*ROUTES, ("GET", "/v1/runs")):
        answer = await client.request(method, path.format("A"), headers=bearer(wrong))
        assert answer.status_code == 401, (method, path, wrong)
        assert answer.headers["www-authenticate"] == "Bearer"


async def test_one_runs_secret_under_another_runs_id_is_401(
    client: httpx.AsyncClient, tokens: dict[str, str]
) -> None:
    secret = tokens["A"].split(".", 1)[1]
    answer = await client.get("/v1/runs/B", headers=bearer(f"B.{secret}"))
    assert answer.status_code == 401


async def test_the_operator_token_reaches_every_run(
    client: httpx.AsyncClient, tokens: dict[str, str]
) -> None:
    for run_id in ("A", "B"):
        for method, path in ROUTES:
            answer = await client.request(method, path.format(run_id), headers=bearer(OPERATOR))
            assert answer.status_code in {200, 202}, (method, path, run_id)


async def test_the_token_is_shown_once_and_stored_as_a_digest(
    client: httpx.AsyncClient, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    created = await submit(client, "A")
    token = created.json()["run_token"]
    assert token.startswith("A.") and len(token) > 40
    answers = [
        await client.request(method, path.format("A"), headers=bearer(who))
        for who in (token, OPERATOR)
        for method, path in (("GET", "/v1/runs"), *ROUTES)
    ]
    assert all(a.status_code < 300 or a.status_code == 409 for a in answers)
    assert not [a.request.url for a in answers if token in a.text or "token_sha256" in a.text]
    stored = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.run("A"))).items()}  # type: ignore[misc]
    assert stored[TOKEN_DIGEST_FIELD] == hashlib.sha256(token.encode()).hexdigest()
    for key in await redis.keys("*"):
        assert token.encode() not in await redis.dump(key), key
    assert token not in caplog.text


async def test_tokens_survive_a_coordinator_restart(
    redis_url: str, redis: Redis, tokens: dict[str, str]
) -> None:
    async with client_for(create_app(make_config(redis_url), redis)) as restarted:
        assert (await restarted.get("/v1/runs/A", headers=bearer(tokens["A"]))).status_code == 200
        assert (await restarted.get("/v1/runs/B", headers=bearer(tokens["A"]))).status_code == 403


async def test_without_an_operator_token_everything_stays_open(redis_url: str, redis: Redis) -> None:
    async with client_for(create_app(make_config(redis_url, token=None), redis)) as c:
        a = (await c.post("/v1/runs", json={**SPEC, "name": "A"})).json()
        assert (await c.post("/v1/runs", json={**SPEC, "name": "B"})).status_code == 201
        assert (await c.get("/v1/runs/B", headers=bearer(a["run_token"]))).status_code == 200
        assert (await c.get("/v1/runs")).json()["runs"][0]["run_id"] == "B"
        assert (await c.post("/v1/runs/B/stop")).status_code == 202


# --- the CLI against a served coordinator ---------------------------------------------------------------


@pytest.fixture
def served(redis_url: str) -> Iterator[str]:
    """The app served by uvicorn on a loopback port (the CLI speaks HTTP); stopped after the test."""
    import socket

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


def cli_submit(served: str, run_file: Path, name: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Submits with the operator's token; the run token the CLI printed."""
    assert cli("submit", str(run_file), "--name", name, "--url", served, "--token", OPERATOR) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == name
    lines = [line for line in printed.err.splitlines() if line.startswith(runs_cli.RUN_TOKEN_LINE)]
    assert len(lines) == 1, printed.err
    return lines[0].removeprefix(runs_cli.RUN_TOKEN_LINE)


def test_cli_takes_a_run_token_as_it_takes_the_operators(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text('[model]\npath = "tiny"\n\n[dataset]\npath = "p.jsonl"\n')
    token_a = cli_submit(served, run_file, "cli-a", capsys)
    cli_submit(served, run_file, "cli-b", capsys)
    own = ("--url", served, "--token", token_a)
    assert cli("status", "cli-a", "--json", *own) == 0
    assert '"run_token"' not in capsys.readouterr().out
    assert cli("status", "cli-b", *own) == 1
    assert "HTTP 403" in (err := capsys.readouterr().err) and ANOTHER_RUN in err
    assert cli("stop", "cli-b", *own) == 1 and "HTTP 403" in capsys.readouterr().err
    assert cli("submit", str(run_file), "--name", "cli-c", *own) == 1
    assert "HTTP 403" in capsys.readouterr().err
    monkeypatch.setenv("RLFABRIC_API_TOKEN", token_a)  # the same way as the operator's
    assert cli("list", "--json", "--url", served) == 0
    assert '"cli-a"' in (out := capsys.readouterr().out) and "cli-b" not in out
    assert cli("stop", "cli-a", "--url", served) == 0 and "stopped" in capsys.readouterr().out


def test_cli_submit_overrides_keys_of_the_run_file(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text('[model]\npath = "tiny"\n\n[dataset]\npath = "p.jsonl"\n\n[train]\nsteps = 9\n')
    operator = ("--url", served, "--token", OPERATOR)
    assert cli("submit", str(run_file), "--name", "set-a", "--set", "train.steps=3", *operator) == 0
    capsys.readouterr()
    assert cli("status", "set-a", "--json", *operator) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["train"]["steps"] == 3
    assert cli("submit", str(run_file), "--name", "set-b", "--set", "train.steps=-1", *operator) == 1
    assert "HTTP 422" in (err := capsys.readouterr().err) and "train.steps" in err
