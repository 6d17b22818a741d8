"""`llm_judge`: an LLM grades each completion against a rubric (RLAIF) over an OpenAI-compatible API.

For every item the rubric `template` is filled in ({prompt}, {completion}, {reference}; other braces are
left alone, so JSON examples in a rubric are safe) and POSTed to `{base_url}/chat/completions`.
The judgement's score is found by `parse_score` (a JSON `{"score": x}`, `[[x]]`, `Score: x` or
`Score: x/y`, or a bare number; the last one wins, judges reason first) and mapped from
[scale_min, scale_max] to [0, 1].

Failure is never a low score: an unparseable judgement, a score outside the scale, a 4xx answer or an
endpoint still failing after `max_retries` retries (transport errors, 429 and 5xx, with exponential
backoff) make that item a `scorer_error`. Requests run concurrently (`concurrency`) on one event loop;
`score_batch` runs that loop itself, so from async code call `ascore_batch` (or `arun_scorer`).
Template filling and the request with its retries are `rlfabric.runtime.llm_api`'s, shared with the
preference pipeline's LLM judges (`rlfabric.prefs`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Sequence
from typing import Any, Self

import httpx
from pydantic import Field, field_validator, model_validator

from rlfabric.reward.scorers.base import (
    InvalidScorerSpec,
    ItemError,
    ScoreInput,
    Scorer,
    ScoreResult,
    ScorerParams,
    describe_exception,
)
from rlfabric.reward.scorers.policy import ScorerPolicy
from rlfabric.reward.scorers.registry import register
from rlfabric.runtime.llm_api import ChatApiError, ChatEndpoint, choice_texts, fill_template

DEFAULT_TEMPLATE = """You are grading an answer to a question.

Question:
{prompt}

Reference answer (may be empty):
{reference}

Answer to grade:
{completion}

