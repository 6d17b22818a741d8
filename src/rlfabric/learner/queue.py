"""The learner's side of the groups stream: at-least-once delivery turned into exactly-once training.

Redis delivers each entry of `keys.groups` to one consumer of the group "learner" at least once
(redelivered after a crash, reclaimed from a dead consumer). Training stays exactly-once because:

1. `read` never hands out a group whose id is in the `AppliedLedger`; such a redelivery is acknowledged
   and counted as `skipped_duplicate`.
2. The caller adds the ids of the groups a step used to the ledger, saves the ledger *with* the
   checkpoint, and only then calls `ack`. A crash before the checkpoint is durable leaves the entries
   pending (they are redelivered and trained again, as the step was lost); a crash after it leaves them
   in the restored ledger (they are skipped).

Entries that cannot be trained go to the dead-letter stream `keys.dead_letters` (original
payload, error, reason, delivery count, original entry id) and are acknowledged in the same MULTI, so an
entry is never both lost and unrecorded: undecodable or invalid payloads at once, entries delivered more
than `max_deliveries` times (a group that crashes the learner every time), and groups the caller rejects
with `dead_letter`.

`claim_idle_ms` must exceed the longest time an entry legitimately stays unacknowledged (a step plus its
checkpoint), or a live consumer's entries are reclaimed by another one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from opentelemetry.trace import SpanKind

from rlfabric.contracts import keys, wire
from rlfabric.contracts.keys import CONSUMER_GROUP
from rlfabric.contracts.streams import (
    DATA_FIELD,
    as_str,
    dead_letter_once,
    ensure_consumer_group,
    require_bytes_client,
)
from rlfabric.runtime import telemetry
from rlfabric.v1.common_pb2 import REWARD_STATUS_OK, RewardStatus
from rlfabric.v1.queue_pb2 import ScoredGroup, ScoredSample

_log = logging.getLogger(__name__)

REASON_DECODE = "decode"
"""The payload is not a ScoredGroup."""
REASON_INVALID = "invalid"
"""The group decoded but fails `validate_group`."""
REASON_MAX_DELIVERIES = "max_deliveries"
"""The entry was delivered more than `max_deliveries` times without being acknowledged."""
REASON_DELETED = "deleted"
"""The entry was deleted from the stream (XDEL) while pending: only its id is left."""
REASON_STEP = "step"
"""The caller rejected the group while training (`GroupConsumer.dead_letter`)."""


@dataclass
class QueueCounters:
    """What the consumer did with the entries it read. `trained` is left to the caller to count."""

    read: int = 0
    trained: int = 0
    skipped_duplicate: int = 0
    reclaimed: int = 0
    dead_lettered: dict[str, int] = field(default_factory=dict)
    """Dead-lettered entries by reason (the REASON_* constants)."""

    def count_dead(self, reason: str) -> None:
        self.dead_lettered[reason] = self.dead_lettered.get(reason, 0) + 1

    @property
    def dead_lettered_total(self) -> int:
        return sum(self.dead_lettered.values())

    def as_dict(self) -> dict[str, int]:
        """Flat counters for metrics: dead letters as `dead_lettered.<reason>`."""
        flat = {
            "read": self.read,
            "trained": self.trained,
            "skipped_duplicate": self.skipped_duplicate,
            "reclaimed": self.reclaimed,
            "dead_lettered": self.dead_lettered_total,
        }
        flat.update({f"dead_lettered.{reason}": n for reason, n in sorted(self.dead_lettered.items())})
        return flat


@dataclass(frozen=True)
class Delivery:
    """One delivered stream entry.

    `read` returns only trainable deliveries: `group` set and `error` None. Rejected ones (dead-lettered
    and acknowledged already) carry `error` and, when the payload decoded, `group`; they are kept in
    `GroupConsumer.last_rejected`. `deliveries` counts this delivery (1 on first read).
    """

    entry_id: str
    group: ScoredGroup | None
    error: str | None
    deliveries: int
    data: bytes = field(default=b"", repr=False)
    """The entry's raw payload, kept so a dead letter carries the exact bytes that were enqueued."""


