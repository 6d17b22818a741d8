"""Stream layer, fast: key names, validation, the ledger, and the read/ack/dead-letter flow on the session's
redis-server (dead letters are a Lua script, which fakeredis runs only with lupa installed).

The guarantees that depend on real Redis (reclaim timing, AOF restart, concurrent consumers) are proven in
tests/integration/test_learner_queue.py.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis

from rlfabric.contracts import keys
from rlfabric.contracts.keys import Counter
from rlfabric.contracts.streams import (
    BackpressureTimeout,
    GroupProducer,
    encode_entry,
    parse_id,
    trim_acknowledged,
    trim_floor,
)
from rlfabric.learner.queue import (
    REASON_DECODE,
    REASON_INVALID,
    REASON_STEP,
    AppliedLedger,
    GroupConsumer,
    QueueCounters,
    validate_group,
)
from rlfabric.v1.common_pb2 import REWARD_STATUS_OK, REWARD_STATUS_SCORER_ERROR, REWARD_STATUS_TIMEOUT
from rlfabric.v1.queue_pb2 import ScoredGroup

RUN = "unit-run"


def make_group(group_id: str, n: int = 2, *, run_id: str = RUN, version: int = 3) -> ScoredGroup:
    group = ScoredGroup(run_id=run_id, prompt_id="p", group_id=group_id, policy_version=version)
    for i in range(n):
        sample = group.samples.add(sample_index=i, token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3])
        sample.policy_version = version
        sample.reward.value = float(i)
        sample.reward.status = REWARD_STATUS_OK
    return group


async def entries(redis: Any, key: str) -> list[tuple[str, dict[bytes, bytes]]]:
    """XRANGE of a whole stream with text ids (typed for the assertions)."""
    return [(entry_id.decode(), fields) for entry_id, fields in await redis.xrange(key)]


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def test_key_names() -> None:
    assert keys.groups("r1") == "rlfabric:r1:groups"
    assert keys.dead_letters("r1") == "rlfabric:r1:groups:dead"
    with pytest.raises(ValueError):
        keys.groups("")
    with pytest.raises(ValueError):
        keys.groups("a b")


def test_encode_entry_is_protobuf_with_group_id() -> None:
    fields = encode_entry(make_group("g1"))
    assert ScoredGroup.FromString(fields[b"data"]).group_id == "g1"
    assert fields[b"group_id"] == b"g1"
    with pytest.raises(ValueError):
        encode_entry(ScoredGroup())


def test_parse_id() -> None:
    assert parse_id(b"12-3") == (12, 3)
    assert parse_id("5") == (5, 0)
    assert parse_id("2-0") < parse_id("10-0")


def test_validate_group_accepts_a_good_group() -> None:
    assert validate_group(make_group("g"), expected_n=2, run_id=RUN) is None


def _broken(mutate: str) -> ScoredGroup:
    group = make_group("g")
    sample = group.samples[1]
    if mutate == "misaligned":
        sample.logprobs.append(-1.0)
    elif mutate == "empty":
        del sample.token_ids[:]
        del sample.logprobs[:]
    elif mutate == "nan_reward":
        sample.reward.value = math.nan
    elif mutate == "inf_reward":
        sample.reward.value = math.inf
    elif mutate == "scorer_error":
        sample.reward.status = REWARD_STATUS_SCORER_ERROR
    elif mutate == "timeout":
        sample.reward.status = REWARD_STATUS_TIMEOUT
    elif mutate == "unspecified":
        sample.reward.status = 0
    elif mutate == "nan_component":
        sample.reward.components["format"] = math.nan
    elif mutate == "nan_logprob":
        sample.logprobs[0] = math.nan
    elif mutate == "index":
        sample.sample_index = 5
    elif mutate == "version":
        sample.policy_version = 2
    elif mutate == "short_mask":
        sample.loss_mask = bytes([1, 0])
    elif mutate == "no_policy_token":
        sample.loss_mask = bytes([0, 0, 0])
    elif mutate == "turn_order":
        sample.loss_mask = bytes([1, 0, 1])
        sample.turns.add(start=0)
        sample.turns.add(start=0)
    return group


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        ("misaligned", "logprobs"),
        ("empty", "logprobs"),
        ("nan_reward", "not finite"),
        ("inf_reward", "not finite"),
        ("scorer_error", "SCORER_ERROR"),
        ("timeout", "TIMEOUT"),
        ("unspecified", "UNSPECIFIED"),
        ("nan_component", "components"),
        ("nan_logprob", "logprob"),
        ("index", "sample_index"),
        ("version", "policy_version"),
        ("short_mask", "loss mask"),
        ("no_policy_token", "no policy token"),
        ("turn_order", "turn starts"),
    ],
)
def test_validate_group_rejects(mutate: str, needle: str) -> None:
    error = validate_group(_broken(mutate))
    assert error is not None and needle in error and error.startswith("sample 1:")


def test_validate_group_rejects_group_level_problems() -> None:
    assert "group_id" in (validate_group(ScoredGroup(samples=make_group("g").samples)) or "")
    assert "no samples" in (validate_group(ScoredGroup(group_id="g")) or "")
    assert "expected 4" in (validate_group(make_group("g"), expected_n=4) or "")
    assert "run_id" in (validate_group(make_group("g"), run_id="other") or "")


def test_ledger_round_trip_is_sorted_json() -> None:
    ledger = AppliedLedger(["b", "a"])
    ledger.add("c")
    ledger.add("a")
    assert len(ledger) == 3 and "a" in ledger and "z" not in ledger
    assert ledger.to_bytes() == b'["a","b","c"]'
    again = AppliedLedger.from_bytes(ledger.to_bytes())
    assert list(again) == ["a", "b", "c"]
    assert len(AppliedLedger.from_bytes(AppliedLedger().to_bytes())) == 0


@pytest.mark.parametrize("data", [b'{"a": 1}', b'["a", 2]', b'[""]', b"not json"])
def test_ledger_rejects_malformed_bytes(data: bytes) -> None:
    with pytest.raises(ValueError):
        AppliedLedger.from_bytes(data)


def test_counters_flatten_for_metrics() -> None:
    counters = QueueCounters(read=3)
    counters.count_dead(REASON_DECODE)
    counters.count_dead(REASON_DECODE)
    counters.count_dead(REASON_INVALID)
    flat = counters.as_dict()
    assert flat["read"] == 3 and flat["dead_lettered"] == 3
    assert flat["dead_lettered.decode"] == 2 and flat["dead_lettered.invalid"] == 1


def test_clients_that_decode_responses_are_refused() -> None:
    with pytest.raises(ValueError, match="decode_responses"):
        GroupProducer(fakeredis.FakeAsyncRedis(decode_responses=True), RUN, 10)


async def test_produce_read_ack_and_trim(redis: aioredis.Redis) -> None:
    producer = GroupProducer(redis, RUN, max_len=10)
    ids = [await producer.append(make_group(f"g{i}")) for i in range(4)]
    consumer = GroupConsumer(redis, RUN, "c1", expected_n=2)
    batch = await consumer.read(3)
    assert [d.entry_id for d in batch] == ids[:3]
    assert [d.group.group_id for d in batch if d.group] == ["g0", "g1", "g2"]
    assert all(d.deliveries == 1 and d.error is None for d in batch)
    assert await consumer.ack([batch[0].entry_id]) == 1
    assert await trim_floor(redis, RUN) == batch[1].entry_id
    assert await producer.trim_acknowledged() == 1
    assert await redis.xlen(keys.groups(RUN)) == 3


async def test_duplicates_are_skipped_and_acked(redis: aioredis.Redis) -> None:
    producer = GroupProducer(redis, RUN, max_len=10)
    for group_id in ["g0", "g1"]:
        await producer.append(make_group(group_id))
    await redis.xadd(keys.groups(RUN), encode_entry(make_group("g0")))  # not the producer's: it enqueues once
    consumer = GroupConsumer(redis, RUN, "c1", ledger=AppliedLedger(["g0"]))
    batch = await consumer.read(10)
    assert [d.group.group_id for d in batch if d.group] == ["g1"]
    assert consumer.counters.skipped_duplicate == 2
    assert (await redis.xpending(keys.groups(RUN), "learner"))["pending"] == 1


async def test_a_group_id_is_enqueued_once_with_its_bookkeeping(redis: aioredis.Redis) -> None:
    producer = GroupProducer(redis, RUN, max_len=10)
    await redis.hset(keys.inflight(RUN), mapping={"g0": "{}", "g1": "{}"})
    first = await producer.append(make_group("g0"))
    assert first is not None and await producer.append(make_group("g0")) is None
    assert await producer.append(make_group("g1")) is not None
    assert (await entries(redis, keys.groups(RUN)))[0][0] == first
    assert await redis.xlen(keys.groups(RUN)) == 2
    assert await redis.smembers(keys.enqueued(RUN)) == {b"g0", b"g1"}
    assert await redis.hlen(keys.inflight(RUN)) == 0  # cleared by the repeat too
    assert await redis.hget(keys.counters(RUN), Counter.GROUPS_QUEUED) == b"2"


async def test_trimming_counts_what_it_removed(redis: aioredis.Redis) -> None:
    producer = GroupProducer(redis, RUN, max_len=10)
    for i in range(3):
        await producer.append(make_group(f"g{i}"))
    consumer = GroupConsumer(redis, RUN, "c1", expected_n=2)
    await consumer.ack([d.entry_id for d in await consumer.read(2)])
    assert await producer.trim_acknowledged() == 2
    assert await producer.trim_acknowledged() == 0
    assert await redis.hget(keys.counters(RUN), Counter.STREAM_TRIMMED) == b"2"
    assert await redis.hlen(keys.trimmed(RUN)) == 2


async def test_poison_and_invalid_go_to_dead_letter(redis: aioredis.Redis) -> None:
    producer = GroupProducer(redis, RUN, max_len=10)
    await redis.xgroup_create(keys.groups(RUN), "learner", id="0", mkstream=True)
    await redis.xadd(keys.groups(RUN), {b"data": b"\xff\xff\xff garbage"})
    bad = make_group("bad")
    bad.samples[0].reward.status = REWARD_STATUS_SCORER_ERROR
    await producer.append(bad)
    await producer.append(make_group("good"))
    consumer = GroupConsumer(redis, RUN, "c1")
    batch = await consumer.read(10)
    assert [d.group.group_id for d in batch if d.group] == ["good"]
    assert consumer.counters.dead_lettered == {REASON_DECODE: 1, REASON_INVALID: 1}
    dead = await entries(redis, keys.dead_letters(RUN))
    assert [f[b"reason"] for _, f in dead] == [b"decode", b"invalid"]
    assert dead[0][1][b"data"] == b"\xff\xff\xff garbage"
    assert b"SCORER_ERROR" in dead[1][1][b"error"]
    assert (await redis.xpending(keys.groups(RUN), "learner"))["pending"] == 1


async def test_caller_dead_letters_a_group_that_poisons_a_step(redis: aioredis.Redis) -> None:
    producer = GroupProducer(redis, RUN, max_len=10)
    await producer.append(make_group("g0"))
    consumer = GroupConsumer(redis, RUN, "c1")
    (delivery,) = await consumer.read(1)
    await consumer.dead_letter(delivery, "loss is NaN")
    (_, record), *_ = await entries(redis, keys.dead_letters(RUN))
    assert record[b"error"] == b"loss is NaN" and record[b"reason"] == REASON_STEP.encode()
    assert record[b"entry_id"] == delivery.entry_id.encode() and record[b"group_id"] == b"g0"
    assert ScoredGroup.FromString(record[b"data"]) == delivery.group
    assert (await redis.xpending(keys.groups(RUN), "learner"))["pending"] == 0


async def test_backpressure_times_out_when_full(redis: aioredis.Redis) -> None:
    producer = GroupProducer(redis, RUN, max_len=2, poll_s=0.01)
    await producer.append(make_group("g0"))
    await producer.append(make_group("g1"))
    with pytest.raises(BackpressureTimeout):
        await producer.append(make_group("g2"), timeout_s=0.05)
    assert await redis.xlen(keys.groups(RUN)) == 2
    await GroupConsumer(redis, RUN, "c1").read(1)
    await producer.append(make_group("g2"), timeout_s=0.05)
    assert await redis.xlen(keys.groups(RUN)) == 3


async def test_trim_waits_for_every_consumer_group_and_keeps_summaries(
    redis: aioredis.Redis,
) -> None:
    producer = GroupProducer(redis, RUN, max_len=10)
    ids = [await producer.append(make_group(f"g{i}", version=i)) for i in range(3)]
    await redis.xgroup_create(keys.groups(RUN), "audit", id="0")
    consumer = GroupConsumer(redis, RUN, "c1", expected_n=2)
    await consumer.ack([d.entry_id for d in await consumer.read(3)])
    assert await trim_acknowledged(redis, RUN) == 0  # "audit" has read nothing yet
    await redis.xreadgroup("audit", "a1", {keys.groups(RUN): ">"}, count=2)
    await redis.xack(keys.groups(RUN), "audit", ids[0])
    assert await trim_acknowledged(redis, RUN) == 1  # ids[1] pending in "audit", ids[2] undelivered
    assert await redis.xlen(keys.groups(RUN)) == 2
    assert await redis.hgetall(keys.trimmed(RUN)) == {ids[0].encode(): b'["g0", [0]]'}
