"""Every Redis name two rlfabric processes share: keys, the counters' fields, the consumer group, the
pub/sub channel, drop reasons and stop reasons. Nothing outside `rlfabric.contracts` spells a key (a unit
test parses `src/rlfabric` and fails on a `rlfabric:` literal elsewhere).

Each key is a function registered with `_key`: its docstring says what the key holds, the registration its
Redis type, who writes it and who reads it. `KEYSPACE` lists them all, and `keyspace_table()` renders them
(with `Counter`) as the markdown table in docs/architecture.md (`python scripts/gen_keyspace.py`; a unit
test fails when the doc differs).

Invariants:
1. The bytes of every key are fixed: a stored run stays readable by a newer build. Renaming a key is a
   migration, not a refactor.
2. Every run-scoped key is `rlfabric:{run}:<suffix>`, so a run's data can be listed and deleted by prefix;
   the one global key is the index of runs.
3. A counter is a field of `counters(run)`; each is written by exactly one process (`Counter.writer`).

Imports nothing but the standard library: every process, the ledger and the tests use it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, TypeVar

PREFIX = "rlfabric"
"""The first part of every key."""
NO_RUN = "_"
"""The run id of rollout replicas bound to no run (their registry entries)."""
CONSUMER_GROUP = "learner"
"""The one consumer group on a run's groups stream: the learner ranks that read it."""

Kind = Literal["string", "hash", "list", "set", "zset", "stream", "channel"]
"""A key's Redis type ("channel": a pub/sub channel, which holds nothing)."""
KeyBuilder = TypeVar("KeyBuilder", bound=Callable[..., str])
PLACEHOLDERS = {"run_id": "{run}", "replica_id": "{replica}", "fleet": "{fleet}"}
"""How a key function's parameters are written in its rendered pattern."""


@dataclass(frozen=True)
class KeyDoc:
    """One row of the keyspace table."""

    name: str
    """The function in this module that builds the key."""
    pattern: str
    """The key with placeholders, e.g. `rlfabric:{run}:groups`."""
    kind: Kind
    writers: str
    readers: str
    meaning: str
    """The function's docstring on one line."""


KEYSPACE: list[KeyDoc] = []
"""Every key, in the order this module defines them."""


def _key(kind: Kind, *, writers: str, readers: str) -> Callable[[KeyBuilder], KeyBuilder]:
    """Registers a key function in `KEYSPACE` (its pattern is the function called on placeholders)."""

    def register(build: KeyBuilder) -> KeyBuilder:
        names = inspect.signature(build).parameters
        pattern = build(*(PLACEHOLDERS[name] for name in names))
        KEYSPACE.append(KeyDoc(build.__name__, pattern, kind, writers, readers, _one_line(build.__doc__)))
        return build

    return register


def _one_line(doc: str | None) -> str:
    return " ".join((doc or "").split()).replace("|", "\\|")


def _run(run_id: str, suffix: str) -> str:
    return f"{PREFIX}:{run_id}:{suffix}"


def _stream_run(run_id: str, suffix: str) -> str:
    """A key of the groups stream's family: the run id is checked, since a consumer group created on a
    wrong key would wait forever."""
    if not run_id or any(c.isspace() for c in run_id):
        raise ValueError(f"run id must be non-empty without whitespace, got {run_id!r}")
    return _run(run_id, suffix)


# --- the run record ---------------------------------------------------------------------------------------


@_key("zset", writers="coordinator (RunStore)", readers="coordinator")
def runs_index() -> str:
    """Every run id, scored by its creation time (unix seconds)."""
    return f"{PREFIX}:runs"


@_key("hash", writers="coordinator (RunStore)", readers="coordinator (API, pipeline)")
def run(run_id: str) -> str:
    """The run record: spec (JSON), state, step, policy version, error, warnings, stop flag and reason."""
    return _run(run_id, "run")


@_key(
    "hash", writers="coordinator, learner (see `Counter`)", readers="coordinator (API, admit bound), ledger"
)
def counters(run_id: str) -> str:
    """The run's counters: field `Counter` -> integer, incremented with HINCRBY (`groups_trained` is set)."""
    return _run(run_id, "counters")


@_key(
    "stream", writers="learner (`contracts.metrics.append_row`)", readers="coordinator (API, health), ledger"
)
def metrics(run_id: str) -> str:
    """One entry per learner step, plus a marker row per learner restart: field `row` = a JSON object."""
    return _run(run_id, "metrics")


@_key("hash", writers="coordinator (pipeline)", readers="coordinator (API), learner (metrics rows)")
def scaling(run_id: str) -> str:
    """The pipeline's latest autoscaling signal (`ScalingSignal` fields and `time`)."""
    return _run(run_id, "scaling")


