"""The run spec: the user's run file (TOML, YAML or JSON), and the body of `POST /v1/runs`.

This module is the one home of every training-loop default: model, dataset, sampling, reward, algorithm,
optimiser, schedule and weight transport. Services read the sections they need; no service re-declares a
default. A run file holds overrides only, e.g.

    [model]
    path = "Qwen/Qwen2.5-0.5B-Instruct"

    [dataset]
    path = "data/gsm8k.jsonl"

    [reward]
    scorer = "math_verify"
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from rlfabric.environment.run_spec import RunEnvironmentSpec
from rlfabric.plan.resources import ResourcesSpec
from rlfabric.runtime.config import StrictModel

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
ADVANTAGE_ALIASES = {"ppo": "gae"}
"""Other names users know an estimator by: PPO is GAE with a critic (`algorithm.advantage = "gae"`)."""

MAX_TOKENS = 1 << 20
"""Upper bound of every length in tokens (context, completion, buffers, top-k): about a million."""
MAX_STEPS = 10_000_000
"""Upper bound of every count of steps or samples (steps, warm-up, intervals, epochs, horizons)."""
MAX_BATCH = 100_000
"""Upper bound of every per-step or per-call count (groups, sequences, items in flight or per call)."""
MAX_KEEP = 1000
"""Upper bound of small counts: samples per prompt, kept checkpoints and versions, windows, epochs of PPO."""
MAX_SEED = 2**32 - 1
"""Seeds are unsigned 32-bit."""

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Run names (and so run ids): a letter or digit, then up to 63 letters, digits, `_`, `.` or `-`."""

PathKind = Literal["data", "model"]
"""What a path in a spec names: a dataset (confined to data roots) or a model (to model roots)."""


class SpecModel(StrictModel):
    """Base of every run-spec section. Besides unknown keys being errors, types are strict: no bool -> int,
    str -> int or str -> float coercion (an int is accepted where a float is expected), floats must be
    finite, and every integer field has an upper bound, so a spec cannot ask for absurd sizes."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class TinyModelRecipe(SpecModel):
    """A random tiny model `rlfabric up` builds at `model.path` when nothing is there yet
    (`rlfabric make-tiny-model`'s options): examples and demos that must run without downloading."""

    preset: Literal["tiny", "bench"] = "tiny"
    """Shape: tiny (0.4 M parameters) or bench (24 M)."""
    tokenizer: Literal["char", "bpe"] = "bpe"
    """char: one token per character (ChatML); bpe: a byte-level BPE with a Qwen2.5-style tool template."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    """Seed of the random weights."""


class LoraSpec(SpecModel):
    """Low-rank adapters (LoRA, through PEFT) trained instead of the policy's full weights."""

    rank: int = Field(default=16, ge=1, le=1024)
    """The adapters' rank r."""
    alpha: int = Field(default=32, ge=1, le=1 << 16)
    """Scale numerator: an adapter adds (alpha / r) * B @ A to its layer's weight."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training."""
    target_modules: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names (last component) of the linear layers that get an adapter; the default is every attention and
    MLP projection of Llama/Qwen/Mistral-style models. `["all-linear"]` is PEFT's every linear layer but
    the head."""
    publish: Literal["adapter", "merged"] = "adapter"
    """What each published version holds: the adapter alone (a few MB; replicas serve it beside the base
    model and need `engine.max_adapters` >= 1, which `rlfabric up` sets), or the policy with the adapter
    merged into its weights (any replica, full-weight transfers). Broadcast transport: merged only."""


class ModelSpec(SpecModel):
    """The policy and its frozen reference."""

    path: str
    """Local folder or hub id of the policy, loaded with transformers / vLLM (weights never downloaded by
    tests: they build tiny models with `rlfabric make-tiny-model`)."""
    reference_path: str | None = None
    """Reference model for the KL penalty; defaults to `path`. Online runs do not load it when the KL
    coefficient is 0; offline preference runs load it for dpo, ipo and kto (orpo and simpo need none)."""
    critic_path: str | None = None
    """Causal LM whose transformer backbone (LM head dropped, a fresh scalar value head added) is the PPO
    critic; defaults to `path`. Loaded only with the gae estimator."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype: auto is bfloat16 where the device computes it natively (a GPU with bfloat16, a CPU
    with AMX, or with AVX-512 BF16 where a probe measures bfloat16 faster) and float32 elsewhere
    (`rlfabric.runtime.hardware`); bfloat16 where it is not native warns."""
    max_model_len: int = Field(default=2048, ge=16, le=MAX_TOKENS)
    """Longest prompt + completion in tokens."""
    tiny: TinyModelRecipe | None = None
    """Build a random tiny model at `path` when the folder does not exist yet (`rlfabric up` only; a run
    submitted to the services needs the folder)."""
    lora: LoraSpec | None = None
    """Train LoRA adapters on the frozen policy instead of its weights (online runs). The KL reference is
    then the same model with its adapters disabled (no second copy) unless `reference_path` names another;
    what each published version holds is `lora.publish`'s choice."""

    @property
    def published_adapter(self) -> LoraSpec | None:
        """The LoRA spec when each published version is the adapter alone (replicas serve it beside the
        base model); None for full-weight versions (no LoRA, or `publish = "merged"`)."""
        return self.lora if self.lora is not None and self.lora.publish == "adapter" else None


