"""Run-health warnings read off a run's metrics series (pure functions, no I/O).

Each check looks at the rows the learner appends per step (`reward_mean`, `kl`, `entropy`,
`response_length_mean`, and the sparse `eval_reward_mean` of held-out evaluations) and returns a warning
string when the series shows a known failure pattern of RL post-training:

- reward hacking: KL to the reference and the training reward jump together;
- overfitting: the training reward rises while the held-out reward falls;
- entropy collapse: the policy became (nearly) deterministic;
- response length runaway or collapse: completions grow towards the limit or shrink to nothing.

Recent values are means over the last `window` rows, so that one noisy step does not warn.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean
from typing import Any

from pydantic import BaseModel, Field

Row = dict[str, Any]


class HealthThresholds(BaseModel):
    """Thresholds of the run-health checks; every default lives here."""

    window: int = Field(default=5, ge=1)
    """Rows averaged for "recent" and "before" values."""
    kl_jump_factor: float = Field(default=2.0, gt=1.0)
    """Reward hacking: recent KL is at least this multiple of the window before..."""
    kl_floor: float = Field(default=1e-3, ge=0.0)
    """...with the earlier KL taken as at least this (so KL rising from ~0 must reach a real size)..."""
    reward_jump: float = Field(default=0.1, gt=0.0)
    """...while the mean reward rose by at least this much between the two windows."""
    eval_points: int = Field(default=3, ge=2)
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
    """...or above this fraction of max_tokens (most completions are being truncated)."""
    length_collapse_ratio: float = Field(default=0.25, gt=0.0, lt=1.0)
    """Length collapse: recent mean response length below this fraction of the first window's..."""
    length_min_tokens: float = Field(default=2.0, ge=0.0)
    """...or below this many tokens."""


def series(rows: Sequence[Row], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that has a numeric `key`, in row order (rows without `step` use their
    index)."""
    points = []
    for index, row in enumerate(rows):
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            points.append((int(row.get("step", index)), float(value)))
    return points


def _mean(points: Sequence[tuple[int, float]]) -> float:
    return fmean(value for _, value in points)


def check_reward_hacking(rows: Sequence[Row], t: HealthThresholds) -> str | None:
    """KL and reward jumping together between the last two windows."""
    kl, reward = series(rows, "kl"), series(rows, "reward_mean")
    w = t.window
    if len(kl) < 2 * w or len(reward) < 2 * w:
        return None
    kl_before, kl_now = _mean(kl[-2 * w : -w]), _mean(kl[-w:])
    reward_before, reward_now = _mean(reward[-2 * w : -w]), _mean(reward[-w:])
    kl_jumped = kl_now >= t.kl_jump_factor * max(kl_before, t.kl_floor)
    if kl_jumped and reward_now - reward_before >= t.reward_jump:
        return (
            f"possible reward hacking: KL rose {kl_before:.4g} -> {kl_now:.4g} while the training reward "
            f"jumped {reward_before:.3g} -> {reward_now:.3g} (last {w} steps vs the {w} before)"
        )
    return None


def check_overfitting(rows: Sequence[Row], t: HealthThresholds) -> str | None:
    """Training reward rising while the held-out reward falls over the last `eval_points` evaluations."""
    evals, reward = series(rows, "eval_reward_mean"), series(rows, "reward_mean")
    if len(evals) < t.eval_points or not reward:
        return None
    (first_step, first_eval), (last_step, last_eval) = evals[-t.eval_points], evals[-1]
    train_then = _train_reward_at(reward, first_step, t.window)
    train_now = _train_reward_at(reward, last_step, t.window)
    if train_then is None or train_now is None:
        return None
    if first_eval - last_eval >= t.eval_drop and train_now - train_then >= t.train_rise:
        return (
            f"held-out reward fell {first_eval:.3g} -> {last_eval:.3g} while the training reward rose "
            f"{train_then:.3g} -> {train_now:.3g} (steps {first_step}-{last_step}): overfitting or reward "
            "hacking"
        )
    return None


def _train_reward_at(reward: Sequence[tuple[int, float]], step: int, window: int) -> float | None:
    """Mean training reward of the `window` points at or before `step`."""
    upto = [point for point in reward if point[0] <= step][-window:]
    return _mean(upto) if upto else None


def check_entropy_collapse(rows: Sequence[Row], t: HealthThresholds) -> str | None:
    """Recent entropy under the absolute floor or a small fraction of its initial value."""
    entropy = series(rows, "entropy")
    if len(entropy) < t.window:
        return None
    start, now = _mean(entropy[: t.window]), _mean(entropy[-t.window :])
    if now < t.entropy_floor:
        return f"entropy collapse: mean token entropy {now:.3g} nats is below {t.entropy_floor:g}"
    if len(entropy) >= 2 * t.window and now < t.entropy_ratio * start:
        return f"entropy collapse: mean token entropy fell {start:.3g} -> {now:.3g} nats"
    return None


def check_response_length(
    rows: Sequence[Row], t: HealthThresholds, max_tokens: int | None = None
) -> str | None:
    """Response length running away (towards max_tokens, or far above its start) or collapsing."""
    length = series(rows, "response_length_mean")
    if len(length) < t.window:
        return None
    start, now = _mean(length[: t.window]), _mean(length[-t.window :])
    if max_tokens and now >= t.length_limit_fraction * max_tokens:
        return f"response length runaway: mean {now:.1f} tokens is near max_tokens={max_tokens}"
    if now < t.length_min_tokens:
        return f"response length collapse: mean {now:.2g} tokens"
    if len(length) < 2 * t.window:
        return None
    if now > t.length_runaway_factor * start:
        return f"response length runaway: mean grew {start:.1f} -> {now:.1f} tokens"
    if now < t.length_collapse_ratio * start:
        return f"response length collapse: mean fell {start:.1f} -> {now:.1f} tokens"
    return None


def run_health(
    rows: Sequence[Row], thresholds: HealthThresholds | None = None, *, max_tokens: int | None = None
) -> list[str]:
    """Every warning the series triggers, in a fixed order (empty for a healthy or too short series)."""
    t = thresholds or HealthThresholds()
    found = [
        check_reward_hacking(rows, t),
        check_overfitting(rows, t),
        check_entropy_collapse(rows, t),
        check_response_length(rows, t, max_tokens),
    ]
    return [warning for warning in found if warning]
