"""The plain data an environment and its callers exchange: observations, step results, tool calls.

No grpc and no environment code here: `contracts.wire` converts these to and from the proto messages,
and the client hands them to whoever drives a trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Message = dict[str, str]
"""One chat message: {"role": "system" | "user" | "assistant" | "tool", "content": ...}."""

EnvStatus = Literal["ok", "env_error", "timeout", "truncated"]
"""How an environment call ended; anything but "ok" and "truncated" means the episode failed."""
ENV_STATUSES: tuple[EnvStatus, ...] = ("ok", "env_error", "timeout", "truncated")


@dataclass(frozen=True)
class ToolSchema:
    """A function the model may call: what a chat template's `tools` argument holds for it."""

    name: str
    description: str
    parameters: dict[str, Any]
    """The JSON schema of the arguments object."""

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI/Hugging Face form: {"type": "function", "function": {name, description, parameters}}."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Observation:
    """What an environment shows at reset: the first messages and the tools the model may call."""

    messages: list[Message]
    tools: list[ToolSchema] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call found in an action and its outcome. `output` is what the model sees: the tool's
    answer when `ok`, else the problem in words (bad JSON, unknown tool, arguments off the schema, the
    tool raised)."""

    name: str
    arguments: str
    """The arguments as JSON text, or the call's raw text when it could not be parsed."""
    ok: bool
    output: str


@dataclass(frozen=True)
class StepResult:
    """What an environment's `step` returns.

    `reward` None means the step gives no reward (never read it as 0); `truncated` says the environment's
    own limit ended the episode (then `done` is true as well)."""

    messages: list[Message]
    reward: float | None = None
    done: bool = False
    info: dict[str, str] = field(default_factory=dict)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    truncated: bool = False


@dataclass(frozen=True)
class StepOutcome:
    """A step as the service answers it: the environment's result, or the status that replaced it.

    Invariant: `status` "env_error" or "timeout" comes with `done`, no messages and no reward."""

    status: EnvStatus
    result: StepResult
    message: str = ""

    @classmethod
    def failed(cls, status: EnvStatus, message: str) -> StepOutcome:
        """An outcome for an environment that raised or timed out: the episode is over."""
        return cls(status, StepResult(messages=[], done=True), message)


@dataclass(frozen=True)
class ResetOutcome:
    """A reset as the service answers it: a session and its first observation, or why none opened."""

    status: EnvStatus
    session_id: str = ""
    observation: Observation = field(default_factory=lambda: Observation([]))
    message: str = ""
