"""`[algorithm]`, `[optim]`, `[train]` and `[weights]`: the learner's estimator, loss, optimiser,
schedule and weight publishing."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from rlfabric.runspec.base import (
    MAX_BATCH,
    MAX_KEEP,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    SpecModel,
)

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
ADVANTAGE_ALIASES = {"ppo": "gae"}
"""Other names users know an estimator by: PPO is GAE with a critic (`algorithm.advantage = "gae"`)."""


class KLSpec(SpecModel):
    """KL to the frozen reference: the safety rail against reward hacking."""

    coef: float = Field(default=0.0, ge=0.0)
    """Initial coefficient; 0 never loads the reference model."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(policy || reference)."""
    mode: Literal["loss", "reward"] = "loss"
    """loss: add coef*KL to the loss; reward: subtract it from per-token rewards."""
    target: float | None = Field(default=None, gt=0.0)
    """Target KL for the adaptive controller; None keeps the coefficient fixed."""
    horizon: int = Field(default=10000, ge=1, le=MAX_STEPS)
    """Horizon (in samples) of the adaptive controller."""


class OverlongSpec(SpecModel):
    """DAPO overlong shaping and truncation masking."""

    penalty: bool = False
    """Add a soft penalty in the last `buffer_tokens` before max_tokens (and -1 past it)."""
    buffer_tokens: int = Field(default=64, ge=1, le=MAX_TOKENS)
    """Width of the soft punishment zone."""
    mask_truncated: bool = False
    """Exclude completions cut at max_tokens from the loss."""


class AlgorithmSpec(SpecModel):
    """Advantage estimator and loss."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = "grpo"
    """Estimator; gae trains a critic (PPO; "ppo" is accepted as its name, see `ADVANTAGE_ALIASES`)."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"] = (
        "token_mean"
    )
    """How per-token losses are reduced; constant is Dr.GRPO's fixed normaliser."""
    clip_eps_low: float = Field(default=0.2, gt=0.0)
    """PPO clip range below 1."""
    clip_eps_high: float = Field(default=0.2, gt=0.0)
    """PPO clip range above 1; DAPO's clip-higher raises it (e.g. 0.28)."""
    dual_clip: float | None = Field(default=None, gt=1.0)
    """Dual-clip bound c for negative advantages; None disables it."""
    gspo: bool = False
    """Use the sequence-level (geometric mean) importance ratio of GSPO."""
    tis_cap: float | None = Field(default=2.0, gt=0.0)
    """Upper bound of the rollout correction's per-token weight `p_trainer / p_engine` (TIS's cap); None
    disables the correction."""
    rollout_correction: Literal["truncate", "mask_token", "mask_sequence"] = "truncate"
    """How the engine's log-probs correct the trainer/engine mismatch and the policy lag of asynchronous
    runs (with `old_policy = "trainer"`). `truncate` (TIS): weight each token by `min(w, tis_cap)`.
    `mask_token` (IcePop, token-level MIS): weight by `w` inside `[rollout_mask_low, tis_cap]`, drop the
    token's gradient outside. `mask_sequence` (sequence-level MIS): drop whole samples whose geometric-mean
    `w` leaves that range, truncate the rest. The masks keep one- or two-step-stale samples from pushing
    tokens the policy has moved away from."""
    rollout_mask_low: float = Field(default=0.5, gt=0.0, lt=1.0)
    """Lower bound of the weight the `mask_*` corrections keep."""
    rollout_trust_kl: float | None = Field(default=None, gt=0.0)
    """A trust region on stale samples (asynchronous runs): when the step's KL between the engine's
    sampling policy and the trainer's (`rollout_mismatch_kl`, nats per token, averaged over the step)
    exceeds this, the policy's learning rate for that step, and the weight its gradient gets in Adam's
    moments, are scaled by `rollout_trust_kl / rollout_mismatch_kl` (reported as `lr_scale`). Per-token
    corrections reweight the gradient, but Adam normalises its size, so a step on samples from a policy
    far from the current one still moves the weights by about the full learning rate, and its momentum
    carries the stale direction into the next steps; this bounds both. On-policy the mismatch is ~1e-5
    and the step is untouched. None (default) disables it."""
    old_policy: Literal["trainer", "rollout"] = "trainer"
    """The policy the PPO ratio is taken against. `trainer`: the learner's own log-probs before the
    step (a ratio of 1 with one epoch), and TIS corrects for the engine's samples. `rollout`: the
    engine's log-probs of the sampled tokens, i.e. the behaviour policy that generated them, so the clip
    bounds how far a step moves from it however stale the samples are (asynchronous runs); the ratio is
    then the importance weight itself and TIS is not applied on top."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    kl: KLSpec = Field(default_factory=KLSpec)
    """KL to the reference."""
    overlong: OverlongSpec = Field(default_factory=OverlongSpec)
    """Overlong shaping."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """GAE discount (gae only)."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    """GAE lambda (gae only)."""
    ppo_epochs: int = Field(default=1, ge=1, le=MAX_KEEP)
    """Optimisation passes over each batch."""
    value_coef: float = 0.5
    """Weight of the critic's value loss (gae only, where it must be > 0). The critic has its own
    optimiser, so this scales only the critic's gradient, before its clipping."""
    value_clip: float | None = Field(default=0.2, gt=0.0)
    """The critic's new values may move at most this far from the old ones in the value loss (PPO2's
    value clipping, on the raw return scale); None disables it (gae only)."""

    @field_validator("advantage", mode="before")
    @classmethod
    def _alias(cls, value: Any) -> Any:
        """An alias (`ADVANTAGE_ALIASES`) becomes the estimator's registered name."""
        return ADVANTAGE_ALIASES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _masks_have_bounds(self) -> AlgorithmSpec:
        if self.rollout_correction != "truncate" and (self.tis_cap is None or self.tis_cap <= 1.0):
            raise ValueError(
                f"algorithm.tis_cap must be > 1 with rollout_correction {self.rollout_correction!r}: it is "
                f"the upper bound of the weights kept (got {self.tis_cap})"
            )
        return self

    @model_validator(mode="after")
    def _gae_trains_a_critic(self) -> AlgorithmSpec:
        if self.advantage == "gae" and self.value_coef <= 0:
            raise ValueError(
                f"algorithm.value_coef must be > 0 with advantage 'gae': the critic is trained only by the"
                f" value loss (got {self.value_coef})"
            )
        return self


