"""The plot `rlfabric up` leaves in the run directory (`local.plot`): curves split at learner restarts,
evaluations at the step they evaluated, KL marked when it was not measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfabric.local import plot as up_plot

RESTARTED = [
    {"step": 1, "reward_mean": 0.1},
    {"step": 2, "reward_mean": 0.2},
    {"step": 3, "reward_mean": 0.3},
    {"step": 2, "event": "learner_restart", "restored_step": 2, "policy_version": 2, "time": 0.0},
    {"step": 3, "reward_mean": 0.35},
]


def test_curves_are_not_joined_across_a_learner_restart() -> None:
    assert up_plot.restart_steps(RESTARTED) == [2]
    assert up_plot.segments(RESTARTED, "reward_mean") == [[(1, 0.1), (2, 0.2), (3, 0.3)], [(3, 0.35)]]
    assert up_plot.segments(RESTARTED, "kl") == []


def test_an_evaluation_is_plotted_at_the_step_it_evaluated() -> None:
    """The evaluation of step 20's policy reaches the learner's row of step 22: it is drawn at 20."""
    rows = [
        {"step": 1, "kl": 0.0, "eval_reward_mean": 0.5, "eval_step": 0},
        {"step": 22, "kl": 0.0, "eval_reward_mean": 0.6, "eval_step": 20},
        {"step": 23, "kl": 0.0},
    ]
    assert up_plot.segments(rows, "eval_reward_mean") == [[(0, 0.5), (20, 0.6)]]
    assert up_plot.segments(rows, "kl") == [[(1, 0.0), (22, 0.0), (23, 0.0)]]
    assert not up_plot.measured(rows, "kl")
    assert up_plot.measured([{"step": 1, "kl": 0.0}, {"step": 2, "kl": 0.01}], "kl")


def test_the_plot_marks_a_learner_restart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in RESTARTED))
    assert up_plot.plot(metrics, tmp_path / "curves.png") == tmp_path / "curves.png"
    assert (tmp_path / "curves.png").stat().st_size > 0
