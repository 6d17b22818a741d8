"""What TRL reward functions log (`log_metric`, `log_extra`) reaches the learner's metrics rows: the
scorer's components ride each sample of the ScoredGroup, and the learner reports each component's
per-step mean as `reward/<component>`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfabric.contracts import wire
from rlfabric.learner.samples import GroupSamples, Rollout, component_means
from rlfabric.reward.scorers import ScoreInput, ScoreResult, build_scorer, run_scorer
from rlfabric.reward.scorers.policy import ScorerPolicy
from rlfabric.reward.spec import ItemResult
from rlfabric.v1 import rollout_pb2

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
FUNCTION = f"{EXAMPLES / 'trl_rewards.py'}:length_curriculum_reward"


def item_result(index: int, result: ScoreResult) -> ItemResult:
    return ItemResult(
        str(index), result.reward, result.status, "", dict(result.components), "python_function", "1", 0.0
    )


def scored_group(texts: list[str]) -> bytes:
    """A group scored by the example's logging reward function, as the coordinator enqueues it."""
    scorer = build_scorer("python_function", {"function": FUNCTION}, ScorerPolicy((str(EXAMPLES),)))
    items = [ScoreInput(f"i{i}", "Q?", text, policy_version=0) for i, text in enumerate(texts)]
    results = run_scorer(scorer, items)
    samples = [
        rollout_pb2.GeneratedSample(
            sample_index=i, prompt_token_ids=[7], token_ids=[1], logprobs=[-0.5], text=t
        )
        for i, t in enumerate(texts)
    ]
    group = wire.scored_group(
        run_id="r", prompt_id="p", group_id="g", epoch=0, samples=samples,
        scores=[item_result(i, r) for i, r in enumerate(results)], trace={}, enqueued_at=0.0,
    )  # fmt: skip
    return group.SerializeToString()


def test_logged_values_reach_the_step_metrics_as_reward_components() -> None:
    texts = ["x" * 10, "x" * 30]
    groups = [wire.group_samples_from_proto(wire.decode_group(scored_group(texts)))]
    means = component_means(groups)
    assert means["reward/length_curriculum_reward/mean_chars"] == pytest.approx(20.0)
    assert means["reward/length_curriculum_reward/chars"] == pytest.approx(20.0)  # log_extra, per sample
    assert means["reward/length_curriculum_reward"] == pytest.approx(-0.5)  # (-0.5 + -0.5) / 2


def test_a_component_is_averaged_over_the_samples_that_carry_it() -> None:
    def rollout(components: dict[str, float]) -> Rollout:
        return Rollout([1], [0.0], 1.0, components=components)

    groups = [
        GroupSamples([1], [rollout({"correct": 1.0, "format": 0.5}), rollout({"correct": 0.0})]),
        GroupSamples([1], [rollout({"correct": 1.0}), rollout({})]),
    ]
    assert component_means(groups) == {"reward/correct": pytest.approx(2 / 3), "reward/format": 0.5}
    assert component_means([GroupSamples([1], [rollout({})])]) == {}
