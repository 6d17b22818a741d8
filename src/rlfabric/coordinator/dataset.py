"""The prompt source of a run: training rows, evaluation rows, and a position that survives restarts.

Sources are read by `rlfabric.data` (files, folders, `save_to_disk` output and hub ids through Hugging
Face `datasets`, with a split). A row's id is its `id` column, or its index in the split.

Evaluation rows come from a separate set (`dataset.eval`: another source and/or split), else from the
held-out fraction, chosen by a hash of the prompt id, so it is the same on every restart and never depends
on the shuffle. Evaluation rows are never in the training rows.

`PromptCursor` walks the training rows epoch by epoch in a seeded order and keeps its position in Redis
(`keys.cursor`): a restarted coordinator neither skips nor repeats a prompt. Prompts taken but not
yet enqueued are tracked by the pipeline (`keys.inflight`) and re-dispatched after a restart.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlfabric.contracts import keys
from rlfabric.data import (
    BUILDERS,
    DatasetError,
    Source,
    eval_source,
    json_problem,
    read_records,
    record_problem,
    training_source,
)
from rlfabric.runspec import DatasetSpec

Message = dict[str, str]
EvalSource = Literal["eval_set", "held_out", "none"]


@dataclass(frozen=True)
class PromptRow:
    """One prompt: text or chat messages, the reference answer and the other columns for scorers."""

    prompt_id: str
    prompt: str | list[dict[str, str]]
    reference: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


# --- rows ---------------------------------------------------------------------------------------------


def load_rows(spec: DatasetSpec, source: Source | None = None) -> list[PromptRow]:
    """Every row of the source (default: the training split) as a PromptRow; DatasetError for a missing
    or unreadable source, an empty split, or a row without a prompt."""
    source = source or training_source(spec)
    records = read_records(source)
    if not records:
        raise DatasetError(f"{source.field}.path {source.path}: the split {source.split!r} is empty")
    path = Path(source.path)
    for number, record in enumerate(records, 1):
        problem = record_problem(source, path, number, record, spec.prompt_field)
        if problem is not None:
            raise _explained(source, path, spec, problem)
    return [to_row(spec, i, record) for i, record in enumerate(records)]


def _explained(source: Source, path: Path, spec: DatasetSpec, problem: DatasetError) -> DatasetError:
    """For a JSON file, the line-level reason (a line that is no object reads as a missing column)."""
    if path.is_file() and BUILDERS.get(path.suffix) == "json":
        return json_problem(source, path, spec.prompt_field) or problem
    return problem


def to_row(spec: DatasetSpec, index: int, record: dict[str, Any]) -> PromptRow:
    reference = record.get(spec.reference_field) if spec.reference_field else None
    row_id = record.get("id")
    return PromptRow(
        prompt_id=str(index if row_id is None else row_id),
        prompt=record[spec.prompt_field],
        reference="" if reference is None else str(reference),
        metadata={k: record[k] for k in spec.metadata_fields if k in record},
    )


def in_held_out(prompt_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(prompt_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split(rows: list[PromptRow], fraction: float) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, held_out), stable across restarts and shuffles."""
    held = [r for r in rows if in_held_out(r.prompt_id, fraction)]
    train = [r for r in rows if not in_held_out(r.prompt_id, fraction)]
    if not train:
        raise DatasetError("held_out_fraction leaves no training prompts")
    return train, held


@dataclass(frozen=True)
class PromptSets:
    """A run's prompts: `train` is walked by the cursor, `evaluation` only evaluated (never trained on);
    `eval_source` says where the evaluation rows came from."""

    train: list[PromptRow]
    evaluation: list[PromptRow]
    eval_source: EvalSource


def load_prompt_sets(spec: DatasetSpec) -> PromptSets:
    """The training rows and the evaluation rows: the separate set when `spec.eval` names one, else the
    held-out fraction; at most `eval.max_prompts` evaluation rows (0: all)."""
    rows = load_rows(spec)
    kind: EvalSource = "eval_set"
    if spec.eval.separate:
        train, evaluation = rows, load_rows(spec, eval_source(spec))
    else:
        train, evaluation = split(rows, spec.held_out_fraction)
        kind = "held_out" if evaluation else "none"
    if spec.eval.max_prompts:
        evaluation = evaluation[: spec.eval.max_prompts]
    return PromptSets(train, evaluation, kind)


def chat_prompt(row: PromptRow, spec: DatasetSpec) -> str | list[Message]:
    """The prompt as generation sees it: with `spec.system_prompt` as the first message of a chat prompt
    (a string prompt becomes one when rendered with the chat template) unless it has its own."""
    prompt = row.prompt
    if spec.system_prompt is None or (isinstance(prompt, str) and not spec.chat_template):
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if messages and messages[0].get("role") == "system":
        return messages
    return [{"role": "system", "content": spec.system_prompt}, *messages]


def epoch_order(count: int, seed: int | None, epoch: int) -> list[int]:
    order = list(range(count))
    if seed is not None:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


@dataclass(frozen=True)
class Draw:
    """A prompt taken from the cursor: which epoch and position it came from."""

    row: PromptRow
    epoch: int
    position: int


class PromptCursor:
    """The seeded walk over the training rows, its position (prompts taken so far) in Redis. The pipeline
    advances the position in the same script that records the prompt in flight (`pipeline.DRAW_AT`)."""

    def __init__(self, redis: Any, run_id: str, rows: list[PromptRow], spec: DatasetSpec) -> None:
        self.redis, self.rows, self.spec = redis, rows, spec
        self.key = keys.cursor(run_id)
        self._orders: dict[int, list[int]] = {}

    async def next(self) -> tuple[int, Draw | None]:
        """The position and the prompt there (None after the last epoch); takes nothing."""
        taken = await self.taken()
        return taken, self.at(taken)

    def at(self, taken: int) -> Draw | None:
        """The prompt at position `taken` of the walk, or None past the last epoch."""
        epoch, position = divmod(taken, len(self.rows))
        if epoch >= self.spec.epochs:
            return None
        order = self._orders.setdefault(epoch, epoch_order(len(self.rows), self.spec.shuffle_seed, epoch))
        return Draw(self.rows[order[position]], epoch, position)

    async def taken(self) -> int:
        return int(await self.redis.get(self.key) or 0)
