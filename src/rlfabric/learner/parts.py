"""The building blocks the learner's trainers share (RL, preference losses, reward models, SFT):
loading a causal LM sharded with FSDP2, target log-probs and entropy in bounded chunks, AdamW with its
LR schedule, and one clipped optimizer step.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from rlfabric.learner.algorithms import entropy_from_logits
from rlfabric.learner.dist import reshard, shard_model
from rlfabric.learner.lora import add_adapters
from rlfabric.learner.packing import PACKED_ATTENTION, packing_supported, register_packed_attention
from rlfabric.runspec import LoraSpec, OptimSpec, RunSpec

log = logging.getLogger(__name__)

LOGPROB_CHUNK = 1024
"""Positions per chunk when turning logits into log-probs: bounds the float32 copy of the logits."""
FLOAT32_ATTENTION = "rlfabric_sdpa_float32"
"""The attention implementation of low-precision training on CPU (see `sdpa_in_float32`)."""

# -- models ---------------------------------------------------------------------------------------------


def load_model(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    trainable: bool,
    checkpointing: bool,
    compile_blocks: bool = False,
    reward_head: bool = False,
    lora: LoraSpec | None = None,
    packed: bool = False,
) -> nn.Module:
    """A causal LM from `path` with float32 master weights on `device`, sharded with FSDP2; with
    `compile_blocks` its element-wise blocks compiled (`compile_elementwise_blocks`). With `reward_head`
    the model is loaded as a sequence classifier with one label instead (the LM head dropped, a scalar
    `score` head newly initialised from the torch RNG: seed it alike on every rank). With `lora` (a trainable
    policy) only LoRA adapters added to it train (`rlfabric.learner.lora`). With `packed` its attention is
    `packing.packed_attention` where the architecture allows (`packing.packing_supported`; the caller
    reads `is_packed(model)`), so that it takes packed micro-batches."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    options: dict[str, Any] = {"num_labels": 1} if reward_head else {}
    if packed and packing_supported(AutoConfig.from_pretrained(str(path))):
        register_packed_attention()  # computes in float32 where sdpa_in_float32 would
        options["attn_implementation"] = PACKED_ATTENTION
        log.info("train.packing: %s takes packed micro-batches", path)
    elif packed:
        log.info("train.packing: %s has sliding-window attention layers; its micro-batches are padded", path)
    elif device.type == "cpu" and dtype != torch.float32:
        register_float32_attention()
        options["attn_implementation"] = FLOAT32_ATTENTION
    auto = AutoModelForSequenceClassification if reward_head else AutoModelForCausalLM
    model = auto.from_pretrained(str(path), dtype=torch.float32, **options)
    model.config.use_cache = False
    if checkpointing and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module: nn.Module = model
    module.requires_grad_(trainable)
    module.train(trainable)
    if lora is not None and trainable:
        module = add_adapters(module, lora)  # freezes the base weights
    module.to(device)
    if not trainable and dist.get_world_size() == 1:
        # A frozen model in a world of one: nothing to shard and no master weights to keep, so its
        # parameters are held in the compute dtype once instead of cast from float32 on every forward
        # (as FSDP's mixed precision does; buffers such as rotary frequencies stay float32 there too).
        for param in module.parameters():
            param.data = param.data.to(dtype)
    else:
        shard_model(module, dtype)
    if compile_blocks:
        compile_elementwise_blocks(module)
    return module


def is_packed(model: nn.Module) -> bool:
    """Whether `model` was loaded to take packed micro-batches (`load_model(packed=True)`)."""
    return getattr(model.config, "_attn_implementation", None) == PACKED_ATTENTION


COMPILED_BLOCKS = ("RMSNorm", "MLP")
"""Class-name endings of the modules `compile_elementwise_blocks` compiles (Llama, Qwen, Mistral, Gemma
...: `LlamaRMSNorm`, `Qwen2MLP`). Mixture-of-experts blocks (data-dependent routing) do not match."""


def compile_elementwise_blocks(model: nn.Module) -> int:
    """`torch.compile` `model`'s normalisation layers and MLP blocks in place; returns how many.

    Eager, an RMSNorm is six element-wise passes over the activations forward (a float32 round trip) and
    more backward, and an MLP's SiLU and gating product two more: on the CPU they were a fifth of a bf16
    learner step, and compiled into fused loops an RMSNorm's forward + backward ran 5x faster. Attention
    modules and whole decoder layers stay eager: compiled they made the step slower on CPU (+9 % and
    +22 %). Shapes are dynamic (micro-batches differ in length), so one graph serves every batch."""
    compiled = 0
    for module in model.modules():
        if type(module).__name__.endswith(COMPILED_BLOCKS):
            module.compile(dynamic=True)
            compiled += 1
    log.info("train.compile: %d norm and MLP blocks of %s compiled", compiled, type(model).__name__)
    return compiled


