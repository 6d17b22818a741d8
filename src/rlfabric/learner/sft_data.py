"""Supervised fine-tuning data: dataset rows into the token ids and assistant masks a rollout produces.

Rows follow TRL's SFT conventions (`runspec.SFTSpec`):

    conversational      `sft.messages_field`: [{role, content, tool_calls?}, ...] (system, user, assistant,
                        tool), with the row's tools in `sft.tools_field` or the spec's `sft.tools`
    prompt-completion   `dataset.prompt_field` and `sft.completion_field`, each a string or a list of
                        messages; with `dataset.chat_template` a string prompt is a user message and a
                        string completion an assistant message, so the row is a conversation too

Tokenization matches inference token for token. A conversation is tokenized as the rollout's multi-turn
driver (`rlfabric.rollout.trajectory`) builds a trajectory with `rollout.chat_template`'s
`IncrementalRenderer`: each run of non-assistant messages is an environment turn (`append_turn`, which
ends with the generation prompt) and each assistant message is what an engine samples (`sampled_ids`:
T of its text through the end-of-turn token). The mask is 1 exactly on the assistant turns' ids, their
end token included, and 0 on everything else (system, user and tool turns, the template's text between
turns). Messages after the last assistant message are dropped (nothing follows them in a trajectory);
two assistant messages in a row are joined by the generation prompt (mask 0); a conversation must start
with a message that is not the assistant's. With `dataset.system_prompt`, a conversation that does not
start with a system message gets it first, as the coordinator does to prompts. A template that rewrites
earlier turns is refused (`TemplateMismatch`), as the driver refuses it.

Plain prompt-completion text (`dataset.chat_template = false`): T(prompt), then T(completion) + EOS, the
mask on the completion and EOS (the offline preference run's layout).

Truncation: an example longer than `model.max_model_len` keeps its first `max_model_len` ids and is
counted as truncated; one left with no assistant token to predict (none after its first id) is dropped
and counted. Both counts land in every metrics row (`sft_truncated`, `sft_dropped`).

Arrow fills the keys that some rows lack with nulls (a message without `tool_calls` beside one with
them, tool arguments of different shapes), so null values are removed from messages and tools before
rendering. Held-out rows: the separate set `dataset.eval` names, else the rows whose id hashes below
`dataset.held_out_fraction` (stable across restarts, as the coordinator splits prompts); at most
`dataset.eval.max_prompts` of them (0: all). The parsing here needs no torch; transformers is imported
when a model's tokenizer is loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfabric.data import DatasetError, Source, eval_source, read_records, training_source
from rlfabric.rollout.chat_template import IncrementalRenderer, Message, turns_of
from rlfabric.runspec import RunSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")
"""The message roles of a conversational row."""


class SFTRowError(DatasetError):
    """A row that cannot be trained on: the spec field it is about and the row, never the row's data."""

    def __init__(self, field_name: str, row: int, reason: str) -> None:
        self.field = field_name
        self.row = row
        """0-based index of the row in its split (messages count from 1, as `rlfabric.validate`)."""
        self.detail = f"row {row + 1} {reason}"
        """The message without the field."""
        super().__init__(f"{field_name}: {self.detail}")


@dataclass
class ChatRow:
    """A row as a conversation to render with the chat template."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None


@dataclass
class TextRow:
    """A plain prompt-completion row (no chat template)."""

    prompt: str
    completion: str


@dataclass
class SFTExample:
    """One training sequence: `token_ids` and `loss_mask` align, one entry per token."""

    token_ids: list[int]
    """The whole sequence, at least two ids."""
    loss_mask: list[int]
    """1 on the assistant's tokens (those trained), 0 elsewhere; the first entry is never trained (it is
    predicted by nothing)."""
    example_id: str = ""
    """Identity of the example (its row index in the split), for the consumed-row ledger."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.loss_mask) or len(self.token_ids) < 2:
            raise ValueError(f"example {self.example_id!r}: needs >= 2 ids and one mask entry per id")


@dataclass
class SFTData:
    """A run's examples and what fitting them into the context cost."""

    train: list[SFTExample]
    evaluation: list[SFTExample] = field(default_factory=list)
    truncated: int = 0
    """Training and evaluation examples cut to `model.max_model_len`."""
    dropped: int = 0
    """Examples left with no assistant token once cut (not trained or evaluated)."""


