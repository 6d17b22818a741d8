"""`ToolEnvironment`: the built-in environment of tool-using tasks.

Reset shows the task's prompt (`prompt_field`) and the declared tools. Each step runs the tool calls of
the model's turn and answers with one "tool" message per call (a malformed call's message names the
problem); a turn without a tool call is the model's final answer and ends the episode. This environment
gives no reward: the trajectory driver scores the final answer with the run's scorer (the reward
service), as for single-turn tasks. Each step's `info` counts `tool_calls` and `tool_errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlfabric.environment.base import Environment, prompt_messages
from rlfabric.environment.spec import ToolEnvironmentSpec
from rlfabric.environment.tools import ToolBox
from rlfabric.environment.types import Observation, StepResult


class ToolEnvironment(Environment):
    """One session's episode over a shared `ToolBox`."""

    def __init__(self, spec: ToolEnvironmentSpec, toolbox: ToolBox) -> None:
        self.spec = spec
        self.toolbox = toolbox

    def reset(self, task: Mapping[str, Any], *, seed: int | None = None) -> Observation:
        """The task's prompt and the tools; a task without the prompt column is a KeyError (ENV_ERROR)."""
        if self.spec.prompt_field not in task:
            raise KeyError(f"the task has no {self.spec.prompt_field!r} column (prompt_field)")
        return Observation(prompt_messages(task[self.spec.prompt_field]), self.toolbox.schemas())

    async def step(self, action: str) -> StepResult:
        """Runs the turn's tool calls; no call means the final answer (done)."""
        _, records = await self.toolbox.run(action)
        if not records:
            return StepResult([], done=True, info={"tool_calls": "0", "tool_errors": "0"})
        messages = [{"role": "tool", "content": record.output} for record in records]
        errors = sum(not record.ok for record in records)
        info = {"tool_calls": str(len(records)), "tool_errors": str(errors)}
        return StepResult(messages, info=info, tool_calls=records)
