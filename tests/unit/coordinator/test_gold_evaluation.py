"""Held-out evaluation with a gold reward (`dataset.eval.reward`): each result keeps the run's own reward
as `reward_mean` and adds `gold_reward_mean` over the same samples; a failing gold call leaves its prompt
out of the gold mean only; without a gold reward the result is as before. The run spec's section and its
checks: the scorer's problems name `dataset.eval.reward` fields, and `rlfabric up`'s reward service allows
the functions both rewards name."""

from __future__ import annotations

import json
from typing import Any

import fakeredis
import grpc
import pytest

from rlfabric.contracts import keys
from rlfabric.coordinator.dataset import PromptRow
from rlfabric.coordinator.evaluation import Evaluator
from rlfabric.reward.check import allowed_functions, run_rewards
from rlfabric.reward.client import RewardServiceError
from rlfabric.reward.spec import ItemResult, ScorerProblem
from rlfabric.runspec import RunSpec
from rlfabric.v1 import rollout_pb2
from rlfabric.validate import check_local, scorer_issues

BASE: dict[str, Any] = {"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}}


def spec(**eval_section: Any) -> RunSpec:
    return RunSpec.model_validate({**BASE, "dataset": {"path": "d.jsonl", "eval": eval_section}})


class FakePipeline:
    run_id = "gold"

    def __init__(self) -> None:
        self.spec = spec()
        self.redis = fakeredis.FakeAsyncRedis()
        self.dispatcher = self  # generates itself, as the pipeline's dispatcher would

    async def generate(self, item: Any, row: PromptRow, sampling: Any = None) -> list[Any]:
        return [
            rollout_pb2.GeneratedSample(sample_index=i, text=f"{row.prompt_id}-{i}", policy_version=7)
            for i in range(2)
        ]

    async def learner_step(self) -> int:
        return 7

    async def count(self, counter: Any, n: int = 1) -> None: ...

    async def refused_as_too_long(self, row: PromptRow, reason: str) -> None: ...


def results(*rewards: float) -> list[ItemResult]:
    return [ItemResult(str(i), r, "ok", "", {}, "s", "1", 0.0) for i, r in enumerate(rewards)]


async def proxy(row: PromptRow, samples: list[Any]) -> list[ItemResult]:
    return results(1.0, 3.0) if row.prompt_id == "a" else results(5.0, 7.0)


async def gold(row: PromptRow, samples: list[Any]) -> list[ItemResult]:
    if row.prompt_id == "b":
        raise RewardServiceError(grpc.StatusCode.UNAVAILABLE, "down")
    return [*results(0.25), ItemResult("1", float("nan"), "scorer_error", "bad", {}, "s", "1", 0.0)]


ROWS = [PromptRow("a", "p a"), PromptRow("b", "p b")]


async def stored(pipeline: FakePipeline) -> list[dict[str, Any]]:
    return [json.loads(r) for r in await pipeline.redis.lrange(keys.eval_results("gold"), 0, -1)]


async def test_gold_reward_is_recorded_beside_the_proxy() -> None:
    pipeline = FakePipeline()
    await Evaluator(pipeline, proxy, gold).evaluate(ROWS, 7, "eval_set")
    [result] = await stored(pipeline)
    assert result["reward_mean"] == 4.0 and result["samples"] == 4 and result["prompts"] == 2
    assert result["gold_reward_mean"] == 0.25 and result["gold_samples"] == 1  # b failed, a's 2nd errored
    assert (result["step"], result["policy_version"], result["source"]) == (7, 7, "eval_set")


async def test_without_a_gold_reward_the_result_is_as_before() -> None:
    pipeline = FakePipeline()
    await Evaluator(pipeline, proxy).evaluate(ROWS, 7, "held_out")
    [result] = await stored(pipeline)
    assert set(result) == {"reward_mean", "policy_version", "step", "source", "prompts", "samples"}


def test_the_gold_section_and_its_checks(tmp_path) -> None:
    gold_reward = {"scorer": "python_function", "params": {"function": "pkg.gold:score"}}
    run = spec(reward=gold_reward, path="e.jsonl")
    assert run.dataset.eval.reward is not None and run.dataset.eval.reward.scorer == "python_function"
    assert [r.scorer for r in run_rewards(run)] == ["exact_match", "python_function"]
    assert allowed_functions(run_rewards(run), None) == ["pkg.gold:score"]
    issues = scorer_issues([ScorerProblem("params.parts[1].name", "unknown")], "dataset.eval.reward")
    assert [i.field for i in issues] == ["dataset.eval.reward.parts[1].scorer"]
    missing = spec(reward={"scorer": "reward_model", "params": {"path": str(tmp_path / "none")}})
    fields = [i.field for i in check_local(missing).issues]
    assert "dataset.eval.reward.params.path" in fields
    with pytest.raises(ValueError, match="parts"):
        spec(reward={"scorer": "composite"})


async def test_the_learner_carries_the_gold_reward_into_its_row() -> None:
    from types import SimpleNamespace

    from rlfabric.learner.leader import Leader

    redis = fakeredis.FakeAsyncRedis()
    leader = SimpleNamespace(config=SimpleNamespace(run_id="gold"), redis=redis)
    old = {"reward_mean": 0.1, "policy_version": 3, "step": 3}
    new = {"reward_mean": 0.5, "policy_version": 7, "step": 7, "gold_reward_mean": 0.25, "gold_samples": 4}
    await redis.rpush(keys.eval_results("gold"), json.dumps(old), json.dumps(new))
    row = await Leader.take_eval_results(leader)  # type: ignore[arg-type]
    assert row == {
        "eval_reward_mean": 0.5,
        "eval_policy_version": 7,
        "eval_step": 7,
        "eval_gold_reward_mean": 0.25,
    }
    assert await Leader.take_eval_results(leader) == {}  # type: ignore[arg-type]
