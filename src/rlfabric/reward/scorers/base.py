"""The scorer contract: what goes in, what comes out, and how a scorer declares its parameters.

A scorer turns a batch of `ScoreInput`s into one `ScoreResult` each, in the same order. The one rule every
scorer keeps: a failure is never a reward. An item the scorer could not judge (bad reference, judge
unreachable, user function returned None) has status "scorer_error" and reward NaN, so that a trainer
that forgets to look at the status gets a loud NaN instead of a silent 0 that teaches the policy.

Scorers are classes with class-level `name`, `version`, `description` and a pydantic `Params` model;
an instance is built once with validated params (`rlfabric.reward.scorers.registry.build_scorer`) and
then scores many batches. Per-item scorers write `_score_one` and let `score_each` turn exceptions into
per-item errors; batched scorers (a reward model, a judge, a user function) override `score_batch`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Self

from pydantic import BaseModel, ConfigDict

from rlfabric.reward.spec import Message as Message
from rlfabric.reward.spec import ScoreInput as ScoreInput
from rlfabric.reward.spec import ScoreResult as ScoreResult
from rlfabric.reward.spec import ScoreStatus as ScoreStatus

if TYPE_CHECKING:
    from rlfabric.reward.scorers.policy import ScorerPolicy


class InvalidScorerSpec(ValueError):
    """A scorer name or parameter is wrong; `field` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class ScorerParams(BaseModel):
    """Base for every scorer's `Params`: unknown keys are errors, and field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Scorer:
    """A named, versioned scorer built from validated `Params`.

    Subclasses set `name` (the registry key), `version` (bump when scores change for the same input),
    `description` (one line) and `Params`, and implement `score_batch` or `_score_one`.
    `per_item` tells `run_scorer` it may score items one by one on worker threads (so a slow item times
    out alone); batched scorers leave it False and get the whole batch in one call. `item_threads` caps
    how many of those threads run at once: a scorer whose items wait (on a subprocess, a socket) gains
    from several, a CPU-bound pure-Python one sets 1, since the GIL runs one thread at a time anyway and
    more only add switching (a replacement thread still takes over from an item that overran).
    """

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ""
    Params: ClassVar[type[ScorerParams]] = ScorerParams
    per_item: ClassVar[bool] = False
    item_threads: ClassVar[int] = 8

    def __init__(self, params: ScorerParams) -> None:
        self.params = params

    @classmethod
    def create(cls, params: ScorerParams, policy: ScorerPolicy) -> Self:
        """Build from validated params under the server's `policy`; scorers that load user code or run
        it (python_function, code_exec, composite's parts) override this to obey the policy."""
        return cls(params)

    @property
    def whole_batch(self) -> bool:
        """True when an item's score depends on the other items of its call (a reward model normalised
        over the batch): the service then scores a call in one piece, never split across workers."""
        return False

    def score_batch(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        """Score `items`; the result has the same length and order. Per-item failures are results."""
        return score_each(items, self._score_one)

    def _score_one(self, item: ScoreInput) -> ScoreResult | float:
        raise NotImplementedError(f"{type(self).__name__} implements neither score_batch nor _score_one")

    async def ascore_batch(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        """Async form for I/O-bound scorers; by default `score_batch` on a worker thread."""
        return await asyncio.to_thread(self.score_batch, items)

    def close(self) -> None:
        """Release held resources (models, HTTP clients). Safe to call more than once."""


ItemFn = Callable[[ScoreInput], "ScoreResult | float"]


def score_each(items: Sequence[ScoreInput], fn: ItemFn) -> list[ScoreResult]:
    """Apply `fn` to every item; a float becomes an ok result and an exception a `scorer_error` result."""
    return [score_one_safely(item, fn) for item in items]


def score_one_safely(item: ScoreInput, fn: ItemFn) -> ScoreResult:
    try:
        result = fn(item)
    except Exception as exc:
        return ScoreResult.error(describe_exception(exc))
    return result if isinstance(result, ScoreResult) else ScoreResult.ok(result)


def describe_exception(exc: BaseException) -> str:
    """An error message for a result: an `ItemError` speaks for itself, others carry their type name."""
    return str(exc) if isinstance(exc, ItemError) else f"{type(exc).__name__}: {exc}"


class ItemError(Exception):
    """Raised inside a scorer for an item it cannot judge (bad reference, missing metadata)."""
