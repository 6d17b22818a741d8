"""LoRA adapter sizes from the architecture alone: what a run's `model.lora` adds and trains.

An adapter on a linear layer of `fan_in` inputs and `fan_out` outputs is A (r, fan_in) and B (fan_out, r):
r x (fan_in + fan_out) parameters. Dense decoders only: a mixture-of-experts MLP's adapters depend on how
PEFT wraps its expert layers, which the planner does not model (attention adapters are still counted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlfabric.plan.arch import ModelArch

if TYPE_CHECKING:
    from rlfabric.runspec import LoraSpec

ALL_LINEAR = "all-linear"
"""PEFT's every linear layer but the head."""
DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of one Llama/Qwen/Mistral-style decoder layer."""


def layer_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """(fan_in, fan_out) of each linear layer of one decoder layer, by its name."""
    h, i = arch.hidden_size, arch.intermediate_size
    shapes = {
        "q_proj": (h, arch.q_width),
        "k_proj": (h, arch.kv_width),
        "v_proj": (h, arch.kv_width),
        "o_proj": (arch.q_width, h),
    }
    if not arch.num_experts:
        shapes.update(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))
    return shapes


def adapter_params(arch: ModelArch, lora: LoraSpec) -> int:
    """Parameters of the run's adapters over the whole model (what the learner trains)."""
    shapes = layer_shapes(arch)
    targets = list(DENSE_TARGETS) if lora.target_modules == [ALL_LINEAR] else lora.target_modules
    per_layer = sum(
        lora.rank * (fan_in + fan_out) for name, (fan_in, fan_out) in shapes.items() if name in targets
    )
    return per_layer * arch.num_hidden_layers


def adapted_output_width(arch: ModelArch, lora: LoraSpec) -> int:
    """Sum of the output widths of one layer's adapted projections."""
    targets = list(DENSE_TARGETS) if lora.target_modules == [ALL_LINEAR] else lora.target_modules
    return sum(fan_out for name, (_, fan_out) in layer_shapes(arch).items() if name in targets)
