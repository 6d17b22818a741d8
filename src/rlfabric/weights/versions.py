"""Published policy weights: the on-storage format the learner writes and the rollout replicas read.

Layout under a run's weights root (an fsspec URL or a plain local path)::

    <root>/v000007/model-00001-of-00002.safetensors  shards of <= `shard_bytes` (or one bigger tensor)
    <root>/v000007/model-00002-of-00002.safetensors
    <root>/v000007/manifest.json                     per-file size + sha256, per-tensor file/dtype/shape
    <root>/v000007/COMMITTED                         the manifest's sha256: written last

Invariants:
- A version is *published* iff its `COMMITTED` marker exists. The marker is written only after every shard
  and the manifest are durable (local files: written under a temporary name, fsynced, renamed, directory
  fsynced), so a crash at any point leaves either a committed, complete version or one that every reader
  ignores. Object stores give the same guarantee because each object appears whole on close.
- Published versions increase strictly: `publish_version` refuses a version not greater than the latest
  committed one, so monotonicity survives learner restarts (the storage is the source of truth).
  One writer per root is assumed (the learner's rank 0).
- A reader checks the marker against the manifest's sha256 and, when verifying, every file's size and
  sha256; what it deserializes are the very bytes it hashed (no check-then-reread race). Shards are read
  with safetensors, never with pickle.
- Every state-dict name gets its own bytes in the shards. Tensors sharing storage (tied embeddings) are
  written once per name, straight from the shared memory without cloning, and load back as independent
  tensors: tying is the model's business, and vLLM can read the directory as a plain HF checkpoint.

Shards are written by `rlfabric.weights.shards` (streamed from tensor memory into the file and
into sha256 at once, no serialized copy, no second read pass) onto a `rlfabric.weights.store`
(a local directory with fsync + rename, or any fsspec filesystem).

This module imports without torch (the coordinator only lists versions); torch and safetensors are
imported inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from rlfabric.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from rlfabric.weights.shards import (
    CHUNK_BYTES,
    MAX_IO_THREADS,
    FileEntry,
    PublishTimings,
    Shard,
    dtype_code,
    dtype_codes,
    plan_shards,
    write_shards,
)
from rlfabric.weights.store import Store, join, open_store

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
DEFAULT_SHARD_BYTES = 1 << 30
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_T = TypeVar("_T")


class VersionConflict(FailedPrecondition):
    """A version not greater than the latest committed one was published."""


class WeightsCorrupted(FailedPrecondition):
    """A committed version's files do not match its manifest; the message names the file."""


class VersionNotCommitted(NotFound):
    """The version has no commit marker: never published, or still being written."""


# --- manifest ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor lives: its shard file, safetensors dtype code (`F32`, `BF16`, ...) and shape."""

    file: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True)
