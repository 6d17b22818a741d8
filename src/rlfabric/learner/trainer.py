"""The learner's training core: one optimizer step over a step's scored groups, FSDP2-sharded.

`Trainer.train_step(groups)` runs in named phases:
1. plan: this rank's share of the groups (whole groups, round-robin), its micro-batches (as many on every
   rank: FSDP collectives need it) and the global loss normaliser (all-reduced);
2. frozen pass: reference log-probs (KL), when needed the pre-update policy log-probs, and with a critic
   (gae) its pre-update values;
3. advantages: per group, over the step's samples, in the completion layout, then scattered onto each
   micro-batch's target positions (with gae, the critic's returns too);
4. accumulate: forward and backward per micro-batch (the policy's, then the critic's value loss);
5. optimizer step: grad clipping, AdamW, LR schedule (the critic's separately: `critic.py`);
6. metrics: one all-reduce of every summed statistic.

Gradient accumulation is exact: each micro-batch's aggregated loss is re-weighted by
`local_count / global_count`, where the count is the aggregation's own normaliser (valid tokens for
`token_mean`, responses for the sequence means, rows for `constant`) summed over every micro-batch of
every rank. The result equals aggregating the whole step at once, however it is cut. FSDP averages
gradients over ranks, so each rank's loss is also multiplied by the world size.

Advantage estimators that whiten over the batch (`reinforce_pp`, `gae`) see this rank's share of the step;
group estimators (GRPO, Dr.GRPO, RLOO) are unaffected by the split.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlfabric.learner.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    PolicyLossConfig,
    aggregate,
    apply_kl_penalty,
    entropy_bonus,
    make_kl_controller,
    masked_sum,
    overlong_penalty,
    policy_loss,
    rollout_mismatch,
)
from rlfabric.learner.batch import (
    GroupSamples,
    MicroBatch,
    Rollout,
    StepBatch,
    attached,
    build_micro_batches,
    empty_micro_batch,
    shard_groups,
)
from rlfabric.learner.checkpoint import TrainObjects
from rlfabric.learner.critic import Critic, ValueLossConfig, load_value_model
from rlfabric.learner.dist import (
    World,
    all_reduce_max,
    all_reduce_sum,
    defer_gradient_sync,
    reshard,
)
from rlfabric.learner.lora import AdaptersDisabled
from rlfabric.learner.packing import packed_logits
from rlfabric.learner.parts import (
    build_optimizer,
    clip_and_step,
    is_packed,
    load_model,
    token_logprobs_and_entropy,
)
from rlfabric.learner.step_metrics import sample_sums, step_metrics
from rlfabric.learner.trainer_base import TrainerBase
from rlfabric.runspec import RunSpec

log = logging.getLogger(__name__)


def policy_loss_config(spec: RunSpec) -> PolicyLossConfig:
    """The loss knobs of the run spec."""
    algo = spec.algorithm
    return PolicyLossConfig(
        clip_eps_low=algo.clip_eps_low,
        clip_eps_high=algo.clip_eps_high,
        dual_clip=algo.dual_clip,
        gspo=algo.gspo,
        tis_cap=algo.tis_cap,
        rollout_correction=algo.rollout_correction,
        mask_low=algo.rollout_mask_low,
        aggregation=algo.loss_aggregation,
        max_tokens=spec.rollout.sampling.max_tokens,
    )


def normaliser_count(mask: Tensor, aggregation: str) -> Tensor:
    """The quantity `aggregation` divides by, for one micro-batch's loss mask (B, T) → scalar float."""
    if aggregation == "token_mean":
        return mask.sum()
    if aggregation == "constant":
        return torch.tensor(float(mask.shape[0]), device=mask.device)
    return (mask.sum(-1) > 0).sum().to(torch.float32)


# -- the step -------------------------------------------------------------------------------------------


@dataclass
class StepPlan:
    """This rank's share of one step, ready to train on."""

    step_batch: StepBatch
    """The completion layout of this rank's samples (advantages)."""
    micro_batches: list[MicroBatch]
    """On this rank's device; padded with empty ones to the largest count over ranks."""
    global_count: float
    """The aggregation's normaliser summed over every micro-batch of every rank."""


