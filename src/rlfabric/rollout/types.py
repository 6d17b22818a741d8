"""The rollout service's plain data types: what a Generate request asks of an engine and what it yields.

Kept apart from `engine.py` (the engine interface) so `rlfabric.contracts.wire` can convert them without
loading any rollout code; `engine.py` re-exports them. `SamplingSettings` is where sampling values are
validated, once: a request converted from the wire and one built in-process pass the same rules and get
the same field-naming messages (a replica then checks only its own limits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlfabric.runtime.errors import InvalidArgument

FinishReason = Literal["stop", "length", "abort"]
"""Why a sample ended: a stop token or string, max_tokens, or an abort."""
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort")
"""Every `FinishReason`, in the proto enum's order."""


class InvalidSampling(InvalidArgument, ValueError):
    """Sampling values no engine can run; the message names the field (`sampling.top_p: ...`)."""


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample each prompt. `top_k <= 0` and `top_p == 1.0` switch those filters off;
    `temperature == 0` is greedy. With `seed` set, sample k of a request (k = prompt_index * n +
    sample_index) uses seed + k, so results are reproducible on one engine. Construction raises
    `InvalidSampling` for values outside those ranges (`sampling_problem`)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (fixed-length samples for benchmarks and tests)."""

    def __post_init__(self) -> None:
        problem = sampling_problem(self)
        if problem is not None:
            raise InvalidSampling(problem)

    def sample_seed(self, prompt_index: int, sample_index: int) -> int | None:
        """The seed of one sample, or None when the request is unseeded."""
        if self.seed is None:
            return None
        return self.seed + prompt_index * self.n + sample_index


def sampling_problem(s: SamplingSettings) -> str | None:
    """The first rule `s` breaks, as a message naming the field; None when every value is runnable."""
    problems = [
        (s.n < 1, f"sampling.n: must be >= 1, got {s.n}"),
        (s.max_tokens < 1, f"sampling.max_tokens: must be >= 1, got {s.max_tokens}"),
        (not s.temperature >= 0, f"sampling.temperature: must be >= 0, got {s.temperature}"),
        (not 0 < s.top_p <= 1, f"sampling.top_p: must be in (0, 1], got {s.top_p}"),
        (s.top_k < -1, f"sampling.top_k: must be positive, or 0 or -1 (off), got {s.top_k}"),
        (any(not stop for stop in s.stop), "sampling.stop: stop strings must not be empty"),
    ]
    return next((message for bad, message in problems if bad), None)


@dataclass(frozen=True)
class EngineSample:
    """One finished (or aborted) completion. `token_ids` and `logprobs` align one to one; `token_ids`
    includes a final end-of-sequence token when the sample stopped on one. Times are seconds since the
    request was submitted to the engine."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    first_token_s: float
    total_s: float
    cached_tokens: int = 0
    """Prompt tokens the engine found in its prefix cache (not computed again); 0 when unknown."""