# -- rows -----------------------------------------------------------------------------------------------


def without_nulls(value: Any) -> Any:
    """`value` with every None-valued key of its dicts removed, recursively (Arrow's filled-in nulls)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def row_tools(row: dict[str, Any], spec: RunSpec, index: int) -> list[dict[str, Any]] | None:
    """The row's tools (its column, a list or JSON text), else the spec's; None when there are none."""
    value = row.get(spec.sft.tools_field)
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise SFTRowError("sft.tools_field", index, "holds text that is not JSON") from None
    if value in (None, "", []):
        return list(spec.sft.tools) or None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise SFTRowError("sft.tools_field", index, "is not a list of JSON-schema functions")
    return [without_nulls(t) for t in value]


def checked_messages(value: Any, field_name: str, index: int) -> list[Message]:
    """`value` as a list of messages with known roles and text content; SFTRowError naming the field."""
    if not isinstance(value, list) or not value:
        raise SFTRowError(field_name, index, "is not a non-empty list of messages")
    messages = [without_nulls(m) for m in value]
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise SFTRowError(field_name, index, f"message {number} has no role among {', '.join(ROLES)}")
        if not isinstance(message.get("content", ""), str):
            raise SFTRowError(field_name, index, f"message {number} has content that is not text")
    return messages


def as_messages(value: Any, role: str, field_name: str, index: int) -> list[Message]:
    """A prompt-completion cell as messages: a string is one message of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return checked_messages(value, field_name, index)


def parse_row(row: dict[str, Any], spec: RunSpec, index: int) -> ChatRow | TextRow:
    """A dataset row as a conversation (or plain text); SFTRowError naming the field that is wrong."""
    data, sft = spec.dataset, spec.sft
    if row.get(sft.messages_field) is not None:
        if not data.chat_template:
            raise SFTRowError("dataset.chat_template", index, "is conversational: needs the chat template")
        return ChatRow(with_system(checked_messages(row[sft.messages_field], "sft.messages_field", index),
                                   data.system_prompt), row_tools(row, spec, index))  # fmt: skip
    prompt, completion = row.get(data.prompt_field), row.get(sft.completion_field)
    if prompt is None or completion is None:
        wanted = f"{sft.messages_field!r} nor both {data.prompt_field!r} and {sft.completion_field!r}"
        raise SFTRowError("sft.messages_field", index, f"holds neither {wanted}")
    if not data.chat_template:
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise SFTRowError("dataset.chat_template", index, "holds messages: needs the chat template")
        return TextRow(prompt, completion)
    messages = as_messages(prompt, "user", "dataset.prompt_field", index)
    messages += as_messages(completion, "assistant", "sft.completion_field", index)
    return ChatRow(with_system(messages, data.system_prompt), row_tools(row, spec, index))


def with_system(messages: list[Message], system_prompt: str | None) -> list[Message]:
    """`messages` after the system prompt, unless there is none or they start with their own."""
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def trained_part(messages: Sequence[Message], index: int) -> list[Message]:
    """The messages through the last assistant message; SFTRowError when there is none, or when the
    conversation starts with one."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        raise SFTRowError("sft.messages_field", index, "has no assistant message to learn from")
    if messages[0]["role"] == "assistant":
        raise SFTRowError("sft.messages_field", index, "starts with an assistant message (no prompt)")
    return list(messages[: last + 1])


# -- tokenization ---------------------------------------------------------------------------------------


class SFTTokenizer:
    """Turns parsed rows into (ids, mask) with the model's tokenizer, as inference would (module
    docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: RunSpec) -> None:
        self.hf = tokenizer
        self.template_kwargs = dict(spec.dataset.chat_template_kwargs)

    def encode(self, parsed: ChatRow | TextRow, index: int) -> tuple[list[int], list[int]]:
        """The row's ids and mask, whole (before truncation)."""
        if isinstance(parsed, TextRow):
            return self.text_ids(parsed)
        renderer = IncrementalRenderer(self.hf, parsed.tools, template_kwargs=self.template_kwargs)
        return conversation_ids(renderer, trained_part(parsed.messages, index))

    def text_ids(self, row: TextRow) -> tuple[list[int], list[int]]:
        """T(prompt) then T(completion) + EOS, the mask on the completion and EOS."""
        prompt = list(self.hf.encode(row.prompt, add_special_tokens=False))
        completion = list(self.hf.encode(row.completion, add_special_tokens=False))
        if self.hf.eos_token_id is not None:
            completion.append(int(self.hf.eos_token_id))
        return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def conversation_ids(
    renderer: IncrementalRenderer, messages: Sequence[Message]
) -> tuple[list[int], list[int]]:
    """The ids of `messages` turn by turn as a trajectory holds them, and the mask (1 on assistant turns).
    `messages` start with a non-assistant message and end with an assistant one."""
    ids: list[int] = []
    mask: list[int] = []
    for turn in turns_of(messages):
        so_far, first = messages[: turn[0]], messages[turn[0]]
        if first["role"] != "assistant":
            new, trained = renderer.append_turn(ids, so_far, [messages[i] for i in turn]), 0
        else:
            if so_far[-1]["role"] == "assistant":  # the generation prompt between two assistant turns
                joint = renderer.append_turn(ids, so_far, [])
                ids, mask = ids + joint, mask + [0] * len(joint)
            new, trained = renderer.sampled_ids(so_far, first), 1
        ids, mask = ids + new, mask + [trained] * len(new)
    return ids, mask