@_key("string", writers="coordinator (manager; `reopen` deletes it)", readers="learner")
def stop_requested(run_id: str) -> str:
    """Set when the run ends, to a `StopReason`: the learner finishes (at once for `health`)."""
    return _run(run_id, "stop_requested")


# --- the prompt pipeline ----------------------------------------------------------------------------------


@_key("string", writers="coordinator (pipeline `DRAW_AT`)", readers="coordinator, ledger")
def cursor(run_id: str) -> str:
    """The dataset position: prompts taken so far over all epochs."""
    return _run(run_id, "cursor")


@_key("hash", writers="coordinator (pipeline), learner (`lineage.hand_back`)", readers="coordinator, ledger")
def inflight(run_id: str) -> str:
    """Groups drawn and not yet enqueued or dropped: group id -> in-flight record (JSON)."""
    return _run(run_id, "inflight")


@_key("set", writers="coordinator (`streams.GroupProducer`)", readers="ledger")
def enqueued(run_id: str) -> str:
    """The group ids enqueued on the groups stream (the exactly-once key of the enqueue)."""
    return _run(run_id, "enqueued")


@_key("stream", writers="coordinator (pipeline), learner (stale drops)", readers="ledger")
def dropped(run_id: str) -> str:
    """One entry per dropped group: group_id, reason (`DropReason`), and prompt_id and detail (the
    coordinator's) or lag and learner_version (a stale drop: the learner's policy version it was lag training
    steps behind)."""
    return _run(run_id, "dropped")


@_key("set", writers="coordinator (pipeline `DROP_ONCE`)", readers="coordinator")
def dropped_ids(run_id: str) -> str:
    """The group ids the coordinator dropped (the exactly-once key of its drops)."""
    return _run(run_id, "dropped_ids")


@_key("list", writers="coordinator (pipeline)", readers="learner (metrics rows)")
def eval_results(run_id: str) -> str:
    """Held-out evaluation results (JSON: reward_mean, policy_version, step), popped by the learner."""
    return _run(run_id, "eval")


@_key("string", writers="learner (its last step)", readers="coordinator (evaluation, which deletes it)")
def final_eval(run_id: str) -> str:
    """The step whose published weights the learner asks to be evaluated before it writes that step's
    metrics row (its last one); the coordinator deletes it once the result is in `eval_results`."""
    return _run(run_id, "final_eval")


# --- the groups stream ------------------------------------------------------------------------------------


@_key(
    "stream",
    writers="coordinator (`streams.GroupProducer`)",
    readers="learner (consumer group `learner`), coordinator (backlog, trim, liveness), ledger",
)
def groups(run_id: str) -> str:
    """The scored groups: field `data` = `ScoredGroup` protobuf bytes, `group_id` = its id."""
    return _stream_run(run_id, "groups")


@_key("stream", writers="learner (`learner.queue`)", readers="ledger")
def dead_letters(run_id: str) -> str:
    """Entries the learner refused: the original payload, error, reason, delivery count and entry id."""
    return _stream_run(run_id, "groups:dead")


@_key("set", writers="learner (`streams.dead_letter_once`)", readers="learner")
def dead_letter_ids(run_id: str) -> str:
    """The entry ids already dead-lettered (the exactly-once key of a dead letter)."""
    return _stream_run(run_id, "groups:dead_ids")


@_key("set", writers="learner (`streams.drop_stale_once`)", readers="learner")
def stale_ids(run_id: str) -> str:
    """The entry ids already dropped as stale (the exactly-once key of a stale drop)."""
    return _stream_run(run_id, "groups:stale_ids")


@_key("hash", writers="coordinator (`streams.trim_acknowledged`)", readers="ledger")
def trimmed(run_id: str) -> str:
    """Entries trimmed from the groups stream once acknowledged: entry id -> JSON [group id, [versions]]."""
    return _stream_run(run_id, "groups:trimmed")


# --- the learner's progress and lineage -------------------------------------------------------------------


@_key("string", writers="learner", readers="coordinator (pipeline: step budget, evaluation)")
def step(run_id: str) -> str:
    """The learner's last completed step (set back to the checkpoint's after a restart)."""
    return _run(run_id, "step")


@_key("string", writers="learner (offline preference runs)", readers="coordinator (the run's end)")
def learner_done(run_id: str) -> str:
    """The step at which the learner finished the run on its own (its dataset ran out before the step
    budget); the coordinator then completes the run."""
    return _run(run_id, "learner_done")


