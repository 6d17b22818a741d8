"""Offline preference training on (prompt, chosen, rejected) pairs (DPO, IPO, SimPO, ORPO), FSDP2-sharded.
KTO, on unpaired rows, is `kto.KTOTrainer`.

`PreferenceTrainer.train_step(pairs)` runs in named phases, like the online `Trainer`:
1. plan: this rank's share of the pairs (round-robin), cut into micro-batches of whole pairs (a pair's two
   completions are consecutive rows of one forward pass), padded to the same count on every rank (FSDP
   collectives need it), and the step's pair count summed over the ranks;
2. reference pass: the frozen reference's log-prob of each completion, without gradient (DPO and IPO:
   SimPO and ORPO are reference-free, and no reference is loaded for them: one model in memory);
3. accumulate: per micro-batch, the policy's log-probs, the loss by name (`spec.preference.loss`), and
   backward;
4. optimizer step: grad clipping, AdamW, LR schedule (the online trainer's `build_optimizer`);
5. metrics: one all-reduce of every summed statistic.

A completion's log-prob is the sum of its tokens' log-probs for DPO and their mean for IPO, SimPO and ORPO
(`algorithms.preference.LOSS_KINDS`; ORPO's NLL term is then minus the chosen mean). Every loss averages
over pairs, so gradient accumulation is exact when each micro-batch of P pairs is weighted by
`P / global_pairs`; FSDP averages gradients over ranks, so each rank's loss is also multiplied by the
world size. A loss with a reference always loads it: DPO needs it whatever `kl.coef` says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from rlfabric.learner.algorithms import masked_sum
from rlfabric.learner.algorithms.preference import LOSS_KINDS, PREFERENCE_LOSSES
from rlfabric.learner.batch import GroupSamples, MicroBatch, Rollout, build_micro_batches, empty_micro_batch
from rlfabric.learner.checkpoint import TrainObjects
from rlfabric.learner.dist import World, all_reduce_max, all_reduce_sum, defer_gradient_sync
from rlfabric.learner.parts import LOGPROB_CHUNK, build_optimizer, clip_and_step, load_model
from rlfabric.learner.trainer_base import TrainerBase
from rlfabric.runspec import PreferenceSpec, RunSpec


@dataclass
class PreferencePair:
    """One preference judgement: the same prompt, a preferred and a dispreferred completion (token ids)."""

    prompt_token_ids: list[int]
    """The prompt, at least one token."""
    chosen_token_ids: list[int]
    """The preferred completion, at least one token."""
    rejected_token_ids: list[int]
    """The dispreferred completion, at least one token."""
    pair_id: str = ""
    """Identity of the pair (its dataset row), for the consumed-pair ledger."""

    def __post_init__(self) -> None:
        for name in ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids"):
            if not getattr(self, name):
                raise ValueError(f"pair {self.pair_id!r}: {name} is empty")


def pairs_as_groups(pairs: Sequence[PreferencePair]) -> list[GroupSamples]:
    """Each pair as a group of two samples, chosen first: rows 2i and 2i+1 of the step's micro-batches."""
    return [
        GroupSamples(
            p.prompt_token_ids,
            [Rollout(p.chosen_token_ids, [0.0] * len(p.chosen_token_ids), 1.0),
             Rollout(p.rejected_token_ids, [0.0] * len(p.rejected_token_ids), 0.0)],
            p.pair_id,
        )
        for p in pairs
    ]  # fmt: skip