def sampling_temperature(spec: RunSpec) -> float:
    """What the policy's logits are divided by in every log-prob, entropy and KL of an RL step: the
    replicas' `rollout.sampling.temperature`, so that the policy trained, its importance ratios and its
    KL to the reference are those of the distribution the samples were drawn from, the distribution whose
    log-probs the replicas report (TRL's and verl's convention too). 1 for greedy decoding (0), which
    has no distribution to match. Top-k and top-p are not applied: their truncation shows in the
    engine/learner mismatch (`rollout_mismatch_kl`)."""
    temperature = spec.rollout.sampling.temperature
    return temperature if temperature > 0 else 1.0


class Trainer(TrainerBase[GroupSamples]):
    """Policy, optional frozen reference, optimizer and schedule of one learner rank."""

    def __init__(self, spec: RunSpec, model_path: str | Path, *, device: torch.device, world: World) -> None:
        super().__init__(spec, device=device, world=world)
        algo = spec.algorithm
        self.model = load_model(
            model_path,
            device,
            self.dtype,
            trainable=True,
            checkpointing=spec.train.activation_checkpointing,
            compile_blocks=spec.train.compile,
            lora=spec.model.lora,
            packed=spec.train.packing,
        )
        self.packed = is_packed(self.model)
        self.warmed = not spec.train.compile
        """Whether the compiled blocks have run (`warm_up`); until then steps run eager."""
        self.reference = self._load_reference(model_path)
        self.optimizer, self.scheduler = build_optimizer(self.model, spec)
        self.kl = make_kl_controller(algo.kl.coef, algo.kl.target, algo.kl.horizon)
        self.loss_config = policy_loss_config(spec)
        self.critic = self._load_critic(model_path)
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.temperature = sampling_temperature(spec)
        """The logits' divisor: the policy trained is the one the replicas sample from."""

    def _load_reference(self, model_path: str | Path) -> nn.Module | None:
        """The frozen reference, only when the KL coefficient is positive; with LoRA and no other reference
        named, the policy with its adapters off (no second copy)."""
        if self.spec.algorithm.kl.coef <= 0:
            return None
        if self.spec.model.lora is not None and self.spec.model.reference_path is None:
            return AdaptersDisabled(self.model)
        path = self.spec.model.reference_path or model_path
        return load_model(
            path,
            self.device,
            self.dtype,
            trainable=False,
            checkpointing=False,
            compile_blocks=self.spec.train.compile,
            packed=self.packed,
        )

    def _load_critic(self, model_path: str | Path) -> Critic | None:
        """The PPO critic and its optimiser, only with the gae estimator."""
        spec = self.spec
        if spec.algorithm.advantage != "gae":
            return None
        path = spec.model.critic_path or model_path
        checkpointing = spec.train.activation_checkpointing
        model = load_value_model(
            path, self.device, self.dtype, checkpointing=checkpointing, compile_blocks=spec.train.compile
        )
        optimizer, scheduler = build_optimizer(model, spec, lr=spec.optim.critic_peak_lr)
        config = ValueLossConfig(
            coef=spec.algorithm.value_coef,
            clip_eps=spec.algorithm.value_clip,
            aggregation=self.loss_config.aggregation,
            max_tokens=self.loss_config.max_tokens,
        )
        return Critic(model, optimizer, scheduler, config)

    # -- public API -------------------------------------------------------------------------------------

    def _train(self, groups: Sequence[GroupSamples]) -> dict[str, float]:
        """One step on the step's groups (`TrainerBase.train_step`). Returns global metrics.

        With `ppo_epochs` > 1 the optimizer steps once per epoch over the same plan; the metrics are the
        last epoch's."""
        if not groups:
            raise ValueError("a train step needs at least one group")
        plan = self.plan(groups)
        for _ in range(self.spec.algorithm.ppo_epochs):
            self._zero_grad()
            metrics = self._finish_metrics(plan, self._accumulate(plan))
            steps = self._optimizer_step(self._lr_scale(metrics))
        metrics.update(steps)
        self.kl.update(metrics.get("kl", 0.0), int(metrics["samples"]))
        return metrics

    def accumulate_gradients(self, groups: Sequence[GroupSamples]) -> dict[str, float]:
        """Phases 1-4 and 6 only: leave the step's gradients in `.grad` without stepping (for tests).

        The models are resharded at the end: in a world of one the layers otherwise stay unsharded, and
        FSDP keeps the gradients on the sharded parameters (`dist.shard_model`)."""
        self._zero_grad()
        plan = self.plan(groups)
        metrics = self._finish_metrics(plan, self._accumulate(plan))
        for model in self._trained_models():
            reshard(model)
        return metrics

    def warm_up(self) -> None:
        """One forward and backward (frozen pass, policy, critic) of a tiny made-up step, gradients then
        dropped: with `train.compile` the blocks compile here (~15-25 s on the bench model on two cores,
        cold cache). The loop calls it right after the first step, which runs eager (`train_step`), so the
        compile overlaps the generation of the second step instead of delaying the first. The weights,
        optimizer, step and KL coefficient are untouched. Collective (a group for each rank)."""
        if self.warmed:
            return
        start = time.perf_counter()
        ids = [1 + i % 8 for i in range(8)]
        rollouts = [Rollout(ids, [-1.0] * len(ids), float(i)) for i in range(2)]
        self.accumulate_gradients([GroupSamples(ids, rollouts) for _ in range(self.world.size)])
        self._zero_grad()
        self.warmed = True
        log.info("train.compile: warmed up in %.1f s", time.perf_counter() - start)

    def train_step(self, items: Sequence[GroupSamples]) -> dict[str, float]:
        """One optimizer step; before `warm_up` (with `train.compile`) the compiled blocks run eager
        (`torch.compiler.set_stance("force_eager")`): the same arithmetic, nothing compiled."""
        if self.warmed:
            return super().train_step(items)
        with torch.compiler.set_stance("force_eager"):
            return super().train_step(items)

    def plan(self, groups: Sequence[GroupSamples]) -> StepPlan:
        """Phases 1-3: shard, micro-batch, frozen pass, advantages."""
        mine = shard_groups(groups, self.world.rank, self.world.size)
        micro_batches = build_micro_batches(
            mine, self.spec.train.micro_batch_size, self.pad_id, by_length=True, packed=self.packed
        )
        micro_batches = self._pad_micro_batches(micro_batches)
        step_batch = StepBatch.from_groups(mine)
        for mb in micro_batches:
            mb.train_mask = self._train_mask(mb, step_batch)
        plan = StepPlan(step_batch, micro_batches, self._global_count(micro_batches))
        self._frozen_pass(plan)
        self._attach_advantages(plan)
        return plan

    @torch.no_grad()
    def sequence_logprobs(self, groups: Sequence[GroupSamples]) -> Tensor:
        """Sum of the policy's log-probs of each completion: (N,) in step order. Collective: every rank
        passes the same groups and gets every sample's value (evaluation and tests)."""
        micro_batches = build_micro_batches(
            groups, self.spec.train.micro_batch_size, self.pad_id, by_length=True, packed=self.packed
        )
        out = torch.zeros(sum(len(g.rollouts) for g in groups))
        for mb in micro_batches:
            mb = mb.to(self.device)
            logp, _ = self._logprobs(self.model, mb)
            out[mb.sample_index.cpu()] = masked_sum(logp, mb.loss_mask, dim=-1).cpu()
        return out

    def _scalars(self) -> dict[str, Any]:
        """The adaptive KL coefficient rides in the checkpoint."""
        return {"kl_coef": self.kl.value}

    def _load_scalars(self, scalars: dict[str, Any]) -> None:
        self.kl.value = float(scalars["kl_coef"])

    def _trained_models(self) -> list[nn.Module]:
        """The policy, and the critic when there is one."""
        return [self.model, *([self.critic.model] if self.critic is not None else [])]

    def _train_objects(self) -> TrainObjects:
        critic = self.critic.train_objects() if self.critic is not None else None
        return TrainObjects(self.model, self.optimizer, self.scheduler, critic)

    # -- phase 1: plan ----------------------------------------------------------------------------------

    def _pad_micro_batches(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """Move to the device and pad with empty micro-batches to the most any rank has."""
        target = all_reduce_max(len(micro_batches), self.world)
        padding = [empty_micro_batch(self.pad_id, self.packed) for _ in range(target - len(micro_batches))]
        return [mb.to(self.device) for mb in micro_batches + padding]

    def _train_mask(self, mb: MicroBatch, step_batch: StepBatch) -> Tensor:
        """The loss mask, without truncated completions when the run masks them. (B, T)."""
        if not self.spec.algorithm.overlong.mask_truncated or _is_empty(mb):
            return mb.loss_mask
        truncated = step_batch.truncated.to(self.device)[mb.sample_index]
        return mb.loss_mask * (~truncated).unsqueeze(-1).to(mb.loss_mask.dtype)

    def _global_count(self, micro_batches: list[MicroBatch]) -> float:
        """The aggregation's normaliser over the whole step, all ranks."""
        aggregation = self.loss_config.aggregation
        local = torch.zeros(1, device=self.device)
        for mb in micro_batches:
            if not _is_empty(mb):
                local += normaliser_count(attached(mb.train_mask), aggregation)
        return float(all_reduce_sum(local, self.world).item())

    # -- phase 2: frozen pass ---------------------------------------------------------------------------

    @torch.no_grad()
    def _frozen_pass(self, plan: StepPlan) -> None:
        """Reference log-probs (KL), pre-update policy log-probs (several epochs, KL in the reward) and the
        critic's pre-update values (gae)."""
        kl = self.spec.algorithm.kl
        need_old = self.spec.algorithm.ppo_epochs > 1 or (self.reference is not None and kl.mode == "reward")
        for mb in plan.micro_batches:
            if self.reference is not None:
                mb.ref_logp = self._logprobs(self.reference, mb)[0]
            if need_old:
                mb.old_logp = self._logprobs(self.model, mb)[0]
            if self.critic is not None:
                mb.old_values = self.critic.values(mb)

    def _logprobs(
        self, model: nn.Module, mb: MicroBatch, entropy_grad: bool = False
    ) -> tuple[Tensor, Tensor]:
        """`model`'s log-prob of each target and entropy per position, of its logits divided by the sampling
        temperature (`sampling_temperature`): both (B, T). A packed micro-batch
        runs as its packed row (0 on the prompt positions, which no loss mask covers) through a model
        loaded for it; a model that is not (a reference whose architecture cannot be packed) takes the
        padded rows."""
        packed = mb.packed if is_packed(model) else None
        if packed is None:
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            return token_logprobs_and_entropy(logits, mb.targets(self.pad_id), entropy_grad, self.temperature)
        logits = packed_logits(model, packed)
        logp, entropy = token_logprobs_and_entropy(logits, packed.targets, entropy_grad, self.temperature)
        shape = mb.input_ids.shape
        return packed.to_target_layout(logp, shape), packed.to_target_layout(entropy, shape)

    # -- phase 3: advantages ----------------------------------------------------------------------------

    def _attach_advantages(self, plan: StepPlan) -> None:
        """Advantages per group over this rank's samples, scattered onto each micro-batch (B, T); with a
        critic, the returns (its targets) too."""
        sb = plan.step_batch
        if sb.rewards.numel() == 0:
            for mb in plan.micro_batches:
                mb.advantages = mb.returns = torch.zeros_like(mb.loss_mask)
            return
        token_rewards = self._token_rewards(plan).to(self.device)
        mask = sb.completion_mask.to(self.device)
        values = (
            self._completion_layout(plan, lambda mb: attached(mb.old_values))
            if self.critic is not None
            else None
        )
        algo = self.spec.algorithm
        estimator = ADVANTAGE_ESTIMATORS[algo.advantage]
        advantages, returns = estimator(
            token_rewards,
            mask,
            group_size=sb.group_size,
            values=None if values is None else values.to(self.device),
            gamma=algo.gamma,
            lam=algo.lam,
        )
        for mb in plan.micro_batches:
            mb.advantages = _to_target_layout(mb, advantages, mask)
            if self.critic is not None:
                mb.returns = _to_target_layout(mb, returns, mask)

    def _token_rewards(self, plan: StepPlan) -> Tensor:
        """Outcome rewards (+ overlong penalty) on each completion's last policy token and the turns'
        rewards on theirs (`StepBatch.token_rewards`), minus the KL penalty on the policy tokens when the
        KL is in the reward: (N, Tc) on the CPU."""
        sb, algo = plan.step_batch, self.spec.algorithm
        rewards = sb.rewards
        if algo.overlong.penalty:
            max_tokens = self.spec.rollout.sampling.max_tokens
            rewards = rewards + overlong_penalty(sb.lengths, max_tokens, algo.overlong.buffer_tokens)
        token_rewards = sb.token_rewards(rewards)
        if self.reference is not None and algo.kl.mode == "reward":
            kl = self._completion_kl(plan)
            token_rewards = apply_kl_penalty(token_rewards, kl, sb.completion_mask, self.kl.value)
        return token_rewards

    def _completion_kl(self, plan: StepPlan) -> Tensor:
        """Per-token KL of the pre-update policy to the reference in the completion layout: (N, Tc)."""
        estimator = KL_ESTIMATORS[self.spec.algorithm.kl.estimator]
        return self._completion_layout(
            plan, lambda mb: estimator(attached(mb.old_logp), attached(mb.ref_logp))
        )

    @staticmethod
    def _completion_layout(plan: StepPlan, per_token: Callable[[MicroBatch], Tensor]) -> Tensor:
        """Gather a per-token quantity of each micro-batch, `per_token(mb)` (B, T), into the step's
        completion layout: (N, Tc) on the CPU, 0 off the completions."""
        out = torch.zeros_like(plan.step_batch.completion_mask)
        for mb in plan.micro_batches:
            if not _is_empty(mb):
                values = per_token(mb) * mb.loss_mask
                out[mb.sample_index.cpu()] = mb.to_completion_layout(values, out.shape[1]).cpu()
        return out

    # -- phase 4: accumulate ----------------------------------------------------------------------------

    def _accumulate(self, plan: StepPlan) -> dict[str, Tensor]:
        """Forward and backward over every micro-batch; returns the step's summed statistics (local)."""
        sums: dict[str, Tensor] = {}
        trained = self._trained_models()
        last = len(plan.micro_batches) - 1
        for i, mb in enumerate(plan.micro_batches):
            defer_gradient_sync(trained, self.world, defer=i < last)
            mb_sums = self._micro_batch_backward(mb, plan.global_count)
            if self.critic is not None:
                weight = self._weight(mb, plan.global_count)
                mb_sums.update(self.critic.backward(mb, attached(mb.train_mask), weight, self.world.size))
            for name, value in mb_sums.items():
                sums[name] = sums.get(name, torch.zeros((), device=self.device)) + value
        return sums

    def _micro_batch_backward(self, mb: MicroBatch, global_count: float) -> dict[str, Tensor]:
        """Loss of one micro-batch, weighted into the step's aggregate, backpropagated. Returns sums."""
        algo, mask = self.spec.algorithm, attached(mb.train_mask)
        logp, entropy = self._logprobs(self.model, mb, entropy_grad=algo.entropy_coef != 0)
        if algo.old_policy == "rollout":
            old_logp, rollout_logp = mb.rollout_logprobs, None  # the ratio is the importance weight
        else:
            old_logp = mb.old_logp if mb.old_logp is not None else logp.detach()
            rollout_logp = mb.rollout_logprobs
        pg_loss, stats = policy_loss(
            logp, old_logp, attached(mb.advantages), mask, self.loss_config, rollout_logp
        )
        stats.update(rollout_mismatch(logp, mb.rollout_logprobs, mask))
        kl_tokens = self._kl_tokens(logp, mb)
        loss = pg_loss + self._kl_loss(kl_tokens, mask) + self._entropy_loss(entropy, mask)
        weight = self._weight(mb, global_count)
        (loss * (weight * self.world.size)).backward()
        tokens = mask.sum()
        sums = {name: value * tokens for name, value in stats.items()}
        sums.update(
            loss=loss.detach() * weight,
            policy_loss=pg_loss.detach() * weight,
            kl=masked_sum(kl_tokens.detach(), mask),
            entropy=masked_sum(entropy.detach(), mask),
            tokens=tokens,
        )
        return sums

    def _weight(self, mb: MicroBatch, global_count: float) -> float:
        """This micro-batch's share of the step's normaliser: `local_count / global_count`."""
        if _is_empty(mb):
            return 0.0
        local = float(normaliser_count(attached(mb.train_mask), self.loss_config.aggregation))
        return local / max(global_count, 1.0)

    def _kl_tokens(self, logp: Tensor, mb: MicroBatch) -> Tensor:
        """Per-token KL to the reference (with gradient through `logp`), or zeros without one. (B, T)."""
        if mb.ref_logp is None:
            return torch.zeros_like(logp)
        return KL_ESTIMATORS[self.spec.algorithm.kl.estimator](logp, mb.ref_logp)

    def _kl_loss(self, kl_tokens: Tensor, mask: Tensor) -> Tensor:
        """`coef * aggregate(kl)` when the KL is in the loss, else 0."""
        if self.reference is None or self.spec.algorithm.kl.mode != "loss":
            return torch.zeros((), device=mask.device)
        cfg = self.loss_config
        return self.kl.value * aggregate(kl_tokens, mask, cfg.aggregation, cfg.max_tokens)

    def _entropy_loss(self, entropy: Tensor, mask: Tensor) -> Tensor:
        """The entropy bonus term (0 when its coefficient is 0)."""
        coef = self.spec.algorithm.entropy_coef
        if coef == 0:
            return torch.zeros((), device=mask.device)
        return entropy_bonus(entropy, mask, coef, self.loss_config.aggregation, self.loss_config.max_tokens)

    # -- phase 5: optimizer step ------------------------------------------------------------------------

    def _zero_grad(self) -> None:
        """Clear the policy's (and the critic's) gradients."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.optimizer.zero_grad(set_to_none=True)

    def _lr_scale(self, metrics: dict[str, float]) -> float:
        """The policy's LR factor for this step: `rollout_trust_kl / rollout_mismatch_kl` when the step's
        samples came from a policy further than `algorithm.rollout_trust_kl` from the trainer's, else 1.
        `metrics` are the step's global ones, so every rank takes the same step."""
        trust = self.spec.algorithm.rollout_trust_kl
        mismatch = metrics.get("rollout_mismatch_kl", 0.0)
        if trust is None or not mismatch > trust:
            return 1.0
        return trust / mismatch

    def _optimizer_step(self, lr_scale: float = 1.0) -> dict[str, float]:
        """Step the policy at `lr_scale` times its scheduled LR (and the critic at its own), each with its
        own grad-norm clip; returns the grad norms, the LRs used and the scale."""
        clip = self.spec.optim.grad_clip
        grad_norm, lr = clip_and_step(self.model, self.optimizer, self.scheduler, clip, lr_scale)
        out = {"grad_norm": grad_norm, "lr": lr, "lr_scale": lr_scale}
        if self.critic is not None:
            critic = self.critic
            out["critic_grad_norm"], out["critic_lr"] = clip_and_step(
                critic.model, critic.optimizer, critic.scheduler, clip
            )
        return out

    # -- phase 6: metrics -------------------------------------------------------------------------------

    def _finish_metrics(self, plan: StepPlan, sums: dict[str, Tensor]) -> dict[str, float]:
        """Sum every statistic over the ranks (one all-reduce) and turn sums into means."""
        sums = {**sums, **sample_sums(plan.step_batch, plan.micro_batches, self.device)}
        names = sorted(sums)
        totals = all_reduce_sum(torch.stack([sums[n].float() for n in names]), self.world).tolist()
        total = dict(zip(names, totals, strict=True))
        return step_metrics(total)


def _is_empty(mb: MicroBatch) -> bool:
    """A padding micro-batch (see `empty_micro_batch`)."""
    return bool((mb.sample_index < 0).all())


def _to_target_layout(mb: MicroBatch, per_token: Tensor, completion_mask: Tensor) -> Tensor:
    """`mb`'s rows of a step tensor (N, Tc) in the target layout (B, T); zeros for a padding micro-batch."""
    if _is_empty(mb):
        return torch.zeros_like(mb.loss_mask)
    return mb.from_completion_layout(per_token, completion_mask)
