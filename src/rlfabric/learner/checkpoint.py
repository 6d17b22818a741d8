"""Resumable learner checkpoints: sharded model and optimizer, scheduler, RNG, step and the caller's ledger.

Layout of `<root>/step-000012/`:
- torch.distributed.checkpoint (DCP) shards: tensors only (`model.*`, `optim.*`, and with a PPO critic
  `critic.model.*`, `critic.optim.*`: each rank writes its shards, so saving never gathers the model);
- `meta.json` (rank 0): step, policy version, scheduler state, optimizer param groups (the critic's under
  `critic`), trainer scalars and the caller's opaque `extra` (bytes base64-encoded);
- `rng-00000.pt` per rank: torch CPU (and CUDA) RNG states as uint8 tensors, python `random` state as a
  JSON string; read back with `torch.load(weights_only=True)`;
- `COMPLETE`, written last.
Nothing is pickled: DCP pickles non-tensor values, so they go to `meta.json` instead. A checkpoint is
written as `step-000012.tmp` and renamed once `COMPLETE` is in it, so a folder named `step-NNNNNN` is
whole; `latest_complete` also checks the marker, for folders copied by other means.
"""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlfabric.learner.dist import World, barrier
from rlfabric.runtime import failpoints

COMPLETE = "COMPLETE"
META = "meta.json"
_NAME = re.compile(r"^step-(\d{6,})$")


@dataclass
class CheckpointState:
    """What a checkpoint records besides the model and optimizer tensors."""

    step: int
    """Optimizer steps done."""
    policy_version: int
    """Version of the policy these weights are."""
    extra: dict[str, bytes | str] = field(default_factory=dict)
    """The caller's opaque data (the applied-group ledger), saved and returned verbatim."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """JSON-able trainer scalars (e.g. the adaptive KL coefficient)."""


@dataclass
class TrainObjects:
    """The stateful training objects a checkpoint saves and restores in place."""

    model: nn.Module
    optimizer: Optimizer
    scheduler: LRScheduler
    critic: TrainObjects | None = None
    """The PPO critic's model, optimizer and schedule, when the run trains one."""


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """`<root>/step-000012`."""
    return Path(root) / f"step-{step:06d}"


# -- save -----------------------------------------------------------------------------------------------