class EvalSpec(SpecModel):
    """The prompts evaluation scores (`dataset.eval_every_steps`) and how they are sampled. A separate
    set is named by `path` and/or `split`: another file, folder or hub id, or another split of the
    training dataset. Without one, evaluation uses the held-out fraction (`dataset.held_out_fraction`).
    Either way the evaluated rows are never trained on."""

    path: str | None = None
    """File, folder or hub id of the evaluation set; None: the training dataset (its `name` and
    `revision` too)."""
    name: str | None = None
    """Configuration of a hub dataset (`datasets.load_dataset`'s `name`, e.g. "main" for GSM8K)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of `path`."""
    split: str | None = None
    """Split of the evaluation set, e.g. "test" or "train[90%:]"; None: "train" when `path` is set,
    and no separate set when neither is."""
    max_prompts: int = Field(default=0, ge=0, le=MAX_BATCH)
    """Evaluate at most this many prompts (the first ones of the set); 0: all of them."""
    n: int | None = Field(default=None, ge=1, le=MAX_KEEP)
    """Samples per evaluated prompt; None: `rollout.sampling.n`."""
    temperature: float | None = Field(default=None, ge=0.0)
    """Sampling temperature of evaluation; None: `rollout.sampling.temperature`."""
    reward: RewardSpec | None = None
    """An evaluation-only "gold" reward (a `[reward]`-like section, scored by the same reward service):
    each held-out evaluation then records the run's own (proxy) reward as `reward_mean` and this one as
    `gold_reward_mean` (rows: `eval_reward_mean`, `eval_gold_reward_mean`); never trained on. The
    `overoptimization` health check watches the gold reward. None: only the run's reward."""

    @property
    def separate(self) -> bool:
        """True when a separate evaluation set is named (else the held-out fraction is used)."""
        return self.path is not None or self.split is not None


