"""A run's replica pool (`coordinator.replicas.ReplicaPool`, real Redis registry) never puts more groups on a
replica than the capacity it registered: past it the replica would refuse them as RESOURCE_EXHAUSTED,
which the pipeline takes for a failed replica (excluded for a while, evaluations skipped). Seen with
`rlfabric up --replica-max-in-flight 8`: a run's evaluation of 40 prompts at once lost most of them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from rlfabric.contracts import registry
from rlfabric.contracts.registry import ReplicaEntry
from rlfabric.coordinator.replicas import ReplicaPool
from rlfabric.coordinator.scaling import BusyMeter

RUN = "capacity-run"


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def entry(replica_id: str, capacity: int) -> ReplicaEntry:
    return ReplicaEntry(
        replica_id=replica_id, address=f"127.0.0.1:{capacity}", version=0, serving=True, in_flight=0,
        capacity=capacity, model="m", engine="vllm",
    )  # fmt: skip


async def test_a_replica_gets_at_most_its_registered_capacity(redis: Redis) -> None:
    await registry.register(redis, RUN, entry("small", 3), ttl_s=30)
    await registry.register(redis, RUN, entry("large", 50), ttl_s=30)
    pool = ReplicaPool(redis, RUN, per_replica=8, meter=BusyMeter(30.0))
    await pool.refresh()
    granted = [await pool.acquire() for _ in range(11)]
    assert granted.count("127.0.0.1:3") == 3  # its capacity, below the run's per-replica bound of 8
    assert granted.count("127.0.0.1:50") == 8  # the run's bound, below the replica's capacity
    blocked = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.05)
    assert not blocked.done() and pool.waiting == 1
    await pool.release("127.0.0.1:3")
    assert await asyncio.wait_for(blocked, 1.0) == "127.0.0.1:3"
    await pool.close()
