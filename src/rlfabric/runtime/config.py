"""Loading typed configuration from a file, environment variables and `--set` overrides.

Every service has a pydantic model (its schema, with every default and its docstring in one place). A
configuration is built in layers, each overriding the one before:

    1. the model's defaults
    2. a file (TOML, YAML or JSON, by suffix), or data built elsewhere (`base`: a built-in run spec)
    3. environment variables  PREFIX + dotted path with "__" for ".", e.g. RLFABRIC_REWARD__SERVER__PORT=7001
    4. `--set a.b=value` overrides, in the order given
    5. explicit command-line flags such as `--host` and `--port`

Values from layers 3 and 4 are parsed as YAML scalars/flow values ("3" -> 3, "true" -> True,
"[1, 2]" -> list), then validated by the model like everything else. Unknown keys are errors, so a typo
fails at start with the field named instead of being silently ignored. An error names where each bad value
came from (`Origins`): the file, the environment variable, the `--set` key or the flag.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

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


def env_overrides(prefix: str, environ: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """Overrides from variables named PREFIX + "A__B" (case-insensitive keys), sorted for determinism:
    (dotted key, parsed value, the variable's name)."""
    found = []
    for name in sorted(environ):
        if name.upper().startswith(prefix.upper()) and len(name) > len(prefix):
            dotted = name[len(prefix) :].lower().replace("__", ".")
            found.append((dotted, parse_value(environ[name]), name))
    return found


Key = tuple[str, ...]


class Origins:
    """Which layer set each key of a configuration being built, so that an error names the file,
    environment variable, `--set` key or flag that gave the bad value."""

    def __init__(self, fallback: str = "defaults") -> None:
        self.fallback = fallback
        """The source of a value no layer set (the model's default)."""
        self.by_key: dict[Key, str] = {}

    def set(self, dotted: str, source: str) -> None:
        """`source` set `dotted`, replacing whatever an earlier layer set at or under it."""
        key = tuple(k for k in dotted.split(".") if k)
        self.by_key = {k: s for k, s in self.by_key.items() if k[: len(key)] != key}
        self.by_key[key] = source

    def set_leaves(self, data: Mapping[str, Any], source: str, under: Key = ()) -> None:
        """`source` (a file) set every leaf of `data`, its tables walked."""
        for name, value in data.items():
            key = (*under, str(name))
            if isinstance(value, Mapping) and value:
                self.set_leaves(value, source, key)
            else:
                self.by_key[key] = source

    def of(self, loc: tuple[str | int, ...]) -> list[str]:
        """The sources of the value at pydantic's `loc`: the layer that set it or a table above it; else
        those that set values under it (a rule across fields); else the fallback."""
        path = tuple(str(p) for p in loc)
        above = [k for k in self.by_key if _leads_to(k, path)]
        if above:
            return [self.by_key[max(above, key=len)]]
        below = dict.fromkeys(s for k, s in self.by_key.items() if k[: len(path)] == path)
        return list(below) or [self.fallback]


def _leads_to(key: Key, path: Key) -> bool:
    """`key` is `path` or a table above it; `path` may hold extra steps between (a tagged union's tag)."""
    if not key or not path or key[0] != path[0]:
        return False
    rest = iter(path[1:])
    return all(step in rest for step in key[1:])


def load_config(
    model: type[M],
    *,
    path: str | Path | None = None,
    base: tuple[Mapping[str, Any], str] | None = None,
    overrides: Iterable[str] = (),
    env_prefix: str | None = None,
    environ: Mapping[str, str] | None = None,
    explicit: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
) -> M:
    """Builds `model` from the layers described in the module docstring.

    `explicit` maps dotted paths to values from dedicated flags (e.g. {"server.port": 7001}); entries
    whose value is None are ignored, so unset flags do not override anything. `flags` names the flag of
    each explicit key (e.g. {"server.port": "--port"}) for errors. `base` takes the file's place: data
    built elsewhere and what to call it in errors (e.g. a built-in run spec's dump, "the built-in demo").
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path:
        data, source = read_file(path), str(path)
    elif base:
        data, source = copy.deepcopy(dict(base[0])), base[1]
    origins = Origins()
    origins.set_leaves(data, source)
    if env_prefix:
        for dotted, value, name in env_overrides(env_prefix, environ if environ is not None else {}):
            set_path(data, dotted, value)
            origins.set(dotted, f"environment variable {name}")
    for item in overrides:
        dotted, value = parse_override(item)
        set_path(data, dotted, value)
        origins.set(dotted, f"--set {dotted}")
    for dotted, value in (explicit or {}).items():
        if value is not None:
            set_path(data, dotted, value)
            origins.set(dotted, (flags or {}).get(dotted, f"the flag for {dotted}"))
    return validate(model, data, source, origins)


def validate(model: type[M], data: dict[str, Any], source: str, origins: Origins | None = None) -> M:
    """Validates `data`, turning pydantic's error into a ConfigError that names every bad field and where
    its value came from: by `origins` when the data was built in layers, else all from `source`."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(invalid_message(e, source, origins or Origins(source))) from None


def invalid_message(error: ValidationError, source: str, origins: Origins) -> str:
    """The error's text: a header naming the sources of the bad values, then a line per bad field, which
    names its own sources when there are several. A missing field has none: the header then names
    `source`."""
    rows = [
        (_describe(err), [] if err["type"] == "missing" else origins.of(err["loc"])) for err in error.errors()
    ]
    named = list(dict.fromkeys(s for _, sources in rows for s in sources)) or [source]
    tagged = len(named) > 1
    lines = [
        f"  {line} [{', '.join(sources)}]" if tagged and sources else f"  {line}" for line, sources in rows
    ]
    return f"invalid configuration ({', '.join(named)}):\n" + "\n".join(lines)


def _describe(err: ErrorDetails) -> str:
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    shown = err["type"] != "missing" and not isinstance(err["input"], dict)
    got = f" (got {err['input']!r})" if shown else ""
    return f"{where}: {err['msg']}{got}"


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
