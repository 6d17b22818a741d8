"""`overlong_penalty`: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

With L the completion length, `max_len` the generation limit and `cache_len` the soft zone before it:

    0                                  if L <= max_len - cache_len
    ((max_len - cache_len) - L) / cache_len   if max_len - cache_len < L <= max_len   (0 down to -1)
    -1                                 if L > max_len

times `penalty_factor`. L is in tokens from metadata `completion_tokens` when present; without it the
default `unit="auto"` falls back to the completion's length in characters, so set `max_len` and
`cache_len` in the unit your data provides (or `unit="tokens"` to make a missing count an error).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rlfabric.reward.scorers.base import ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.registry import register
from rlfabric.reward.scorers.text import LengthUnit, completion_length


class OverlongPenaltyParams(ScorerParams):
    max_len: int = Field(default=4096, gt=0)
    """The maximum completion length (usually the sampler's max_tokens)."""
    cache_len: int = Field(default=512, ge=0)
    """Length of the soft-penalty zone just below `max_len` (DAPO's L_cache)."""
    unit: LengthUnit = "auto"
    """"tokens": metadata `completion_tokens` (required); "chars": characters; "auto": tokens when the
    metadata has them, else characters."""
    penalty_factor: float = Field(default=1.0, ge=0)
    """Multiplier on the penalty (the reward goes down to -penalty_factor)."""

    @model_validator(mode="after")
    def _cache_fits(self) -> OverlongPenaltyParams:
        if self.cache_len > self.max_len:
            raise ValueError(f"cache_len ({self.cache_len}) must not exceed max_len ({self.max_len})")
        return self


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    """DAPO's soft overlong punishment in [-1, 0]."""
    soft_start = max_len - cache_len
    if length <= soft_start:
        return 0.0
    if length > max_len:
        return -1.0
    return (soft_start - length) / cache_len


@register
class OverlongPenalty(Scorer):
    name = "overlong_penalty"
    version = "1"
    description = "DAPO soft overlong punishment: 0, then linear down to -1 in the last cache_len, -1 beyond."
    Params = OverlongPenaltyParams
    params: OverlongPenaltyParams

    def _score_one(self, item: ScoreInput) -> ScoreResult:
        p = self.params
        length = completion_length(item, p.unit)
        reward = p.penalty_factor * overlong_penalty(length, p.max_len, p.cache_len)
        return ScoreResult.ok(reward, {"length": float(length)})
