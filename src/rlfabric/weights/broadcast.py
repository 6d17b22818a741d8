"""Broadcast weight transport: the learner (rank 0) sends a full state dict to rollout workers (ranks 1..N).

The group is built for one transfer and torn down after it, from torch primitives only (a `TCPStore` and a
gloo or NCCL backend object), so it never touches `torch.distributed`'s default process group: the
learner keeps its FSDP group, each vLLM worker keeps its own, and neither side needs vLLM to take part.

One transfer, the same on every rank:
1. Rendezvous on the store at `host:port` (rank 0 hosts it). Rank 0 publishes a digest of the tensor
   metadata; every receiver compares it with its own and acknowledges (or names why it refuses); rank 0
   answers "go" or "abort". A mismatched plan fails on every rank before a byte of weights moves.
2. Build the backend (gloo on CPU, NCCL on GPU) with `timeout_s` as its collective timeout.
3. For each bucket of `plan_buckets(metas, bucket_bytes)`: rank 0 broadcasts a large tensor as it is, or
   flattens a bucket of small ones into one flat tensor of their dtype; receivers unflatten into views.

`timeout_s` bounds each phase (waiting for the peers to join, each store wait, each collective): a peer
that never joins or dies midway makes the call raise (`BroadcastTimeout`, `BroadcastError`), never hang.

Both sides must agree on the metadata list and `bucket_bytes`: the metas travel in the UpdateWeights
request (`BroadcastSource.tensors`), in broadcast order, which `metas_from_state_dict` makes dtype-grouped.

torch is imported inside the functions that need it, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import socket
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from rlfabric.runtime.addresses import route_source

if TYPE_CHECKING:
    import torch

Backend = Literal["gloo", "nccl"]

DEFAULT_BUCKET_BYTES = 256 << 20
"""Bucket size: large enough to amortise a collective's latency, small enough to bound the extra copy."""