class DatasetSpec(SpecModel):
    """Where prompts come from and how they are drawn. Every source is read with Hugging Face
    `datasets`: a JSONL, JSON, Parquet or CSV file, a folder written by `save_to_disk` (a Dataset or a
    DatasetDict) or holding data files, or a hub id (`org/name`)."""

    path: str
    """Local file or folder, or a hub dataset id (`org/name`, loaded with `datasets.load_dataset`)."""
    name: str | None = None
    """Configuration of a hub dataset (`datasets.load_dataset`'s `name`, e.g. "main" for GSM8K)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of `path`."""
    split: str = "train"
    """Split trained on, e.g. "train" or "train[:90%]" (a single file's only split is "train")."""
    prompt_field: str = "prompt"
    """Column with the prompt: a string, or a list of {role, content} chat messages."""
    reference_field: str | None = "answer"
    """Column with the reference answer passed to the scorer; None if there is none."""
    metadata_fields: list[str] = Field(default_factory=list)
    """Extra columns passed to scorers as keyword arguments (test cases, tags, ...)."""
    chat_template: bool = True
    """Render string prompts as a single user message with the model's chat template."""
    system_prompt: str | None = None
    """System message put before every prompt rendered with the chat template (a chat prompt that
    starts with its own system message keeps it); needs `chat_template` for string prompts."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables of the chat template, e.g. {enable_thinking = false} (JSON values; numbers
    travel as floats)."""
    shuffle_seed: int | None = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the per-epoch shuffle; None keeps file order."""
    epochs: int = Field(default=1, ge=1, le=MAX_STEPS)
    """Passes over the training prompts."""
    held_out_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of the training prompts set aside for evaluation when `eval` names no separate set."""
    eval_every_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    """Evaluate every k learner steps (on `eval`'s set, else the held-out fraction); 0 disables it."""
    eval: EvalSpec = Field(default_factory=EvalSpec)
    """The evaluation set and its sampling."""

    @property
    def evaluated(self) -> bool:
        """True when the run evaluates held-out prompts: every k steps, on a separate set or the held-out
        fraction."""
        return self.eval_every_steps > 0 and (self.eval.separate or self.held_out_fraction > 0)

    @model_validator(mode="after")
    def _eval_is_never_trained_on(self) -> DatasetSpec:
        if not self.eval.separate:
            return self
        if self.held_out_fraction:
            raise ValueError("dataset.held_out_fraction: set it or a separate dataset.eval set, not both")
        same_name = (self.eval.name or self.name) == self.name
        if self.eval.path in (None, self.path) and same_name and self.eval_split == self.split:
            raise ValueError(
                f"dataset.eval.split: {self.split!r} is the training split (evaluation rows are never "
                "trained on); name another split or path"
            )
        return self

    @model_validator(mode="after")
    def _system_prompt_needs_template(self) -> DatasetSpec:
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("dataset.system_prompt: needs dataset.chat_template = true")
        return self

    @property
    def eval_split(self) -> str:
        """The evaluation set's split (`eval.split`, else "train" of a separate path)."""
        return self.eval.split or "train"


class SamplingSpec(SpecModel):
    """Sampling parameters of the rollout engines."""

    n: int = Field(default=8, ge=1, le=MAX_KEEP)
    """Samples per prompt: the group size of group-based estimators."""
    temperature: float = Field(default=1.0, ge=0.0)
    """0 is greedy decoding (useless for group estimators: every sample is equal)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1, le=MAX_TOKENS)
    """Top-k cut-off; -1 disables it."""
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS)
    """Maximum completion length in tokens."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings."""


class RolloutSpec(SpecModel):
    """How generation is scheduled."""

    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """Sampling parameters."""
    max_staleness: int = Field(default=1, ge=0, le=MAX_KEEP)
    """Policy lag bound: 0 is synchronous on-policy; 1 overlaps generation of step t+1 with training of
    step t. Groups generated by an older version are dropped by the learner and counted."""
    max_in_flight_per_replica: int = Field(default=64, ge=1, le=MAX_BATCH)
    """Groups dispatched to one replica and not yet returned."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no learning signal for group estimators); counted."""
    fleet: str | None = Field(default=None, pattern=RUN_NAME_PATTERN)
    """A shared rollout fleet to generate on (its replicas serve several runs' LoRA adapters on one base
    model, `rlfabric serve rollout` with `fleet` set); None: the run's own replicas. Needs
    `model.lora.publish = "adapter"` (a run on a shared fleet never changes the base weights)."""
    fleet_weight: float = Field(default=1.0, gt=0, le=1000)
    """This run's share of the fleet's replica slots against the other runs on it (weighted fair share:
    while several runs wait, each gets slots in proportion to its weight)."""


class ScorerPart(SpecModel):
    """One weighted part of a composite reward."""

    scorer: str
    """Registered scorer name (see `rlfabric reward list`)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The scorer's parameters."""
    weight: float = 1.0
    """Weight of this part in the sum."""
    alias: str | None = None
    """Name of this part in the reward components; defaults to the scorer name."""


class RewardSpec(SpecModel):
    """How completions are scored."""

    scorer: str = "exact_match"
    """Registered scorer name; "composite" uses `parts`."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The scorer's parameters."""
    parts: list[ScorerPart] = Field(default_factory=list)
    """Parts of a composite scorer (only with scorer = "composite")."""
    item_timeout_s: float = Field(default=10.0, gt=0)
    """Deadline per scored item; a scorer past it yields status TIMEOUT, never a reward of 0."""
    batch_size: int = Field(default=64, ge=1, le=MAX_BATCH)
    """Items per Score call."""

    @model_validator(mode="after")
    def _composite_has_parts(self) -> RewardSpec:
        if (self.scorer == "composite") != bool(self.parts):
            raise ValueError("parts must be given exactly when scorer is 'composite'")
        return self


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


