"""The prompt source of a run: training rows, evaluation rows, and a position that survives restarts.

Every source is read with Hugging Face `datasets` (`load_dataset`, or `load_from_disk` for a folder
written by `save_to_disk`): a JSONL, JSON, Parquet or CSV file, a folder of such files, a saved Dataset
or DatasetDict, or a hub id (`org/name`, with `name` and `revision`). `split` selects the rows ("train",
"test", "train[:90%]"). A local file is read into memory with a throw-away cache, so runs leave nothing
behind in the `datasets` cache. A row's id is its `id` column, or its index in the split.

Evaluation rows come from a separate set (`dataset.eval`: another source and/or split), else from the
held-out fraction, chosen by a hash of the prompt id, so it is the same on every restart and never depends
on the shuffle. Evaluation rows are never in the training rows.

`PromptCursor` walks the training rows epoch by epoch in a seeded order and keeps its position in Redis
(`keys.cursor`): a restarted coordinator neither skips nor repeats a prompt. Prompts taken but not
yet enqueued are tracked by the pipeline (`keys.inflight`) and re-dispatched after a restart.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlfabric.contracts import keys
from rlfabric.runspec import DatasetSpec
from rlfabric.runtime.paths import is_hub_id

if TYPE_CHECKING:
    import datasets

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""The `datasets` builder of each local file type."""
SAVED_MARKERS = ("dataset_dict.json", "state.json")
"""Files that mark a folder written by `save_to_disk` (a DatasetDict, a Dataset)."""

Message = dict[str, str]
EvalSource = Literal["eval_set", "held_out", "none"]


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


@dataclass(frozen=True)
class Source:
    """Where one set of rows comes from; `field` is the spec section that names it (for messages)."""

    field: str
    path: str
    split: str
    name: str | None = None
    revision: str | None = None


def training_source(spec: DatasetSpec) -> Source:
    return Source("dataset", spec.path, spec.split, spec.name, spec.revision)


def eval_source(spec: DatasetSpec) -> Source:
    """The separate evaluation set: its own path (name, revision), else the training dataset's."""
    ev = spec.eval
    if ev.path is None:
        return Source(
            "dataset.eval", spec.path, spec.eval_split, ev.name or spec.name, ev.revision or spec.revision
        )
    return Source("dataset.eval", ev.path, spec.eval_split, ev.name, ev.revision)


# --- reading a source ---------------------------------------------------------------------------------


def read_records(source: Source | Path) -> list[dict[str, Any]]:
    """The rows of the source's split, as dicts (every row holds every column, None where absent); a
    bare path is the "train" split of that file or folder (`training_source` names a spec's split)."""
    if isinstance(source, Path):
        source = Source("dataset", str(source), "train")
    path = Path(source.path)
    if path.is_dir():
        return _read_folder(source, path)
    if path.exists():
        return _read_file(source, path)
    if is_hub_id(source.path):
        return _read_hub(source)
    raise DatasetError(f"{source.field}.path {path}: no such file or folder (nor a hub id org/name)")


