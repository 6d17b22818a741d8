"""The coordinator's pipeline against real processes: a reward service, rollout replicas (reference
engine, as real `rlfabric serve rollout` processes registered in a real Redis), and a stand-in learner that
consumes the stream. The reward service and the replicas require their tokens and the pipeline presents
them (a pipeline without them would score, or generate, nothing). A replica added mid-run receives work;
a replica SIGKILLed mid-run loses nothing: its groups are re-dispatched and every drawn prompt ends
enqueued once, dropped with a reason, or in flight. A run's last steps get exactly the groups they train.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from rlfabric.contracts import keys
from rlfabric.coordinator.pipeline import RunPipeline
from rlfabric.learner.queue import GroupConsumer
from rlfabric.local.procs import ServiceProcess
from rlfabric.runspec import RunSpec
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc

RUN = "pipe"
REWARD_TOKEN = "pipeline-reward-token"
ROLLOUT_TOKEN = "pipeline-rollout-token"
ROLLOUT_AUTH = (("authorization", f"Bearer {ROLLOUT_TOKEN}"),)
G = 4  # groups per step


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlfabric.cli", *args]


@pytest.fixture
def reward_address(tmp_path: Path) -> Iterator[str]:
    proc = ServiceProcess(
        "reward",
        cli("serve", "reward", "--port", "0", "--set", "workers=1"),
        log_path=tmp_path / "reward.log",
        env={**os.environ, "RLFABRIC_REWARD__TOKEN": REWARD_TOKEN},
    )
    yield proc.start(r"listening on (\S+)", timeout_s=60).group(1)
    proc.stop()


def start_replica(tmp_path: Path, model: Path, redis_url: str, name: str) -> tuple[ServiceProcess, str]:
    argv = cli("serve", "rollout", "--model", str(model), "--engine", "transformers", "--port", "0")
    for setting in (f"run_id={RUN}", f"redis.url={redis_url}", f"replica_id={name}", "heartbeat_s=0.5"):
        argv += ["--set", setting]
    env = {
        **os.environ,
        "RLFABRIC_ROLLOUT__CLIENT_TOKEN": ROLLOUT_TOKEN,
        "RLFABRIC_ROLLOUT__LEARNER_TOKEN": "pipeline-learner-token",  # no UpdateWeights here
    }
    proc = ServiceProcess(name, argv, log_path=tmp_path / f"{name}.log", env=env)
    address = proc.start(r"listening on (\S+)", timeout_s=120).group(1)
    proc.wait_for(r"serving version", timeout_s=120)
    return proc, address


def spec(tmp_path: Path, model: Path, steps: int = 10_000) -> RunSpec:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"say {i}"}) + "\n" for i in range(20)))
    return RunSpec.model_validate(
        {
            "name": RUN,
            "model": {"path": str(model)},
            "dataset": {"path": str(data), "reference_field": None, "epochs": 100},
            "rollout": {"sampling": {"n": 2, "max_tokens": 8}, "max_staleness": 3},
            "reward": {"scorer": "length_penalty", "params": {"target_length": 4}},
            "train": {"steps": steps, "groups_per_step": G},
        }
    )


async def fake_learner(redis: aioredis.Redis, done: asyncio.Event) -> None:
    """Reads and acknowledges groups, advancing `rlfabric:{run}:step` every G groups and reporting what
    it trained in the run's counters (the coordinator's lag bound reads `groups_trained`)."""
    consumer = GroupConsumer(redis, RUN, "fake-learner", max_deliveries=3, claim_idle_ms=60_000)
    read = 0
    while not done.is_set():
        deliveries = await consumer.read(G, block_ms=200)
        await consumer.ack([d.entry_id for d in deliveries])
        read += len(deliveries)
        await redis.hset(f"rlfabric:{RUN}:counters", "groups_trained", read)
        await redis.set(f"rlfabric:{RUN}:step", read // G)


def run_pipeline(run_spec: RunSpec, redis: aioredis.Redis, reward_address: str) -> RunPipeline:
    """The run's pipeline, presenting the reward service's and the replicas' tokens."""
    return RunPipeline(
        RUN,
        run_spec,
        redis,
        reward_address,
        max_stream_length=64,
        reward_token=REWARD_TOKEN,
        rollout_token=ROLLOUT_TOKEN,
    )


