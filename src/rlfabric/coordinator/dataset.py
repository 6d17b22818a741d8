"""The prompt source of a run: rows from a local file, a held-out split, and a position that survives
restarts.

Rows come from JSONL, Parquet (needs pyarrow) or a folder written by `datasets.save_to_disk` (needs the
`datasets` package). A row's id is its `id` column, or its line index. The held-out split is chosen by a
hash of the prompt id, so it is the same on every restart and never depends on the shuffle.

`PromptCursor` walks the training rows epoch by epoch in a seeded order and keeps its position in Redis
(`keys.cursor`): a restarted coordinator neither skips nor repeats a prompt. Prompts taken but not
yet enqueued are tracked by the pipeline (`keys.inflight`) and re-dispatched after a restart.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfabric.contracts import keys
from rlfabric.runspec import DatasetSpec


class DatasetError(ValueError):
    """The dataset cannot be used. The message names the spec field, the file and the problem, never
    the file's data (not even its column names): a spec's author may point it at any file the
    coordinator can read."""


@dataclass(frozen=True)
class PromptRow:
    """One prompt: text or chat messages, the reference answer and the other columns for scorers."""

    prompt_id: str
    prompt: str | list[dict[str, str]]
    reference: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def read_records(path: Path) -> list[Any]:
    """The file's records, unchecked (each should be a JSON object / table row)."""
    if path.is_dir():
        return _read_hf_disk(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise DatasetError(
        f"dataset.path {path}: unsupported dataset format (use .jsonl, .parquet or a save_to_disk folder)"
    )


def _read_jsonl(path: Path) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DatasetError(f"dataset.path {path}: not UTF-8 text") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"dataset.path {path}: line {number} is not JSON ({exc.msg})") from None
    return rows


def _read_parquet(path: Path) -> list[Any]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(f"dataset.path {path}: reading Parquet needs the pyarrow package") from exc
    try:
        return list(pq.read_table(path).to_pylist())
    except (pyarrow.ArrowException, OSError) as exc:
        raise DatasetError(
            f"dataset.path {path}: not a readable Parquet file ({type(exc).__name__})"
        ) from None


def _read_hf_disk(path: Path) -> list[Any]:
    try:
        import datasets
    except ImportError as exc:
        raise DatasetError(
            f"dataset.path {path}: reading a save_to_disk folder needs the datasets package"
        ) from exc
    try:
        data = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as exc:
        raise DatasetError(f"dataset.path {path}: not a save_to_disk folder ({type(exc).__name__})") from None
    if isinstance(data, datasets.DatasetDict):
        data = data["train"]
    return [dict(row) for row in data]


def load_rows(spec: DatasetSpec) -> list[PromptRow]:
    """Every row of the dataset as a PromptRow; DatasetError for a missing or unreadable file, a row that
    is not an object, or a row without the prompt column."""
    path = Path(spec.path)
    if not path.exists():
        raise DatasetError(f"dataset.path {path}: no such file or folder")
    records = read_records(path)
    if not records:
        raise DatasetError(f"dataset.path {path}: the dataset is empty")
    for number, record in enumerate(records, 1):
        check_record(spec, path, number, record)
    return [to_row(spec, i, record) for i, record in enumerate(records)]


def check_record(spec: DatasetSpec, path: Path, number: int, record: Any) -> None:
    """DatasetError unless row `number` (1-based) is an object holding the prompt column."""
    if not isinstance(record, dict):
        raise DatasetError(f"dataset.path {path}: row {number} is not a JSON object")
    if spec.prompt_field not in record:
        raise DatasetError(
            f"dataset.prompt_field: row {number} of {path} has no column {spec.prompt_field!r}"
        )


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
