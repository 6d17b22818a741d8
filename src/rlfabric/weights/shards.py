"""Safetensors shards written by streaming tensor memory into the file and into sha256 at once.

`rlfabric.weights.versions` publishes versions with these rather than `safetensors.torch.save_file`, which
first serializes the whole shard into one bytes object and leaves hashing to a second read pass. Here
each shard's bytes go straight from the tensors (views, no copies, once they are in host memory) to the
file, and each chunk is hashed on a second thread while the next is written (sha256 and file writes both
release the GIL); shards are written concurrently. The bytes are safetensors' format exactly: an 8-byte
little-endian header length, a JSON header padded with spaces to a multiple of 8, then each tensor's raw
little-endian bytes in C order, contiguous and in header order, so any safetensors reader (vLLM,
transformers, `safetensors.safe_open`) reads the files.

Within a shard tensors are ordered by element size, largest first, so each tensor's data starts aligned
to its element size (the header ends on an 8-byte boundary). Tensors that share storage (tied
embeddings) are each written under their own name from the shared memory, with no clone.

Imports without torch; torch is imported inside the functions that need it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import astuple, dataclass, field
from typing import TYPE_CHECKING, Any

from rlfabric.runtime.errors import InvalidArgument
from rlfabric.weights.store import Store, join

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 8 << 20
"""Unit of streaming: each chunk is hashed on one thread while the next is written on another."""
MAX_IO_THREADS = 4


@dataclass(frozen=True)
class FileEntry:
    """One shard: its name inside the version directory, its size in bytes and the sha256 of those bytes."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PublishTimings:
    """Seconds per phase. `write_s` (including each shard's fsync) and `hash_s` are summed over threads:
    they overlap each other and across shards, so they can add up to more than `total_s`. `serialize_s`
    covers headers and moving tensors to host memory; `sync_s` the directory syncs, manifest and marker."""

    serialize_s: float = 0.0
    write_s: float = 0.0
    hash_s: float = 0.0
    sync_s: float = 0.0
    total_s: float = 0.0

    def __add__(self, other: PublishTimings) -> PublishTimings:
        return PublishTimings(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class Shard:
    """Tensors bound for one file, in on-disk order (largest element size first, so data stays aligned)."""

    name: str
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0


def plan_shards(state_dict: Mapping[str, torch.Tensor], shard_bytes: int) -> list[Shard]:
    """Greedy split in state-dict order: a shard is closed when the next tensor would overflow it."""
    if shard_bytes < 1:
        raise InvalidArgument(f"shard_bytes must be positive, got {shard_bytes}")
    if not state_dict:
        raise InvalidArgument("refusing to publish an empty state dict")
    shards = [Shard("")]
    for name, tensor in state_dict.items():
        if name == "__metadata__":
            raise InvalidArgument("'__metadata__' is reserved by safetensors and cannot name a tensor")
        dtype_code(tensor)  # fail on an unsupported dtype before writing anything
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1].tensors and shards[-1].nbytes + nbytes > shard_bytes:
            shards.append(Shard(""))
        shards[-1].tensors.append((name, tensor))
        shards[-1].nbytes += nbytes
    for index, shard in enumerate(shards, start=1):
        shard.name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        shard.tensors.sort(key=lambda item: (-item[1].element_size(), item[0]))
    return shards


def dtype_code(tensor: torch.Tensor) -> str:
    """The safetensors dtype code of `tensor` (`F32`, `BF16`, ...); `InvalidArgument` if it has none."""
    codes = dtype_codes()
    if tensor.dtype not in codes:
        raise InvalidArgument(f"dtype {tensor.dtype} cannot be published (safetensors has no code for it)")
    return codes[tensor.dtype]


@functools.cache
def dtype_codes() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors dtype code, for every dtype both support."""
    import torch

    return {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
        torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint64: "U64",
        torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL",
    }  # fmt: skip


def write_shards(store: Store, path: str, shards: Sequence[Shard]) -> tuple[list[FileEntry], PublishTimings]:
    """Writes the shards into the directory `path` concurrently (a thread each, plus a hashing thread
    each). Their contents are durable on return, their names once the caller syncs the directory. Returns
    the entries in shard order and the timings summed over shards."""
    workers = min(len(shards), MAX_IO_THREADS)
    with ThreadPoolExecutor(workers, thread_name_prefix="weights-write") as pool:
        results = list(pool.map(lambda shard: _write_shard(store, join(path, shard.name), shard), shards))
    timings = PublishTimings()
    for _, shard_timings in results:
        timings += shard_timings
    return [entry for entry, _ in results], timings


def _write_shard(store: Store, path: str, shard: Shard) -> tuple[FileEntry, PublishTimings]:
    """Streams one shard into `path`, hashing each chunk on a second thread while the next is written."""
    digest, size, spent = hashlib.sha256(), 0, {"serialize": 0.0, "write": 0.0, "hash": 0.0}
    pending: list[Future[None]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="weights-hash") as hasher:
        with store.open_write(path) as out:
            for chunk in _shard_chunks(shard, spent):
                pending.append(hasher.submit(_timed, digest.update, chunk, spent, "hash"))
                _timed(out.write, chunk, spent, "write")
                size += len(chunk)
            close_started = time.perf_counter()
        spent["write"] += time.perf_counter() - close_started  # fsync, flush of the last object part
        for future in pending:
            future.result()
    timings = PublishTimings(spent["serialize"], spent["write"], spent["hash"])
    return FileEntry(os.path.basename(path), size, digest.hexdigest()), timings


def _timed(fn: Callable[[memoryview], Any], chunk: memoryview, spent: dict[str, float], key: str) -> None:
    started = time.perf_counter()
    fn(chunk)
    spent[key] += time.perf_counter() - started


def _shard_chunks(shard: Shard, spent: dict[str, float]) -> Iterator[memoryview]:
    """The file's bytes as views (no copies of host tensors): header, then each tensor in `CHUNK_BYTES`."""
    started = time.perf_counter()
    yield memoryview(_shard_header(shard))
    spent["serialize"] += time.perf_counter() - started
    for _, tensor in shard.tensors:
        started = time.perf_counter()
        data = _host_bytes(tensor)
        spent["serialize"] += time.perf_counter() - started
        for offset in range(0, data.nbytes, CHUNK_BYTES):
            yield data[offset : offset + CHUNK_BYTES]


def _shard_header(shard: Shard) -> bytes:
    """safetensors header: u64 little-endian length, then JSON padded with spaces to a multiple of 8."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in shard.tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtype_code(tensor), "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order on the host: a view of its memory when it already is there."""
    import torch

    if sys.byteorder != "little":
        raise RuntimeError("safetensors is little-endian; publishing from a big-endian host is unsupported")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data  # a 1-D memoryview of unsigned bytes
