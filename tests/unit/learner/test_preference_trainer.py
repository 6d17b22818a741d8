"""The preference trainer in one process (a gloo world of one) on the tiny model: DPO and IPO learn, the
step-0 losses match their closed forms, and gradient accumulation is exact."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.preference import PreferencePair, PreferenceTrainer, pairs_per_micro_batch
from rlfabric.runspec import RunSpec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """A world of one; one intra-op thread (the tiny model's matmuls only lose from more), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield init_distributed(CPU)
    torch.set_num_threads(threads)


def make_spec(model_dir: Path, **overrides: Any) -> RunSpec:
    """An offline DPO run spec for the tiny model; `overrides` are nested section dicts."""
    raw: dict[str, Any] = {
        "mode": "offline_preference",
        "model": {"path": str(model_dir)},
        "dataset": {"path": "unused.jsonl"},
        "optim": {"lr": 5e-3},
        "train": {"micro_batch_size": 4, "steps": 20},
    }
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return RunSpec.model_validate(raw)


def consistent_pairs(n: int = 4, seed: int = 0) -> list[PreferencePair]:
    """Random prompts; the chosen completion is always one string of tokens, the rejected another."""
    gen = torch.Generator().manual_seed(seed)
    chosen, rejected = [40, 41, 42, 43], [60, 61, 62]
    return [
        PreferencePair(torch.randint(6, 100, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen)
                       .tolist(), chosen, rejected, pair_id=str(i))
        for i in range(n)
    ]  # fmt: skip


def test_pairs_need_tokens() -> None:
    with pytest.raises(ValueError, match="chosen_token_ids is empty"):
        PreferencePair([7], [], [8], pair_id="x")
    assert pairs_per_micro_batch(1) == 1 and pairs_per_micro_batch(5) == 2


def test_dpo_loss_is_log2_when_policy_is_reference(tiny_model_dir: Path, world: World) -> None:
    trainer = PreferenceTrainer(make_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    metrics = trainer.train_step(consistent_pairs())
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["reward_accuracy"] == 0.0  # ties are not wins
    assert metrics["pairs"] == 4 and metrics["tokens"] == 4 * (4 + 3)
    assert metrics["logps_chosen"] < 0 and metrics["grad_norm"] > 0
    assert (trainer.step, trainer.policy_version) == (1, 1)


def test_dpo_learns_the_preference(tiny_model_dir: Path, world: World) -> None:
    trainer = PreferenceTrainer(make_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    pairs = consistent_pairs()
    history = [trainer.train_step(pairs) for _ in range(4)]
    margins = [m["reward_margin"] for m in history]
    assert margins[-1] > margins[1] > margins[0]
    assert history[-1]["reward_accuracy"] == 1.0
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["rewards_chosen"] > history[-1]["rewards_rejected"]


def test_ipo_starts_at_its_margin_and_learns(tiny_model_dir: Path, world: World) -> None:
    spec = make_spec(tiny_model_dir, preference={"loss": "ipo", "beta": 0.5}, optim={"lr": 1e-3})
    trainer = PreferenceTrainer(spec, tiny_model_dir, device=CPU, world=world)
    pairs = consistent_pairs()
    history = [trainer.train_step(pairs) for _ in range(3)]
    assert history[0]["loss"] == pytest.approx((1 / (2 * 0.5)) ** 2, abs=1e-6)  # margin 0, target 1/(2 beta)
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["reward_margin"] > 0


def test_accumulation_is_exact(tiny_model_dir: Path, world: World) -> None:
    """One pair per forward pass trains like all pairs in one, including a label-smoothed loss: the
    metrics of the second step agree to 1e-4, and the weights after it differ by under 1% (in norm) of
    how far the two steps moved them. Element-wise equality is not the right test: Adam divides by each
    gradient's own size, so an element whose gradient is rounding noise takes a full-size step in a
    random direction."""
    pairs = consistent_pairs(n=3, seed=1)
    results = []
    initial: dict[str, torch.Tensor] = {}
    for micro_batch_size in (2, 8):
        spec = make_spec(
            tiny_model_dir,
            train={"micro_batch_size": micro_batch_size},
            preference={"label_smoothing": 0.1, "beta": 0.5},
        )
        trainer = PreferenceTrainer(spec, tiny_model_dir, device=CPU, world=world)
        initial = initial or {k: v.clone() for k, v in trainer.full_state_dict().items()}
        trainer.train_step(pairs)
        second = trainer.train_step(pairs)  # after one update: policy != reference
        results.append((second, {k: v.clone() for k, v in trainer.full_state_dict().items()}))
    (m1, w1), (m2, w2) = results
    for name in ("loss", "reward_margin", "logps_chosen", "grad_norm"):
        assert m1[name] == pytest.approx(m2[name], rel=1e-4, abs=1e-6), name
    for name, tensor in w1.items():
        if name.endswith("k_proj.bias"):
            continue  # softmax ignores a shift shared by every key: this gradient is 0 up to rounding
        moved = (tensor - initial[name]).norm().item()
        assert moved > 0, name
        assert (w2[name] - tensor).norm().item() <= 0.01 * moved, name
