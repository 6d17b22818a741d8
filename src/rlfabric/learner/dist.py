"""The learner's process group (one rank per torchrun process, gloo on CPU and NCCL on GPU) and FSDP2.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; without them (a plain `python`
process, a unit test) the learner is a world of one on loopback. FSDP2 needs a process group even then,
so the single-process path initialises one too: the trainer has one code path for every world size.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rlfabric.runtime import hardware

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """Where this process sits in the learner's process group."""

    rank: int
    """Global rank, 0 .. size-1; rank 0 writes shared files and gathers full state dicts."""
    size: int
    """Number of ranks (data-parallel and FSDP shard degree)."""
    local_rank: int
    """Rank on this node: the index of its GPU."""
    backend: str
    """"gloo" or "nccl"."""
    device: torch.device
    """Where this rank's model lives."""

    @property
    def is_main(self) -> bool:
        """Rank 0."""
        return self.rank == 0


def select_device(local_rank: int) -> torch.device:
    """`cuda:<local_rank>` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def _free_loopback_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (for the world-of-one rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env_int(name: str, default: int) -> int:
    """An integer environment variable set by torchrun."""
    return int(os.environ.get(name, default))


def init_distributed(device: torch.device | None = None) -> World:
    """Join (or create) the default process group and return this rank's `World`.

    Idempotent: when a group already exists it is described, not re-created.
    """
    rank, size, local_rank = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    device = device or select_device(local_rank)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)  # a bare "cuda" means this rank's own GPU
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=size, device_id=_device_id(device))
        else:
            init_method = f"tcp://127.0.0.1:{_free_loopback_port()}"
            dist.init_process_group(backend, init_method=init_method, rank=0, world_size=1)
    return World(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), device)


def _device_id(device: torch.device) -> torch.device | None:
    """Bind NCCL to its GPU up front (eager init); gloo takes no device."""
    return device if device.type == "cuda" else None


def leave_together() -> None:
    """After a finished run, waits until every rank is done before the process group is destroyed: rank 0
    writes the last checkpoint and weights after the last collective, and a rank that destroyed its gloo
    group and exited meanwhile was seen aborting at exit (`terminate called without an active exception`)
    on a loaded CI machine. Not after a failure: a dead peer would leave the barrier waiting."""
    if dist.is_initialized():
        dist.barrier()


def destroy_distributed() -> None:
    """Leave the process group, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End this learner process with `code` once its run is over and the process group destroyed, without
    the interpreter's teardown: the atexit handlers run, logging and stdout/stderr are flushed, then
    `os._exit`. After a finished two-rank gloo run, a rank was seen aborting in that teardown (`terminate
    called without an active exception`, SIGABRT, after its last log line), which torchrun reports as a
    failed run although every step, checkpoint and published version was written. The teardown frees
    nothing a process that ends needs freed."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def barrier(world: World) -> None:
    """All ranks meet here (on NCCL, on this rank's device)."""
    if world.backend == "nccl":
        dist.barrier(device_ids=[world.device.index])
    else:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, world: World) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place on this rank's device, and return it."""
    reduced = tensor.to(world.device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced


def all_reduce_max(value: int, world: World) -> int:
    """The largest `value` over the ranks."""
    t = torch.tensor([value], dtype=torch.int64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _broadcast_device(world: World) -> torch.device:
    """Where broadcast tensors live: this rank's GPU on NCCL, else the CPU."""
    return world.device if world.backend == "nccl" else torch.device("cpu")


def broadcast_flag(flag: bool, world: World) -> bool:
    """Rank 0's `flag` on every rank (collective)."""
    if world.size == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=_broadcast_device(world))
    dist.broadcast(value, src=0)
    return bool(value.item())


STOP = -1
"""The payload count rank 0 sends to end the loop on every rank."""


def share_payloads(payloads: list[bytes] | None, world: World) -> list[bytes] | None:
    """Rank 0's list of byte strings on every rank (broadcasts of the count, the lengths, the bytes);
    None on every rank when rank 0 passes None (stop). The other ranks' `payloads` are ignored."""
    if world.size == 1:
        return payloads
    device = _broadcast_device(world)
    count = torch.tensor([STOP if payloads is None else len(payloads)], dtype=torch.int64, device=device)
    dist.broadcast(count, src=0)
    if int(count) == STOP:
        return None
    payloads = payloads or []
    lengths = torch.tensor([len(p) for p in payloads] or [0] * int(count), dtype=torch.int64, device=device)
    if not world.is_main:
        lengths = torch.zeros(int(count), dtype=torch.int64, device=device)
    dist.broadcast(lengths, src=0)
    blob = torch.frombuffer(bytearray(b"".join(payloads)) or bytearray(1), dtype=torch.uint8).to(device)
    if not world.is_main:
        blob = torch.zeros(max(int(lengths.sum()), 1), dtype=torch.uint8, device=device)
    dist.broadcast(blob, src=0)
    data = blob.cpu().numpy().tobytes()
    offsets = [0, *torch.cumsum(lengths.cpu(), 0).tolist()]
    return [data[offsets[i] : offsets[i + 1]] for i in range(int(count))]


# -- FSDP2 ---------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(spec_dtype: str, device: torch.device) -> torch.dtype:
    """The forward/backward dtype: `auto` is bfloat16 where the device computes it natively, float32
    elsewhere (`rlfabric.runtime.hardware.auto_dtype`); an explicit bfloat16 where it is not native logs a
    warning. Master weights stay fp32."""
    name = hardware.auto_dtype(device.type) if spec_dtype == "auto" else spec_dtype
    warning = hardware.bfloat16_warning(name, device.type)
    if warning:
        log.warning("model.dtype: %s", warning)
    return _DTYPES[name]


def shard_model(model: nn.Module, dtype: torch.dtype) -> None:
    """FSDP2: shard each decoder layer (the model's `_no_split_modules`), then the root.

    In a world of one there is nothing to free (the shard is the whole parameter), so the layers stay
    unsharded after the forward and after the backward: the backward and every later micro-batch of the
    step reuse the low-precision copies cast once, instead of casting and "gathering" the parameters
    again per micro-batch. The optimizer step reshards first (`reshard`), so the step after it casts the
    updated weights."""
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    reshard = dist.get_world_size() > 1
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in layer_types]
    for module in [*units, model]:
        fully_shard(module, mp_policy=policy, reshard_after_forward=reshard)
        if not reshard:
            cast(FSDPModule, module).set_reshard_after_backward(False, recurse=False)


def defer_gradient_sync(models: list[nn.Module], world: World, defer: bool) -> None:
    """Whether the coming backward may leave `models`' gradients unreduced (FSDP's
    `requires_gradient_sync`): call before each micro-batch, deferring on all but a step's last.

    In a world of one, deferred gradients accumulate in float32 beside the unsharded parameters and the
    last micro-batch's backward reduces them into the sharded `.grad` once, instead of every
    micro-batch copying each layer's gradients into a flat buffer and back (~3 % of a bfloat16 step of
    the bench model on CPU). With several ranks it is a no-op: deferring there would hold whole-model
    gradients on every rank until the step's last micro-batch."""
    if world.size > 1:
        return
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(not defer, recurse=False)


def reshard(model: nn.Module) -> None:
    """Return every FSDP unit of `model` to its sharded parameters (a no-op where already sharded).

    In a world of one the layers stay unsharded after forward and backward (see `shard_model`), holding
    compute-dtype copies of the weights: an optimizer step reshards first (`parts.clip_and_step`), so the
    next forward casts the updated master weights instead of reusing stale copies. State dicts and
    checkpoint loads need no call: FSDP's own state-dict hooks reshard."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
