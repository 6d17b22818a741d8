"""`POST /v1/runs` refuses a run whose declared `[resources]` cannot hold it: a real coordinator app with
`checks.SubmitCheck` on a real Redis (the scorer checked by a real reward servicer over gRPC) answers 422
naming `resources`, with the memory plan in the body, and stores nothing; the same run on devices that
hold it is accepted, and so is a run that declares no resources. `GET /v1/runs/{id}/plan` (the run
page's plan) answers the accepted run's plan."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.checks import SubmitCheck
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.plan.report import SCHEMA
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


def run_body(model: Path, data: Path, name: str, memory: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "model": {"path": str(model)}, "dataset": {"path": str(data)}}
    if memory is not None:
        body["resources"] = {"placement": "colocated", "learner": {"kind": "cpu", "memory": memory}}
    return body


async def test_a_run_that_cannot_fit_its_resources_is_refused_with_the_plan(
    redis_url: str, reward_address: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    cfg = CoordinatorServiceConfig.model_validate(
        {
            "api": {"token": TOKEN},
            "redis": {"url": redis_url},
            "reward_address": reward_address,
            "data_roots": ["/"],
            "model_roots": ["/"],
        }
    )
    redis = Redis.from_url(redis_url)
    app = create_app(cfg, redis, check=SubmitCheck(cfg))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as client:
        small = run_body(tiny_model_dir, data, "too-big", "64MiB")
        refused = await client.post("/v1/runs", json=small, headers=AUTH)
        assert refused.status_code == 422, refused.text
        body = refused.json()
        assert [e["loc"] for e in body["detail"]] == [["body", "resources"]]
        assert body["detail"][0]["type"] == "resources_do_not_fit"
        assert "does not fit" in body["message"]
        plan = body["plan"]
        assert plan["schema"] == SCHEMA and plan["fits"] is False
        device = plan["devices"][0]
        assert device["memory_bytes"] == 64 << 20 and device["total_bytes"] > device["memory_bytes"]
        assert (await client.get("/v1/runs/too-big", headers=AUTH)).status_code == 404

        fits = run_body(tiny_model_dir, data, "fits", "64GiB")
        roomy = await client.post("/v1/runs", json=fits, headers=AUTH)
        assert roomy.status_code == 201, roomy.text
        undeclared = run_body(tiny_model_dir, data, "undeclared", None)
        assert (await client.post("/v1/runs", json=undeclared, headers=AUTH)).status_code == 201

        shown = (await client.get("/v1/runs/fits/plan", headers=AUTH)).json()
        assert shown["plan"]["fits"] is True and shown["plan"]["run"] == "fits"
        assert shown["measured"] == {}  # no learner step yet: no memory measured
        unplanned = (await client.get("/v1/runs/undeclared/plan", headers=AUTH)).json()
        assert unplanned["plan"] is None and "no [resources]" in unplanned["reason"]
        assert (await client.get("/v1/runs/nobody/plan", headers=AUTH)).status_code == 404
    await redis.aclose()