def register_float32_attention() -> None:
    """Registers `sdpa_in_float32` with transformers under FLOAT32_ATTENTION (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLOAT32_ATTENTION, sdpa_in_float32)


def sdpa_in_float32(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention computed in float32, the result cast back to the inputs' dtype.

    On CPU, PyTorch's bfloat16 flash-attention backward is several times slower than its float32 one
    (58 against 14 ms a call on the bench model's micro-batches), while the matmuls around it run several
    times faster in bfloat16: a bfloat16 step of the bench model took 20 % less time with this
    attention. A forward with no backward (grad disabled: the reference, old log-probs) keeps the inputs'
    dtype, whose forward kernel is the faster one (8 against 16 ms). Query, key and value are
    (B, heads, T, head_dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not torch.is_grad_enabled():  # a forward with no backward: bfloat16 is the faster one (2x)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = query.dtype
    out, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return out.to(dtype), weights


def token_logprobs_and_entropy(
    logits: Tensor, targets: Tensor, entropy_grad: bool, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target and the entropy per position, in float32 chunks along T, of the
    distribution softmax(logits / temperature).

    `logits` (B, T, V), `targets` (B, T) → `(logp, entropy)`, both (B, T). The entropy carries a
    gradient only with `entropy_grad` (it is otherwise a metric and needs no graph).
    """
    logps, entropies = [], []
    for start in range(0, logits.shape[1], LOGPROB_CHUNK):
        chunk = logits[:, start : start + LOGPROB_CHUNK].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        target = targets[:, start : start + LOGPROB_CHUNK].unsqueeze(-1)
        logps.append(chunk.gather(-1, target).squeeze(-1) - torch.logsumexp(chunk, dim=-1))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies.append(entropy_from_logits(chunk))
    return torch.cat(logps, dim=1), torch.cat(entropies, dim=1)


# -- optimiser ------------------------------------------------------------------------------------------


def lr_multiplier(step: int, optim: OptimSpec, total_steps: int) -> float:
    """Factor on the peak LR at optimizer step `step` (0-based): linear warm-up to 1 over
    `warmup_steps` (the first step already moves), then constant, linear or cosine decay to 0 at
    `total_steps`."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    if optim.schedule == "linear":
        return 1.0 - progress
    if optim.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def build_optimizer(model: nn.Module, spec: RunSpec, lr: float | None = None) -> tuple[AdamW, LambdaLR]:
    """AdamW over the trainable parameters and its LR schedule from `spec.optim`; peak `lr` (default
    `optim.lr`)."""
    optim = spec.optim
    params = [p for p in model.parameters() if p.requires_grad]
    peak = optim.lr if lr is None else lr
    optimizer = AdamW(params, lr=peak, betas=optim.betas, weight_decay=optim.weight_decay)

    total_steps = spec.train.steps * spec.algorithm.ppo_epochs  # each epoch is an optimizer step

    def schedule(step: int) -> float:
        return lr_multiplier(step, optim, total_steps)

    return optimizer, LambdaLR(optimizer, schedule)


def clip_and_step(
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    clip: float | None,
    lr_scale: float = 1.0,
) -> tuple[float, float]:
    """Clip `model`'s global grad norm, step `optimizer`, step `scheduler`; returns (grad_norm, lr used).

    With `lr_scale` < 1 (a step on stale samples, `algorithm.rollout_trust_kl`) the step runs at that
    fraction of the scheduled LR and its (clipped) gradient enters Adam's moments at that weight too:
    scaling the LR alone would leave the whole stale gradient in the momentum, which the next full-LR
    steps would then apply (early in a run Adam's bias-corrected momentum weighs the last few gradients
    almost equally). The schedule itself is untouched."""
    if not 0.0 <= lr_scale <= 1.0:
        raise ValueError(f"lr_scale must be in [0, 1], got {lr_scale}")
    reshard(model)  # the step updates the master weights; the next forward casts them afresh
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip is not None else math.inf)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if lr_scale < 1.0:  # the step's gradient enters the optimizer's moments at the same weight
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], lr_scale)
    scheduled = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
        group["lr"] = lr * lr_scale
    used = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
        group["lr"] = lr  # the scheduled LR again: a chainable scheduler's next value builds on it
    scheduler.step()
    return float(norm), used
