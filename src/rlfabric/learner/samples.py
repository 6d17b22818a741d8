"""Scored groups as the learner receives them: plain records, no torch.

Kept apart from `batch.py` (the tensors the learner trains on) so `rlfabric.contracts.wire` can build
them from a `ScoredGroup` without loading torch; `batch.py` re-exports them.

A multi-turn sample's completion interleaves the policy's tokens with tokens the environment, a tool or
the chat template appended. `Rollout.loss_mask` tells them apart (1 = the policy's); only the policy's
tokens are trained on, the others are context. Rewards land on policy tokens (`Rollout.reward_positions`):
each rewarded turn's reward on the last policy token at or before the turn's end (the action that
earned it), the final reward on the last policy token of the completion. Token-level estimators (GAE,
REINFORCE++) so give turn-level credit; group estimators score a sample by the sum of its token rewards,
the trajectory reward `final + sum(turn rewards)`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from rlfabric.contracts.trajectory import Turn as Turn
from rlfabric.contracts.trajectory import TurnRole as TurnRole

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
    loss_mask: list[int] | None = None
    """Per completion token, aligned with `token_ids` and `logprobs`: 1 for a token the policy sampled,
    0 for one the environment, a tool or the chat template appended (its logprob is 0, ignored). None
    means every token is the policy's (a single-turn sample)."""
    turns: list[Turn] = field(default_factory=list)
    """The turns in order, partitioning the completion (the first starts at 0); empty when single-turn."""
    tool_calls: int = 0
    """Tool calls the policy made in the trajectory (multi-turn)."""
    tool_errors: int = 0
    """Of those, the ones that failed (malformed, unknown tool, off the schema, raised)."""

    @property
    def num_turns(self) -> int:
        """The number of turns (1 for a single-turn sample)."""
        return len(self.turns) or 1

    def model_mask(self) -> list[int]:
        """1 on the policy's tokens, 0 on the others: `len(token_ids)` entries."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.token_ids)

    def last_model_token(self, end: int | None = None) -> int:
        """Index of the last policy token before `end` (default: the whole completion); -1 when none."""
        mask = self.model_mask()
        stop = len(mask) if end is None else end
        return next((i for i in range(stop - 1, -1, -1) if mask[i]), -1)

    def turn_ends(self) -> list[int]:
        """Each turn's end offset (exclusive), aligned with `turns`."""
        if not self.turns:
            return []
        return [t.start for t in self.turns[1:]] + [len(self.token_ids)]

    def reward_positions(self) -> list[tuple[int, float]]:
        """`(token index, reward)` of each rewarded turn: its reward on the last policy token at or before
        the turn's end. The final `reward` is not included (it goes on `last_model_token()`)."""
        ends = self.turn_ends()
        return [
            (self.last_model_token(end), turn.reward)
            for turn, end in zip(self.turns, ends, strict=True)
            if turn.reward is not None
        ]

    def check(self, group_id: str) -> None:
        """Raise ValueError unless the per-token lists align and the turns partition the completion."""
        n = len(self.token_ids)
        if len(self.logprobs) != n:
            raise ValueError(f"group {group_id!r}: {n} tokens but {len(self.logprobs)} logprobs")
        if self.loss_mask is not None and (
            len(self.loss_mask) != n or any(m not in (0, 1) for m in self.loss_mask)
        ):
            raise ValueError(f"group {group_id!r}: the loss mask needs {n} entries of 0 or 1")
        self._check_turns(group_id)

    def _check_turns(self, group_id: str) -> None:
        """Turns start at 0, strictly increase, stay inside the completion and reward only after a policy
        token."""
        starts = [t.start for t in self.turns]
        if not starts:
            return
        if starts[0] != 0 or any(b <= a for a, b in pairwise(starts)):
            raise ValueError(f"group {group_id!r}: turn starts {starts} must begin at 0 and increase")
        if starts[-1] >= len(self.token_ids):
            raise ValueError(f"group {group_id!r}: a turn starts at or past the completion's end")
        if any(position < 0 for position, _ in self.reward_positions()):
            raise ValueError(f"group {group_id!r}: a turn's reward comes before any policy token")


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
            r.check(self.group_id)


def component_means(groups: Sequence[GroupSamples]) -> dict[str, float]:
    """Each reward component's mean over the step's samples that carry it, as `reward/<component>`."""
    values: dict[str, list[float]] = defaultdict(list)
    for group in groups:
        for rollout in group.rollouts:
            for name, value in rollout.components.items():
                values[name].append(value)
    return {f"{COMPONENT_PREFIX}{name}": sum(v) / len(v) for name, v in sorted(values.items())}


def trajectory_means(groups: Sequence[GroupSamples]) -> dict[str, float]:
    """A multi-turn step's trajectory metrics ({} for single-turn steps): model turns per trajectory
    (`turns_mean`), tool calls per trajectory and the share of them that succeeded."""
    rollouts = [r for g in groups for r in g.rollouts if r.turns]
    if not rollouts:
        return {}
    calls = sum(r.tool_calls for r in rollouts)
    metrics = {
        "turns_mean": sum(sum(t.role == "model" for t in r.turns) for r in rollouts) / len(rollouts),
        "tool_calls_mean": calls / len(rollouts),
    }
    if calls:
        metrics["tool_call_success_rate"] = 1.0 - sum(r.tool_errors for r in rollouts) / calls
    return metrics
