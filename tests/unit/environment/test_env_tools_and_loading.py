"""Tools (schema validation, unknown and malformed calls as messages, user tools under the allow-list),
the ToolEnvironment, in-process environment loading with its allow-list refusals, and the wire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfabric.contracts import wire
from rlfabric.environment.loading import InvalidEnvironment, environment_factory
from rlfabric.environment.spec import PythonEnvironmentSpec, ToolEnvironmentSpec, ToolSpec
from rlfabric.environment.tool_env import ToolEnvironment
from rlfabric.environment.types import Observation, ResetOutcome, StepOutcome, StepResult, ToolCallRecord
from rlfabric.runtime.errors import InvalidArgument
from rlfabric.runtime.schema import SandboxConfig
from rlfabric.runtime.user_code import FunctionAllowlist
from rlfabric.v1 import environment_pb2

USER_CODE = """
from rlfabric.environment.base import Environment
from rlfabric.environment.types import Observation, StepResult


def lookup(word: str) -> dict:
    if word == "boom":
        raise ValueError("no such word")
    return {"word": word, "length": len(word)}


class Echo(Environment):
    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def reset(self, task, *, seed=None):
        return task["prompt"]

    def step(self, action):
        return StepResult([{"role": "user", "content": self.prefix + action}], reward=1.0, done=True)


