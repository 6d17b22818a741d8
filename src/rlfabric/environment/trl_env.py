"""Environments written for TRL's `GRPOTrainer(environment_factory=...)`, run unchanged (`kind = "trl"`).

`TrlEnvironment` drives such an environment the way TRL 1.16 does (trl/trainer/grpo_trainer.py):

1. the factory is a class or a zero-argument callable. TRL makes one instance per concurrent rollout and
   reuses it across batches through `reset`; here every session gets its own instance, and the one made
   at load (to check the class, as TRL probes one) serves the first session, as TRL's probe seeds its pool;
2. the tools are the class's public functions (`inspect.getmembers(type(env), inspect.isfunction)`, less
   `reset`, `get_reward` and names starting with "_"), bound to the instance; the model is shown the
   schema `transformers.utils.get_json_schema` makes of each (type hints and Google docstring);
3. `reset(**row)` gets every column of the task as a keyword argument; a text it returns is appended to
   the content of the prompt's last message (no separator), None leaves the prompt as it is; a task
   without the prompt column starts from one empty user message;
4. each tool call is answered by a {"role": "tool", "name": ..., "content": ...} message: `str(result)`,
   or `str({"error": str(exc)})` for a tool that raised;
5. a turn without a tool call ends the episode, and `get_reward()` (sync or async), when the class
   defines it, is then called once: its value is that step's reward (None without one: the run's scorer
   decides).

Where rlfabric differs, on purpose: the calls are found by `tool_parser` and checked like every rlfabric
tool call (`tools.ToolBox`): a malformed call, an unknown tool, arguments off the schema and calls past
`max_tool_calls` are answered "error: ..." without running (TRL calls the method and reports its
TypeError), and answers are cut to `max_output_chars`. Sync methods run on a worker thread. `seed` is
not passed to `reset` (TRL has none). The schema's "return" entry is not sent: `ToolSchema` carries the
name, description and parameters. `close` drops the instance without calling the user's `close` (TRL
never closes an environment; a public `close` method is a tool).
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlfabric.environment.base import Environment, InvalidEnvironmentOutput, prompt_messages
from rlfabric.environment.spec import TrlEnvironmentSpec
from rlfabric.environment.tools import BoundTool, ToolBox, ToolFn, WordedToolError
from rlfabric.environment.types import Message, Observation, StepResult, ToolSchema

NOT_TOOLS = ("reset", "get_reward")
"""The public methods TRL does not expose as tools."""
EMPTY_PROMPT: list[Message] = [{"role": "user", "content": ""}]
"""The prompt of a task without the prompt column (TRL's default when an environment owns the data)."""


class NotTrlEnvironment(ValueError):
    """A factory TRL would refuse (not callable, no `reset`) or whose tools have no schema."""


@dataclass(frozen=True)
class TrlClass:
    """What the adapter needs of one environment class: its tools (by name, as TRL lists them) and
    whether it owns the reward (`get_reward`)."""

    tools: tuple[ToolSchema, ...]
    rewarded: bool


_CLASSES: dict[type, TrlClass] = {}
"""Each environment class met, described once."""


def describe(env: Any) -> TrlClass:
    """The tools and reward of `env`'s class; `NotTrlEnvironment` when TRL would not accept it."""
    cls = type(env)
    if cls not in _CLASSES:
        members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))
        if "reset" not in members:
            raise NotTrlEnvironment(f"{cls.__qualname__} defines no `reset` method (TRL requires one)")
        names = [n for n in members if n not in NOT_TOOLS and not n.startswith("_")]
        tools = tuple(tool_schema(getattr(env, name)) for name in names)
        _CLASSES[cls] = TrlClass(tools, "get_reward" in members)
    return _CLASSES[cls]


def tool_schema(method: Callable[..., Any]) -> ToolSchema:
    """The schema transformers (hence TRL's chat template) makes of `method`."""
    try:
        from transformers.utils import get_json_schema
        from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException
    except ImportError as exc:
        raise NotTrlEnvironment("kind 'trl' needs transformers (rlfabric[cpu] or rlfabric[gpu])") from exc
    try:
        function = get_json_schema(method)["function"]
    except (DocstringParsingException, TypeHintParsingException, NameError) as exc:
        raise NotTrlEnvironment(f"tool {method.__qualname__}: {exc}") from exc
    return ToolSchema(function["name"], function.get("description") or "", function["parameters"])


