"""Automatic stops on run health, over a real Redis: a run whose metrics show reward hacking is stopped
with the reason and the last checkpoint from before the jump, and the learner is told to halt at once;
a run that only warns keeps running; the status shows the scaling signal the pipeline stored."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from rlfabric.contracts import keys
from rlfabric.contracts.metrics import append_row
from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.health import last_good_checkpoint, stopping_warning
from rlfabric.coordinator.manager import RunManager
from rlfabric.coordinator.runs import RunStore
from rlfabric.runspec import RunSpec

BASE: dict[str, Any] = {"model": {"path": "tiny"}, "dataset": {"path": "prompts.jsonl"}}


def hacked_rows() -> list[dict[str, Any]]:
    """12 steps: calm until step 7, then KL and reward jump together; checkpoints at steps 3, 6, 9, 12."""
    rows = []
    for step in range(1, 13):
        jumped = step >= 8
        row = {"step": step, "policy_version": step, "kl": 0.08 if jumped else 0.01}
        row["reward_mean"] = 0.9 if jumped else 0.3
        if step % 3 == 0:
            row["checkpoint_step"] = step
        rows.append(row)
    return rows


def spec(**health: Any) -> RunSpec:
    return RunSpec.model_validate(
        {**BASE, "health": {"window": 5, **health}, "train": {"keep_checkpoints": 3}}
    )


def test_last_good_checkpoint_is_the_newest_kept_one_before_the_problem() -> None:
    rows = hacked_rows()
    warning = stopping_warning(rows, spec(auto_stop=["reward_hacking"]).health)
    assert warning is not None and warning.check == "reward_hacking" and warning.since_step == 8
    assert last_good_checkpoint(rows, warning.since_step, keep=3) == 6
    assert last_good_checkpoint(rows, warning.since_step, keep=1) is None  # only step 12 is kept
    assert stopping_warning(rows, spec(auto_stop=["entropy_collapse"]).health) is None


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_reward_hacking_stops_the_run_and_keeps_the_good_checkpoint(redis: Redis) -> None:
    store = RunStore(redis)
    record = await store.create(spec(auto_stop=["reward_hacking"]).model_copy(update={"name": "hacked"}))
    for row in hacked_rows():
        await append_row(store.redis, record.run_id, row)
    manager = RunManager(CoordinatorServiceConfig(), redis)
    assert await manager.stop_if_unhealthy(record) is True
    after = await store.get(record.run_id)
    assert after.stop_requested
    assert after.stop_reason is not None and after.stop_reason.startswith("health: possible reward hacking")
    assert after.last_good_checkpoint == 6
    assert any("reward hacking" in w for w in after.warnings)
    assert await redis.get("rlfabric:hacked:stop_requested") == b"health"


async def test_a_warning_without_auto_stop_only_warns(redis: Redis) -> None:
    store = RunStore(redis)
    record = await store.create(spec().model_copy(update={"name": "warned"}))
    for row in hacked_rows():
        await append_row(store.redis, record.run_id, row)
    assert await RunManager(CoordinatorServiceConfig(), redis).stop_if_unhealthy(record) is False
    config = CoordinatorServiceConfig.model_validate({"redis": {"url": "redis://unused"}})
    app = create_app(config, redis)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as client:
        status = (await client.get("/v1/runs/warned")).json()
    assert status["stop_requested"] is False and status["stop_reason"] is None
    assert any("reward hacking" in w for w in status["warnings"])
    assert status["scaling"] is None
    await redis.hset(keys.scaling("warned"), mapping={"desired_replicas": "2", "busy_fraction": "0.97"})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as client:
        status = (await client.get("/v1/runs/warned")).json()
    assert status["scaling"] == {"desired_replicas": 2.0, "busy_fraction": 0.97}


async def test_a_user_stop_says_so(redis: Redis) -> None:
    store = RunStore(redis)
    record = await store.create(spec().model_copy(update={"name": "asked"}))
    stopped = await store.request_stop(record.run_id)
    assert stopped.stop_reason == "api" and stopped.last_good_checkpoint is None