PreferenceLossName = Literal["dpo", "ipo", "kto", "orpo", "simpo"]
"""The offline preference losses (`rlfabric.learner.algorithms.preference`)."""

SIMPO_BETA = 2.0
"""`preference.beta`'s default with loss simpo (the SimPO paper's beta is 2.0-2.5); 0.1 with the others."""


class PreferenceSpec(SpecModel):
    """Offline preference training (`mode = "offline_preference"`): the loss, its parameters and the
    dataset's columns. The dataset's `prompt_field` holds the prompt (a string or chat messages).

    dpo, ipo, orpo and simpo train on (prompt, chosen, rejected) pairs: a micro-batch holds
    `train.micro_batch_size // 2` pairs (at least one), a pair's two completions share a forward pass.
    kto trains on unpaired rows, `train.micro_batch_size` per micro-batch, in TRL's formats: rows of
    (prompt, `completion_field`, `label_field`), the label a bool (true: desirable), or (prompt, chosen,
    rejected) pairs, each then one desirable and one undesirable row; the first row decides (pairs when it
    holds `chosen_field` and `rejected_field` and no `completion_field`). dpo, ipo and kto read the frozen
    reference (`model.reference_path`, else `model.path`); orpo and simpo load no reference."""

    loss: PreferenceLossName = "dpo"
    """dpo: sigmoid DPO on summed completion log-probs; ipo: IPO on per-token mean log-probs; simpo:
    SimPO, reference-free, length-normalised; orpo: ORPO, reference-free, the chosen completion's NLL plus
    an odds-ratio term; kto: KTO, on rows labelled desirable or undesirable."""
    beta: float = Field(default=0.1, gt=0.0)
    """Inverse temperature of the implicit reward: DPO's and KTO's strength of the implicit KL to the
    reference, IPO's margin 1 / (2 beta), SimPO's scale of the length-normalised reward (default 2.0 with
    simpo, 0.1 otherwise). Not used by orpo (its weight is `orpo_lambda`)."""
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)
    """dpo and simpo: probability that a pair's labels are flipped (conservative DPO)."""
    simpo_gamma: float = Field(default=0.5, ge=0.0)
    """simpo: the target reward margin gamma, in reward units, subtracted inside the sigmoid (the paper's
    gamma and TRL's `simpo_gamma`; the SimPO repository's `gamma_beta_ratio` is gamma / beta)."""
    orpo_lambda: float = Field(default=0.1, gt=0.0)
    """orpo: lambda, the weight of the odds-ratio term against the NLL term (TRL's `ORPOConfig.beta`)."""
    kto_desirable_weight: float = Field(default=1.0, gt=0.0)
    """kto: lambda_D, the weight of a desirable row's loss. The KTO paper advises
    lambda_D * n_D / (lambda_U * n_U) within [1, 4/3] (n: the rows of each class)."""
    kto_undesirable_weight: float = Field(default=1.0, gt=0.0)
    """kto: lambda_U, the weight of an undesirable row's loss."""
    chosen_field: str = "chosen"
    """Column with the preferred completion (a string)."""
    rejected_field: str = "rejected"
    """Column with the dispreferred completion (a string)."""
    completion_field: str = "completion"
    """kto, unpaired rows: column with the completion (a string)."""
    label_field: str = "label"
    """kto, unpaired rows: column with the label, a bool (true: desirable; 1 and 0 are accepted)."""

    @model_validator(mode="before")
    @classmethod
    def _simpo_beta(cls, data: Any) -> Any:
        """A simpo run without a beta gets SimPO's (`SIMPO_BETA`), not DPO's 0.1."""
        if isinstance(data, dict) and data.get("loss") == "simpo" and "beta" not in data:
            return {**data, "beta": SIMPO_BETA}
        return data

    @model_validator(mode="after")
    def _fields_of_other_losses(self) -> PreferenceSpec:
        """A loss's own field set away from its default under another loss is a mistake: refused."""
        for name, losses in LOSS_ONLY_FIELDS.items():
            default = type(self).model_fields[name].default
            if self.loss not in losses and getattr(self, name) != default:
                raise ValueError(
                    f"preference.{name} applies to loss {' or '.join(losses)}, not {self.loss!r}"
                )
        if self.loss == "orpo" and self.beta != type(self).model_fields["beta"].default:
            raise ValueError("preference.beta is not used by loss 'orpo': its weight is orpo_lambda")
        return self


