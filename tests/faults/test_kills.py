"""SIGKILL each service mid-run (and restart Redis) with the whole loop running as real processes; the run
completes and the ledger balances: nothing dispatched is lost, nothing is trained twice.

The learner's own crash points are also proven in isolation, against hand-made groups, by
tests/integration/learner/test_learner_service.py (`test_killed_learner_resumes_...`); here they happen
inside a live loop, with the coordinator still producing while the learner is down.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fault_stack import Stack

from rlfabric.contracts import registry


def in_flight_on(stack: Stack, replica_id: str) -> int:
    import asyncio

    import redis.asyncio as aioredis

    async def read() -> int:
        client = aioredis.Redis.from_url(stack.redis_url)
        try:
            entries = await registry.discover(client, stack.spec.name)
        finally:
            await client.aclose()
        return next((e.in_flight for e in entries if e.replica_id == replica_id), 0)

    return asyncio.run(read())


def test_rollout_replica_sigkilled_mid_generation(make_stack: Callable[..., Stack]) -> None:
    # 24 steps, not the default 6: the learner trains the default run faster than the poll below can
    # catch rollout-0 holding a request (the run once completed before it was seen generating).
    stack = make_stack(train={"steps": 24})
    stack.start(replicas=2)
    stack.wait_for_step(1)
    stack.wait(lambda: in_flight_on(stack, "rollout-0") > 0, 60, "rollout-0 generating")
    stack.kill("rollout-0")  # mid-generation: it holds at least one request
    status = stack.finish()
    assert status["counters"]["redispatches"] >= 1, status["counters"]
    stack.books()


@pytest.mark.parametrize(
    "failpoint",
    [
        "learner.after_step=3",
        pytest.param("learner.after_read=3", marks=pytest.mark.faults_full),
        pytest.param("learner.before_ack=2", marks=pytest.mark.faults_full),
    ],
)
def test_learner_sigkilled_at_a_failpoint_resumes(make_stack: Callable[..., Stack], failpoint: str) -> None:
    stack = make_stack()
    stack.start(failpoints=failpoint)
    learner = stack.procs["learner"].proc
    assert learner is not None
    assert learner.wait(180) == -9, stack.tails()  # killed itself at the failpoint, mid-run
    stack.start_learner()  # resumes from its last complete checkpoint
    stack.finish()
    stack.books()
    stack.assert_every_step_trained()
    if failpoint.startswith("learner.before_ack"):  # checkpointed, never acknowledged: redelivered, skipped
        assert stack.last_metrics()["queue_skipped_duplicate"] >= 1


def test_coordinator_sigkilled_mid_run_and_restarted(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack()
    stack.start()
    stack.wait_for_step(2)
    stack.kill("coordinator")
    stack.start_coordinator()  # resumes the run: its cursor from Redis, its in-flight groups re-dispatched
    stack.finish()
    stack.books()


def test_reward_service_sigkilled_and_restarted(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack()
    stack.start()
    stack.wait_for_step(2)
    stack.kill("reward")
    stack.start_reward()  # same port: the coordinator's scoring calls fail meanwhile and are retried
    stack.finish()
    stack.books()


@pytest.mark.parametrize("sigkill", [False, pytest.param(True, marks=pytest.mark.faults_full)])
def test_redis_restarted_mid_run(make_stack: Callable[..., Stack], sigkill: bool) -> None:
    stack = make_stack()
    if sigkill:
        stack.appendfsync = "always"  # everysec may lose the last second of writes to a SIGKILL
    stack.start()
    stack.wait_for_step(2)
    stack.restart_redis(sigkill=sigkill)
    stack.finish()
    stack.books()
