"""KL estimators and coefficient controllers against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfabric.learner.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    make_kl_controller,
)

LN2 = math.log(2)


def test_registry_names() -> None:
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


@pytest.mark.parametrize(
    ("p", "p_ref", "k1", "k2", "k3"),
    [
        # r = p_ref / p = 0.5: k1 = ln 2, k2 = 0.5 ln^2 2, k3 = 0.5 - 1 + ln 2
        (0.5, 0.25, LN2, 0.5 * LN2**2, LN2 - 0.5),
        # r = 2: k1 = -ln 2, k2 = 0.5 ln^2 2, k3 = 2 - 1 - ln 2
        (0.25, 0.5, -LN2, 0.5 * LN2**2, 1 - LN2),
    ],
)
def test_estimators_hand_computed(p: float, p_ref: float, k1: float, k2: float, k3: float) -> None:
    logp, ref = torch.tensor([[math.log(p)]]), torch.tensor([[math.log(p_ref)]])
    assert KL_ESTIMATORS["k1"](logp, ref).item() == pytest.approx(k1, rel=1e-6)
    assert KL_ESTIMATORS["k2"](logp, ref).item() == pytest.approx(k2, rel=1e-6)
    assert KL_ESTIMATORS["k3"](logp, ref).item() == pytest.approx(k3, rel=1e-5)


def test_k3_is_nonnegative_and_zero_when_distributions_match() -> None:
    gen = torch.Generator().manual_seed(0)
    logp, ref = -5 * torch.rand(64, 32, generator=gen), -5 * torch.rand(64, 32, generator=gen)
    assert (KL_ESTIMATORS["k3"](logp, ref) >= 0).all()
    assert torch.equal(KL_ESTIMATORS["k3"](logp, logp), torch.zeros(64, 32))


def test_k3_is_finite_for_extreme_ratios() -> None:
    logp, ref = torch.tensor([[0.0, -1000.0]]), torch.tensor([[-1000.0, 0.0]])
    kl = KL_ESTIMATORS["k3"](logp, ref)
    assert torch.isfinite(kl).all()
    # log r clamped to -20: e^-20 - 1 + 20
    assert kl[0, 0].item() == pytest.approx(19.0, rel=1e-6)


@pytest.mark.parametrize(
    ("name", "grad"),
    # log r = ref - logp, clamped to -20; d/dlogp = -d/dlog_r: k1 1, k2 -(-20), k3 -(e^-20 - 1)
    [("k1", 1.0), ("k2", 20.0), ("k3", 1.0 - math.exp(-20.0))],
)
def test_gradient_survives_the_clamp(name: str, grad: float) -> None:
    """A token the policy pushed e^30 above the reference (log r = -30, beyond the clamp) still gets the
    KL's pull back: the gradient at the bound, not the 0 of a plain clamp. A reference probability of 0
    (log r = -inf) is the same case: finite value, finite gradient."""
    for ref in (-31.0, float("-inf")):
        logp = torch.tensor([[-1.0]], requires_grad=True)
        kl = KL_ESTIMATORS[name](logp, torch.tensor([[ref]]))
        kl.sum().backward()
        assert logp.grad is not None
        assert torch.isfinite(kl).all(), ref
        assert logp.grad.item() == pytest.approx(grad, rel=1e-6), ref


def test_values_are_clamped_at_both_ends() -> None:
    logp, ref = torch.tensor([[-1.0, -101.0]]), torch.tensor([[-101.0, -1.0]])  # log r = -100, +100
    torch.testing.assert_close(KL_ESTIMATORS["k1"](logp, ref), torch.tensor([[20.0, -20.0]]))
    torch.testing.assert_close(KL_ESTIMATORS["k2"](logp, ref), torch.tensor([[200.0, 200.0]]))
    k3 = KL_ESTIMATORS["k3"](logp, ref)
    torch.testing.assert_close(k3, torch.tensor([[math.exp(-20) + 19.0, math.expm1(20.0) - 20.0]]))


def test_k1_and_k3_are_unbiased_on_samples_from_the_policy() -> None:
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    true_kl = 0.3 * math.log(2.5)  # 0.5 ln 2.5 + 0.3 ln 1 + 0.2 ln 0.4
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, ref = p.log()[tokens], q.log()[tokens]
    for name in ("k1", "k3"):
        assert KL_ESTIMATORS[name](logp, ref).mean().item() == pytest.approx(true_kl, abs=0.01)


def test_apply_kl_penalty_only_on_masked_in_tokens() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3]], requires_grad=True)
    out = apply_kl_penalty(rewards, kl, torch.tensor([[1, 1, 0]]), coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, 1.0]]))
    assert not out.requires_grad


@pytest.mark.parametrize(
    ("current_kl", "expected"),
    [
        (12.0, 0.1 * 1.002),  # error clipped to +0.2; 1 + 0.2 * 100 / 10000
        (3.0, 0.1 * 0.998),  # error -0.5 clipped to -0.2
        (6.6, 0.1 * 1.001),  # error 0.1
        (6.0, 0.1),
    ],
)
def test_adaptive_controller(current_kl: float, expected: float) -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl, n_samples=100)
    assert ctl.value == pytest.approx(expected)


def test_fixed_controller_and_factory() -> None:
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05
    assert isinstance(make_kl_controller(0.05), FixedKLController)
    adaptive = make_kl_controller(0.05, target=6.0, horizon=100)
    assert isinstance(adaptive, AdaptiveKLController)
    assert adaptive.horizon == 100
