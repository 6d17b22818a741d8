"""Scorers by name: registration, self-description from the `Params` models, and construction.

Users choose scorers by name (in a run file, a CLI flag, a gRPC request), so the registry is the one map
from name to class. `describe_scorers()` derives every parameter's type, default and description from
the scorer's pydantic `Params`, so the documentation cannot drift from the validation.
`build_scorer(name, params)` validates and raises `InvalidScorerSpec` naming the offending field as a
dotted path from the spec root: `name`, `params.pattern`, `params.parts[1].params.weight`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_core import PydanticUndefined, to_jsonable_python

from rlfabric.reward.scorers.base import InvalidScorerSpec, Scorer, ScorerParams
from rlfabric.reward.scorers.policy import ScorerPolicy
from rlfabric.reward.spec import ParamInfo as ParamInfo
from rlfabric.reward.spec import ScorerInfo as ScorerInfo

SCORERS: dict[str, type[Scorer]] = {}
S = TypeVar("S", bound=type[Scorer])


def register(cls: S) -> S:
    """Class decorator: add `cls` to `SCORERS` under `cls.name`; every Params field must be described."""
    if cls.name in SCORERS and SCORERS[cls.name] is not cls:
        raise ValueError(f"scorer name {cls.name!r} is already registered by {SCORERS[cls.name].__name__}")
    undocumented = [n for n, f in cls.Params.model_fields.items() if not f.description]
    if undocumented:
        raise ValueError(f"{cls.__name__}.Params fields without a docstring: {undocumented}")
    SCORERS[cls.name] = cls
    return cls


def describe_scorers() -> list[ScorerInfo]:
    """Every registered scorer, sorted by name, with its parameters derived from its `Params` model."""
    return [
        ScorerInfo(cls.name, cls.version, cls.description, tuple(describe_params(cls.Params)))
        for _, cls in sorted(SCORERS.items())
    ]


def describe_params(params: type[ScorerParams]) -> list[ParamInfo]:
    schema = params.model_json_schema()
    props = schema.get("properties", {})
    return [_param_info(name, info, props.get(name, {})) for name, info in params.model_fields.items()]


def _param_info(name: str, info: Any, prop: dict[str, Any]) -> ParamInfo:
    required = info.is_required()
    default = None
    if not required:
        value = info.get_default(call_default_factory=True)
        default = json.dumps(to_jsonable_python(value)) if value is not PydanticUndefined else None
    return ParamInfo(
        name=name,
        type=_json_type(prop),
        default=default,
        description=info.description or "",
        required=required,
        choices=tuple(prop.get("enum", ())),
    )


def _json_type(prop: dict[str, Any]) -> str:
    """The JSON-schema type of one property: "integer", "number|null", "array", "object" for models."""
    if "type" in prop:
        return str(prop["type"])
    if "anyOf" in prop:
        return "|".join(_json_type(p) for p in prop["anyOf"])
    if "enum" in prop or "const" in prop:
        return "string"
    return "object"


def build_scorer(
    name: str, params: Mapping[str, Any] | None = None, policy: ScorerPolicy | None = None
) -> Scorer:
    """Validate `params` for the scorer `name` and build it under `policy` (None: the default policy, no
    user code and the default sandbox); raise `InvalidScorerSpec` naming the field."""
    cls = SCORERS.get(name)
    if cls is None:
        raise InvalidScorerSpec("name", f"unknown scorer {name!r}; known: {', '.join(sorted(SCORERS))}")
    validated = validate_params(cls, params or {})
    try:
        return cls.create(validated, policy or ScorerPolicy())
    except InvalidScorerSpec as exc:
        raise InvalidScorerSpec(f"params.{exc.field}", exc.reason) from exc


def validate_params(cls: type[Scorer], params: Mapping[str, Any]) -> ScorerParams:
    try:
        return cls.Params.model_validate(dict(params))
    except ValidationError as exc:
        errors = exc.errors()
        fields = [f"params{_loc_path(e['loc'])}" for e in errors]
        reason = f"{errors[0]['msg']} (scorer {cls.name!r})"
        others = [f"{f}: {e['msg']}" for f, e in zip(fields[1:], errors[1:], strict=True)]
        if others:
            reason += "; also " + "; ".join(others)
        raise InvalidScorerSpec(fields[0], reason) from exc


def _loc_path(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
