"""Scored groups as the learner receives them: plain records, no torch.

Kept apart from `batch.py` (the tensors the learner trains on) so `rlfabric.contracts.wire` can build
them from a `ScoredGroup` without loading torch; `batch.py` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rollout:
    """One sampled completion of a group's prompt, scored."""

    token_ids: list[int]
    """Completion token ids (the prompt is on the group)."""
    logprobs: list[float]
    """The inference engine's log-prob of each completion token: same length as `token_ids`."""
    reward: float
    """Sequence-level reward."""
    finish_reason: str = "stop"
    """"stop" or "length" (cut at max_tokens), as the engine reported it."""
    policy_version: int = 0
    """Policy version at dispatch."""


@dataclass
class GroupSamples:
    """The n samples of one prompt: the unit the learner consumes, never split by the estimators."""

    prompt_token_ids: list[int]
    """The prompt, at least one token."""
    rollouts: list[Rollout]
    """The samples, in sample-index order."""
    group_id: str = ""
    """Identity of the group (for the applied-group ledger)."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"group {self.group_id!r} has an empty prompt")
        for r in self.rollouts:
            if len(r.token_ids) != len(r.logprobs):
                raise ValueError(
                    f"group {self.group_id!r}: {len(r.token_ids)} tokens but {len(r.logprobs)} logprobs"
                )
