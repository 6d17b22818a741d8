"""The trackers' mirror rules without a tracker package: which row fields are metrics, a failing tracker
is disabled once and training goes on, a tracker asked for but not installed is a config error, and what
the MLflow tracker makes of the spec (params within MLflow's limits, tags)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest

from rlfabric.learner import tracking
from rlfabric.learner.tracking import Trackers, TrackingUnavailable, require_trackers, step_metrics
from rlfabric.learner.tracking_mlflow import MAX_KEY, MAX_PARAM_VALUE, config_params, run_tags
from rlfabric.runspec import RunSpec


class Recorder:
    """A tracker that records its calls, or raises on every call once `broken`."""

    def __init__(self, name: str, broken: bool = False) -> None:
        self.name, self.broken = name, broken
        self.calls: list[tuple[str, Any]] = []

    def record(self, call: str, value: Any) -> None:
        if self.broken:
            raise ConnectionError("tracker unreachable")
        self.calls.append((call, value))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.record("metrics", (step, metrics))

    def log_curves(self, step: int, png: Path) -> None:
        self.record("curves", (step, png.name))

    def finish(self) -> None:
        self.record("finish", None)


def spec(**tracking: Any) -> RunSpec:
    return RunSpec.model_validate({"model": {"path": "m"}, "dataset": {"path": "d"}, "tracking": tracking})


def test_step_metrics_are_the_rows_numbers_but_the_axes() -> None:
    row = {"step": 3, "time": 1.5, "loss": 0.5, "policy_version": 4, "pair_ids": ["1"], "flag": True}
    assert step_metrics(row) == {"loss": 0.5, "policy_version": 4}


def test_a_failing_tracker_is_disabled_once_and_the_others_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad = Recorder("good"), Recorder("bad", broken=True)
    trackers = Trackers([good, bad], tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    with caplog.at_level(logging.WARNING, logger=tracking.__name__):
        for step in (1, 2):
            trackers.step({"step": step, "loss": 1.0 / step})
        trackers.close(2)
    assert trackers.failed == ["bad"]
    assert len([r for r in caplog.records if "tracker bad failed" in r.getMessage()]) == 1
    assert good.calls == [
        ("metrics", (1, {"loss": 1.0})),
        ("metrics", (2, {"loss": 0.5})),
        ("curves", (2, "curves.png")),
        ("finish", None),
    ]
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_a_tracker_that_fails_to_start_is_disabled(tmp_path: Path) -> None:
    def refuse() -> Recorder:
        raise PermissionError("no API key")

    trackers = Trackers([], tmp_path)
    trackers.add("wandb", refuse)
    trackers.step({"step": 1, "loss": 1.0})
    assert (trackers.active, trackers.failed) == ([], ["wandb"])


def test_no_tracker_asked_for_costs_nothing(tmp_path: Path) -> None:
    trackers = Trackers.start(spec(), "run", tmp_path, None)
    trackers.step({"step": 1, "loss": 1.0})
    trackers.close(1)
    assert not (tmp_path / "curves.png").exists()


def test_a_tracker_asked_for_but_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(TrackingUnavailable, match=r"tracking\.wandb.*rlfabric\[wandb\]"):
        require_trackers(spec(wandb={"mode": "offline"}).tracking)


def test_the_spec_refuses_unknown_tracker_keys() -> None:
    with pytest.raises(ValueError, match="api_key"):
        spec(wandb={"api_key": "secret"})


def test_mlflow_asked_for_but_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name))
    require_trackers(spec(wandb={"mode": "offline"}).tracking)
    with pytest.raises(TrackingUnavailable, match=r"tracking\.mlflow.*rlfabric\[mlflow\]"):
        require_trackers(spec(mlflow={}).tracking)


def test_mlflow_params_are_the_flattened_spec_within_mlflows_limits() -> None:
    config = {"train": {"steps": 3, "lr": None}, "tags": ["a"], "empty": {}, "k" * 300: "v" * 7000}
    params = config_params(config)
    assert params["train.steps"] == "3" and params["tags"] == '["a"]' and params["empty"] == "{}"
    assert "train.lr" not in params  # unset leaves are not params
    (long_key,) = (key for key in params if key.startswith("kk"))
    assert len(long_key) == MAX_KEY and len(params[long_key]) == MAX_PARAM_VALUE
    assert params[long_key].endswith("...")


def test_mlflow_tags_say_what_the_run_trains_from() -> None:
    run = spec(mlflow={"tags": {"team": "rl"}})
    assert run.tracking.mlflow is not None
    tags = run_tags(run.tracking.mlflow, tracking.run_versions(run, "r-1", "v3"))
    assert tags == {
        "team": "rl",
        "mlflow.runName": "r-1",
        "rlfabric.run_id": "r-1",
        "rlfabric.mode": "online",
        "rlfabric.model": "m",
        "rlfabric.dataset": "d",
        "rlfabric.dataset_version": "v3",
    }
