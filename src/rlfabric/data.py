"""Dataset sources shared by every process that reads a run's data: the coordinator's prompts, the
offline learner's preference pairs and the run checks (`rlfabric.validate`).

Every source is read with Hugging Face `datasets` (`load_dataset`, or `load_from_disk` for a folder
written by `save_to_disk`): a JSONL, JSON, Parquet or CSV file, a folder of such files, a saved Dataset
or DatasetDict, or a hub id (`org/name`, with `name` and `revision`). `split` selects the rows ("train",
"test", "train[:90%]"). A local file is read into memory with a throw-away cache, so runs leave nothing
behind in the `datasets` cache. A preference dataset version (a folder `rlfabric prefs build` wrote) is
verified against its manifest before its data shards are read, and refused (`DatasetVersionError`, naming
the spec field) when it does not verify. Light by design: no torch, grpc or coordinator import; `datasets` is
imported when a source is read.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfabric.runspec import DatasetSpec
from rlfabric.runtime.hf import HF_LOCK
from rlfabric.runtime.paths import is_hub_id

if TYPE_CHECKING:
    import datasets

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""The `datasets` builder of each local file type."""
SAVED_MARKERS = ("dataset_dict.json", "state.json")
"""Files that mark a folder written by `save_to_disk` (a DatasetDict, a Dataset)."""


class DatasetError(ValueError):
    """The dataset cannot be used. The message names the spec field, the file and the problem, never
    the file's data (not even its column names): a spec's author may point it at any file the
    coordinator can read."""


class DatasetVersionError(DatasetError):
    """A preference dataset version (`rlfabric prefs build`) whose files do not match its manifest."""


@dataclass(frozen=True)
class Source:
    """Where one set of rows comes from; `field` is the spec section that names it (for messages)."""

    field: str
    path: str
    split: str
    name: str | None = None
    revision: str | None = None


def training_source(spec: DatasetSpec) -> Source:
    """The training set: the spec's path, split, name and revision."""
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
    with HF_LOCK:  # not beside another thread's first tokenizer load (`rlfabric.runtime.hf`)
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
    from rlfabric.prefs import store

    if store.is_version(path):
        return _read_version(source, path)
    if any((path / marker).exists() for marker in SAVED_MARKERS):
        return _read_saved(source, path)
    try:
        return _load_local(source, str(path))
    except Exception as exc:  # any failure of the reader: explained without the folder's data
        raise DatasetError(
            f"{source.field}.path {path}: the folder's data files could not be read with split "
            f"{source.split!r} ({type(exc).__name__})"
        ) from None


def _read_version(source: Source, path: Path) -> list[dict[str, Any]]:
    """A preference dataset version: verified against its manifest first (`DatasetVersionError`
    otherwise), then its data shards alone (never the manifest, report or drop records)."""
    from rlfabric.prefs import store

    checked = store.verify(path)
    if not checked.ok:
        more = f" (and {len(checked.problems) - 1} more)" if len(checked.problems) > 1 else ""
        raise DatasetVersionError(
            f"{source.field}.path {path}: the preference dataset version does not verify against its "
            f"manifest, refusing it: {checked.problems[0]}{more}"
        )
    if not store.read_manifest(path)["rows"]:
        return []
    shards = [str(p) for p in store.shard_paths(path)]
    try:
        return _load_local(source, "json", data_files=shards)
    except Exception as exc:  # any failure of the reader: explained without the version's data
        raise DatasetError(
            f"{source.field}.path {path}: the version's shards could not be read with split "
            f"{source.split!r} ({type(exc).__name__})"
        ) from None


def dataset_version(path: str) -> str | None:
    """The id of the preference dataset version at `path` (as its manifest declares it; reading the
    rows verifies it), None when `path` is not a version folder."""
    from rlfabric.prefs import store

    return store.version_of(path)


def _load_local(source: Source, *args: str, **kwargs: Any) -> list[dict[str, Any]]:
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
