"""SimPO, ORPO and KTO against values computed by hand (with `math`) from the papers' formulas: losses,
statistics, gradients and their signs, label smoothing, and edge cases (ORPO's log odds near P = 1 and
far below, KTO's reference point held constant)."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from rlfabric.learner.algorithms.preference import (
    LOSS_KINDS,
    MAX_MEAN_LOGP,
    PREFERENCE_LOSSES,
    kto_loss,
    log1mexp,
    log_odds,
    orpo_loss,
    simpo_loss,
)
from rlfabric.learner.preference_data import REFERENCE_FREE_LOSSES
from rlfabric.runspec import PreferenceLossName


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def test_every_loss_of_the_spec_is_registered_with_its_kind() -> None:
    assert set(get_args(PreferenceLossName)) == set(PREFERENCE_LOSSES) == set(LOSS_KINDS)
    assert sorted(n for n, k in LOSS_KINDS.items() if not k.reference) == list(REFERENCE_FREE_LOSSES)
    assert [n for n, k in LOSS_KINDS.items() if not k.paired] == ["kto"]
    assert [n for n, k in LOSS_KINDS.items() if k.average] == ["ipo", "simpo", "orpo"]


# -- SimPO: -log sigmoid(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma) ---------------------

# y_w: 3 tokens, log pi(y_w|x) = -1.5; y_l: 4 tokens, log pi(y_l|x) = -5.0
SUM_W, LEN_W, SUM_L, LEN_L = -1.5, 3, -5.0, 4


def simpo_by_hand(beta: float, gamma: float, eps: float = 0.0) -> float:
    z = beta / LEN_W * SUM_W - beta / LEN_L * SUM_L - gamma
    return -(1 - eps) * math.log(sigmoid(z)) - eps * math.log(sigmoid(-z))


def per_token_means() -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer passes: per-token means, as leaves with gradients."""
    w = torch.tensor([SUM_W / LEN_W], dtype=torch.float64, requires_grad=True)
    lo = torch.tensor([SUM_L / LEN_L], dtype=torch.float64, requires_grad=True)
    return w, lo


def test_simpo_hand_computed_with_stats_and_gradients() -> None:
    w, lo = per_token_means()
    loss, stats = simpo_loss(w, lo, beta=2.0, gamma=0.5)
    # z = 2 * (-0.5) - 2 * (-1.25) - 0.5 = 1
    assert loss.item() == pytest.approx(simpo_by_hand(2.0, 0.5))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)))
    assert stats["rewards_chosen"].item() == pytest.approx(2.0 * SUM_W / LEN_W)
    assert stats["rewards_rejected"].item() == pytest.approx(2.0 * SUM_L / LEN_L)
    assert stats["reward_margin"].item() == pytest.approx(1.5)
    assert stats["reward_accuracy"].item() == 1.0
    loss.backward()
    assert w.grad is not None and lo.grad is not None
    # d/dm_w -log sigmoid(z) = -beta sigmoid(-z); the rejected side the opposite
    assert w.grad.item() == pytest.approx(-2.0 * sigmoid(-1.0)) and w.grad.item() < 0
    assert lo.grad.item() == pytest.approx(2.0 * sigmoid(-1.0)) and lo.grad.item() > 0


def test_simpo_label_smoothing_and_the_margin_gamma() -> None:
    w, lo = per_token_means()
    loss, _ = simpo_loss(w, lo, beta=2.5, gamma=1.0, label_smoothing=0.2)
    assert loss.item() == pytest.approx(simpo_by_hand(2.5, 1.0, eps=0.2))
    # gamma equal to the reward margin: the sigmoid's argument is 0, loss log 2, still pushing
    w, lo = per_token_means()
    loss, _ = simpo_loss(w, lo, beta=2.0, gamma=1.5)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2))
    assert w.grad is not None and w.grad.item() == pytest.approx(-1.0)  # -beta * sigmoid(0)


