"""Masked reductions: hand-computed values, and 0 (not NaN) when nothing is masked in."""

from __future__ import annotations

import pytest
import torch

from rlfabric.learner.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def test_masked_sum_and_mean_ignore_masked_positions() -> None:
    assert masked_sum(X, MASK).item() == 3.0
    assert masked_mean(X, MASK).item() == 1.5
    assert torch.equal(masked_sum(X, MASK, dim=-1), torch.tensor([3.0, 0.0]))


def test_fully_masked_row_has_mean_zero_and_finite_gradient() -> None:
    x = X.clone().requires_grad_()
    means = masked_mean(x, MASK.bool(), dim=-1)
    assert torch.equal(means, torch.tensor([1.5, 0.0]))
    means.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]))


def test_masked_var_unbiased_and_biased() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    # mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    assert masked_var(x, mask).item() == pytest.approx(5 / 3)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(5 / 4)
    assert masked_var(x, torch.tensor([1, 0, 0, 0, 0])).item() == 0.0


def test_masked_whiten() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    torch.testing.assert_close(masked_whiten(x, mask, eps=0.0), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(
        masked_whiten(x, mask, eps=0.0, shift_mean=False), torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    )


def test_masked_whiten_of_constant_is_zero() -> None:
    out = masked_whiten(torch.full((2, 3), 7.0), torch.ones(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


@pytest.mark.parametrize("value", [0.9, 0.1, 0.7])
def test_masked_whiten_of_equal_float32_entries_is_exactly_zero(value: float) -> None:
    """Their float32 mean misses them by an ulp (30 copies of 0.9 average to 0.9 - 1.8e-7), which a std
    of the same order used to blow up into a uniform advantage: -0.151 for 0.9, +0.0074 for 0.1."""
    x = torch.full((30,), value, dtype=torch.float32)
    assert (x - x.mean()).abs().max().item() > 0  # the rounding this guards against
    for eps in (1e-6, 0.0):
        assert torch.equal(masked_whiten(x, torch.ones(30), eps=eps), torch.zeros(30))
    padded = torch.cat([x.view(3, 10), torch.full((3, 2), 5.0)], dim=1)  # padding holds other values
    mask = torch.cat([torch.ones(3, 10), torch.zeros(3, 2)], dim=1)
    assert torch.equal(masked_whiten(padded, mask), torch.zeros(3, 12))
    assert torch.equal(masked_whiten(x, torch.ones(30), shift_mean=False), torch.full((30,), x.mean().item()))


def test_masked_whiten_of_a_single_or_no_entry_is_zero() -> None:
    x = torch.tensor([[0.9, 3.0, 4.0]])
    assert torch.equal(masked_whiten(x, torch.tensor([[1, 0, 0]])), torch.zeros(1, 3))
    assert torch.equal(masked_whiten(x, torch.zeros(1, 3)), torch.zeros(1, 3))
