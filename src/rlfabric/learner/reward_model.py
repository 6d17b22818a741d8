"""Reward-model training (`mode = "reward_model"`): Bradley-Terry on preference pairs, FSDP2-sharded.

The model is the policy checkpoint loaded as a sequence classifier with one label (`parts.load_model`
with `reward_head`: the LM head dropped, a scalar `score` head newly initialised) whose
`config.pad_token_id` is the tokenizer's pad token (else its EOS), so each sequence's reward is the score
at its last token that is not padding, in training as in the reward service's `reward_model` scorer.

`RewardModelTrainer.train_step(pairs)` runs in named phases, like the other trainers:
1. plan: this rank's share of the pairs (round-robin), longest first, cut into micro-batches of whole
   pairs (rows 2i chosen and 2i+1 rejected of one forward pass), padded to the same count on every rank
   (FSDP collectives need it), and the step's pair count summed over the ranks;
2. accumulate: per micro-batch, the rewards, the summed per-pair loss (`bradley_terry_loss`) divided by
   the step's global pair count, backpropagated;
3. optimizer step: grad clipping, AdamW, LR schedule (`parts.build_optimizer`);
4. metrics: one all-reduce of every summed statistic.

The loss is the mean over every pair of the step, on every rank, so gradient accumulation and sharding
are exact: FSDP averages gradients over ranks, so each rank's loss is also multiplied by the world size.
No reference model is loaded. `evaluate` computes the same statistics without gradient on held-out pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlfabric.learner.checkpoint import TrainObjects
from rlfabric.learner.dist import World, all_reduce_max, all_reduce_sum, defer_gradient_sync
from rlfabric.learner.parts import build_optimizer, clip_and_step, load_model
from rlfabric.learner.reward_model_data import RewardPair
from rlfabric.learner.trainer_base import TrainerBase
from rlfabric.runspec import RunSpec

SUMMED = ("loss", "correct", "margin", "chosen", "rejected", "pairs", "tokens")
"""Per-step sums over pairs: loss, pairs ranked right (r_chosen > r_rejected), r_chosen - r_rejected,
r_chosen, r_rejected; then the pairs and their tokens."""


def bradley_terry_loss(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_coef: float | None = None
) -> Tensor:
    """Each pair's loss: -log sigmoid(r_c - r_r - m), plus coef * (r_c + r_r)^2 with `center_coef` (TRL's
    `center_rewards_coefficient`; its mean over pairs is TRL's term). (P,) rewards and margins → (P,)."""
    diff = chosen - rejected if margin is None else chosen - rejected - margin
    loss = -F.logsigmoid(diff)
    if center_coef is not None:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


@dataclass
class PairBatch:
    """One forward pass of whole pairs: rows 2i (chosen) and 2i+1 (rejected) are pair i."""

    input_ids: Tensor
    """(2P, T) right-padded with the pad id; a padding batch is one row of one pad token."""
    attention_mask: Tensor
    """(2P, T) 1 on real tokens."""
    margins: Tensor
    """(P,) each pair's margin."""
    pairs: int
    """P: 0 for a padding batch."""


def pair_batch(pairs: Sequence[RewardPair], pad_id: int, device: torch.device) -> PairBatch:
    """`pairs` as one right-padded batch on `device` (a padding batch when there are none)."""
    rows = [ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)] or [[pad_id]]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    margins = torch.tensor([p.margin for p in pairs], dtype=torch.float32, device=device)
    return PairBatch(input_ids, mask, margins, len(pairs))


def plan_batches(pairs: Sequence[RewardPair], per_batch: int) -> list[list[RewardPair]]:
    """`pairs` longest first, in groups of `per_batch` (little padding within a forward pass)."""
    ordered = sorted(pairs, key=lambda p: -max(len(p.chosen_ids), len(p.rejected_ids)))
    return [ordered[i : i + per_batch] for i in range(0, len(ordered), per_batch)]


def pad_token_id(tokenizer_path: str | Path) -> int:
    """The id padding rows: the tokenizer's pad token, else its EOS (TRL's and the scorer's choice)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("model.path: the tokenizer has neither a pad nor an EOS token to pad rewards with")
    return int(pad)


def rewards_of(model: nn.Module, batch: PairBatch) -> Tensor:
    """The model's reward of each row, in float32: (2P,)."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return out.logits[:, 0].float()


