"""The LLM pairwise judge: a model, reached through a generator, says which of two answers is better.

For each `Comparison` the `template` is filled in ({prompt}, {first}, {second}, {reference}; other braces
are kept, so a JSON example in a template is safe), sent as one user message (after `system_prompt`, when
set) and the answer's verdict is read by `parse_verdict`: the last of "[[A]]", "[[B]]", "[[tie]]" (or
"[[C]]"), "Verdict: A" and its variants wins (judges reason first), and an answer that is nothing but "A",
"B" or "tie" counts too. A maps to "first", B to "second".

Never a guess: an answer without a verdict is a `Judgement("error")` whose detail is the raw answer, and
a failed request is one whose detail is the error. The judge sees one order per comparison; asking both
orders and combining them is the pipeline's (`prefs.judging`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, field_validator

from rlfabric.prefs.generation import GenerationError, Generator, GeneratorSpec, Outcome, make_generator
from rlfabric.prefs.types import Comparison, Judgement, Prompt
from rlfabric.runtime.config import StrictModel
from rlfabric.runtime.llm_api import fill_template

DEFAULT_TEMPLATE = """Which of two answers to a question is better? Judge correctness first, then helpfulness,
honesty and clarity. The order of the answers says nothing about their quality, and length is no merit.

Question:
{prompt}

Reference answer (may be empty):
{reference}

Answer A:
{first}

Answer B:
{second}

Compare the answers briefly, then end with the verdict on its own line: "[[A]]" if A is better,
"[[B]]" if B is better, or "[[tie]]" if neither is better."""

Verdict = Literal["first", "second", "tie"]

_WORDS: dict[str, Verdict] = {
    "a": "first",
    "first": "first",
    "b": "second",
    "second": "second",
    "c": "tie",
    "tie": "tie",
    "draw": "tie",
    "equal": "tie",
}
_BRACKETED = re.compile(r"\[\[\s*(?P<v>A|B|C|first|second|tie|draw|equal)\s*\]\]", re.IGNORECASE)
_LABELLED = re.compile(
    r"(?i:\b(?:final\s+)?(?:verdict|winner|decision|judge?ment|preferred|preference|better(?:\s+answer)?))"
    r"[\s*_:=\-\"'`]*(?i:is\s+)?[\s*_\"'`(\[]*"  # "Verdict:", "**Winner** is", "Verdict = ("
    r"(?i:(?:(?:the|a)\s+)?(?:(?:answer|response|assistant|output|option)\s*)?)"
    r"(?P<v>[AB]|(?i:first|second|tie|draw|equal))\b"  # the letters capital only: "a tie" is no "A"
)
_BARE = re.compile(r"[\s*_\"'`(\[]*(?P<v>A|B|(?i:tie))[\s*_\"'`)\].!]*")


def parse_verdict(text: str) -> Verdict | None:
    """The verdict an answer ends on ("first" for A, "second" for B, "tie"), or None when it has none. Of
    every "[[X]]" and "Verdict: X" form the last one in the text wins; a whole answer of "A", "B" or "tie"
    counts too."""
    found = [m for pattern in (_BRACKETED, _LABELLED) for m in pattern.finditer(text)]
    if found:
        last = max(found, key=lambda m: m.end())
        return _WORDS[last.group("v").lower()]
    bare = _BARE.fullmatch(text.strip())
    return _WORDS[bare.group("v").lower()] if bare else None


def prompt_text(prompt: Prompt) -> str:
    """A prompt as text for a template: chat messages one per line as `role: content` (as the reward
    service's judge shows them)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)


class LlmJudgeSpec(StrictModel):
    """An LLM pairwise judge: which generator asks which model, with which prompt."""

    name: str = "llm"
    """How reports and the manifest name this judge."""
    generator: GeneratorSpec
    """The model that judges (`prefs.generation`): a rollout replica or an OpenAI-compatible endpoint."""
    template: str = DEFAULT_TEMPLATE
    """The judge's prompt; {prompt}, {first}, {second} and {reference} are replaced, other braces kept.
    It should ask for a verdict `parse_verdict` reads, with A the first answer and B the second."""
    system_prompt: str | None = None
    """An optional system message before the template."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature of the judge."""
    max_tokens: int = Field(default=512, ge=1)
    """Token limit of one judgement (its reasoning and verdict)."""
    seed: int | None = Field(default=None, ge=0)
    """Seed of the judge's sampling, where the endpoint honours one."""

    @field_validator("template")
    @classmethod
    def _has_both_answers(cls, template: str) -> str:
        missing = [p for p in ("{first}", "{second}") if p not in template]
        if missing:
            raise ValueError(f"the template must contain the {' and '.join(missing)} placeholder(s)")
        return template


def judge_prompt(spec: LlmJudgeSpec, comparison: Comparison) -> Prompt:
    """What the judge model is asked about one comparison: the filled template as a user message."""
    values = {
        "prompt": prompt_text(comparison.prompt),
        "first": comparison.first,
        "second": comparison.second,
        "reference": comparison.reference,
    }
    text = fill_template(spec.template, values)
    if spec.system_prompt is None:
        return text
    return [{"role": "system", "content": spec.system_prompt}, {"role": "user", "content": text}]


def judgement(outcome: Outcome) -> Judgement:
    """The judgement of one answer of the judge model (or of its failed request)."""
    if isinstance(outcome, GenerationError):
        return Judgement("error", f"judge request failed: {outcome}")
    text = outcome[0]
    verdict = parse_verdict(text)
    return Judgement("error" if verdict is None else verdict, text)


class LlmPairwiseJudge:
    """A `types.PairwiseJudge` backed by a generator: built from `spec.generator` (and closed by `close`)
    unless one is given (then its owner closes it: a generator shared with other stages)."""

    def __init__(self, spec: LlmJudgeSpec, generator: Generator | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self._owned = generator is None
        self.generator = generator if generator is not None else make_generator(spec.generator)

    async def judge(self, comparisons: Sequence[Comparison]) -> list[Judgement]:
        """One judgement per comparison, all asked in one `generate_each` batch. A failed request or an
        answer without a verdict is an "error" judgement; `GeneratorUnusable` (bad endpoint) is raised."""
        prompts = [judge_prompt(self.spec, c) for c in comparisons]
        outcomes = await self.generator.generate_each(
            prompts,
            n=1,
            max_tokens=self.spec.max_tokens,
            temperature=self.spec.temperature,
            seed=self.spec.seed,
        )
        return [judgement(o) for o in outcomes]

    def describe(self) -> dict[str, Any]:
        """Kind, name, the generator (model, endpoint, versions; no credential) and the prompt settings."""
        spec = self.spec
        return {
            "kind": "llm",
            "name": spec.name,
            "generator": self.generator.describe(),
            "template": spec.template,
            "system_prompt": spec.system_prompt,
            "temperature": spec.temperature,
            "max_tokens": spec.max_tokens,
            "seed": spec.seed,
        }

    async def close(self) -> None:
        """Closes the generator's channel or HTTP client, when this judge made it."""
        if self._owned:
            await self.generator.close()