DTYPE_BYTES: dict[str, int] = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}
DTYPE_BYTES |= {"int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
"""Element size of each dtype a tensor may carry (torch dtype names without the `torch.` prefix)."""

SOLO_BYTES = 1 << 20
"""Tensors this large travel alone, with no flattening copy: at this size a collective's fixed cost is
small, and copying into a bucket costs more than it saves (measured on loopback gloo)."""

PIPELINE_DEPTH = 1
"""Buckets in flight beyond the one being prepared: the next bucket is flattened (sender) or allocated
(receivers) while the previous one travels, so up to PIPELINE_DEPTH + 1 buckets are in memory at once."""

_KEY_PREFIX = "rlfabric/broadcast"
_GO = "go"


class BroadcastError(RuntimeError):
    """A transfer failed: a peer refused the plan, hung up, or the collective errored."""


class BroadcastTimeout(BroadcastError, TimeoutError):
    """A peer did not join, answer or finish a collective within `timeout_s`."""


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and shape of one tensor of the state dict (HF checkpoint naming)."""

    name: str
    dtype: str
    """torch dtype name without the prefix, e.g. "float32", "bfloat16"."""
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {self.name!r}: unsupported dtype {self.dtype!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (for `collective_rpc` arguments)."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorMeta:
        return cls(str(data["name"]), str(data["dtype"]), tuple(int(d) for d in data["shape"]))


@dataclass(frozen=True)
class BroadcastPlan:
    """How a receiver joins one broadcast of new weights: the sender's rendezvous (`host`:`port`), this
    receiver's `rank` of `world_size` (the sender is rank 0), and every tensor it will receive, in order."""

    metas: list[TensorMeta]
    host: str
    port: int
    rank: int
    world_size: int
    backend: Backend = "gloo"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


@dataclass(frozen=True)
class BroadcastStats:
    """What one rank measured of one transfer. `bytes` counts the payload once (not per receiver)."""

    rank: int
    world_size: int
    tensors: int
    buckets: int
    bytes: int
    rendezvous_s: float
    """Store handshake plus backend creation."""
    transfer_s: float
    """All bucket broadcasts, flattening and unflattening included (group teardown excluded)."""

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbytes_per_s": self.gbytes_per_s}


# Metadata and the bucket plan


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def metas_from_state_dict(state_dict: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    """The metas of a state dict in broadcast order: grouped by dtype (first appearance), then dict order."""
    metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state_dict.items()]
    return _group_by_dtype(metas)


def _group_by_dtype(metas: Iterable[TensorMeta]) -> list[TensorMeta]:
    groups: dict[str, list[TensorMeta]] = {}
    for meta in metas:
        groups.setdefault(meta.dtype, []).append(meta)
    return [meta for group in groups.values() for meta in group]


def plan_buckets(
    metas: Sequence[TensorMeta], bucket_bytes: int, solo_bytes: int = SOLO_BYTES
) -> list[list[TensorMeta]]:
    """The broadcast plan: buckets of one dtype each, in the order they are sent.

    A tensor of at least `min(solo_bytes, bucket_bytes)` bytes is a bucket by itself (sent without a
    copy). Smaller ones are packed in order, per dtype (groups in order of first appearance), into
    buckets of at most `bucket_bytes`; a packing bucket is emitted when the next tensor would overflow
    it, when the dtype changes, or at the end. The plan is a pure function of its arguments, so sender
    and receivers compute the same one."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in _group_by_dtype(metas):
        if meta.nbytes >= min(solo_bytes, bucket_bytes):
            buckets.append([meta])
            continue
        if current and (meta.dtype != current[0].dtype or size + meta.nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        buckets.append(current)
    return buckets


def plan_digest(metas: Sequence[TensorMeta], bucket_bytes: int) -> str:
    """sha256 of the metas and bucket size: equal digests mean sender and receiver agree on the plan."""
    payload = json.dumps([bucket_bytes, SOLO_BYTES, [m.to_dict() for m in metas]], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def metas_to_json(metas: Iterable[TensorMeta]) -> list[dict[str, Any]]:
    """Metas as plain dicts (what `collective_rpc` can carry)."""
    return [m.to_dict() for m in metas]


def metas_from_json(data: str | Sequence[Mapping[str, Any]]) -> list[TensorMeta]:
    """Metas from `metas_to_json` output, or that output serialised as a JSON string."""
    items = json.loads(data) if isinstance(data, str) else data
    return [TensorMeta.from_dict(item) for item in items]


# The group: store handshake, then the backend


@dataclass
class _Group:
    """One transfer's store and backend; `close` releases both."""

    store: Any
    backend: Any
    device: torch.device

    def start(self, tensor: torch.Tensor) -> Any:
        """Starts broadcasting `tensor` from rank 0 in place; returns the work to pass to `wait`."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        with _translated_errors("broadcast"):
            return self.backend.broadcast([tensor], options)

    def wait(self, work: Any) -> None:
        """Waits for a started broadcast; raises BroadcastTimeout/BroadcastError on failure."""
        with _translated_errors("broadcast"):
            work.wait()

    def close(self) -> None:
        if hasattr(self.backend, "shutdown"):
            self.backend.shutdown()
        self.backend = None
        self.store = None


@contextlib.contextmanager
def _translated_errors(what: str) -> Iterator[None]:
    """Turns torch's store/collective failures into BroadcastTimeout (timeouts) or BroadcastError."""
    try:
        yield
    except BroadcastError:
        raise
    except Exception as exc:
        text = str(exc).lower()
        error = BroadcastTimeout if ("timeout" in text or "timed out" in text) else BroadcastError
        raise error(f"{what} failed: {exc}") from exc


def _open_store(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """The transfer's TCPStore: rank 0 listens on `host:port`, the others connect once it listens."""
    import torch.distributed as dist

    if rank != 0:  # torch's own connect retries back off past the timeout: wait for the listener here
        _wait_for_listener(host, port, time.monotonic() + timeout_s)
    with _translated_errors(f"rendezvous at {host}:{port}"):
        store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )  # fmt: skip
    return dist.PrefixStore(_KEY_PREFIX, store)


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Returns once something accepts TCP connections at `host:port`; BroadcastTimeout at `deadline`."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic())):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise BroadcastTimeout(f"no sender listening at {host}:{port}") from error
            time.sleep(0.005)


def _store_get(store: Any, key: str, what: str) -> str:
    with _translated_errors(what):
        return store.get(key).decode()


def _handshake_sender(store: Any, digest: str, world_size: int, timeout_s: float) -> None:
    """Publishes the plan digest, waits (at most `timeout_s` in all) for every receiver's answer, then says
    go, or aborts and raises."""
    store.set("digest", digest)
    ranks = range(1, world_size)
    try:
        with _translated_errors("waiting for the receivers to join"):
            store.wait([f"ack/{r}" for r in ranks], timedelta(seconds=timeout_s))
    except BroadcastTimeout as error:
        missing = [r for r in ranks if not store.check([f"ack/{r}"])]
        _abort(store, f"ranks {missing} did not join", [r for r in ranks if r not in missing])
        raise BroadcastTimeout(f"receiver ranks {missing} did not join within {timeout_s:g} s") from error
    answers = {r: store.get(f"ack/{r}").decode() for r in ranks}
    refusals = {r: a for r, a in answers.items() if a != _GO}
    if refusals:
        _abort(store, f"refused: {refusals}", [r for r, a in answers.items() if a == _GO])
        raise BroadcastError(f"receivers refused the transfer: {refusals}")
    store.set("decision", _GO)


def _abort(store: Any, reason: str, waiting: list[int]) -> None:
    """Tells the receivers that joined to give up, and lets them read it before the store goes away."""
    store.set("decision", f"abort: {reason}")
    if waiting:
        # A receiver that left already needs no answer; the caller raises the abort anyway.
        with contextlib.suppress(Exception):
            store.wait([f"seen/{r}" for r in waiting], timedelta(seconds=5))


def _handshake_receiver(store: Any, digest: str, rank: int, refusal: str | None) -> None:
    """Checks the sender's digest against ours, answers, and waits for the sender's decision."""
    theirs = _store_get(store, "digest", "waiting for the sender")
    if refusal is None and theirs != digest:
        refusal = "tensor metadata or bucket_bytes differ from the sender's"
    store.set(f"ack/{rank}", _GO if refusal is None else refusal)
    if refusal is not None:
        raise BroadcastError(f"rank {rank} refused the transfer: {refusal}")
    decision = _store_get(store, "decision", "waiting for the sender's decision")
    store.set(f"seen/{rank}", "1")
    if decision != _GO:
        raise BroadcastError(f"sender aborted the transfer ({decision})")


def _local_address(host: str) -> str:
    """The address gloo binds on this rank: the one it reaches the rendezvous `host` from (the sender's
    own when `host` is local), which the other ranks can therefore reach. gloo's default device binds what
    the machine's hostname resolves to, which another host (a pod, a network namespace) may not reach."""
    return route_source(host)


def _make_backend(
    store: Any, rank: int, world_size: int, backend: Backend, host: str, timeout_s: float
) -> Any:
    """A gloo or NCCL backend object over `store` (not registered with torch.distributed)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    prefix = dist.PrefixStore("pg", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(host))]
        return dist.ProcessGroupGloo(prefix, rank, world_size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world_size, options)
    raise ValueError(f"unknown backend {backend!r} (gloo or nccl)")


def _open_group(
    host: str, port: int, rank: int, world_size: int, backend: Backend, timeout_s: float, *,
    digest: str, refusal: str | None = None,
) -> _Group:  # fmt: skip
    """Rendezvous, handshake and backend creation: step 1 and 2 of a transfer."""
    import torch

    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} / world_size {world_size}: need world_size >= 2 and 0 <= rank")
    store = _open_store(host, port, rank, world_size, timeout_s)
    if rank == 0:
        _handshake_sender(store, digest, world_size, timeout_s)
    else:
        _handshake_receiver(store, digest, rank, refusal)
    with _translated_errors(f"creating the {backend} group"):
        pg = _make_backend(store, rank, world_size, backend, host, timeout_s)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return _Group(store, pg, device)


# Sender and receiver


def send_state_dict(
    state_dict: Mapping[str, torch.Tensor], *, host: str, port: int, world_size: int,
    backend: Backend = "gloo", bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0,
    metas: Sequence[TensorMeta] | None = None,
) -> BroadcastStats:  # fmt: skip
    """Broadcasts `state_dict` as rank 0 to ranks 1..world_size-1 and returns what it measured.

    `metas` defaults to `metas_from_state_dict(state_dict)`; pass the list the receivers were given if it
    was built otherwise. Raises BroadcastTimeout when a receiver does not join or stalls for `timeout_s`,
    BroadcastError when one refuses the plan or fails."""
    metas = list(metas) if metas is not None else metas_from_state_dict(state_dict)
    start = time.perf_counter()
    group = _open_group(
        host, port, 0, world_size, backend, timeout_s, digest=plan_digest(metas, bucket_bytes)
    )
    try:
        rendezvous_s = time.perf_counter() - start
        buckets = plan_buckets(metas, bucket_bytes)
        in_flight: deque[tuple[Any, torch.Tensor]] = deque()
        for bucket in buckets:
            flat = _flatten(state_dict, bucket, group.device)
            if flat.numel():
                in_flight.append((group.start(flat), flat))
            while len(in_flight) > PIPELINE_DEPTH:
                group.wait(in_flight.popleft()[0])
        while in_flight:
            group.wait(in_flight.popleft()[0])
        transfer_s = time.perf_counter() - start - rendezvous_s
    finally:
        group.close()
    total = sum(m.nbytes for m in metas)
    return BroadcastStats(0, world_size, len(metas), len(buckets), total, rendezvous_s, transfer_s)


def receive_state_dict(
    metas: Sequence[TensorMeta], *, host: str, port: int, rank: int, world_size: int,
    backend: Backend = "gloo", bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0,
    device: str | torch.device | None = None, refusal: str | None = None,
) -> tuple[dict[str, torch.Tensor], BroadcastStats]:  # fmt: skip
    """Receives the state dict that rank 0 broadcasts; returns it (in `metas` order) and what it measured.

    Tensors are views into per-bucket flat tensors on `device` (default: CPU for gloo, the current CUDA
    device for NCCL). `refusal`, when given, makes this rank join only to refuse: the sender fails with the
    reason instead of waiting for it to time out, and this call raises BroadcastError."""
    import torch

    start = time.perf_counter()
    digest = plan_digest(metas, bucket_bytes)
    group = _open_group(host, port, rank, world_size, backend, timeout_s, digest=digest, refusal=refusal)
    try:
        rendezvous_s = time.perf_counter() - start
        buckets = plan_buckets(metas, bucket_bytes)
        target = torch.device(device) if device is not None else group.device
        received: dict[str, torch.Tensor] = {}
        in_flight: deque[tuple[Any, torch.Tensor, list[TensorMeta]]] = deque()
        for bucket in buckets:
            flat = torch.empty(
                sum(m.numel for m in bucket), dtype=_dtype(bucket[0].dtype), device=group.device
            )
            in_flight.append((group.start(flat) if flat.numel() else None, flat, bucket))
            while len(in_flight) > PIPELINE_DEPTH or (in_flight and bucket is buckets[-1]):
                received.update(_finish(group, *in_flight.popleft(), target))
        transfer_s = time.perf_counter() - start - rendezvous_s
    finally:
        group.close()
    stats = BroadcastStats(
        rank, world_size, len(metas), len(buckets), sum(m.nbytes for m in metas), rendezvous_s, transfer_s
    )
    return {m.name: received[m.name] for m in metas}, stats


def _finish(
    group: _Group, work: Any, flat: torch.Tensor, bucket: list[TensorMeta], target: torch.device
) -> Iterable[tuple[str, torch.Tensor]]:
    """Waits for one received bucket and returns its tensors on `target`."""
    if work is not None:
        group.wait(work)
    return list(_unflatten(flat.to(target), bucket))


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _flatten(
    state_dict: Mapping[str, torch.Tensor], bucket: Sequence[TensorMeta], device: Any
) -> torch.Tensor:
    """The bucket's tensors, checked against their metas, concatenated into one flat tensor on `device`."""
    import torch

    parts = []
    for meta in bucket:
        tensor = state_dict[meta.name]
        if dtype_name(tensor.dtype) != meta.dtype or tuple(tensor.shape) != meta.shape:
            raise ValueError(
                f"tensor {meta.name!r} is {tensor.dtype} {tuple(tensor.shape)}, meta says {meta}"
            )
        parts.append(tensor.detach().reshape(-1).to(device))
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def _unflatten(flat: torch.Tensor, bucket: Sequence[TensorMeta]) -> Iterable[tuple[str, torch.Tensor]]:
    """Views of `flat` shaped as the bucket's metas, in order."""
    offset = 0
    for meta in bucket:
        yield meta.name, flat[offset : offset + meta.numel].view(meta.shape)
        offset += meta.numel


def mismatches(metas: Sequence[TensorMeta], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Why `metas` is not a full state dict of a model whose tensors are `expected` (name -> shape).

    Empty when every expected name arrives exactly once with its shape and nothing else arrives. Dtypes
    are not compared: the engine casts on load."""
    problems: list[str] = []
    seen: set[str] = set()
    for meta in metas:
        if meta.name in seen:
            problems.append(f"{meta.name}: sent twice")
        elif meta.name not in expected:
            problems.append(f"{meta.name}: not a tensor of this model")
        elif tuple(expected[meta.name]) != meta.shape:
            problems.append(f"{meta.name}: shape {meta.shape}, model has {tuple(expected[meta.name])}")
        seen.add(meta.name)
    problems.extend(f"{name}: missing" for name in expected if name not in seen)
    return problems
