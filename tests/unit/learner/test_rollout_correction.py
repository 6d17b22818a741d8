"""The masked rollout corrections (IcePop / token MIS, sequence MIS) and the engine/trainer mismatch
metric, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfabric.learner.algorithms import PolicyLossConfig, policy_loss, rollout_mismatch
from rlfabric.runspec import AlgorithmSpec


def weights_case(w: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logp (ratio 1 to old, with gradient), old, and rollout log-probs with exp(old - rollout) = w."""
    old = torch.full((len(w), len(w[0])), -1.0)
    logp = old.clone().requires_grad_()
    return logp, old, old - torch.tensor(w).log()


def test_mask_token_keeps_in_range_weights_and_drops_the_rest() -> None:
    logp, old, rollout = weights_case([[0.4, 0.8, 1.5, 3.0]])
    cfg = PolicyLossConfig(tis_cap=2.0, rollout_correction="mask_token", mask_low=0.5)
    loss, stats = policy_loss(logp, old, torch.ones(1, 4), torch.ones(1, 4), cfg, rollout_logp=rollout)
    # A = 1, ratio 1: per-token loss -1 x weight; weights 0, 0.8, 1.5, 0; token mean over 4 tokens
    assert loss.item() == pytest.approx(-(0.8 + 1.5) / 4)
    assert stats["rollout_masked_fraction"].item() == 0.5
    assert stats["tis_weight_mean"].item() == pytest.approx((0.8 + 1.5) / 4)
    assert "tis_capped_fraction" not in stats
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.2, -0.375, 0.0]]))


def test_mask_sequence_drops_whole_samples_by_geometric_mean_and_truncates_the_rest() -> None:
    # row 0: weights 0.5 and 8, geometric mean 2 -> kept, 8 truncated to 3; row 1: 4 and 4 -> dropped
    logp, old, rollout = weights_case([[0.5, 8.0], [4.0, 4.0]])
    cfg = PolicyLossConfig(tis_cap=3.0, rollout_correction="mask_sequence", mask_low=0.5)
    loss, stats = policy_loss(logp, old, torch.ones(2, 2), torch.ones(2, 2), cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx(-(0.5 + 3.0) / 4)
    assert stats["rollout_masked_fraction"].item() == 0.5


def test_mask_sequence_ignores_padding_in_the_geometric_mean() -> None:
    logp, old, rollout = weights_case([[2.0, 1000.0]])
    mask = torch.tensor([[1.0, 0.0]])
    cfg = PolicyLossConfig(tis_cap=3.0, rollout_correction="mask_sequence")
    loss, stats = policy_loss(logp, old, torch.ones(1, 2), mask, cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx(-2.0)  # the padded token's weight does not drop the sample
    assert stats["rollout_masked_fraction"].item() == 0.0


def test_mismatch_is_zero_when_engine_and_trainer_agree_and_k3_otherwise() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    same = rollout_mismatch(logp, logp.clone(), mask)
    assert same["rollout_mismatch_kl"].item() == 0.0 and same["rollout_logprob_abs_diff"].item() == 0.0
    rollout = logp - torch.tensor([[math.log(2.0), -math.log(2.0), 5.0]])  # w = 2, 0.5 (padding: 5)
    got = rollout_mismatch(logp, rollout, mask)
    k3 = ((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 2
    assert got["rollout_mismatch_kl"].item() == pytest.approx(k3)
    assert got["rollout_logprob_abs_diff"].item() == pytest.approx(math.log(2))


def test_the_mismatch_estimates_the_kl_between_two_distributions() -> None:
    """k3 over tokens sampled from the engine's distribution converges to KL(engine || trainer)."""
    engine = torch.tensor([0.5, 0.3, 0.2])
    trainer = torch.tensor([0.4, 0.4, 0.2])
    tokens = torch.multinomial(engine, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    got = rollout_mismatch(
        trainer.log()[tokens][None], engine.log()[tokens][None], torch.ones(1, len(tokens))
    )
    exact = float((engine * (engine / trainer).log()).sum())
    assert got["rollout_mismatch_kl"].item() == pytest.approx(exact, rel=0.05)


def test_masks_need_an_upper_bound_above_one() -> None:
    with pytest.raises(ValueError, match=r"algorithm\.tis_cap must be > 1"):
        AlgorithmSpec(rollout_correction="mask_token", tis_cap=None)
    with pytest.raises(ValueError, match=r"algorithm\.tis_cap must be > 1"):
        AlgorithmSpec(rollout_correction="mask_sequence", tis_cap=0.9)
    assert AlgorithmSpec(rollout_correction="mask_token").rollout_mask_low == 0.5


def test_rollout_trust_kl_must_be_positive() -> None:
    assert AlgorithmSpec(rollout_trust_kl=0.05).rollout_trust_kl == 0.05
    assert AlgorithmSpec().rollout_trust_kl is None
    with pytest.raises(ValueError, match="rollout_trust_kl"):
        AlgorithmSpec(rollout_trust_kl=0.0)
