"""Held-out evaluation of a run: the evaluation prompts scored with the serving policy before the first
learner step, every k steps and, when the learner asks for it (`keys.final_eval`), with the final policy;
never enqueued and never trained on.

The prompts are the separate evaluation set (`dataset.eval`) or the held-out fraction of the training
set (`dataset.held_out_fraction`); each evaluation generates with `dataset.eval`'s sampling overrides and
appends one result to `keys.eval_results` (mean reward, the lowest policy version sampled, the step, the
source and how many prompts and samples it covers). A prompt a replica refuses as too long is counted
once (`eval_prompts_too_long`) and skipped from then on.

With a gold reward (`dataset.eval.reward`) the same samples are scored twice: `reward_mean` stays the
run's own (proxy) reward, as always, and `gold_reward_mean` (with `gold_samples`, the samples it covers)
is the gold one. A gold Score call that fails leaves that prompt out of the gold mean only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlfabric.contracts import keys, wire
from rlfabric.contracts.keys import Counter
from rlfabric.contracts.trajectory import FAILED_STATUSES
from rlfabric.coordinator.dataset import EvalSource, PromptRow
from rlfabric.coordinator.inflight import InFlight, InvalidPrompt, ReplicaFailed
from rlfabric.reward.client import RewardServiceError
from rlfabric.reward.spec import ItemResult
from rlfabric.runspec import RunSpec, SamplingSpec
from rlfabric.runtime.aio import cancel_point
from rlfabric.v1 import rollout_pb2

POLL_S = 0.5
"""How often the learner's step is read to see whether an evaluation is due."""


def eval_sampling(spec: RunSpec) -> SamplingSpec:
    """The run's sampling with `dataset.eval`'s overrides (samples per prompt, temperature)."""
    overrides = {"n": spec.dataset.eval.n, "temperature": spec.dataset.eval.temperature}
    return spec.rollout.sampling.model_copy(update={k: v for k, v in overrides.items() if v is not None})


class Generates(Protocol):
    """The run's generation (`dispatch.Dispatcher`)."""

    async def generate(
        self, item: InFlight, row: PromptRow, sampling: SamplingSpec | None = None
    ) -> list[rollout_pb2.GeneratedSample]: ...


class Pipeline(Protocol):
    """What an evaluation uses of the run's pipeline: its generation, scoring and books."""

    run_id: str
    spec: RunSpec
    redis: Any

    @property
    def dispatcher(self) -> Generates: ...
    async def learner_step(self) -> int: ...
    async def count(self, counter: Counter, n: int = 1) -> None: ...
    async def refused_as_too_long(self, row: PromptRow, reason: str) -> None: ...


Score = Callable[[PromptRow, list[rollout_pb2.GeneratedSample]], Awaitable[list[ItemResult]]]
"""A Score call for one prompt's samples (`scoring.GroupScorer.score`)."""


class Evaluator:
    """Evaluates `rows` every `dataset.eval_every_steps` learner steps (`run`), or once (`evaluate`):
    with the run's reward (`score`) and, when given, the gold reward (`gold`)."""

    def __init__(self, pipeline: Pipeline, score: Score, gold: Score | None = None) -> None:
        self.pipeline, self.score, self.gold = pipeline, score, gold
        self.sampling = eval_sampling(pipeline.spec)
        self.too_long: set[str] = set()
        """Evaluation prompt ids a replica refused as too long: never evaluated again."""

    async def run(self, rows: list[PromptRow], source: EvalSource) -> None:
        """Evaluates before the first step, every k steps, and the final policy when the learner asks
        (`keys.final_eval`: it has published its last step's weights and waits for the result, so its
        last metrics row carries the final policy's held-out reward). A request is answered (deleted)
        even when nothing could be evaluated, so the learner never waits for nothing."""
        every = self.pipeline.spec.dataset.eval_every_steps
        if not every:
            return
        request = keys.final_eval(self.pipeline.run_id)
        done = -1
        while True:
            cancel_point()
            final = await self.pipeline.redis.get(request)
            if final is not None:
                step = int(final)
                if rows:
                    await self.evaluate(rows, step, source)
                done = max(done, step // every)  # not again when the learner's step reaches it
                await self.pipeline.redis.delete(request)
            step = await self.pipeline.learner_step()
            if rows and step // every > done:
                done = step // every
                await self.evaluate(rows, step, source)
            await asyncio.sleep(POLL_S)

    async def evaluate(self, rows: list[PromptRow], step: int, source: EvalSource = "held_out") -> None:
        """Scores the evaluation prompts all at once (so the result describes one version, not several)."""
        rows = [r for r in rows if r.prompt_id not in self.too_long]
        outcomes = await asyncio.gather(*(self.evaluate_one(row, step) for row in rows))
        rewards = [r for o in outcomes for r in o.rewards]
        versions = [v for o in outcomes for v in o.versions]
        golds = [g for o in outcomes for g in o.gold]
        if rewards:
            result: dict[str, Any] = {
                "reward_mean": sum(rewards) / len(rewards),
                "policy_version": min(versions),
                "step": step,
                "source": source,
                "prompts": sum(1 for o in outcomes if o.rewards),
                "samples": len(rewards),
            }
            if golds:
                result.update(gold_reward_mean=sum(golds) / len(golds), gold_samples=len(golds))
            await self.pipeline.redis.rpush(keys.eval_results(self.pipeline.run_id), json.dumps(result))

    async def evaluate_one(self, row: PromptRow, step: int) -> Outcome:
        """One prompt's rewards and gold rewards (ok items only) and sampled versions; nothing when it
        cannot be evaluated."""
        item = InFlight(f"eval:{row.prompt_id}:s{step}", row.prompt_id, 0, 0)
        try:
            generated = await self.pipeline.dispatcher.generate(item, row, self.sampling)
            samples = [s for s in generated if evaluable(s)]
            if not samples:
                return Outcome()
            scores = await self.score(row, samples)
        except InvalidPrompt as exc:
            if exc.too_long:
                self.too_long.add(row.prompt_id)
                await self.pipeline.count(Counter.EVAL_PROMPTS_TOO_LONG)
                await self.pipeline.refused_as_too_long(row, str(exc))
            return Outcome()
        except (ReplicaFailed, RewardServiceError):  # tolerated: an evaluation is skipped
            return Outcome()
        rewards = [r.reward for r in scores if r.status == "ok"]
        return Outcome(rewards, [s.policy_version for s in samples], await self.gold_rewards(row, samples))

    async def gold_rewards(self, row: PromptRow, samples: list[rollout_pb2.GeneratedSample]) -> list[float]:
        """The samples' gold rewards (ok items only); none without a gold reward or when its call fails."""
        if self.gold is None:
            return []
        try:
            scores = await self.gold(row, samples)
        except RewardServiceError:  # tolerated: this prompt is left out of the gold mean
            return []
        return [r.reward for r in scores if r.status == "ok"]


@dataclass(frozen=True)
class Outcome:
    """One prompt's evaluation: rewards of the ok items, the sampled versions, gold rewards of the ok
    items."""

    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    gold: list[float] = field(default_factory=list)


def evaluable(sample: rollout_pb2.GeneratedSample) -> bool:
    """False for a trajectory whose environment failed (nothing to score: not a reward of 0)."""
    if not sample.HasField("trajectory"):
        return True
    return wire.trajectory_status_from_proto(sample.trajectory.status) not in FAILED_STATUSES
