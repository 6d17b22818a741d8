"""Supervised fine-tuning (`mode = "sft"`): cross-entropy on the assistant's tokens, FSDP2-sharded.

`SFTTrainer.train_step(examples)` runs in named phases, like the other trainers:
1. plan: this rank's share of the examples (round-robin), cut into micro-batches of
   `train.micro_batch_size` sequences, padded to the same count on every rank (FSDP collectives need it),
   and the step's trained-token count summed over the ranks. Packed (`train.packing`, the default, where
   the architecture allows): the examples sorted by their ids, so that examples opening alike sit
   together, and each micro-batch one packed row in which the longest prefix its examples share and none
   of them trains on (a system prompt, the tool schemas, a few-shot preamble) is computed once
   (`rlfabric.learner.packing`: each example attends to that prefix and causally to itself, at its own
   positions, so the loss is the padded layout's). On tool-calling conversations, whose tool schemas open
   every example, that is most of the tokens. Otherwise shortest first, so little is padding;
2. accumulate: per micro-batch, the policy's log-prob of each target and the summed negative log-prob of
   the masked ones divided by the step's global token count, backpropagated;
3. optimizer step: grad clipping, AdamW, LR schedule (`parts.build_optimizer`);
4. metrics: one all-reduce of every summed statistic.

The loss is the mean over every assistant token of the step, on every rank (TRL's `assistant_only_loss`
normalised by the whole batch's token count), so gradient accumulation and sharding are exact: FSDP
averages gradients over ranks, so each rank's loss is also multiplied by the world size. An example is a
one-token "prompt" (its first id, never a target) and a completion of the rest whose loss mask is the
example's mask: the target layout of `batch.MicroBatch` then puts mask[t + 1] at position t. No reference
model is loaded. `evaluate` is the same token mean without gradient, on held-out examples.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from rlfabric.learner.algorithms import masked_sum
from rlfabric.learner.batch import GroupSamples, MicroBatch, Rollout, build_micro_batches, empty_micro_batch
from rlfabric.learner.checkpoint import TrainObjects
from rlfabric.learner.dist import World, all_reduce_max, all_reduce_sum, defer_gradient_sync
from rlfabric.learner.packing import packed_logits
from rlfabric.learner.parts import build_optimizer, clip_and_step, is_packed, load_model
from rlfabric.learner.preference import token_logprobs
from rlfabric.learner.sft_data import SFTExample
from rlfabric.learner.trainer_base import TrainerBase
from rlfabric.runspec import RunSpec

SUMMED = ("nll", "correct", "tokens", "sequences")
"""Per-step sums: negative log-likelihood and correctly predicted tokens over the trained tokens, the
trained tokens and the sequences."""


def examples_as_groups(examples: Sequence[SFTExample]) -> list[GroupSamples]:
    """Each example as a one-sample group: its first id the prompt, the rest a completion with its mask."""
    return [GroupSamples(e.token_ids[:1], [completion(e, 1)], e.example_id) for e in examples]


def completion(example: SFTExample, prompt_length: int) -> Rollout:
    """The ids of `example` after its first `prompt_length` as a sampled completion, with their mask."""
    rest = example.token_ids[prompt_length:]
    return Rollout(rest, [0.0] * len(rest), 0.0, loss_mask=example.loss_mask[prompt_length:])


def shared_prefix_groups(examples: Sequence[SFTExample], micro_batch_size: int) -> list[GroupSamples]:
    """The examples sorted by their ids and cut into chunks of `micro_batch_size` (one micro-batch each),
    each chunk split into runs that share a prefix (`shared_prefix_runs`): a run is a group whose prompt
    is that prefix and whose completions are each example's rest with its mask."""
    ordered = sorted(examples, key=lambda e: e.token_ids)
    groups = []
    for start in range(0, len(ordered), micro_batch_size):
        for shared, run in shared_prefix_runs(ordered[start : start + micro_batch_size]):
            prompt = max(shared, 1)  # at least the first id, which nothing predicts
            groups.append(
                GroupSamples(
                    run[0].token_ids[:prompt], [completion(e, prompt) for e in run], run[0].example_id
                )
            )
    return groups


