"""Memory formulas of an rlfabric run: what each role holds on one device, line by line, with the formula.

A learner rank holds the policy and, depending on the algorithm, a frozen reference (KL coefficient > 0)
and a critic (the gae estimator); a rollout replica holds the policy's weights and its KV cache; a reward
service may hold a reward model. Every line is a `Line` whose `formula` shows the numbers substituted, so
a reader can check it by hand; docs/plan_formulas.md explains each and where its constants come from.

How the learner allocates (src/rlfabric/learner): master weights are float32 and sharded by FSDP2 over
the world; the forward and backward compute in the run's dtype on all-gathered copies (in a world of one
every layer stays gathered for the whole step, `dist.shard_model`); gradients are reduced in float32 into
sharded `.grad`s (in a world of one they first accumulate unsharded over the micro-batches,
`dist.defer_gradient_sync`); AdamW keeps two float32 moments per parameter. Per micro-batch the policy's
forward keeps every layer's activations for the backward (only each layer's input with activation
checkpointing) and its logits (B, T, V), of which `parts.token_logprobs_and_entropy` takes float32 chunks.

The learner's peak is in the policy's backward: the reference's and the critic's forward-only passes run
before it and keep nothing but (B, T) vectors, and the critic's own backward comes after the policy's
activations are freed. Lines that are not resident at the peak are shown with 0 bytes and say so, so that
a rank's total is the sum of its roles' totals.

No torch import: the planner runs without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from rlfabric.plan.arch import DTYPE_BYTES, ModelArch
from rlfabric.plan.lora import adapted_output_width, adapter_params

if TYPE_CHECKING:
    from rlfabric.runspec import LoraSpec, RunSpec

Device = Literal["cpu", "cuda"]

MiB = 1 << 20
DEFAULT_PROMPT_TOKENS = 256
"""Prompt length assumed when the caller gives none (a run spec does not bound its prompts)."""
FLOAT32 = 4
ADAM_MOMENTS = 2
"""AdamW keeps exp_avg and exp_avg_sq, float32, one each per trainable parameter."""

CPU_FRAMEWORK_BYTES = 495 * MiB
"""RSS of a learner process on CPU besides its model: Python, torch, transformers, the learner modules, a
gloo process group and what the first forward/backward loads lazily (kernels, thread pools). Measured by
`bench/plan.py`'s `framework` probe (the tiny model trained two steps on one 32-token sequence: 506
MiB on torch 2.13 / transformers 5.19, x86-64) less the tiny model's own ~12 MiB."""
CPU_SLACK_PARAM_COPIES = 1
"""Float32 parameter-sized copies the CPU allocator holds beyond the live tensors: the gathered weights
and gradient accumulators are freed and re-allocated every step, and glibc keeps freed heap blocks."""
CPU_SLACK_ACTIVATIONS = 0.25
"""Share of the activations the CPU allocator holds on top (freed blocks of one micro-batch not reused
by the next: tensors under glibc's 32 MiB mmap threshold stay in the heap). The slack constants were
fitted once on the bench and 100M models (bench/plan.py) and are shown as their own "allocator
slack" line; on a GPU the prediction is compared with `torch.cuda.max_memory_allocated`, which counts
live tensors only, and the line is 0."""
CPU_SHARDED_PARAM_COPIES = 3
"""Unsharded float32 parameter-sized copies a rank's RSS holds beyond the sharded state when world > 1
on CPU (FSDP2 over gloo): measured at world 2 on the bench and 100M models with one short sequence per
micro-batch, 2.9 and 2.7 copies over the prediction without them. Each rank loads the whole model before
sharding it and gathers and frees whole layers every micro-batch; which of these the heap keeps was not
identified further, and larger worlds were not measured."""
CUDA_CONTEXT_BYTES = 600 * MiB
"""Device memory the CUDA context and kernels' workspaces take before any tensor (a typical figure for a
recent driver on an H100; not measured here)."""
ROLLOUT_CPU_OVERHEAD_BYTES = 1800 * MiB
"""RSS of a vLLM engine's process tree on CPU beyond its weights and KV cache (front end, engine core,
worker): bench/results/rollout_memory.md measured a tree PSS of ~1,800 MiB with a 13 MiB model."""
ROLLOUT_CUDA_OVERHEAD_BYTES = 1500 * MiB
"""vLLM's GPU memory beyond weights and KV cache (CUDA context, graphs, sampler workspace): an estimate."""