def test_simpo_averages_over_pairs() -> None:
    w, lo = torch.tensor([-0.5, -2.0]), torch.tensor([-1.25, -1.0])
    loss, stats = simpo_loss(w, lo, beta=2.0, gamma=0.0)
    # z = 2 * 0.75 = 1.5 and 2 * -1 = -2
    assert loss.item() == pytest.approx((softplus(-1.5) + softplus(2.0)) / 2)
    assert stats["reward_accuracy"].item() == 0.5


# -- ORPO: -log P(y_w) / |y_w| + lambda * -log sigmoid(log odds(y_w) - log odds(y_l)) ---------------------


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_orpo_hand_computed_with_stats() -> None:
    m_w, m_l, lam = -0.5, -1.5, 0.1
    p_w, p_l = math.exp(m_w), math.exp(m_l)  # P(y|x) = exp(mean token log-prob)
    ratio = logit(p_w) - logit(p_l)
    expected_or = -math.log(sigmoid(ratio))
    loss, stats = orpo_loss(torch.tensor([m_w]), torch.tensor([m_l]), lam=lam)
    assert loss.item() == pytest.approx(-m_w + lam * expected_or, rel=1e-6)
    assert stats["nll_loss"].item() == pytest.approx(0.5)
    assert stats["odds_ratio_loss"].item() == pytest.approx(expected_or, rel=1e-6)
    assert stats["rewards_chosen"].item() == pytest.approx(logit(p_w), rel=1e-6)
    assert stats["rewards_rejected"].item() == pytest.approx(logit(p_l), rel=1e-6)
    assert stats["reward_margin"].item() == pytest.approx(ratio, rel=1e-6)
    assert stats["reward_accuracy"].item() == 1.0


def test_orpo_gradients_by_hand() -> None:
    """d log odds / dm = 1 / (1 - P): d loss / dm_w = -1 - lam sigmoid(-ratio) / (1 - P_w) and
    d loss / dm_l = lam sigmoid(-ratio) / (1 - P_l): both terms raise the chosen, the rejected falls."""
    m_w, m_l, lam = -0.3, -0.9, 0.5
    w = torch.tensor([m_w], dtype=torch.float64, requires_grad=True)
    lo = torch.tensor([m_l], dtype=torch.float64, requires_grad=True)
    loss, _ = orpo_loss(w, lo, lam=lam)
    loss.backward()
    p_w, p_l = math.exp(m_w), math.exp(m_l)
    s = sigmoid(-(logit(p_w) - logit(p_l)))
    assert w.grad is not None and lo.grad is not None
    assert w.grad.item() == pytest.approx(-1 - lam * s / (1 - p_w)) and w.grad.item() < 0
    assert lo.grad.item() == pytest.approx(lam * s / (1 - p_l)) and lo.grad.item() > 0


@pytest.mark.parametrize("m", [-1e-4, -0.6, -0.69, -0.7, -0.8, -5.0, -30.0])
def test_log_odds_are_exact_on_both_sides_of_the_branch(m: float) -> None:
    p = math.exp(m)
    expected = m - math.log(-math.expm1(m))  # log P - log(1 - P)
    assert log_odds(torch.tensor([m], dtype=torch.float64)).item() == pytest.approx(expected, rel=1e-12)
    assert log1mexp(torch.tensor([m], dtype=torch.float64)).item() == pytest.approx(math.log1p(-p), rel=1e-12)
    assert log_odds(torch.tensor([m])).item() == pytest.approx(expected, rel=1e-5)  # float32 too


