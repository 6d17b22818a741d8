"""The coordinator's checks of runs against the services and files they need (`rlfabric.validate`).

- `SubmitCheck`: before a run is accepted (`POST /v1/runs` answers 422 naming the field): the scorer is
  asked of the reward service (CheckScorer: the coordinator loads no scorer), everything else is checked
  here on a worker thread. A reward service that does not answer leaves the scorer unchecked (said in the
  report and the log); the running run then warns that the service does not answer.
- `reward_warning` and `model_warning`: the probes of a running run's liveness that are not in Redis
  (`RunManager.watch_liveness` runs them every `checks.interval_s`).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.reward.client import AsyncRewardClient
from rlfabric.reward.spec import ScorerProblem, spec_from_reward_spec
from rlfabric.runspec import RewardSpec, RunSpec
from rlfabric.runtime.hf import HF_LOCK
from rlfabric.validate import (
    GOLD_SECTION,
    CheckReport,
    SpecIssue,
    check_models,
    check_paths,
    check_spec,
    uses_reward,
)

log = logging.getLogger(__name__)

REWARD_SILENT = "reward service does not answer"
"""Start of the warning of a run whose reward service did not answer the last probe."""
MODEL_UNLOADABLE = "the model does not load"
"""Start of the warning of a run whose model files are missing or do not load."""


class RewardUnanswered(Exception):
    """The reward service did not answer a check; the message says where and how."""


def preload() -> None:
    """Imports what a submit's model check needs (transformers' auto classes: ~4-5 s on two cores), so
    that a run submitted right after start-up, as `rlfabric up` does, does not wait for them. Run on a
    daemon thread at start, under `HF_LOCK`: a dataset read beside a half-imported transformers fails
    (`rlfabric.runtime.hf`); a check or read meanwhile waits for the import instead."""
    with HF_LOCK:
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401


async def check_scorer(
    config: CoordinatorServiceConfig, spec: RunSpec, reward: RewardSpec | None = None
) -> list[ScorerProblem]:
    """The reward service's verdict on the run's scorer (or on `reward`, e.g. the evaluation's gold
    reward); RewardUnanswered when it gives none."""
    client = AsyncRewardClient(config.reward_address, token=config.reward_token)
    try:
        scorer = spec_from_reward_spec(reward or spec.reward)
        return await client.check_scorer(scorer, timeout_s=config.checks.reward_timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise RewardUnanswered(f"{config.reward_address} ({exc.code().name})") from exc
    finally:
        await client.close()


class SubmitCheck:
    """`POST /v1/runs`' check of a run spec (the API turns its issues into a 422)."""

    def __init__(self, config: CoordinatorServiceConfig) -> None:
        self.config = config

    async def __call__(self, spec: RunSpec) -> CheckReport:
        problems, skipped = await self.scorer(spec)
        gold = spec.dataset.eval.reward
        gold_problems, gold_skipped = await self.scorer(spec, gold) if gold is not None else ([], [])
        report = await asyncio.to_thread(check_spec, spec, problems, gold_problems)
        report.skipped += skipped + gold_skipped
        for line in report.skipped:
            log.info("run check: not checked: %s", line)
        return report

    async def scorer(
        self, spec: RunSpec, reward: RewardSpec | None = None
    ) -> tuple[list[ScorerProblem], list[str]]:
        """The problems of the run's scorer (or of `reward`: the gold one), or none and why it was not
        checked."""
        if not uses_reward(spec):
            return [], []
        try:
            return await check_scorer(self.config, spec, reward), []
        except RewardUnanswered as exc:
            section = "reward" if reward is None else GOLD_SECTION
            return [], [f"{section}.scorer: the reward service at {exc} did not answer"]


async def reward_warning(config: CoordinatorServiceConfig, spec: RunSpec) -> str | None:
    """A warning when the reward service does not answer or refuses the run's scorer, else None."""
    if not uses_reward(spec):
        return None
    try:
        problems = await check_scorer(config, spec)
        gold = spec.dataset.eval.reward
        gold_problems = await check_scorer(config, spec, gold) if gold is not None and not problems else []
    except RewardUnanswered as exc:
        return f"{REWARD_SILENT}: {exc}; nothing can be scored (is the reward service running?)"
    if problems:
        first = problems[0]
        return f"reward service refuses the run's scorer: {first.field}: {first.reason}"
    if gold_problems:
        first = gold_problems[0]
        return f"reward service refuses the run's gold scorer ({GOLD_SECTION}): {first.field}: {first.reason}"
    return None


def model_issues(spec: RunSpec) -> list[SpecIssue]:
    """What is wrong with the run's model paths and files (blocking: loads configs and tokenizers, never
    beside a dataset read of another thread: `rlfabric.runtime.hf`)."""
    issues = [i for i in check_paths(spec).issues if i.field.startswith("model.")]
    if issues:
        return issues
    with HF_LOCK:
        return check_models(spec)[0].issues


async def model_warning(spec: RunSpec) -> str | None:
    """A warning naming the model field that is missing or does not load, else None."""
    issues = await asyncio.to_thread(model_issues, spec)
    if not issues:
        return None
    return f"{MODEL_UNLOADABLE}: {issues[0]} (replicas and the learner cannot start with it)"