def pairs_per_micro_batch(micro_batch_size: int) -> int:
    """Pairs in one forward pass of `micro_batch_size` sequences (at least one pair)."""
    return max(1, micro_batch_size // 2)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """Log-prob of each target, in float32 chunks along T. `logits` (B, T, V), `targets` (B, T) → (B, T)."""
    out = []
    for start in range(0, logits.shape[1], LOGPROB_CHUNK):
        chunk = logits[:, start : start + LOGPROB_CHUNK].float()
        target = targets[:, start : start + LOGPROB_CHUNK].unsqueeze(-1)
        out.append(chunk.gather(-1, target).squeeze(-1) - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out, dim=1)


def completion_logprobs(model: nn.Module, mb: MicroBatch, pad_id: int, *, average: bool) -> Tensor:
    """`model`'s log-prob of each row's completion, summed (or averaged) over its tokens: (B,)."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    total = masked_sum(token_logprobs(logits, mb.targets(pad_id)), mb.loss_mask, dim=-1)
    return total / mb.loss_mask.sum(-1).clamp(min=1.0) if average else total


@dataclass
class PairMicroBatch:
    """One forward pass of whole pairs: rows 2i (chosen) and 2i+1 (rejected) of `mb` are pair i."""

    mb: MicroBatch
    """On this rank's device; a padding micro-batch (one empty row) when `pairs` is 0."""
    pairs: int
    """Pairs in it: 0 for padding."""
    ref_logps: Tensor | None = None
    """(2 * pairs,) the reference's completion log-probs, rows as in `mb` (set by the reference pass;
    None for a reference-free loss)."""


def loss_options(pref: PreferenceSpec) -> dict[str, float]:
    """The keyword options of `pref.loss`'s function, from the spec."""
    if pref.loss == "dpo":
        return {"beta": pref.beta, "label_smoothing": pref.label_smoothing}
    if pref.loss == "simpo":
        return {"beta": pref.beta, "gamma": pref.simpo_gamma, "label_smoothing": pref.label_smoothing}
    if pref.loss == "orpo":
        return {"lam": pref.orpo_lambda}
    return {"beta": pref.beta}


class PreferenceTrainer(TrainerBase[PreferencePair]):
    """Policy, frozen reference (for the losses that read one), optimizer and schedule of one learner
    rank, trained on preference pairs."""

    def __init__(self, spec: RunSpec, model_path: str | Path, *, device: torch.device, world: World) -> None:
        super().__init__(spec, device=device, world=world)
        self.kind = LOSS_KINDS[spec.preference.loss]
        if not self.kind.paired:
            raise ValueError(f"loss {spec.preference.loss!r} trains on unpaired rows: kto.KTOTrainer")
        dtype = self.dtype
        checkpointing = spec.train.activation_checkpointing
        compile_blocks = spec.train.compile
        self.model = load_model(
            model_path,
            device,
            dtype,
            trainable=True,
            checkpointing=checkpointing,
            compile_blocks=compile_blocks,
        )
        self.reference: nn.Module | None = None
        if self.kind.reference:
            reference_path = spec.model.reference_path or model_path
            self.reference = load_model(
                reference_path,
                device,
                dtype,
                trainable=False,
                checkpointing=False,
                compile_blocks=compile_blocks,
            )
        self.optimizer, self.scheduler = build_optimizer(self.model, spec)
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.average = self.kind.average
        self.options = loss_options(spec.preference)

    # -- public API -------------------------------------------------------------------------------------

    def _train(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        """One optimizer step on `pairs` (`TrainerBase.train_step`). Returns global metrics."""
        if not pairs:
            raise ValueError("a train step needs at least one pair")
        self.optimizer.zero_grad(set_to_none=True)
        plan, global_pairs = self.plan(pairs)
        sums = self._accumulate(plan, global_pairs)
        grad_norm, lr = self._optimizer_step()
        metrics = self._finish_metrics(sums)
        metrics.update(grad_norm=grad_norm, lr=lr)
        return metrics

    def plan(self, pairs: Sequence[PreferencePair]) -> tuple[list[PairMicroBatch], float]:
        """Phases 1-2: this rank's micro-batches with reference log-probs, and the global pair count."""
        mine = list(pairs[self.world.rank :: self.world.size])
        per_mb = pairs_per_micro_batch(self.spec.train.micro_batch_size)
        mbs = build_micro_batches(pairs_as_groups(mine), 2 * per_mb, self.pad_id)
        plan = [PairMicroBatch(mb.to(self.device), int(mb.input_ids.shape[0]) // 2) for mb in mbs]
        missing = all_reduce_max(len(plan), self.world) - len(plan)
        plan += [PairMicroBatch(empty_micro_batch(self.pad_id).to(self.device), 0) for _ in range(missing)]
        self._reference_pass(plan)
        local = torch.tensor([float(len(mine))], device=self.device)
        return plan, float(all_reduce_sum(local, self.world).item())

    def _train_objects(self) -> TrainObjects:
        return TrainObjects(self.model, self.optimizer, self.scheduler)

    # -- phase 2: reference pass ------------------------------------------------------------------------

    @torch.no_grad()
    def _reference_pass(self, plan: list[PairMicroBatch]) -> None:
        """The reference's completion log-probs of every micro-batch (padding ones too: FSDP collectives);
        nothing for a reference-free loss."""
        if self.reference is None:
            return
        for pmb in plan:
            pmb.ref_logps = completion_logprobs(self.reference, pmb.mb, self.pad_id, average=self.average)

    # -- phase 3: accumulate ----------------------------------------------------------------------------

    def _accumulate(self, plan: list[PairMicroBatch], global_pairs: float) -> dict[str, Tensor]:
        """Forward and backward over every micro-batch; returns the step's summed statistics (local)."""
        sums: dict[str, Tensor] = {}
        for i, pmb in enumerate(plan):
            defer_gradient_sync([self.model], self.world, defer=i < len(plan) - 1)
            for name, value in self._micro_batch_backward(pmb, global_pairs).items():
                sums[name] = sums.get(name, torch.zeros((), device=self.device)) + value
        return sums

    def _micro_batch_backward(self, pmb: PairMicroBatch, global_pairs: float) -> dict[str, Tensor]:
        """Loss of one micro-batch, weighted into the step's mean over pairs, backpropagated. Returns sums."""
        logps = completion_logprobs(self.model, pmb.mb, self.pad_id, average=self.average)  # (2P,)
        if pmb.pairs == 0:
            (logps.sum() * 0.0).backward()  # padding: the forward and backward collectives only
            return {}
        loss, stats = self._loss(logps, pmb.ref_logps)
        weight = pmb.pairs / max(global_pairs, 1.0)
        (loss * (weight * self.world.size)).backward()
        sums = {name: stats[name] * pmb.pairs for name in self.kind.stats}
        sums.update(
            loss=loss.detach() * pmb.pairs,
            logps_chosen=logps[0::2].detach().sum(),
            logps_rejected=logps[1::2].detach().sum(),
            tokens=pmb.mb.loss_mask.sum(),
            pairs=torch.tensor(float(pmb.pairs), device=self.device),
        )
        return sums

    def _loss(self, logps: Tensor, ref_logps: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """`spec.preference.loss` on a micro-batch's (2P,) completion log-probs (chosen at even rows) and
        the reference's (None when reference-free) → mean loss over its pairs () and statistics."""
        inputs = [logps[0::2], logps[1::2]]
        if self.kind.reference:
            assert ref_logps is not None
            inputs += [ref_logps[0::2], ref_logps[1::2]]
        return PREFERENCE_LOSSES[self.spec.preference.loss](*inputs, **self.options)

    # -- phase 4: optimizer step ------------------------------------------------------------------------

    def _optimizer_step(self) -> tuple[float, float]:
        """Clip the global grad norm, step AdamW and the schedule; returns (grad_norm, lr used)."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.spec.optim.grad_clip)

    # -- phase 5: metrics -------------------------------------------------------------------------------

    def _finish_metrics(self, sums: dict[str, Tensor]) -> dict[str, float]:
        """Sum every statistic over the ranks (one all-reduce) and turn sums into means over pairs."""
        names = ("loss", *self.kind.stats, "logps_chosen", "logps_rejected", "tokens", "pairs")
        zero = torch.zeros((), device=self.device)
        stacked = torch.stack([sums.get(n, zero).float() for n in names])
        total = dict(zip(names, all_reduce_sum(stacked, self.world).tolist(), strict=True))
        pairs = max(total["pairs"], 1.0)
        metrics = {name: total[name] / pairs for name in names[:-2]}
        metrics.update(tokens=total["tokens"], pairs=total["pairs"])
        return metrics
