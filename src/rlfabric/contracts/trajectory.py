"""The plain records of a multi-turn trajectory, shared by whoever produces one (the rollout replica's
trajectory driver) and whoever trains on it (the learner): no grpc, no torch. `contracts.wire` converts
them to and from the proto messages (`rlfabric.v1.Turn`, `TrajectoryStatus`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TurnRole = Literal["model", "environment", "tool"]
"""Who produced a turn's tokens: the policy, the environment (an observation) or a tool (its result)."""

TrajectoryStatus = Literal["done", "truncated", "env_error", "env_timeout", "template_mismatch", "aborted"]
"""How a trajectory ended (rollout.proto's `TrajectoryStatus`): the environment said done; a limit cut
it; the environment failed or timed out (never a reward of 0: the group is dropped); the chat template
could not extend the conversation token for token; a weight update aborted a turn."""
TRAJECTORY_STATUSES: tuple[TrajectoryStatus, ...] = (
    "done",
    "truncated",
    "env_error",
    "env_timeout",
    "template_mismatch",
    "aborted",
)
"""Every `TrajectoryStatus`, in the proto enum's order."""
ENVIRONMENT_FAILURES: frozenset[TrajectoryStatus] = frozenset({"env_error", "env_timeout"})
"""The environment's own failures (counted in `environment_errors`; a template mismatch is the product
refusing to re-tokenize and is counted apart, in `template_mismatches`)."""
FAILED_STATUSES: frozenset[TrajectoryStatus] = ENVIRONMENT_FAILURES | {"template_mismatch"}
"""Statuses whose trajectory has no valid outcome to score or train on."""


@dataclass(frozen=True)
class Turn:
    """One turn of a multi-turn completion: the tokens from `start` to the next turn's start."""

    start: int
    """Offset into the completion's `token_ids` where the turn starts."""
    role: TurnRole
    """Who produced the turn."""
    reward: float | None = None
    """The environment's reward for this turn; None when it gave none (which is not a reward of 0)."""