LOSS_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "label_smoothing": ("dpo", "simpo"),
    "simpo_gamma": ("simpo",),
    "orpo_lambda": ("orpo",),
    "kto_desirable_weight": ("kto",),
    "kto_undesirable_weight": ("kto",),
    "completion_field": ("kto",),
    "label_field": ("kto",),
}
"""`PreferenceSpec` fields that only some losses read: the losses that do."""


class SFTSpec(SpecModel):
    """Supervised fine-tuning (`mode = "sft"`, and a warm start's `[warm_start.sft]`): the dataset's
    columns, in TRL's SFT conventions. A row is conversational when `messages_field` holds a value: a
    list of {role, content} messages (system, user, assistant, tool; an assistant message may carry
    `tool_calls`). Otherwise it is prompt-completion: `dataset.prompt_field` and `completion_field`, each
    a string or a list of messages (string ones become a user and an assistant message with
    `dataset.chat_template`, else plain text ending with EOS). The loss is the cross-entropy of the
    assistant tokens only (`rlfabric.learner.sft_data` says exactly which ids those are)."""

    messages_field: str = "messages"
    """Column with a conversational row's messages."""
    completion_field: str = "completion"
    """Column with a prompt-completion row's completion (its prompt is `dataset.prompt_field`)."""
    tools_field: str = "tools"
    """Column with a row's tools (a list of JSON-schema functions, or its JSON text), passed to the chat
    template; a row where it is empty or absent uses `tools`."""
    tools: list[dict[str, Any]] = Field(default_factory=list)
    """Tools (JSON-schema functions, {type = "function", function = {name, description, parameters}})
    of every row without its own."""


class RewardModelSpec(SpecModel):
    """Reward-model training (`mode = "reward_model"`): Bradley-Terry on preference pairs, in the formats of
    TRL's `RewardTrainer`. A row holds `chosen_field` and `rejected_field`, each a string or a list of
    {role, content} messages; with an explicit prompt (`dataset.prompt_field`, a string or messages) they
    are the completions, without one (the implicit-prompt form) each holds the whole text or
    conversation. Each side is scored as the reward service's `reward_model` scorer scores it
    (`rlfabric.learner.reward_model_data`), and the final model is a sequence-classification checkpoint
    that scorer loads. A micro-batch holds `train.micro_batch_size // 2` pairs (at least one)."""

    chosen_field: str = "chosen"
    """Column with the preferred completion (or, without a prompt column, the whole preferred text)."""
    rejected_field: str = "rejected"
    """Column with the dispreferred completion (or the whole dispreferred text)."""
    margin_field: str | None = None
    """Column with each pair's margin m (a number): the loss is -log sigmoid(r_chosen - r_rejected - m),
    as in Llama 2 and TRL; None: no margin."""
    center_rewards_coef: float | None = Field(default=None, ge=0.0)
    """TRL's `center_rewards_coefficient`: adds coef * mean((r_chosen + r_rejected)^2) to the loss,
    keeping rewards centred on 0; None: not added."""
    max_length: int | None = Field(default=None, ge=2, le=MAX_TOKENS)
    """Longest scored sequence in tokens; pairs with a longer side are left out and counted
    (`rm_dropped`), as TRL filters them. None: `model.max_model_len`. Serve with the scorer's
    `max_length` at least this."""


