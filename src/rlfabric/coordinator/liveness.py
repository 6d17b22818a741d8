"""The inputs of the liveness checks in `health.py`, read from Redis when a run's status is read.

A running run warns when its learner stopped consuming (groups wait in the stream, no step and no read of
the stream for the stall time, `checks.learner_stall_s`), when no learner consumes at all (nothing waits
and no learner read or stepped for as long), or when no replica is registered. Nothing here is stored: the
warnings hold exactly while the condition does, and a run that is not running has none.
"""

from __future__ import annotations

import time
from typing import Any

from rlfabric.contracts import keys
from rlfabric.contracts.keys import CONSUMER_GROUP
from rlfabric.contracts.registry import discover
from rlfabric.contracts.streams import as_str, group_info, undelivered
from rlfabric.coordinator.health import (
    LEARNER_STALL_S,
    check_learner_stalled,
    check_no_learner,
    check_no_replica,
)
from rlfabric.coordinator.runs import RunRecord, RunState, RunStore

WAITING_CAP = 10_000
"""Undelivered groups are counted exactly up to this many."""


async def waiting_groups(redis: Any, run_id: str) -> int:
    """Groups in the stream the learner has not finished with: undelivered ones plus those delivered and
    not yet acknowledged (0 before the stream exists)."""
    if not await redis.exists(keys.groups(run_id)):
        return 0
    try:
        info = await group_info(redis, run_id)
    except LookupError:  # the stream exists, its consumer group not yet: nothing was delivered
        return int(await redis.xlen(keys.groups(run_id)))
    return await undelivered(redis, run_id, cap=WAITING_CAP) + int(info.get("pending") or 0)


async def learner_idle_s(redis: Any, run_id: str) -> float | None:
    """Seconds since the most recent read of the stream by any learner consumer; None if none read it."""
    if not await redis.exists(keys.groups(run_id)):
        return None
    groups = [as_str(g["name"]) for g in await redis.xinfo_groups(keys.groups(run_id))]
    if CONSUMER_GROUP not in groups:
        return None
    consumers = await redis.xinfo_consumers(keys.groups(run_id), CONSUMER_GROUP)
    idle = [int(c["idle"]) / 1000 for c in consumers]
    return min(idle) if idle else None


async def since_step_s(store: RunStore, run_id: str, now: float) -> float | None:
    """Seconds since the newest metrics row with a step was appended (its stream id is its time)."""
    rows = [r for r in await store.recent_metrics(run_id, 5) if "step" in r]
    return now - int(rows[-1]["_id"].split("-")[0]) / 1000 if rows else None


async def liveness_warnings(
    store: RunStore, record: RunRecord, stall_s: float = LEARNER_STALL_S
) -> list[str]:
    """The liveness warnings of a running run (none for a run in any other state). An offline run needs
    no replica and reads no stream: only its learner's steps count."""
    if record.state != RunState.RUNNING:
        return []
    redis, run_id, now = store.redis, record.run_id, time.time()
    age_s, step_s = now - record.created_at.timestamp(), await since_step_s(store, run_id, now)
    if record.spec.mode != "online":
        return [w for w in (check_no_learner(step_s, step_s, age_s, stall_s),) if w]
    waiting, idle_s = await waiting_groups(redis, run_id), await learner_idle_s(redis, run_id)
    learner = (
        check_learner_stalled(waiting, step_s, idle_s, age_s, stall_s)
        if waiting > 0
        else check_no_learner(step_s, idle_s, age_s, stall_s)
    )
    fleet = record.spec.rollout.fleet
    scope = keys.fleet_scope(fleet) if fleet is not None else run_id  # a fleet run's replicas are the fleet's
    lonely = check_no_replica(len(await discover(redis, scope)), record.spec.model.path)
    return [w for w in (learner, lonely) if w]