class OptimSpec(SpecModel):
    """AdamW and the learning-rate schedule."""

    lr: float = Field(default=1e-6, gt=0.0)
    """Peak learning rate."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    betas: Annotated[tuple[float, float], Field(strict=False)] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    """Linear warm-up steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up."""
    grad_clip: float | None = Field(default=1.0, gt=0.0)
    """Max global gradient norm; None disables clipping. The critic's norm is clipped separately."""
    critic_lr: float | None = Field(default=None, gt=0.0)
    """Peak learning rate of the critic (gae only), on the same schedule; None is 10 x `lr` (a fresh
    value head must move faster than a pre-trained policy)."""

    @property
    def critic_peak_lr(self) -> float:
        """`critic_lr`, or its default of 10 x `lr`."""
        return self.critic_lr if self.critic_lr is not None else 10.0 * self.lr


class TrainSpec(SpecModel):
    """Steps, batches and checkpoints of the learner."""

    steps: int = Field(default=100, ge=1, le=MAX_STEPS)
    """Optimizer steps in the run."""
    groups_per_step: int = Field(default=8, ge=1, le=MAX_BATCH)
    """Scored groups consumed per step; in `offline_preference` and `reward_model` modes, preference pairs
    (KTO: rows) per step; in `sft` mode, rows (conversations) per step."""
    micro_batch_size: int = Field(default=8, ge=1, le=MAX_BATCH)
    """Sequences per forward/backward; gradients are accumulated over the step."""
    checkpoint_every: int = Field(default=10, ge=1, le=MAX_STEPS)
    """Write a resumable checkpoint every k steps (and at the end)."""
    keep_checkpoints: int = Field(default=2, ge=1, le=MAX_KEEP)
    """Complete checkpoints kept (older ones are deleted); keep more to roll back further."""
    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    packing: bool = True
    """Pack each micro-batch's samples into one row with each group's prompt computed once instead of once
    per sample, and no padding (`rlfabric.learner.packing`; policy-gradient modes, the policy and the
    reference). The log-probs are the padded layout's; a group of 8 samples whose prompt is 3/4 of each
    sample computes ~1/3 of the tokens. In `sft` mode (and a warm start) the examples are sorted by their
    ids and each micro-batch computes the prefix its examples share and do not train on (a system turn,
    tool schemas) once. Models with sliding-window attention layers are never packed."""
    compile: bool = False
    """`torch.compile` the models' element-wise blocks (normalisation layers and MLPs) into fused kernels;
    attention and the matmuls stay eager. On CPU in bfloat16 a learner step of the bench model took
    9-20 % less time (docs/benchmarks.md). The first step runs eager; compiling (~10-40 s, less once
    inductor's on-disk cache holds the kernels) follows it, while the replicas generate the second step.
    Worth it for long runs; off by default so short runs and tests start at once."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the learner's RNGs."""


class WeightsSpec(SpecModel):
    """How new policy versions reach the rollout replicas."""

    transport: Literal["object_store", "broadcast"] = "object_store"
    """object_store: safetensors + manifest under `url`; broadcast: torch.distributed (gloo/NCCL)."""
    url: str | None = None
    """fsspec URL for published versions; defaults to <output_dir>/<run>/weights."""
    bucket_bytes: int = Field(default=256 << 20, ge=1 << 20, le=1 << 36)
    """Broadcast bucket size."""
    keep_versions: int = Field(default=3, ge=1, le=MAX_KEEP)
    """Published versions kept in the object store (older ones are deleted)."""
