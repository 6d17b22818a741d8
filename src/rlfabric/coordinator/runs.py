"""Run records in Redis: the coordinator's whole memory of its runs.

Every piece of state lives in Redis, so a restarted coordinator finds its runs where it left them: the
index of runs, each run's record, counters, metrics stream and scaling signal (`rlfabric.contracts.keys`:
`runs_index`, `run`, `counters`, `metrics`, `scaling`).

State changes are check-and-set transactions (WATCH/MULTI), so two writers never move a run along an
illegal transition. A finished run (completed, failed, stopped) never changes state again.

Each run gets a bearer token of its own when it is stored (`create_with_token`): `<run id>.<secret>`,
handed out once; the record's hash keeps only its SHA-256 (`TOKEN_DIGEST_FIELD`, never part of
`RunRecord`), so nothing read back from Redis can act as the token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from rlfabric.contracts import keys
from rlfabric.contracts.keys import Counter
from rlfabric.contracts.metrics import decode_row
from rlfabric.runspec import RUN_NAME_PATTERN, RunSpec


class RunState(StrEnum):
    """A run's lifecycle state. The values are the record's `state` field in Redis and in the REST API's
    JSON; a member compares and hashes equal to its value."""

    PENDING = "pending"
    """Accepted, not started (or reopened to be resumed)."""
    RUNNING = "running"
    """The pipeline works on it."""
    COMPLETED = "completed"
    """Final: the learner reached its step budget, or every prompt was trained."""
    FAILED = "failed"
    """Final: the run could not go on (the record's `error` says why)."""
    STOPPED = "stopped"
    """Final: a stop was requested (through the API or by a health check)."""


FINISHED: frozenset[RunState] = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.STOPPED})
"""States a run never leaves (but `RunStore.reopen`, for failed and stopped ones)."""

TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.PENDING: frozenset({RunState.RUNNING, RunState.FAILED, RunState.STOPPED}),
    RunState.RUNNING: frozenset({RunState.COMPLETED, RunState.FAILED, RunState.STOPPED}),
    RunState.COMPLETED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.STOPPED: frozenset(),
}
"""Legal moves. Setting a non-final state to itself is an idempotent no-op (a restarted coordinator
marks its resumed runs running again)."""

COUNTERS = tuple(c.value for c in Counter)
"""The standard counter names (`keys.Counter`); `counters()` reports each (0 when never incremented) plus
any other."""

MetricsRows = list[dict[str, Any]]
"""Metrics rows, oldest first (an alias: `RunStore.list` shadows the builtin inside the class)."""
_STREAM_ID = re.compile(r"^(\d{1,20})(?:-(\d{1,20}))?$")
STREAM_ID_PART_MAX = 2**64 - 1
"""Each part of a Redis stream id (`<ms>-<seq>`) is an unsigned 64-bit integer."""
LAST_STREAM_ID = (STREAM_ID_PART_MAX, STREAM_ID_PART_MAX)
"""The largest stream id: no entry can follow it."""
TOKEN_DIGEST_FIELD = "token_sha256"
"""The field of a run's record hash (`keys.run`) holding the SHA-256 (hex) of the run's own token."""
TOKEN_SEPARATOR = "."
"""Between the run id and the secret in a run token (the secret, URL-safe base64, never holds it)."""
TOKEN_SECRET_BYTES = 32
"""Random bytes in a run token's secret."""
_RUN_ID = re.compile(RUN_NAME_PATTERN)


class RunError(Exception):
    """Base of the store's errors; the message is safe to show to an API client."""


class RunNotFound(RunError):
    """No run has this id (HTTP 404)."""


class RunExists(RunError):
    """A run with this name already exists (HTTP 409)."""


class InvalidTransition(RunError):
    """The run cannot move to the requested state, e.g. it has already finished (HTTP 409)."""


class RunRecord(BaseModel):
    """One run as the coordinator knows it."""

    run_id: str
    """Unique id; the run's name when the spec gives one."""
    name: str
    """Display name (equal to run_id)."""
    spec: RunSpec
    """The submitted spec, with `name` set to the run id."""
    state: RunState = RunState.PENDING
    """Lifecycle state."""
    created_at: datetime
    """When the run was accepted (UTC)."""
    updated_at: datetime
    """Last change of state, progress or warnings (UTC)."""
    error: str | None = None
    """Why the run failed; None otherwise."""
    step: int = 0
    """Last learner step reported."""
    policy_version: int = 0
    """Last published policy version reported."""
    warnings: list[str] = Field(default_factory=list)
    """Warnings recorded by the services (health warnings from the metrics are computed on read)."""
    stop_requested: bool = False
    """A stop was requested; the pipeline winds the run down and marks it stopped."""
    stop_reason: str | None = None
    """Why the run was stopped: "api" (a user asked) or "health: <warning>" (an automatic stop)."""
    last_good_checkpoint: int | None = None
    """After a health stop: the step of the newest kept checkpoint from before the problem began."""

    @property
    def finished(self) -> bool:
        """True in a final state."""
        return self.state in FINISHED


