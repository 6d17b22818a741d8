"""A run's policy lineage across learner restarts: which training step each published version holds, which
versions a restart rolled back, and how their groups go back to the coordinator to be generated again.

A learner that resumes from the checkpoint of step S (whose weights were, or were to be, published as
version V_c) after versions up to P > V_c were published, publishes the checkpoint's weights again at once
as version P + 1: versions only increase (replicas refuse older ones) and the replicas follow the newest,
so they move to the restored policy immediately. That publish is a *restore*. Versions V_c+1..P held
steps the crash undid: they are *rolled back*. Their groups are neither trained (they sample a policy
that no longer exists) nor dropped: the learner hands each back to the coordinator under a new group id,
and the coordinator generates it again with the restored policy.

Redis records (named in `rlfabric.contracts.keys`):

    keys.lineage      hash: restore version -> `RestoreRecord` JSON
    keys.rolled_back  stream: one entry per group handed back (group_id, redispatched_as, prompt_id,
                      version)
    keys.redispatch   list: the new group ids not yet taken by the coordinator
    keys.counters     field `rolled_back` (`Counter.ROLLED_BACK`): groups handed back

Invariants:
1. Within one learner life, version and step advance together (one publish per step), so a version holds
   step `segment step + (version - segment version)`, where its segment starts at the base model (version
   0, step 0) or at the newest restore at or below it.
2. A version is in the lineage unless a restore rolled it back. The lag between two lineage versions is
   the difference of their steps: a sample of V_c is on-policy for the restore of V_c.
3. A group is handed back in one script (`HAND_BACK`) that acknowledges its stream entry, records it in
   `:rolled_back`, records its new id in the coordinator's in-flight hash (where a restarted coordinator
   finds it) and on `:redispatch` (where a running one does), and counts it: the books balance at every
   instant, and a retried call whose first run went through does nothing.

Imports without torch or grpc (the coordinator and the ledger use it).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rlfabric.contracts import keys
from rlfabric.contracts.keys import CONSUMER_GROUP, Counter
from rlfabric.contracts.streams import as_str

RESTART_EVENT = "learner_restart"
"""The `event` of the metrics row a learner writes when it resumes."""
_REDISPATCH_SUFFIX = re.compile(r":r(\d+)$")


def redispatch_id(group_id: str) -> str:
    """The id a handed-back group is generated again under: `p:e0` -> `p:e0:r1` -> `p:e0:r2`. A new id,
    because a group id is enqueued (and trained) at most once."""
    match = _REDISPATCH_SUFFIX.search(group_id)
    if match is None:
        return f"{group_id}:r1"
    return f"{group_id[: match.start()]}:r{int(match[1]) + 1}"


def inflight_record(group_id: str, prompt_id: str, epoch: int) -> str:
    """The coordinator's in-flight record of a group (the fields of its `InFlight`): a handed-back group
    has no cursor position of its own, so it sorts first in its epoch."""
    record = {"group_id": group_id, "prompt_id": prompt_id, "epoch": epoch, "position": -1, "attempts": 0}
    return json.dumps(record)


# --- the lineage ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestoreRecord:
    """Version `version` = the checkpoint of step `restored_step` = the weights of version `weights_of`."""

    version: int
    """The version the restored weights were published as."""
    restored_step: int
    """The step of the checkpoint the learner resumed from."""
    weights_of: int
    """The checkpoint's own policy version: the version whose weights these are (0: the base model)."""
    rolled_back: list[int] = field(default_factory=list)
    """Versions this restore rolled back (published past the checkpoint, not equal to it)."""
    time: float = 0.0
    """Unix time of the restore."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RestoreRecord:
        raw = json.loads(text)
        return cls(
            int(raw["version"]),
            int(raw["restored_step"]),
            int(raw["weights_of"]),
            [int(v) for v in raw.get("rolled_back", [])],
            float(raw.get("time", 0.0)),
        )


@dataclass(frozen=True)
class Lineage:
    """The run's restores, oldest first; everything else follows from them (invariants 1 and 2)."""

    restores: tuple[RestoreRecord, ...] = ()

    @property
    def rolled_back(self) -> frozenset[int]:
        return frozenset(v for record in self.restores for v in record.rolled_back)

    def is_rolled_back(self, version: int) -> bool:
        return version in self.rolled_back

    def step_of(self, version: int) -> int:
        """The training step whose weights `version` holds (invariant 1)."""
        start_version, start_step = 0, 0
        for record in self.restores:
            if record.version <= version:
                start_version, start_step = record.version, record.restored_step
        return start_step + (version - start_version)

    def lag(self, current: int, version: int) -> int:
        """How many training steps `version`'s policy is behind `current`'s (both in the lineage)."""
        return self.step_of(current) - self.step_of(version)

    def with_restore(self, record: RestoreRecord) -> Lineage:
        return Lineage(tuple(sorted((*self.restores, record), key=lambda r: r.version)))


