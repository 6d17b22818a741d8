"""The books of a run, reconciled: proof that nothing dispatched was lost and nothing was trained twice.

    books  = read_books(redis, run_id, checkpoints)   # everything the services recorded (read only)
    ledger = reconcile(books)                         # pure: outcomes per group and every violation
    ledger.raise_for_violations()                     # or `check(...)`, which does all three

What the services record (the Guarantees of the design brief turned into data):
- coordinator: its dataset position in `:cursor` (prompts taken), advanced in the same script that records
  the prompt in flight and counts it in `prompts_dispatched` (`rlfabric:{run}:counters`); groups still in
  flight in the hash
  `:inflight`; group ids enqueued (once each, by a Lua script) in the set `:enqueued`; groups it dropped,
  with a reason (scorer_error, zero_variance, ...), in the stream `:dropped`;
- the stream `:groups` (consumer group "learner") with one entry per enqueued group, its pending entries
  (delivered, not acknowledged) and the group's last-delivered id; entries acknowledged and trimmed since
  are read from their summaries in `:groups:trimmed` (`streams.trim_acknowledged`), as acknowledged;
- learner: groups dropped as stale in `:dropped` (reason "stale"), refused entries in `:groups:dead`,
  one metrics row per step in `:metrics` (with the policy version it published), and in its newest
  complete checkpoint the applied-group ledger and the ordered log of `[step, group_id]` it trained on.

Each dispatched group must end in exactly one outcome: `trained` (once, in the checkpoint's lineage),
`dropped:<reason>`, `dead_lettered:<reason>`, or `in_flight` (drawn but not enqueued, enqueued but not
yet delivered, or delivered and not yet acknowledged). Violations: a group with no outcome or two,
a group trained twice, an acknowledged entry that was neither trained nor dropped (lost), a prompt taken
from the cursor but never recorded (lost), a trained group that was never enqueued, counters that disagree
with the sets, policy versions that go backwards or were never published.

Reads the learner's checkpoint folder directly (`step-NNNNNN/` with `COMPLETE` and `meta.json`, see
`rlfabric.learner.checkpoint`) so that this module, like the coordinator, imports without torch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfabric.common.streams import CONSUMER_GROUP, dead_letter_key, groups_key, parse_id, trimmed_key
from rlfabric.v1.queue_pb2 import ScoredGroup

_CHECKPOINT = re.compile(r"^step-(\d{6,})$")
TRAINED, IN_FLIGHT = "trained", "in_flight"


class LedgerViolation(AssertionError):
    """The books do not balance; the message lists every violation."""


@dataclass(frozen=True)
class StreamEntry:
    """One entry of the groups stream and where it stands with the learner's consumer group."""

    entry_id: str
    group_id: str
    versions: tuple[int, ...]
    """The group's policy_version followed by each sample's; empty when the payload did not decode."""
    state: str
    """"undelivered", "pending" (delivered, not acknowledged) or "acked"."""


@dataclass
class Books:
    """Everything a run recorded, as read from Redis and the learner's newest complete checkpoint."""

    run_id: str
    counters: dict[str, int]
    cursor: int
    """Prompts taken from the dataset (`:cursor`); each must have been counted as dispatched."""
    in_flight: set[str]
    enqueued: set[str]
    dropped: list[dict[str, str]]
    """Entries of `:dropped` in order (coordinator drops and the learner's stale drops)."""
    entries: list[StreamEntry]
    dead: list[dict[str, str]]
    metric_versions: list[int]
    """The policy_version of each learner metrics row, in the order written (across restarts); a row
    written twice (identical, time included: a command retried after its reply was lost) counts once."""
    applied_log: list[tuple[int, str]] | None
    """[(step, group_id)] from the newest complete checkpoint; None when there is no checkpoint."""
    applied_set: list[str] | None
    checkpoint_step: int | None
    published: set[int] = field(default_factory=set)
    """Versions known to have been published besides the metrics rows (committed in the object store,
    announced in `:version`). Version 0, the base model, always counts as published."""