class WarmStartSpec(SpecModel):
    """A supervised warm start of an online run: `rlfabric up` first runs an SFT run (`mode = "sft"`)
    of the run's model with these sections, then starts the online run from its final model
    (`model.path`, and the reference unless `model.reference_path` is set). A completed warm start is
    reused by `up --resume`. Only `rlfabric up` runs it; a run submitted to the services directly
    starts from `model.path` as it is."""

    dataset: DatasetSpec
    """The SFT data (its `prompt_field`, `chat_template`, `system_prompt`, `epochs`, `shuffle_seed`,
    `held_out_fraction`, `eval` and `eval_every_steps` as in a `mode = "sft"` run)."""
    sft: SFTSpec = Field(default_factory=SFTSpec)
    """The data's columns and tools."""
    optim: OptimSpec = Field(default_factory=OptimSpec)
    """The warm start's optimiser (set its `lr`: the default is the RL one)."""
    train: TrainSpec = Field(default_factory=TrainSpec)
    """Its steps, sequences per step (`groups_per_step`), micro-batches and checkpoints."""


HealthCheck = Literal[
    "reward_hacking",
    "overfitting",
    "entropy_collapse",
    "response_length",
    "rollout_mismatch",
    "overoptimization",
]
"""The run-health checks (see `rlfabric.coordinator.health`)."""


class HealthThresholds(SpecModel):
    """Thresholds of the run-health checks; every default lives here."""

    window: int = Field(default=5, ge=1, le=MAX_KEEP)
    """Rows averaged for "recent" and "before" values."""
    kl_jump_factor: float = Field(default=2.0, gt=1.0)
    """Reward hacking: recent KL is at least this multiple of the window before..."""
    kl_floor: float = Field(default=1e-3, ge=0.0)
    """...with the earlier KL taken as at least this (so KL rising from ~0 must reach a real size)..."""
    reward_jump: float = Field(default=0.1, gt=0.0)
    """...while the mean reward rose by at least this much between the two windows."""
    eval_points: int = Field(default=3, ge=2, le=MAX_KEEP)
    """Overfitting: held-out evaluations compared (the first and the last of the most recent ones)."""
    eval_drop: float = Field(default=0.02, gt=0.0)
    """Overfitting: the held-out reward fell by at least this much..."""
    train_rise: float = Field(default=0.02, gt=0.0)
    """...while the training reward rose by at least this much over the same steps."""
    entropy_floor: float = Field(default=0.01, ge=0.0)
    """Entropy collapse: recent mean token entropy (nats) below this..."""
    entropy_ratio: float = Field(default=0.1, gt=0.0, lt=1.0)
    """...or below this fraction of the entropy in the first window."""
    length_runaway_factor: float = Field(default=3.0, gt=1.0)
    """Length runaway: recent mean response length above this multiple of the first window's..."""
    length_limit_fraction: float = Field(default=0.95, gt=0.0, le=1.0)
    """...or above this fraction of max_tokens (most completions are being truncated)."""
    length_collapse_ratio: float = Field(default=0.25, gt=0.0, lt=1.0)
    """Length collapse: recent mean response length below this fraction of the first window's..."""
    length_min_tokens: float = Field(default=2.0, ge=0.0)
    """...or below this many tokens."""
    mismatch_kl_max: float = Field(default=0.05, gt=0.0)
    """Rollout mismatch: the recent mean KL between the engine's and the trainer's token distributions
    (`rollout_mismatch_kl`, nats per token) above this: stale samples or a precision/kernel gap the
    rollout correction is straining to cover..."""
    mismatch_drift_factor: float = Field(default=10.0, gt=1.0)
    """...or above this multiple of its first window's mean..."""
    mismatch_floor: float = Field(default=0.005, ge=0.0)
    """...once it is at least this large (a drift from ~0 must reach a real size)."""
    gold_drop: float = Field(default=0.05, gt=0.0)
    """Over-optimisation (needs `dataset.eval.reward`): the gold reward of each of the last `gold_patience`
    evaluations is at least this much below its peak (in the gold reward's units)..."""
    gold_patience: int = Field(default=2, ge=1, le=MAX_KEEP)
    """...for this many evaluations in a row after the peak..."""
    proxy_rise: float = Field(default=0.0, ge=0.0)
    """...while the proxy (the run's own) reward of those evaluations rose, on average, by more than this
    above its value at the gold peak."""


class HealthSpec(HealthThresholds):
    """Run-health warnings (shown on the run status and page) and the checks that stop the run."""

    auto_stop: list[HealthCheck] = Field(default_factory=list)
    """Checks that stop the run when they trigger (the learner stops at once, writes no further
    checkpoint, and the run reports the last checkpoint from before the problem began); [] only warns."""


