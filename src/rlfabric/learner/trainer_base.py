"""What every learner trainer is, whatever it trains on: the seam between the loops and the trainers.

Every trainer shares it: `trainer.Trainer` (online RL on scored groups), `preference.PreferenceTrainer`
(offline DPO/IPO/ORPO/SimPO on preference pairs), `kto.KTOTrainer` (KTO on labelled rows),
`reward_model.RewardModelTrainer` (Bradley-Terry reward models) and `sft.SFTTrainer` (supervised
fine-tuning). The loops
(`loop.TrainingLoop`, `offline.OfflineRun`), the restart helpers and the leader are typed against
`TrainerBase`, never against one trainer.

Invariants:
1. `step` counts the optimizer steps taken; `policy_version` is the version of the weights the trainer
   holds. `_set_progress` is their one writer, called by `train_step` (each + 1), `load_checkpoint`
   (the checkpoint's) and `renumber` (a loop's decision: a restart's restore version, or the offline
   run's next free version). Everything else reads them.
2. Only rank 0's `policy_version` is published or written into a checkpoint's metadata; a loop that
   renumbers on rank 0 alone (a restart) leaves the other ranks' copy unused.
3. A checkpoint holds step, version, the trainer's own scalars (`_scalars`) and the caller's `extra`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlfabric.learner.checkpoint import CheckpointState, TrainObjects, load_checkpoint, save_checkpoint
from rlfabric.learner.dist import World, compute_dtype
from rlfabric.learner.lora import adapter_state_dict, merged_state_dict
from rlfabric.runspec import RunSpec

ItemT = TypeVar("ItemT")
"""What one train step consumes a sequence of: scored groups, or preference pairs."""


class TrainerBase(Generic[ItemT]):
    """One learner rank's policy, optimizer and schedule, FSDP2-sharded, and its step and version.

    Subclasses load `model`, `optimizer`, `scheduler` and `pad_id` in their `__init__` (after this one,
    which seeds the RNGs) and implement `_train` and `_train_objects`."""

    model: nn.Module
    optimizer: Optimizer
    scheduler: LRScheduler
    pad_id: int

    def __init__(self, spec: RunSpec, *, device: torch.device, world: World) -> None:
        self.spec, self.world, self.device = spec, world, device
        random.seed(spec.train.seed)
        torch.manual_seed(spec.train.seed)
        self.dtype = compute_dtype(spec.model.dtype, device)
        self._step = 0
        self._policy_version = 0

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored from a checkpoint)."""
        return self._step

    @property
    def policy_version(self) -> int:
        """The version of the weights this trainer holds (invariant 1 of the module docstring)."""
        return self._policy_version

    def train_step(self, items: Sequence[ItemT]) -> dict[str, float]:
        """One optimizer step on `items` (the same list on every rank; collective). Returns the step's
        global metrics; step and version each advance by one."""
        metrics = self._train(items)
        self._set_progress(self._step + 1, self._policy_version + 1)
        return metrics

    def warm_up(self) -> None:
        """Run the training path once on made-up data, leaving no trace (collective), so that one-time
        costs (compiling, first allocations) are paid before the first real step. Nothing by default."""

    def renumber(self, version: int) -> None:
        """Hold the current weights as `version` (the loop chose it: see invariant 1)."""
        self._set_progress(self._step, version)

    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded policy weights on CPU, on rank 0 (empty elsewhere), LoRA adapters merged (the plain
        model's names and shapes). Collective."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = cast(dict[str, Tensor], get_model_state_dict(self.model, options=options))
        lora = self.spec.model.lora
        return merged_state_dict(state, lora) if lora is not None else state

    def adapter_state_dict(self) -> dict[str, Tensor]:
        """The policy's LoRA adapters alone (PEFT's saved names) on CPU, on rank 0 (empty elsewhere); only
        the trainable parameters are gathered. Collective."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return adapter_state_dict(cast(dict[str, Tensor], get_model_state_dict(self.model, options=options)))

    def save_checkpoint(self, root: str | Path, extra: dict[str, bytes | str] | None = None) -> Path:
        """Write a resumable checkpoint of this step under `root` (collective)."""
        state = CheckpointState(self._step, self._policy_version, dict(extra or {}), self._scalars())
        return save_checkpoint(root, state, self._train_objects(), self.world)

    def load_checkpoint(self, path: str | Path) -> dict[str, bytes | str]:
        """Resume from the checkpoint at `path` (collective); returns the caller's `extra`."""
        state = load_checkpoint(path, self._train_objects(), self.world)
        self._set_progress(state.step, state.policy_version)
        self._load_scalars(state.trainer)
        return state.extra

    def _set_progress(self, step: int, policy_version: int) -> None:
        """The one writer of `step` and `policy_version`."""
        self._step, self._policy_version = step, policy_version

    # -- what each trainer provides ------------------------------------------------------------------

    def _train(self, items: Sequence[ItemT]) -> dict[str, float]:
        """The step's work before the counters advance: plan, accumulate, optimizer step, metrics."""
        raise NotImplementedError

    def _train_objects(self) -> TrainObjects:
        """The stateful objects a checkpoint saves and restores in place."""
        raise NotImplementedError

    def _scalars(self) -> dict[str, Any]:
        """JSON-able trainer scalars a checkpoint records (none by default)."""
        return {}

    def _load_scalars(self, scalars: dict[str, Any]) -> None:
        """Restore what `_scalars` recorded."""