def _now() -> datetime:
    return datetime.now(UTC)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _encode(record: RunRecord) -> dict[str, str]:
    """The record as hash fields (all strings)."""
    return {
        "run_id": record.run_id,
        "name": record.name,
        "spec": record.spec.model_dump_json(),
        "state": record.state,
        "created_at": record.created_at.isoformat(),
        "updated_at": record.updated_at.isoformat(),
        "error": record.error or "",
        "step": str(record.step),
        "policy_version": str(record.policy_version),
        "warnings": json.dumps(record.warnings),
        "stop_requested": "1" if record.stop_requested else "0",
        "stop_reason": record.stop_reason or "",
        "last_good_checkpoint": _optional_int(record.last_good_checkpoint),
    }


def _optional_int(value: int | None) -> str:
    return "" if value is None else str(value)


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text else None


def _decode(raw: Mapping[Any, Any]) -> RunRecord:
    """The inverse of `_encode` (accepts a client with or without decode_responses)."""
    fields = {_text(k): _text(v) for k, v in raw.items()}
    return RunRecord(
        run_id=fields["run_id"],
        name=fields["name"],
        spec=RunSpec.model_validate_json(fields["spec"]),
        state=fields["state"],  # type: ignore[arg-type]
        created_at=datetime.fromisoformat(fields["created_at"]),
        updated_at=datetime.fromisoformat(fields["updated_at"]),
        error=fields["error"] or None,
        step=int(fields["step"]),
        policy_version=int(fields["policy_version"]),
        warnings=json.loads(fields["warnings"]),
        stop_requested=fields["stop_requested"] == "1",
        stop_reason=fields.get("stop_reason") or None,
        last_good_checkpoint=_int_or_none(fields.get("last_good_checkpoint")),
    )


def new_run_token(run_id: str) -> str:
    """A fresh token for the run: `<run id>.<secret>` (the id tells the API whose digest to compare)."""
    return f"{run_id}{TOKEN_SEPARATOR}{secrets.token_urlsafe(TOKEN_SECRET_BYTES)}"


