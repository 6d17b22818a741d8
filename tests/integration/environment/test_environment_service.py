"""The environment service as users run it: `rlfabric serve environment` as a real process, called with
the async client over gRPC on an ephemeral port.

One process runs a user environment loaded from an allowed file (sessions, NOT_FOUND naming the session,
a step past the deadline answered TIMEOUT, the token required); another runs the built-in
ToolEnvironment with the calculator and the sandboxed `python` tool.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rlfabric.environment.client import AsyncEnvironmentClient, EnvironmentServiceError
from rlfabric.local.procs import ServiceProcess
from rlfabric.runtime.sandbox import probe_isolation

TOKEN = "environment-suite-token"
USER_ENV = '''
import time

from rlfabric.environment.base import Environment
from rlfabric.environment.types import Observation, StepResult


class Countdown(Environment):
    """Counts the model's turns down from the task's `n`; "sleep" blocks past the step deadline."""

    def reset(self, task, *, seed=None):
        self.left = int(task["n"])
        return Observation([{"role": "user", "content": f"say anything {self.left} times"}])

    def step(self, action):
        if action == "sleep":
            time.sleep(3)
        self.left -= 1
        done = self.left == 0
        message = {"role": "user", "content": f"{self.left} left"}
        return StepResult([message], reward=1.0 if done else None, done=done)
'''


def serve(name: str, tmp: Path, *settings: str) -> Iterator[str]:
    """A `serve environment` process holding TOKEN; yields its address and stops it after."""
    argv = [sys.executable, "-m", "rlfabric.cli", "serve", "environment", "--port", "0"]
    argv += [arg for setting in settings for arg in ("--set", setting)]
    env = {**os.environ, "RLFABRIC_ENVIRONMENT__TOKEN": TOKEN}
    proc = ServiceProcess(name, argv, log_path=tmp / f"{name}.log", env=env)
    yield proc.start(r"listening on (\S+)", timeout_s=60).group(1)
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def countdown(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("env")
    (folder / "countdown.py").write_text(USER_ENV)
    environment = json.dumps({"kind": "python", "ref": f"{folder}/countdown.py:Countdown"})
    yield from serve(
        "countdown", folder, f"environment={environment}", f"allowed_functions={json.dumps([str(folder)])}",
        "step_timeout_s=0.5", "log.format=text",
    )  # fmt: skip


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("tools")
    environment = {"kind": "tools", "tools": [{"name": "calculator"}, {"name": "python"}]}
    yield from serve("tools", folder, f"environment={json.dumps(environment)}", "log.format=text")


async def test_reset_step_close_with_rewards_only_where_given(countdown: str) -> None:
    async with AsyncEnvironmentClient(countdown, token=TOKEN) as client:
        reset = await client.reset({"n": 2})
        assert reset.status == "ok" and reset.observation.messages[0]["content"] == "say anything 2 times"
        assert reset.observation.tools == []
        first = await client.step(reset.session_id, "hello")
        assert (first.status, first.result.done, first.result.reward) == ("ok", False, None)
        last = await client.step(reset.session_id, "hello")
        assert (last.status, last.result.done, last.result.reward) == ("ok", True, 1.0)
        with pytest.raises(EnvironmentServiceError) as done:
            await client.step(reset.session_id, "again")
        assert done.value.code == grpc.StatusCode.FAILED_PRECONDITION
        await client.close(reset.session_id)
        with pytest.raises(EnvironmentServiceError) as gone:
            await client.step(reset.session_id, "x")
        assert gone.value.code == grpc.StatusCode.NOT_FOUND and reset.session_id in gone.value.details


async def test_unknown_sessions_bad_tasks_and_faults(countdown: str) -> None:
    async with AsyncEnvironmentClient(countdown, token=TOKEN) as client:
        with pytest.raises(EnvironmentServiceError) as unknown:
            await client.close("no-such-session")
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND
        assert "session_id: no session 'no-such-session'" in unknown.value.details
        failed = await client.reset({"m": 1})
        assert (failed.status, failed.session_id) == ("env_error", "")
        assert "KeyError" in failed.message


async def test_a_step_past_the_deadline_is_a_timeout_status(countdown: str) -> None:
    async with AsyncEnvironmentClient(countdown, token=TOKEN) as client:
        session_id = (await client.reset({"n": 5})).session_id
        outcome = await client.step(session_id, "sleep")
        assert (outcome.status, outcome.result.done, outcome.result.reward) == ("timeout", True, None)
        assert "step_timeout_s" in outcome.message
        await client.close(session_id)


async def test_calls_without_the_token_are_unauthenticated(countdown: str) -> None:
    for token in (None, "wrong"):
        async with AsyncEnvironmentClient(countdown, token=token) as client:
            with pytest.raises(EnvironmentServiceError) as refused:
                await client.reset({"n": 1})
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_the_tool_environment_runs_the_calculator_and_sandboxed_python(tools: str) -> None:
    async with AsyncEnvironmentClient(tools, token=TOKEN) as client:
        reset = await client.reset({"prompt": "What is 6 * 7?"})
        assert [t.name for t in reset.observation.tools] == ["calculator", "python"]
        calls = [
            {"name": "calculator", "arguments": {"expression": "6 * 7"}},
            {"name": "calculator", "arguments": {"expression": "__import__('os')"}},
        ]
        if probe_isolation().mode != "none":
            calls.append({"name": "python", "arguments": {"code": "print(sum(range(10)))"}})
        action = "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls) + "<tool_call>{bad"
        step = await client.step(reset.session_id, action)
        contents = [m["content"] for m in step.result.messages]
        assert contents[0] == "42" and contents[1].startswith("error: only numbers")
        assert contents[-1].startswith("error: <tool_call> is not closed")
        if len(calls) == 3:
            assert contents[2] == "45\n"
        assert [c.ok for c in step.result.tool_calls] == [True, False, *([True] * (len(calls) - 2)), False]
        assert step.result.info["tool_errors"] == "2" and not step.result.done
        final = await client.step(reset.session_id, "It is 42.")
        assert final.result.done and final.result.reward is None
        await client.close(reset.session_id)