ACTIVATION_WIDTHS = {"hidden": 6, "q": 5, "mlp": 4}
"""Per token and layer, the vectors of each width a decoder layer keeps for its backward, counted from the
autograd graph of transformers' Llama/Qwen2 layer: hidden (6): the layer input, both RMSNorms' normalised
values and outputs, the residual after attention; query width (5): the rotated queries, keys and values as
attention saves them (k and v repeated to the query heads), the attention output and its contiguous copy
for o_proj; MLP width (4): gate, SiLU(gate), up, and their product."""
RECOMPUTED_LAYERS = 3
"""With activation checkpointing, layers' worth of activations alive in the backward besides the saved
inputs: the recomputed layer, its gradients, and the blocks of the previous one that the allocator has
not reused yet. Calibrated on the bench model (bench/plan.py, `bench GRPO mb 16 ckpt`)."""
LOGITS_COPIES = 3
"""Float32 (B, T, V) buffers alive at the policy's peak: the logits, their gradient and the log-softmax's
saved input (`parts.token_logprobs_and_entropy`); a bfloat16 run adds the compute-dtype logits."""
PREFETCH_LAYERS = 2
"""Gathered layers alive at once in a sharded world: the one computing and the one FSDP2 prefetches."""

WEIGHTS = "weights"
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer states"
ACTIVATIONS = "activations"
LOGITS_BUFFERS = "logits buffers"
COMMUNICATION_BUCKETS = "communication buckets"
KV_CACHE = "kv cache"
ALLOCATOR_SLACK = "allocator slack"
FRAMEWORK_OVERHEAD = "framework overhead"
LINE_NAMES = (
    WEIGHTS,
    GRADIENTS,
    OPTIMIZER_STATES,
    COMMUNICATION_BUCKETS,
    ACTIVATIONS,
    LOGITS_BUFFERS,
    KV_CACHE,
    ALLOCATOR_SLACK,
    FRAMEWORK_OVERHEAD,
)
"""Every `Line.name` the planner prints, in the order of a report."""


@dataclass(frozen=True)
class Line:
    """One line of a role's memory: what it is, its bytes and how they were computed."""

    name: str
    """One of `LINE_NAMES`."""
    bytes: int
    formula: str
    """Human-readable, with the numbers substituted."""


@dataclass(frozen=True)
class RoleMemory:
    """What one role holds on one device."""

    role: str
    """"policy" | "reference" | "critic" | "reward" | "rollout"."""
    lines: tuple[Line, ...]

    @property
    def total(self) -> int:
        """Sum of the lines."""
        return sum(line.bytes for line in self.lines)


@dataclass(frozen=True)
class LearnerShape:
    """What one learner rank does per micro-batch, from a run spec (`learner_shape`)."""

    world: int
    """Learner ranks (FSDP shard degree)."""
    micro_batch: int
    """Sequences per forward/backward (B)."""
    seq_len: int
    """Tokens per sequence (T): prompt + max_tokens, at most max_model_len."""
    dtype: str
    """Compute dtype of forward and backward."""
    master_fp32: bool = True
    """Master weights, gradients and optimizer states in float32 (the learner always keeps them so)."""
    checkpointing: bool = False
    """Activation checkpointing: only each layer's input is kept, the layer is recomputed in backward."""
    critic: bool = False
    """A PPO critic (gae) is trained beside the policy."""
    reference: bool = False
    """A frozen reference is loaded (KL coefficient > 0)."""
    bucket_bytes: int = 256 * MiB
    """Weights broadcast bucket (`WeightsSpec.bucket_bytes`); rank 0 packs one when publishing."""
    publishes_weights: bool = False
    """Rank 0 packs weight buckets for the broadcast transport."""
    lora: LoraSpec | None = None
    """LoRA adapters are trained instead of the policy's weights (`model.lora`)."""
    reference_is_policy: bool = False
    """The KL reference is the policy with its adapters off (LoRA without `reference_path`): no copy."""

    @property
    def compute_bytes(self) -> int:
        """Bytes per element in the compute dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def master_bytes(self) -> int:
        """Bytes per master weight, gradient and moment."""
        return FLOAT32 if self.master_fp32 else self.compute_bytes

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch: B x T."""
        return self.micro_batch * self.seq_len


