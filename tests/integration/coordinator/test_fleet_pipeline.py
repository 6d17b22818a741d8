"""Two runs on one shared rollout fleet, through a real coordinator run manager over a real Redis: one
in-process rollout replica (scripted answers, real gRPC on loopback) registered under the fleet's scope
with both runs' adapters, a real reward servicer, and a stand-in learner per run.

Both runs' groups are generated on the fleet's replica, run a's on its adapter (its learner announced
version 1) and run b's on the base (version 0); the replica never holds more than its capacity nor a run
more than its `max_in_flight_per_replica`; the fleet's members hash holds both runs while they run and
neither once they are stopped; the fleet's summed signal (in Redis and its gauges) is there while they
run and removed after; the fleet route shows members, the replica's adapters and the signal to the
operator only. A fleet run that fails (its prompts cannot be read) leaves the fleet too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter as Tally
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from rlfabric.contracts import fleet, keys, registry
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.fleet_api import add_fleet_route
from rlfabric.coordinator.manager import RunManager
from rlfabric.coordinator.runs import RunState, RunStore
from rlfabric.learner.queue import GroupConsumer
from rlfabric.reward.server import RewardServicer
from rlfabric.reward.service import RewardEngine
from rlfabric.runspec import RunSpec
from rlfabric.runtime.grpc_server import GrpcServer, full_service_name
from rlfabric.v1 import common_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from rlfabric.weights.adapters import run_adapter_name

FLEET = "shared"
RUNS = ("fleet-a", "fleet-b")
TOKEN = "fleet-operator-token"
G = 2  # groups per step
CAPACITY = 3  # prompts the replica holds at once
PER_RUN = 2  # each run's rollout.max_in_flight_per_replica
SERVING_GAUGE = "rlfabric_coordinator_fleet_serving_replicas"


class FleetReplica(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers each prompt with n short samples after a short delay; records every request and the most
    prompts held at once, in all and per run."""

    def __init__(self) -> None:
        self.requests: list[rollout_pb2.GenerateRequest] = []
        self.held: Tally[str] = Tally()
        self.most = 0
        self.most_per_run: Tally[str] = Tally()

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        run = request.request_id.split(":")[0]
        self.requests.append(request)
        self.held[run] += 1
        self.most = max(self.most, sum(self.held.values()))
        self.most_per_run[run] = max(self.most_per_run[run], self.held[run])
        try:
            await asyncio.sleep(0.05)
            for k in range(request.sampling.n):
                yield rollout_pb2.GeneratedSample(
                    request_id=request.request_id,
                    prompt_id=request.prompts[0].prompt_id,
                    sample_index=k,
                    prompt_token_ids=[1, 2],
                    token_ids=[3] * (k + 2),
                    logprobs=[-0.5] * (k + 2),
                    text="x" * (k + 2),
                    finish_reason=common_pb2.FINISH_REASON_STOP,
                    policy_version=request.min_policy_version,
                    replica_id="fleet-replica",
                )
        finally:
            self.held[run] -= 1

    def runs_served(self) -> set[str]:
        return {r.request_id.split(":")[0] for r in self.requests}


@pytest.fixture
async def replica(redis_url: str) -> AsyncIterator[FleetReplica]:
    """The fake replica on loopback, registered (and kept alive by a heartbeat) under the fleet's scope."""
    fake = FleetReplica()
    server = grpc.aio.server()
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    redis = Redis.from_url(redis_url)
    adapters = json.dumps({run_adapter_name(RUNS[0]): 1, run_adapter_name(RUNS[1]): 0})
    entry = registry.ReplicaEntry(
        "fleet-replica", f"127.0.0.1:{port}", 0, True, 0, CAPACITY, "tiny", "fake", adapters=adapters
    )
    beat = registry.Heartbeat(redis, keys.fleet_scope(FLEET), lambda: entry, interval_s=0.5)
    await beat.start()
    yield fake
    await beat.stop()
    await server.stop(None)
    await redis.aclose()


@pytest.fixture
async def reward_address() -> AsyncIterator[str]:
    engine = RewardEngine(workers=1, item_timeout_s=5.0, inline=["length_penalty"])
    servicer = RewardServicer(engine, max_batch_items=100, max_item_bytes=100_000)
    server = GrpcServer()
    service = full_service_name(reward_pb2, "RewardService")
    server.add_servicer(reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer, service)
    port = await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


def run_spec(name: str, weight: float, model: Path, tmp_path: Path) -> RunSpec:
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"say {i}"}) + "\n" for i in range(20)))
    return RunSpec.model_validate(
        {
            "name": name,
            "model": {"path": str(model), "lora": {"publish": "adapter"}},
            "dataset": {"path": str(data), "reference_field": None, "epochs": 100},
            "rollout": {
                "fleet": FLEET,
                "fleet_weight": weight,
                "max_in_flight_per_replica": PER_RUN,
                "max_staleness": 3,
                "sampling": {"n": 2, "max_tokens": 8},
            },
            "reward": {"scorer": "length_penalty", "params": {"target_length": 4}},
            "train": {"steps": 10_000, "groups_per_step": G},
            "weights": {"url": str(tmp_path / name / "weights")},
        }
    )