class AppliedLedger:
    """The ids of the groups already applied to the model; saved with the learner checkpoint.

    Invariant: an id is added only for a group whose step is part of the checkpoint the ledger is saved
    with. Serialised as a sorted JSON list of strings (compact, deterministic, no pickle).
    """

    def __init__(self, group_ids: Iterable[str] = ()) -> None:
        self._ids: set[str] = set()
        self.update(group_ids)

    def add(self, group_id: str) -> None:
        if not isinstance(group_id, str) or not group_id:
            raise ValueError(f"group id must be a non-empty string, got {group_id!r}")
        self._ids.add(group_id)

    def update(self, group_ids: Iterable[str]) -> None:
        for group_id in group_ids:
            self.add(group_id)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._ids))

    def to_bytes(self) -> bytes:
        return json.dumps(sorted(self._ids), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> AppliedLedger:
        """Inverse of `to_bytes`; raises ValueError on anything but a JSON list of non-empty strings."""
        ids = json.loads(data.decode())
        if not isinstance(ids, list):
            raise ValueError(f"applied-group ledger must be a JSON list, got {type(ids).__name__}")
        return cls(ids)


def validate_group(
    group: ScoredGroup, *, expected_n: int | None = None, run_id: str | None = None
) -> str | None:
    """The first reason `group` cannot be trained on, or None if it can.

    Checked: group id set; run id matches (when given); n samples (== expected_n when given) with
    sample_index 0..n-1 in order; per sample, token_ids and logprobs of equal non-zero length with finite
    logprobs, the group's policy_version, a multi-turn loss mask and turns that fit the completion (with a
    policy token), and a reward with status OK and finite value and components.
    """
    if not group.group_id:
        return "group_id is empty"
    if run_id is not None and group.run_id != run_id:
        return f"run_id {group.run_id!r} is not this run's ({run_id!r})"
    if not group.samples:
        return "group has no samples"
    if expected_n is not None and len(group.samples) != expected_n:
        return f"group has {len(group.samples)} samples, expected {expected_n}"
    for index, sample in enumerate(group.samples):
        error = _sample_error(sample, index, group.policy_version)
        if error:
            return f"sample {index}: {error}"
    return None


def _sample_error(sample: ScoredSample, index: int, policy_version: int) -> str | None:
    if sample.sample_index != index:
        return f"sample_index is {sample.sample_index}, expected {index}"
    if not sample.token_ids or len(sample.token_ids) != len(sample.logprobs):
        return f"{len(sample.token_ids)} token_ids vs {len(sample.logprobs)} logprobs (must match, > 0)"
    if not all(math.isfinite(lp) for lp in sample.logprobs):
        return "non-finite logprob"
    if sample.policy_version != policy_version:
        return f"policy_version {sample.policy_version} differs from the group's {policy_version}"
    return _turns_error(sample) or _reward_error(sample)


def _turns_error(sample: ScoredSample) -> str | None:
    """A multi-turn sample's loss mask and turns as the trainer needs them (`Rollout.check`), and at least
    one policy token: found here, a malformed trajectory is dead-lettered instead of failing a step. A
    single-turn sample (neither field) has nothing to check and is not converted."""
    if not sample.loss_mask and not sample.turns:
        return None
    rollout = wire.rollout_from_proto(sample)
    try:
        rollout.check("")
    except ValueError as exc:
        return str(exc).removeprefix("group '': ")
    if rollout.loss_mask is not None and not any(rollout.loss_mask):
        return "the loss mask holds no policy token"
    return None


def _reward_error(sample: ScoredSample) -> str | None:
    reward = sample.reward
    if reward.status != REWARD_STATUS_OK:
        status = RewardStatus.Name(reward.status)
        return f"reward status {status}" + (f": {reward.message}" if reward.message else "")
    if not math.isfinite(reward.value):
        return f"reward value {reward.value} is not finite"
    bad = sorted(name for name, value in reward.components.items() if not math.isfinite(value))
    return f"non-finite reward components {bad}" if bad else None


@dataclass(frozen=True)
class _Entry:
    """A raw entry as read from Redis, with its delivery count."""

    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int
    reclaimed: bool = False


class GroupConsumer:
    """One consumer of the learner group: reads, reclaims, validates, dead-letters, acknowledges.

    Not safe for concurrent `read` calls on one object; use one object per consumer name.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        run_id: str,
        consumer_name: str,
        *,
        max_deliveries: int = 3,
        claim_idle_ms: int = 60_000,
        ledger: AppliedLedger | None = None,
        expected_n: int | None = None,
    ) -> None:
        if max_deliveries < 1 or claim_idle_ms < 0:
            raise ValueError("max_deliveries must be >= 1 and claim_idle_ms >= 0")
        require_bytes_client(redis)
        self.redis = redis
        self.run_id = run_id
        self.name = consumer_name
        self.key = keys.groups(run_id)
        self.dead_key = keys.dead_letters(run_id)
        self.max_deliveries = max_deliveries
        self.claim_idle_ms = claim_idle_ms
        self.ledger = ledger if ledger is not None else AppliedLedger()
        self.expected_n = expected_n
        self.counters = QueueCounters()
        self.last_rejected: list[Delivery] = []
        """Entries the last `read` dead-lettered or skipped as duplicates (for logs and traces)."""
        self._in_flight: set[str] = set()
        self._history_cursor: str | None = "0"
        self._claim_cursor = "0-0"
        self._group_ready = False

    async def read(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to `count` trainable deliveries, oldest first.

        Sources, in order: this consumer's own pending entries left by a previous life (first calls
        only), entries idle for `claim_idle_ms` in other (dead) consumers (XAUTOCLAIM), new entries
        (XREADGROUP >, blocking up to `block_ms` only if the other sources gave nothing).
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        await self._ensure_group()
        started = time.time_ns()
        entries = await self._fetch(count, block_ms)
        self.last_rejected = []
        deliveries = [await self._admit(entry) for entry in entries]
        trainable = [d for d in deliveries if d is not None]
        if trainable:  # an empty poll is not worth a trace of its own
            trace_read(trainable, started)
        return trainable

    async def ack(self, entry_ids: Sequence[str]) -> int:
        """Acknowledges entries whose step is durable (checkpoint with the ledger saved); returns count."""
        if not entry_ids:
            return 0
        acked = int(await self.redis.xack(self.key, CONSUMER_GROUP, *entry_ids))
        self._in_flight.difference_update(entry_ids)
        return acked

    def forget(self, entry_id: str) -> None:
        """Stops tracking a delivered entry that the caller acknowledged in a script of its own."""
        self._in_flight.discard(entry_id)

    async def dead_letter(self, delivery: Delivery, error: str, *, reason: str = REASON_STEP) -> None:
        """Moves a delivered group that cannot be trained to the dead-letter stream and acknowledges it."""
        await self._dead_letter(dataclasses.replace(delivery, error=error), reason)

    # -- reading ---------------------------------------------------------------------------------------

    async def _fetch(self, count: int, block_ms: int | None) -> list[_Entry]:
        entries = await self._own_history(count)
        if len(entries) < count:
            taken = {entry.entry_id for entry in entries}
            entries += [e for e in await self._reclaim(count - len(entries)) if e.entry_id not in taken]
        if len(entries) < count:
            block = block_ms if not entries else None
            entries += await self._read_new(count - len(entries), block)
        return entries

    async def _own_history(self, count: int) -> list[_Entry]:
        """This consumer's pending entries from before this object existed (a restarted learner)."""
        if self._history_cursor is None:
            return []
        reply = await self.redis.xreadgroup(
            CONSUMER_GROUP, self.name, {self.key: self._history_cursor}, count
        )
        raw = _stream_entries(reply)
        # A short read is the end of the history. The cursor must stop there: the same `read` goes on to
        # claim and read new entries into this consumer's pending list, after the cursor, and a later
        # history read would deliver them again while they are held (a resumed run once trained three
        # groups twice in one step this way).
        self._history_cursor = as_str(raw[-1][0]) if len(raw) == count else None
        return await self._with_delivery_counts(raw, reclaimed=False)

    async def _reclaim(self, count: int) -> list[_Entry]:
        """Claims entries idle for `claim_idle_ms` in any consumer (XAUTOCLAIM bumps their counts)."""
        reply = await self.redis.xautoclaim(
            self.key, CONSUMER_GROUP, self.name, self.claim_idle_ms, self._claim_cursor, count=count
        )
        cursor, raw, deleted = reply[0], reply[1], reply[2] if len(reply) > 2 else []
        self._claim_cursor = as_str(cursor)
        for entry_id in deleted:
            gone = Delivery(as_str(entry_id), None, "entry deleted from the stream while pending", 0)
            await self._dead_letter(gone, REASON_DELETED)
        fresh = [(entry_id, fields) for entry_id, fields in raw if as_str(entry_id) not in self._in_flight]
        return await self._with_delivery_counts(fresh, reclaimed=True)

    async def _read_new(self, count: int, block_ms: int | None) -> list[_Entry]:
        reply = await self.redis.xreadgroup(CONSUMER_GROUP, self.name, {self.key: ">"}, count, block=block_ms)
        return [_Entry(as_str(i), dict(fields), 1) for i, fields in _stream_entries(reply)]

    async def _with_delivery_counts(self, raw: list[tuple[Any, Any]], *, reclaimed: bool) -> list[_Entry]:
        """Attaches each entry's delivery count from XPENDING (which includes the delivery just made)."""
        if not raw:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, _ in raw:
            pipe.xpending_range(self.key, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
        pending = await pipe.execute()
        counts = [int(rows[0]["times_delivered"]) if rows else 1 for rows in pending]
        return [
            _Entry(as_str(i), dict(fields or {}), n, reclaimed)
            for (i, fields), n in zip(raw, counts, strict=True)
        ]

    # -- admitting -------------------------------------------------------------------------------------

    async def _admit(self, entry: _Entry) -> Delivery | None:
        """Turns a raw entry into a trainable Delivery, or dead-letters / skips it and returns None."""
        if entry.entry_id in self._in_flight:
            # Held already, not yet acknowledged: handing it out again would train it twice. The one path
            # known to do it (the history cursor running past the history) is closed in `_own_history`;
            # this guard stays for any other.
            _log.warning("entry %s delivered again while held; not handed out twice", entry.entry_id)
            return None
        self.counters.read += 1
        self.counters.reclaimed += entry.reclaimed
        data = entry.fields.get(DATA_FIELD, b"")
        group, error, reason = self._decode(entry, data)
        delivery = Delivery(entry.entry_id, group, error, entry.deliveries, data)
        if group is not None and group.group_id in self.ledger:
            await self._skip_duplicate(delivery)
            return None
        if error is None and entry.deliveries > self.max_deliveries:
            error = f"delivered {entry.deliveries} times (max_deliveries={self.max_deliveries})"
            reason = REASON_MAX_DELIVERIES
        if error is None and group is not None:
            error = validate_group(group, expected_n=self.expected_n, run_id=self.run_id)
        if error is not None:
            await self._reject(Delivery(entry.entry_id, group, error, entry.deliveries, data), reason)
            return None
        self._in_flight.add(entry.entry_id)
        return delivery

    def _decode(self, entry: _Entry, data: bytes) -> tuple[ScoredGroup | None, str | None, str]:
        """(group, None, reason-if-invalid) or (None, error, reason) for a payload that is not a group."""
        if not entry.fields:
            return None, "entry deleted from the stream while pending", REASON_DELETED
        if not data:
            return None, f"entry has no {DATA_FIELD.decode()!r} field", REASON_DECODE
        try:
            return wire.decode_group(data), None, REASON_INVALID
        except DecodeError as exc:
            return None, f"not a ScoredGroup: {exc}", REASON_DECODE

    async def _skip_duplicate(self, delivery: Delivery) -> None:
        await self.redis.xack(self.key, CONSUMER_GROUP, delivery.entry_id)
        self._in_flight.discard(delivery.entry_id)
        self.counters.skipped_duplicate += 1
        self.last_rejected.append(delivery)

    async def _reject(self, delivery: Delivery, reason: str) -> None:
        await self._dead_letter(delivery, reason)
        self.last_rejected.append(delivery)

    async def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        """XADD to the dead-letter stream, count it and XACK the original, once (`dead_letter_once`)."""
        entry_id = delivery.entry_id
        record = {
            b"data": delivery.data,
            b"error": (delivery.error or "").encode(),
            b"reason": reason.encode(),
            b"deliveries": str(delivery.deliveries).encode(),
            b"entry_id": entry_id.encode(),
            b"group_id": (delivery.group.group_id if delivery.group is not None else "").encode(),
            b"consumer": self.name.encode(),
            b"dead_lettered_at": repr(time.time()).encode(),
        }
        await dead_letter_once(self.redis, self.run_id, entry_id, record)  # counted for the lag bound
        self._in_flight.discard(entry_id)
        self.counters.count_dead(reason)

    async def _ensure_group(self) -> None:
        if not self._group_ready:
            await ensure_consumer_group(self.redis, self.run_id)
            self._group_ready = True


def trace_read(deliveries: list[Delivery], started_ns: int) -> None:
    """Records the read that returned `deliveries` as an XREADGROUP span, linked to each group's trace."""
    stored = [wire.trace_from_proto(d.group.trace) for d in deliveries if d.group is not None]
    links = [c for carrier in stored if (c := telemetry.context_from_carrier(carrier)) is not None]
    attributes = {**telemetry.db_attributes("XREADGROUP"), "groups": len(deliveries)}
    with telemetry.span(
        "XREADGROUP", kind=SpanKind.CLIENT, attributes=attributes, links=links, start_time_ns=started_ns
    ):
        pass


def _stream_entries(reply: Any) -> list[tuple[Any, Any]]:
    """The (id, fields) pairs of an XREADGROUP reply for one stream (RESP2 list or RESP3 dict)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [tuple(e) for streams in reply.values() for e in streams[0]]
    return [tuple(e) for e in reply[0][1]]
