"""python_function keeps TRL's reward-function contract: TRL's own reward functions and the examples of
TRL's docs (examples/trl_rewards.py, unchanged) score as they would in TRL's GRPOTrainer."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rlfabric.reward.scorers import ScoreInput, ScoreResult, build_scorer, run_scorer
from rlfabric.reward.scorers.policy import ScorerPolicy

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TRL_FILE = EXAMPLES / "trl_rewards.py"
POLICY = ScorerPolicy((str(EXAMPLES), "trl.rewards"))
CHAT = [{"role": "user", "content": "What is 2+2?"}]


def fn(name: str) -> str:
    """A function of the examples file, or `trl.rewards:<name>` for a name with a colon."""
    return name if ":" in name else f"{TRL_FILE}:{name}"


def score(function: str | list[str], items: list[ScoreInput], **params: Any) -> list[ScoreResult]:
    functions = [fn(f) for f in function] if isinstance(function, list) else fn(function)
    scorer = build_scorer("python_function", {"function": functions, **params}, POLICY)
    return run_scorer(scorer, items)


def item(completion: Any, prompt: Any = "Q?", **columns: Any) -> ScoreInput:
    ids = columns.pop("completion_ids", None)
    version = columns.pop("policy_version", None)
    return ScoreInput("i", prompt, completion, metadata=columns, completion_ids=ids, policy_version=version)


def rewards(results: list[ScoreResult]) -> list[float]:
    assert {r.status for r in results} == {"ok"}, results
    return [r.reward for r in results]


def test_the_quickstart_reward_len_takes_only_completions() -> None:
    assert rewards(score("reward_len", [item("x" * 20), item("abc")])) == [0.0, -17.0]


def test_a_conversational_prompt_gets_completions_as_assistant_messages() -> None:
    good = "<think>4 = 2+2</think><answer>4</answer>"
    results = score("format_reward_func", [item(good, CHAT), item("4", CHAT)])
    assert rewards(results) == [1.0, 0.0]


def test_dataset_columns_arrive_under_their_own_names() -> None:
    items = [item(r"so \boxed{2}", ground_truth="2"), item(r"\boxed{6}", ground_truth="5")]
    assert rewards(score("reward_func", items)) == [1.0, 0.0]


def test_async_functions_are_awaited() -> None:
    assert rewards(score("async_reward_func", [item("yes"), item("")])) == [1.0, 0.0]


def test_trl_think_format_reward() -> None:
    items = [item("<think>\nreasoning\n</think>\nanswer", CHAT), item("<think>\nno end", CHAT)]
    assert rewards(score("trl.rewards:think_format_reward", items)) == [1.0, 0.0]


def test_trl_accuracy_reward_reads_solution_and_skips_unparseable_gold() -> None:
    items = [
        item(r"My answer is \boxed{\frac{1}{3}}", CHAT, solution=r"\frac{1}{3}"),
        item(r"My answer is \boxed{\frac{1}{2}}", CHAT, solution=r"\frac{1}{3}"),
        item(r"\boxed{1}", CHAT, solution="no gold here"),
    ]
    results = score("trl.rewards:accuracy_reward", items)
    assert [r.status for r in results] == ["ok", "ok", "not_applicable"]
    assert [r.reward for r in results[:2]] == [1.0, 0.0]
    assert math.isnan(results[2].reward), "None is not a reward"


def test_completion_ids_reach_trl_overlong_punishment() -> None:
    items = [item("short", completion_ids=[1] * 50), item("long", completion_ids=[1] * 90)]
    assert rewards(score("soft_overlong_punishment", items)) == [0.0, -0.5]


def test_unknown_completion_ids_fail_naming_the_function() -> None:
    [result] = score("soft_overlong_punishment", [item("no ids")])
    assert result.status == "scorer_error" and math.isnan(result.reward)
    assert "soft_overlong_punishment_reward raised TypeError" in result.message
    assert "completion_ids unknown" in result.message


def test_log_metric_log_extra_and_trainer_state() -> None:
    items = [item("x" * 40, policy_version=12), item("x" * 20, policy_version=11)]
    results = score("length_curriculum_reward", items)
    assert rewards(results) == [0.0, -0.5], "step 11 >= 10: the target is 40 characters"
    assert results[0].components["length_curriculum_reward/mean_chars"] == 30.0
    assert [r.components["length_curriculum_reward/chars"] for r in results] == [40.0, 20.0]


def test_several_functions_combine_as_trl_weighted_nansum() -> None:
    items = [
        item("2+2 is 4", "2+2", task="math"),
        item("2+2 is 5", "2+2", task="math"),
        item("def f(): pass", "code", task="code"),
    ]
    results = score(["math_reward_func", "reward_len"], items, weights=[2.0, 0.5])
    assert rewards(results) == [2.0 + 0.5 * -12, -2.0 + 0.5 * -12, 0.5 * -7]
    assert results[2].components == {"reward_len": -7.0}, "a None is left out of the sum, never 0"


def test_every_function_none_is_not_applicable() -> None:
    [result] = score(["math_reward_func"], [item("code", "write code", task="code")])
    assert result.status == "not_applicable" and "math_reward_func returned None" in result.message


@pytest.mark.parametrize("completion", [[{"role": "assistant", "content": "hi"}], 7, None])
def test_a_completion_that_is_not_text_is_an_error_never_a_reward(completion: Any) -> None:
    [result] = score("reward_len", [item(completion)])
    assert result.status == "scorer_error" and "completion: expected a string" in result.message


def test_a_non_number_reward_is_an_error_naming_the_function(tmp_path: Path) -> None:
    source = "def words(completions, **kwargs):\n    return ['high' for _ in completions]\n"
    (tmp_path / "bad.py").write_text(source)
    policy = ScorerPolicy((str(tmp_path),))
    scorer = build_scorer("python_function", {"function": f"{tmp_path}/bad.py:words"}, policy)
    [result] = run_scorer(scorer, [item("a")])
    assert result.status == "scorer_error" and "words returned 'high'" in result.message


def test_weights_must_match_the_functions() -> None:
    with pytest.raises(ValueError, match="weights"):
        score(["reward_len", "async_reward_func"], [item("a")], weights=[1.0])
