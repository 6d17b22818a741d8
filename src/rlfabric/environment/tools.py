"""Running the model's tool calls: a `ToolBox` holds the declared tools and answers every call.

Each call found by the parser is answered by exactly one `ToolCallRecord`, whose `output` is what the
model sees next as a "tool" message:

1. a malformed call (bad JSON, no name), an unknown tool, arguments that do not fit the tool's JSON
   schema, a call past `max_tool_calls`, or a tool that raised, is answered `ok=False` with the problem
   in words ("error: ..."), never a crash: the model learns from it;
2. a host fault that is not the model's doing (the sandbox cannot be set up) propagates, and the service
   reports the step as ENV_ERROR.

Built-ins: `calculator` (`calculator.calculate`, AST arithmetic) and `python` (the program runs in
`runtime.sandbox` under the service's `sandbox` limits). User tools are functions loaded by reference
under the allow-list; sync ones run on a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from rlfabric.environment.calculator import CalculatorError, calculate
from rlfabric.environment.parsers import MalformedCall, ParsedAction, ToolCall, get_parser
from rlfabric.environment.spec import ToolSpec
from rlfabric.environment.types import ToolCallRecord, ToolSchema
from rlfabric.runtime.sandbox import limit_exceeded, run_python
from rlfabric.runtime.schema import SandboxConfig
from rlfabric.runtime.user_code import FunctionAllowlist, InvalidReference, load_reference

ToolFn = Callable[[dict[str, Any]], Awaitable[str]]
"""A tool: its (validated) arguments -> the text the model sees. Raising `ToolError` (or, for a user
tool, any exception) answers the call with an error message."""


class ToolError(Exception):
    """A call the tool refuses; the message is shown to the model after "error: "."""

    def shown(self) -> str:
        """What the model sees."""
        return f"error: {self}"


class WordedToolError(ToolError):
    """A tool failure the environment words itself: the message is shown exactly as it is (TRL's
    environments answer a raising tool with `str({"error": str(exc)})`)."""

    def shown(self) -> str:
        return str(self)


class InvalidTool(ValueError):
    """A tool declaration that cannot be built (a refused or missing function); names the tool."""


@dataclass(frozen=True)
class BoundTool:
    """A declared tool ready to run: its schema, its arguments validator and its function."""

    schema: ToolSchema
    validator: jsonschema.protocols.Validator
    fn: ToolFn

    @classmethod
    def of(cls, schema: ToolSchema, fn: ToolFn) -> BoundTool:
        """`fn` under `schema`, its calls checked against `schema.parameters`."""
        return cls(schema, jsonschema.Draft202012Validator(schema.parameters), fn)


class ToolBox:
    """The tools of an environment and the parser that finds calls in the model's text."""

    def __init__(
        self, tools: Sequence[BoundTool], parser: str = "hermes", *, max_calls: int = 8, max_chars: int = 4000
    ) -> None:
        self.tools = {tool.schema.name: tool for tool in tools}
        self.parse = get_parser(parser)
        self.max_calls = max_calls
        self.max_chars = max_chars

    @classmethod
    def build(
        cls, specs: Sequence[ToolSpec], allowlist: FunctionAllowlist, sandbox: SandboxConfig, **kw: Any
    ) -> ToolBox:
        """Binds each declared tool (user functions loaded now, under `allowlist`); `InvalidTool` naming
        the first that cannot be bound."""
        return cls([bind(spec, allowlist, sandbox) for spec in specs], **kw)

    def schemas(self) -> list[ToolSchema]:
        """The declarations the model is shown, in declaration order."""
        return [tool.schema for tool in self.tools.values()]

    async def run(self, action: str) -> tuple[ParsedAction, list[ToolCallRecord]]:
        """The action's calls and one record per call, in order (run one after the other)."""
        parsed = self.parse(action)
        records = []
        for index, call in enumerate(parsed.calls):
            if index >= self.max_calls:
                records.append(refused(call, f"more than {self.max_calls} tool calls in one turn; not run"))
            else:
                records.append(await self.call(call))
        return parsed, records

    async def call(self, call: ToolCall | MalformedCall) -> ToolCallRecord:
        """Answers one call: refused with the problem in words, or the tool's output."""
        if isinstance(call, MalformedCall):
            return refused(call, call.problem)
        tool = self.tools.get(call.name)
        if tool is None:
            return refused(call, f"unknown tool {call.name!r} (available: {', '.join(self.tools) or 'none'})")
        problem = schema_problem(tool.validator, call.arguments)
        if problem:
            return refused(call, f"arguments of {call.name!r} do not match its schema: {problem}")
        try:
            output = await tool.fn(call.arguments)
        except ToolError as exc:
            return ToolCallRecord(call.name, _json(call.arguments), False, self.cut(exc.shown()))
        return ToolCallRecord(call.name, _json(call.arguments), True, self.cut(output))

    def cut(self, text: str) -> str:
        """`text` cut to `max_chars`, the cut marked."""
        if len(text) <= self.max_chars:
            return text
        return text[: self.max_chars] + f"\n[... {len(text) - self.max_chars} more characters cut]"


