"""The Redis stream of scored groups (`keys.groups`): its entry format, the producer side, trimming, and
the learner's exactly-once dead letters and stale drops.

The coordinator appends each `ScoredGroup` (protobuf bytes, never pickle) to `rlfabric:{run}:groups`;
the learner reads it through the consumer group "learner" (`rlfabric.learner.queue`). Delivery is
at-least-once; the learner turns it into exactly-once training with its ledger of applied group ids.

Invariants this module keeps:
- A group id is enqueued at most once (`GroupProducer`, one Lua script with its bookkeeping).
- Unconsumed entries are never trimmed. `append` applies backpressure instead of XADD MAXLEN: it waits
  while the group's lag (entries appended but not yet delivered to any consumer) is at least `max_len`.
  One producer object never overshoots (its appends are serialised); several producers sharing a run can
  overshoot by at most one entry each, since check and XADD are two commands.
- `trim_acknowledged` removes only entries below, for every consumer group, both its oldest pending id and
  its first undelivered id, i.e. entries every consumer has acknowledged; in the same MULTI it keeps each
  removed entry's summary (group id, policy versions) in `rlfabric:{run}:groups:trimmed`, so the ledger
  still sees every entry the stream ever held while the payloads (the bulk of Redis memory) go.
- The consumer group is created at id 0, so entries appended before the learner starts are delivered.
- A dead letter or a stale drop is recorded, counted and acknowledged in one script keyed by the entry id
  (`dead_letter_once`, `drop_stale_once`): replayed from the AOF and retried after a lost reply, it still
  counts once, so `dead_lettered` and `dropped_stale` (the coordinator's lag bound) stay exact.

Importable without torch: the coordinator uses it. The Redis client must be a `redis.asyncio.Redis` made
with `decode_responses=False` (payloads are bytes).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from opentelemetry.trace import SpanKind
from redis.exceptions import ResponseError

from rlfabric.contracts import keys, wire
from rlfabric.contracts.keys import CONSUMER_GROUP, Counter, DropReason
from rlfabric.runtime import telemetry
from rlfabric.v1.queue_pb2 import ScoredGroup

DATA_FIELD = b"data"
"""Entry field holding `ScoredGroup.SerializeToString()`."""

GROUP_ID_FIELD = b"group_id"
"""Entry field repeating the group id as text, for inspection with redis-cli."""


def require_bytes_client(redis: aioredis.Redis) -> None:
    """Raises ValueError for a client that decodes responses: stream payloads are binary protobuf."""
    if redis.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError("the Redis client must be created with decode_responses=False")


def as_str(value: bytes | str) -> str:
    """A Redis reply value (bytes with a bytes client) as text."""
    return value.decode() if isinstance(value, bytes) else value


def encode_entry(group: ScoredGroup) -> dict[bytes, bytes]:
    """The stream entry fields of `group`: the protobuf bytes and the group id."""
    if not group.group_id:
        raise ValueError("a ScoredGroup without group_id cannot be enqueued (it is the idempotency key)")
    return {DATA_FIELD: group.SerializeToString(), GROUP_ID_FIELD: group.group_id.encode()}


async def ensure_consumer_group(redis: aioredis.Redis, run_id: str) -> bool:
    """Creates the stream and its consumer group at id 0 unless they exist; True if it created them."""
    try:
        await redis.xgroup_create(keys.groups(run_id), CONSUMER_GROUP, id="0", mkstream=True)
    except ResponseError as error:
        if "BUSYGROUP" not in str(error):
            raise
        return False
    return True


async def group_info(redis: aioredis.Redis, run_id: str) -> dict[str, Any]:
    """XINFO GROUPS for the learner group (keys: pending, last-delivered-id, entries-read, lag, ...)."""
    for info in await redis.xinfo_groups(keys.groups(run_id)):
        if as_str(info["name"]) == CONSUMER_GROUP:
            return dict(info)
    raise LookupError(f"consumer group {CONSUMER_GROUP!r} missing on {keys.groups(run_id)}")


async def undelivered(redis: aioredis.Redis, run_id: str, *, cap: int) -> int:
    """Entries not yet delivered to the learner group (its lag), counted exactly up to `cap`.

    Redis reports `lag` as nil when it cannot compute it (e.g. after XDEL); then the entries after the
    group's last-delivered id are counted with a range bounded by `cap`, so the answer is min(lag, cap).
    """
    info = await group_info(redis, run_id)
    if info.get("lag") is not None:
        return min(int(info["lag"]), cap)
    start = "(" + as_str(info["last-delivered-id"])
    entries = await redis.xrange(keys.groups(run_id), min=start, max="+", count=cap)
    return len(entries or [])


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    """A stream id "ms-seq" as a comparable tuple."""
    ms, _, seq = as_str(entry_id).partition("-")
    return int(ms), int(seq or 0)


def format_id(parts: tuple[int, int]) -> str:
    return f"{parts[0]}-{parts[1]}"


async def trim_floor(redis: aioredis.Redis, run_id: str) -> str:
    """The lowest id that must be kept: over every consumer group of the stream, the minimum of its oldest
    pending id and the first id after its last-delivered one ("0-0", keep everything, without a group).

    Every entry below it was delivered to and acknowledged by every group. Safe against concurrent
    consumers: new pending entries only ever have ids above the last-delivered id read here, so the floor
    can only rise.
    """
    groups = await redis.xinfo_groups(keys.groups(run_id))
    floors = [await _group_floor(redis, run_id, info) for info in groups]
    return format_id(min(floors)) if floors else "0-0"


async def _group_floor(redis: aioredis.Redis, run_id: str, info: dict[str, Any]) -> tuple[int, int]:
    last = parse_id(info["last-delivered-id"])
    floor = (last[0], last[1] + 1)
    if int(info["pending"]) > 0:
        summary = await redis.xpending(keys.groups(run_id), as_str(info["name"]))
        if summary["min"] is not None:
            floor = min(floor, parse_id(summary["min"]))
    return floor


def entry_summary(fields: dict[bytes, bytes]) -> str:
    """What the ledger needs of a trimmed entry: JSON [group id, sorted distinct policy versions] (no
    versions for a payload that is not a ScoredGroup)."""
    group_id = as_str(fields.get(GROUP_ID_FIELD, b""))
    try:
        group = wire.decode_group(fields.get(DATA_FIELD, b""))
    except DecodeError:
        return json.dumps([group_id, []])
    versions = wire.group_versions(group)
    return json.dumps([group.group_id or group_id, sorted(versions)])


async def trim_acknowledged(redis: aioredis.Redis, run_id: str, *, batch: int = 1000) -> int:
    """Deletes up to `batch` acknowledged entries (those below `trim_floor`), recording each one's
    `entry_summary` in `keys.trimmed` in the same MULTI; returns how many were removed."""
    key = keys.groups(run_id)
    floor = await trim_floor(redis, run_id)
    entries: list[tuple[bytes, dict[bytes, bytes]]] = await redis.xrange(  # type: ignore[assignment]
        key, min="-", max="(" + floor, count=batch
    )
    if not entries:
        return 0
    last = parse_id(entries[-1][0])
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.trimmed(run_id), mapping={as_str(i): entry_summary(f) for i, f in entries})
        pipe.xtrim(key, minid=format_id((last[0], last[1] + 1)), approximate=False)
        _, removed = await pipe.execute()
    return int(removed)


# KEYS: dead-letter stream, groups stream, counters, dead-letter ids; ARGV: entry id, consumer group, counter,
# then the record's field/value pairs. Records and counts an entry once; acknowledges it every time.
DEAD_LETTER_ONCE = """
if redis.call('SADD', KEYS[4], ARGV[1]) == 1 then
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, 4))
  redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