@dataclass
class Ledger:
    """The outcome of every dispatched group, and what does not balance."""

    outcomes: dict[str, list[str]]
    violations: list[str]

    def count(self) -> Counter[str]:
        """How many groups ended in each outcome (a group with two outcomes is a violation)."""
        return Counter(o for found in self.outcomes.values() for o in found)

    def raise_for_violations(self) -> Ledger:
        if self.violations:
            shown = "\n  ".join(self.violations[:50])
            raise LedgerViolation(f"{len(self.violations)} ledger violations:\n  {shown}\n{self.count()}")
        return self


# --- reading --------------------------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(raw: dict[Any, Any]) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in raw.items() if k not in (b"data", "data")}


def read_checkpoint(root: str | Path) -> tuple[int, list[tuple[int, str]], list[str]] | None:
    """(step, applied log, applied-group ledger) of the newest complete checkpoint under `root`."""
    root = Path(root)
    found = sorted(
        (int(m[1]), p)
        for p in (root.iterdir() if root.is_dir() else [])
        if (m := _CHECKPOINT.match(p.name)) and (p / "COMPLETE").is_file()
    )
    if not found:
        return None
    meta = json.loads((found[-1][1] / "meta.json").read_text())
    extra = meta["extra"]
    log = [(int(step), str(group)) for step, group in json.loads(_extra_text(extra["applied_log"]))]
    return int(meta["step"]), log, list(json.loads(_extra_text(extra["ledger"])))


def _extra_text(value: dict[str, str]) -> str:
    import base64

    return value["str"] if "str" in value else base64.b64decode(value["bytes"]).decode()


def read_books(
    redis: Any, run_id: str, checkpoints: str | Path | None, *, weights_root: str | None = None
) -> Books:
    """Reads a run's books with a blocking Redis client (bytes or decoded replies); reads nothing else."""
    base = f"rlfabric:{run_id}"
    checkpoint = read_checkpoint(checkpoints) if checkpoints is not None else None
    published = {0}
    if (announced := redis.get(f"{base}:version")) is not None:
        published.add(int(_text(announced)))
    if weights_root is not None:
        from rlfabric.common.weights import list_versions

        published |= {info.version for info in list_versions(weights_root) if info.committed}
    return Books(
        run_id=run_id,
        counters={_text(k): int(v) for k, v in redis.hgetall(f"{base}:counters").items()},
        cursor=int(_text(redis.get(f"{base}:cursor") or 0)),
        in_flight={_text(k) for k in redis.hkeys(f"{base}:inflight")},
        enqueued={_text(m) for m in redis.smembers(f"{base}:enqueued")},
        dropped=[_fields(f) for _, f in redis.xrange(f"{base}:dropped")],
        entries=_stream_entries(redis, run_id),
        dead=[_fields(f) for _, f in redis.xrange(dead_letter_key(run_id))],
        metric_versions=[
            int(json.loads(row)["policy_version"])
            for row in dict.fromkeys(
                _text(f.get(b"row", f.get("row"))) for _, f in redis.xrange(f"{base}:metrics")
            )
        ],
        applied_log=checkpoint[1] if checkpoint else None,
        applied_set=checkpoint[2] if checkpoint else None,
        checkpoint_step=checkpoint[0] if checkpoint else None,
        published=published,
    )


def _trimmed_entries(redis: Any, run_id: str) -> list[StreamEntry]:
    """The entries trimmed from the stream (every one acknowledged when it was trimmed), oldest first."""
    rows = [(parse_id(_text(i)), json.loads(_text(v))) for i, v in redis.hgetall(trimmed_key(run_id)).items()]
    return [StreamEntry(f"{i[0]}-{i[1]}", g, tuple(v), "acked") for i, (g, v) in sorted(rows)]