class RewardModelTrainer(TrainerBase[RewardPair]):
    """Reward model, optimizer and schedule of one learner rank, trained on preference pairs."""

    def __init__(
        self, spec: RunSpec, model_path: str | Path, *, device: torch.device, world: World, total_steps: int
    ) -> None:
        super().__init__(spec, device=device, world=world)
        self.pad_id = pad_token_id(model_path)
        self.model = load_model(
            model_path,
            device,
            self.dtype,
            trainable=True,
            checkpointing=spec.train.activation_checkpointing,
            compile_blocks=spec.train.compile,
            reward_head=True,
        )
        config: Any = self.model.config
        config.pad_token_id = self.pad_id  # the scored token: the last one that is not padding
        schedule = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": total_steps})})
        self.optimizer, self.scheduler = build_optimizer(self.model, schedule)
        self.center_coef = spec.reward_model.center_rewards_coef
        self.margins = spec.reward_model.margin_field is not None

    # -- public API -------------------------------------------------------------------------------------

    def _train(self, pairs: Sequence[RewardPair]) -> dict[str, float]:
        """One optimizer step on `pairs` (`TrainerBase.train_step`). Returns global metrics."""
        if not pairs:
            raise ValueError("a train step needs at least one pair")
        self.optimizer.zero_grad(set_to_none=True)
        plan, global_pairs = self.plan(pairs)
        sums = self._accumulate(plan, global_pairs)
        grad_norm, lr = clip_and_step(self.model, self.optimizer, self.scheduler, self.spec.optim.grad_clip)
        metrics = self._finish_metrics(sums)
        metrics.update(grad_norm=grad_norm, lr=lr)
        return metrics

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[RewardPair]) -> dict[str, float]:
        """The statistics of `pairs` (the same list on every rank; collective) as `eval_loss`,
        `eval_accuracy`, `eval_reward_margin`, `eval_rewards_chosen`, `eval_rewards_rejected`,
        `eval_pairs` and `eval_tokens`."""
        plan, _ = self.plan(pairs)
        sums: dict[str, Tensor] = {}
        self.model.eval()
        for batch in plan:
            add(sums, self._statistics(batch, rewards_of(self.model, batch)))
        self.model.train()
        return {f"eval_{name}": value for name, value in self._finish_metrics(sums).items()}

    def plan(self, pairs: Sequence[RewardPair]) -> tuple[list[PairBatch], float]:
        """Phase 1: this rank's batches on the device, as many on every rank, and the global pair count."""
        mine = list(pairs[self.world.rank :: self.world.size])
        per_batch = max(1, self.spec.train.micro_batch_size // 2)
        plan = [pair_batch(group, self.pad_id, self.device) for group in plan_batches(mine, per_batch)]
        missing = all_reduce_max(len(plan), self.world) - len(plan)
        plan += [pair_batch([], self.pad_id, self.device) for _ in range(missing)]
        local = torch.tensor([float(len(mine))], device=self.device)
        return plan, float(all_reduce_sum(local, self.world).item())

    def _train_objects(self) -> TrainObjects:
        return TrainObjects(self.model, self.optimizer, self.scheduler)

    # -- phase 2: accumulate ----------------------------------------------------------------------------

    def _accumulate(self, plan: list[PairBatch], global_pairs: float) -> dict[str, Tensor]:
        """Forward and backward over every batch; returns the step's summed statistics (local)."""
        sums: dict[str, Tensor] = {}
        scale = self.world.size / max(global_pairs, 1.0)
        for i, batch in enumerate(plan):
            defer_gradient_sync([self.model], self.world, defer=i < len(plan) - 1)
            rewards = rewards_of(self.model, batch)
            if batch.pairs == 0:
                (rewards.sum() * 0.0).backward()  # padding: the forward and backward collectives only
                continue
            stats = self._statistics(batch, rewards)
            (stats["loss"] * scale).backward()
            add(sums, {name: value.detach() for name, value in stats.items()})
        return sums

    def _statistics(self, batch: PairBatch, rewards: Tensor) -> dict[str, Tensor]:
        """The batch's summed statistics (`SUMMED`); the loss keeps its graph."""
        if batch.pairs == 0:
            return {}
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = batch.margins if self.margins else None
        loss = bradley_terry_loss(chosen, rejected, margin, self.center_coef)
        diff = (chosen - rejected).detach()
        return {
            "loss": loss.sum(),
            "correct": (diff > 0).float().sum(),
            "margin": diff.sum(),
            "chosen": chosen.detach().sum(),
            "rejected": rejected.detach().sum(),
            "pairs": torch.tensor(float(batch.pairs), device=self.device),
            "tokens": batch.attention_mask.sum().float(),
        }

    # -- phase 4: metrics -------------------------------------------------------------------------------

    def _finish_metrics(self, sums: dict[str, Tensor]) -> dict[str, float]:
        """Sum every statistic over the ranks (one all-reduce) and turn sums into means over pairs."""
        zero = torch.zeros((), device=self.device)
        stacked = torch.stack([sums.get(n, zero).detach().float() for n in SUMMED])
        total = dict(zip(SUMMED, all_reduce_sum(stacked, self.world).tolist(), strict=True))
        pairs = max(total["pairs"], 1.0)
        return {
            "loss": total["loss"] / pairs,
            "accuracy": total["correct"] / pairs,
            "reward_margin": total["margin"] / pairs,
            "rewards_chosen": total["chosen"] / pairs,
            "rewards_rejected": total["rejected"] / pairs,
            "pairs": total["pairs"],
            "tokens": total["tokens"],
        }


def add(sums: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    """Add each value into `sums` under its name."""
    for name, value in values.items():
        sums[name] = sums[name] + value if name in sums else value
