"""Offline KTO (`preference.loss = "kto"`) on unpaired rows labelled desirable or undesirable, FSDP2-sharded.

`KTOTrainer.train_step(rows)` runs in the phases of `preference.PreferenceTrainer`:
1. plan: this rank's share of the rows (round-robin), cut into micro-batches of `train.micro_batch_size`
   rows, padded to the same count on every rank (FSDP collectives need it), and the step's row count
   summed over the ranks. Beside each micro-batch, its rows' *mismatched* rows: row i of the step is
   paired with the completion of row i - 1 (cyclically, over the whole step; TRL's rotation by one),
   cut to fit `model.max_model_len` after the prompt;
2. frozen pass, without gradient: the reference's log-prob of each row's completion, and the policy's
   and the reference's of each mismatched row; the reference point
       z0 = max(0, sum over the step's mismatched rows of (log pi(y'|x) - log pi_ref(y'|x)) / rows)
   summed over the ranks (one all-reduce), so every micro-batch of every rank uses the one z0 of the
   step, whatever the micro-batching and the world size. It is the KTO paper's estimate of
   KL(pi || pi_ref) (and TRL's, which takes it per device batch): a constant of the step, taken before
   the update with the weights the update starts from, never differentiated;
3. accumulate: per micro-batch, the policy's summed log-probs, `kto_loss` with z0, and backward;
4. optimizer step: grad clipping, AdamW, LR schedule;
5. metrics: one all-reduce of every summed statistic.

The loss averages over the step's rows, so gradient accumulation is exact when each micro-batch of R rows
is weighted by `R / global_rows` (times the world size: FSDP averages gradients over ranks). A step of
one row pairs it with its own completion: z0 is then its own reward, clamped at 0 (TRL warns likewise
that the KL term needs more than one row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from rlfabric.learner.algorithms.preference import kto_loss
from rlfabric.learner.batch import GroupSamples, MicroBatch, Rollout, build_micro_batches, empty_micro_batch
from rlfabric.learner.checkpoint import TrainObjects
from rlfabric.learner.dist import World, all_reduce_max, all_reduce_sum, defer_gradient_sync
from rlfabric.learner.parts import build_optimizer, clip_and_step, load_model
from rlfabric.learner.preference import completion_logprobs
from rlfabric.learner.trainer_base import TrainerBase
from rlfabric.runspec import RunSpec

SUMMED = (
    "loss",
    "rewards_chosen_sum",
    "rewards_rejected_sum",
    "logps_chosen_sum",
    "logps_rejected_sum",
    "desirable",
    "undesirable",
    "tokens",
    "rows",
)
"""The statistics each rank sums over its micro-batches; one all-reduce sums them over the ranks."""


@dataclass
class KTOExample:
    """One unpaired row: a prompt, a completion, and whether it is desirable (token ids)."""

    prompt_token_ids: list[int]
    """The prompt, at least one token."""
    completion_token_ids: list[int]
    """The completion, at least one token."""
    desirable: bool
    """True: a good completion (the loss raises its reward); False: a bad one."""
    pair_id: str = ""
    """Identity of the row for the consumed-row ledger: its dataset row index, with "/chosen" or
    "/rejected" when it came from a pair (`OfflineRun.item_id` reads it under a pair's name)."""

    def __post_init__(self) -> None:
        for name in ("prompt_token_ids", "completion_token_ids"):
            if not getattr(self, name):
                raise ValueError(f"row {self.pair_id!r}: {name} is empty")


def mismatched(rows: Sequence[KTOExample], max_len: int) -> list[KTOExample]:
    """Row i's prompt with row i - 1's completion (cyclically), cut to `max_len` tokens in all."""
    out = []
    for i, row in enumerate(rows):
        room = max(max_len - len(row.prompt_token_ids), 1)
        completion = rows[i - 1].completion_token_ids[:room]
        out.append(KTOExample(row.prompt_token_ids, completion, row.desirable, f"{row.pair_id}~kl"))
    return out


def rows_as_groups(rows: Sequence[KTOExample]) -> list[GroupSamples]:
    """Each row as a group of one sample (its reward the label), in order."""
    groups = []
    for r in rows:
        completion = Rollout(r.completion_token_ids, [0.0] * len(r.completion_token_ids), float(r.desirable))
        groups.append(GroupSamples(r.prompt_token_ids, [completion], r.pair_id))
    return groups


@dataclass
class RowMicroBatch:
    """One forward pass of rows and the forward pass of their mismatched rows (for z0)."""

    mb: MicroBatch
    """On this rank's device; a padding micro-batch (one empty row) when `rows` is 0."""
    kl_mb: MicroBatch
    """The same rows' mismatched rows (`mismatched`), in the same order; padding when `rows` is 0."""
    rows: int
    """Rows in it: 0 for padding."""
    desirable: Tensor
    """(rows,) bool labels."""
    ref_logps: Tensor | None = None
    """(rows,) the reference's summed completion log-probs (set by the frozen pass)."""


class KTOTrainer(TrainerBase[KTOExample]):
    """Policy, frozen reference, optimizer and schedule of one learner rank, trained with KTO."""

    def __init__(self, spec: RunSpec, model_path: str | Path, *, device: torch.device, world: World) -> None:
        super().__init__(spec, device=device, world=world)
        if spec.preference.loss != "kto":
            raise ValueError(f"KTOTrainer trains loss 'kto', not {spec.preference.loss!r}")
        compile_blocks = spec.train.compile
        self.model = load_model(
            model_path,
            device,
            self.dtype,
            trainable=True,
            checkpointing=spec.train.activation_checkpointing,
            compile_blocks=compile_blocks,
        )
        self.reference = load_model(
            spec.model.reference_path or model_path,
            device,
            self.dtype,
            trainable=False,
            checkpointing=False,
            compile_blocks=compile_blocks,
        )
        self.optimizer, self.scheduler = build_optimizer(self.model, spec)
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)

    def _train(self, rows: Sequence[KTOExample]) -> dict[str, float]:
        """One optimizer step on `rows` (`TrainerBase.train_step`). Returns global metrics."""
        if not rows:
            raise ValueError("a train step needs at least one row")
        self.optimizer.zero_grad(set_to_none=True)
        plan, global_rows, z0 = self.plan(rows)
        sums = self._accumulate(plan, global_rows, z0)
        grad_norm, lr = clip_and_step(self.model, self.optimizer, self.scheduler, self.spec.optim.grad_clip)
        metrics = self._finish_metrics(sums)
        metrics.update(kl=z0, grad_norm=grad_norm, lr=lr)
        return metrics

    def _train_objects(self) -> TrainObjects:
        return TrainObjects(self.model, self.optimizer, self.scheduler)

    # -- phases 1-2: plan and frozen pass ---------------------------------------------------------------

    def plan(self, rows: Sequence[KTOExample]) -> tuple[list[RowMicroBatch], float, float]:
        """This rank's micro-batches with reference log-probs, the global row count and the step's z0."""
        mine = list(rows[self.world.rank :: self.world.size])
        kl_rows = mismatched(rows, self.spec.model.max_model_len)[self.world.rank :: self.world.size]
        size = self.spec.train.micro_batch_size
        mbs = build_micro_batches(rows_as_groups(mine), size, self.pad_id)
        kl_mbs = build_micro_batches(rows_as_groups(kl_rows), size, self.pad_id)
        plan = []
        for j, (mb, kl_mb) in enumerate(zip(mbs, kl_mbs, strict=True)):
            labels = torch.tensor([r.desirable for r in mine[j * size : (j + 1) * size]], device=self.device)
            plan.append(RowMicroBatch(mb.to(self.device), kl_mb.to(self.device), len(labels), labels))
        missing = all_reduce_max(len(plan), self.world) - len(plan)
        for _ in range(missing):
            empty = empty_micro_batch(self.pad_id).to(self.device)
            plan.append(RowMicroBatch(empty, empty, 0, torch.zeros(0, dtype=torch.bool, device=self.device)))
        kl_sum = self._frozen_pass(plan)
        local = torch.stack([torch.tensor(float(len(mine)), device=self.device), kl_sum])
        global_rows, global_kl = all_reduce_sum(local, self.world).tolist()
        return plan, global_rows, max(0.0, global_kl / max(global_rows, 1.0))

    @torch.no_grad()
    def _frozen_pass(self, plan: list[RowMicroBatch]) -> Tensor:
        """Phase 2 on every micro-batch (padding ones too: FSDP collectives): sets `ref_logps` and returns
        this rank's sum over its mismatched rows of `log pi - log pi_ref`."""
        kl_sum = torch.zeros((), device=self.device)
        for rmb in plan:
            rmb.ref_logps = completion_logprobs(self.reference, rmb.mb, self.pad_id, average=False)
            policy = completion_logprobs(self.model, rmb.kl_mb, self.pad_id, average=False)
            reference = completion_logprobs(self.reference, rmb.kl_mb, self.pad_id, average=False)
            if rmb.rows:
                kl_sum += (policy - reference).float().sum()
        return kl_sum

    # -- phase 3: accumulate ----------------------------------------------------------------------------

    def _accumulate(self, plan: list[RowMicroBatch], global_rows: float, z0: float) -> dict[str, Tensor]:
        """Forward and backward over every micro-batch; returns the step's summed statistics (local)."""
        sums: dict[str, Tensor] = {}
        for i, rmb in enumerate(plan):
            defer_gradient_sync([self.model], self.world, defer=i < len(plan) - 1)
            for name, value in self._micro_batch_backward(rmb, global_rows, z0).items():
                sums[name] = sums.get(name, torch.zeros((), device=self.device)) + value
        return sums

    def _micro_batch_backward(self, rmb: RowMicroBatch, global_rows: float, z0: float) -> dict[str, Tensor]:
        """Loss of one micro-batch, weighted into the step's mean over rows, backpropagated. Returns sums."""
        logps = completion_logprobs(self.model, rmb.mb, self.pad_id, average=False)  # (R,)
        if rmb.rows == 0:
            (logps.sum() * 0.0).backward()  # padding: the forward and backward collectives only
            return {}
        assert rmb.ref_logps is not None
        pref = self.spec.preference
        loss, stats = kto_loss(
            logps,
            rmb.ref_logps,
            rmb.desirable,
            kl=z0,
            beta=pref.beta,
            desirable_weight=pref.kto_desirable_weight,
            undesirable_weight=pref.kto_undesirable_weight,
        )
        (loss * (rmb.rows / max(global_rows, 1.0) * self.world.size)).backward()
        detached = logps.detach()
        stats.update(
            loss=loss.detach() * rmb.rows,
            logps_chosen_sum=detached[rmb.desirable].sum(),
            logps_rejected_sum=detached[~rmb.desirable].sum(),
            tokens=rmb.mb.loss_mask.sum(),
            rows=torch.tensor(float(rmb.rows), device=self.device),
        )
        return stats

    # -- phase 5: metrics -------------------------------------------------------------------------------

    def _finish_metrics(self, sums: dict[str, Tensor]) -> dict[str, float]:
        """Sum every statistic over the ranks (one all-reduce) and turn sums into means: the loss over
        rows, rewards and log-probs over the rows of their class (absent when the step has none)."""
        zero = torch.zeros((), device=self.device)
        stacked = torch.stack([sums.get(n, zero).float() for n in SUMMED])
        total = dict(zip(SUMMED, all_reduce_sum(stacked, self.world).tolist(), strict=True))
        good, bad = total["desirable"], total["undesirable"]
        metrics = {"loss": total["loss"] / max(total["rows"], 1.0), "desirable": good, "undesirable": bad}
        metrics.update(tokens=total["tokens"], rows=total["rows"])
        if good:
            metrics["rewards_chosen"] = total["rewards_chosen_sum"] / good
            metrics["logps_chosen"] = total["logps_chosen_sum"] / good
        if bad:
            metrics["rewards_rejected"] = total["rewards_rejected_sum"] / bad
            metrics["logps_rejected"] = total["logps_rejected_sum"] / bad
        if good and bad:
            metrics["reward_margin"] = metrics["rewards_chosen"] - metrics["rewards_rejected"]
        return metrics