def _stream_entries(redis: Any, run_id: str) -> list[StreamEntry]:
    key = groups_key(run_id)
    trimmed = _trimmed_entries(redis, run_id)
    if not redis.exists(key):
        return trimmed
    info = next((i for i in redis.xinfo_groups(key) if _text(i["name"]) == CONSUMER_GROUP), None)
    last = parse_id(info["last-delivered-id"]) if info else (0, 0)
    rows = redis.xpending_range(key, CONSUMER_GROUP, "-", "+", 1 << 30) if info is not None else []
    pending = {_text(row["message_id"]) for row in rows}
    entries = []
    for entry_id, raw in redis.xrange(key):
        entry_id = _text(entry_id)
        state = "pending" if entry_id in pending else "acked" if parse_id(entry_id) <= last else "undelivered"
        data = raw.get(b"data", raw.get("data", b""))
        entries.append(StreamEntry(entry_id, *_decode(data, raw), state))  # type: ignore[arg-type]
    return trimmed + entries


def _decode(data: bytes | str, raw: dict[Any, Any]) -> tuple[str, tuple[int, ...]]:
    """(group id, versions) of an entry; the group_id field and no versions for a payload that is no group."""
    fallback = _text(raw.get(b"group_id", raw.get("group_id", "")))
    try:
        group = ScoredGroup.FromString(data if isinstance(data, bytes) else data.encode("latin-1"))
    except Exception:  # tolerated: a poison payload is the dead-letter stream's business, not the ledger's
        return fallback, ()
    return group.group_id or fallback, (group.policy_version, *(s.policy_version for s in group.samples))


# --- reconciling ----------------------------------------------------------------------------------------


def reconcile(books: Books) -> Ledger:
    """Every dispatched group's outcome and every violation of the Guarantees (pure)."""
    outcomes: dict[str, list[str]] = {}
    violations: list[str] = []
    trained = _trained(books, violations)
    for group_id in books.in_flight:
        outcomes.setdefault(group_id, []).append(IN_FLIGHT)
    for group_id, reason in _unique_drops(books.dropped):
        outcomes.setdefault(group_id, []).append("dropped:" + reason)
    dead = {r.get("group_id", ""): r.get("reason", "?") for r in books.dead}
    _reconcile_stream(books, trained, dead, outcomes, violations)
    _check_counters(books, violations)
    _check_versions(books, violations)
    for group_id, found in sorted(outcomes.items()):
        if len(found) != 1:
            violations.append(f"group {group_id!r} has {len(found)} outcomes: {found}")
    return Ledger(outcomes, violations)


def _unique_drops(records: list[dict[str, str]]) -> list[tuple[str, str]]:
    """(group id, reason) of each drop record, once: a record written twice (a command retried after
    Redis died between executing it and replying) names the same outcome, not a second one."""
    return list(dict.fromkeys((r.get("group_id", ""), r.get("reason", "?")) for r in records))


def _trained(books: Books, violations: list[str]) -> set[str]:
    if books.applied_log is None:
        if books.metric_versions:
            violations.append("the learner reported steps but left no complete checkpoint")
        return set()
    counts = Counter(group_id for _, group_id in books.applied_log)
    violations += [f"group {g!r} trained {n} times" for g, n in sorted(counts.items()) if n > 1]
    steps = [step for step, _ in books.applied_log]
    if steps != sorted(steps) or (steps and steps[-1] > (books.checkpoint_step or 0)):
        violations.append(f"applied log steps out of order or past the checkpoint: {steps[-20:]}")
    if books.applied_set is not None and set(books.applied_set) != set(counts):
        violations.append("the checkpoint's applied-group ledger differs from its applied log")
    return set(counts)


