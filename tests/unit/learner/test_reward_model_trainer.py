"""The Bradley-Terry loss against hand-computed values (margin, centring), and the reward-model trainer in
one process (a gloo world of one) on the tiny model: its loss is the mean over pairs of the loss of each
sequence's reward scored alone (no padding), and its loss and gradient are the same whatever the
micro-batch size."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.reward_model import RewardModelTrainer, bradley_terry_loss, plan_batches
from rlfabric.learner.reward_model_data import RewardPair
from rlfabric.runspec import RunSpec

CPU = torch.device("cpu")
PAIRS = [
    RewardPair([4, 30, 31, 5, 90, 90, 90], [4, 30, 31, 5, 91, 92], 0.5, "a"),
    RewardPair([4, 73, 6, 90], [4, 73, 6, 40, 41, 42, 43, 44], 0.0, "b"),
    RewardPair([9, 10, 11, 90, 90], [9, 10, 11, 12], 1.5, "c"),
]
"""Three pairs of uneven lengths (so micro-batches pad differently), with margins."""


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_the_loss_is_minus_log_sigmoid_of_the_reward_difference() -> None:
    chosen, rejected = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0])
    got = bradley_terry_loss(chosen, rejected)
    assert got.tolist() == pytest.approx([-log_sigmoid(1.5), -log_sigmoid(-2.0)], rel=1e-6)
    assert got.tolist() == pytest.approx([0.2014132779827524, 2.1269280110429727], rel=1e-6)


def test_a_margin_is_subtracted_from_the_difference() -> None:
    chosen, rejected, margin = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0]), torch.tensor([1.0, 0.25])
    got = bradley_terry_loss(chosen, rejected, margin)
    assert got.tolist() == pytest.approx([-log_sigmoid(0.5), -log_sigmoid(-2.25)], rel=1e-6)


def test_centring_adds_coef_times_the_squared_reward_sum() -> None:
    chosen, rejected = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0])
    got = bradley_terry_loss(chosen, rejected, None, 0.01)
    # TRL: mean(-logsigmoid(d)) + 0.01 * mean((r_c + r_r)^2); (2 + 0.5)^2 = 6.25, (-1 + 1)^2 = 0
    trl = (-log_sigmoid(1.5) - log_sigmoid(-2.0)) / 2 + 0.01 * (6.25 + 0.0) / 2
    assert float(got.mean()) == pytest.approx(trl, rel=1e-6)
    assert got.tolist() == pytest.approx([-log_sigmoid(1.5) + 0.0625, -log_sigmoid(-2.0)], rel=1e-6)


def test_batches_hold_whole_pairs_longest_first() -> None:
    batches = plan_batches(PAIRS, 2)
    assert [[p.pair_id for p in b] for b in batches] == [["b", "a"], ["c"]]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield init_distributed(CPU)
    torch.set_num_threads(threads)


def make_trainer(model_dir: Path, world: World, micro_batch_size: int, **rm: Any) -> RewardModelTrainer:
    spec = RunSpec.model_validate(
        {
            "mode": "reward_model",
            "model": {"path": str(model_dir)},
            "dataset": {"path": "unused.jsonl"},
            "optim": {"lr": 1e-2, "grad_clip": None},
            "train": {"micro_batch_size": micro_batch_size},
            "reward_model": rm,
        }
    )
    return RewardModelTrainer(spec, model_dir, device=CPU, world=world, total_steps=10)


def alone(trainer: RewardModelTrainer, ids: list[int]) -> float:
    """The trainer's reward of one sequence scored by itself (no padding)."""
    with torch.no_grad():
        return float(trainer.model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_the_step_loss_is_the_pair_mean_of_unpadded_rewards(tiny_model_dir: Path, world: World) -> None:
    trainer = make_trainer(tiny_model_dir, world, 2, margin_field="m", center_rewards_coef=0.1)
    rewards = [(alone(trainer, p.chosen_ids), alone(trainer, p.rejected_ids)) for p in PAIRS]
    by_hand = [
        -log_sigmoid(c - r - p.margin) + 0.1 * (c + r) ** 2 for (c, r), p in zip(rewards, PAIRS, strict=True)
    ]
    metrics = trainer.train_step(PAIRS)
    assert metrics["loss"] == pytest.approx(sum(by_hand) / 3, rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(sum(c > r for c, r in rewards) / 3)
    assert metrics["rewards_chosen"] == pytest.approx(sum(c for c, _ in rewards) / 3, rel=1e-5)
    assert metrics["reward_margin"] == pytest.approx(sum(c - r for c, r in rewards) / 3, rel=1e-5)
    assert metrics["pairs"] == 3 and metrics["tokens"] == sum(
        len(p.chosen_ids + p.rejected_ids) for p in PAIRS
    )


def test_loss_and_gradient_do_not_depend_on_the_micro_batch_size(tiny_model_dir: Path, world: World) -> None:
    found = []
    for size in (2, 4, 16):  # 1, 2 and 3 pairs per forward pass
        metrics = make_trainer(tiny_model_dir, world, size, margin_field="m").train_step(PAIRS)
        found.append((metrics["loss"], metrics["grad_norm"]))
    assert found[0][1] > 0
    for loss, norm in found[1:]:
        assert loss == pytest.approx(found[0][0], rel=1e-5)
        assert norm == pytest.approx(found[0][1], rel=1e-4)


def test_evaluation_changes_nothing(tiny_model_dir: Path, world: World) -> None:
    trainer = make_trainer(tiny_model_dir, world, 4)
    before = trainer.full_state_dict()
    first, again = trainer.evaluate(PAIRS), trainer.evaluate(PAIRS)
    assert first == again and first["eval_pairs"] == 3
    assert set(first) >= {"eval_loss", "eval_accuracy", "eval_reward_margin", "eval_rewards_rejected"}
    after = trainer.full_state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