@dataclass
class TrlFactory:
    """The user's factory and the instance made at load, which the first session takes."""

    make: Callable[[], Any]
    spare: list[Any] = field(default_factory=list)

    @classmethod
    def probe(cls, make: Any, ref: str) -> TrlFactory:
        """Calls the factory once and checks what it makes (`NotTrlEnvironment` otherwise)."""
        if not callable(make):
            raise NotTrlEnvironment(f"{ref!r} is not callable (a class or a zero-argument function)")
        try:
            env = make()
        except Exception as exc:
            raise NotTrlEnvironment(f"{ref}() raised {type(exc).__name__}: {exc}") from exc
        describe(env)
        return cls(make, [env])

    async def instance(self) -> Any:
        """The spare instance, else a new one (made on a worker thread)."""
        if self.spare:
            return self.spare.pop()
        return await asyncio.to_thread(self.make)


class TrlEnvironment(Environment):
    """One session: one instance of the user's environment, driven as GRPOTrainer drives it."""

    def __init__(self, spec: TrlEnvironmentSpec, factory: TrlFactory) -> None:
        self.spec = spec
        self.factory = factory
        self.env: Any = None
        self.toolbox = ToolBox([], spec.tool_parser)
        self.rewarded = False

    async def reset(self, task: Mapping[str, Any], *, seed: int | None = None) -> Observation:
        """A fresh instance reset on the task's columns: the prompt with `reset`'s text and its tools."""
        self.env = await self.factory.instance()
        described = describe(self.env)
        self.toolbox = self._toolbox(described.tools)
        self.rewarded = described.rewarded
        text = await call_user(self.env.reset, **task)
        prompt = task.get(self.spec.prompt_field, EMPTY_PROMPT)
        return Observation(with_reset_text(prompt_messages(prompt), text), self.toolbox.schemas())

    async def step(self, action: str) -> StepResult:
        """Runs the turn's tool calls; a turn without one ends the episode with `get_reward()`."""
        _, records = await self.toolbox.run(action)
        info = {"tool_calls": str(len(records)), "tool_errors": str(sum(not r.ok for r in records))}
        if not records:
            return StepResult([], reward=await self.reward(), done=True, info=info)
        messages = [{"role": "tool", "name": r.name, "content": r.output} for r in records]
        return StepResult(messages, info=info, tool_calls=records)

    def close(self) -> None:
        """Drops the instance (the user's own `close`, if any, is a tool and is not called)."""
        self.env = None

    async def reward(self) -> float | None:
        """`get_reward()` when the class defines it, else None."""
        if not self.rewarded:
            return None
        return as_reward(await call_user(self.env.get_reward))

    def _toolbox(self, schemas: tuple[ToolSchema, ...]) -> ToolBox:
        tools = [BoundTool.of(schema, method_tool(getattr(self.env, schema.name))) for schema in schemas]
        spec = self.spec
        return ToolBox(
            tools, spec.tool_parser, max_calls=spec.max_tool_calls, max_chars=spec.max_output_chars
        )


def method_tool(method: Callable[..., Any]) -> ToolFn:
    """An environment method as a tool: answered `str(result)`, or TRL's `str({"error": str(exc)})`."""

    async def run(arguments: dict[str, Any]) -> str:
        try:
            result = await call_user(method, **arguments)
        except Exception as exc:
            raise WordedToolError(str({"error": str(exc)})) from exc
        return str(result)

    return run


async def call_user(fn: Callable[..., Any], /, **kwargs: Any) -> Any:
    """`fn(**kwargs)`: awaited when it is a coroutine function, else run on a worker thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(**kwargs)
    return await asyncio.to_thread(fn, **kwargs)


def with_reset_text(prompt: list[Message], text: Any) -> list[Message]:
    """The prompt with `reset`'s text appended to its last message's content (None: unchanged)."""
    if text is None:
        return prompt
    if not isinstance(text, str):
        raise InvalidEnvironmentOutput(f"reset returned {type(text).__name__}: expected a text or None")
    if not prompt:
        raise InvalidEnvironmentOutput("the prompt holds no message to append reset's text to")
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + text}]


def as_reward(value: Any) -> float | None:
    """What `get_reward` returned, as a reward: a number, or None ("no reward here")."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real):
        raise InvalidEnvironmentOutput(f"get_reward returned {type(value).__name__}, not a number")
    return float(value)
