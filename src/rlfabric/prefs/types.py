"""The value types and protocols every stage of a preference pipeline shares.

A prompt is what a dataset row's prompt column holds: a string, or chat messages ({role, content}). A
completion is text. Light by design: no torch, grpc or httpx import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Prompt = str | list[dict[str, Any]]
"""A prompt column's value: a string or a list of chat messages."""

Preference = Literal["first", "second", "tie", "error"]
"""A judge's answer for one ordered comparison: which of the two completions it prefers, a tie, or that it
could not judge (an unparseable answer, a failed request)."""


@dataclass(frozen=True)
class Comparison:
    """One ordered question to a pairwise judge: is `first` or `second` the better answer to `prompt`?"""

    prompt: Prompt
    first: str
    second: str
    reference: str = ""
    """A reference answer, when the row has one (judges may show it)."""


@dataclass(frozen=True)
class Judgement:
    """A judge's answer to one `Comparison`, with what it said (kept with the data for audits)."""

    preference: Preference
    detail: str = ""
    """The judge's raw answer (an LLM judge's text, a scorer's two scores), or the error."""


class PairwiseJudge(Protocol):
    """Answers ordered comparisons. The pipeline asks each pair in both orders and keeps a pair only when
    both answers agree (position bias cancels); a judge never sees which order it is asked in."""

    name: str
    """How reports and the manifest name this judge."""

    async def judge(self, comparisons: Sequence[Comparison]) -> list[Judgement]:
        """One `Judgement` per comparison, in order. A failure of one item is a `Judgement("error", ...)`,
        never an exception; an exception means the judge as a whole cannot work (bad endpoint)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the dataset manifest records of this judge: kind, model/endpoint, version, parameters
        (never a credential)."""
        ...


class TextGenerator(Protocol):
    """Generates completions: a rollout replica (gRPC) or an OpenAI-compatible chat endpoint."""

    async def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[list[str]]:
        """`n` completions of each prompt, in order: result[i] has `n` texts for prompts[i]."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the manifest records of this generator: kind, model, version, endpoint (no credential)."""
        ...

    async def close(self) -> None:
        """Release channels and clients."""
        ...


@dataclass(frozen=True)
class CritiqueStep:
    """One principle's turn of a critique-revise chain, with the exact prompts the model saw."""

    principle: str
    critique_prompt: Prompt
    critique: str
    revision_prompt: Prompt
    revision: str


@dataclass(frozen=True)
class CaiChain:
    """Constitutional AI on one answer: the original, each principle's critique and revision in turn, and
    the final revision (the pair is revised > original)."""

    prompt: Prompt
    original: str
    steps: tuple[CritiqueStep, ...]

    @property
    def revised(self) -> str:
        """The last revision (the original when no step ran)."""
        return self.steps[-1].revision if self.steps else self.original


@dataclass
class PrefPair:
    """One row of a preference dataset version: (prompt, chosen, rejected) and how it came to be.

    `meta` is JSON-serialisable: the source (`source`), the judges' votes, a CAI chain, a score margin."""

    prompt: Prompt
    chosen: str
    rejected: str
    meta: dict[str, Any] = field(default_factory=dict)
