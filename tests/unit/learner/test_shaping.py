"""DAPO overlong penalty and truncated-completion masking."""

from __future__ import annotations

import pytest
import torch

from rlfabric.learner.algorithms import is_truncated, mask_truncated, overlong_penalty


def test_overlong_penalty_zones() -> None:
    lengths = torch.tensor([10, 16, 17, 18, 19, 20, 25])
    # max 20, buffer 4: safe up to 16, then (16 - L) / 4, -1 from 20 on
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_tokens=20, buffer_tokens=4), expected)


def test_overlong_penalty_rejects_bad_buffer() -> None:
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_tokens=10, buffer_tokens=0)
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_tokens=10, buffer_tokens=11)


def test_truncated_completions_are_masked_out() -> None:
    truncated = is_truncated(torch.tensor([19, 20, 21]), max_tokens=20)
    assert truncated.tolist() == [False, True, True]
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    assert torch.equal(mask_truncated(mask, truncated), torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    bool_mask = mask_truncated(mask.bool(), truncated)
    assert bool_mask.dtype == torch.bool
    assert bool_mask.tolist() == [[True, True], [False, False], [False, False]]
