"""`regex`: a format check; the completion matches (or fully matches) a regular expression."""

from __future__ import annotations

import re
from functools import reduce
from typing import Literal

from pydantic import field_validator

from rlfabric.reward.scorers.base import ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.registry import register

RegexFlag = Literal["IGNORECASE", "MULTILINE", "DOTALL", "VERBOSE"]


class RegexParams(ScorerParams):
    pattern: str
    """The regular expression (Python `re` syntax), e.g. `^<think>.*?</think>\\s*<answer>.*?</answer>$`."""
    mode: Literal["search", "fullmatch"] = "search"
    """"search": the pattern matches anywhere; "fullmatch": it matches the whole completion."""
    flags: list[RegexFlag] = []
    """`re` flags by name."""
    strip: bool = True
    """Strip leading and trailing whitespace from the completion first."""
    reward_match: float = 1.0
    """Reward when the pattern matches."""
    reward_no_match: float = 0.0
    """Reward when it does not."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from exc
        return pattern


@register
class RegexScorer(Scorer):
    name = "regex"
    version = "1"
    description = "Completion matches a regular expression (format reward)."
    Params = RegexParams
    params: RegexParams

    def __init__(self, params: RegexParams) -> None:
        super().__init__(params)
        flags = reduce(lambda acc, name: acc | getattr(re, name), params.flags, 0)
        self._regex = re.compile(params.pattern, flags)

    def _score_one(self, item: ScoreInput) -> ScoreResult:
        text = item.completion.strip() if self.params.strip else item.completion
        match = self._regex.fullmatch(text) if self.params.mode == "fullmatch" else self._regex.search(text)
        reward = self.params.reward_match if match else self.params.reward_no_match
        return ScoreResult.ok(reward, {"matched": 1.0 if match else 0.0})