async def fake_learner(redis: Redis, run_id: str) -> None:
    """Reads and acknowledges the run's groups, reporting them trained (the lag bound reads it)."""
    consumer = GroupConsumer(redis, run_id, "fake-learner", max_deliveries=3, claim_idle_ms=60_000)
    read = 0
    while True:
        deliveries = await consumer.read(G, block_ms=200)
        await consumer.ack([d.entry_id for d in deliveries])
        read += len(deliveries)
        await redis.hset(keys.counters(run_id), "groups_trained", read)
        await redis.set(keys.step(run_id), read // G)


async def wait_until(predicate: Any, timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not reached in time")


async def queued(redis: Redis, run_id: str) -> int:
    return int(await redis.hget(keys.counters(run_id), "groups_queued") or 0)


def fleet_client(redis: Redis) -> httpx.AsyncClient:
    app = FastAPI()
    app.state.store = RunStore(redis)
    add_fleet_route(app, TOKEN)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator")


async def test_two_runs_share_one_fleet_replica_and_leave_the_fleet_when_stopped(
    redis_url: str, reward_address: str, replica: FleetReplica, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = CoordinatorServiceConfig.model_validate(
        {
            "redis": {"url": redis_url},
            "reward_address": reward_address,
            "data_roots": ["/"],
            "model_roots": ["/"],
            "scaling": {"interval_s": 0.2},
        }
    )
    redis = Redis.from_url(redis_url)
    await redis.set(keys.version(RUNS[0]), 1)  # run a's learner announced its first adapter version
    manager, store = RunManager(config, redis), RunStore(redis)
    learners = [asyncio.create_task(fake_learner(redis, run_id)) for run_id in RUNS]
    try:
        for run_id, weight in zip(RUNS, (1.0, 3.0), strict=True):
            await manager.on_submit(await store.create(run_spec(run_id, weight, tiny_model_dir, tmp_path)))
        for run_id in RUNS:
            await wait_until(lambda run_id=run_id: _at_least(queued(redis, run_id), 6))
        members = await fleet.members(redis, FLEET)
        assert sorted(members) == list(RUNS)
        assert members[RUNS[1]].weight == 3.0 and members[RUNS[0]].adapter == run_adapter_name(RUNS[0])
        assert members[RUNS[0]].weights_root == str(tmp_path / RUNS[0] / "weights")
        await wait_until(lambda: redis.exists(keys.fleet_scaling(FLEET)))
        async with fleet_client(redis) as client:
            body = (
                await client.get(f"/v1/fleets/{FLEET}", headers={"Authorization": f"Bearer {TOKEN}"})
            ).json()
            refused = await client.get(f"/v1/fleets/{FLEET}")
        assert refused.status_code == 401
        assert [m["run_id"] for m in body["members"]] == list(RUNS)
        [shown] = body["replicas"]
        assert shown["capacity"] == CAPACITY and set(shown["adapters"]) == {run_adapter_name(r) for r in RUNS}
        assert body["scaling"]["replicas"] == 1.0
        assert REGISTRY.get_sample_value(SERVING_GAUGE, {"fleet": FLEET}) == 1.0
        for run_id in RUNS:
            await store.request_stop(run_id)
        await wait_until(lambda: _true(not manager.tasks))
    finally:
        for learner in learners:
            learner.cancel()
        await manager.close()
    assert replica.runs_served() == set(RUNS)
    adapters = {(r.request_id.split(":")[0], r.adapter) for r in replica.requests}
    assert adapters == {(RUNS[0], run_adapter_name(RUNS[0])), (RUNS[1], "")}
    assert replica.most <= CAPACITY and max(replica.most_per_run.values()) <= PER_RUN
    assert replica.most == CAPACITY  # the fleet kept its replica full while both runs waited
    assert await fleet.members(redis, FLEET) == {}
    assert not await redis.exists(keys.fleet_scaling(FLEET))
    assert REGISTRY.get_sample_value(SERVING_GAUGE, {"fleet": FLEET}) is None
    for run_id in RUNS:
        assert (await store.get(run_id)).state == RunState.STOPPED
    await redis.aclose()


async def _at_least(value: Any, n: int) -> bool:
    return int(await value) >= n


async def _true(value: bool) -> bool:
    return value


async def test_a_fleet_run_that_fails_leaves_the_fleet(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = CoordinatorServiceConfig.model_validate(
        {
            "redis": {"url": redis_url},
            "reward_address": "127.0.0.1:1",
            "data_roots": ["/"],
            "model_roots": ["/"],
        }
    )
    redis = Redis.from_url(redis_url)
    manager, store = RunManager(config, redis), RunStore(redis)
    spec = run_spec(RUNS[0], 1.0, tiny_model_dir, tmp_path)
    (tmp_path / f"{RUNS[0]}.jsonl").unlink()  # the pipeline cannot load its prompts
    caplog.set_level(logging.INFO, logger="rlfabric.coordinator.manager")
    try:
        await manager.on_submit(await store.create(spec))
        await wait_until(lambda: _true(not manager.tasks))
    finally:
        await manager.close()
    assert (await store.get(RUNS[0])).state == RunState.FAILED
    messages = [r.getMessage() for r in caplog.records]
    assert (
        f"run {RUNS[0]} joined fleet {FLEET}" in messages and f"run {RUNS[0]} left fleet {FLEET}" in messages
    )
    assert await fleet.members(redis, FLEET) == {}
    await redis.aclose()