end
redis.call('XACK', KEYS[2], ARGV[2], ARGV[1])
return 1
"""

# KEYS: dropped stream, groups stream, counters, stale ids; ARGV: entry id, consumer group, group id, lag,
# reason, counter, learner version.
DROP_STALE_ONCE = """
if redis.call('SADD', KEYS[4], ARGV[1]) == 1 then
  redis.call('XADD', KEYS[1], '*', 'group_id', ARGV[3], 'reason', ARGV[5], 'lag', ARGV[4],
             'learner_version', ARGV[7])
  redis.call('HINCRBY', KEYS[3], ARGV[6], 1)
end
redis.call('XACK', KEYS[2], ARGV[2], ARGV[1])
return 1
"""

# KEYS: groups stream, enqueued set, in-flight hash, counters; ARGV: group id, payload, counter. Appends a
# group id once (its entry id returned; false for a repeat) and clears its in-flight record every time.
ENQUEUE_ONCE = """
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then
  redis.call('HDEL', KEYS[3], ARGV[1])
  return false
end
local entry_id = redis.call('XADD', KEYS[1], '*', 'data', ARGV[2], 'group_id', ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[4], ARGV[3], 1)
return entry_id
"""


async def dead_letter_once(
    redis: aioredis.Redis, run_id: str, entry_id: str, record: dict[bytes, bytes]
) -> None:
    """Moves entry `entry_id` to the dead-letter stream (`record`), counts it in `dead_lettered` and
    acknowledges it, in one script: a retry or a replay records and counts nothing twice."""
    names = [
        keys.dead_letters(run_id),
        keys.groups(run_id),
        keys.counters(run_id),
        keys.dead_letter_ids(run_id),
    ]
    fields = [part for pair in record.items() for part in pair]
    args: list[bytes | str] = [entry_id, CONSUMER_GROUP, Counter.DEAD_LETTERED.value, *fields]
    await redis.register_script(DEAD_LETTER_ONCE)(keys=names, args=args)


async def drop_stale_once(
    redis: aioredis.Redis, run_id: str, entry_id: str, group_id: str, lag: int, learner_version: int
) -> None:
    """Records entry `entry_id` (group `group_id`, `lag` training steps behind the learner's policy
    `learner_version`) as dropped with the reason "stale", counts it in `dropped_stale` and acknowledges it,
    in one script: exact across retries and replays."""
    names = [keys.dropped(run_id), keys.groups(run_id), keys.counters(run_id), keys.stale_ids(run_id)]
    reason = DropReason.STALE
    args: list[str | int] = [
        entry_id, CONSUMER_GROUP, group_id, lag, reason.value, reason.counter.value, learner_version
    ]  # fmt: skip
    await redis.register_script(DROP_STALE_ONCE)(keys=names, args=args)


class BackpressureTimeout(TimeoutError):
    """The learner's backlog stayed at `max_len` for the whole append timeout; nothing was appended."""


