"""`length_penalty`: a non-positive reward that grows with the distance from a target length.

reward = max(min_reward, -scale * excess / target_length), where excess is `max(0, L - target)` in mode
"over" (only long answers are penalised) and `|L - target|` in mode "deviation". L is the completion
length in tokens (metadata `completion_tokens`) or characters, per `unit` (see `completion_length`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.reward.scorers.base import ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.registry import register
from rlfabric.reward.scorers.text import LengthUnit, completion_length


class LengthPenaltyParams(ScorerParams):
    target_length: int = Field(default=1024, gt=0)
    """The length that is not penalised, in `unit`s."""
    unit: LengthUnit = "auto"
    """"tokens": metadata `completion_tokens` (required); "chars": characters; "auto": tokens when the
    metadata has them, else characters."""
    mode: Literal["over", "deviation"] = "over"
    """"over": penalise only lengths above the target; "deviation": penalise both sides."""
    scale: float = Field(default=1.0, ge=0)
    """Penalty per target length of excess (1.0: twice the target scores -1)."""
    min_reward: float = Field(default=-1.0, le=0)
    """The floor of the penalty."""


def length_penalty(length: int, p: LengthPenaltyParams) -> float:
    excess = abs(length - p.target_length) if p.mode == "deviation" else max(0, length - p.target_length)
    return max(p.min_reward, -p.scale * excess / p.target_length)


@register
class LengthPenalty(Scorer):
    name = "length_penalty"
    version = "1"
    description = "Penalty proportional to the completion's distance from a target length."
    Params = LengthPenaltyParams
    params: LengthPenaltyParams

    def _score_one(self, item: ScoreInput) -> ScoreResult:
        length = completion_length(item, self.params.unit)
        return ScoreResult.ok(length_penalty(length, self.params), {"length": float(length)})
