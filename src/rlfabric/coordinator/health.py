"""Run-health warnings read off a run's metrics series (pure functions, no I/O).

Each check looks at the rows the learner appends per step (`reward_mean`, `kl`, `entropy`,
`response_length_mean`, and the sparse `eval_reward_mean` of held-out evaluations) and returns a warning
string when the series shows a known failure pattern of RL post-training:

- reward hacking: KL to the reference and the training reward jump together;
- reward collapse: the training reward fell far below its best window;
- no learning signal: nearly every group gave all its samples one reward while the reward did not rise;
- overfitting: the training reward rises while the held-out reward falls;
- over-optimisation (runs with a gold reward, `dataset.eval.reward`): the held-out gold reward fell from
  its peak while the proxy (the run's own reward) on the same evaluations kept rising; its warning's
  `since_step` is the step after the peak's policy, so an automatic stop keeps the last checkpoint at or
  before the gold peak;
- entropy collapse: the policy became (nearly) deterministic;
- response length runaway or collapse: completions grow towards the limit or shrink to nothing;
- rollout mismatch: the engine's and the trainer's token distributions drift apart (`rollout_mismatch_kl`:
  samples too stale for the learning rate, or an engine/trainer precision gap).

Recent values are means over the last `window` rows, so that one noisy step does not warn.

Two liveness checks look at the running system instead of the series (`liveness.py` gathers their inputs
from Redis when a run's status is read, so they warn within `LEARNER_STALL_S` plus the registry's TTL):

- the learner stopped consuming: groups wait in the stream, yet no step came and no learner read the
  stream for `LEARNER_STALL_S` (a dead or hung learner);
- no learner consumes: nothing waits, yet no learner read the stream (or, offline, stepped) for as long;
- no replica serves: no rollout replica of the run is registered (each one's entry expires three missed
  heartbeats after it stops; a replica registers only once its model loaded).

`checks.py` probes what is not in Redis (the reward service answers, the model loads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from rlfabric.runspec import HealthCheck, HealthSpec, RunSpec
from rlfabric.runspec import HealthThresholds as HealthThresholds

Row = dict[str, Any]
HEALTH_ROWS = 500
"""Metrics rows (the most recent) the health checks look at."""
LEARNER_STALL_S = 25.0
"""Seconds without a step and without a learner read of the stream, while groups wait, after which the
learner counts as stopped (below 30 s, so that a status read warns within 30 s of the stop). A learner
step that takes longer than this on a big model also warns, until the step ends."""


@dataclass(frozen=True)
class HealthWarning:
    """One triggered check: which, what it saw, and the first step of the window that shows it."""

    check: HealthCheck
    message: str
    since_step: int


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


def check_reward_hacking(rows: Sequence[Row], t: HealthThresholds) -> HealthWarning | None:
    """KL and reward jumping together between the last two windows."""
    kl, reward = series(rows, "kl"), series(rows, "reward_mean")
    w = t.window
    if len(kl) < 2 * w or len(reward) < 2 * w:
        return None
    kl_before, kl_now = _mean(kl[-2 * w : -w]), _mean(kl[-w:])
    reward_before, reward_now = _mean(reward[-2 * w : -w]), _mean(reward[-w:])
    kl_jumped = kl_now >= t.kl_jump_factor * max(kl_before, t.kl_floor)
    if kl_jumped and reward_now - reward_before >= t.reward_jump:
        message = (
            f"possible reward hacking: KL rose {kl_before:.4g} -> {kl_now:.4g} while the training reward "
            f"jumped {reward_before:.3g} -> {reward_now:.3g} (last {w} steps vs the {w} before)"
        )
        return HealthWarning("reward_hacking", message, kl[-w][0])
    return None


def check_reward_collapse(rows: Sequence[Row], t: HealthThresholds) -> HealthWarning | None:
    """The last window's training reward at least `reward_collapse_drop` below the best window before it:
    a policy that had learned and lost it (a step too large, samples too stale, a broken scorer). KL and
    entropy need not move (the agentic example at lr 1e-3 fell from 0.9 to 0 with rising entropy).
    `since_step` is the first step after the best window: checkpoints up to it hold the better policy."""
    reward, w = series(rows, "reward_mean"), t.window
    if len(reward) < 2 * w:
        return None
    now = _mean(reward[-w:])
    windows = [(_mean(reward[i : i + w]), i) for i in range(len(reward) - 2 * w + 1)]  # all before the last
    best, start = max(windows, key=lambda window: (window[0], -window[1]))  # the first of equal bests
    if best - now < t.reward_collapse_drop:
        return None
    message = (
        f"reward collapse: the training reward fell {best:.3g} -> {now:.3g} (steps {reward[start][0]}-"
        f"{reward[start + w - 1][0]} vs the last {w}); the policy of the best steps is the one to keep"
    )
    return HealthWarning("reward_collapse", message, reward[start + w][0])


def check_no_signal(rows: Sequence[Row], t: HealthThresholds) -> HealthWarning | None:
    """At least `no_signal_fraction` of the last window's groups gave every sample the same reward while
    the training reward has not risen by `no_signal_rise` since the first window: a group estimator has
    had nothing to learn from (prompts too hard for the policy, a reward that cannot tell its samples
    apart). Uniform groups at a reward that rose are a solved task and stay quiet (the demo's end)."""
    uniform, reward, w = series(rows, "uniform_reward_groups_fraction"), series(rows, "reward_mean"), t.window
    if len(uniform) < w or len(reward) < 2 * w:
        return None
    share, first, now = _mean(uniform[-w:]), _mean(reward[:w]), _mean(reward[-w:])
    if share < t.no_signal_fraction or now - first >= t.no_signal_rise:
        return None
    message = (
        f"no learning signal: {share:.0%} of the last {w} steps' groups gave every sample the same reward "
        f"and the training reward has not risen ({first:.3g} at steps {reward[0][0]}-{reward[w - 1][0]}, "
        f"{now:.3g} now): the prompts may be too hard for the policy, or the reward may not tell its "
        "samples apart (a warm start, easier prompts, a reward with partial credit)"
    )
    return HealthWarning("no_signal", message, uniform[-w][0])


def check_overfitting(rows: Sequence[Row], t: HealthThresholds) -> HealthWarning | None:
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
        message = (
            f"held-out reward fell {first_eval:.3g} -> {last_eval:.3g} while the training reward rose "
            f"{train_then:.3g} -> {train_now:.3g} (steps {first_step}-{last_step}): overfitting or reward "
            "hacking"
        )
        return HealthWarning("overfitting", message, first_step)
    return None


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation as the metrics rows carry it (`eval_*` keys of the row the learner wrote
    after it): the evaluated `step` (`eval_step`, else the row's), its `policy_version` (the lowest sampled;
    = the learner step that produced it), the `proxy` (the run's own reward, `eval_reward_mean`), the
    `gold` reward (`eval_gold_reward_mean`; None without one) and `kl`, the learner's mean KL to the
    reference in the row of the evaluated step (else in the row that carries the evaluation; None when
    neither has one)."""

    step: int
    policy_version: int
    proxy: float | None
    gold: float | None
    kl: float | None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def evaluated_step(row: Row, own: int) -> int:
    """The step whose policy a row's evaluation scored: `eval_step`, else the row's own step `own` (the
    learner writes an evaluation into a later row than the step it evaluated)."""
    return int(row["eval_step"]) if _number(row.get("eval_step")) is not None else own


def evaluations(rows: Sequence[Row]) -> list[Evaluation]:
    """Every evaluation the rows carry (a row with `eval_reward_mean` or `eval_gold_reward_mean`), in row
    order."""
    kl_at = {int(row["step"]): _number(row.get("kl")) for row in rows if "step" in row}
    found = []
    for index, row in enumerate(rows):
        proxy, gold = _number(row.get("eval_reward_mean")), _number(row.get("eval_gold_reward_mean"))
        if proxy is None and gold is None:
            continue
        step = evaluated_step(row, int(row.get("step", index)))
        version = _number(row.get("eval_policy_version"))
        kl = kl_at.get(step)
        kl = _number(row.get("kl")) if kl is None else kl
        found.append(Evaluation(step, step if version is None else int(version), proxy, gold, kl))
    return found


def check_overoptimization(rows: Sequence[Row], t: HealthThresholds) -> HealthWarning | None:
    """The gold reward at least `gold_drop` below its peak in each of the last `gold_patience` evaluations
    while the proxy reward of those evaluations rose (on average, by more than `proxy_rise`) above its value
    at the peak. `since_step` is one past the peak's policy version: checkpoints before it are at or before
    the gold peak."""
    evals = [(e, e.gold, e.proxy) for e in evaluations(rows) if e.gold is not None and e.proxy is not None]
    if len(evals) <= t.gold_patience:
        return None
    peak_index = max(range(len(evals)), key=lambda i: (evals[i][1], -i))  # the first of equal peaks
    if peak_index >= len(evals) - t.gold_patience:
        return None  # the peak is among the recent evaluations
    peak, peak_gold, peak_proxy = evals[peak_index]
    recent = evals[-t.gold_patience :]
    gold_now, proxy_now = [g for _, g, _ in recent], [p for _, _, p in recent]
    if max(gold_now) > peak_gold - t.gold_drop or fmean(proxy_now) - peak_proxy <= t.proxy_rise:
        return None
    first, last = recent[0][0], recent[-1][0]
    message = (
        f"reward over-optimisation: the gold reward fell {peak_gold:.3g} -> {gold_now[-1]:.3g} from its peak "
        f"at step {peak.policy_version} while the proxy reward rose {peak_proxy:.3g} -> {proxy_now[-1]:.3g} "
        f"(last {t.gold_patience} evaluations, steps {first.step}-{last.step}); the policy at the gold peak "
        "is the one to keep"
    )
    return HealthWarning("overoptimization", message, peak.policy_version + 1)


def _train_reward_at(reward: Sequence[tuple[int, float]], step: int, window: int) -> float | None:
    """Mean training reward of the `window` points at or before `step`."""
    upto = [point for point in reward if point[0] <= step][-window:]
    return _mean(upto) if upto else None


def check_entropy_collapse(rows: Sequence[Row], t: HealthThresholds) -> HealthWarning | None:
    """Recent entropy under the absolute floor or a small fraction of its initial value."""
    entropy = series(rows, "entropy")
    if len(entropy) < t.window:
        return None
    start, now = _mean(entropy[: t.window]), _mean(entropy[-t.window :])
    since = entropy[-t.window][0]
    if now < t.entropy_floor:
        message = f"entropy collapse: mean token entropy {now:.3g} nats is below {t.entropy_floor:g}"
        return HealthWarning("entropy_collapse", message, since)
    if len(entropy) >= 2 * t.window and now < t.entropy_ratio * start:
        message = f"entropy collapse: mean token entropy fell {start:.3g} -> {now:.3g} nats"
        return HealthWarning("entropy_collapse", message, since)
    return None


@dataclass(frozen=True)
class LengthLimit:
    """The most tokens a trained response can hold, and the setting that makes it so (the warning names
    it)."""

    tokens: int
    setting: str


def length_limit(spec: RunSpec) -> LengthLimit | None:
    """What bounds a run's `response_length_mean`. Single-turn: the completion, `rollout.sampling.max_tokens`.
    Multi-turn: the whole trajectory after the prompt, model and environment turns together, where
    `max_tokens` bounds each model turn of several: `environment.max_total_tokens`, or None when that is 0
    (the prompt's length decides what `model.max_model_len` leaves; only the relative checks apply)."""
    if spec.environment is None:
        return LengthLimit(spec.rollout.sampling.max_tokens, "rollout.sampling.max_tokens")
    total = spec.environment.max_total_tokens
    return LengthLimit(total, "environment.max_total_tokens") if total else None


def check_response_length(
    rows: Sequence[Row], t: HealthThresholds, limit: LengthLimit | None = None
) -> HealthWarning | None:
    """Response length running away (towards its `limit`, or far above its start) or collapsing."""
    length = series(rows, "response_length_mean")
    if len(length) < t.window:
        return None
    message = _length_problem(length, t, limit)
    return HealthWarning("response_length", message, length[-t.window][0]) if message else None


def _length_problem(
    length: Sequence[tuple[int, float]], t: HealthThresholds, limit: LengthLimit | None
) -> str | None:
    start, now = _mean(length[: t.window]), _mean(length[-t.window :])
    if limit is not None and now >= t.length_limit_fraction * limit.tokens:
        return f"response length runaway: mean {now:.1f} tokens is near {limit.setting}={limit.tokens}"
    if now < t.length_min_tokens:
        return f"response length collapse: mean {now:.2g} tokens"
    if len(length) < 2 * t.window:
        return None
    if now > t.length_runaway_factor * start:
        return f"response length runaway: mean grew {start:.1f} -> {now:.1f} tokens"
    if now < t.length_collapse_ratio * start:
        return f"response length collapse: mean fell {start:.1f} -> {now:.1f} tokens"
    return None


def check_rollout_mismatch(rows: Sequence[Row], t: HealthThresholds) -> HealthWarning | None:
    """Recent engine/trainer mismatch above the absolute bound, or drifted far above its start."""
    mismatch = series(rows, "rollout_mismatch_kl")
    if len(mismatch) < t.window:
        return None
    start, now = _mean(mismatch[: t.window]), _mean(mismatch[-t.window :])
    since = mismatch[-t.window][0]
    if now > t.mismatch_kl_max:
        message = (
            f"rollout mismatch: engine and trainer disagree by {now:.3g} nats/token of KL (above "
            f"{t.mismatch_kl_max:g}); samples may be too stale for the learning rate (max_staleness, "
            "algorithm.rollout_correction, algorithm.rollout_trust_kl)"
        )
        return HealthWarning("rollout_mismatch", message, since)
    drifted = len(mismatch) >= 2 * t.window and now >= t.mismatch_floor
    if drifted and now > t.mismatch_drift_factor * start:
        message = f"rollout mismatch drifting: engine/trainer KL rose {start:.3g} -> {now:.3g} nats/token"
        return HealthWarning("rollout_mismatch", message, since)
    return None


def health_warnings(
    rows: Sequence[Row], thresholds: HealthThresholds | None = None, *, limit: LengthLimit | None = None
) -> list[HealthWarning]:
    """Every check the series triggers, in a fixed order (empty for a healthy or too short series)."""
    t = thresholds or HealthThresholds()
    found = [
        check_reward_hacking(rows, t),
        check_reward_collapse(rows, t),
        check_no_signal(rows, t),
        check_overfitting(rows, t),
        check_entropy_collapse(rows, t),
        check_response_length(rows, t, limit),
        check_rollout_mismatch(rows, t),
        check_overoptimization(rows, t),
    ]
    return [warning for warning in found if warning]


def run_health(
    rows: Sequence[Row], thresholds: HealthThresholds | None = None, *, limit: LengthLimit | None = None
) -> list[str]:
    """The messages of `health_warnings`."""
    return [w.message for w in health_warnings(rows, thresholds, limit=limit)]


def stopping_warning(
    rows: Sequence[Row], spec: HealthSpec, *, limit: LengthLimit | None = None
) -> HealthWarning | None:
    """The first triggered check the spec stops the run for, if any."""
    stops = set(spec.auto_stop)
    return next((w for w in health_warnings(rows, spec, limit=limit) if w.check in stops), None)


def last_good_checkpoint(rows: Sequence[Row], since_step: int, keep: int) -> int | None:
    """The newest checkpoint step before `since_step` among the `keep` newest the learner still holds
    (rows carry `checkpoint_step` on the steps that wrote one); None when none qualifies."""
    steps = sorted({int(p[1]) for p in series(rows, "checkpoint_step")})[-keep:]
    good = [step for step in steps if step < since_step]
    return good[-1] if good else None


def check_learner_stalled(
    waiting_groups: int,
    since_step_s: float | None,
    learner_idle_s: float | None,
    run_age_s: float,
    stall_s: float = LEARNER_STALL_S,
) -> str | None:
    """The learner stopped consuming: `waiting_groups` > 0 groups wait in the stream, the last step is
    `since_step_s` old (None: no step yet, the run's age counts) and the learner's last read of the stream
    `learner_idle_s` (None: no learner ever read it), both at least `stall_s`."""
    quiet_s = run_age_s if since_step_s is None else since_step_s
    idle_s = run_age_s if learner_idle_s is None else learner_idle_s
    if waiting_groups <= 0 or min(quiet_s, idle_s) < stall_s:
        return None
    step = "no learner step yet" if since_step_s is None else f"no learner step for {since_step_s:.0f} s"
    return (
        f"learner stopped consuming: {step} and no read of the stream for {idle_s:.0f} s while "
        f"{waiting_groups} group(s) wait (is the learner running? a live one that hangs ends itself after "
        "its stall_timeout_s and is restarted; `kill -USR1 PID` writes where it waits to its log)"
    )


def check_no_learner(
    since_step_s: float | None,
    learner_idle_s: float | None,
    run_age_s: float,
    stall_s: float = LEARNER_STALL_S,
) -> str | None:
    """No learner consumes the run while nothing waits for it: no step for `stall_s` (None: no step yet,
    the run's age counts) and no read of the stream for as long (None: no learner ever read it; an
    offline run's learner reads none, so only its steps count). A waiting learner reads every second."""
    quiet_s = run_age_s if since_step_s is None else since_step_s
    idle_s = run_age_s if learner_idle_s is None else learner_idle_s
    if min(quiet_s, idle_s) < stall_s:
        return None
    if learner_idle_s is None:
        return (
            f"no learner consumes the run: none has read its stream or reported a step in {idle_s:.0f} s "
            "(is the learner running, and does it load the model?)"
        )
    return f"no learner consumes the run: no read of its stream for {idle_s:.0f} s (is the learner running?)"


def check_no_replica(registered: int, model: str = "") -> str | None:
    """No rollout replica is registered for the run, so nothing generates."""
    if registered > 0:
        return None
    serving = f" of model {model!r}" if model else ""
    return (
        f"no rollout replica serves the run: none is registered (none sent a heartbeat lately; is a "
        f"replica{serving} running, and does it load the model?)"
    )