def save_checkpoint(root: str | Path, state: CheckpointState, objects: TrainObjects, world: World) -> Path:
    """Write the checkpoint of `state.step` (collective: every rank calls it) and return its folder."""
    final = checkpoint_dir(root, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    tensors, groups = _tensor_state(objects)
    dcp.save(tensors, checkpoint_id=tmp)
    torch.save(_rng_state(), tmp / _rng_name(world.rank))
    barrier(world)
    if world.is_main:
        failpoints.hit("learner.checkpoint_write")  # tensors written, meta and marker not yet
        _write_meta(tmp, state, objects, groups)
        (tmp / COMPLETE).write_text(json.dumps({"step": state.step}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    barrier(world)
    return final


def _tensor_state(objects: TrainObjects) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DCP tree of model and optimizer tensors (the critic's under `critic`) and the optimizers'
    param groups, keyed alike ("policy", "critic")."""
    model_sd, optim_sd = get_state_dict(objects.model, objects.optimizer)
    tensors: dict[str, Any] = {"model": model_sd, "optim": optim_sd["state"]}
    groups = {"policy": optim_sd["param_groups"]}
    if objects.critic is not None:
        critic_model, critic_optim = get_state_dict(objects.critic.model, objects.critic.optimizer)
        tensors["critic"] = {"model": critic_model, "optim": critic_optim["state"]}
        groups["critic"] = critic_optim["param_groups"]
    return tensors, groups


def _write_meta(folder: Path, state: CheckpointState, objects: TrainObjects, groups: dict[str, Any]) -> None:
    """`meta.json`: every non-tensor part of the checkpoint."""
    meta = {
        "step": state.step,
        "policy_version": state.policy_version,
        "scheduler": objects.scheduler.state_dict(),
        "param_groups": groups["policy"],
        "trainer": state.trainer,
        "extra": _encode_extra(state.extra),
    }
    if objects.critic is not None:
        meta["critic"] = {
            "scheduler": objects.critic.scheduler.state_dict(),
            "param_groups": groups["critic"],
        }
    (folder / META).write_text(json.dumps(meta))


def _encode_extra(extra: dict[str, bytes | str]) -> dict[str, dict[str, str]]:
    """JSON form of `extra`: bytes as base64, each value tagged with its type."""
    return {
        key: {"bytes": base64.b64encode(value).decode()} if isinstance(value, bytes) else {"str": value}
        for key, value in extra.items()
    }


def _decode_extra(encoded: dict[str, dict[str, str]]) -> dict[str, bytes | str]:
    """Inverse of `_encode_extra`."""
    return {
        key: base64.b64decode(value["bytes"]) if "bytes" in value else value["str"]
        for key, value in encoded.items()
    }


def _rng_name(rank: int) -> str:
    return f"rng-{rank:05d}.pt"


def _rng_state() -> dict[str, torch.Tensor | str]:
    """This process's RNG states, as tensors and a JSON string (weights_only-loadable)."""
    state: dict[str, torch.Tensor | str] = {
        "torch_cpu": torch.get_rng_state(),
        "python": json.dumps(random.getstate()),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


# -- load -----------------------------------------------------------------------------------------------


def load_checkpoint(path: str | Path, objects: TrainObjects, world: World) -> CheckpointState:
    """Restore `objects` and this rank's RNG from the checkpoint at `path` (collective)."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint")
    meta = json.loads((path / META).read_text())
    if objects.critic is not None and "critic" not in meta:
        raise ValueError(f"{path} has no critic: it was not written by a run with a critic (gae)")
    tensors, _ = _tensor_state(objects)
    dcp.load(tensors, checkpoint_id=path)  # in place
    _restore_objects(objects, tensors, meta)
    if objects.critic is not None:
        _restore_objects(objects.critic, tensors["critic"], meta["critic"])
    _restore_rng(path, world.rank)
    return CheckpointState(
        step=meta["step"],
        policy_version=meta["policy_version"],
        extra=_decode_extra(meta["extra"]),
        trainer=meta["trainer"],
    )


def _restore_objects(objects: TrainObjects, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    """Load one model/optimizer/scheduler from its loaded DCP `tensors` and `meta` (param groups and
    scheduler state)."""
    optim_sd = {"state": tensors["optim"], "param_groups": _param_groups(meta["param_groups"])}
    set_state_dict(
        objects.model, objects.optimizer, model_state_dict=tensors["model"], optim_state_dict=optim_sd
    )
    objects.scheduler.load_state_dict(meta["scheduler"])


def _param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Optimizer param groups from JSON: lists (betas) back to tuples, parameter names kept as lists."""
    return [
        {key: tuple(v) if isinstance(v, list) and key != "params" else v for key, v in group.items()}
        for group in groups
    ]


def _restore_rng(path: Path, rank: int) -> None:
    """Restore this rank's RNG states (rank 0's when the world grew since the save)."""
    file = path / _rng_name(rank)
    if not file.is_file():
        file = path / _rng_name(0)
    state = torch.load(file, weights_only=True)
    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


# -- housekeeping ---------------------------------------------------------------------------------------


def _step_of(path: Path) -> int | None:
    """The step in a `step-NNNNNN` folder name; None for anything else (including `.tmp`)."""
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := _step_of(p)) is not None and (p / COMPLETE).is_file()]
    return [p for _, p in sorted(found)]


def latest_complete(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None; unfinished ones are ignored."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and unfinished folders older than the
    newest complete one (left by a crash). Rank 0 only, never while a save is in progress."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    complete = complete_checkpoints(root)
    doomed = complete[:-keep]
    if complete:
        newest = _step_of(complete[-1]) or 0
        doomed += [p for p in Path(root).iterdir() if _is_stale(p, newest)]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def _is_stale(path: Path, newest: int) -> bool:
    """An unfinished checkpoint folder (`.tmp`, or no marker) of a step before `newest`."""
    name = path.name.removesuffix(".tmp")
    match = _NAME.match(name)
    if not match or int(match.group(1)) >= newest:
        return False
    return path.name.endswith(".tmp") or not (path / COMPLETE).is_file()