class GroupProducer:
    """The coordinator's side of a run's groups stream: enqueues scored groups, exactly once per group id,
    while the learner's backlog has room, and trims the entries the learner acknowledged.

    Invariants:
    1. A group id is appended at most once: `ENQUEUE_ONCE` adds it to `keys.enqueued`, appends it, clears
       its in-flight record and counts `groups_queued` in one script, so neither a coordinator killed
       between two commands nor a call retried after a lost reply leaves the books off by one.
    2. An append happens only when fewer than `max_len` entries are undelivered (this producer's appends
       are serialised); the stream is never trimmed by length, so nothing unconsumed is lost.
    """

    def __init__(self, redis: aioredis.Redis, run_id: str, max_len: int, *, poll_s: float = 0.05) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        require_bytes_client(redis)
        self.redis = redis
        self.run_id = run_id
        self.names = [
            keys.groups(run_id),
            keys.enqueued(run_id),
            keys.inflight(run_id),
            keys.counters(run_id),
        ]
        """The keys of `ENQUEUE_ONCE`."""
        self.max_len = max_len
        self.poll_s = poll_s
        self.waits = 0
        """Appends that had to wait for room (a backpressure counter for metrics)."""
        self._enqueue = redis.register_script(ENQUEUE_ONCE)
        self._lock = asyncio.Lock()
        self._group_ready = False

    async def append(self, group: ScoredGroup, *, timeout_s: float | None = 30.0) -> str | None:
        """Appends `group` once the backlog has room; returns the entry id, None when its group id was
        enqueued before (nothing appended; its in-flight record is cleared all the same).

        Raises BackpressureTimeout if there is no room within `timeout_s` (None waits forever).
        """
        fields = encode_entry(group)
        args: list[bytes | str] = [fields[GROUP_ID_FIELD], fields[DATA_FIELD], Counter.GROUPS_QUEUED.value]
        async with self._lock:
            await self._wait_for_room(timeout_s)
            with telemetry.span("XADD", kind=SpanKind.CLIENT, attributes=telemetry.db_attributes("XADD")):
                entry_id = await self._enqueue(keys=self.names, args=args)
        return None if entry_id is None else as_str(entry_id)

    async def backlog(self) -> int:
        """Entries appended but not yet delivered to the learner, counted up to `max_len`."""
        await self._ensure_group()
        return await undelivered(self.redis, self.run_id, cap=self.max_len)

    async def trim_acknowledged(self) -> int:
        """Trims every entry the learner has acknowledged (`trim_acknowledged`, summaries kept for the
        ledger), counted in `stream_trimmed`; returns how many. The stream then holds only what is
        undelivered or pending."""
        await self._ensure_group()
        total = 0
        while removed := await trim_acknowledged(self.redis, self.run_id):
            total += removed
            await self.redis.hincrby(keys.counters(self.run_id), Counter.STREAM_TRIMMED.value, removed)  # type: ignore[misc]
        return total

    async def _wait_for_room(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waited = False
        while await self.backlog() >= self.max_len:
            if deadline is not None and time.monotonic() >= deadline:
                raise BackpressureTimeout(
                    f"{self.names[0]}: {self.max_len} groups undelivered for {timeout_s} s; "
                    "is the learner up?"
                )
            waited = True
            await asyncio.sleep(self.poll_s)
        self.waits += waited

    async def _ensure_group(self) -> None:
        if not self._group_ready:
            await ensure_consumer_group(self.redis, self.run_id)
            self._group_ready = True
