"""Reward-model data (`mode = "reward_model"`): preference rows into the token ids a reward model scores.

Rows follow TRL's `RewardTrainer` formats (`runspec.RewardModelSpec`): `reward_model.chosen_field` and
`rejected_field` hold strings or lists of {role, content} messages, and `dataset.prompt_field` the prompt
(explicit prompt) or nothing (implicit prompt: each side is the whole text or conversation). A row's
optional `reward_model.margin_field` holds a number.

Each side is tokenized exactly as the reward service's `reward_model` scorer tokenizes an item, so the
model is trained on the ids it will score:

    chat        (`dataset.chat_template`, or a side or prompt that is a list of messages) the prompt
                messages (a string is one user message; `dataset.system_prompt` first, as the coordinator
                does), then the side (a string is one assistant message), rendered whole with the chat
                template (`tokenize=False`) and encoded without special tokens: the scorer's
                `input_format = "chat_template"` ("auto" with a tokenizer that has a template)
    plain text  (`dataset.chat_template = false`, string prompt and sides; or an implicit-prompt string)
                prompt + side encoded with the tokenizer's special tokens and no EOS added: the scorer's
                `input_format = "concat"`. TRL appends EOS here; the scorer does not, so neither does this

A pair with a side longer than `reward_model.max_length` (default `model.max_model_len`) is left out and
counted (`dropped`), as TRL filters it (the scorer would truncate it, scoring another token). Held-out
pairs: the separate set `dataset.eval` names, else the rows whose id hashes below
`dataset.held_out_fraction` (`sft_data.in_held_out`: stable across restarts); at most
`dataset.eval.max_prompts` of them (0: all). The parsing needs no torch; transformers is imported when a
model's tokenizer is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfabric.data import DatasetError
from rlfabric.learner.sft_data import (
    SFTRowError,
    checked_messages,
    load_tokenizer,
    train_and_held_out,
    with_system,
)
from rlfabric.rollout.chat_template import Message
from rlfabric.runspec import RunSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RewardPair:
    """One preference judgement as the two token sequences a reward model scores."""

    chosen_ids: list[int]
    """The preferred side, whole (prompt included), at least one id."""
    rejected_ids: list[int]
    """The dispreferred side, whole, at least one id."""
    margin: float = 0.0
    """How far the chosen reward should exceed the rejected one (0 without `margin_field`)."""
    pair_id: str = ""
    """Identity of the pair (its row index in the split; an evaluation set's prefixed `eval-`)."""

    def __post_init__(self) -> None:
        if not self.chosen_ids or not self.rejected_ids:
            raise ValueError(f"pair {self.pair_id!r}: a side has no token")


@dataclass
class RewardModelData:
    """A run's training and held-out pairs, and how many rows were left out as too long."""

    train: list[RewardPair]
    evaluation: list[RewardPair] = field(default_factory=list)
    dropped: int = 0
    """Training and evaluation pairs with a side longer than the length limit."""


@dataclass
class ScoredText:
    """One side as the scorer sees it: the text and whether the tokenizer adds its special tokens."""

    text: str
    special_tokens: bool


def is_chat(value: Any) -> bool:
    """Whether a cell is a list (of messages), not text."""
    return isinstance(value, list)


def side_messages(value: Any, field_name: str, index: int) -> list[Message]:
    """A side as messages: a string is one assistant message."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    return checked_messages(value, field_name, index)


def prompt_messages(value: Any, index: int) -> list[Message]:
    """A prompt as messages: a string is one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return checked_messages(value, "dataset.prompt_field", index)


def side_text(spec: RunSpec, tokenizer: PreTrainedTokenizerBase, row: dict[str, Any], side: str,
              index: int) -> ScoredText:  # fmt: skip
    """The text of one side of a row (`side` is the field name, e.g. "reward_model.chosen_field") as the
    scorer renders it (module docstring); SFTRowError naming the field that is wrong."""
    data = spec.dataset
    column = getattr(spec.reward_model, side.removeprefix("reward_model."))
    value, prompt = row.get(column), row.get(data.prompt_field)
    if value is None:
        raise SFTRowError(side, index, f"has no {column!r} column")
    if not isinstance(value, str | list):
        raise SFTRowError(side, index, "is neither text nor a list of messages")
    if prompt is not None and not isinstance(prompt, str | list):
        raise SFTRowError("dataset.prompt_field", index, "is neither text nor a list of messages")
    chat = is_chat(value) or is_chat(prompt) or (data.chat_template and prompt is not None)
    if isinstance(value, str) and not isinstance(prompt, list) and not chat:
        return ScoredText((prompt or "") + value, special_tokens=True)
    if not data.chat_template:
        raise SFTRowError("dataset.chat_template", index, "holds messages: needs the chat template")
    messages = [] if prompt is None else prompt_messages(prompt, index)
    messages = with_system(messages + side_messages(value, side, index), data.system_prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise SFTRowError("model.path", index, "needs a chat template: the model's tokenizer has none")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return ScoredText(str(text), special_tokens=False)


def row_margin(spec: RunSpec, row: dict[str, Any], index: int) -> float:
    """The row's margin (`reward_model.margin_field`), 0 without one."""
    name = spec.reward_model.margin_field
    if name is None:
        return 0.0
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SFTRowError("reward_model.margin_field", index, f"holds no number in {name!r}")
    return float(value)


class PairEncoder:
    """Rows into `RewardPair`s with the model's tokenizer, as the scorer tokenizes them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: RunSpec) -> None:
        self.hf, self.spec = tokenizer, spec
        self.max_length = spec.reward_model.max_length or spec.model.max_model_len

    def ids(self, row: dict[str, Any], side: str, index: int) -> list[int]:
        scored = side_text(self.spec, self.hf, row, side, index)
        return list(self.hf.encode(scored.text, add_special_tokens=scored.special_tokens))

    def encode(self, row: Any, pair_id: str, index: int) -> RewardPair | None:
        """The row's pair; None when a side is longer than the limit (or empty)."""
        if not isinstance(row, dict):
            raise SFTRowError("dataset.path", index, "is not an object of columns")
        chosen = self.ids(row, "reward_model.chosen_field", index)
        rejected = self.ids(row, "reward_model.rejected_field", index)
        if not 0 < len(chosen) <= self.max_length or not 0 < len(rejected) <= self.max_length:
            return None
        return RewardPair(chosen, rejected, row_margin(self.spec, row, index), pair_id)


def load_reward_data(spec: RunSpec, tokenizer: PreTrainedTokenizerBase | None = None) -> RewardModelData:
    """The run's training and held-out pairs (module docstring)."""
    encoder = PairEncoder(tokenizer or load_tokenizer(spec), spec)
    data = RewardModelData(train=[])
    rows, evaluated = train_and_held_out(spec)
    data.train = encode_rows(data, encoder, rows)
    data.evaluation = encode_rows(data, encoder, evaluated)
    if not data.train:
        limit = "reward_model.max_length" if spec.reward_model.max_length else "model.max_model_len"
        raise DatasetError(f"dataset.path: no training pair fits in {limit}")
    return data


def encode_rows(
    data: RewardModelData, encoder: PairEncoder, rows: Sequence[tuple[str, Any]]
) -> list[RewardPair]:
    """`rows` as pairs; counts the ones left out as too long into `data`."""
    pairs = []
    for pair_id, row in rows:
        pair = encoder.encode(row, pair_id, int(pair_id.removeprefix("eval-")))
        if pair is None:
            data.dropped += 1
        else:
            pairs.append(pair)
    return pairs
