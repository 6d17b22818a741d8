"""`rollout.lora_cpu`: the grouped CPU LoRA ops give what vLLM's own torch ops give (imported from the
installed vLLM, not a copy), for decode (bgmv) and prefill (sgmv) calls, 3- and 4-dimensional stacked
weights, tokens without an adapter (index -1), add and overwrite, slices, bfloat16 outputs, through both
ways a batch of several adapters is computed (all slots stacked, or grouped by adapter); and `install`
puts them where vLLM's CPU LoRA wrapper calls them."""

from __future__ import annotations

import importlib

import pytest
import torch

from rlfabric.rollout import lora_cpu

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")


@pytest.fixture(scope="module")
def vllm_ops() -> dict[str, object]:
    """vLLM's own functions, from a fresh import (whatever `install` did to the loaded module)."""
    fresh = importlib.util.spec_from_file_location("vllm_lora_ops_original", lora_ops.__file__)
    assert fresh is not None and fresh.loader is not None
    module = importlib.util.module_from_spec(fresh)
    fresh.loader.exec_module(module)
    return {name: getattr(module, name) for name in lora_cpu.OPS}


@pytest.fixture(autouse=True, params=["stacked", "grouped"])
def strategy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every check twice: batches of several adapters through the stacked product (the tests' batches are
    all small enough) and through the grouping by adapter (what larger batches take)."""
    if request.param == "grouped":
        monkeypatch.setattr(lora_cpu, "STACKED_MAX_ELEMENTS", 0)
    return str(request.param)


def indices(tokens: int, slots: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-1, slots, (tokens,), generator=generator)


@pytest.mark.parametrize("dims", [3, 4])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bgmv_shrink_matches_vllm(vllm_ops: dict, dims: int, tokens: int, dtype: torch.dtype) -> None:
    torch.manual_seed(tokens)
    weights = torch.randn(3, 1, 16, 64) if dims == 4 else torch.randn(3, 16, 64)
    inputs = torch.randn(tokens, 64)
    idx = indices(tokens, 3, tokens)
    theirs, ours = torch.zeros(tokens, 16, dtype=dtype), torch.zeros(tokens, 16, dtype=dtype)
    vllm_ops["bgmv_shrink"](inputs, weights, theirs, idx, 0.5)
    lora_cpu.bgmv_shrink(inputs, weights, ours, idx, 0.5)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5  # the same products, summed in another order
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("width", [40, 48, 56])  # the output narrower, equal, wider than the adapter
def test_bgmv_expand_matches_vllm(vllm_ops: dict, add: bool, width: int) -> None:
    torch.manual_seed(width)
    weights, inputs, idx = torch.randn(4, 1, 48, 16), torch.randn(9, 16), indices(9, 4, width)
    start = torch.randn(9, width)
    theirs, ours = start.clone(), start.clone()
    vllm_ops["bgmv_expand"](inputs, weights, theirs, idx, add)
    lora_cpu.bgmv_expand(inputs, weights, ours, idx, add)
    torch.testing.assert_close(ours, theirs)


def test_bgmv_expand_of_one_row_into_many_matches_vllm(vllm_ops: dict) -> None:
    weights, inputs, idx = torch.randn(2, 32, 8), torch.randn(1, 8), torch.tensor([1])
    theirs, ours = torch.zeros(5, 32), torch.zeros(5, 32)
    vllm_ops["bgmv_expand"](inputs, weights, theirs, idx, True)
    lora_cpu.bgmv_expand(inputs, weights, ours, idx, True)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("add", [True, False])
def test_bgmv_expand_slice_matches_vllm(vllm_ops: dict, add: bool) -> None:
    torch.manual_seed(3)
    weights, inputs, idx = torch.randn(3, 1, 24, 16), torch.randn(11, 16), indices(11, 3, 3)
    start = torch.randn(11, 96)
    theirs, ours = start.clone(), start.clone()
    vllm_ops["bgmv_expand_slice"](inputs, weights, theirs, idx, 24, 24, add)
    lora_cpu.bgmv_expand_slice(inputs, weights, ours, idx, 24, 24, add)
    torch.testing.assert_close(ours, theirs)


def test_the_sgmv_ops_of_a_prefill_match_vllm(vllm_ops: dict) -> None:
    """Three sequences of 5, 1 and 9 tokens on adapters 2, -1 (none) and 0."""
    torch.manual_seed(4)
    seq_lens, per_seq = torch.tensor([5, 1, 9]), torch.tensor([2, -1, 0])
    starts = torch.tensor([0, 5, 6])
    a, b, x = torch.randn(3, 1, 8, 32), torch.randn(3, 1, 64, 8), torch.randn(15, 32)
    meta = (starts, seq_lens, per_seq, 3, 9, 15)
    shrunk = {side: torch.zeros(15, 8) for side in ("theirs", "ours")}
    vllm_ops["sgmv_shrink"](x, a, shrunk["theirs"], *meta, 0.25)
    lora_cpu.sgmv_shrink(x, a, shrunk["ours"], *meta, 0.25)
    torch.testing.assert_close(shrunk["ours"], shrunk["theirs"])
    expanded = {side: torch.ones(15, 64) for side in ("theirs", "ours")}
    vllm_ops["sgmv_expand"](shrunk["theirs"], b, expanded["theirs"], *meta, True)
    lora_cpu.sgmv_expand(shrunk["theirs"], b, expanded["ours"], *meta, True)
    torch.testing.assert_close(expanded["ours"], expanded["theirs"])
    sliced = {side: torch.ones(15, 128) for side in ("theirs", "ours")}
    vllm_ops["sgmv_expand_slice"](shrunk["theirs"], b, sliced["theirs"], *meta, 64, 64, False)
    lora_cpu.sgmv_expand_slice(shrunk["theirs"], b, sliced["ours"], *meta, 64, 64, False)
    torch.testing.assert_close(sliced["ours"], sliced["theirs"])


def test_install_puts_the_grouped_ops_where_the_cpu_wrapper_calls_them() -> None:
    punica_cpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_cpu")
    assert lora_cpu.install()
    for name in lora_cpu.OPS:
        assert getattr(lora_ops, name) is getattr(lora_cpu, name)
        assert getattr(punica_cpu, name) is getattr(lora_cpu, name)
