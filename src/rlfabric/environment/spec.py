"""What an environment is, as a run file or a service config declares it: tools and environment specs.

Plain pydantic, no grpc and no tool code, so a run file's schema can hold these later without importing
the environment service. A tool is a JSON-schema function (`ToolSpec`); an environment is either the
built-in `ToolEnvironment` over a list of tools (`kind = "tools"`), a user class loaded by reference
(`kind = "python"`), or an environment written for TRL's `GRPOTrainer(environment_factory=...)` run
unchanged (`kind = "trl"`), under the operator's `allowed_functions`.

    [[environment.tools]]
    name = "calculator"
    kind = "builtin"

    [[environment.tools]]
    name = "lookup"
    kind = "python"
    ref = "my_tools:lookup"
    description = "Looks a word up in the dictionary."
    parameters = { type = "object", properties = { word = { type = "string" } }, required = ["word"] }
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Self

import jsonschema
from pydantic import AfterValidator, Field, field_validator, model_validator

from rlfabric.environment.parsers import PARSERS
from rlfabric.runtime.config import StrictModel

BUILTIN_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "calculator": (
        "Evaluates an arithmetic expression (numbers, + - * / // % **, parentheses); returns its value.",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    ),
    "python": (
        "Runs a Python program in a sandbox without network and returns what it prints.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; print the results"}},
            "required": ["code"],
            "additionalProperties": False,
        },
    ),
}
"""Each built-in tool's default description and arguments schema, by name."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def _known_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r} (known: {', '.join(sorted(PARSERS))})")
    return name


ParserName = Annotated[str, AfterValidator(_known_parser)]
"""The name of a registered tool-call parser (`rlfabric.environment.parsers`)."""


class ToolSpec(StrictModel):
    """One tool the model may call, declared as a JSON-schema function."""

    name: str
    """The name the model calls it by (letters, digits, "_", "-", "."; at most 64 characters)."""
    kind: Literal["builtin", "python"] = "builtin"
    """builtin: one of the built-in tools (`calculator`, `python`); python: a user function (`ref`)."""
    ref: str | None = None
    """python: the function, "package.module:function" or "path/to/file.py:function", allowed by the
    service's `allowed_functions`; called with the arguments as keywords, sync or async, and its return
    value (text, or anything JSON can write) is what the model sees. builtin: the built-in's name
    (defaults to `name`)."""
    description: str | None = None
    """What the tool does, for the model; a built-in's own description when unset."""
    parameters: dict[str, Any] | None = None
    """The JSON schema of the arguments object (type "object"); a built-in's own schema when unset.
    Calls whose arguments do not fit it are refused with a message the model sees."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(f"{name!r}: letters, digits, '_', '-' and '.' only, at most 64 characters")
        return name

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return None
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        if schema.get("type") != "object":
            raise ValueError('the arguments schema must have "type": "object"')
        return schema

    @model_validator(mode="after")
    def _ref_fits_kind(self) -> Self:
        if self.kind == "python" and not self.ref:
            raise ValueError(f"tool {self.name!r}: kind 'python' needs ref ('module:function')")
        if self.kind == "builtin" and self.builtin not in BUILTIN_TOOLS:
            known = ", ".join(sorted(BUILTIN_TOOLS))
            raise ValueError(f"tool {self.name!r}: no built-in tool {self.builtin!r} (known: {known})")
        return self

    @property
    def builtin(self) -> str:
        """The built-in this tool is (its `ref`, else its name); meaningful for kind "builtin" only."""
        return self.ref or self.name

    def resolved_description(self) -> str:
        """The description the model sees."""
        if self.description is not None:
            return self.description
        return BUILTIN_TOOLS[self.builtin][0] if self.kind == "builtin" else ""

    def resolved_parameters(self) -> dict[str, Any]:
        """The arguments schema calls are checked against."""
        if self.parameters is not None:
            return self.parameters
        if self.kind == "builtin":
            return BUILTIN_TOOLS[self.builtin][1]
        return {"type": "object", "properties": {}}


class ToolCallingSpec(StrictModel):
    """What every tool-calling environment reads from its spec: where the prompt is, how calls are found
    in the model's text, and how much of them runs."""

    tool_parser: ParserName = "hermes"
    """How tool calls are read from the model's text: a registered parser ("hermes")."""
    prompt_field: str = "prompt"
    """The task column holding the prompt: text (one user message) or a list of chat messages."""
    max_tool_calls: int = Field(default=8, ge=1, le=1024)
    """Tool calls run per step; later ones are answered with an error message, not run."""
    max_output_chars: int = Field(default=4000, ge=1, le=1 << 20)
    """A tool's answer is cut to this many characters (the cut is marked) before the model sees it."""


class ToolEnvironmentSpec(ToolCallingSpec):
    """The built-in `ToolEnvironment`: the task's prompt, then tool calls answered until the model
    answers without one (its final answer, scored later by the trajectory driver's scorer)."""

    kind: Literal["tools"] = "tools"
    tools: list[ToolSpec] = Field(default_factory=lambda: [ToolSpec(name="calculator")])
    """The tools the model may call (names unique)."""

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[ToolSpec]) -> list[ToolSpec]:
        names = [t.name for t in tools]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tool names must be unique: {', '.join(repeated)} repeated")
        return tools


class PythonEnvironmentSpec(StrictModel):
    """A user environment class loaded by reference (see `rlfabric.environment.base.Environment`)."""

    kind: Literal["python"]
    ref: str
    """The class, "package.module:Class" or "path/to/file.py:Class", allowed by `allowed_functions`;
    one instance per session."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class's constructor."""


class TrlEnvironmentSpec(ToolCallingSpec):
    """An environment written for TRL's `GRPOTrainer(environment_factory=...)`, run unchanged (see
    `rlfabric.environment.trl_env`): its public methods are the tools, `reset(**row)` may add text to the
    prompt (appended to the last message of `prompt_field`, whose absence means one empty user message,
    as in TRL), and `get_reward()` (when defined) is the final step's reward."""

    kind: Literal["trl"]
    ref: str
    """The factory, "package.module:Name" or "path/to/file.py:Name", allowed by `allowed_functions`: a
    class or a zero-argument callable returning an environment (what TRL's `environment_factory` takes)."""


EnvironmentSpec = Annotated[
    ToolEnvironmentSpec | PythonEnvironmentSpec | TrlEnvironmentSpec, Field(discriminator="kind")
]
"""Which environment a service runs: `kind` "tools" (built-in), "python" (a user class) or "trl" (an
environment written for TRL's `environment_factory`)."""