def shared_prefix_runs(chunk: Sequence[SFTExample]) -> list[tuple[int, list[SFTExample]]]:
    """`chunk` (sorted by ids) cut into consecutive runs, each with the prefix length all its examples share
    before their first trained token, so that the ids computed once are the most (`(n - 1) * shared` a
    run): a run's examples share at least their first id. Exact, by dynamic programming over the cuts; as
    the chunk is sorted, a run's common prefix is the least of its neighbours' (O(n^2) in all)."""
    limits = [untrained_length(e) for e in chunk]
    neighbours = [common_length(a.token_ids, b.token_ids) for a, b in itertools.pairwise(chunk)]
    # for chunk[:j]: the most ids saved, where its last run starts and that run's shared prefix
    saved, cut, prefix = [0] * (len(chunk) + 1), [0] * (len(chunk) + 1), [0] * (len(chunk) + 1)
    for j in range(1, len(chunk) + 1):
        saved[j], cut[j], prefix[j] = saved[j - 1], j - 1, limits[j - 1]  # chunk[j - 1] alone
        common = limits[j - 1]
        for i in range(j - 2, -1, -1):  # the run chunk[i:j]
            common = min(common, limits[i], neighbours[i])
            if common < 1:
                break
            if saved[i] + (j - 1 - i) * common > saved[j]:
                saved[j], cut[j], prefix[j] = saved[i] + (j - 1 - i) * common, i, common
    runs, j = [], len(chunk)
    while j > 0:
        runs.append((prefix[j], list(chunk[cut[j] : j])))
        j = cut[j]
    return runs[::-1]


def untrained_length(example: SFTExample) -> int:
    """Leading ids of `example` before its first trained token (and before its last id, so that one is left
    to train on)."""
    return next((i for i, m in enumerate(example.loss_mask) if m), len(example.token_ids) - 1)


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def token_nll(model: torch.nn.Module, mb: MicroBatch, pad_id: int) -> tuple[Tensor, Tensor]:
    """The summed negative log-prob of the masked targets () and how many of them are the argmax (). A
    packed micro-batch runs as its packed row through a model loaded for it, the LM head on the examples'
    own positions only."""
    packed = mb.packed if is_packed(model) else None
    if packed is None:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        targets = mb.targets(pad_id)
        logp, hits = token_logprobs(logits, targets), (logits.detach().argmax(-1) == targets).float()
    else:
        logits = packed_logits(model, packed)
        shape = mb.input_ids.shape
        logp = packed.to_target_layout(token_logprobs(logits, packed.targets), shape)
        hits = packed.to_target_layout((logits.detach().argmax(-1) == packed.targets).float(), shape)
    return -masked_sum(logp, mb.loss_mask), masked_sum(hits, mb.loss_mask)


