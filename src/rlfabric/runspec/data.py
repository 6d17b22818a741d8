"""`[dataset]`: where prompts come from, how they are drawn, and the held-out evaluation set."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rlfabric.runspec.base import (
    MAX_BATCH,
    MAX_KEEP,
    MAX_SEED,
    MAX_STEPS,
    SpecModel,
)
from rlfabric.runspec.generation import RewardSpec


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
