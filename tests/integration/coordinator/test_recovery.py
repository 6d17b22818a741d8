"""The pipeline's recovery against real processes (a reward service and a rollout replica as real
`rlfabric serve` processes, a real Redis) and a stand-in learner that acknowledges what it reads:

- a reward outage holds the generated samples and retries scoring (counted, warned in the run status while
  it lasts); nothing is generated twice, and the run goes on once the service is back on its port;
- a prompt longer than the replica's context is dropped with the reason `prompt_too_long`, never retried,
  and the replica is not blamed (no re-dispatch);
- acknowledged entries are trimmed, so the stream and Redis memory stay bounded over many groups, and the
  books still balance.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import redis.asyncio as aioredis

from rlfabric.contracts import keys
from rlfabric.contracts.streams import ensure_consumer_group
from rlfabric.coordinator.dataset import PromptRow
from rlfabric.coordinator.inflight import InFlight
from rlfabric.coordinator.pipeline import RunPipeline
from rlfabric.coordinator.runs import RunStore
from rlfabric.coordinator.scoring import REWARD_WARNING
from rlfabric.learner.queue import GroupConsumer
from rlfabric.local.procs import ServiceProcess
from rlfabric.reward.spec import ItemResult
from rlfabric.runspec import RunSpec
from rlfabric.v1 import rollout_pb2

RUN = "recovery"
G, N = 4, 2  # groups per step, samples per group
CONTEXT = 64  # the replica's max_model_len: the long prompt does not fit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlfabric.cli", *args]


def start_reward(tmp_path: Path, port: int) -> ServiceProcess:
    argv = cli("serve", "reward", "--port", str(port), "--insecure", "--set", "workers=1")
    proc = ServiceProcess("reward", argv, log_path=tmp_path / "reward.log")
    proc.start(r"listening on (\S+)", timeout_s=60)
    return proc


def start_replica(tmp_path: Path, model: Path, redis_url: str) -> ServiceProcess:
    argv = cli(
        "serve", "rollout", "--model", str(model), "--engine", "transformers", "--port", "0", "--insecure"
    )
    settings = [f"run_id={RUN}", f"redis.url={redis_url}", "replica_id=r0", "heartbeat_s=0.5"]
    for setting in [*settings, f"engine.max_model_len={CONTEXT}"]:
        argv += ["--set", setting]
    proc = ServiceProcess("r0", argv, log_path=tmp_path / "r0.log")
    proc.start(r"serving version", timeout_s=120)
    return proc


def make_spec(tmp_path: Path, model: Path) -> RunSpec:
    rows = [{"id": f"p{i}", "prompt": f"say {i}"} for i in range(10)]
    rows.append({"id": "long", "prompt": "x" * CONTEXT})
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return RunSpec.model_validate(
        {
            "name": RUN,
            "model": {"path": str(model)},
            "dataset": {"path": str(data), "reference_field": None, "epochs": 100},
            "rollout": {"sampling": {"n": N, "max_tokens": 8}, "max_staleness": 1},
            "reward": {"scorer": "length_penalty", "params": {"target_length": 4}},
            "train": {"steps": 10_000, "groups_per_step": G},
        }
    )


async def fake_learner(redis: aioredis.Redis, done: asyncio.Event) -> None:
    """Reads and acknowledges groups, reporting them trained (the coordinator's lag bound reads it)."""
    consumer = GroupConsumer(redis, RUN, "fake-learner", max_deliveries=3, claim_idle_ms=60_000)
    read = 0
    while not done.is_set():
        deliveries = await consumer.read(G, block_ms=200)
        await consumer.ack([d.entry_id for d in deliveries])
        read += len(deliveries)
        await redis.hset(f"rlfabric:{RUN}:counters", "groups_trained", read)
        await redis.set(f"rlfabric:{RUN}:step", read // G)


async def counters(redis: aioredis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(f"rlfabric:{RUN}:counters")).items()}


async def wait_for(redis: aioredis.Redis, name: str, at_least: int, timeout_s: float = 120.0) -> None:
    for _ in range(int(timeout_s / 0.2)):
        if (await counters(redis)).get(name, 0) >= at_least:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{name} did not reach {at_least}: {await counters(redis)}")


async def test_reward_outage_holds_samples_and_an_invalid_prompt_is_dropped(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    port = free_port()
    reward = start_reward(tmp_path, port)
    replica = start_replica(tmp_path, tiny_model_dir, redis_url)
    redis = aioredis.Redis.from_url(redis_url)
    store = RunStore(redis)
    record = await store.create(make_spec(tmp_path, tiny_model_dir))
    pipeline = RunPipeline(RUN, record.spec, redis, f"127.0.0.1:{port}", max_stream_length=64)
    stop, done = asyncio.Event(), asyncio.Event()

    async def stop_requested() -> bool:
        return stop.is_set()

    run = asyncio.get_running_loop().create_task(pipeline.run(stop_requested))
    learner = asyncio.get_running_loop().create_task(fake_learner(redis, done))
    try:
        await wait_for(redis, "dropped_prompt_too_long", 1)
        await wait_for(redis, "groups_queued", 4)
        reward.kill()  # SIGKILL: Score calls fail with UNAVAILABLE
        await wait_for(redis, "score_retries", 4)
        assert any(w.startswith(REWARD_WARNING) for w in (await store.get(RUN)).warnings)
        queued = (await counters(redis))["groups_queued"]
        reward = start_reward(tmp_path, port)  # back on its port: the held groups are scored
        await wait_for(redis, "groups_queued", queued + 2 * G)
        assert not any(w.startswith(REWARD_WARNING) for w in (await store.get(RUN)).warnings)
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 120) == "stopped"
        done.set()
        await learner
        reward.stop()
        replica.stop()
    found = await counters(redis)
    # neither the outage nor the long prompt blamed the replica
    assert found.get("redispatches", 0) == 0, found
    assert found["samples_generated"] <= N * found["prompts_dispatched"], found  # nothing generated twice
    drops = [
        {k.decode(): v.decode() for k, v in f.items()}
        for _, f in await redis.xrange(f"rlfabric:{RUN}:dropped")
    ]
    invalid = [d for d in drops if d["reason"] == "prompt_too_long"]
    assert invalid and all(d["prompt_id"] == "long" for d in invalid)
    assert found["dropped_prompt_too_long"] == len(invalid)
    assert "exceed the context" in invalid[0]["detail"]
    await pipeline.trim_acknowledged()
    await assert_books_balance(redis)
    await redis.aclose()


async def assert_books_balance(redis: aioredis.Redis, *, drawn: bool = True) -> None:
    """Each dispatched prompt enqueued once, dropped with a reason or in flight; the stream (what is left
    of it plus its trimmed entries) holds each enqueued group once."""
    found = await counters(redis)
    drops = await redis.xlen(f"rlfabric:{RUN}:dropped")
    in_flight = await redis.hlen(f"rlfabric:{RUN}:inflight")
    enqueued = await redis.scard(f"rlfabric:{RUN}:enqueued")
    stream = await redis.xlen(keys.groups(RUN)) + await redis.hlen(keys.trimmed(RUN))
    assert found["groups_queued"] == enqueued == stream
    if drawn:
        assert found["prompts_dispatched"] == enqueued + drops + in_flight, (found, drops, in_flight)


def scored_group(tokens: int) -> tuple[list[rollout_pb2.GeneratedSample], list[ItemResult]]:
    """N generated samples of `tokens` tokens each and their (distinct) scores."""
    samples = [
        rollout_pb2.GeneratedSample(
            sample_index=i, token_ids=list(range(tokens)), logprobs=[-0.5] * tokens, text="x" * tokens
        )
        for i in range(N)
    ]
    scores = [ItemResult(str(i), float(i), "ok", "", {}, "s", "1", 0.0) for i in range(N)]
    return samples, scores


async def run_groups(pipeline: RunPipeline, consumer: GroupConsumer, first: int, count: int) -> int:
    """Enqueues `count` groups through the pipeline's own path (`finish_group`), the learner acknowledging
    as it goes and the pipeline trimming every 50 groups; returns the payload bytes enqueued."""
    samples, scores = scored_group(tokens=256)
    payload = 0
    for i in range(first, first + count):
        item = InFlight(f"p{i}:e0", f"p{i}", 0, i)
        payload += len(pipeline.build_group(item, samples, scores).SerializeToString())
        await pipeline.finish_group(item, PromptRow(f"p{i}", "say"), samples, scores)
        await consumer.ack([d.entry_id for d in await consumer.read(10)])
        if i % 50 == 49:
            await pipeline.trim_acknowledged()
    return payload


async def test_redis_memory_stays_flat_over_many_groups(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    spec = make_spec(tmp_path, tiny_model_dir)
    pipeline = RunPipeline(RUN, spec, redis, "127.0.0.1:1", max_stream_length=64)
    consumer = GroupConsumer(redis, RUN, "learner-0")
    await ensure_consumer_group(redis, RUN)
    await run_groups(pipeline, consumer, 0, 200)
    before = int((await redis.info("memory"))["used_memory"])
    payload = await run_groups(pipeline, consumer, 200, 1000)
    grown = int((await redis.info("memory"))["used_memory"]) - before
    assert await redis.xlen(keys.groups(RUN)) <= 50
    assert (await counters(redis))["stream_trimmed"] >= 1150
    assert grown < 0.1 * payload, (grown, payload)  # bookkeeping only (ids, summaries), no payloads
    await assert_books_balance(redis, drawn=False)
    await pipeline.scorer.close()
    await redis.aclose()
