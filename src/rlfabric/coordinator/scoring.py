"""Scoring a run's groups through the reward service, holding their samples while it fails.

A group's samples are generated once. If the Score call fails (the service is down, restarting, or
refuses the run's scorer) the samples are held and scored again with exponential backoff, never answered
by generating again; the run status carries a warning from the first failure until a call succeeds. A
scorer's own failure on an item is not a call failure: it comes back as that item's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc

from rlfabric.coordinator.dataset import PromptRow
from rlfabric.coordinator.runs import RunNotFound, RunStore
from rlfabric.reward.client import ITEM_COLUMNS, AsyncRewardClient, RewardServiceError
from rlfabric.reward.spec import ItemResult, spec_from_reward_spec
from rlfabric.runspec import RewardSpec, RunSpec
from rlfabric.runtime.aio import cancel_point
from rlfabric.v1 import rollout_pb2

log = logging.getLogger(__name__)

SCORE_RETRY_FIRST_S = 0.5
"""After a failed Score call a held group waits this long before scoring again; the wait doubles each time."""
SCORE_RETRY_MAX_S = 10.0
"""Longest wait between two Score attempts of a held group."""
REWARD_WARNING = "reward service unreachable"
"""Start of the run-status warning shown while Score calls fail."""
REWARD_REFUSAL = "reward service refuses the run's scorer"
"""Start of the warning shown instead while the service refuses the run's scorer (`REFUSAL_CODES`)."""
REFUSAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
"""Score failures that are the run's configuration, not an outage: the warning gives the service's reason
(retrying goes on, so a reward service restarted with the right settings picks the run up)."""


def reward_warning(error: RewardServiceError) -> str:
    """The run-status warning for a failed Score call: a refusal names the service's reason (the field and
    why, never file contents: the reward service's messages are written so), an outage its status code."""
    if error.code in REFUSAL_CODES:
        return f"{REWARD_REFUSAL} ({error.code.name}): {error.details}; groups hold their samples"
    return f"{REWARD_WARNING} ({error.code.name}); groups hold their samples"


class GroupScorer:
    """One run's Score calls (`score`), their retries (`score_held`) and the outage warning."""

    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        store: RunStore,
        address: str,
        count_retry: Callable[[], Awaitable[None]],
        *,
        token: str | None = None,
        reward: RewardSpec | None = None,
    ) -> None:
        """`reward`: the reward to score with (None: the run's `reward`; the evaluation's gold reward)."""
        self.run_id, self.spec, self.store, self.count_retry = run_id, spec, store, count_retry
        self.reward = reward or spec.reward
        self.client = AsyncRewardClient(address, timeout_s=self.reward.item_timeout_s * 4 + 30, token=token)
        self.reward_spec = spec_from_reward_spec(self.reward)
        self.warning: str | None = None
        self.warning_lock = asyncio.Lock()

    async def close(self) -> None:
        await self.client.close()

    async def score(
        self, row: PromptRow, samples: list[rollout_pb2.GeneratedSample], epoch: int = 0
    ) -> list[ItemResult]:
        """One Score call for a group's samples. Each item carries the dataset's columns (the reference
        also under its own column name, as TRL passes it), the engine's token ids, the sample's policy
        version and the prompt's epoch (a user reward function's `completion_ids` and `trainer_state`)."""
        column = self.spec.dataset.reference_field
        named = {column: row.reference} if column and column not in ITEM_COLUMNS else {}
        base = {"prompt": row.prompt, "reference": row.reference, **named, **row.metadata, "epoch": epoch}
        items = [
            {
                **base,
                "id": str(s.sample_index),
                "completion": s.text,
                "completion_tokens": len(s.token_ids),
                "completion_ids": list(s.token_ids),
                "policy_version": s.policy_version,
            }
            for s in samples
        ]
        return await self.client.score(items, self.reward_spec, item_timeout_s=self.reward.item_timeout_s)

    async def score_held(
        self, row: PromptRow, samples: list[rollout_pb2.GeneratedSample], epoch: int = 0
    ) -> list[ItemResult]:
        """Scores held samples, retrying with exponential backoff while the Score call fails (each retry
        counted by `count_retry`); the run status carries a warning from the first failure until a call
        succeeds again."""
        delay = SCORE_RETRY_FIRST_S
        while True:
            cancel_point()
            try:
                scores = await self.score(row, samples, epoch)
            except RewardServiceError as exc:
                await self.outage(exc)
                await self.count_retry()
                await asyncio.sleep(delay)
                delay = min(2 * delay, SCORE_RETRY_MAX_S)
                continue
            await self.outage(None)
            return scores

    async def outage(self, error: RewardServiceError | None) -> None:
        """Keeps the run's reward-outage warning in step with the last Score call (None: it succeeded).
        A pipeline without a run record (driven directly, as in tests) has no status to warn in."""
        warning = None if error is None else reward_warning(error)
        if warning == self.warning:
            return
        async with self.warning_lock:
            previous, self.warning = self.warning, warning
            with contextlib.suppress(RunNotFound):
                if previous is not None:
                    await self.store.remove_warning(self.run_id, previous)
                if warning is not None and error is not None:
                    log.warning("%s: %s", warning, error.details)
                    await self.store.add_warning(self.run_id, warning)