def _quiet_datasets() -> Any:
    """The `datasets` module, its progress bars and info logs off (the coordinator's log is JSON)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _read_file(source: Source, path: Path) -> list[dict[str, Any]]:
    builder = BUILDERS.get(path.suffix)
    if builder is None:
        raise DatasetError(
            f"{source.field}.path {path}: unsupported dataset format (use .jsonl, .json, .parquet, .csv, "
            "a folder or a hub id)"
        )
    if source.split.split("[")[0] != "train":
        raise DatasetError(f"{source.field}.split: a single file has only the split 'train' (and its slices)")
    try:
        return _load_local(source, builder, data_files=str(path))
    except Exception as exc:  # any failure of the reader: explained without the file's data
        raise _file_error(source, path, builder, exc) from None


def _read_folder(source: Source, path: Path) -> list[dict[str, Any]]:
    if any((path / marker).exists() for marker in SAVED_MARKERS):
        return _read_saved(source, path)
    try:
        return _load_local(source, str(path))
    except Exception as exc:  # any failure of the reader: explained without the folder's data
        raise DatasetError(
            f"{source.field}.path {path}: the folder's data files could not be read with split "
            f"{source.split!r} ({type(exc).__name__})"
        ) from None


def _load_local(source: Source, *args: str, **kwargs: str) -> list[dict[str, Any]]:
    """`datasets.load_dataset` of local data, held in memory; its cache is deleted once read."""
    datasets = _quiet_datasets()
    with tempfile.TemporaryDirectory(prefix="rlfabric-dataset-") as cache:
        data = datasets.load_dataset(
            *args, split=source.split, cache_dir=cache, keep_in_memory=True, **kwargs
        )
        return _to_records(data)


def _read_saved(source: Source, path: Path) -> list[dict[str, Any]]:
    """A `save_to_disk` folder: a DatasetDict's split, or a Dataset (whose only split is "train")."""
    datasets = _quiet_datasets()
    try:
        data = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as exc:  # a damaged folder: explained without its data
        raise DatasetError(
            f"{source.field}.path {path}: not a readable save_to_disk folder ({type(exc).__name__})"
        ) from None
    if isinstance(data, datasets.DatasetDict):
        if source.split not in data:
            raise DatasetError(
                f"{source.field}.split: no split {source.split!r} in {path} (it has {sorted(data)})"
            )
        return _to_records(data[source.split])
    if source.split != "train":
        raise DatasetError(f"{source.field}.split: {path} holds one Dataset; its only split is 'train'")
    return _to_records(data)


def _read_hub(source: Source) -> list[dict[str, Any]]:
    """A hub dataset (downloaded into the `datasets` cache, or read from it when offline)."""
    datasets = _quiet_datasets()
    try:
        data = datasets.load_dataset(source.path, source.name, split=source.split, revision=source.revision)
    except Exception as exc:  # the hub's answer names the repository, never local data
        raise DatasetError(
            f"{source.field}.path {source.path}: the hub dataset could not be loaded "
            f"(name={source.name!r}, split={source.split!r}, revision={source.revision!r}): "
            f"{type(exc).__name__}: {str(exc)[:300]}"
        ) from None
    return _to_records(data)


def _to_records(data: datasets.Dataset) -> list[dict[str, Any]]:
    return [dict(row) for row in data.to_list()]


def _file_error(source: Source, path: Path, builder: str, exc: Exception) -> DatasetError:
    """Why a file could not be read: for JSON the first bad line or row, else the reader's error type."""
    if builder == "json":
        found = json_problem(source, path, prompt_field=None)
        if found is not None:
            return found
        return DatasetError(
            f"{source.field}.path {path}: not readable as JSON rows of one type per column "
            f"({type(exc).__name__})"
        )
    kind = "Parquet" if builder == "parquet" else "CSV"
    return DatasetError(f"{source.field}.path {path}: not a readable {kind} file ({type(exc).__name__})")


def json_problem(source: Source, path: Path, prompt_field: str | None) -> DatasetError | None:
    """The first problem of a JSON or JSON-lines file: not UTF-8, a line that is not JSON, a row that is
    not an object, a row without `prompt_field`; None when there is none."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return DatasetError(f"{source.field}.path {path}: not UTF-8 text")
    records = _json_records(source, path, text)
    if isinstance(records, DatasetError):
        return records
    for number, record in enumerate(records, 1):
        problem = record_problem(source, path, number, record, prompt_field)
        if problem is not None:
            return problem
    return None


def _json_records(source: Source, path: Path, text: str) -> list[Any] | DatasetError:
    """A JSON document's rows (a list, or one value), else one value per non-blank line."""
    try:
        whole = json.loads(text)
        return whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:
        pass
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                return DatasetError(f"{source.field}.path {path}: line {number} is not JSON ({exc.msg})")
    return records


def record_problem(
    source: Source, path: Path, number: int, record: Any, prompt_field: str | None
) -> DatasetError | None:
    """The problem of row `number` (1-based), if any: not an object, or no value in the prompt column."""
    if not isinstance(record, dict):
        return DatasetError(f"{source.field}.path {path}: row {number} is not a JSON object")
    if prompt_field is not None and record.get(prompt_field) is None:
        return DatasetError(f"dataset.prompt_field: row {number} of {path} has no column {prompt_field!r}")
    return None


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
