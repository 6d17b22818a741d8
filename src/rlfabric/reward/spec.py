"""The reward service's contract in domain terms: what a caller asks and what it gets back.

Plain dataclasses, no scorer, pool, metrics or grpc: the client, the coordinator and
`rlfabric.contracts.wire` import this module, never the scorers, so a caller of the reward service loads
none of the service's code. The scorers and the service re-export these types where they always were.

- described: `ScorerInfo` with its `ParamInfo`s (ListScorers)
- checked: `ScorerProblem`s of a spec (CheckScorer)
- asked: `ScorerSpec` (which scorer, with its parameters; a composite lists its parts), `ScoreInput`
- answered: `ScoreResult` per item (scorer side), `ScoredBatch` per call (service side), `ItemResult`
  per item as a client receives it (with the batch's provenance)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from rlfabric.runspec import RewardSpec

ScoreStatus = Literal["ok", "scorer_error", "timeout", "not_applicable"]
"""An item's outcome; every status but "ok" carries reward NaN. "not_applicable" is neither a reward nor a
failure: every user reward function returned None for the item (TRL's meaning of None)."""
SCORE_STATUSES: tuple[ScoreStatus, ...] = ("ok", "scorer_error", "timeout", "not_applicable")
"""Every `ScoreStatus`, in the proto enum's order."""
Message = dict[str, Any]
"""One chat message: {"role": ..., "content": ...}."""
COMPOSITE = "composite"
"""The scorer name of a weighted sum of parts (its params hold `parts`)."""


@dataclass(frozen=True)
class ScorerSpec:
    """Which scorer to run, with its parameters (a composite is name "composite" with its parts, each a
    `composite_part` dict)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def key(self) -> str:
        """The canonical JSON of the spec (the scorer cache's key); computed once per spec object."""
        return json.dumps({"name": self.name, "params": self.params}, sort_keys=True)


def composite_part(
    scorer: str, params: Mapping[str, Any], weight: float, alias: str | None
) -> dict[str, Any]:
    """One part of a composite spec: the alias defaults to the scorer name."""
    return {"alias": alias or scorer, "scorer": scorer, "weight": weight, "params": dict(params)}


def spec_from_reward_spec(reward: RewardSpec) -> ScorerSpec:
    """The scorer spec of a run file's `[reward]` section (the one schema for specs in files)."""
    if reward.scorer != COMPOSITE:
        return ScorerSpec(reward.scorer, dict(reward.params))
    parts = [composite_part(p.scorer, p.params, p.weight, p.alias) for p in reward.parts]
    return ScorerSpec(COMPOSITE, {"parts": parts})


@dataclass(frozen=True)
class ParamInfo:
    """One scorer parameter. `default` is JSON text (None when `required`); `type` is its JSON-schema type."""

    name: str
    type: str
    default: str | None
    description: str
    required: bool
    choices: tuple[Any, ...] = ()


@dataclass(frozen=True)
class ScorerInfo:
    """What `describe_scorers` says about one registered scorer (ListScorers answers with these)."""

    name: str
    version: str
    description: str
    params: tuple[ParamInfo, ...]


@dataclass(frozen=True)
class ScoreInput:
    """One completion to score.

    `prompt` is the rendered prompt text, or the chat messages (`[{"role": ..., "content": ...}]`) it was
    rendered from. `reference` is the gold answer (empty when the scorer needs none); `metadata` carries
    everything else a scorer may need (test cases, `completion_tokens`, dataset columns).
    `completion_ids` are the completion's token ids when the engine's are known; `policy_version` and
    `epoch` say where in a training run the completion came from (None outside one).
    """

    id: str
    prompt: str | list[Message]
    completion: str
    reference: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    completion_ids: list[int] | None = None
    policy_version: int | None = None
    epoch: int | None = None

    @property
    def prompt_text(self) -> str:
        """The prompt as plain text: messages are rendered one per line as `role: content`."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in self.prompt)


@dataclass(frozen=True)
class ScoreResult:
    """The score of one item. Invariant: status "ok" ⇔ `reward` is a real number; otherwise it is NaN.

    `components` are named sub-scores (e.g. tests passed/total, each part of a composite) for logging.
    """

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    status: ScoreStatus = "ok"
    message: str = ""

    @classmethod
    def ok(cls, reward: float, components: dict[str, float] | None = None, message: str = "") -> ScoreResult:
        """A successful score; raises ValueError for a NaN or infinite reward (that is a scorer failure)."""
        if not math.isfinite(reward):
            raise ValueError(f"a successful score must be a finite number, got {reward!r}")
        return cls(float(reward), dict(components or {}), "ok", message)

    @classmethod
    def error(cls, message: str, components: dict[str, float] | None = None) -> ScoreResult:
        """A scorer failure: reward NaN."""
        return cls(math.nan, dict(components or {}), "scorer_error", message)

    @classmethod
    def timed_out(cls, message: str) -> ScoreResult:
        """An item past its deadline: reward NaN."""
        return cls(math.nan, {}, "timeout", message)

    @classmethod
    def not_applicable(cls, message: str, components: dict[str, float] | None = None) -> ScoreResult:
        """An item the scorer does not apply to (TRL's None): reward NaN, and not a failure."""
        return cls(math.nan, dict(components or {}), "not_applicable", message)


@dataclass(frozen=True)
class ScoredBatch:
    """The results of one batch, `results[i]` for item i, with their provenance (the same for every item
    of the batch). `latency_s` is the wall time of the whole batch."""

    results: list[ScoreResult]
    scorer_name: str
    scorer_version: str
    latency_s: float


@dataclass(frozen=True)
class ItemResult:
    """One scored item as a client receives it. `reward` is NaN unless `status` is "ok"."""

    id: str
    reward: float
    status: ScoreStatus
    message: str
    components: dict[str, float]
    scorer_name: str
    scorer_version: str
    latency_s: float


@dataclass(frozen=True)
class ScorerProblem:
    """One thing wrong with a scorer spec (CheckScorer): `field` is the dotted path from the spec's root
    (`name`, `params.pattern`, `params.parts[1].params.weight`), `reason` says what is wrong."""

    field: str
    reason: str
