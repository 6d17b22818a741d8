"""The over-optimisation check on synthetic metrics series (rows as the learner writes them: the held-out
evaluation's `eval_*` keys on the row after it), the evaluations it reads, and their readers: the status
summary, `rlfabric runs status` and the plot's KL curve."""

from __future__ import annotations

from typing import Any

from rlfabric.coordinator.api import evaluation_summary
from rlfabric.coordinator.health import (
    HealthThresholds,
    check_overoptimization,
    evaluations,
    health_warnings,
    last_good_checkpoint,
    stopping_warning,
)
from rlfabric.coordinator.runs_cli import evaluation_text
from rlfabric.local.plot import kl_curve
from rlfabric.runspec import HealthSpec

T = HealthThresholds()  # gold_drop 0.05, gold_patience 2, proxy_rise 0


def run_rows(
    gold: list[float], proxy: list[float], every: int = 5, kl_coef: bool = True
) -> list[dict[str, Any]]:
    """One row per step; an evaluation every `every` steps (its keys land on the next step's row, as the
    learner pops them); KL grows 0.01 a step; a checkpoint every 5 steps."""
    rows: list[dict[str, Any]] = []
    steps = every * len(gold) + 1
    for step in range(1, steps + 1):
        row: dict[str, Any] = {"step": step, "policy_version": step, "kl": 0.01 * step if kl_coef else 0.0}
        if step % 5 == 0:
            row["checkpoint_step"] = step
        done = (step - 1) // every - 1
        if step > 1 and (step - 1) % every == 0 and done < len(gold):
            evaluated = step - 1
            row.update(eval_step=evaluated, eval_policy_version=evaluated)
            row.update(eval_reward_mean=proxy[done], eval_gold_reward_mean=gold[done])
        rows.append(row)
    return rows


GOLD = [0.2, 0.4, 0.6, 0.5, 0.45]  # peak at the 3rd evaluation (step 15)
PROXY = [0.1, 0.5, 1.0, 1.5, 2.0]


def test_evaluations_read_the_rows_as_the_learner_writes_them() -> None:
    evals = evaluations(run_rows(GOLD, PROXY))
    assert [e.step for e in evals] == [5, 10, 15, 20, 25]
    assert [e.gold for e in evals] == GOLD and [e.proxy for e in evals] == PROXY
    assert [e.kl for e in evals] == [0.05, 0.1, 0.15, 0.2, 0.25]  # the KL of the evaluated step's row
    old = [{"step": 1, "kl": 0.5, "eval_reward_mean": 0.3, "eval_policy_version": 0}]  # no eval_step
    assert (
        evaluations(old)[0].step == 1 and evaluations(old)[0].kl == 0.5 and evaluations(old)[0].gold is None
    )


def test_gold_falling_while_the_proxy_rises_warns_at_the_gold_peak() -> None:
    rows = run_rows(GOLD, PROXY)
    warning = check_overoptimization(rows, T)
    assert warning is not None and warning.check == "overoptimization"
    assert "0.6 -> 0.45" in warning.message and "peak at step 15" in warning.message
    assert warning.since_step == 16  # checkpoints before it are at or before the gold peak
    assert last_good_checkpoint(rows, warning.since_step, keep=3) == 15  # kept: 15, 20, 25
    assert last_good_checkpoint(rows, warning.since_step, keep=2) is None  # 15 already pruned
    assert [w.check for w in health_warnings(rows, T)] == ["overoptimization"]


def test_no_warning_without_a_lasting_drop_or_a_rising_proxy_or_a_gold_reward() -> None:
    assert check_overoptimization(run_rows(GOLD[:4], PROXY[:4]), T) is None  # one evaluation past the peak
    assert check_overoptimization(run_rows([0.2, 0.4, 0.6, 0.58, 0.57], PROXY), T) is None  # within gold_drop
    assert check_overoptimization(run_rows([0.2, 0.4, 0.6, 0.5, 0.56], PROXY), T) is None  # one recovered
    falling_proxy = [0.1, 0.5, 1.0, 0.9, 0.8]  # both fall: not over-optimisation
    assert check_overoptimization(run_rows(GOLD, falling_proxy), T) is None
    strict = HealthThresholds(proxy_rise=1.0)  # proxy rose 1.0 -> 1.75 on average: not by more than 1
    assert check_overoptimization(run_rows(GOLD, PROXY), strict) is None
    patient = HealthThresholds(gold_patience=3)
    assert check_overoptimization(run_rows(GOLD, PROXY), patient) is None
    rising = [0.2, 0.4, 0.6, 0.7, 0.8]
    assert check_overoptimization(run_rows(rising, PROXY), T) is None
    no_gold = [{k: v for k, v in r.items() if k != "eval_gold_reward_mean"} for r in run_rows(GOLD, PROXY)]
    assert check_overoptimization(no_gold, T) is None


def test_auto_stop_picks_overoptimization() -> None:
    rows = run_rows(GOLD, PROXY)
    assert stopping_warning(rows, HealthSpec(auto_stop=["reward_hacking"])) is None
    warning = stopping_warning(rows, HealthSpec(auto_stop=["overoptimization"]))
    assert warning is not None and warning.since_step == 16


def test_status_summary_and_its_text() -> None:
    summary = evaluation_summary(run_rows(GOLD, PROXY))
    assert summary is not None
    assert (summary.step, summary.reward, summary.gold_reward, summary.kl) == (25, 2.0, 0.45, 0.25)
    assert (summary.gold_peak, summary.gold_peak_step) == (0.6, 15)
    text = evaluation_text(summary.model_dump())
    assert text == "evaluation: step 25, reward 2, gold reward 0.45 (peak 0.6 at step 15), kl 0.25"
    no_gold = [{k: v for k, v in r.items() if k != "eval_gold_reward_mean"} for r in run_rows(GOLD, PROXY)]
    plain = evaluation_summary(no_gold)
    assert plain is not None and plain.gold_reward is None and plain.gold_peak is None
    assert evaluation_text(plain.model_dump()) == "evaluation: step 25, reward 2, kl 0.25"
    assert evaluation_summary([{"step": 1, "kl": 0.1}]) is None


def test_the_plot_curve_is_against_kl_or_the_step_without_one() -> None:
    label, points = kl_curve(run_rows(GOLD, PROXY))
    assert label == "KL to the reference"
    assert points[2] == (0.15, 1.0, 0.6)
    label, points = kl_curve(run_rows(GOLD, PROXY, kl_coef=False))
    assert label.startswith("step") and [p[0] for p in points] == [5.0, 10.0, 15.0, 20.0, 25.0]
