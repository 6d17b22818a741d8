"""The queue guarantees on a real redis-server: one delivery per group across consumers, reclaim from dead
consumers, exactly-once training with the applied-group ledger, dead letters, backpressure instead of
trimming, and durability of the stream and its pending entries across a Redis restart (AOF)."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from rlfabric.contracts import keys
from rlfabric.contracts.streams import GroupProducer
from rlfabric.learner.queue import (
    REASON_DECODE,
    REASON_MAX_DELIVERIES,
    AppliedLedger,
    Delivery,
    GroupConsumer,
)
from rlfabric.local.procs import ServiceProcess
from rlfabric.v1.common_pb2 import REWARD_STATUS_OK
from rlfabric.v1.queue_pb2 import ScoredGroup


def make_group(run_id: str, group_id: str, n: int = 2) -> ScoredGroup:
    group = ScoredGroup(run_id=run_id, prompt_id="p", group_id=group_id, policy_version=1)
    for i in range(n):
        sample = group.samples.add(sample_index=i, token_ids=[5, 6], logprobs=[-0.5, -1.5], policy_version=1)
        sample.reward.value = float(i)
        sample.reward.status = REWARD_STATUS_OK
    return group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ids_of(batch: list[Delivery]) -> list[str]:
    return [d.group.group_id for d in batch if d.group is not None]


async def entries(redis: Any, key: str) -> list[tuple[str, dict[bytes, bytes]]]:
    """XRANGE of a whole stream with text ids (typed for the assertions)."""
    return [(entry_id.decode(), fields) for entry_id, fields in await redis.xrange(key)]


async def pending_ids(redis: Any, run_id: str) -> list[str]:
    rows = await redis.xpending_range(keys.groups(run_id), "learner", "-", "+", 100)
    return [row["message_id"].decode() for row in rows]


@pytest.fixture
def run_id() -> str:
    return f"it-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def pending_count(redis: aioredis.Redis, run_id: str) -> int:
    return int((await redis.xpending(keys.groups(run_id), "learner"))["pending"])


async def produce(redis: aioredis.Redis, run_id: str, n: int, *, max_len: int = 1000) -> list[str]:
    producer = GroupProducer(redis, run_id, max_len)
    return [await producer.append(make_group(run_id, f"g{i}")) for i in range(n)]


async def consume_until_empty(consumer: GroupConsumer, producer_done: asyncio.Event) -> list[str]:
    """Reads small batches and acks each at once, until the producer is done and a read comes back empty."""
    seen: list[str] = []
    while True:
        batch = await consumer.read(2, block_ms=50)
        if not batch and producer_done.is_set():
            return seen
        seen += ids_of(batch)
        await consumer.ack([d.entry_id for d in batch])
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("protocol", [2, 3])
async def test_two_concurrent_consumers_each_group_exactly_once(
    redis_url: str, run_id: str, protocol: int
) -> None:
    clients = [aioredis.Redis.from_url(redis_url, protocol=protocol) for _ in range(3)]
    producer = GroupProducer(clients[0], run_id, max_len=8)
    done = asyncio.Event()

    async def produce_all() -> None:
        for i in range(60):
            await producer.append(make_group(run_id, f"g{i}"))
        done.set()

    consumers = [GroupConsumer(c, run_id, f"c{k}", claim_idle_ms=60_000) for k, c in enumerate(clients[1:])]
    _, seen_a, seen_b = await asyncio.gather(
        produce_all(), *(consume_until_empty(c, done) for c in consumers)
    )
    assert seen_a and seen_b, "both consumers should have taken part"
    assert not set(seen_a) & set(seen_b)
    assert sorted(seen_a + seen_b) == sorted(f"g{i}" for i in range(60))
    assert await pending_count(clients[0], run_id) == 0
    for client in clients:
        await client.aclose()


async def test_dead_consumers_entries_are_reclaimed(redis: aioredis.Redis, run_id: str) -> None:
    await produce(redis, run_id, 5)
    dead = GroupConsumer(redis, run_id, "dead", claim_idle_ms=200)
    taken = ids_of(await dead.read(3))
    del dead  # dies without acknowledging

    alive = GroupConsumer(redis, run_id, "alive", claim_idle_ms=200)
    fresh = await alive.read(10)
    assert ids_of(fresh) == ["g3", "g4"] and alive.counters.reclaimed == 0
    await asyncio.sleep(0.3)
    reclaimed = await alive.read(10)
    assert ids_of(reclaimed) == taken
    assert all(d.deliveries == 2 for d in reclaimed)
    assert alive.counters.reclaimed == 3
    owners = await redis.xpending_range(keys.groups(run_id), "learner", "-", "+", 10)
    assert {row["consumer"] for row in owners} == {b"alive"}


async def test_restart_skips_applied_groups_and_retrains_the_rest(redis: aioredis.Redis, run_id: str) -> None:
    await produce(redis, run_id, 4)
    ledger = AppliedLedger()
    learner = GroupConsumer(redis, run_id, "learner-0", ledger=ledger)
    batch = await learner.read(4)
    ledger.update(ids_of(batch)[:2])  # a step applied g0, g1 and its checkpoint (with the ledger) is durable
    checkpoint = ledger.to_bytes()
    del learner  # crash before acknowledging anything

    restarted = GroupConsumer(redis, run_id, "learner-0", ledger=AppliedLedger.from_bytes(checkpoint))
    again = await restarted.read(10)
    assert ids_of(again) == ["g2", "g3"]
    assert all(d.deliveries == 2 for d in again)
    assert restarted.counters.skipped_duplicate == 2
    assert await pending_count(redis, run_id) == 2
    await restarted.ack([d.entry_id for d in again])
    assert await pending_count(redis, run_id) == 0
    assert await restarted.read(10, block_ms=10) == []


async def test_reclaimed_group_already_applied_is_skipped_and_acked(
    redis: aioredis.Redis, run_id: str
) -> None:
    await produce(redis, run_id, 2)
    first = GroupConsumer(redis, run_id, "a", claim_idle_ms=100)
    await first.read(2)
    del first
    await asyncio.sleep(0.15)
    other = GroupConsumer(redis, run_id, "b", claim_idle_ms=100, ledger=AppliedLedger(["g0"]))
    assert ids_of(await other.read(10)) == ["g1"]
    assert other.counters.skipped_duplicate == 1 and other.counters.reclaimed == 2
    assert await pending_count(redis, run_id) == 1


async def test_an_entry_held_is_never_handed_out_twice(redis: aioredis.Redis, run_id: str) -> None:
    """Whatever path makes Redis deliver a held (read, not yet acknowledged) entry again, `read` does not
    hand it out a second time: a step would train it twice."""
    await produce(redis, run_id, 2)
    crashed = GroupConsumer(redis, run_id, "learner-0")
    await crashed.read(2)
    del crashed
    restarted = GroupConsumer(redis, run_id, "learner-0")
    assert ids_of(await restarted.read(2)) == ["g0", "g1"]  # its own pending entries, now held
    restarted._history_cursor = "0"  # Redis delivers them again (XREADGROUP of the pending history)
    assert await restarted.read(2, block_ms=10) == []
    assert await pending_count(redis, run_id) == 2  # still held, acknowledged once their step is durable


async def test_restarted_consumer_reads_its_history_once(
    redis: aioredis.Redis, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted learner's first read takes its old pending entries and then new ones; the next read,
    before the step is durable (nothing acknowledged), must not treat the new ones as history again."""
    await produce(redis, run_id, 8)
    crashed = GroupConsumer(redis, run_id, "learner-0")
    await crashed.read(2)
    del crashed
    restarted = GroupConsumer(redis, run_id, "learner-0")
    assert ids_of(await restarted.read(4)) == ["g0", "g1", "g2", "g3"]  # history, then new
    with caplog.at_level("WARNING", logger="rlfabric.learner.queue"):
        assert ids_of(await restarted.read(4, block_ms=10)) == ["g4", "g5", "g6", "g7"]
    assert "delivered again while held" not in caplog.text
    assert await pending_count(redis, run_id) == 8


