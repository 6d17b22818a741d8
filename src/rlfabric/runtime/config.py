"""Loading typed configuration from a file, environment variables and `--set` overrides.

Every service has a pydantic model (its schema, with every default and its docstring in one place). A
configuration is built in layers, each overriding the one before:

    1. the model's defaults
    2. a file (TOML, YAML or JSON, by suffix)
    3. environment variables  PREFIX + dotted path with "__" for ".", e.g. RLFABRIC_REWARD__SERVER__PORT=7001
    4. `--set a.b=value` overrides, in the order given
    5. explicit command-line flags such as `--host` and `--port`

Values from layers 3 and 4 are parsed as YAML scalars/flow values ("3" -> 3, "true" -> True,
"[1, 2]" -> list), then validated by the model like everything else. Unknown keys are errors, so a typo
fails at start with the field named instead of being silently ignored.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats: `1e-6` and `3E5` are numbers, not strings (YAML 1.1
    needs a dot and a signed exponent), so they validate as floats under the run spec's strict types."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    """One YAML document with `_YamlLoader` (safe: plain data only)."""
    loader = _YamlLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class ConfigError(ValueError):
    """A configuration that cannot be loaded; the message names the source and the offending fields."""


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors and defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)


def read_file(path: str | Path) -> dict[str, Any]:
    """Reads a TOML, YAML or JSON file into a dict (an empty file is an empty dict)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    text = p.read_text()
    try:
        data = _parse(p.suffix.lower(), text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: not valid {p.suffix.lstrip('.')}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a table/mapping, got {type(data).__name__}")
    return data


def _parse(suffix: str, text: str) -> Any:
    if suffix == ".toml":
        return tomllib.loads(text)
    if suffix in (".yaml", ".yml"):
        return yaml_load(text) or {}
    if suffix == ".json":
        return json.loads(text)
    raise ConfigError(f"unsupported config format {suffix!r}: use .toml, .yaml, .yml or .json")


def parse_value(text: str) -> Any:
    """Parses an override value the way YAML reads a scalar or flow collection."""
    try:
        return yaml_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets `data[a][b][c] = value` for "a.b.c", creating tables on the way."""
    keys = [k for k in dotted.split(".") if k]
    if not keys:
        raise ConfigError(f"empty key in override {dotted!r}")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted!r}: {key!r} is not a table")
        node = child
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """Splits "a.b=value" into ("a.b", parsed value)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form key.path=value")
    return key.strip(), parse_value(raw)


def env_overrides(prefix: str, environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """Overrides from variables named PREFIX + "A__B" (case-insensitive keys), sorted for determinism."""
    found = []
    for name in sorted(environ):
        if name.upper().startswith(prefix.upper()) and len(name) > len(prefix):
            dotted = name[len(prefix) :].lower().replace("__", ".")
            found.append((dotted, parse_value(environ[name])))
    return found


def load_config(
    model: type[M],
    *,
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    env_prefix: str | None = None,
    environ: Mapping[str, str] | None = None,
    explicit: Mapping[str, Any] | None = None,
) -> M:
    """Builds `model` from the layers described in the module docstring.

    `explicit` maps dotted paths to values from dedicated flags (e.g. {"server.port": 7001}); entries
    whose value is None are ignored, so unset flags do not override anything.
    """
    data: dict[str, Any] = read_file(path) if path else {}
    source = str(path) if path else "defaults"
    if env_prefix:
        for dotted, value in env_overrides(env_prefix, environ if environ is not None else {}):
            set_path(data, dotted, value)
    for item in overrides:
        set_path(data, *parse_override(item))
    for dotted, value in (explicit or {}).items():
        if value is not None:
            set_path(data, dotted, value)
    return validate(model, data, source)


def validate(model: type[M], data: dict[str, Any], source: str) -> M:
    """Validates `data`, turning pydantic's error into a ConfigError that names every bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid configuration ({source}):\n{format_errors(e)}") from None


def format_errors(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        shown = err["type"] != "missing" and not isinstance(err["input"], dict)
        got = f" (got {err['input']!r})" if shown else ""
        lines.append(f"  {where}: {err['msg']}{got}")
    return "\n".join(lines)


def describe_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """Flattens a model into (dotted key, default as text, description) rows for `--help`."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(describe_fields(annotation, f"{key}."))
            continue
        default = "(required)" if field.is_required() else _show(field.get_default(call_default_factory=True))
        rows.append((key, default, (field.description or "").split("\n")[0]))
    return rows


def _show(value: Any) -> str:
    if isinstance(value, BaseModel):
        return json.dumps(value.model_dump(mode="json"))
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)
