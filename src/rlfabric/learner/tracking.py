"""Experiment trackers: rank 0's mirror of a run on Weights & Biases and MLflow (`[tracking.wandb]`,
`[tracking.mlflow]` in the run spec; the MLflow tracker is in `tracking_mlflow.py`).

A tracker receives, from `Trackers`:
- at start, the run spec as its config, with the model and dataset the run trains from (`run_versions`:
  paths, the dataset's hub revision, the preference-dataset version `rlfabric prefs build` made);
- each step, the numbers of the step's metrics.jsonl row under the names the row uses, at the row's step
  (`policy_version` among them);
- at checkpoints and at the end, curves.png rendered from metrics.jsonl (`rlfabric.local.plot`).

Tracking is a mirror, never the record (metrics.jsonl is): a tracker call that raises disables that
tracker for the rest of the run after one warning, and training goes on. A tracker the spec asks for
whose package is not installed is a configuration error at start (`require_trackers`), naming the extra.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rlfabric.learner.tracking_mlflow import MlflowTracker
from rlfabric.runspec import RunSpec, TrackingSpec, WandbSpec

log = logging.getLogger(__name__)

NOT_METRICS = ("step", "time")
"""Numeric row fields that are axes, not metrics."""
WANDB = "wandb"
"""The W&B tracker's name: its spec field, package and extra."""
MLFLOW = "mlflow"
"""The MLflow tracker's name: its spec field, package and extra."""
CURVES = "curves.png"
"""The plot of the run's curves, in the run directory (the file `rlfabric up` leaves there too)."""


class TrackingUnavailable(ValueError):
    """The spec asks for a tracker whose package is not installed."""


def require_trackers(tracking: TrackingSpec) -> None:
    """`TrackingUnavailable` unless every tracker `tracking` asks for can be imported."""
    for name, asked in ((WANDB, tracking.wandb), (MLFLOW, tracking.mlflow)):
        if asked is not None and importlib.util.find_spec(name) is None:
            raise TrackingUnavailable(
                f"tracking.{name}: the {name} package is not installed; install the extra: "
                f"pip install 'rlfabric[{name}]'"
            )


def run_versions(spec: RunSpec, run_id: str, dataset_version: str | None) -> dict[str, str]:
    """What the run trains from, by name: model and dataset paths, the dataset's revision and version."""
    found = {"run_id": run_id, "mode": spec.mode, "model": spec.model.path, "dataset": spec.dataset.path}
    if spec.model.reference_path is not None:
        found["reference_model"] = spec.model.reference_path
    if spec.dataset.revision is not None:
        found["dataset_revision"] = spec.dataset.revision
    if dataset_version is not None:
        found["dataset_version"] = dataset_version
    return found


def step_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers (bools and lists left out), `step` and `time` excepted."""
    return {
        name: value
        for name, value in row.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and name not in NOT_METRICS
    }


class Tracker(Protocol):
    """One experiment tracker's run."""

    name: str

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_curves(self, step: int, png: Path) -> None: ...

    def finish(self) -> None: ...


class WandbTracker:
    """A W&B run whose id is the run id (`resume="allow"`: a restarted learner continues it)."""

    name = WANDB

    def __init__(self, spec: WandbSpec, run_dir: Path, config: dict[str, Any], versions: dict[str, str]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            mode=spec.mode,
            id=versions["run_id"],
            name=versions["run_id"],
            resume="allow",
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            tags=[*spec.tags, versions["mode"]],
            config={**config, "rlfabric": versions},
        )

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_curves(self, step: int, png: Path) -> None:
        self.run.log({"curves": self.wandb.Image(str(png))}, step=step)

    def finish(self) -> None:
        self.run.finish()


class Trackers:
    """Rank 0's trackers (none when the spec names none: then every call is free). A tracker whose call
    raises is dropped with one warning and counted in `failed`."""

    def __init__(self, trackers: list[Tracker], run_dir: Path) -> None:
        self.active = trackers
        self.run_dir = run_dir
        self.failed: list[str] = []
        self.plots = True

    @classmethod
    def start(cls, spec: RunSpec, run_id: str, run_dir: Path, dataset_version: str | None) -> Trackers:
        """The trackers `spec.tracking` names, started (`TrackingUnavailable` if one is not installed)."""
        require_trackers(spec.tracking)
        trackers = cls([], run_dir)
        config = spec.model_dump(mode="json")
        versions = run_versions(spec, run_id, dataset_version)
        wandb_spec, mlflow_spec = spec.tracking.wandb, spec.tracking.mlflow
        if wandb_spec is not None:
            trackers.add(WANDB, lambda: WandbTracker(wandb_spec, run_dir, config, versions))
        if mlflow_spec is not None:
            trackers.add(MLFLOW, lambda: MlflowTracker(mlflow_spec, run_dir, config, versions))
        return trackers

    def add(self, name: str, start: Callable[[], Tracker]) -> None:
        """Start one tracker; one that fails to start is disabled like one that fails later."""
        try:
            self.active.append(start())
        except Exception as exc:  # a tracker is a mirror: it never stops training
            self.disable(name, "start", exc)

    def step(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row's numbers, at its step."""
        metrics = step_metrics(row)
        self.each("log metrics", lambda t: t.log_metrics(int(row["step"]), metrics))

    def curves(self, step: int) -> None:
        """curves.png rendered from metrics.jsonl now, logged at `step`."""
        png = self.plot() if self.active else None
        if png is not None:
            self.each("log curves", lambda t: t.log_curves(step, png))

    def close(self, step: int) -> None:
        """The run is over: the final curves, then every tracker finished."""
        if step > 0:
            self.curves(step)
        self.each("finish", lambda t: t.finish())
        self.active = []

    def plot(self) -> Path | None:
        """curves.png in the run directory (None without matplotlib, or once plotting failed)."""
        if not self.plots:
            return None
        from rlfabric.local.plot import plot

        try:
            return plot(self.run_dir / "metrics.jsonl", self.run_dir / CURVES)
        except Exception as exc:  # the curves are a picture for the trackers: never worth a run
            self.plots = False
            log.warning(
                "curves.png could not be rendered (%s: %s): trackers get no curves", type(exc).__name__, exc
            )
            return None

    def each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.active):
            try:
                call(tracker)
            except Exception as exc:  # a tracker is a mirror: it never stops training
                self.active.remove(tracker)
                self.disable(tracker.name, what, exc)

    def disable(self, name: str, what: str, exc: Exception) -> None:
        self.failed.append(name)
        log.warning(
            "tracker %s failed to %s (%s: %s): disabled for the rest of the run; training goes on",
            name, what, type(exc).__name__, exc,
        )  # fmt: skip