Judge correctness and helpfulness. Explain briefly, then end with a line of the form "Score: N/10",
where N is an integer from 0 (worst) to 10 (best)."""
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
_DOUBLE_BRACKET = re.compile(rf"\[\[\s*({_NUMBER})\s*\]\]")
_LABELLED = re.compile(rf"\b(?:score|rating|grade)\s*[:=]?\s*\**\s*({_NUMBER})\s*(?:/\s*{_NUMBER})?", re.I)


class LlmJudgeParams(ScorerParams):
    base_url: str
    """The OpenAI-compatible API root, including the version, e.g. "http://judge:8000/v1"."""
    model: str
    """The model name sent in the request."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (sent as a Bearer token); None: no key. The
    server's `judge_api_keys` must list it, with this `base_url`."""
    template: str = DEFAULT_TEMPLATE
    """The rubric; {prompt}, {completion} and {reference} are replaced, other braces are kept."""
    system_prompt: str | None = None
    """An optional system message before the rubric."""
    scale_min: float = 0.0
    """The lowest score the rubric asks for (maps to reward 0)."""
    scale_max: float = 10.0
    """The highest score the rubric asks for (maps to reward 1)."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature of the judge."""
    max_tokens: int = Field(default=512, gt=0)
    """Token limit of one judgement."""
    timeout_s: float = Field(default=60.0, gt=0)
    """HTTP timeout of one request."""
    max_retries: int = Field(default=3, ge=0)
    """Retries after a transport error, 429 or 5xx (so at most max_retries + 1 attempts)."""
    backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the first retry; doubles on each further retry."""
    concurrency: int = Field(default=16, gt=0)
    """Requests in flight at once."""

    @field_validator("template")
    @classmethod
    def _has_completion(cls, template: str) -> str:
        if "{completion}" not in template:
            raise ValueError("the template must contain the {completion} placeholder")
        return template

    @model_validator(mode="after")
    def _scale_ordered(self) -> LlmJudgeParams:
        if self.scale_max <= self.scale_min:
            raise ValueError(f"scale_max ({self.scale_max}) must exceed scale_min ({self.scale_min})")
        return self


def parse_score(text: str) -> float | None:
    """The score in a judgement, or None. Tried in order: JSON {"score": x}, [[x]], "Score: x(/y)", a bare
    number; within a form the last occurrence wins."""
    for finder in (_json_score, _last_match(_DOUBLE_BRACKET), _last_match(_LABELLED), _bare_number):
        score = finder(text)
        if score is not None:
            return score
    return None


def _json_score(text: str) -> float | None:
    for candidate in reversed(_JSON_OBJECT.findall(text)):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        score = value.get("score") if isinstance(value, dict) else None
        if isinstance(score, int | float) and not isinstance(score, bool):
            return float(score)
        if isinstance(score, str) and re.fullmatch(_NUMBER, score.strip()):
            return float(score)
    return None


def _last_match(pattern: re.Pattern[str]) -> Any:
    def find(text: str) -> float | None:
        matches = pattern.findall(text)
        return float(matches[-1]) if matches else None

    return find


def _bare_number(text: str) -> float | None:
    stripped = text.strip().rstrip(".")
    return float(stripped) if re.fullmatch(_NUMBER, stripped) else None


def render_template(template: str, item: ScoreInput) -> str:
    values = {"prompt": item.prompt_text, "completion": item.completion, "reference": item.reference}
    return fill_template(template, values)


@register
class LlmJudge(Scorer):
    name = "llm_judge"
    version = "1"
    description = "An LLM grades the completion with a rubric over an OpenAI-compatible endpoint."
    Params = LlmJudgeParams
    params: LlmJudgeParams

    def __init__(self, params: LlmJudgeParams) -> None:
        super().__init__(params)
        key = None
        if params.api_key_env is not None:
            key = os.environ.get(params.api_key_env)
            if not key:
                raise InvalidScorerSpec(
                    "api_key_env", f"environment variable {params.api_key_env!r} is not set"
                )
        self.endpoint = ChatEndpoint(params.base_url, key, params.max_retries, params.backoff_s)

    @classmethod
    def create(cls, params: ScorerParams, policy: ScorerPolicy) -> Self:
        """An API key is read only where the server's `judge_api_keys` allows it for this base URL."""
        assert isinstance(params, LlmJudgeParams)
        if params.api_key_env is not None:
            policy.check_api_key(params.api_key_env, params.base_url)
        return cls(params)

    def score_batch(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        return asyncio.run(self.ascore_batch(items))

    async def ascore_batch(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        limit = asyncio.Semaphore(self.params.concurrency)
        async with httpx.AsyncClient(
            timeout=self.params.timeout_s, headers=self.endpoint.headers()
        ) as client:
            return list(await asyncio.gather(*(self._judge_safely(client, limit, item) for item in items)))

    async def _judge_safely(
        self, client: httpx.AsyncClient, limit: asyncio.Semaphore, item: ScoreInput
    ) -> ScoreResult:
        async with limit:
            try:
                return await self._judge(client, item)
            except Exception as exc:
                return ScoreResult.error(describe_exception(exc))

    async def _judge(self, client: httpx.AsyncClient, item: ScoreInput) -> ScoreResult:
        reply = await self._complete(client, self._messages(item))
        score = parse_score(reply)
        if score is None:
            raise ItemError(f"no score found in the judgement: {reply[-300:]!r}")
        p = self.params
        if not p.scale_min <= score <= p.scale_max:
            raise ItemError(f"judge score {score} is outside the scale [{p.scale_min}, {p.scale_max}]")
        return ScoreResult.ok((score - p.scale_min) / (p.scale_max - p.scale_min), {"judge_score": score})

    def _messages(self, item: ScoreInput) -> list[dict[str, str]]:
        messages = [{"role": "user", "content": render_template(self.params.template, item)}]
        if self.params.system_prompt:
            messages.insert(0, {"role": "system", "content": self.params.system_prompt})
        return messages

    async def _complete(self, client: httpx.AsyncClient, messages: list[dict[str, str]]) -> str:
        body = {
            "model": self.params.model,
            "messages": messages,
            "temperature": self.params.temperature,
            "max_tokens": self.params.max_tokens,
        }
        try:
            texts = choice_texts(await self.endpoint.complete(client, body))
        except ChatApiError as exc:
            raise ItemError(f"judge request: {exc}") from exc
        if not texts:
            raise ItemError("judge request: the chat completion has no choices")
        return texts[0]