def resolve_dtype(spec_dtype: str, device: Device) -> str:
    """`auto` is bfloat16 on a GPU; on a CPU what `rlfabric.runtime.hardware` picks for this machine."""
    if spec_dtype != "auto":
        return spec_dtype
    if device == "cuda":
        return "bfloat16"
    from rlfabric.runtime.hardware import auto_dtype

    return auto_dtype("cpu")


def sequence_length(spec: RunSpec, prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> int:
    """Prompt + max_tokens, at most the model's max_model_len."""
    return min(prompt_tokens + spec.rollout.sampling.max_tokens, spec.model.max_model_len)


def learner_shape(
    spec: RunSpec, world: int, *, prompt_tokens: int = DEFAULT_PROMPT_TOKENS, device: Device = "cpu"
) -> LearnerShape:
    """The learner's per-rank shape for `spec` on `world` ranks."""
    algo = spec.algorithm
    return LearnerShape(
        world=world,
        micro_batch=spec.train.micro_batch_size,
        seq_len=sequence_length(spec, prompt_tokens),
        dtype=resolve_dtype(spec.model.dtype, device),
        checkpointing=spec.train.activation_checkpointing,
        critic=algo.advantage == "gae",
        reference=algo.kl.coef > 0,
        bucket_bytes=spec.weights.bucket_bytes,
        publishes_weights=spec.weights.transport == "broadcast",
        lora=spec.model.lora,
        reference_is_policy=spec.model.lora is not None and spec.model.reference_path is None,
    )


# -- formatting -----------------------------------------------------------------------------------------


def n(value: int) -> str:
    """An integer with thousands separators, for formulas."""
    return f"{value:,}"


def _world(shape: LearnerShape) -> str:
    return f" / world {shape.world}"


# -- learner lines --------------------------------------------------------------------------------------


def master_weights(params: int, shape: LearnerShape) -> Line:
    """The sharded master weights."""
    b = shape.master_bytes
    return Line(WEIGHTS, params * b // shape.world, f"{n(params)} params x {b} B{_world(shape)}")


def gradients(params: int, shape: LearnerShape) -> Line:
    """Sharded float32 gradients; in a world of one also the unsharded accumulators of deferred sync."""
    b = shape.master_bytes
    if shape.world == 1:
        return Line(
            GRADIENTS,
            2 * params * b,
            f"{n(params)} params x {b} B x 2 (unsharded accumulator + sharded .grad, world 1)",
        )
    return Line(GRADIENTS, params * b // shape.world, f"{n(params)} params x {b} B{_world(shape)}")


def optimizer_states(params: int, shape: LearnerShape) -> Line:
    """AdamW's two float32 moments, sharded."""
    return Line(
        OPTIMIZER_STATES,
        ADAM_MOMENTS * params * FLOAT32 // shape.world,
        f"{n(params)} params x {ADAM_MOMENTS} moments x {FLOAT32} B{_world(shape)}",
    )


def gathered_weights(arch: ModelArch, params: int, shape: LearnerShape) -> Line:
    """FSDP2's unsharded compute-dtype copies: every layer in a world of one (they stay gathered), else the
    root's (embeddings, final norm, LM head: never resharded) plus the layers in flight, with their
    reduce-scatter buffers."""
    b = shape.compute_bytes
    if shape.world == 1:
        return Line(
            COMMUNICATION_BUCKETS,
            params * b,
            f"{n(params)} params x {b} B (all layers stay gathered in a world of one)",
        )
    root = params - arch.num_hidden_layers * arch.layer_params()
    layer = arch.layer_params()
    gathered = (root + PREFETCH_LAYERS * layer) * b
    reduce_scatter = layer * FLOAT32 * (1 + 1 / shape.world)
    return Line(
        COMMUNICATION_BUCKETS,
        int(gathered + reduce_scatter),
        f"({n(root)} root + {PREFETCH_LAYERS} x {n(layer)} layer params) x {b} B all-gathered"
        f" + {n(layer)} x {FLOAT32} B x (1 + 1/{shape.world}) reduce-scatter",
    )


def layer_token_widths(arch: ModelArch) -> int:
    """Elements one decoder layer keeps per token for its backward (`ACTIVATION_WIDTHS`): the hidden-width
    tensors, the query-width ones (k and v counted at the query width: attention with a padding mask
    repeats them to every query head), and the MLP's (the routed experts' for a mixture of experts)."""
    widths = ACTIVATION_WIDTHS
    return widths["hidden"] * arch.hidden_size + widths["q"] * arch.q_width + widths["mlp"] * _mlp_width(arch)


def _mlp_width(arch: ModelArch) -> int:
    """MLP activations' width per token: the dense MLP's, or the routed experts' together."""
    if not arch.num_experts:
        return arch.intermediate_size
    return arch.expert_width * max(arch.num_experts_per_tok, 1)


def layer_activation_bytes(arch: ModelArch, shape: LearnerShape) -> int:
    """What one decoder layer keeps for its backward per micro-batch."""
    return shape.tokens * layer_token_widths(arch) * shape.compute_bytes


def _widths_formula(arch: ModelArch) -> str:
    w = ACTIVATION_WIDTHS
    return (
        f"({w['hidden']} x {arch.hidden_size} h + {w['q']} x {arch.q_width} q"
        f" + {w['mlp']} x {_mlp_width(arch)} i)"
    )


def activations(arch: ModelArch, shape: LearnerShape) -> Line:
    """Saved activations of one micro-batch: every layer's plus one more layer's worth of gradients and
    temporaries while the backward starts; with checkpointing each layer's input plus
    `RECOMPUTED_LAYERS` layers' worth (the recomputed layer, its gradients, the blocks just freed)."""
    layers, b, bt = arch.num_hidden_layers, shape.compute_bytes, shape.tokens
    per_layer = f"{n(bt)} tokens x {_widths_formula(arch)} x {b} B"
    layer = layer_activation_bytes(arch, shape)
    if shape.checkpointing:
        inputs = layers * bt * arch.hidden_size * b
        return Line(
            ACTIVATIONS,
            inputs + RECOMPUTED_LAYERS * layer,
            f"{layers} layers x {n(bt)} tokens x {arch.hidden_size} h x {b} B (layer inputs)"
            f" + {RECOMPUTED_LAYERS} x {per_layer}",
        )
    return Line(ACTIVATIONS, (layers + 1) * layer, f"({layers} + 1) layers x {per_layer}")


def with_adapter_activations(act: Line, arch: ModelArch, shape: LearnerShape, lora: LoraSpec) -> Line:
    """`act` plus what PEFT's LoRA layers keep: one more output-sized tensor per adapted projection of
    every layer whose activations are held (measured: `bench/plan.py`'s LoRA configurations)."""
    layers = RECOMPUTED_LAYERS if shape.checkpointing else arch.num_hidden_layers + 1
    width = adapted_output_width(arch, lora)
    extra = layers * shape.tokens * width * shape.compute_bytes
    b = shape.compute_bytes
    formula = f" + {layers} layers x {n(shape.tokens)} tokens x {n(width)} adapted outputs x {b} B"
    return Line(act.name, act.bytes + extra, act.formula + formula)


def logits_buffers(arch: ModelArch, shape: LearnerShape) -> Line:
    """The policy's (B, T, V) logits, their float32 log-softmax input and gradient."""
    bt, v = shape.tokens, arch.vocab_size
    copies = LOGITS_COPIES * FLOAT32 + (shape.compute_bytes if shape.compute_bytes != FLOAT32 else 0)
    return Line(
        LOGITS_BUFFERS,
        bt * v * copies,
        f"{n(bt)} tokens x {n(v)} vocab x {copies} B ({LOGITS_COPIES} float32 copies"
        + (f" + {shape.compute_bytes} B compute-dtype logits)" if copies > LOGITS_COPIES * FLOAT32 else ")"),
    )


def framework_overhead(device: Device) -> Line:
    """The process's memory before any model (CPU: RSS after imports; GPU: the CUDA context)."""
    if device == "cuda":
        context = CUDA_CONTEXT_BYTES
        return Line(FRAMEWORK_OVERHEAD, context, f"CUDA context ~{n(context // MiB)} MiB (estimate)")
    return Line(
        FRAMEWORK_OVERHEAD,
        CPU_FRAMEWORK_BYTES,
        f"Python + torch + transformers + learner RSS {n(CPU_FRAMEWORK_BYTES // MiB)} MiB (measured)",
    )


def _not_at_peak(name: str, bytes_: int, why: str) -> Line:
    """A transient that is freed before the rank's peak: shown with its size, counted as 0."""
    return Line(name, 0, f"0 at the peak ({n(bytes_)} B {why})")


def allocator_slack(params: int, activation_bytes: int, shape: LearnerShape, device: Device) -> Line:
    """What a CPU rank's RSS holds beyond the live tensors (`CPU_SLACK_PARAM_COPIES`,
    `CPU_SLACK_ACTIVATIONS`, and at world > 1 `CPU_SHARDED_PARAM_COPIES`); 0 on a GPU, whose peak is
    counted in live tensors."""
    if device == "cuda":
        return Line(ALLOCATOR_SLACK, 0, "0 (max_memory_allocated counts live tensors)")
    copies = CPU_SLACK_PARAM_COPIES * params * FLOAT32 // shape.world
    extra = int(CPU_SLACK_ACTIVATIONS * activation_bytes)
    formula = (
        f"{CPU_SLACK_PARAM_COPIES} x {n(params)} params x {FLOAT32} B{_world(shape)}"
        f" + {CPU_SLACK_ACTIVATIONS:.0%} x {n(activation_bytes)} B activations"
    )
    if shape.world > 1:
        copies += CPU_SHARDED_PARAM_COPIES * params * FLOAT32
        formula += f" + {CPU_SHARDED_PARAM_COPIES} x {n(params)} params x {FLOAT32} B (unsharded, world > 1)"
    return Line(ALLOCATOR_SLACK, copies + extra, formula + " (measured on CPU)")


def policy_memory(policy: ModelArch, shape: LearnerShape, device: Device) -> RoleMemory:
    """The trained policy's lines, the process's overhead included. With LoRA the adapters' parameters
    join the weights and only they have gradients and optimizer states."""
    p = policy.params()
    trainable = p
    if shape.lora is not None:
        trainable = adapter_params(policy, shape.lora)
        p += trainable
    act = activations(policy, shape)
    if shape.lora is not None:
        act = with_adapter_activations(act, policy, shape, shape.lora)
    lines = (
        master_weights(p, shape),
        gradients(trainable, shape),
        optimizer_states(trainable, shape),
        gathered_weights(policy, p, shape),
        act,
        logits_buffers(policy, shape),
        allocator_slack(p, act.bytes, shape, device),
        framework_overhead(device),
    )
    return RoleMemory("policy", lines)


def reference_memory(reference: ModelArch, shape: LearnerShape) -> RoleMemory:
    """The frozen reference: held in the compute dtype in a world of one (nothing to shard), else sharded
    float32 with its gathered layers; its forward runs before the policy's and keeps only (B, T) log-probs.
    With LoRA and no other reference named, it is the policy with its adapters off: nothing of its own."""
    if shape.reference_is_policy:
        return RoleMemory("reference", (Line(WEIGHTS, 0, "0: the policy's own weights, adapters off"),))
    p = reference.params()
    if shape.world == 1:
        b = shape.compute_bytes
        weights = Line(WEIGHTS, p * b, f"{n(p)} params x {b} B (compute dtype, unsharded in world 1)")
        buckets = Line(COMMUNICATION_BUCKETS, 0, "none: not sharded in a world of one")
    else:
        weights = master_weights(p, shape)
        buckets = gathered_weights(reference, p, shape)
    forward = activations(reference, replace(shape, checkpointing=True))
    return RoleMemory(
        "reference",
        (
            weights,
            buckets,
            _not_at_peak(ACTIVATIONS, forward.bytes, "during the frozen pass, before the policy's forward"),
        ),
    )


def critic_memory(critic: ModelArch, shape: LearnerShape, device: Device) -> RoleMemory:
    """The critic: trained like the policy (backbone + value head), its backward after the policy's."""
    p = critic.backbone_params() + critic.hidden_size + 1  # value head: Linear(h, 1)
    act = activations(critic, shape)
    return RoleMemory(
        "critic",
        (
            master_weights(p, shape),
            gradients(p, shape),
            optimizer_states(p, shape),
            gathered_weights(critic, p, shape),
            _not_at_peak(ACTIVATIONS, act.bytes, "during its own backward, after the policy's is freed"),
            allocator_slack(p, 0, shape, device),
        ),
    )


def learner_memory(
    shape: LearnerShape,
    policy: ModelArch,
    *,
    critic: ModelArch | None = None,
    reference: ModelArch | None = None,
    device: Device = "cpu",
) -> list[RoleMemory]:
    """Per learner rank at its peak: the policy's lines, then the reference's and the critic's when the
    shape has them (each defaults to the policy's architecture)."""
    roles = [policy_memory(policy, shape, device)]
    if shape.reference:
        roles.append(reference_memory(reference or policy, shape))
    if shape.critic:
        roles.append(critic_memory(critic or policy, shape, device))
    return roles


def rank_total(roles: list[RoleMemory]) -> int:
    """A rank's predicted peak: the sum of its roles' totals."""
    return sum(role.total for role in roles)


# -- rollout and reward ---------------------------------------------------------------------------------

CPU_BLOCK_TOKENS = 128
"""vLLM's KV-cache block size on CPU (16 on GPU): a sequence holds whole blocks."""
GPU_BLOCK_TOKENS = 16


def kv_cache_needed(arch: ModelArch, *, concurrency: int, seq_len: int, dtype: str, block: int) -> int:
    """Bytes of KV cache `concurrency` sequences of `seq_len` tokens occupy: keys and values of every
    layer, rounded up to whole blocks."""
    tokens = math.ceil(seq_len / block) * block
    return concurrency * tokens * 2 * arch.num_hidden_layers * arch.kv_width * DTYPE_BYTES[dtype]


def rollout_memory(
    spec: RunSpec,
    arch: ModelArch,
    *,
    concurrency: int,
    device: Device = "cpu",
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    kv_cache_bytes: int | None = None,
) -> RoleMemory:
    """A rollout replica: weights in the run's dtype, the KV cache for `concurrency` sequences of prompt +
    max_tokens (or `kv_cache_bytes` when the replica is configured with a size: vLLM on CPU allocates
    exactly that, `EngineConfig.kv_cache_bytes`), and the engine's overhead."""
    dtype = resolve_dtype(spec.model.dtype, device)
    b, p = DTYPE_BYTES[dtype], arch.params()
    seq = sequence_length(spec, prompt_tokens)
    block = GPU_BLOCK_TOKENS if device == "cuda" else CPU_BLOCK_TOKENS
    needed = kv_cache_needed(arch, concurrency=concurrency, seq_len=seq, dtype=dtype, block=block)
    kv_formula = (
        f"{concurrency} seqs x ceil({seq} / {block}) x {block} tokens x 2 (k, v) x {arch.num_hidden_layers}"
        f" layers x {arch.kv_width} kv width x {b} B"
    )
    if kv_cache_bytes is not None:
        configured = f"configured {n(kv_cache_bytes)} B (needs {n(needed)}: {kv_formula})"
        kv = Line(KV_CACHE, kv_cache_bytes, configured)
    else:
        kv = Line(KV_CACHE, needed, kv_formula)
    overhead = ROLLOUT_CUDA_OVERHEAD_BYTES if device == "cuda" else ROLLOUT_CPU_OVERHEAD_BYTES
    return RoleMemory(
        "rollout",
        (
            Line(WEIGHTS, p * b, f"{n(p)} params x {b} B"),
            kv,
            Line(FRAMEWORK_OVERHEAD, overhead, f"vLLM engine ~{n(overhead // MiB)} MiB"),
        ),
    )


def reward_model_memory(arch: ModelArch, *, batch: int, seq_len: int, device: Device = "cpu") -> RoleMemory:
    """A reward model scoring `batch` sequences of `seq_len` tokens: weights in their stored dtype, one
    layer's forward transients at a time (no backward), a scalar head (no (B, T, V) logits)."""
    b, p = arch.dtype_bytes, arch.backbone_params() + arch.hidden_size
    shape = LearnerShape(world=1, micro_batch=batch, seq_len=seq_len, dtype=arch.torch_dtype)
    layer = layer_activation_bytes(arch, shape)
    return RoleMemory(
        "reward",
        (
            Line(WEIGHTS, p * b, f"{n(p)} params x {b} B (backbone + score head)"),
            Line(ACTIVATIONS, layer, f"one layer's forward: {n(batch * seq_len)} tokens (no backward)"),
            framework_overhead(device),
        ),
    )
