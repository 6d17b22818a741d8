"""`exact_match`: the (optionally extracted and normalised) answer equals the reference."""

from __future__ import annotations

from typing import Literal

from rlfabric.reward.scorers.base import ItemError, ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.registry import register
from rlfabric.reward.scorers.text import extract_boxed, extract_tag, normalize


class ExactMatchParams(ScorerParams):
    extract: Literal["none", "tag", "boxed", "tag_or_boxed"] = "none"
    """Where the answer is taken from: the whole completion, the last <tag>..</tag>, the last \\boxed{}, or
    the tag and failing that \\boxed{}. A completion without the expected wrapper scores `reward_mismatch`."""
    tag: str = "answer"
    """The tag name for extract="tag"/"tag_or_boxed" (`answer` reads <answer>..</answer>)."""
    extract_reference: bool = False
    """Apply the same extraction to the reference (for references that carry the wrapper themselves)."""
    normalize_whitespace: bool = True
    """Strip and collapse runs of whitespace to one space before comparing."""
    case_sensitive: bool = False
    """Compare case-sensitively; by default both sides are lower-cased."""
    strip_punctuation: bool = False
    """Remove ASCII punctuation before comparing."""
    reward_match: float = 1.0
    """Reward when the answer equals the reference."""
    reward_mismatch: float = 0.0
    """Reward when it does not, or when no answer could be extracted."""


@register
class ExactMatch(Scorer):
    name = "exact_match"
    version = "1"
    description = "Extracted, normalised answer equals the reference."
    Params = ExactMatchParams
    params: ExactMatchParams

    def __init__(self, params: ExactMatchParams) -> None:
        super().__init__(params)
        # The only three outcomes, built once (results are immutable; this scorer runs µs per item).
        self._match = ScoreResult.ok(params.reward_match, {"extracted": 1.0})
        self._mismatch = ScoreResult.ok(params.reward_mismatch, {"extracted": 1.0})
        self._not_extracted = ScoreResult.ok(params.reward_mismatch, {"extracted": 0.0})

    def _score_one(self, item: ScoreInput) -> ScoreResult:
        p = self.params
        reference = self._extract(item.reference) if p.extract_reference else item.reference
        if reference is None:
            raise ItemError(f"reference has no answer to extract with extract={p.extract!r}")
        answer = self._extract(item.completion)
        if answer is None:
            return self._not_extracted
        matched = self._normalize(answer) == self._normalize(reference)
        return self._match if matched else self._mismatch

    def _extract(self, text: str) -> str | None:
        mode = self.params.extract
        if mode == "none":
            return text
        found = extract_tag(text, self.params.tag) if mode in ("tag", "tag_or_boxed") else None
        if found is None and mode in ("boxed", "tag_or_boxed"):
            found = extract_boxed(text)
        return found

    def _normalize(self, text: str) -> str:
        p = self.params
        return normalize(
            text,
            whitespace=p.normalize_whitespace,
            case=not p.case_sensitive,
            punctuation=p.strip_punctuation,
        )