async def stepwise_learner(redis: aioredis.Redis) -> None:
    """Trains in whole steps, as the learner does: takes G groups, then reports the step and the groups
    trained together."""
    consumer = GroupConsumer(redis, RUN, "stepwise-learner", max_deliveries=3, claim_idle_ms=60_000)
    trained = 0
    while True:
        batch = []
        while len(batch) < G:
            batch += await consumer.read(G - len(batch), block_ms=200)
        await consumer.ack([d.entry_id for d in batch])
        trained += len(batch)
        await redis.hset(f"rlfabric:{RUN}:counters", "groups_trained", trained)
        await redis.set(f"rlfabric:{RUN}:step", trained // G)


async def tokens(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        info = await rollout_pb2_grpc.RolloutServiceStub(channel).GetInfo(
            rollout_pb2.GetInfoRequest(), timeout=10, metadata=ROLLOUT_AUTH
        )
    return int(info.tokens_generated)


async def wait_until(predicate, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.2)):
        if await predicate():
            return
        await asyncio.sleep(0.2)
    raise AssertionError("condition not reached in time")


async def test_replica_joins_and_a_killed_replica_loses_nothing(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, reward_address: str
) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    first, _ = start_replica(tmp_path, tiny_model_dir, redis_url, "rollout-a")
    second = None
    stop, done = asyncio.Event(), asyncio.Event()
    pipeline = run_pipeline(spec(tmp_path, tiny_model_dir), redis, reward_address)

    async def stop_requested() -> bool:
        return stop.is_set()

    run = asyncio.get_running_loop().create_task(pipeline.run(stop_requested))
    learner = asyncio.get_running_loop().create_task(fake_learner(redis, done))
    queued = lambda: redis.hget(f"rlfabric:{RUN}:counters", "groups_queued")  # noqa: E731
    try:
        await wait_until(lambda: _at_least(queued(), 6))
        second, second_address = await asyncio.to_thread(
            start_replica, tmp_path, tiny_model_dir, redis_url, "rollout-b"
        )
        await wait_until(lambda: _positive(tokens(second_address)))  # the new replica receives work
        at_kill = int(await queued() or 0)
        first.kill()  # SIGKILL mid-run
        await wait_until(lambda: _at_least(queued(), at_kill + 10))  # the run goes on, on the survivor
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 120) == "stopped"
        done.set()
        await learner
        first.kill()
        if second is not None:
            second.stop()
    await assert_books_balance(redis)
    await redis.aclose()


async def _at_least(value, n: int) -> bool:  # type: ignore[no-untyped-def]
    return int(await value or 0) >= n


async def _positive(value) -> bool:  # type: ignore[no-untyped-def]
    return int(await value) > 0


async def assert_books_balance(redis: aioredis.Redis) -> None:
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(f"rlfabric:{RUN}:counters")).items()}
    drops = await redis.xlen(f"rlfabric:{RUN}:dropped")
    in_flight = await redis.hlen(f"rlfabric:{RUN}:inflight")
    enqueued = await redis.scard(f"rlfabric:{RUN}:enqueued")
    stream = await redis.xlen(keys.groups(RUN)) + await redis.hlen(keys.trimmed(RUN))  # trimmed: summaries
    assert counters["groups_queued"] == enqueued == stream
    assert counters["prompts_dispatched"] == enqueued + drops + in_flight, (counters, drops, in_flight)


async def test_no_group_is_generated_past_the_steps_left(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, reward_address: str
) -> None:
    """With 3 steps of lag allowed and 3 steps to train, the pipeline still queues only the 3 steps'
    groups: the lag bound would admit 4 steps' worth, but a group past the last step would only be
    generated, scored and left untrained."""
    redis = aioredis.Redis.from_url(redis_url)
    replica, _ = start_replica(tmp_path, tiny_model_dir, redis_url, "rollout-a")
    steps = 3
    pipeline = run_pipeline(spec(tmp_path, tiny_model_dir, steps=steps), redis, reward_address)

    async def never() -> bool:
        return False

    learner = asyncio.get_running_loop().create_task(stepwise_learner(redis))
    try:
        assert await asyncio.wait_for(pipeline.run(never), 300) == "completed"
    finally:
        learner.cancel()
        replica.stop()
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(f"rlfabric:{RUN}:counters")).items()}
    assert counters["groups_queued"] == steps * G, counters
    assert await redis.hlen(f"rlfabric:{RUN}:inflight") == 0
    await assert_books_balance(redis)
    await redis.aclose()
