"""Token entropy, the entropy bonus and the clipped value loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfabric.learner.algorithms import entropy_bonus, entropy_from_logits, value_loss


def test_entropy_hand_computed() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(2), 0.0, 0.0, -math.inf]]])
    # uniform over 4: ln 4; probs (0.5, 0.25, 0.25, 0): 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[math.log(4), 1.5 * math.log(2)]]))


def test_entropy_is_stable_and_has_finite_gradient() -> None:
    logits = torch.tensor([[[1000.0, 0.0, -math.inf], [1e4, 1e4, 1e4]]], requires_grad=True)
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h.detach(), torch.tensor([[0.0, math.log(3)]]))
    h.sum().backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()


def test_entropy_bonus_is_negative_scaled_mean() -> None:
    entropy = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert entropy_bonus(entropy, mask, coef=0.01).item() == pytest.approx(-0.02)


def test_value_loss_clipped_hand_computed() -> None:
    values = torch.tensor([[1.0, 2.0, 0.0, 7.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # token 0: unclipped (1-2)^2 = 1, clipped V = 0.5 + 0.2 = 0.7 -> 1.69 (the max: clipped)
    # token 1: 1 and 1; token 2: 0.09 and 0.09
    loss, stats = value_loss(values, old, returns, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0 + 0.09) / 3)
    assert stats["value_clip_fraction"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dV 0.5 (V-R)^2 / 3 = (V - R) / 3 where unclipped; 0 at the clipped token and at padding
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1 / 3, -0.1, 0.0]]))


def test_value_loss_unclipped() -> None:
    values = torch.tensor([[1.0, 2.0, 0.0]])
    loss, _ = value_loss(values, values * 0, torch.tensor([[2.0, 1.0, 0.3]]), torch.ones(1, 3), clip_eps=None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.09) / 3)
