"""`[health]`: thresholds of the run-health checks and the checks that stop a run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.runspec.base import (
    MAX_KEEP,
    SpecModel,
)

HealthCheck = Literal[
    "reward_hacking",
    "overfitting",
    "entropy_collapse",
    "response_length",
    "rollout_mismatch",
    "overoptimization",
    "reward_collapse",
    "no_signal",
]
"""The run-health checks (see `rlfabric.coordinator.health`)."""


class HealthThresholds(SpecModel):
    """Thresholds of the run-health checks; every default lives here."""

    window: int = Field(default=5, ge=1, le=MAX_KEEP)
    """Rows averaged for "recent" and "before" values."""
    kl_jump_factor: float = Field(default=2.0, gt=1.0)
    """Reward hacking: recent KL is at least this multiple of the window before..."""
    kl_floor: float = Field(default=1e-3, ge=0.0)
    """...with the earlier KL taken as at least this (so KL rising from ~0 must reach a real size)..."""
    reward_jump: float = Field(default=0.1, gt=0.0)
    """...while the mean reward rose by at least this much between the two windows."""
    reward_collapse_drop: float = Field(default=0.3, gt=0.0)
    """Reward collapse: the last window's mean training reward is at least this much (in the reward's
    units) below the best earlier window's: a policy that had it and lost it."""
    no_signal_fraction: float = Field(default=0.9, gt=0.0, le=1.0)
    """No learning signal: at least this share of the last window's groups gave every sample the same
    reward (`uniform_reward_groups_fraction`)..."""
    no_signal_rise: float = Field(default=0.1, ge=0.0)
    """...while the training reward rose less than this (in the reward's units) since the first window:
    uniform groups at a reward that rose are a solved task, not a stuck one."""
    eval_points: int = Field(default=3, ge=2, le=MAX_KEEP)
    """Overfitting: held-out evaluations compared (the first and the last of the most recent ones)."""
    eval_drop: float = Field(default=0.02, gt=0.0)
    """Overfitting: the held-out reward fell by at least this much..."""
    train_rise: float = Field(default=0.02, gt=0.0)
    """...while the training reward rose by at least this much over the same steps."""
    entropy_floor: float = Field(default=0.01, ge=0.0)
    """Entropy collapse: recent mean token entropy (nats) below this..."""
    entropy_ratio: float = Field(default=0.1, gt=0.0, lt=1.0)
    """...or below this fraction of the entropy in the first window."""
    length_runaway_factor: float = Field(default=3.0, gt=1.0)
    """Length runaway: recent mean response length above this multiple of the first window's..."""
    length_limit_fraction: float = Field(default=0.95, gt=0.0, le=1.0)
    """...or above this fraction of max_tokens (most completions are being truncated; multi-turn runs:
    of `environment.max_total_tokens`, a trajectory's budget)."""
    length_collapse_ratio: float = Field(default=0.25, gt=0.0, lt=1.0)
    """Length collapse: recent mean response length below this fraction of the first window's..."""
    length_min_tokens: float = Field(default=2.0, ge=0.0)
    """...or below this many tokens."""
    mismatch_kl_max: float = Field(default=0.05, gt=0.0)
    """Rollout mismatch: the recent mean KL between the engine's and the trainer's token distributions
    (`rollout_mismatch_kl`, nats per token) above this: stale samples or a precision/kernel gap the
    rollout correction is straining to cover..."""
    mismatch_drift_factor: float = Field(default=10.0, gt=1.0)
    """...or above this multiple of its first window's mean..."""
    mismatch_floor: float = Field(default=0.005, ge=0.0)
    """...once it is at least this large (a drift from ~0 must reach a real size)."""
    gold_drop: float = Field(default=0.05, gt=0.0)
    """Over-optimisation (needs `dataset.eval.reward`): the gold reward of each of the last `gold_patience`
    evaluations is at least this much below its peak (in the gold reward's units)..."""
    gold_patience: int = Field(default=2, ge=1, le=MAX_KEEP)
    """...for this many evaluations in a row after the peak..."""
    proxy_rise: float = Field(default=0.0, ge=0.0)
    """...while the proxy (the run's own) reward of those evaluations rose, on average, by more than this
    above its value at the gold peak."""


class HealthSpec(HealthThresholds):
    """Run-health warnings (shown on the run status and page) and the checks that stop the run."""

    auto_stop: list[HealthCheck] = Field(default_factory=list)
    """Checks that stop the run when they trigger (the learner stops at once, writes no further
    checkpoint, and the run reports the last checkpoint from before the problem began); [] only warns."""