def token_digest(token: str) -> str:
    """The SHA-256 (hex) of a token: what the record keeps."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_run_id(token: str) -> str | None:
    """The run a token names (`new_run_token`'s form), None when it cannot be a run token."""
    run_id, separator, secret = token.rpartition(TOKEN_SEPARATOR)
    if not separator or not secret or _RUN_ID.match(run_id) is None:
        return None
    return run_id


def new_run_id() -> str:
    """A short unique id that also matches the run-name pattern, e.g. `run-3f9a0c1d`."""
    return f"run-{secrets.token_hex(4)}"


class RunStore:
    """Async access to run records, counters and metrics in Redis (see the module docstring for keys)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    # --- records ---------------------------------------------------------------------------------------

    async def create(self, spec: RunSpec) -> RunRecord:
        """Stores a new pending run. The id is `spec.name` when given (RunExists if taken), else generated."""
        record, _ = await self.create_with_token(spec)
        return record

    async def create_with_token(self, spec: RunSpec) -> tuple[RunRecord, str]:
        """`create`, also returning the run's own token (only its digest is stored: show it now or never)."""
        if spec.name is not None:
            return await self._insert(spec.name, spec)
        while True:
            try:
                return await self._insert(new_run_id(), spec)
            except RunExists:
                continue  # a collision of 32 random bits: draw again

    async def _insert(self, run_id: str, spec: RunSpec) -> tuple[RunRecord, str]:
        now = _now()
        token = new_run_token(run_id)
        record = RunRecord(
            run_id=run_id,
            name=run_id,
            spec=spec.model_copy(update={"name": run_id}),
            created_at=now,
            updated_at=now,
        )

        async def write(pipe: Pipeline) -> None:
            if await pipe.exists(keys.run(run_id)):
                raise RunExists(f"a run named {run_id!r} already exists")
            pipe.multi()
            fields = {**_encode(record), TOKEN_DIGEST_FIELD: token_digest(token)}
            pipe.hset(keys.run(run_id), mapping=fields)  # type: ignore[arg-type]
            pipe.zadd(keys.runs_index(), {run_id: now.timestamp()})

        await self.redis.transaction(write, keys.run(run_id))
        return record, token

    async def token_matches(self, run_id: str, token: str) -> bool:
        """True when `token` is the run's own (digests compared in constant time); False for a run without
        one or no run at all."""
        stored = await self.redis.hget(keys.run(run_id), TOKEN_DIGEST_FIELD)  # type: ignore[misc]
        if stored is None:
            return False
        return hmac.compare_digest(token_digest(token).encode(), _text(stored).encode())

    async def get(self, run_id: str) -> RunRecord:
        """The run's record; RunNotFound if there is none."""
        raw = await self.redis.hgetall(keys.run(run_id))  # type: ignore[misc]
        if not raw:
            raise RunNotFound(f"no run {run_id!r}")
        return _decode(raw)

    async def exists(self, run_id: str) -> bool:
        """True if the run exists."""
        return bool(await self.redis.exists(keys.run(run_id)))

    async def list(self, *, limit: int = 100, states: set[RunState] | None = None) -> list[RunRecord]:
        """Runs, newest first; at most `limit` of them, only those in `states` when given."""
        ids = [_text(i) for i in await self.redis.zrevrange(keys.runs_index(), 0, -1)]
        records: list[RunRecord] = []
        for start in range(0, len(ids), 100):
            async with self.redis.pipeline(transaction=False) as pipe:
                for run_id in ids[start : start + 100]:
                    pipe.hgetall(keys.run(run_id))
                batch = await pipe.execute()
            records += [_decode(raw) for raw in batch if raw]
            records = [r for r in records if states is None or r.state in states]
            if len(records) >= limit:
                break
        return records[:limit]

    async def _update(self, run_id: str, change: Callable[[RunRecord], dict[str, str]]) -> RunRecord:
        """Reads the record, asks `change` for the fields to set (it may raise), writes them atomically."""

        async def apply(pipe: Pipeline) -> RunRecord:
            raw = await pipe.hgetall(keys.run(run_id))  # type: ignore[misc]
            if not raw:
                raise RunNotFound(f"no run {run_id!r}")
            record = _decode(raw)
            fields = change(record)
            pipe.multi()
            if fields:
                fields["updated_at"] = _now().isoformat()
                pipe.hset(keys.run(run_id), mapping=fields)  # type: ignore[arg-type]
            return record

        await self.redis.transaction(apply, keys.run(run_id), value_from_callable=True)
        return await self.get(run_id)

    async def set_state(self, run_id: str, state: RunState, error: str | None = None) -> RunRecord:
        """Moves the run to `state` (recording `error`); InvalidTransition for an illegal move."""
        if state not in {s.value for s in RunState}:
            raise ValueError(f"unknown run state {state!r}")

        def change(record: RunRecord) -> dict[str, str]:
            if record.state == state and not record.finished:
                return {"error": error} if error else {}
            if state not in TRANSITIONS[record.state]:
                raise InvalidTransition(f"run {run_id!r} is {record.state}; it cannot become {state}")
            return {"state": state, "error": error or ""}

        return await self._update(run_id, change)

    async def update_progress(self, run_id: str, step: int, policy_version: int) -> RunRecord:
        """Records the learner's latest step and published policy version (no write when unchanged)."""

        def change(record: RunRecord) -> dict[str, str]:
            if (record.step, record.policy_version) == (step, policy_version):
                return {}
            return {"step": str(step), "policy_version": str(policy_version)}

        return await self._update(run_id, change)

    async def add_warning(self, run_id: str, warning: str) -> RunRecord:
        """Appends a warning to the record (duplicates are kept once)."""

        def change(record: RunRecord) -> dict[str, str]:
            if warning in record.warnings:
                return {}
            return {"warnings": json.dumps([*record.warnings, warning])}

        return await self._update(run_id, change)

    async def remove_warning(self, run_id: str, warning: str) -> RunRecord:
        """Removes a warning that no longer holds (the reward service answers again); absent: a no-op."""

        def change(record: RunRecord) -> dict[str, str]:
            if warning not in record.warnings:
                return {}
            return {"warnings": json.dumps([w for w in record.warnings if w != warning])}

        return await self._update(run_id, change)

    async def request_stop(
        self, run_id: str, reason: str = "api", last_good_checkpoint: int | None = None
    ) -> RunRecord:
        """Flags the run to stop, saying why; a pending run becomes stopped at once. InvalidTransition if
        finished."""

        def change(record: RunRecord) -> dict[str, str]:
            if record.finished:
                raise InvalidTransition(f"run {run_id!r} has already finished ({record.state})")
            fields = {"stop_requested": "1", "stop_reason": reason}
            if last_good_checkpoint is not None:
                fields["last_good_checkpoint"] = str(last_good_checkpoint)
            if record.state == RunState.PENDING:
                fields["state"] = RunState.STOPPED
            return fields

        return await self._update(run_id, change)

    async def reopen(self, run_id: str) -> RunRecord:
        """Makes a stopped or failed run pending again, so that a (re)starting coordinator resumes it:
        `rlfabric up --resume`, the one way out of those final states. Clears the stop request, its
        reason, the error and the learner's stop flag (`keys.stop_requested`); the run keeps
        its counters, metrics, dataset position and stream. InvalidTransition for a completed run."""

        def change(record: RunRecord) -> dict[str, str]:
            if record.state == RunState.COMPLETED:
                raise InvalidTransition(f"run {run_id!r} has completed; there is nothing to resume")
            if not record.finished:
                return {}
            return {"state": RunState.PENDING, "error": "", "stop_requested": "0", "stop_reason": ""}

        record = await self._update(run_id, change)
        await self.redis.delete(keys.stop_requested(run_id))
        return record

    async def stop_requested(self, run_id: str) -> bool:
        """True once `request_stop` was called for the run."""
        value = await self.redis.hget(keys.run(run_id), "stop_requested")  # type: ignore[misc]
        if value is None:
            raise RunNotFound(f"no run {run_id!r}")
        return _text(value) == "1"

    # --- counters --------------------------------------------------------------------------------------

    async def incr(self, run_id: str, counter: str, n: int = 1) -> int:
        """Adds `n` to one of the run's counters and returns the new value."""
        return int(await self.redis.hincrby(keys.counters(run_id), counter, n))  # type: ignore[misc]

    async def counters(self, run_id: str) -> dict[str, int]:
        """Every standard counter (0 if never incremented) and any other the run has."""
        raw = await self.redis.hgetall(keys.counters(run_id))  # type: ignore[misc]
        values = {name: 0 for name in COUNTERS}
        values.update({_text(k): int(v) for k, v in raw.items()})
        return values

    async def scaling(self, run_id: str) -> dict[str, float] | None:
        """The run's latest autoscaling signal, None before its pipeline exported one."""
        raw = await self.redis.hgetall(keys.scaling(run_id))  # type: ignore[misc]
        return {_text(k): float(v) for k, v in raw.items()} or None

    # --- metrics ---------------------------------------------------------------------------------------

    async def metrics(
        self, run_id: str, since_id: str | None = None, limit: int | None = None
    ) -> MetricsRows:
        """Metrics rows after stream id `since_id` (all when None), oldest first, at most `limit`.

        Each row is the stored JSON object plus `_id`, its stream id (pass the last one as `since_id`)."""
        if since_id is not None and parse_stream_id(since_id) == LAST_STREAM_ID:
            return []  # nothing can follow the largest id (and Redis refuses to start after it)
        start = f"({since_id}" if since_id else "-"
        entries: Any = await self.redis.xrange(keys.metrics(run_id), min=start, max="+", count=limit)
        return [_row(entry_id, fields) for entry_id, fields in entries]

    async def recent_metrics(self, run_id: str, count: int) -> MetricsRows:
        """The last `count` metrics rows, oldest first."""
        entries: Any = await self.redis.xrevrange(keys.metrics(run_id), max="+", min="-", count=count)
        return [_row(entry_id, fields) for entry_id, fields in reversed(entries)]


def parse_stream_id(text: str) -> tuple[int, int | None]:
    """(ms, seq) of a Redis stream id, `<ms>` (seq None) or `<ms>-<seq>`, each part at most 2**64 - 1;
    ValueError otherwise (its message does not repeat the text)."""
    match = _STREAM_ID.match(text)
    if match is None:
        raise ValueError("not a stream id: expected <milliseconds>-<sequence>, e.g. 1700000000000-0")
    ms, seq = int(match[1]), None if match[2] is None else int(match[2])
    if ms > STREAM_ID_PART_MAX or (seq or 0) > STREAM_ID_PART_MAX:
        raise ValueError(f"stream id out of range: each part is at most {STREAM_ID_PART_MAX}")
    return ms, seq


def _row(entry_id: Any, fields: Any) -> dict[str, Any]:
    """A metrics stream entry as a dict: its row, plus `_id`."""
    row = decode_row(fields)
    row["_id"] = _text(entry_id)
    return row
