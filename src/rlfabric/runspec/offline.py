"""The offline modes' sections: `[preference]`, `[sft]`, `[reward_model]`, and an online run's
`[warm_start]` (an SFT run before it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlfabric.runspec.base import (
    MAX_TOKENS,
    SpecModel,
)
from rlfabric.runspec.data import DatasetSpec
from rlfabric.runspec.training import (
    OptimSpec,
    TrainSpec,
)

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
