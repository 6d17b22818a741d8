"""`python_function`: user reward functions called exactly as TRL's GRPOTrainer calls them.

TRL 1.16 calls `reward_func(prompts=..., completions=..., completion_ids=..., **reward_kwargs)`, by keyword;
so does this scorer, so TRL reward functions (`trl.rewards.*`, the examples of TRL's docs) run unchanged.
A function is named `"package.module:attr"` (imported) or `"path/to/file.py:attr"` (loaded from the file),
and loads only where the server's `allowed_functions` allow it (see `policy.py`: the check comes before
any import). A function made by a factory (`trl.rewards.get_soft_overlong_punishment(...)`) is named by
the module attribute it is assigned to, with the factory's module allowed too. Per batch it receives:

- `prompts`: each item's prompt, a string or a list of chat messages, as given;
- `completions`: the completion strings; where the prompt is chat messages (TRL's conversational
  format) the completion is `[{"role": "assistant", "content": text}]`;
- `completion_ids`: each completion's token ids from the engine (None for an item whose ids are unknown;
  `rlfabric reward score` reads them from a `completion_ids` column);
- every dataset column under its own name: `reference` (the built-in scorers' name for the gold answer)
  and each metadata key, None where an item lacks it (a run also passes the reference under its dataset
  column's name, e.g. `solution` for `reference_field = "solution"`, as TRL would);
- `trainer_state`: a `TrainerState` with `global_step` (the lowest policy version of the batch's
  samples) and `epoch` (0 for both outside a run);
- `log_metric(name, value)`: the values one call logs under a name are averaged and land in every item's
  components as `<function>/<name>`, so they reach the run's metrics (`reward/<function>/<name>`);
- `log_extra(column, values)`: one value per item; a numeric value lands in that item's components as
  `<function>/<column>` (there is no completions table: other values are not kept);
- then the constant `kwargs` of the params (they win on a clash).

A function without `**kwargs` receives only the keywords it names. Async functions are awaited (several
concurrently). Several functions (`function` as a list: TRL's `reward_funcs`, with `weights` as its
`reward_weights`) combine as TRL combines them: the reward is the weighted sum over the functions that
returned a number for the item, and each function's value is a component under its name. None means "not
applicable": an item for which every function returned None has status "not_applicable" (reward NaN,
neither a reward nor a failure). A non-number, an exception or a wrong-length answer is a `scorer_error`
naming the function, never a reward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from pydantic import model_validator

from rlfabric.reward.scorers.base import (
    InvalidScorerSpec,
    ScoreInput,
    Scorer,
    ScoreResult,
    ScorerParams,
    describe_exception,
)
from rlfabric.reward.scorers.policy import ScorerPolicy
from rlfabric.reward.scorers.registry import register
from rlfabric.runtime.user_code import FunctionAllowlist, InvalidReference, load_reference

RewardFn = Callable[..., Sequence[float | None] | Awaitable[Sequence[float | None]]]
RESERVED = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"})
"""Keywords the scorer itself passes; a dataset column of the same name is not passed."""


class PythonFunctionParams(ScorerParams):
    function: str | list[str]
    """The reward function, or several (TRL's `reward_funcs`): each "package.module:attr" or
    "path/to/file.py:attr", allowed by the server's `allowed_functions`."""
    weights: list[float] | None = None
    """TRL's `reward_weights`: one weight per function (default 1.0 each)."""
    kwargs: dict[str, Any] = {}
    """Extra constant keyword arguments passed on every call (after the columns; they win on a clash)."""

    @model_validator(mode="after")
    def _one_weight_per_function(self) -> Self:
        if not self.functions:
            raise ValueError("function: name at least one reward function")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(f"weights: {len(self.weights)} weights for {len(self.functions)} functions")
        return self

    @property
    def functions(self) -> list[str]:
        """The function references, as a list."""
        return [self.function] if isinstance(self.function, str) else list(self.function)


@dataclass(frozen=True)
class TrainerState:
    """The part of transformers' `TrainerState` a reward function can read here (curriculum rewards)."""

    global_step: int = 0
    """The lowest policy version (learner step) among the batch's samples."""
    epoch: float = 0.0
    """The lowest dataset epoch among the batch's prompts."""


@dataclass
class CallLogs:
    """What one function logged during one call, through `log_metric` and `log_extra`."""

    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    extra: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric`: one scalar for this batch."""
        self.metrics[name].append(value)

    def log_extra(self, column: str, values: list[Any]) -> None:
        """TRL's `log_extra`: one value per item of the batch."""
        self.extra[column].extend(values)

    def components(self, prefix: str, index: int) -> dict[str, float]:
        """Item `index`'s share: every metric's mean and its own numeric extra values (finite only)."""
        out = {f"{prefix}/{k}": sum(v) / len(v) for k, v in self.metrics.items() if v and _all_numbers(v)}
        for column, values in self.extra.items():
            if index < len(values) and _is_number(values[index]):
                out[f"{prefix}/{column}"] = float(values[index])
        return {k: v for k, v in out.items() if math.isfinite(v)}


@dataclass
class Outcome:
    """One function's answer for a batch: its values, or the error that fails every item."""

    name: str
    values: list[Any]
    logs: CallLogs
    error: str = ""


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _all_numbers(values: list[Any]) -> bool:
    return all(_is_number(v) for v in values)


def load_function(spec: str, allowlist: FunctionAllowlist) -> RewardFn:
    """Resolve "module:attr" or "file.py:attr" to a callable the allowlist allows; `InvalidScorerSpec` on
    any failure. Invariant: nothing is imported and no file is read before the allowlist said yes."""
    try:
        fn = load_reference(spec, allowlist)
    except InvalidReference as exc:
        raise InvalidScorerSpec("function", exc.reason) from exc
    if not callable(fn):
        raise InvalidScorerSpec("function", f"{spec!r} is not callable")
    return fn


def _accepted_keywords(fn: Callable[..., Any]) -> set[str] | None:
    """The keyword names `fn` accepts, or None when it takes `**kwargs` (then it accepts all)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def function_name(fn: Callable[..., Any]) -> str:
    """The name TRL logs a reward function under: its `__name__`, else its class's."""
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def build_columns(items: Sequence[ScoreInput]) -> dict[str, list[Any]]:
    """Every dataset column as a list aligned with `items`: `reference`, then each metadata key."""
    columns: dict[str, list[Any]] = {"reference": [item.reference for item in items]}
    keys = sorted({key for item in items for key in item.metadata} - RESERVED)
    for key in keys:
        columns[key] = [item.metadata.get(key) for item in items]
    return columns


def completion_arg(item: ScoreInput) -> str | list[dict[str, str]]:
    """The completion as TRL gives it: the text, or one assistant message when the prompt is chat."""
    if isinstance(item.prompt, list):
        return [{"role": "assistant", "content": item.completion}]
    return item.completion


def trainer_state(items: Sequence[ScoreInput]) -> TrainerState:
    """The stand-in `trainer_state` of a batch (zeros outside a run)."""
    versions = [i.policy_version for i in items if i.policy_version is not None]
    epochs = [i.epoch for i in items if i.epoch is not None]
    return TrainerState(min(versions, default=0), float(min(epochs, default=0)))


def run_coroutines(coroutines: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Awaits `coroutines` concurrently; each result or exception in order. On a thread of its own when
    this thread already runs an event loop."""

    async def gather() -> list[Any]:
        return await asyncio.gather(*coroutines, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


@register
class PythonFunction(Scorer):
    name = "python_function"
    version = "2"
    description = "User reward functions called as TRL's GRPOTrainer calls them (reward_funcs + weights)."
    Params = PythonFunctionParams
    params: PythonFunctionParams

    def __init__(self, params: PythonFunctionParams, fns: Sequence[RewardFn]) -> None:
        super().__init__(params)
        self._fns = list(fns)
        self._names = _unique([function_name(fn) for fn in fns])
        self._accepts = [_accepted_keywords(fn) for fn in fns]
        self._weights = params.weights or [1.0] * len(fns)

    @classmethod
    def create(cls, params: ScorerParams, policy: ScorerPolicy) -> Self:
        """Loads the functions only where the server's `allowed_functions` allows them."""
        assert isinstance(params, PythonFunctionParams)
        return cls(params, [_load_nth(params, i, policy.allowlist) for i in range(len(params.functions))])

    def score_batch(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        bad = {i: _completion_error(item) for i, item in enumerate(items)}
        good = [i for i, error in bad.items() if not error]
        scored = iter(self._score_valid([items[i] for i in good]) if good else [])
        return [ScoreResult.error(bad[i]) if bad[i] else next(scored) for i in range(len(items))]

    def _score_valid(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        logs = [CallLogs() for _ in self._fns]
        answers = self._call_all(items, logs)
        outcomes = [self._outcome(i, answer, len(items), items, logs[i]) for i, answer in enumerate(answers)]
        return [self._combine(index, outcomes) for index in range(len(items))]

    def _call_all(self, items: Sequence[ScoreInput], logs: list[CallLogs]) -> list[Any]:
        """Each function's answer (or the exception it raised): sync ones called in turn, async ones
        awaited together."""
        shared = {
            "prompts": [item.prompt for item in items],
            "completions": [completion_arg(item) for item in items],
            "completion_ids": [item.completion_ids for item in items],
            **build_columns(items),
            "trainer_state": trainer_state(items),
        }
        answers: list[Any] = []
        for fn, accepts, log in zip(self._fns, self._accepts, logs, strict=True):
            logging = {"log_extra": log.log_extra, "log_metric": log.log_metric}
            kwargs = {**shared, **logging, **self.params.kwargs}
            if accepts is not None:
                kwargs = {k: v for k, v in kwargs.items() if k in accepts}
            answers.append(_call(fn, kwargs))
        pending = [i for i, answer in enumerate(answers) if inspect.iscoroutine(answer)]
        for i, result in zip(pending, run_coroutines([answers[i] for i in pending]), strict=True):
            answers[i] = result
        return answers

    def _outcome(self, i: int, answer: Any, n: int, items: Sequence[ScoreInput], logs: CallLogs) -> Outcome:
        name = self._names[i]
        if isinstance(answer, BaseException):
            return Outcome(name, [], logs, f"{name} raised {describe_exception(answer)}{_ids_hint(items)}")
        try:
            values = list(answer)
        except TypeError:
            return Outcome(name, [], logs, f"{name} returned {type(answer).__name__}, not a list of rewards")
        if len(values) != n:
            return Outcome(name, [], logs, f"{name} returned {len(values)} rewards for {n} items")
        return Outcome(name, values, logs)

    def _combine(self, index: int, outcomes: list[Outcome]) -> ScoreResult:
        """Item `index`'s result: TRL's weighted sum over the functions that returned a number for it."""
        components: dict[str, float] = {}
        total, applied = 0.0, 0
        for outcome, weight in zip(outcomes, self._weights, strict=True):
            components.update(outcome.logs.components(outcome.name, index))
            if outcome.error:
                return ScoreResult.error(outcome.error, components)
            value = outcome.values[index]
            if value is None:
                continue
            if not _is_number(value):
                return ScoreResult.error(f"{outcome.name} returned {value!r}: not a finite number or None")
            total += weight * float(value)
            components[outcome.name] = float(value)
            applied += 1
        if not applied:
            names = ", ".join(o.name for o in outcomes)
            return ScoreResult.not_applicable(f"not applicable: {names} returned None", components)
        return ScoreResult.ok(total, components)


def _call(fn: RewardFn, kwargs: dict[str, Any]) -> Any:
    """`fn(**kwargs)`, or the exception it raised."""
    try:
        return fn(**kwargs)
    except Exception as exc:
        return exc


def _completion_error(item: ScoreInput) -> str:
    """Why an item's completion cannot be scored ("" when it can)."""
    if isinstance(item.completion, str):
        return ""
    return f"completion: expected a string, got {type(item.completion).__name__}"


def _ids_hint(items: Sequence[ScoreInput]) -> str:
    unknown = sum(item.completion_ids is None for item in items)
    return f" (completion_ids unknown for {unknown} items)" if unknown else ""


def _unique(names: list[str]) -> list[str]:
    """`names` with a repeated name numbered (`f`, `f_2`), so each function's component is its own."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def _load_nth(params: PythonFunctionParams, index: int, allowlist: FunctionAllowlist) -> RewardFn:
    """Function `index` of the params; a list's errors name the entry (`function[1]`)."""
    try:
        return load_function(params.functions[index], allowlist)
    except InvalidScorerSpec as exc:
        if isinstance(params.function, str):
            raise
        raise InvalidScorerSpec(f"function[{index}]", exc.reason) from exc