def refused(call: ToolCall | MalformedCall, problem: str) -> ToolCallRecord:
    """The record of a call that was not run (or failed): `output` is the error the model sees."""
    if isinstance(call, MalformedCall):
        return ToolCallRecord("", call.raw, False, f"error: {problem}")
    return ToolCallRecord(call.name, _json(call.arguments), False, f"error: {problem}")


def schema_problem(validator: jsonschema.protocols.Validator, arguments: Mapping[str, Any]) -> str:
    """The first way `arguments` fail the schema, in words ("" when they fit)."""
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is None:
        return ""
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


def bind(spec: ToolSpec, allowlist: FunctionAllowlist, sandbox: SandboxConfig) -> BoundTool:
    """The runnable form of a declaration."""
    schema = ToolSchema(spec.name, spec.resolved_description(), spec.resolved_parameters())
    if spec.kind == "builtin":
        return BoundTool.of(schema, builtin(spec.builtin, sandbox))
    return BoundTool.of(schema, user_tool(spec, allowlist))


def builtin(name: str, sandbox: SandboxConfig) -> ToolFn:
    """The function of a built-in tool."""
    if name == "calculator":
        return run_calculator
    if name == "python":
        return PythonTool(sandbox).run
    raise InvalidTool(f"no built-in tool {name!r}")


async def run_calculator(arguments: dict[str, Any]) -> str:
    """`calculator`: the value of `arguments["expression"]`."""
    try:
        return repr(calculate(arguments["expression"]))
    except CalculatorError as exc:
        raise ToolError(str(exc)) from None


@dataclass(frozen=True)
class PythonTool:
    """`python`: runs `arguments["code"]` in the sandbox; the answer is its stdout, then (on failure) its
    stderr's tail and the limit it hit. A sandbox that cannot be built raises `SandboxError` (a host
    fault: the step is ENV_ERROR)."""

    sandbox: SandboxConfig

    async def run(self, arguments: dict[str, Any]) -> str:
        limits = self.sandbox.to_limits()
        allow = self.sandbox.allow_unisolated
        result = await asyncio.to_thread(run_python, arguments["code"], "", limits, allow_unisolated=allow)
        if result.ok:
            return result.stdout
        hit = limit_exceeded(result, limits)
        status = hit or f"exit status {result.returncode}"
        return f"{result.stdout}{result.stderr[-2000:]}[{status}]"


def user_tool(spec: ToolSpec, allowlist: FunctionAllowlist) -> ToolFn:
    """A user function as a tool: called with the arguments as keywords; an exception it raises is shown
    to the model as an error."""
    assert spec.ref is not None
    try:
        fn = load_reference(spec.ref, allowlist)
    except InvalidReference as exc:
        raise InvalidTool(f"tool {spec.name!r}: {exc.reason}") from exc
    if not callable(fn):
        raise InvalidTool(f"tool {spec.name!r}: {spec.ref!r} is not callable")

    async def run(arguments: dict[str, Any]) -> str:
        try:
            if inspect.iscoroutinefunction(fn):
                value = await fn(**arguments)
            else:
                value = await asyncio.to_thread(fn, **arguments)
        except Exception as exc:
            raise ToolError(f"tool {spec.name!r} raised {type(exc).__name__}: {exc}") from exc
        return value if isinstance(value, str) else _json(value)

    return run


def _json(value: Any) -> str:
    """`value` as JSON text (anything JSON cannot write as its `str`)."""
    return json.dumps(value, ensure_ascii=False, default=str)
