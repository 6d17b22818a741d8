"""The over-optimisation guard over a real Redis: metrics rows written as the learner writes them (held-out
evaluations with a gold reward on the row after each), the coordinator's health logic stops the run at the
gold peak and reports the last checkpoint at or before it; the status shows the latest evaluation and the
run page the proxy/gold-vs-KL chart."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from rlfabric.contracts.metrics import append_row
from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.manager import RunManager
from rlfabric.coordinator.runs import RunStore
from rlfabric.runspec import RunSpec

GOLD_REWARD = {"scorer": "exact_match"}  # any scorer: only the rows matter here


def spec(name: str, **health: Any) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": name,
            "model": {"path": "tiny"},
            "dataset": {"path": "p.jsonl", "held_out_fraction": 0.1, "eval_every_steps": 4,
                        "eval": {"reward": GOLD_REWARD}},
            "train": {"keep_checkpoints": 3, "checkpoint_every": 4},
            "health": health,
        }
    )  # fmt: skip


def overoptimized_rows() -> list[dict[str, Any]]:
    """24 steps, an evaluation every 4 (its keys on the next row); the gold reward peaks at step 12 and
    falls, the proxy keeps rising; checkpoints every 4 steps."""
    gold = {4: 0.30, 8: 0.45, 12: 0.55, 16: 0.48, 20: 0.40}
    rows = []
    for step in range(1, 25):
        row: dict[str, Any] = {"step": step, "policy_version": step, "kl": 0.02 * step}
        row["reward_mean"] = 0.1 * step
        if step % 4 == 0:
            row["checkpoint_step"] = step
        if step - 1 in gold:
            row.update(eval_step=step - 1, eval_policy_version=step - 1)
            row.update(eval_reward_mean=0.1 * (step - 1), eval_gold_reward_mean=gold[step - 1])
        rows.append(row)
    return rows


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_overoptimization_stops_at_the_gold_peak(redis: Redis) -> None:
    store = RunStore(redis)
    record = await store.create(spec("overopt", auto_stop=["overoptimization"]))
    manager = RunManager(CoordinatorServiceConfig(), redis)
    for row in overoptimized_rows()[:17]:  # up to the first evaluation after the peak: not yet
        await append_row(store.redis, record.run_id, row)
    assert await manager.stop_if_unhealthy(record) is False
    for row in overoptimized_rows()[17:21]:  # to the row carrying the second one (step 21)
        await append_row(store.redis, record.run_id, row)
    assert await manager.stop_if_unhealthy(record) is True
    after = await store.get(record.run_id)
    assert after.stop_requested and after.stop_reason is not None
    assert after.stop_reason.startswith("health: reward over-optimisation")
    assert after.last_good_checkpoint == 12  # the gold peak's (kept then: 12, 16, 20)
    assert await redis.get("rlfabric:overopt:stop_requested") == b"health"


async def test_status_and_page_show_the_gold_reward(redis: Redis) -> None:
    store = RunStore(redis)
    record = await store.create(spec("shown"))
    for row in overoptimized_rows():
        await append_row(store.redis, record.run_id, row)
    config = CoordinatorServiceConfig.model_validate({"redis": {"url": "redis://unused"}})
    app = create_app(config, redis)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as client:
        status = (await client.get("/v1/runs/shown")).json()
        page = (await client.get("/runs/shown")).text
    assert status["stop_requested"] is False
    assert any("over-optimisation" in w for w in status["warnings"])  # warns without auto_stop
    evaluation = status["evaluation"]
    assert (evaluation["step"], evaluation["gold_reward"], evaluation["gold_peak_step"]) == (20, 0.4, 12)
    assert evaluation["kl"] == pytest.approx(0.4) and evaluation["reward"] == pytest.approx(2.0)
    assert "eval_gold_reward_mean" in page and "over-optimisation" in page and "klPoints" in page