@_key("string", writers="learner", readers="rollout replicas, coordinator (admission version), ledger")
def version(run_id: str) -> str:
    """The newest policy version the learner published (replicas load it from the object store)."""
    return _run(run_id, "version")


@_key("channel", writers="learner", readers="none in this repository (for external watchers)")
def versions(run_id: str) -> str:
    """Pub/sub: each newly published policy version, as the message."""
    return _run(run_id, "versions")


@_key("hash", writers="learner (`lineage.record_restore`)", readers="learner, ledger")
def lineage(run_id: str) -> str:
    """The restores of learner restarts: restore version -> `RestoreRecord` JSON."""
    return _run(run_id, "lineage")


@_key("stream", writers="learner (`lineage.hand_back`)", readers="ledger")
def rolled_back(run_id: str) -> str:
    """Groups handed back because a restart rolled their version back: group_id, redispatched_as, ..."""
    return _run(run_id, "rolled_back")


@_key("list", writers="learner (`lineage.hand_back`)", readers="coordinator (`lineage.take_handed_back`)")
def redispatch(run_id: str) -> str:
    """The new ids of handed-back groups the coordinator has not taken yet."""
    return _run(run_id, "redispatch")


# --- the replica registry ---------------------------------------------------------------------------------


@_key("hash", writers="rollout replicas (`registry.Heartbeat`)", readers="coordinator (`registry.discover`)")
def replica(run_id: str | None, replica_id: str) -> str:
    """A replica's registry entry (`ReplicaEntry`), with a TTL of 3 heartbeats; run `_` when unbound, the
    fleet's scope (`fleet=<name>`) for a fleet replica."""
    return _run(run_id or NO_RUN, f"replicas:{replica_id}")


# --- shared rollout fleets -------------------------------------------------------------------------------


def fleet_scope(fleet: str) -> str:
    """The scope a fleet's replicas register under, in place of a run id (`replica(fleet_scope(f), id)`):
    `fleet=<name>`, which no run id can be (`=` is not in the run-name pattern)."""
    if not fleet or any(c.isspace() or c in ":=" for c in fleet):
        raise ValueError(f"fleet name must be non-empty without whitespace, ':' or '=', got {fleet!r}")
    return f"fleet={fleet}"


@_key(
    "hash",
    writers="coordinator (manager: a fleet run joins when it starts, leaves when it ends)",
    readers="fleet rollout replicas (which adapters to hold), coordinator",
)
def fleet_members(fleet: str) -> str:
    """The runs generating on a fleet: run id -> `FleetMember` JSON (adapter name, weights root, weight)."""
    return f"{PREFIX}:{fleet_scope(fleet)}:members"


@_key("hash", writers="coordinator (fleet scheduler)", readers="coordinator (API), autoscalers")
def fleet_scaling(fleet: str) -> str:
    """The fleet's autoscaling signal, summed over its runs (`ScalingSignal` fields and `time`)."""
    return f"{PREFIX}:{fleet_scope(fleet)}:scaling"


# --- names inside the keys --------------------------------------------------------------------------------


