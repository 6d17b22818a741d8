"""`python_function`: a user reward function with TRL's signature, loaded by reference.

The function is `fn(prompts, completions, **columns) -> list[float | None]`, as TRL's GRPOTrainer calls
reward functions, so existing ones work unchanged. It is named `"package.module:attr"` (imported) or
`"path/to/file.py:attr"` (loaded from the file), and only where the server's `allowed_functions` allow it
(see `policy.py`: the check comes before any import). Per batch it receives:

- `prompts`: each item's prompt, a string or a list of chat messages, as given;
- `completions`: the completion strings;
- `reference`: the reference strings, then one keyword per metadata key (a list aligned with the batch,
  None where an item lacks the key; metadata wins over `reference` on a name clash, and keys named
  `prompts` or `completions` are not passed). A function without
  `**kwargs` receives only the keywords it names.

A None for an item is a `scorer_error` for that item (TRL's "not applicable"), a return value of the
wrong length is an error for every item, and an exception fails the batch (see `run_scorer`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Self

from rlfabric.reward.scorers.base import InvalidScorerSpec, ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.policy import (
    FunctionAllowlist,
    ScorerPolicy,
    check_attribute_path,
    resolve_attribute,
)
from rlfabric.reward.scorers.registry import register

RewardFn = Callable[..., Sequence[float | None]]
_POSITIONAL = {"prompts", "completions"}


class PythonFunctionParams(ScorerParams):
    function: str
    """The function: "package.module:attr" or "path/to/file.py:attr"; the server's `allowed_functions`
    must allow it."""
    kwargs: dict[str, Any] = {}
    """Extra constant keyword arguments passed on every call (after the columns; they win on a clash)."""


def load_function(spec: str, allowlist: FunctionAllowlist) -> RewardFn:
    """Resolve "module:attr" or "file.py:attr" to a callable the allowlist allows; `InvalidScorerSpec` on
    any failure. Invariant: nothing is imported and no file is read before the allowlist said yes."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise InvalidScorerSpec("function", f"expected 'module:attr' or 'path.py:attr', got {spec!r}")
    parts = check_attribute_path(attr)
    if target.endswith(".py"):
        module = _guarded_load(lambda: _load_file(allowlist.check_file(target)), target)
    else:
        allowlist.check_module(target, attr)
        module = _guarded_load(lambda: importlib.import_module(target), target)
    fn = resolve_attribute(module, parts, spec)
    allowlist.check_definition(fn, spec, module.__name__)
    if not callable(fn):
        raise InvalidScorerSpec("function", f"{spec!r} is not callable")
    return fn


def _guarded_load(load: Callable[[], ModuleType], target: str) -> ModuleType:
    """`load()` with every failure but a refusal turned into `InvalidScorerSpec`."""
    try:
        return load()
    except InvalidScorerSpec:
        raise
    except Exception as exc:
        raise InvalidScorerSpec("function", f"cannot load {target!r}: {type(exc).__name__}: {exc}") from exc


def _load_file(resolved: Path) -> ModuleType:
    """Imports the (allowed, resolved) file under a name derived from its path."""
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    name = f"rlfabric_user_reward_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise InvalidScorerSpec("function", f"cannot import {str(resolved)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _accepted_keywords(fn: RewardFn) -> set[str] | None:
    """The keyword names `fn` accepts, or None when it takes `**kwargs` (then it accepts all)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def build_columns(items: Sequence[ScoreInput]) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {"reference": [item.reference for item in items]}
    keys = sorted({key for item in items for key in item.metadata} - _POSITIONAL)
    for key in keys:
        columns[key] = [item.metadata.get(key) for item in items]
    return columns


@register
class PythonFunction(Scorer):
    name = "python_function"
    version = "1"
    description = "User reward function with TRL's signature fn(prompts, completions, **columns)."
    Params = PythonFunctionParams
    params: PythonFunctionParams

    def __init__(self, params: PythonFunctionParams, fn: RewardFn) -> None:
        super().__init__(params)
        self._fn = fn
        self._accepts = _accepted_keywords(fn)

    @classmethod
    def create(cls, params: ScorerParams, policy: ScorerPolicy) -> Self:
        """Loads the function only where the server's `allowed_functions` allows it."""
        assert isinstance(params, PythonFunctionParams)
        return cls(params, load_function(params.function, policy.allowlist))

    def score_batch(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        kwargs = {**build_columns(items), **self.params.kwargs}
        if self._accepts is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepts}
        prompts = [item.prompt for item in items]
        values = list(self._fn(prompts, [item.completion for item in items], **kwargs))
        if len(values) != len(items):
            message = f"{self.params.function} returned {len(values)} rewards for {len(items)} items"
            return [ScoreResult.error(message)] * len(items)
        return [self._result(value) for value in values]

    def _result(self, value: Any) -> ScoreResult:
        if value is None:
            return ScoreResult.error(f"{self.params.function} returned None for this item")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            return ScoreResult.error(f"{self.params.function} returned a non-finite or non-number: {value!r}")
        return ScoreResult.ok(float(value))
