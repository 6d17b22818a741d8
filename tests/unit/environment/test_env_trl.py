"""Environments written for TRL's `environment_factory` (`kind = "trl"`), in process: the example class
examples/trl_key_value_env.py loaded under the allow-list and run through a `SessionTable` (reset text
appended, tools with transformers' schemas, tool errors worded as TRL words them, `get_reward` as the
final reward), factories TRL would refuse, and the documented TOML."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rlfabric.environment.config import EnvironmentServiceConfig
from rlfabric.environment.loading import InvalidEnvironment, environment_factory
from rlfabric.environment.run_spec import RunEnvironmentSpec
from rlfabric.environment.sessions import SessionLimits, SessionTable
from rlfabric.environment.spec import TrlEnvironmentSpec
from rlfabric.environment.trl_env import TrlEnvironment
from rlfabric.runtime.schema import SandboxConfig
from rlfabric.runtime.user_code import FunctionAllowlist

transformers_utils = pytest.importorskip("transformers.utils")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "trl_key_value_env.py"
ALLOWED = [str(EXAMPLE.parent)]
FACTS = {"color": "blue", "city": "Oslo", "code": "7"}
TASK = {"prompt": [{"role": "user", "content": "What is the city?"}], "facts": FACTS, "key": "city"}
OTHER_ENVS = '''
class NoReward:
    def reset(self, **kwargs):
        return None

    def echo(self, text: str) -> str:
        """Echoes a text.

        Args:
            text: What to echo.
        """
        return text


class AsyncReward(NoReward):
    async def get_reward(self):
        return 0.25


class TextReward(NoReward):
    def get_reward(self):
        return "high"


class NoReset:
    def lookup(self, key: str) -> str:
        """Looks up.

        Args:
            key: The key.
        """
        return key


class Undocumented:
    def reset(self, **kwargs):
        return None

    def lookup(self, key: str) -> str:
        return key


AN_INSTANCE = NoReward()  # an environment, not a factory of them
'''


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def spec(ref: str, **fields: Any) -> TrlEnvironmentSpec:
    return TrlEnvironmentSpec(kind="trl", ref=ref, **fields)


def sessions(ref: str, allowed: list[str] = ALLOWED, **fields: Any) -> SessionTable:
    factory = environment_factory(spec(ref, **fields), FunctionAllowlist.parse(allowed), SandboxConfig())
    return SessionTable(factory, SessionLimits(step_timeout_s=5.0))


@pytest.fixture
def others(tmp_path: Path) -> str:
    (tmp_path / "other_envs.py").write_text(OTHER_ENVS)
    return str(tmp_path)


def example_class() -> type:
    from rlfabric.runtime.user_code import load_reference

    cls = load_reference(f"{EXAMPLE}:KeyValueEnv", FunctionAllowlist.parse(ALLOWED))
    assert isinstance(cls, type)
    return cls


async def test_reset_appends_its_text_and_shows_the_public_methods_with_transformers_schemas() -> None:
    table = sessions(f"{EXAMPLE}:KeyValueEnv")
    reset = await table.reset(TASK)
    assert reset.status == "ok", reset.message
    assert reset.observation.messages == [
        {"role": "user", "content": "What is the city?\nKeys you may look up: city, code, color."}
    ]
    env = example_class()()
    expected = []
    for name in ("answer", "count", "lookup"):  # not reset, get_reward, _log, nor the property
        schema = transformers_utils.get_json_schema(getattr(env, name))
        schema["function"].pop("return", None)
        expected.append(schema)
    assert [tool.as_openai() for tool in reset.observation.tools] == expected


async def test_prompts_as_text_none_from_reset_and_a_task_without_a_prompt() -> None:
    table = sessions(f"{EXAMPLE}:make_env")  # the zero-argument factory
    text = await table.reset({"prompt": "Which city?", "facts": {"a": "1"}})
    assert text.observation.messages == [{"role": "user", "content": "Which city?\nKeys you may look up: a."}]
    unchanged = await table.reset(
        {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
    )
    assert [m["content"] for m in unchanged.observation.messages] == ["s", "q"]
    no_prompt = await table.reset({"facts": {"b": "2"}})
    assert no_prompt.observation.messages == [{"role": "user", "content": "\nKeys you may look up: b."}]


async def test_tool_calls_run_and_errors_are_tool_messages_worded_as_trl_words_them() -> None:
    table = sessions(f"{EXAMPLE}:KeyValueEnv", max_tool_calls=6)
    session_id = (await table.reset(TASK)).session_id
    action = "Let me look. " + "".join(
        [
            call("lookup", key="city"),
            call("count", prefix="c", limit=1),
            call("lookup", key="planet"),
            call("lookup", key="city", word="x"),
            call("lookup", word="city"),
            call("_log", text="x"),
            call("answer", value="Oslo"),
        ]
    )
    step = await table.step(session_id, action)
    assert step.status == "ok" and not step.result.done and step.result.reward is None
    names = [m["name"] for m in step.result.messages]
    contents = [m["content"] for m in step.result.messages]
    assert names == ["lookup", "count", "lookup", "lookup", "lookup", "_log", "answer"]
    # what TRL's tool loop answers: str(result), or str({"error": str(exc)}) for a method that raised
    assert contents[:4] == [
        "Oslo",
        "1",
        "{'error': \"no key 'planet'\"}",
        "{'error': \"KeyValueEnv.lookup() got an unexpected keyword argument 'word'\"}",
    ]
    # rlfabric's checks, before anything runs
    assert contents[4].startswith("error: arguments of 'lookup' do not match its schema")
    assert contents[5] == "error: unknown tool '_log' (available: answer, count, lookup)"
    assert contents[6].startswith("error: more than 6 tool calls")
    assert [r.ok for r in step.result.tool_calls] == [True, True] + [False] * 5
    assert step.result.info == {"tool_calls": "7", "tool_errors": "5"}


async def test_a_turn_without_a_call_ends_with_get_reward() -> None:
    table = sessions(f"{EXAMPLE}:KeyValueEnv")
    right, wrong = (await table.reset(TASK)).session_id, (await table.reset(TASK)).session_id
    answered = await table.step(right, call("answer", value="Oslo"))
    assert answered.result.messages[0]["content"] == "{'recorded': 'Oslo'}"
    final = await table.step(right, "It is Oslo.")
    assert (final.status, final.result.done, final.result.reward) == ("ok", True, 1.0)
    assert final.result.messages == [] and final.result.info == {"tool_calls": "0", "tool_errors": "0"}
    # each session has its own instance: the other session's answer is not in this one
    unanswered = await table.step(wrong, "No idea.")
    assert (unanswered.result.done, unanswered.result.reward) == (True, 0.0)


async def test_rewards_absent_async_or_not_a_number(others: str) -> None:
    for name, status, reward in (
        ("NoReward", "ok", None),
        ("AsyncReward", "ok", 0.25),
        ("TextReward", "env_error", None),
    ):
        table = sessions(f"{others}/other_envs.py:{name}", [others])
        reset = await table.reset({"prompt": "hi"})
        assert reset.observation.messages == [{"role": "user", "content": "hi"}]
        assert [t.name for t in reset.observation.tools] == ["echo"]
        final = await table.step(reset.session_id, "done")
        assert (final.status, final.result.reward) == (status, reward)
        assert final.result.done
    assert "get_reward returned str, not a number" in final.message


async def test_each_session_has_its_own_instance_the_first_one_made_at_load() -> None:
    factory = environment_factory(
        spec(f"{EXAMPLE}:KeyValueEnv"), FunctionAllowlist.parse(ALLOWED), SandboxConfig()
    )
    first, second = factory(), factory()
    assert isinstance(first, TrlEnvironment) and isinstance(second, TrlEnvironment)
    [probe] = first.factory.spare
    await first.reset(TASK)
    await second.reset(TASK)
    assert first.env is probe and type(second.env) is type(probe) and second.env is not probe
    assert first.factory.spare == []
    first.close()
    assert first.env is None


def test_refs_outside_the_allow_list_or_that_trl_would_refuse(others: str) -> None:
    refusals = [
        (f"{EXAMPLE}:KeyValueEnv", [], "is not in allowed_functions"),
        (f"{EXAMPLE}:KeyValueEnv", [others], "is not in allowed_functions"),
        (
            "trl_key_value_env:KeyValueEnv",
            ["other_module"],
            "'trl_key_value_env:KeyValueEnv' is not in allowed",
        ),
        (f"{others}/other_envs.py:NoReset", [others], "NoReset defines no `reset` method"),
        (f"{others}/other_envs.py:Undocumented", [others], "tool Undocumented.lookup: .*no docstring"),
        (f"{others}/other_envs.py:AN_INSTANCE", [others], "AN_INSTANCE' is not callable"),
    ]
    for ref, allowed, reason in refusals:
        with pytest.raises(InvalidEnvironment, match=f"environment.ref: .*{reason}"):
            environment_factory(spec(ref), FunctionAllowlist.parse(allowed), SandboxConfig())


def test_the_spec_and_the_documented_toml() -> None:
    doc = (ROOT / "docs" / "environment.md").read_text()
    start = doc.index("## Environments written for TRL")
    section = doc[start : doc.find("\n## ", start + 1) % (len(doc) + 1)]
    service_toml, run_toml = re.findall(r"```toml\n(.*?)```", section, flags=re.DOTALL)
    config = EnvironmentServiceConfig.model_validate(tomllib.loads(service_toml))
    assert config.environment == spec("examples/trl_key_value_env.py:KeyValueEnv")
    run = RunEnvironmentSpec.model_validate(tomllib.loads(run_toml)["environment"])
    assert run.service == config.environment and run.max_turns == 6
    with pytest.raises(ValidationError, match="unknown tool parser"):
        spec("m:f", tool_parser="nope")
    with pytest.raises(ValidationError, match="ref"):
        EnvironmentServiceConfig.model_validate({"environment": {"kind": "trl"}})