def _reconcile_stream(
    books: Books,
    trained: set[str],
    dead: dict[str, str],
    outcomes: dict[str, list[str]],
    violations: list[str],
) -> None:
    """Outcomes of enqueued groups; entries the coordinator never enqueued must be dead-lettered."""
    dead_entries = {r.get("entry_id") for r in books.dead}
    per_group = Counter(e.group_id for e in books.entries)
    for entry in books.entries:
        if entry.group_id not in books.enqueued:
            if entry.entry_id not in dead_entries and entry.state == "acked":
                violations.append(f"entry {entry.entry_id} ({entry.group_id!r}) was never enqueued")
            continue
        if per_group[entry.group_id] > 1:
            violations.append(f"group {entry.group_id!r} is in the stream {per_group[entry.group_id]} times")
        outcome = _entry_outcome(entry, trained, dead, outcomes)
        if outcome is None:
            violations.append(f"entry {entry.entry_id} ({entry.group_id!r}) acknowledged but never trained")
        elif outcome:
            outcomes.setdefault(entry.group_id, []).append(outcome)
    for group_id in books.enqueued - set(per_group):
        violations.append(f"group {group_id!r} enqueued but missing from the stream (trimmed or lost)")
    for group_id in sorted(trained - books.enqueued):
        violations.append(f"group {group_id!r} trained but never enqueued")


def _entry_outcome(
    entry: StreamEntry, trained: set[str], dead: dict[str, str], outcomes: dict[str, list[str]]
) -> str | None:
    """The outcome an entry adds ("" when `:dropped` already recorded it), None when it is lost."""
    recorded = outcomes.get(entry.group_id, [])
    if entry.group_id in trained:
        return TRAINED
    if entry.group_id in dead:
        return "dead_lettered:" + dead[entry.group_id]
    if entry.state != "acked":
        return IN_FLIGHT
    return "" if any(o == "dropped:stale" for o in recorded) else None


def _check_counters(books: Books, violations: list[str]) -> None:
    drops = [(g, reason) for g, reason in _unique_drops(books.dropped) if reason != "stale"]
    dispatched = books.counters.get("prompts_dispatched", 0)
    if books.cursor != dispatched:
        violations.append(
            f"the cursor took {books.cursor} prompts but prompts_dispatched={dispatched}"
            " (a prompt taken and never recorded is lost)"
        )
    known = len(books.enqueued) + len(drops) + len(books.in_flight)
    if dispatched != known:
        violations.append(
            f"prompts_dispatched={dispatched} but enqueued {len(books.enqueued)} + dropped {len(drops)}"
            f" + in flight {len(books.in_flight)} = {known}"
        )
    if books.counters.get("groups_queued", 0) != len(books.enqueued):
        violations.append(f"groups_queued={books.counters.get('groups_queued', 0)} != {len(books.enqueued)}")
    for reason, n in Counter(reason for _, reason in drops).items():
        if books.counters.get(f"dropped_{reason}", 0) != n:
            violations.append(f"dropped_{reason}={books.counters.get(f'dropped_{reason}', 0)} != {n} records")


def _check_versions(books: Books, violations: list[str]) -> None:
    versions = books.metric_versions
    backwards = [(a, b) for a, b in itertools.pairwise(versions) if b <= a]
    if backwards:
        violations.append(f"published versions not increasing: {backwards[:5]}")
    published = books.published | set(versions)
    for entry in books.entries:
        unknown = sorted(set(entry.versions) - published)
        if unknown:
            violations.append(f"group {entry.group_id!r} carries unpublished versions {unknown}")


def check(
    redis: Any, run_id: str, checkpoints: str | Path | None, *, weights_root: str | None = None
) -> Ledger:
    """read_books + reconcile; raises LedgerViolation when the books do not balance."""
    return reconcile(read_books(redis, run_id, checkpoints, weights_root=weights_root)).raise_for_violations()


def main(argv: list[str] | None = None) -> int:
    """`python -m rlfabric.common.ledger --redis-url URL --run-id ID --checkpoints DIR`: audit a run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--checkpoints", help="the learner's checkpoint folder (<output>/<run>/checkpoints)")
    parser.add_argument("--weights-root", help="the run's object store, for the published versions")
    args = parser.parse_args(argv)
    import redis

    client = redis.Redis.from_url(args.redis_url)
    ledger = reconcile(read_books(client, args.run_id, args.checkpoints, weights_root=args.weights_root))
    print(json.dumps({"outcomes": dict(ledger.count()), "violations": ledger.violations}, indent=2))
    return 1 if ledger.violations else 0


if __name__ == "__main__":
    sys.exit(main())
