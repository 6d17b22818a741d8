"""The MLflow tracker (`[tracking.mlflow]` in the run spec), through `MlflowClient` (no global active run).

What lands where in the MLflow run:
- params: the run spec, flattened to dotted keys (`train.steps`, `algorithm.kl.coef`), values as JSON
  truncated to MLflow's limits; logged once, when the MLflow run is created (params never change);
- tags: `rlfabric.<name>` for each of `run_versions` (run id, mode, model, dataset, revision, version),
  and the spec's own tags;
- metrics: each step's numbers under the metrics.jsonl names, at the row's step;
- artifacts: curves.png at the artifact root (replaced at each checkpoint and at the end).

`mlflow` is imported when a tracker starts, never at module import (it takes about a second).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlfabric.runspec import MlflowSpec

TAG_PREFIX = "rlfabric."
"""Prefix of the tags that say what the run trains from (`run_versions`)."""
RUN_ID_TAG = TAG_PREFIX + "run_id"
"""The tag that finds a run's MLflow run again after a restart."""
RUN_NAME_TAG = "mlflow.runName"
"""MLflow's own tag for the run's display name."""
STORE = "mlruns"
"""The default file store's folder in the run directory."""
MAX_KEY = 250
"""MLflow's longest param or tag key (`MAX_ENTITY_KEY_LENGTH`)."""
MAX_PARAM_VALUE = 6000
"""MLflow's longest param value (`MAX_PARAM_VAL_LENGTH`)."""
MAX_TAG_VALUE = 8000
"""MLflow's longest tag value (`MAX_TAG_VAL_LENGTH`)."""
PARAMS_PER_BATCH = 100
"""Params and tags per `log_batch` call (`MAX_PARAMS_TAGS_PER_BATCH`)."""
METRICS_PER_BATCH = 1000
"""Metrics per `log_batch` call (`MAX_METRICS_PER_BATCH`)."""
TRUNCATED = "..."
"""Ends a value cut to its limit."""
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
"""MLflow 3 refuses a file store unless this is true; a spec that names one (or the default) opts in."""


def flatten(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) of a nested config; lists and empty tables are leaves."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from flatten(value, f"{name}.")
        else:
            yield name, value


def clip(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters with `TRUNCATED` at the end when longer."""
    return text if len(text) <= limit else text[: limit - len(TRUNCATED)] + TRUNCATED


def param_value(value: Any) -> str:
    """A config leaf as a param value: strings as they are, everything else as JSON."""
    text = value if isinstance(value, str) else json.dumps(value)
    return clip(text, MAX_PARAM_VALUE)


def config_params(config: dict[str, Any]) -> dict[str, str]:
    """The config's leaves as params, keys and values within MLflow's limits (None leaves left out)."""
    return {clip(key, MAX_KEY): param_value(value) for key, value in flatten(config) if value is not None}


def run_tags(spec: MlflowSpec, versions: dict[str, str]) -> dict[str, str]:
    """The MLflow run's tags: the spec's, its name and `rlfabric.<name>` for each version."""
    tags = {**spec.tags, RUN_NAME_TAG: spec.run_name or versions["run_id"]}
    tags.update({TAG_PREFIX + name: clip(value, MAX_TAG_VALUE) for name, value in versions.items()})
    return tags


def default_uri(run_dir: Path) -> str:
    """The file store in the run directory."""
    return (run_dir / STORE).resolve().as_uri()


def batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class MlflowTracker:
    """An MLflow run tagged with the run id: created on the first start, found and resumed after."""

    name = "mlflow"

    def __init__(self, spec: MlflowSpec, run_dir: Path, config: dict[str, Any], versions: dict[str, str]):
        from mlflow.tracking import MlflowClient

        uri = spec.tracking_uri or default_uri(run_dir)
        if uri.startswith("file:"):
            os.environ.setdefault(ALLOW_FILE_STORE, "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment_id = self.experiment_id(spec.experiment)
        found = self.find_run(experiment_id, versions["run_id"])
        self.run_id = found or self.create_run(experiment_id, spec, config, versions)

    def experiment_id(self, name: str) -> str:
        """The experiment's id, created when missing."""
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self.client.create_experiment(name)

    def find_run(self, experiment_id: str, run_id: str) -> str | None:
        """The MLflow run an earlier start of this run created, if any; running again."""
        runs = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1
        )
        if not runs:
            return None
        self.client.update_run(runs[0].info.run_id, status="RUNNING")
        return str(runs[0].info.run_id)

    def create_run(
        self, experiment_id: str, spec: MlflowSpec, config: dict[str, Any], versions: dict[str, str]
    ) -> str:
        """A new MLflow run with its tags, and the config as params."""
        run = self.client.create_run(experiment_id, tags=run_tags(spec, versions))
        self.log_params(run.info.run_id, config_params(config))
        return str(run.info.run_id)

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        entries = [Param(key, value) for key, value in params.items()]
        for batch in batches(entries, PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=batch)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        for batch in batches(entries, METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch)

    def log_curves(self, step: int, png: Path) -> None:
        self.client.log_artifact(self.run_id, str(png))

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
