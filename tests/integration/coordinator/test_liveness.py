"""Run-status liveness warnings on a real Redis: a running run warns when groups wait and no learner read
them for `LEARNER_STALL_S`, and when no replica is registered; a learner that just read the stream, a
registered replica, or a run that is not running silence them. The pure checks' thresholds are tested on
numbers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from rlfabric.contracts import keys
from rlfabric.contracts.keys import CONSUMER_GROUP
from rlfabric.contracts.registry import ReplicaEntry, register
from rlfabric.contracts.streams import ensure_consumer_group
from rlfabric.coordinator import liveness
from rlfabric.coordinator.health import LEARNER_STALL_S, check_learner_stalled, check_no_replica
from rlfabric.coordinator.runs import RunStore
from rlfabric.runspec import RunSpec

STALL = LEARNER_STALL_S


def test_the_learner_counts_as_stalled_only_when_groups_wait_and_it_is_quiet() -> None:
    assert check_learner_stalled(3, STALL + 1, STALL + 1, 100.0) is not None
    assert check_learner_stalled(0, STALL + 1, STALL + 1, 100.0) is None  # nothing waits
    assert check_learner_stalled(3, STALL - 1, STALL + 1, 100.0) is None  # it stepped lately
    assert check_learner_stalled(3, STALL + 1, STALL - 1, 100.0) is None  # it read lately
    assert check_learner_stalled(3, None, None, STALL - 1) is None  # a young run
    message = check_learner_stalled(3, None, None, STALL + 5) or ""
    assert "no learner step yet" in message and "3 group(s) wait" in message
    assert check_no_replica(0) is not None and check_no_replica(1) is None


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RunStore]:
    client = Redis.from_url(redis_url)
    yield RunStore(client)
    await client.aclose()


async def running_run(store: RunStore, name: str) -> None:
    spec = RunSpec.model_validate({"name": name, "model": {"path": "m"}, "dataset": {"path": "d.jsonl"}})
    await store.create(spec)
    await store.set_state(name, "running")


async def warnings(store: RunStore, run_id: str, *, later_s: float = 0.0) -> list[str]:
    """The run's liveness warnings, read `later_s` seconds from now (the run's age and the time of its
    last step move; Redis's own idle clock does not)."""
    with pytest.MonkeyPatch.context() as patch:
        now = liveness.time.time() + later_s
        patch.setattr(liveness.time, "time", lambda: now)
        return await liveness.liveness_warnings(store, await store.get(run_id))


async def test_waiting_groups_nobody_reads_and_no_replica_warn(store: RunStore) -> None:
    await running_run(store, "lonely")
    assert [w for w in await warnings(store, "lonely") if "learner" in w] == []  # nothing waits yet
    await ensure_consumer_group(store.redis, "lonely")
    await store.redis.xadd(keys.groups("lonely"), {"data": b"x"})
    found = await warnings(store, "lonely", later_s=STALL + 1)
    assert any("learner stopped consuming" in w and "1 group(s) wait" in w for w in found), found
    assert any("no rollout replica serves" in w for w in found), found


async def test_a_reading_learner_and_a_registered_replica_are_quiet(store: RunStore) -> None:
    await running_run(store, "busy")
    await ensure_consumer_group(store.redis, "busy")
    await store.redis.xadd(keys.groups("busy"), {"data": b"x"})
    await store.redis.xadd(keys.groups("busy"), {"data": b"y"})
    await store.redis.xreadgroup(CONSUMER_GROUP, "learner-0", {keys.groups("busy"): ">"}, count=1)
    entry = ReplicaEntry("rollout-0", "127.0.0.1:1", 0, True, 0, 8, "m", "transformers")
    await register(store.redis, "busy", entry, ttl_s=30)
    assert await warnings(store, "busy", later_s=STALL + 1) == []  # it read a moment ago (Redis's clock)
    assert await liveness.waiting_groups(store.redis, "busy") == 2  # one undelivered, one pending


async def test_a_run_that_is_not_running_has_no_liveness_warnings(store: RunStore) -> None:
    await running_run(store, "over")
    await store.set_state("over", "stopped")
    assert await warnings(store, "over", later_s=STALL + 1) == []


async def test_a_fleet_run_counts_the_fleets_replicas(store: RunStore) -> None:
    """A run on a shared fleet is served by the replicas registered under the fleet, not under its id."""
    spec = RunSpec.model_validate({
        "name": "tenant", "model": {"path": "m", "lora": {"rank": 8}}, "dataset": {"path": "d.jsonl"},
        "rollout": {"fleet": "shared"},
    })  # fmt: skip
    await store.create(spec)
    await store.set_state("tenant", "running")
    assert any("no rollout replica serves" in w for w in await warnings(store, "tenant"))
    entry = ReplicaEntry("rollout-0", "127.0.0.1:1", 0, True, 0, 8, "m", "vllm")
    await register(store.redis, keys.fleet_scope("shared"), entry, ttl_s=30)
    assert not any("no rollout replica serves" in w for w in await warnings(store, "tenant"))