@dataclass(frozen=True)
class ResumePlan:
    """What a resuming learner does before its first step."""

    publish: int | None
    """The version to publish the restored weights as; None when the newest published version already
    holds them."""
    version: int
    """The learner's policy version once resumed (its next step publishes version + 1)."""
    rolled_back: list[int]
    """Versions published past the checkpoint that this resume rolls back."""


def plan_resume(lineage: Lineage, *, step: int, checkpoint_version: int, latest_published: int) -> ResumePlan:
    """The resume from the checkpoint of `step` (policy version `checkpoint_version`; 0 and 0 without a
    checkpoint) when versions up to `latest_published` (0: none) were published.

    Versions above the checkpoint's are rolled back unless they are earlier restores of this very
    checkpoint. The restored weights are published unless the newest version already holds them: as
    `checkpoint_version` when nothing reached it (a crash between the checkpoint and its publish), else as
    `latest_published + 1`."""
    already = lineage.rolled_back
    same = {r.version for r in lineage.restores if r.weights_of == checkpoint_version}
    above = range(checkpoint_version + 1, latest_published + 1)
    rolled_back = [v for v in above if v not in already and v not in same]
    if latest_published == checkpoint_version or latest_published in same:
        return ResumePlan(None, latest_published, rolled_back)
    if latest_published < checkpoint_version:
        return ResumePlan(checkpoint_version, checkpoint_version, rolled_back)
    return ResumePlan(latest_published + 1, latest_published + 1, rolled_back)


# --- Redis ----------------------------------------------------------------------------------------------


async def load_lineage(redis: Any, run_id: str) -> Lineage:
    """The run's lineage from its restore records (an async client)."""
    raw = await redis.hgetall(keys.lineage(run_id))
    return Lineage(tuple(sorted((RestoreRecord.from_json(v) for v in raw.values()), key=lambda r: r.version)))


async def record_restore(redis: Any, run_id: str, record: RestoreRecord) -> None:
    """Stores a restore record (idempotent: keyed by its version)."""
    await redis.hset(keys.lineage(run_id), str(record.version), record.to_json())


# KEYS: groups stream, rolled-back stream, in-flight hash, redispatch list, counters.
# ARGV: entry id, group id, new group id, prompt id, version, in-flight record, consumer group, counter.
HAND_BACK = """
if redis.call('XACK', KEYS[1], ARGV[7], ARGV[1]) == 0 then
  return 0
end
redis.call('XADD', KEYS[2], '*', 'group_id', ARGV[2], 'redispatched_as', ARGV[3], 'prompt_id', ARGV[4],
           'version', ARGV[5], 'entry_id', ARGV[1])
redis.call('HSET', KEYS[3], ARGV[3], ARGV[6])
redis.call('RPUSH', KEYS[4], ARGV[3])
redis.call('HINCRBY', KEYS[5], ARGV[8], 1)
return 1
"""


@dataclass(frozen=True)
class HandBack:
    """One group to hand back: its stream entry and what identifies its prompt."""

    entry_id: str
    group_id: str
    prompt_id: str
    epoch: int
    version: int


async def hand_back(redis: Any, run_id: str, group: HandBack) -> str | None:
    """Hands a group of a rolled-back version back to the coordinator (invariant 3); returns the id it is
    generated again under, None when a previous call already handed it back."""
    new_id = redispatch_id(group.group_id)
    names = [
        keys.groups(run_id),
        keys.rolled_back(run_id),
        keys.inflight(run_id),
        keys.redispatch(run_id),
        keys.counters(run_id),
    ]
    args = [
        group.entry_id,
        group.group_id,
        new_id,
        group.prompt_id,
        str(group.version),
        inflight_record(new_id, group.prompt_id, group.epoch),
        CONSUMER_GROUP,
        Counter.ROLLED_BACK.value,
    ]
    done = await redis.eval(HAND_BACK, len(names), *names, *args)
    return new_id if int(done) else None


async def take_handed_back(redis: Any, run_id: str) -> dict[str, Any] | None:
    """The coordinator's side: the next handed-back group's in-flight record, None when there is none.
    Ids whose record is gone (a restarted coordinator already finished them) are skipped."""
    while (raw := await redis.lpop(keys.redispatch(run_id))) is not None:
        record = await redis.hget(keys.inflight(run_id), as_str(raw))
        if record is not None:
            return dict(json.loads(record))
    return None


def restart_row(step: int, policy_version: int) -> dict[str, Any]:
    """The metrics row a resumed learner writes (metrics.jsonl and the metrics stream): plots break the
    curve there, since the steps after `step` are trained again."""
    return {
        "step": step,
        "event": RESTART_EVENT,
        "restored_step": step,
        "policy_version": policy_version,
        "time": time.time(),
    }