class Counter(StrEnum):
    """A field of `counters(run)`. Each member carries the process that writes it and what it counts."""

    writer: str
    meaning: str

    def __new__(cls, value: str, writer: str, meaning: str) -> Counter:
        member = str.__new__(cls, value)
        member._value_ = value
        member.writer, member.meaning = writer, meaning
        return member

    PROMPTS_DISPATCHED = "prompts_dispatched", "coordinator", "prompts taken from the cursor"
    SAMPLES_GENERATED = "samples_generated", "coordinator", "samples the replicas returned"
    GROUPS_QUEUED = "groups_queued", "coordinator", "groups enqueued on the groups stream (once each)"
    GROUPS_TRAINED = "groups_trained", "learner", "groups applied in the learner's checkpointed lineage (set)"
    DROPPED_STALE = "dropped_stale", "learner", "groups dropped as beyond the policy-lag bound"
    DROPPED_ZERO_VARIANCE = "dropped_zero_variance", "coordinator", "groups dropped: one reward for all"
    DROPPED_SCORER_ERROR = "dropped_scorer_error", "coordinator", "groups dropped: a sample's scorer failed"
    DROPPED_INVALID_PROMPT = "dropped_invalid_prompt", "coordinator", "groups dropped: the replica refused"
    DROPPED_PROMPT_TOO_LONG = (
        "dropped_prompt_too_long",
        "coordinator",
        "groups dropped: the prompt leaves no room for max_tokens in max_model_len",
    )
    EVAL_PROMPTS_TOO_LONG = "eval_prompts_too_long", "coordinator", "evaluation prompts skipped as too long"
    DROPPED_NOT_APPLICABLE = "dropped_not_applicable", "coordinator", "groups dropped: no reward applies"
    DROPPED_ENVIRONMENT_ERROR = (
        "dropped_environment_error",
        "coordinator",
        "groups dropped: a trajectory's environment failed or timed out, or its template mismatched",
    )
    SCORER_ERRORS = "scorer_errors", "coordinator", "samples whose scorer failed"
    ENVIRONMENT_ERRORS = (
        "environment_errors",
        "coordinator",
        "trajectories the environment failed or timed out",
    )
    TEMPLATE_MISMATCHES = (
        "template_mismatches",
        "coordinator",
        "trajectories ended because the chat template renders a sampled turn otherwise (never re-tokenized)",
    )
    TRAJECTORIES = "trajectories", "coordinator", "multi-turn trajectories the replicas returned"
    TRAJECTORY_TURNS = "trajectory_turns", "coordinator", "model turns in those trajectories"
    TRAJECTORIES_TRUNCATED = "trajectories_truncated", "coordinator", "trajectories a limit cut short"
    TOOL_CALLS = "tool_calls", "coordinator", "tool calls in those trajectories"
    TOOL_ERRORS = "tool_errors", "coordinator", "tool calls that failed (malformed, unknown, refused, raised)"
    PREFIX_PROMPT_TOKENS = "prefix_prompt_tokens", "coordinator", "prompt tokens of the trajectories' turns"
    PREFIX_CACHED_TOKENS = "prefix_cached_tokens", "coordinator", "of those, found in the prefix cache"
    REDISPATCHES = "redispatches", "coordinator", "groups generated again (failed replica, restart)"
    SCORE_RETRIES = "score_retries", "coordinator", "Score calls retried while the reward service failed"
    STREAM_TRIMMED = "stream_trimmed", "coordinator", "acknowledged entries trimmed from the groups stream"
    DEAD_LETTERED = "dead_lettered", "learner", "entries moved to the dead-letter stream"
    ROLLED_BACK = "rolled_back", "learner", "groups handed back because a restart rolled their version back"


class DropReason(StrEnum):
    """The `reason` of an entry of `dropped(run)`; the ledger's outcome is `dropped:<reason>`."""

    STALE = "stale"
    """The learner: the group's policy is beyond the lag bound."""
    ZERO_VARIANCE = "zero_variance"
    """The coordinator (dynamic sampling): every sample got the same reward."""
    SCORER_ERROR = "scorer_error"
    """The coordinator: a sample's scorer failed."""
    INVALID_PROMPT = "invalid_prompt"
    """The coordinator: the replica refused the prompt itself (empty, ...)."""
    PROMPT_TOO_LONG = "prompt_too_long"
    """The coordinator: the prompt's tokens + max_tokens exceed the model's context (the replica said so,
    or an earlier group of the same prompt was refused so)."""
    NOT_APPLICABLE = "not_applicable"
    """The coordinator: a sample's scorer does not apply to it (every user reward function returned None,
    TRL's "not applicable"); as in TRL such a sample carries no learning signal."""
    ENVIRONMENT_ERROR = "environment_error"
    """The coordinator: a trajectory's environment failed or timed out (never read as a reward of 0), or
    the chat template could not extend its conversation token for token."""

    @property
    def counter(self) -> Counter:
        """The counter of this reason's drops (`dropped_<reason>`)."""
        return Counter[f"DROPPED_{self.name}"]


class StopReason(StrEnum):
    """The value of `stop_requested(run)`: why the coordinator ended the run."""

    COMPLETED = "completed"
    """The step budget is spent or every prompt was trained: train what was read, then stop."""
    STOPPED = "stopped"
    """A stop was requested through the API: train what was read, then stop."""
    FAILED = "failed"
    """The pipeline failed: train what was read, then stop."""
    HEALTH = "health"
    """A health check stopped the run: stop before another step and write no checkpoint of the suspect
    policy, so the good ones stay."""


# --- the table --------------------------------------------------------------------------------------------


def keyspace_table() -> str:
    """Markdown: every key (pattern, type, writers, readers, meaning), then every counter."""
    rows = ["| Key | Type | Written by | Read by | Holds |", "|---|---|---|---|---|"]
    rows += [f"| `{k.pattern}` | {k.kind} | {k.writers} | {k.readers} | {k.meaning} |" for k in KEYSPACE]
    rows += [
        "",
        f"Fields of `{counters('{run}')}`:",
        "",
        "| Counter | Written by | Counts |",
        "|---|---|---|",
    ]
    rows += [f"| `{c.value}` | {c.writer} | {c.meaning} |" for c in Counter]
    return "\n".join(rows) + "\n"
