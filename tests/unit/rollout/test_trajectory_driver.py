"""The multi-turn trajectory driver on the trained BPE tokenizer, a scripted engine and the real
`SessionTable` + `ToolEnvironment` (calculator): token-in/token-out ids, loss masks, turns, statuses.

The scripted engine "samples" given texts; one script samples a non-canonical split (`}` then `\\n`)
that re-tokenizing the conversation would merge, to prove the trajectory keeps what was sampled.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlfabric.environment.sessions import SessionLimits, SessionTable
from rlfabric.environment.spec import ToolEnvironmentSpec
from rlfabric.environment.tool_env import ToolEnvironment
from rlfabric.environment.tools import ToolBox
from rlfabric.environment.types import StepResult
from rlfabric.rollout.chat_template import IncrementalRenderer
from rlfabric.rollout.trajectory import TrajectoryDriver, TrajectoryLimits
from rlfabric.rollout.types import EngineSample, SamplingSettings
from rlfabric.runtime.schema import SandboxConfig
from rlfabric.runtime.user_code import FunctionAllowlist
from rlfabric.tools.bpe_tokenizer import build_bpe_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
SAMPLING = SamplingSettings(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64)
TASK = {"prompt": "What is 6 * 7?"}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_bpe_tokenizer()


class ScriptedEngine:
    """Samples the scripted turns in order: each a list of token ids, ending on `<|im_end|>` ("stop")
    unless cut by the budget ("length"). Records each prompt it was given."""

    def __init__(self, tokenizer: Any, turns: list[list[int]]) -> None:
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    async def __call__(self, request_id: str, prompt: list[int], sampling: SamplingSettings) -> EngineSample:
        self.prompts.append(list(prompt))
        ids = self.turns.pop(0)
        cut = ids[: sampling.max_tokens]
        reason = "length" if len(cut) < len(ids) else "stop"
        return EngineSample(
            0, 0, list(prompt), cut, [-0.5] * len(cut), "", reason, 0.01, 0.02, len(prompt) // 2
        )


def turn_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text + "<|im_end|>", add_special_tokens=False))


def sessions(environment: Any = None) -> SessionTable:
    spec = ToolEnvironmentSpec()
    toolbox = ToolBox.build(spec.tools, FunctionAllowlist(), SandboxConfig(), parser="hermes")
    factory = environment or (lambda: ToolEnvironment(spec, toolbox))
    return SessionTable(factory, SessionLimits())


def driver(engine: ScriptedEngine, tokenizer: Any, env: Any = None, **limits: int) -> TrajectoryDriver:
    values = {"max_turns": 4, "max_total_tokens": 4096, "max_model_len": 4096, **limits}
    return TrajectoryDriver(engine, env or sessions(), tokenizer, TrajectoryLimits(**values))


async def test_tool_call_then_answer_keeps_every_sampled_token(tokenizer: Any) -> None:
    call = turn_ids(tokenizer, CALL)
    answer = turn_ids(tokenizer, "The answer is 42.")
    engine = ScriptedEngine(tokenizer, [call, answer])
    t = await driver(engine, tokenizer).play("r", TASK, SAMPLING)

    assert t.status == "done" and t.final_text == "The answer is 42."
    assert [turn.role for turn in t.turns] == ["model", "tool", "model"]
    assert t.tool_calls == 1 and t.tool_errors == 0
    sampled = [tok for tok, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    assert sampled == call + answer  # only the engine's tokens carry mask 1, exactly as sampled
    assert len(t.logprobs) == len(t.token_ids) and all(
        (lp == -0.5) == bool(m) for lp, m in zip(t.logprobs, t.loss_mask, strict=True)
    )
    tool_turn = t.token_ids[t.turns[1].start : t.turns[2].start]
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(tool_turn)
    assert tokenizer.decode(tool_turn).endswith("<|im_start|>assistant\n")
    # each turn's prompt is the previous prompt + what followed it: the prefix the KV cache keeps
    assert engine.prompts[1][: len(engine.prompts[0])] == engine.prompts[0]
    assert engine.prompts[1] == t.prompt_ids + t.token_ids[: t.turns[2].start]
    assert t.prompt_tokens == sum(map(len, engine.prompts))
    assert t.cached_prompt_tokens == sum(len(p) // 2 for p in engine.prompts)
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]


async def test_the_prompt_is_the_rendered_observation_with_tools(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [turn_ids(tokenizer, "42")])
    t = await driver(engine, tokenizer).play("r", TASK, SAMPLING)
    tools = [ToolBox.build(ToolEnvironmentSpec().tools, FunctionAllowlist(), SandboxConfig()).schemas()[0]]
    renderer = IncrementalRenderer(tokenizer, [tool.as_openai() for tool in tools])
    expected = renderer.encode(renderer.render([{"role": "user", "content": TASK["prompt"]}], True))
    assert t.prompt_ids == expected
    assert t.status == "done" and [turn.role for turn in t.turns] == ["model"]


async def test_a_non_canonical_split_survives_the_next_turn(tokenizer: Any) -> None:
    """`}` and `\\n` sampled apart, where the tokenizer would merge `}\\n`: kept as sampled."""
    head, tail = CALL.split("}}\n")
    split = [*tokenizer.encode(head + "}}", add_special_tokens=False), *tokenizer.encode("\n" + tail)]
    split += tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(split) == CALL + "<|im_end|>"
    assert split != turn_ids(tokenizer, CALL)  # a re-tokenization would differ
    engine = ScriptedEngine(tokenizer, [split, turn_ids(tokenizer, "42")])
    t = await driver(engine, tokenizer).play("r", TASK, SAMPLING)
    assert t.status == "done"
    assert t.token_ids[: len(split)] == split
    assert engine.prompts[1][len(t.prompt_ids) : len(t.prompt_ids) + len(split)] == split


async def test_limits_end_the_trajectory_truncated(tokenizer: Any) -> None:
    call = turn_ids(tokenizer, CALL)
    t = await driver(ScriptedEngine(tokenizer, [call, call]), tokenizer, max_turns=2).play(
        "r", TASK, SAMPLING
    )
    assert t.status == "truncated" and "max_turns" in t.message and t.model_turns == 2

    short = SamplingSettings(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=5)
    t = await driver(ScriptedEngine(tokenizer, [call]), tokenizer).play("r", TASK, short)
    assert t.status == "truncated" and len(t.token_ids) == 5 and t.loss_mask == [1] * 5

    t = await driver(ScriptedEngine(tokenizer, [call]), tokenizer, max_total_tokens=len(call) + 3).play(
        "r", TASK, SAMPLING
    )
    assert t.status == "truncated" and "budget" in t.message and t.turns[-1].role == "tool"


class Failing:
    """Rewards each step by 1, fails on the second step."""

    steps = 0

    def reset(self, task: dict[str, Any], *, seed: int | None = None) -> list[dict[str, str]]:
        return [{"role": "user", "content": "go"}]

    def step(self, action: str) -> StepResult:
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("the simulator crashed")
        return StepResult([{"role": "user", "content": "again"}], reward=1.0)


async def test_an_environment_failure_is_a_status_not_a_reward(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [turn_ids(tokenizer, "a"), turn_ids(tokenizer, "b")])
    t = await driver(engine, tokenizer, env=sessions(Failing)).play("r", TASK, SAMPLING)
    assert t.status == "env_error" and "crashed" in t.message
    assert [turn.reward for turn in t.turns] == [1.0, None, None]  # the step reward lands on its action
    assert [turn.role for turn in t.turns] == ["model", "environment", "model"]


async def test_a_failed_reset_has_no_tokens(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [])
    t = await driver(engine, tokenizer).play("r", {"question": "no prompt column"}, SAMPLING)
    assert t.status == "env_error" and t.token_ids == [] and "prompt" in t.message


async def test_sessions_are_closed_whatever_happens(tokenizer: Any) -> None:
    table = sessions()
    engine = ScriptedEngine(tokenizer, [turn_ids(tokenizer, CALL), turn_ids(tokenizer, "42")])
    await driver(engine, tokenizer, env=table).play("r", TASK, SAMPLING)
    await driver(
        ScriptedEngine(tokenizer, [turn_ids(tokenizer, CALL)]), tokenizer, env=table, max_turns=1
    ).play("r", TASK, SAMPLING)
    assert table.sessions == {}


PLAIN_TURN = "{{- turn_start(message['role']) + (message['content'] or '') + '<|im_end|>\\n' -}}"
DROPS_EARLIER_THINKING = (
    "{{- turn_start(message['role']) + ((message['content'] or '') if loop.last or message['role'] != "
    "'assistant' else message['content'].split('</think>')[-1].lstrip('\\n')) + '<|im_end|>\\n' -}}"
)
"""An earlier assistant turn loses its `<think>` block once another message follows (Qwen3's way)."""


async def test_a_history_rewriting_template_is_refused_naming_the_turn() -> None:
    rewriting = build_bpe_tokenizer()
    assert rewriting.chat_template.count(PLAIN_TURN) == 1
    rewriting.chat_template = rewriting.chat_template.replace(PLAIN_TURN, DROPS_EARLIER_THINKING)
    thinking = turn_ids(rewriting, "<think>\nuse the tool\n</think>\n\n" + CALL)
    engine = ScriptedEngine(rewriting, [thinking, turn_ids(rewriting, "42")])
    t = await driver(engine, rewriting).play("r", TASK, SAMPLING)
    assert t.status == "template_mismatch"
    assert "turn 1 (assistant)" in t.message and "rewrites earlier" in t.message
    assert t.loss_mask == [1] * len(thinking)  # nothing was appended past the refused turn
