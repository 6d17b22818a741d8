"""Scored groups as the learner receives them: plain records, no torch.

Kept apart from `batch.py` (the tensors the learner trains on) so `rlfabric.contracts.wire` can build
them from a `ScoredGroup` without loading torch; `batch.py` re-exports them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

COMPONENT_PREFIX = "reward/"
"""Metrics-row prefix of a reward component's per-step mean (`reward/<component>`)."""


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
    components: dict[str, float] = field(default_factory=dict)
    """The reward's named parts, as the scorer reported them: a composite's parts, each TRL reward
    function's own reward (`<function>`) and what it logged (`<function>/<name>`)."""


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


def component_means(groups: Sequence[GroupSamples]) -> dict[str, float]:
    """Each reward component's mean over the step's samples that carry it, as `reward/<component>`."""
    values: dict[str, list[float]] = defaultdict(list)
    for group in groups:
        for rollout in group.rollouts:
            for name, value in rollout.components.items():
                values[name].append(value)
    return {f"{COMPONENT_PREFIX}{name}": sum(v) / len(v) for name, v in sorted(values.items())}
