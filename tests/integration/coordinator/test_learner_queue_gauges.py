"""The coordinator's learner-queue gauges read from a real Redis stream: entries appended by the real
producer, some delivered to the learner's consumer group, some of those acknowledged; the depth is
(entries, undelivered, pending) and what /metrics exports."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from rlfabric.contracts import keys
from rlfabric.contracts.keys import CONSUMER_GROUP
from rlfabric.contracts.streams import GroupProducer
from rlfabric.coordinator.scaling import LearnerQueue, export_queue_gauges, learner_queue
from rlfabric.runtime.metrics import metrics_response
from rlfabric.v1.queue_pb2 import ScoredGroup


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_the_queue_depth_counts_undelivered_and_pending_entries(redis: aioredis.Redis) -> None:
    run_id = f"q-{uuid.uuid4().hex[:8]}"
    assert await learner_queue(redis, run_id) == LearnerQueue(0, 0, 0)  # before the first group
    producer = GroupProducer(redis, run_id, max_len=100)
    for i in range(5):
        await producer.append(ScoredGroup(run_id=run_id, prompt_id="p", group_id=f"g{i}"))
    read = await redis.xreadgroup(CONSUMER_GROUP, "learner-0", {keys.groups(run_id): ">"}, count=3)
    ((_, delivered),) = read
    await redis.xack(keys.groups(run_id), CONSUMER_GROUP, delivered[0][0])

    queue = await learner_queue(redis, run_id)
    assert queue == LearnerQueue(entries=5, undelivered=2, pending=2)
    export_queue_gauges(run_id, queue)
    text = metrics_response()[0].decode()
    assert f'rlfabric_coordinator_learner_queue_lag_groups{{run_id="{run_id}"}} 2.0' in text
    assert f'rlfabric_coordinator_learner_queue_pending_groups{{run_id="{run_id}"}} 2.0' in text
    assert f'rlfabric_coordinator_learner_queue_groups{{run_id="{run_id}"}} 5.0' in text
