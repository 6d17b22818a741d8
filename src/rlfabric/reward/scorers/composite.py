"""`composite`: a weighted sum of named parts, each any registered scorer with its own params.

reward = Σ weight_i · reward_i. Components hold each part's reward under its alias and the part's own
components as `alias.name`. An item fails as soon as one of its parts fails: it takes that part's status
("scorer_error" or "timeout") and a message naming the part, because a sum that silently drops a
failed term would be a wrong reward. Parts run one after another, each through `run_scorer` (so a
per-item part is parallel across items and its exceptions are per-item errors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from pydantic import Field, field_validator

from rlfabric.reward.scorers.base import InvalidScorerSpec, ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.policy import ScorerPolicy
from rlfabric.reward.scorers.registry import build_scorer, register
from rlfabric.reward.scorers.runner import run_scorer


class PartSpec(ScorerParams):
    alias: str = Field(min_length=1)
    """The part's name in the components (e.g. "correct", "format")."""
    scorer: str
    """The registered scorer name of the part."""
    weight: float = 1.0
    """The part's weight in the sum."""
    params: dict[str, Any] = {}
    """The part's own parameters."""


class CompositeParams(ScorerParams):
    parts: list[PartSpec] = Field(min_length=1)
    """The parts, scored in this order; aliases must be unique."""

    @field_validator("parts")
    @classmethod
    def _unique_aliases(cls, parts: list[PartSpec]) -> list[PartSpec]:
        aliases = [part.alias for part in parts]
        duplicates = sorted({a for a in aliases if aliases.count(a) > 1})
        if duplicates:
            raise ValueError(f"duplicate part aliases: {duplicates}")
        return parts


def _build_part(index: int, part: PartSpec, policy: ScorerPolicy) -> Scorer:
    try:
        return build_scorer(part.scorer, part.params, policy)
    except InvalidScorerSpec as exc:
        field = "scorer" if exc.field == "name" else exc.field
        raise InvalidScorerSpec(f"parts[{index}].{field}", exc.reason) from exc


@register
class Composite(Scorer):
    name = "composite"
    version = "1"
    description = "Weighted sum of other scorers; any failing part fails the item."
    Params = CompositeParams
    params: CompositeParams

    def __init__(self, params: CompositeParams, policy: ScorerPolicy) -> None:
        super().__init__(params)
        self.parts = [_build_part(i, part, policy) for i, part in enumerate(params.parts)]

    @classmethod
    def create(cls, params: ScorerParams, policy: ScorerPolicy) -> Self:
        """Every part is built under the same policy as the composite."""
        assert isinstance(params, CompositeParams)
        return cls(params, policy)

    @property
    def whole_batch(self) -> bool:
        return any(part.whole_batch for part in self.parts)

    def score_batch(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        per_part = [run_scorer(scorer, items) for scorer in self.parts]
        return [self._combine([results[i] for results in per_part]) for i in range(len(items))]

    def _combine(self, results: list[ScoreResult]) -> ScoreResult:
        components: dict[str, float] = {}
        total = 0.0
        for spec, result in zip(self.params.parts, results, strict=True):
            if result.status != "ok":
                message = f"part {spec.alias!r} ({spec.scorer}): {result.message}"
                return ScoreResult(result.reward, components, result.status, message)
            total += spec.weight * result.reward
            components[spec.alias] = result.reward
            components.update({f"{spec.alias}.{k}": v for k, v in result.components.items()})
        return ScoreResult.ok(total, components)

    def close(self) -> None:
        for part in self.parts:
            part.close()
