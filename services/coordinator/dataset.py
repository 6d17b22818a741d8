"""The prompt source of a run: rows from a local file, a held-out split, and a position that survives
restarts.

Rows come from JSONL, Parquet (needs pyarrow) or a folder written by `datasets.save_to_disk` (needs the
`datasets` package). A row's id is its `id` column, or its line index. The held-out split is chosen by a
hash of the prompt id, so it is the same on every restart and never depends on the shuffle.

`PromptCursor` walks the training rows epoch by epoch in a seeded order and keeps its position in Redis
(`rlfabric:{run}:cursor`): a restarted coordinator neither skips nor repeats a prompt. Prompts taken but not
yet enqueued are tracked by the pipeline (`rlfabric:{run}:inflight`) and re-dispatched after a restart.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfabric.common.runspec import DatasetSpec


class DatasetError(ValueError):
    """The dataset cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class PromptRow:
    """One prompt: text or chat messages, the reference answer and the other columns for scorers."""

    prompt_id: str
    prompt: str | list[dict[str, str]]
    reference: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def read_records(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        return _read_hf_disk(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise DatasetError(f"{path}: unsupported dataset format (use .jsonl, .parquet or a save_to_disk folder)")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not JSON: {exc}") from exc
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(f"{path}: reading Parquet needs the pyarrow package") from exc
    return list(pq.read_table(path).to_pylist())


def _read_hf_disk(path: Path) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as exc:
        raise DatasetError(f"{path}: reading a save_to_disk folder needs the datasets package") from exc
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        data = data["train"]
    return [dict(row) for row in data]


def load_rows(spec: DatasetSpec) -> list[PromptRow]:
    """Every row of the dataset as a PromptRow; DatasetError for a missing file or prompt column."""
    path = Path(spec.path)
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}")
    records = read_records(path)
    if not records:
        raise DatasetError(f"{path}: the dataset is empty")
    if spec.prompt_field not in records[0]:
        raise DatasetError(f"{path}: no prompt column {spec.prompt_field!r} (columns: {sorted(records[0])})")
    return [to_row(spec, i, record) for i, record in enumerate(records)]


def to_row(spec: DatasetSpec, index: int, record: dict[str, Any]) -> PromptRow:
    reference = record.get(spec.reference_field, "") if spec.reference_field else ""
    return PromptRow(
        prompt_id=str(record.get("id", index)),
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
        self.key = f"rlfabric:{run_id}:cursor"
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