class WandbSpec(SpecModel):
    """A Weights & Biases run mirroring the learner's (the `wandb` extra: `pip install 'rlfabric[wandb]'`).
    Its id is the run id, so a restarted learner resumes the same W&B run (steps it already logged are
    not logged again). The API key and host come from W&B's own settings (`WANDB_API_KEY`, `wandb login`)."""

    project: str = Field(default="rlfabric", min_length=1, max_length=128)
    """W&B project."""
    entity: str | None = Field(default=None, min_length=1, max_length=128)
    """W&B user or team; None: the API key's default entity."""
    mode: Literal["online", "offline"] = "online"
    """online: stream to the W&B server; offline: write the run under the run directory's `wandb/`
    (`wandb sync` uploads it later; `WANDB_DIR` moves it)."""
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=100
    )
    """Tags of the W&B run (the run's mode is always added)."""


class MlflowSpec(SpecModel):
    """An MLflow run mirroring the learner's (the `mlflow` extra: `pip install 'rlfabric[mlflow]'`). The
    MLflow run carries the run id as its tag `rlfabric.run_id`, so a restarted learner finds and continues
    it. Credentials for a tracking server come from MLflow's own settings (`MLFLOW_TRACKING_TOKEN`, ...)."""

    tracking_uri: str | None = Field(default=None, min_length=1)
    """Where runs are recorded: a tracking server (`http://mlflow:5000`), a database (`sqlite:///...`) or a
    file store (`file:///...`); None: a file store at `mlruns/` in the run directory (`mlflow ui
    --backend-store-uri` shows it)."""
    experiment: str = Field(default="rlfabric", min_length=1, max_length=500)
    """MLflow experiment, created when missing."""
    run_name: str | None = Field(default=None, min_length=1, max_length=250)
    """Name of the MLflow run; None: the run id."""
    tags: dict[
        Annotated[str, Field(min_length=1, max_length=250)], Annotated[str, Field(max_length=8000)]
    ] = Field(default_factory=dict, max_length=100)
    """Tags of the MLflow run, besides `rlfabric.*` (what the run trains from) that are always set."""


class TrackingSpec(SpecModel):
    """Experiment trackers the learner's rank 0 mirrors the run to, besides metrics.jsonl and TensorBoard:
    the spec as config, each step's metrics, curves.png at checkpoints and at the end, and the model and
    dataset it trains from (`rlfabric.learner.tracking`). A tracker that fails is disabled with a warning;
    training goes on."""

    wandb: WandbSpec | None = None
    """Weights & Biases; None: not tracked there."""
    mlflow: MlflowSpec | None = None
    """MLflow; None: not tracked there."""


