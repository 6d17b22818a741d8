"""The in-process form of an environment: a class with `reset` and `step`, one instance per session.

    class Guess(Environment):
        def reset(self, task, *, seed=None):
            self.answer = task["answer"]
            return Observation([{"role": "user", "content": "Guess my number."}])

        def step(self, action):
            right = action.strip() == str(self.answer)
            return StepResult([{"role": "user", "content": "yes" if right else "no"}], done=right)

Subclassing `Environment` is optional: any class with these methods loads (`kind = "python"`,
`ref = "module:Class"` under the service's `allowed_functions`). Each method may be sync or async: a
sync one runs on a worker thread, an async one on the service's event loop (so it must not block).
`reset` may return an `Observation`, a list of messages, or a text (one user message); `step` returns a
`StepResult` (anything else is an environment error). A step's `reward` is optional: None is "no reward
here", never 0; the trajectory's final reward may come from a scorer instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any

from rlfabric.environment.types import Message, Observation, StepResult


class InvalidEnvironmentOutput(TypeError):
    """An environment answered something that is not what its method promises."""


class Environment:
    """Base class of in-process environments (see the module docstring)."""

    def reset(
        self, task: Mapping[str, Any], *, seed: int | None = None
    ) -> Observation | Awaitable[Observation]:
        """Starts an episode on `task` (the dataset row) and returns the first observation."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Applies the model's turn and returns what the environment answers."""
        raise NotImplementedError

    def close(self) -> Awaitable[None] | None:
        """Frees what the episode holds (called once, on Close or expiry)."""
        return None


def as_observation(value: Any) -> Observation:
    """What `reset` returned, as an `Observation`: an observation, a list of messages or a text."""
    if isinstance(value, Observation):
        return value
    if isinstance(value, str):
        return Observation([{"role": "user", "content": value}])
    if isinstance(value, list) and all(is_message(m) for m in value):
        return Observation([dict(m) for m in value])
    raise InvalidEnvironmentOutput(
        f"reset returned {type(value).__name__}: expected an Observation, a list of messages or a text"
    )


def as_step_result(value: Any) -> StepResult:
    """What `step` returned, checked: a `StepResult` whose messages are chat messages."""
    if not isinstance(value, StepResult):
        raise InvalidEnvironmentOutput(f"step returned {type(value).__name__}, not a StepResult")
    bad = [i for i, m in enumerate(value.messages) if not is_message(m)]
    if bad:
        raise InvalidEnvironmentOutput(f"step returned messages[{bad[0]}] without a string role and content")
    return value


def is_message(message: Any) -> bool:
    """True for {"role": str, "content": str, ...}."""
    return (
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def prompt_messages(prompt: Any) -> list[Message]:
    """A task's prompt column as messages: a text is one user message; a list of messages as is."""
    return as_observation(prompt).messages
