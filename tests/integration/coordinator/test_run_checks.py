"""Runs checked before they run and while they wait, through the real API over a real Redis:

- `POST /v1/runs` with `checks.SubmitCheck` refuses each broken run file of issue 20 with 422 naming the
  field (the scorer checked by a real reward servicer over gRPC: the coordinator loads no scorer);
- a run accepted with nothing behind it (no replica, no learner, no reward service, a model that does not
  load) shows each warning in its status and in the coordinator log within 30 s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.checks import MODEL_UNLOADABLE, REWARD_SILENT, SubmitCheck
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.manager import RunManager
from rlfabric.reward.server import RewardServicer
from rlfabric.reward.service import RewardEngine
from rlfabric.runtime.grpc_server import GrpcServer, full_service_name
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def reward_address() -> AsyncIterator[str]:
    """A reward servicer on an ephemeral port (CheckScorer builds scorers; nothing is scored)."""
    engine = RewardEngine(workers=1, item_timeout_s=5.0, inline=[])
    servicer = RewardServicer(engine, max_batch_items=10, max_item_bytes=10_000)
    server = GrpcServer()
    service = full_service_name(reward_pb2, "RewardService")
    server.add_servicer(reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer, service)
    port = await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    return path


def config(redis_url: str, reward_address: str, **checks: Any) -> CoordinatorServiceConfig:
    return CoordinatorServiceConfig.model_validate(
        {
            "api": {"token": TOKEN},
            "redis": {"url": redis_url},
            "reward_address": reward_address,
            "data_roots": ["/"],
            "model_roots": ["/"],
            "checks": checks,
        }
    )


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator")


async def test_submit_refuses_each_broken_run_file_naming_the_field(
    redis_url: str, reward_address: str, tiny_model_dir: Path, data: Path, tmp_path: Path
) -> None:
    cfg = config(redis_url, reward_address)
    redis = Redis.from_url(redis_url)
    good = {"model": {"path": str(tiny_model_dir)}, "dataset": {"path": str(data)}}
    broken = {
        "reward.scorer": {**good, "reward": {"scorer": "exact_matc"}},
        "reward.params.bogus": {**good, "reward": {"scorer": "exact_match", "params": {"bogus": 1}}},
        "model.path": {**good, "model": {"path": str(tmp_path / "missing-model")}},
        "dataset.path": {**good, "dataset": {"path": str(tmp_path / "missing.jsonl")}},
    }
    async with client_for(create_app(cfg, redis, check=SubmitCheck(cfg))) as client:
        for field, body in broken.items():
            answer = await client.post("/v1/runs", json=body, headers=AUTH)
            assert answer.status_code == 422, answer.text
            assert [e["loc"] for e in answer.json()["detail"]] == [["body", *field.split(".")]]
            assert field in answer.json()["message"]
        accepted = await client.post("/v1/runs", json={**good, "name": "fine"}, headers=AUTH)
        assert accepted.status_code == 201, accepted.text
    await redis.aclose()


async def test_a_run_with_nothing_behind_it_says_what_is_missing_within_30_s(
    redis_url: str, data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No replica, no learner, a reward service that does not answer (a closed port) and a model folder
    whose config does not parse; the submit check is off, as in a coordinator with checks.on_submit false."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    cfg = config(redis_url, "127.0.0.1:1", on_submit=False, interval_s=0.5, learner_stall_s=3.0)
    redis = Redis.from_url(redis_url)
    manager = RunManager(cfg, redis)
    app = create_app(cfg, redis, on_submit=manager.on_submit, on_stop=manager.on_stop)
    spec = {"name": "waiting", "model": {"path": str(broken)}, "dataset": {"path": str(data)}}
    expected = ["no rollout replica", "no learner consumes", REWARD_SILENT, MODEL_UNLOADABLE]
    caplog.set_level(logging.WARNING, logger="rlfabric.coordinator.manager")
    start = time.monotonic()
    async with client_for(app) as client:
        assert (await client.post("/v1/runs", json=spec, headers=AUTH)).status_code == 201
        while time.monotonic() - start < 30:  # shown in the status and logged (the watch's next look)
            warnings = (await client.get("/v1/runs/waiting", headers=AUTH)).json()["warnings"]
            logged = [r.getMessage() for r in caplog.records]
            if all(any(e in w for w in warnings) and any(e in m for m in logged) for e in expected):
                break
            await asyncio.sleep(0.5)
        status = (await client.get("/v1/runs/waiting", headers=AUTH)).json()
    await manager.close()
    await redis.aclose()
    for text in expected:
        assert any(text in w for w in status["warnings"]), (text, status["warnings"])
        assert any(text in r.getMessage() for r in caplog.records), text
    assert any(str(broken) in w and "model.path" in w for w in status["warnings"])