class SFTTrainer(TrainerBase[SFTExample]):
    """Policy, optimizer and schedule of one learner rank, trained on SFT examples (no reference)."""

    def __init__(
        self, spec: RunSpec, model_path: str | Path, *, device: torch.device, world: World, total_steps: int
    ) -> None:
        super().__init__(spec, device=device, world=world)
        self.model = load_model(
            model_path,
            device,
            self.dtype,
            trainable=True,
            checkpointing=spec.train.activation_checkpointing,
            compile_blocks=spec.train.compile,
            packed=spec.train.packing,
        )
        schedule = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": total_steps})})
        self.optimizer, self.scheduler = build_optimizer(self.model, schedule)
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)

    # -- public API -------------------------------------------------------------------------------------

    def _train(self, examples: Sequence[SFTExample]) -> dict[str, float]:
        """One optimizer step on `examples` (`TrainerBase.train_step`). Returns global metrics."""
        if not examples:
            raise ValueError("a train step needs at least one example")
        self.optimizer.zero_grad(set_to_none=True)
        plan, tokens = self.plan(examples)
        sums = self._accumulate(plan, tokens)
        grad_norm, lr = clip_and_step(self.model, self.optimizer, self.scheduler, self.spec.optim.grad_clip)
        metrics = self._finish_metrics(sums)
        metrics.update(grad_norm=grad_norm, lr=lr)
        return metrics

    @torch.no_grad()
    def evaluate(self, examples: Sequence[SFTExample]) -> dict[str, float]:
        """The token-mean loss and accuracy on `examples` (the same list on every rank; collective), as
        `eval_loss`, `eval_token_accuracy`, `eval_tokens` and `eval_sequences`."""
        plan, _ = self.plan(examples)
        sums: dict[str, Tensor] = {}
        self.model.eval()
        for mb in plan:
            nll, correct = token_nll(self.model, mb, self.pad_id)
            add(sums, nll=nll, correct=correct, tokens=mb.loss_mask.sum(), sequences=real_rows(mb))
        self.model.train()
        return {f"eval_{name}": value for name, value in self._finish_metrics(sums).items()}

    def plan(self, examples: Sequence[SFTExample]) -> tuple[list[MicroBatch], float]:
        """Phase 1: this rank's micro-batches on the device, as many on every rank, and the trained
        tokens of all the examples."""
        mine = list(examples[self.world.rank :: self.world.size])
        size, packed = self.spec.train.micro_batch_size, is_packed(self.model)
        if packed:
            mbs = build_micro_batches(shared_prefix_groups(mine, size), size, self.pad_id, packed=True)
        else:
            mbs = build_micro_batches(examples_as_groups(mine), size, self.pad_id, by_length=True)
        missing = all_reduce_max(len(mbs), self.world) - len(mbs)
        mbs += [empty_micro_batch(self.pad_id, packed) for _ in range(missing)]
        local = torch.tensor([float(sum(sum(e.loss_mask[1:]) for e in mine))], device=self.device)
        return [mb.to(self.device) for mb in mbs], float(all_reduce_sum(local, self.world).item())

    def _train_objects(self) -> TrainObjects:
        return TrainObjects(self.model, self.optimizer, self.scheduler)

    # -- phase 2: accumulate ----------------------------------------------------------------------------

    def _accumulate(self, plan: list[MicroBatch], global_tokens: float) -> dict[str, Tensor]:
        """Forward and backward over every micro-batch; returns the step's summed statistics (local)."""
        sums: dict[str, Tensor] = {}
        scale = self.world.size / max(global_tokens, 1.0)
        for i, mb in enumerate(plan):
            defer_gradient_sync([self.model], self.world, defer=i < len(plan) - 1)
            nll, correct = token_nll(self.model, mb, self.pad_id)
            (nll * scale).backward()  # a padding micro-batch's mask is all 0: only its collectives count
            add(sums, nll=nll.detach(), correct=correct, tokens=mb.loss_mask.sum(), sequences=real_rows(mb))
        return sums

    # -- phase 4: metrics -------------------------------------------------------------------------------

    def _finish_metrics(self, sums: dict[str, Tensor]) -> dict[str, float]:
        """Sum every statistic over the ranks (one all-reduce); loss and accuracy as means per token."""
        zero = torch.zeros((), device=self.device)
        stacked = torch.stack([sums.get(n, zero).float() for n in SUMMED])
        total = dict(zip(SUMMED, all_reduce_sum(stacked, self.world).tolist(), strict=True))
        tokens = max(total["tokens"], 1.0)
        return {
            "loss": total["nll"] / tokens,
            "token_accuracy": total["correct"] / tokens,
            "tokens": total["tokens"],
            "sequences": total["sequences"],
        }


def add(sums: dict[str, Tensor], **values: Tensor) -> None:
    """Add each value into `sums` under its name."""
    for name, value in values.items():
        sums[name] = sums[name] + value if name in sums else value


def real_rows(mb: MicroBatch) -> Tensor:
    """Rows of the micro-batch with a trained token (a padding micro-batch has none): ()."""
    return (mb.loss_mask.sum(-1) > 0).sum().float()