def test_orpo_is_finite_when_a_completion_is_certain() -> None:
    """A mean log-prob of exactly 0 (every token certain in float32) has infinite odds: it is clamped to
    `MAX_MEAN_LOGP`, so the loss and both gradients stay finite; the NLL term still has its gradient."""
    w = torch.tensor([0.0, -1e-9], requires_grad=True)
    lo = torch.tensor([-2.0, 0.0], requires_grad=True)
    loss, stats = orpo_loss(w, lo, lam=1.0)
    loss.backward()
    assert math.isfinite(loss.item()) and w.grad is not None and lo.grad is not None
    assert torch.isfinite(w.grad).all() and torch.isfinite(lo.grad).all()
    assert w.grad[0].item() == pytest.approx(-0.5)  # clamped: only the NLL's -1, over 2 pairs
    clamped = logit(math.exp(MAX_MEAN_LOGP))
    assert stats["rewards_chosen"].item() == pytest.approx(clamped, rel=1e-3)


# -- KTO: lambda_D (1 - sigmoid(beta (r - z0))) | lambda_U (1 - sigmoid(beta (z0 - r))) --------------------


def test_kto_hand_computed_with_stats_and_gradient_signs() -> None:
    policy = torch.tensor([-2.0, -3.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.5, -2.0, -1.5], dtype=torch.float64)
    desirable = torch.tensor([True, False, False])
    beta, z0, lam_d, lam_u = 0.5, 0.2, 1.5, 1.0
    z = torch.tensor(z0, dtype=torch.float64, requires_grad=True)
    loss, stats = kto_loss(
        policy, ref, desirable, kl=z, beta=beta, desirable_weight=lam_d, undesirable_weight=lam_u
    )
    r = [0.5, -1.0, 0.5]  # log pi - log pi_ref
    by_hand = [
        lam_d * (1 - sigmoid(beta * (r[0] - z0))),
        lam_u * (1 - sigmoid(beta * (z0 - r[1]))),
        lam_u * (1 - sigmoid(beta * (z0 - r[2]))),
    ]
    assert loss.item() == pytest.approx(sum(by_hand) / 3)
    assert stats["rewards_chosen_sum"].item() == pytest.approx(beta * r[0])
    assert stats["rewards_rejected_sum"].item() == pytest.approx(beta * (r[1] + r[2]))
    assert (stats["desirable"].item(), stats["undesirable"].item()) == (1.0, 2.0)
    loss.backward()
    assert policy.grad is not None
    # d/dr of lambda (1 - sigmoid(beta (r - z0))) = -lambda beta s (1 - s), s = sigmoid(beta (r - z0))
    s0 = sigmoid(beta * (r[0] - z0))
    assert policy.grad[0].item() == pytest.approx(-lam_d * beta * s0 * (1 - s0) / 3)
    s1 = sigmoid(beta * (z0 - r[1]))
    assert policy.grad[1].item() == pytest.approx(lam_u * beta * s1 * (1 - s1) / 3)
    assert policy.grad[0].item() < 0 < policy.grad[2].item()  # raise the good, lower the bad
    assert z.grad is None  # the reference point is a constant of the step


def test_kto_at_the_reference_is_half_the_weights() -> None:
    """pi = pi_ref and z0 = 0: every row's loss is lambda (1 - sigmoid(0)) = lambda / 2."""
    logps = torch.tensor([-3.0, -1.0, -2.0, -4.0])
    desirable = torch.tensor([True, True, True, False])
    loss, stats = kto_loss(logps, logps, desirable, kl=0.0, beta=0.1, desirable_weight=2.0)
    assert loss.item() == pytest.approx((3 * 2.0 / 2 + 1.0 / 2) / 4)
    assert stats["rewards_chosen_sum"].item() == 0.0 and stats["undesirable"].item() == 1.0


def test_kto_with_one_class_only() -> None:
    logps, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0])
    loss, stats = kto_loss(logps, ref, torch.tensor([False, False]), kl=0.5, beta=1.0)
    assert loss.item() == pytest.approx(((1 - sigmoid(0.5 - 1.0)) + (1 - sigmoid(0.5 - 0.0))) / 2)
    assert stats["desirable"].item() == 0.0 and stats["rewards_chosen_sum"].item() == 0.0