async def test_poison_entry_goes_to_dead_letter(redis: aioredis.Redis, run_id: str) -> None:
    await produce(redis, run_id, 1)
    await redis.xadd(keys.groups(run_id), {b"data": b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff garbage"})
    consumer = GroupConsumer(redis, run_id, "c")
    assert ids_of(await consumer.read(10)) == ["g0"]
    assert consumer.counters.dead_lettered == {REASON_DECODE: 1}
    [(_, record)] = await entries(redis, keys.dead_letters(run_id))
    assert record[b"reason"] == b"decode" and record[b"error"].startswith(b"not a ScoredGroup")
    assert record[b"data"].endswith(b" garbage") and record[b"deliveries"] == b"1"
    assert consumer.last_rejected[0].entry_id == record[b"entry_id"].decode()
    assert await pending_count(redis, run_id) == 1  # only g0, awaiting its step


async def test_entry_delivered_too_often_goes_to_dead_letter(redis: aioredis.Redis, run_id: str) -> None:
    await produce(redis, run_id, 1)
    seen = []
    for attempt in range(3):
        crashing = GroupConsumer(redis, run_id, f"crash-{attempt}", max_deliveries=2, claim_idle_ms=50)
        seen.append(await crashing.read(1))
        await asyncio.sleep(0.1)  # the learner dies mid-step, every time
    assert [len(batch) for batch in seen] == [1, 1, 0]
    assert crashing.counters.dead_lettered == {REASON_MAX_DELIVERIES: 1}
    [(_, record)] = await entries(redis, keys.dead_letters(run_id))
    assert record[b"reason"] == b"max_deliveries" and record[b"deliveries"] == b"3"
    assert record[b"group_id"] == b"g0" and ScoredGroup.FromString(record[b"data"]).group_id == "g0"
    assert await pending_count(redis, run_id) == 0


async def test_backpressure_blocks_producer_until_consumer_catches_up(
    redis: aioredis.Redis, run_id: str
) -> None:
    producer = GroupProducer(redis, run_id, max_len=3, poll_s=0.01)
    appending = asyncio.create_task(produce_with(producer, run_id, 5))
    await asyncio.sleep(0.3)
    assert not appending.done()
    assert await redis.xlen(keys.groups(run_id)) == 3
    consumer = GroupConsumer(redis, run_id, "c")
    batch = await consumer.read(2)
    await consumer.ack([d.entry_id for d in batch])
    await asyncio.wait_for(appending, timeout=5)
    assert await redis.xlen(keys.groups(run_id)) == 5
    assert producer.waits >= 1
    assert await producer.backlog() == 3


async def test_backlog_is_counted_when_redis_cannot_report_lag(redis: aioredis.Redis, run_id: str) -> None:
    ids = await produce(redis, run_id, 4)
    await GroupConsumer(redis, run_id, "c").read(1)
    await redis.xdel(keys.groups(run_id), ids[2])  # a tombstone among undelivered entries: lag is nil
    [info] = await redis.xinfo_groups(keys.groups(run_id))
    assert info["lag"] is None
    assert await GroupProducer(redis, run_id, max_len=10).backlog() == 2
    assert await GroupProducer(redis, run_id, max_len=1).backlog() == 1


async def produce_with(producer: GroupProducer, run_id: str, n: int) -> None:
    for i in range(n):
        await producer.append(make_group(run_id, f"g{i}"), timeout_s=10)


async def test_trim_never_removes_unacknowledged_entries(redis: aioredis.Redis, run_id: str) -> None:
    ids = await produce(redis, run_id, 6)
    producer = GroupProducer(redis, run_id, max_len=100)
    consumer = GroupConsumer(redis, run_id, "c")
    await consumer.read(3)
    await consumer.ack([ids[0], ids[2]])  # ids[1] still pending, ids[3:] never delivered

    assert await producer.trim_acknowledged() == 1
    assert [i for i, _ in await entries(redis, keys.groups(run_id))] == ids[1:]
    await consumer.ack([ids[1]])
    assert await producer.trim_acknowledged() == 2
    assert [i for i, _ in await entries(redis, keys.groups(run_id))] == ids[3:]
    await consumer.read(3)
    assert await producer.trim_acknowledged() == 0  # delivered but pending: kept
    await consumer.ack(ids[3:])
    assert await producer.trim_acknowledged() == 3
    assert await redis.xlen(keys.groups(run_id)) == 0


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_stream_and_pending_entries_survive_redis_restart(
    tmp_path: Path, run_id: str, how: str
) -> None:
    port = free_port()
    argv = [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
        "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--maxmemory-policy", "noeviction",
    ]  # fmt: skip
    server = ServiceProcess("redis-aof", argv, log_path=tmp_path / "redis.log")
    server.start(r"Ready to accept connections", timeout_s=30)
    try:
        before = await write_then_crash_consumer(f"redis://127.0.0.1:{port}/0", run_id)
        server.stop() if how == "sigterm" else server.kill()
        server = ServiceProcess("redis-aof", argv, log_path=tmp_path / "redis.log")
        server.start(r"Ready to accept connections", timeout_s=30)
        await check_after_restart(f"redis://127.0.0.1:{port}/0", run_id, before)
    finally:
        server.stop()


async def write_then_crash_consumer(url: str, run_id: str) -> dict[str, list[str]]:
    """5 groups appended, 3 delivered to 'learner-0', 1 of them acknowledged; returns the ids per state."""
    client = aioredis.Redis.from_url(url)
    ids = await produce(client, run_id, 5)
    consumer = GroupConsumer(client, run_id, "learner-0")
    await consumer.read(3)
    await consumer.ack(ids[:1])
    await client.aclose()
    return {"all": ids, "pending": ids[1:3], "new": ids[3:]}


async def check_after_restart(url: str, run_id: str, before: dict[str, list[str]]) -> None:
    client = aioredis.Redis.from_url(url)
    assert [i for i, _ in await entries(client, keys.groups(run_id))] == before["all"]
    assert await pending_ids(client, run_id) == before["pending"]
    consumer = GroupConsumer(client, run_id, "learner-0")
    batch = await consumer.read(10)
    assert [d.entry_id for d in batch] == before["pending"] + before["new"]
    assert [d.deliveries for d in batch] == [2, 2, 1, 1]
    await client.aclose()
