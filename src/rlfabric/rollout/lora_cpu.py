"""LoRA on vLLM's CPU backend, one matrix product per adapter instead of one per token.

vLLM's CPU LoRA path (`PunicaWrapperCPU`, through `vllm.lora.ops.torch_ops`) gathers every token's
adapter matrices (`weights[indices]`: a rank x hidden copy per token, per projection, per layer) and
multiplies them one token at a time (`einsum("bi, boi -> bo")`). A prefill of two thousand tokens then
copies gigabytes: on two cores, with the 3.3 M-parameter benchmark model and rank 16, a shrink of 2,048
tokens took 24 ms against 1.2 ms done here, and the LoRA products were most of a step's generation time.

The replacements here compute the same thing grouped by adapter: for each adapter index a batch of tokens
uses, one product of those tokens with that adapter's matrix, written to the same rows and columns, with
the same dtype conversions and the same meaning of an index (an index of -1, a token without an adapter,
selects the last slot as vLLM's does). `install` swaps them into vLLM's modules (and the CPU wrapper's
imported names); the rollout worker process calls it on import of `rlfabric.rollout.worker_ext`, so it
runs wherever vLLM builds a worker with rlfabric's extension. GPU workers use vLLM's Triton kernels and
never call these functions. `tests/unit/test_lora_cpu.py` checks every function against vLLM's own on
random inputs.
"""

from __future__ import annotations

import torch

OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")
"""vLLM's torch LoRA ops replaced (the sgmv ones call the bgmv ones through the module)."""


def _matrices(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stacked adapter matrices as (slots, out, in) in `dtype`."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    return weights.to(dtype=dtype)


STACKED_MAX_ELEMENTS = 1 << 20
"""Batches with several adapters whose product with every slot's matrix has at most this many elements
(tokens x slots x output width: a decode batch) take one product with all slots stacked and keep each
token's own slot: 2 operations instead of ~5 per adapter (a comparison, nonzero, a gather, a product, a
scatter), which on small batches cost more than the products. Larger ones (prefills) group by adapter."""


def _products(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Row t: inputs[t] @ weights[indices[t]].T in `dtype` (the output's): one product when every token
    has the same index, else with all slots stacked (small batches) or one product per distinct index."""
    inputs, weights = inputs.to(dtype), _matrices(weights, dtype)
    slots, width = weights.shape[0], weights.shape[1]
    if indices.numel() and bool((indices == indices[0]).all()):
        return inputs @ weights[int(indices[0])].T
    if inputs.shape[0] * slots * width <= STACKED_MAX_ELEMENTS:
        every_slot = (inputs @ weights.reshape(slots * width, -1).T).view(-1, slots, width)
        rows = torch.arange(inputs.shape[0], device=inputs.device)
        return every_slot[rows, indices]  # an index of -1 is the last slot, as in `weights[index]`
    outputs = inputs.new_empty((inputs.shape[0], width))
    for index in torch.unique(indices).tolist():
        rows = (indices == index).nonzero().squeeze(1)
        outputs[rows] = inputs[rows] @ weights[index].T
    return outputs


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = _products(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def sgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    scaling: float,
) -> None:
    indices = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, indices, scaling)


def sgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    add_inputs: bool = False,
) -> None:
    indices = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, indices, add_inputs)


def sgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = False,
) -> None:
    indices = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, indices, slice_offset, slice_size, add_inputs)


def install() -> bool:
    """Puts these functions in place of vLLM's torch LoRA ops (its module and the CPU wrapper's names);
    False when this vLLM has no such ops (nothing changed)."""
    try:
        from vllm.lora.ops import torch_ops
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    if not all(hasattr(lora_ops, name) for name in OPS):
        return False
    for name in OPS:
        for module in (lora_ops, torch_ops, punica_cpu):
            if hasattr(module, name):
                setattr(module, name, globals()[name])
    return True