def fit(ids: list[int], mask: list[int], max_len: int) -> tuple[list[int], list[int], bool] | None:
    """(ids, mask, truncated) cut to `max_len`; None when no trained token is left after the first id."""
    cut = len(ids) > max_len
    ids, mask = ids[:max_len], mask[:max_len]
    if len(ids) < 2 or not any(mask[1:]):
        return None
    return ids, mask, cut


# -- loading --------------------------------------------------------------------------------------------


def in_held_out(example_id: str, fraction: float) -> bool:
    """Whether a row id falls in the held-out fraction (sha256 of the id, as the coordinator splits)."""
    digest = hashlib.sha256(example_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def read_rows(source: Source) -> list[dict[str, Any]]:
    """The rows of a split; `DatasetError` for a missing, unreadable or empty one."""
    rows = read_records(source)
    if not rows:
        raise DatasetError(f"{source.field}.path {source.path}: the split {source.split!r} is empty")
    return rows


def load_tokenizer(spec: RunSpec) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.model.path)


def train_and_held_out(spec: RunSpec) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The run's (row id, row) pairs to train on and to evaluate: a separate evaluation set (ids prefixed
    `eval-`, at most `dataset.eval.max_prompts`), else the held-out fraction of the training rows."""
    rows = [(str(i), r) for i, r in enumerate(read_rows(training_source(spec.dataset)))]
    if spec.dataset.eval.separate:
        evaluated = [(f"eval-{i}", r) for i, r in enumerate(read_rows(eval_source(spec.dataset)))]
    else:
        fraction = spec.dataset.held_out_fraction
        evaluated = [(i, r) for i, r in rows if in_held_out(i, fraction)]
        rows = [(i, r) for i, r in rows if not in_held_out(i, fraction)]
    if spec.dataset.eval.max_prompts:
        evaluated = evaluated[: spec.dataset.eval.max_prompts]
    return rows, evaluated


def load_sft_data(spec: RunSpec, tokenizer: PreTrainedTokenizerBase | None = None) -> SFTData:
    """The run's training and held-out examples (module docstring); example ids are row indexes (an
    evaluation set's prefixed `eval-`)."""
    sft = SFTTokenizer(tokenizer or load_tokenizer(spec), spec)
    data = SFTData(train=[])
    rows, evaluated = train_and_held_out(spec)
    data.train = add_examples(data, sft, spec, rows)
    data.evaluation = add_examples(data, sft, spec, evaluated)
    if not data.train:
        raise DatasetError("dataset.path: no training row keeps an assistant token in model.max_model_len")
    return data


def add_examples(
    data: SFTData, sft: SFTTokenizer, spec: RunSpec, rows: Sequence[tuple[str, dict[str, Any]]]
) -> list[SFTExample]:
    """`rows` as examples fitted to the context; counts the truncated and dropped ones into `data`."""
    examples = []
    for example_id, row in rows:
        index = int(example_id.removeprefix("eval-"))
        fitted = fit(*sft.encode(parse_row(row, spec, index), index), spec.model.max_model_len)
        if fitted is None:
            data.dropped += 1
            continue
        data.truncated += int(fitted[2])
        examples.append(SFTExample(fitted[0], fitted[1], example_id))
    return examples
