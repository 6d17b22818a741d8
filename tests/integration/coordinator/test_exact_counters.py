"""`dead_lettered` and `dropped_stale` (read by the coordinator's lag bound) stay exact across a Redis
kill: a redis-server with AOF is SIGKILLed after the learner dead-lettered one entry and dropped another
as stale, restarted on the same data, and the learner repeats both calls (as it does when a reply was lost
and the entries are redelivered). Each entry is recorded and counted once."""

from __future__ import annotations

import socket
from pathlib import Path

import redis.asyncio as aioredis

from rlfabric.contracts import keys
from rlfabric.contracts.streams import GroupProducer
from rlfabric.learner.queue import Delivery, GroupConsumer
from rlfabric.local.procs import ServiceProcess
from rlfabric.v1 import common_pb2, queue_pb2

RUN = "exact"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(data: Path, port: int) -> ServiceProcess:
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction"]
    proc = ServiceProcess("redis", argv, log_path=data / "redis.log")
    proc.start(r"Ready to accept connections", timeout_s=30)
    return proc


def group(group_id: str) -> queue_pb2.ScoredGroup:
    scored = queue_pb2.ScoredGroup(run_id=RUN, group_id=group_id, policy_version=0)
    sample = scored.samples.add(sample_index=0, token_ids=[1], logprobs=[-1.0], policy_version=0)
    sample.reward.status = common_pb2.REWARD_STATUS_OK
    return scored


async def record_both(url: str) -> None:
    """Reads both entries, dead-letters the first and drops the second as stale (the learner's calls)."""
    from rlfabric.learner.leader import StepSource  # the learner's stale-drop path (imports torch)

    client = aioredis.Redis.from_url(url)
    consumer = GroupConsumer(client, RUN, "learner-0")
    delivered = await consumer.read(2)
    if len(delivered) < 2:  # after the restart both are acknowledged: replay the same calls by id
        delivered = await _replay(client)
    await consumer.dead_letter(delivered[0], "poisons the step")
    await StepSource(consumer, client, RUN, max_staleness=1).drop_stale(delivered[1], lag=3, version=3)
    await client.aclose()


async def _replay(client: aioredis.Redis) -> list[Delivery]:
    entries = await client.xrange(keys.groups(RUN))
    return [Delivery(i.decode(), queue_pb2.ScoredGroup.FromString(f[b"data"]), None, 2) for i, f in entries]


async def counts(url: str) -> tuple[dict[str, int], int, int, int]:
    client = aioredis.Redis.from_url(url)
    counters = {k.decode(): int(v) for k, v in (await client.hgetall(f"rlfabric:{RUN}:counters")).items()}
    dead = await client.xlen(keys.dead_letters(RUN))
    dropped = await client.xlen(f"rlfabric:{RUN}:dropped")
    pending = int((await client.xpending(keys.groups(RUN), "learner"))["pending"])
    await client.aclose()
    return counters, dead, dropped, pending


async def test_counters_stay_exact_when_the_calls_are_repeated_after_a_redis_kill(tmp_path: Path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(tmp_path, port)
    try:
        client = aioredis.Redis.from_url(url)
        producer = GroupProducer(client, RUN, max_len=10)
        for group_id in ("poison", "old"):
            await producer.append(group(group_id))
        await client.aclose()
        await record_both(url)
        server.kill()  # SIGKILL: the AOF (fsync always) holds both scripts' effects
        server = start_redis(tmp_path, port)
        await record_both(url)  # the same two calls again
        counters, dead, dropped, pending = await counts(url)
    finally:
        server.stop()
    assert (counters.get("dead_lettered"), counters.get("dropped_stale")) == (1, 1)
    assert (dead, dropped, pending) == (1, 1, 0)