class RunSpec(SpecModel):
    """A whole run: what to train, on what, with what reward and algorithm."""

    name: str | None = Field(default=None, pattern=RUN_NAME_PATTERN)
    """Run name; a unique id is generated when unset."""
    output_dir: str = "runs"
    """Folder (or fsspec URL) for checkpoints, weights, metrics.jsonl and TensorBoard events."""
    model: ModelSpec
    """The policy."""
    dataset: DatasetSpec
    """The prompts."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """Generation scheduling."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    """Scoring."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """Advantages and loss."""
    optim: OptimSpec = Field(default_factory=OptimSpec)
    """Optimiser."""
    train: TrainSpec = Field(default_factory=TrainSpec)
    """Learner schedule."""
    weights: WeightsSpec = Field(default_factory=WeightsSpec)
    """Weight publishing."""
    mode: Literal["online", "offline_preference", "sft", "reward_model"] = "online"
    """online: RL on scored groups from the rollout and reward services; offline_preference: DPO, IPO,
    KTO, ORPO or SimPO on a fixed dataset of preference pairs (KTO: also unpaired labelled rows); sft:
    supervised fine-tuning on conversations or prompt-completion rows; reward_model: a Bradley-Terry
    reward model on preference pairs. The offline modes need no rollout or reward service."""
    preference: PreferenceSpec = Field(default_factory=PreferenceSpec)
    """Offline preference loss and dataset columns (used when mode = "offline_preference")."""
    sft: SFTSpec = Field(default_factory=SFTSpec)
    """Supervised fine-tuning's dataset columns and tools (used when mode = "sft")."""
    reward_model: RewardModelSpec = Field(default_factory=RewardModelSpec)
    """Reward-model training's dataset columns and loss (used when mode = "reward_model")."""
    warm_start: WarmStartSpec | None = None
    """An SFT run `rlfabric up` runs before this online run, which then starts from its model."""
    health: HealthSpec = Field(default_factory=HealthSpec)
    """Run-health warning thresholds and automatic stops."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """Experiment trackers (Weights & Biases) the learner mirrors the run to."""
    environment: RunEnvironmentSpec | None = None
    """Multi-turn rollouts: each sample is a trajectory played against this environment (tools, a user
    environment class, or one written for TRL); None is single-turn (one prompt, one completion)."""
    resources: ResourcesSpec | None = None
    """The devices each role runs on (`rlfabric.plan.resources`); a run that declares them is refused by
    `POST /v1/runs` and `rlfabric up` when its memory plan does not fit (`rlfabric plan`). None: not
    planned, never refused for memory."""

    @model_validator(mode="after")
    def _groups_need_samples(self) -> RunSpec:
        n = self.rollout.sampling.n
        if self.algorithm.advantage in GROUP_ESTIMATORS and n < 2:
            raise ValueError(
                f"rollout.sampling.n must be >= 2 for the group estimator {self.algorithm.advantage!r}"
                f" (got {n})"
            )
        return self

    @model_validator(mode="after")
    def _lora_is_online(self) -> RunSpec:
        lora = self.model.lora
        if lora is not None and self.mode != "online":
            raise ValueError(f"model.lora: only an online run trains adapters (mode is {self.mode!r})")
        if self.model.published_adapter is not None and self.weights.transport == "broadcast":
            raise ValueError(
                "model.lora.publish: 'adapter' needs weights.transport = 'object_store' (adapters are not"
                " broadcast); use publish = 'merged' with broadcast"
            )
        return self

    @model_validator(mode="after")
    def _fleet_runs_publish_adapters(self) -> RunSpec:
        if self.rollout.fleet is not None and self.model.published_adapter is None:
            raise ValueError(
                "rollout.fleet: a run on a shared fleet must train a LoRA adapter and publish it alone"
                " (model.lora with publish = 'adapter'): full-weight versions would change the base every"
                " run on the fleet generates with"
            )
        return self

    @model_validator(mode="after")
    def _warm_start_is_online(self) -> RunSpec:
        if self.warm_start is not None and self.mode != "online":
            raise ValueError(f"warm_start: only an online run has a warm start (mode is {self.mode!r})")
        return self

    def warm_start_spec(self) -> RunSpec:
        """The SFT run of `warm_start`: this run's model, its dataset, sft, optim and train sections."""
        if self.warm_start is None:
            raise ValueError("the run has no warm_start")
        ws = self.warm_start
        sections = {"dataset": ws.dataset, "sft": ws.sft, "optim": ws.optim, "train": ws.train}
        return self.model_copy(update={**sections, "mode": "sft", "warm_start": None})

    def weights_root(self, run_id: str | None = None) -> str:
        """Where the run's learner publishes its versions and replicas load them: `weights.url`, else
        `<output_dir>/<run>/weights` (the run: `run_id`, else `name`)."""
        if self.weights.url:
            return self.weights.url
        return str(Path(self.output_dir) / (run_id or self.name or "") / "weights")

    def local_paths(self) -> dict[str, tuple[PathKind, str]]:
        """Every file or folder the spec names, by dotted field: the dataset ("data") and the models
        ("model"). A service that reads any of them from a spec it did not write confines them to its
        roots (`rlfabric.runtime.paths`)."""
        found: dict[str, tuple[PathKind, str]] = {"dataset.path": ("data", self.dataset.path)}
        if self.dataset.eval.path is not None:
            found["dataset.eval.path"] = ("data", self.dataset.eval.path)
        if self.warm_start is not None:
            warm = self.warm_start.dataset
            found["warm_start.dataset.path"] = ("data", warm.path)
            if warm.eval.path is not None:
                found["warm_start.dataset.eval.path"] = ("data", warm.eval.path)
        models = {"path": self.model.path, "reference_path": self.model.reference_path}
        models["critic_path"] = self.model.critic_path
        found.update({f"model.{name}": ("model", p) for name, p in models.items() if p is not None})
        return found
