"""DPO and IPO against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfabric.learner.algorithms import PREFERENCE_LOSSES, dpo_loss, ipo_loss

# policy chosen/rejected -1/-3, reference -2/-2: margin h = (-1 + 3) - 0 = 2
PC, PR, RC, RR = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))


def test_registry_names() -> None:
    assert set(PREFERENCE_LOSSES) == {"dpo", "ipo", "kto", "orpo", "simpo"}
    assert PREFERENCE_LOSSES["dpo"] is dpo_loss


def test_dpo_hand_computed() -> None:
    loss, stats = dpo_loss(PC, PR, RC, RR, beta=0.5)
    # beta h = 1: -log sigmoid(1) = log(1 + e^-1)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)))
    assert stats["rewards_chosen"].item() == pytest.approx(0.5)  # 0.5 * (-1 + 2)
    assert stats["rewards_rejected"].item() == pytest.approx(-0.5)  # 0.5 * (-3 + 2)
    assert stats["reward_margin"].item() == pytest.approx(1.0)
    assert stats["reward_accuracy"].item() == 1.0


def test_dpo_label_smoothing() -> None:
    loss, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1)
    expected = 0.9 * math.log(1 + math.exp(-1)) + 0.1 * math.log(1 + math.exp(1))
    assert loss.item() == pytest.approx(expected)


def test_dpo_gradient() -> None:
    pc = PC.clone().requires_grad_()
    loss, _ = dpo_loss(pc, PR, RC, RR, beta=0.5)
    loss.backward()
    # d/dpc -log sigmoid(beta h) = -beta sigmoid(-beta h)
    assert pc.grad is not None
    assert pc.grad.item() == pytest.approx(-0.5 / (1 + math.e))


def test_ipo_hand_computed_and_flat_at_target_margin() -> None:
    loss, _ = ipo_loss(PC, PR, RC, RR, beta=0.5)
    assert loss.item() == pytest.approx((2 - 1) ** 2)  # 1 / (2 beta) = 1
    pc = PC.clone().requires_grad_()
    loss, _ = ipo_loss(pc, PR, RC, RR, beta=0.25)  # target 1 / (2 * 0.25) = 2 = h
    loss.backward()
    assert loss.item() == pytest.approx(0.0)
    assert pc.grad is not None
    assert pc.grad.item() == pytest.approx(0.0)


def test_accuracy_over_a_batch() -> None:
    pc, pr = torch.tensor([-1.0, -5.0]), torch.tensor([-3.0, -1.0])
    ref = torch.tensor([-2.0, -2.0])
    _, stats = dpo_loss(pc, pr, ref, ref, beta=1.0)
    assert stats["reward_accuracy"].item() == 0.5
    assert stats["reward_margin"].item() == pytest.approx((2.0 + -4.0) / 2)
