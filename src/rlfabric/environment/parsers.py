"""Tool-call parsers: the model's text -> the calls in it, keyed by name (`tool_parser` in the config).

A parser never raises on what the model wrote: a call it cannot read becomes a `MalformedCall` naming
the problem, which the environment shows the model as a tool message (as real agent stacks do), so a
policy learning the format sees its mistakes.

    hermes   Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any
             number per message; "arguments" may be an object or JSON text of one, and may be left out
             for a call without arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PARSERS", "MalformedCall", "ParsedAction", "ToolCall", "get_parser", "register_parser"]


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a tool name and its arguments object."""

    name: str
    arguments: dict[str, Any]
    raw: str
    """The call's text as the model wrote it."""


@dataclass(frozen=True)
class MalformedCall:
    """A call the parser could not read; `problem` says why, in words the model is shown."""

    raw: str
    problem: str


@dataclass(frozen=True)
class ParsedAction:
    """An action split into its text outside the calls and the calls, in order of appearance."""

    content: str
    calls: list[ToolCall | MalformedCall]


ToolCallParser = Callable[[str], ParsedAction]
PARSERS: dict[str, ToolCallParser] = {}
"""Every registered parser by name."""


def register_parser(name: str) -> Callable[[ToolCallParser], ToolCallParser]:
    """Registers a parser under `name` (a decorator)."""

    def add(parser: ToolCallParser) -> ToolCallParser:
        if name in PARSERS:
            raise ValueError(f"a tool-call parser named {name!r} is already registered")
        PARSERS[name] = parser
        return parser

    return add


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; KeyError naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r} (known: {', '.join(sorted(PARSERS))})") from None


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(_HERMES_OPEN) + r"(.*?)" + re.escape(_HERMES_CLOSE), re.DOTALL)


@register_parser("hermes")
def parse_hermes(text: str) -> ParsedAction:
    """Every `<tool_call>...</tool_call>` block of `text`; an opening tag left unclosed is malformed."""
    calls: list[ToolCall | MalformedCall] = [hermes_call(m.group(1)) for m in _HERMES_CALL.finditer(text)]
    rest = _HERMES_CALL.sub("", text)
    if _HERMES_OPEN in rest:
        tail = rest[rest.index(_HERMES_OPEN) :]
        calls.append(MalformedCall(tail, f"{_HERMES_OPEN} is not closed by {_HERMES_CLOSE}"))
        rest = rest[: rest.index(_HERMES_OPEN)]
    return ParsedAction(rest.strip(), calls)


def hermes_call(body: str) -> ToolCall | MalformedCall:
    """One call's body: a JSON object with a string "name" and an "arguments" object."""
    raw = body.strip()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return MalformedCall(raw, f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})")
    if not isinstance(data, dict):
        return MalformedCall(raw, f"the tool call must be a JSON object, got {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(raw, 'the tool call has no "name" string')
    arguments = _arguments(data.get("arguments", {}))
    if arguments is None:
        return MalformedCall(raw, f'"arguments" of {name!r} must be a JSON object')
    return ToolCall(name, arguments, raw)


def _arguments(value: Any) -> dict[str, Any] | None:
    """The arguments object: an object, or JSON text of one; None for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None