class Manifest:
    """The description of one version. Invariant: every `TensorEntry.file` names one of `files`."""

    format_version: int
    policy_version: int
    created_at: str
    """ISO-8601 UTC time the publish started."""
    metadata: dict[str, Any]
    """Passed through untouched from the publisher (model config, training step, ...)."""
    files: list[FileEntry]
    tensors: dict[str, TensorEntry]

    def to_bytes(self) -> bytes:
        """The JSON the commit marker's sha256 is computed over; tensors in state-dict order."""
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parses a manifest; `WeightsCorrupted` on anything malformed or of an unknown format version."""
        try:
            raw = json.loads(data)
            if raw["format_version"] != FORMAT_VERSION:
                raise WeightsCorrupted(f"{MANIFEST}: unknown format_version {raw['format_version']!r}")
            files = [FileEntry(**entry) for entry in raw["files"]]
            tensors = {name: TensorEntry(**entry) for name, entry in raw["tensors"].items()}
            manifest = cls(FORMAT_VERSION, int(raw["policy_version"]), str(raw["created_at"]),
                           dict(raw["metadata"]), files, tensors)  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightsCorrupted(f"{MANIFEST}: malformed ({exc!r})") from exc
        if not {t.file for t in tensors.values()} <= {f.name for f in files}:
            raise WeightsCorrupted(f"{MANIFEST}: a tensor names a file that is not listed")
        return manifest

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class PublishedVersion:
    """What `publish_version` wrote: the version, its directory (local path or URL) and its manifest."""

    version: int
    path: str
    manifest: Manifest
    timings: PublishTimings
    total_bytes: int
    num_files: int


@dataclass(frozen=True)
class VersionInfo:
    """A version directory found under the root; `committed` says whether its marker exists."""

    version: int
    committed: bool
    path: str


# --- paths ---------------------------------------------------------------------------------------------


def _dir_name(version: int) -> str:
    return f"v{version:06d}"


def version_dir(root: str | os.PathLike[str], version: int) -> str:
    """The version's directory: a local path for local roots (what vLLM's `reload_weights(weights_path=)`
    reads), else the fsspec URL. Says nothing about whether the version is committed or verified."""
    store = open_store(root)
    return store.url(join(store.root, _dir_name(_check_version(version))))


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidArgument(f"a weights version is a non-negative int, got {version!r}")
    return version


# --- listing and pruning -------------------------------------------------------------------------------


def list_versions(root: str | os.PathLike[str]) -> list[VersionInfo]:
    """Every version directory under `root`, committed or not, in increasing version order."""
    return _list(open_store(root))


def _list(store: Store) -> list[VersionInfo]:
    found = []
    for name in store.list_names(store.root):
        if match := _VERSION_DIR.match(name):
            path = join(store.root, name)
            found.append(VersionInfo(int(match[1]), store.exists(join(path, MARKER)), store.url(path)))
    return sorted(found, key=lambda info: info.version)


def latest_committed(root: str | os.PathLike[str]) -> int | None:
    """The highest committed version, None when nothing is published. Uncommitted directories are ignored."""
    return _latest(open_store(root))


def _latest(store: Store) -> int | None:
    committed = [info.version for info in _list(store) if info.committed]
    return committed[-1] if committed else None


def prune(root: str | os.PathLike[str], keep: int) -> list[int]:
    """Deletes all but the `keep` newest committed versions, and uncommitted leftovers older than the latest
    committed one (newer uncommitted ones may be a publish in progress). Returns the deleted versions.

    Invariant: the latest committed version is never deleted (`keep >= 1`). A committed version loses its
    marker first, so a crash mid-delete leaves an ignored directory, never a committed, incomplete one."""
    if keep < 1:
        raise InvalidArgument(f"prune must keep at least the latest committed version, got keep={keep}")
    store = open_store(root)
    infos = _list(store)
    latest = _latest(store)
    if latest is None:
        return []
    committed = [info.version for info in infos if info.committed]
    kept = set(committed[-keep:])
    doomed = [info for info in infos if info.version not in kept and info.version < latest]
    for info in doomed:
        _delete_version(store, join(store.root, _dir_name(info.version)), info.committed)
    return [info.version for info in doomed]


def _delete_version(store: Store, path: str, committed: bool) -> None:
    if committed:
        store.remove(join(path, MARKER))
        store.sync_dir(path)
    store.remove_tree(path)


# --- publishing ----------------------------------------------------------------------------------------


def publish_version(
    root: str | os.PathLike[str],
    version: int,
    state_dict: Mapping[str, torch.Tensor],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, Any] | None = None,
) -> PublishedVersion:
    """Writes `state_dict` as version `version` under `root` and commits it (marker last).

    Raises `VersionConflict` unless `version` is greater than the latest committed version. A leftover
    uncommitted directory of the same version (a crashed publish) is replaced. Tensors may live on any
    device; they are copied to host memory shard by shard. `metadata` must be JSON-serializable."""
    started = time.perf_counter()
    created_at = datetime.now(UTC).isoformat()
    store = open_store(root)
    _require_newer(store, _check_version(version))
    meta = _check_metadata(metadata)
    shards = plan_shards(state_dict, shard_bytes)
    path = join(store.root, _dir_name(version))
    _fresh_dir(store, path)
    entries, timings = write_shards(store, path, shards)
    index = _tensor_index(shards, state_dict)
    manifest = Manifest(FORMAT_VERSION, version, created_at, meta, entries, index)
    sync_s = _commit(store, path, manifest)
    timings += PublishTimings(sync_s=sync_s, total_s=time.perf_counter() - started)
    return PublishedVersion(version, store.url(path), manifest, timings, manifest.total_bytes, len(entries))


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"weights metadata must be JSON-serializable: {exc}") from exc
    return dict(metadata or {})


def _require_newer(store: Store, version: int) -> None:
    latest = _latest(store)
    if latest is not None and version <= latest:
        raise VersionConflict(f"version {version} is not newer than the latest committed version {latest}")


def _fresh_dir(store: Store, path: str) -> None:
    """An empty, durably named directory for the version; a crashed publish's leftover (uncommitted) is
    removed first. The root (and its own name, when this creates it) is made durable too."""
    if not store.exists(store.root):
        store.makedirs(store.root)
        store.sync_dir(posixpath.dirname(store.root.rstrip("/")) or "/")
    if store.exists(path):
        store.remove_tree(path)
    store.makedirs(path)
    store.sync_dir(store.root)


def _tensor_index(shards: Sequence[Shard], order: Iterable[str]) -> dict[str, TensorEntry]:
    """Where each tensor went, listed in `order` (the state dict's), which `load_version` returns."""
    index = {
        name: TensorEntry(shard.name, dtype_code(tensor), list(tensor.shape))
        for shard in shards
        for name, tensor in shard.tensors
    }
    return {name: index[name] for name in order}


def _commit(store: Store, path: str, manifest: Manifest) -> float:
    """Writes the manifest and syncs the directory (shard and manifest names durable), then, after
    re-checking monotonicity, the marker, and syncs again. Returns the seconds spent."""
    started = time.perf_counter()
    data = manifest.to_bytes()
    store.write_bytes(join(path, MANIFEST), data)
    store.sync_dir(path)
    _require_newer(store, manifest.policy_version)
    store.write_bytes(join(path, MARKER), (hashlib.sha256(data).hexdigest() + "\n").encode())
    store.sync_dir(path)
    return time.perf_counter() - started


# --- reading -------------------------------------------------------------------------------------------


def read_manifest(root: str | os.PathLike[str], version: int) -> Manifest:
    """The manifest of a committed version, checked against the sha256 in its marker (files not checked).

    Raises `VersionNotCommitted` without a marker, `WeightsCorrupted` if the manifest does not match."""
    store = open_store(root)
    return _read_manifest(store, join(store.root, _dir_name(_check_version(version))), version)


def _read_manifest(store: Store, path: str, version: int) -> Manifest:
    """The marker-checked manifest of the version directory `path`, which must describe `version`."""
    try:
        expected = store.read_bytes(join(path, MARKER)).decode().strip()
    except FileNotFoundError:
        raise VersionNotCommitted(f"version directory {store.url(path)} has no {MARKER} marker") from None
    data = _read_file(store, path, MANIFEST)
    if hashlib.sha256(data).hexdigest() != expected:
        raise WeightsCorrupted(f"{MANIFEST} in {store.url(path)}: sha256 does not match the {MARKER} marker")
    manifest = Manifest.from_bytes(data)
    if manifest.policy_version != version:
        raise WeightsCorrupted(
            f"{MANIFEST} in {store.url(path)}: describes version {manifest.policy_version}"
        )
    return manifest


def _read_file(store: Store, path: str, name: str) -> bytes:
    try:
        return store.read_bytes(join(path, name))
    except FileNotFoundError:
        raise WeightsCorrupted(f"{name} is missing from {store.url(path)}") from None


def _read_verified(store: Store, path: str, entry: FileEntry, verify: bool) -> bytes:
    """The file's bytes, after checking its size and (when `verify`) its sha256 against the manifest."""
    data = _read_file(store, path, entry.name)
    _check_file(store.url(path), entry, len(data), hashlib.sha256(data).hexdigest() if verify else None)
    return data


def verify_version(root: str | os.PathLike[str], version: int) -> Manifest:
    """Checks the marker, the manifest's hash and every file's size and sha256; returns the manifest.

    Raises `VersionNotCommitted` or `WeightsCorrupted` (naming the file). After it returns, the directory
    from `version_dir` can be handed to a reader that trusts it (vLLM's `reload_weights`)."""
    store = open_store(root)
    path = join(store.root, _dir_name(_check_version(version)))
    manifest = _read_manifest(store, path, version)
    _map_files(lambda entry: _verify_file(store, path, entry), manifest.files)
    return manifest


def _verify_file(store: Store, path: str, entry: FileEntry) -> None:
    """Streams the file through sha256 (constant memory, unlike `_read_verified`) and checks it."""
    try:
        with store.open_read(join(path, entry.name)) as f:
            digest, size = hashlib.sha256(), 0
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
    except FileNotFoundError:
        raise WeightsCorrupted(f"{entry.name} is missing from {store.url(path)}") from None
    _check_file(store.url(path), entry, size, digest.hexdigest())


def _check_file(where: str, entry: FileEntry, size: int, sha256: str | None) -> None:
    """`WeightsCorrupted` naming the file unless its size (and `sha256`, when given) match the manifest."""
    if size != entry.size:
        raise WeightsCorrupted(f"{entry.name} in {where}: {size} bytes, manifest says {entry.size}")
    if sha256 is not None and sha256 != entry.sha256:
        raise WeightsCorrupted(f"{entry.name} in {where}: sha256 does not match the manifest")


def load_version(
    root: str | os.PathLike[str], version: int, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The committed version's tensors on the CPU, by name (safetensors; never pickle).

    The manifest is always checked against the marker and each file's size against the manifest; with
    `verify` each file's sha256 too, on the same bytes that are then deserialized. Names, dtypes and
    shapes are checked against the manifest. Refuses an uncommitted version (`VersionNotCommitted`)."""
    store = open_store(root)
    path = join(store.root, _dir_name(_check_version(version)))
    manifest = _read_manifest(store, path, version)
    parts = _map_files(lambda entry: _load_file(store, path, entry, manifest, verify), manifest.files)
    state_dict = {name: tensor for part in parts for name, tensor in part.items()}
    return {name: state_dict[name] for name in manifest.tensors}


def _load_file(
    store: Store, path: str, entry: FileEntry, manifest: Manifest, verify: bool
) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    data = _read_verified(store, path, entry, verify)
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors raises its own error type for a malformed header
        raise WeightsCorrupted(
            f"{entry.name} in {store.url(path)}: not a valid safetensors file ({exc})"
        ) from exc
    _check_tensors(entry.name, tensors, manifest)
    return tensors


def _check_tensors(file: str, tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    expected = {name: t for name, t in manifest.tensors.items() if t.file == file}
    if set(tensors) != set(expected):
        raise WeightsCorrupted(f"{file}: tensor names differ from the manifest")
    codes = dtype_codes()
    for name, tensor in tensors.items():
        if codes.get(tensor.dtype) != expected[name].dtype or list(tensor.shape) != expected[name].shape:
            raise WeightsCorrupted(f"{file}: tensor {name!r} differs from the manifest in dtype or shape")


def _map_files(fn: Callable[[FileEntry], _T], files: Sequence[FileEntry]) -> list[_T]:
    """`fn` over the files on up to `MAX_IO_THREADS` threads (reads and sha256 release the GIL)."""
    if len(files) <= 1:
        return [fn(entry) for entry in files]
    with ThreadPoolExecutor(min(len(files), MAX_IO_THREADS), thread_name_prefix="weights-read") as pool:
        return list(pool.map(fn, files))