NOT_A_CLASS = 3
"""
LOOKUP_SCHEMA = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / "user_env.py").write_text(USER_CODE)
    return tmp_path


def tool_env(spec: ToolEnvironmentSpec, allowed: list[str] | None = None) -> ToolEnvironment:
    factory = environment_factory(spec, FunctionAllowlist.parse(allowed or []), SandboxConfig())
    env = factory()
    assert isinstance(env, ToolEnvironment)
    return env


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def test_tool_environment_answers_calls_and_ends_on_a_final_answer() -> None:
    env = tool_env(ToolEnvironmentSpec())
    first = env.reset({"prompt": "What is 6 * 7?"})
    assert first.messages == [{"role": "user", "content": "What is 6 * 7?"}]
    assert [t.name for t in first.tools] == ["calculator"]
    assert first.tools[0].parameters["required"] == ["expression"]
    step = await env.step("Let me see. " + call("calculator", expression="6 * 7"))
    assert (step.messages, step.done, step.reward) == ([{"role": "tool", "content": "42"}], False, None)
    assert step.info == {"tool_calls": "1", "tool_errors": "0"}
    final = await env.step("The answer is 42.")
    assert final.done and final.messages == [] and final.reward is None


async def test_bad_calls_become_tool_messages_and_are_counted() -> None:
    env = tool_env(ToolEnvironmentSpec(max_tool_calls=4))
    action = "".join(
        [
            "<tool_call>{oops}</tool_call>",
            call("search", q="x"),
            call("calculator", expr="1+1"),
            call("calculator", expression="os.system('id')"),
            call("calculator", expression="1+1"),
        ]
    )
    step = await env.step(action)
    contents = [m["content"] for m in step.messages]
    assert all(m["role"] == "tool" for m in step.messages)
    assert "not valid JSON" in contents[0]
    assert "unknown tool 'search' (available: calculator)" in contents[1]
    assert "do not match its schema" in contents[2] and "'expression' is a required property" in contents[2]
    assert "only numbers" in contents[3]
    assert "more than 4 tool calls" in contents[4]
    assert step.info == {"tool_calls": "5", "tool_errors": "5"}
    assert not step.done and [r.ok for r in step.tool_calls] == [False] * 5


async def test_user_tools_load_under_the_allow_list_and_their_errors_are_shown(user_dir: Path) -> None:
    lookup = ToolSpec(
        name="lookup", kind="python", ref=f"{user_dir}/user_env.py:lookup", parameters=LOOKUP_SCHEMA
    )
    spec = ToolEnvironmentSpec(tools=[lookup])
    env = tool_env(spec, [str(user_dir)])
    step = await env.step(call("lookup", word="cat") + call("lookup", word="boom") + call("lookup", word=3))
    assert json.loads(step.messages[0]["content"]) == {"word": "cat", "length": 3}
    assert "raised ValueError: no such word" in step.messages[1]["content"]
    assert "word: 3 is not of type 'string'" in step.messages[2]["content"]
    with pytest.raises(InvalidEnvironment, match="is not in allowed_functions"):
        tool_env(spec, [])


def test_tool_specs_are_checked_when_declared() -> None:
    with pytest.raises(ValidationError, match="needs ref"):
        ToolSpec(name="f", kind="python")
    with pytest.raises(ValidationError, match="no built-in tool 'shell'"):
        ToolSpec(name="shell")
    with pytest.raises(ValidationError, match="not a valid JSON schema"):
        ToolSpec(name="f", kind="python", ref="m:f", parameters={"type": "object", "properties": 3})
    with pytest.raises(ValidationError, match='"type": "object"'):
        ToolSpec(name="f", kind="python", ref="m:f", parameters={"type": "string"})
    with pytest.raises(ValidationError, match="unique"):
        ToolEnvironmentSpec(tools=[ToolSpec(name="calculator"), ToolSpec(name="calculator")])
    with pytest.raises(ValidationError, match="unknown tool parser"):
        ToolEnvironmentSpec(tool_parser="nope")


def test_user_environments_load_by_file_or_module_only_where_allowed(
    user_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    allowed = FunctionAllowlist.parse([str(user_dir)])
    spec = PythonEnvironmentSpec(kind="python", ref=f"{user_dir}/user_env.py:Echo", kwargs={"prefix": "> "})
    env = environment_factory(spec, allowed, SandboxConfig())()
    assert env.reset({"prompt": "hi"}) == "hi"
    assert env.step("x").messages == [{"role": "user", "content": "> x"}]
    monkeypatch.syspath_prepend(str(user_dir))
    by_module = PythonEnvironmentSpec(kind="python", ref="user_env:Echo")
    environment_factory(by_module, FunctionAllowlist.parse(["user_env"]), SandboxConfig())
    refusals = [
        (by_module, FunctionAllowlist.parse(["other"]), "'user_env:Echo' is not in allowed_functions"),
        (spec, FunctionAllowlist(), "is not in allowed_functions"),
        (
            PythonEnvironmentSpec(kind="python", ref="user_env:NOT_A_CLASS"),
            FunctionAllowlist.parse(["user_env"]),
            "is defined in None",
        ),
        (
            PythonEnvironmentSpec(kind="python", ref="user_env:_private"),
            FunctionAllowlist.parse(["user_env"]),
            "private",
        ),
        (
            PythonEnvironmentSpec(kind="python", ref="user_env:lookup"),
            FunctionAllowlist.parse(["user_env"]),
            "lacks",
        ),
    ]
    for refused, allowlist, reason in refusals:
        with pytest.raises(InvalidEnvironment, match=reason.replace("(", r"\(")):
            environment_factory(refused, allowlist, SandboxConfig())


def test_a_refused_module_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "side_effect_env.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(InvalidEnvironment):
        environment_factory(
            PythonEnvironmentSpec(kind="python", ref="side_effect_env:Env"),
            FunctionAllowlist(),
            SandboxConfig(),
        )
    assert not (tmp_path / "ran").exists()


def test_reset_and_step_round_trip_the_wire_and_an_unset_reward_stays_none() -> None:
    schema = ToolSpec(name="calculator")
    observation = Observation(
        [{"role": "user", "content": "q"}], tool_env(ToolEnvironmentSpec(tools=[schema])).toolbox.schemas()
    )
    reset = ResetOutcome("ok", "s1", observation)
    assert wire.reset_outcome_from_proto(wire.reset_reply(reset)) == reset
    record = ToolCallRecord("calculator", '{"expression": "1"}', True, "1")
    for reward in (None, 0.0, 0.5):
        outcome = StepOutcome(
            "ok", StepResult([{"role": "tool", "content": "1"}], reward, False, {"k": "v"}, [record])
        )
        assert wire.step_outcome_from_proto(wire.step_reply(outcome)) == outcome
    failed = StepOutcome.failed("timeout", "slow")
    assert wire.step_outcome_from_proto(wire.step_reply(failed)) == failed
    assert wire.env_status_from_proto(environment_pb2.ENV_STATUS_UNSPECIFIED) == "env_error"
    assert set(wire.ENV_STATUS_NAMES) == {
        v for n, v in environment_pb2.EnvStatus.items() if not n.endswith("UNSPECIFIED")
    }


def test_tasks_come_as_json_or_struct_and_anything_else_is_invalid() -> None:
    task = {"prompt": "p", "answer": 3}
    assert wire.task_from_proto(wire.reset_request(task, seed=1)) == task
    assert wire.task_from_proto(environment_pb2.ResetRequest(task_struct=wire.struct_to_proto(task))) == {
        "prompt": "p",
        "answer": 3.0,
    }
    assert wire.task_from_proto(environment_pb2.ResetRequest()) == {}
    for bad, reason in (("[1]", "expected a JSON object"), ("{x", "not valid JSON")):
        with pytest.raises(InvalidArgument, match=f"task_json: {reason}"):
            wire.task_from_proto(environment_pb2.ResetRequest(task_json=bad))
