"""`[tracking]`: the experiment trackers (Weights & Biases, MLflow) a run is mirrored to."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlfabric.runspec.base import (
    SpecModel,
)


class WandbSpec(SpecModel):
    """A Weights & Biases run mirroring the learner's (the `wandb` extra: `pip install 'rlfabric[wandb]'`).
    Its id is the run id, so a restarted learner resumes the same W&B run (steps it already logged are
    not logged again). The API key and host come from W&B's own settings (`WANDB_API_KEY`, `wandb login`)."""

    project: str = Field(default="rlfabric", min_length=1, max_length=128)
    """W&B project."""
    entity: str | None = Field(default=None, min_length=1, max_length=128)
    """W&B user or team; None: the API key's default entity."""
    mode: Literal["online", "offline"] = "online"
    """online: stream to the W&B server; offline: write the run under the run directory's `wandb/`
    (`wandb sync` uploads it later; `WANDB_DIR` moves it)."""
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=100
    )
    """Tags of the W&B run (the run's mode is always added)."""


class MlflowSpec(SpecModel):
    """An MLflow run mirroring the learner's (the `mlflow` extra: `pip install 'rlfabric[mlflow]'`). The
    MLflow run carries the run id as its tag `rlfabric.run_id`, so a restarted learner finds and continues
    it. Credentials for a tracking server come from MLflow's own settings (`MLFLOW_TRACKING_TOKEN`, ...)."""

    tracking_uri: str | None = Field(default=None, min_length=1)
    """Where runs are recorded: a tracking server (`http://mlflow:5000`), a database (`sqlite:///...`) or a
    file store (`file:///...`); None: a file store at `mlruns/` in the run directory (`mlflow ui
    --backend-store-uri` shows it)."""
    experiment: str = Field(default="rlfabric", min_length=1, max_length=500)
    """MLflow experiment, created when missing."""
    run_name: str | None = Field(default=None, min_length=1, max_length=250)
    """Name of the MLflow run; None: the run id."""
    tags: dict[
        Annotated[str, Field(min_length=1, max_length=250)], Annotated[str, Field(max_length=8000)]
    ] = Field(default_factory=dict, max_length=100)
    """Tags of the MLflow run, besides `rlfabric.*` (what the run trains from) that are always set."""


class TrackingSpec(SpecModel):
    """Experiment trackers the learner's rank 0 mirrors the run to, besides metrics.jsonl and TensorBoard:
    the spec as config, each step's metrics, curves.png at checkpoints and at the end, and the model and
    dataset it trains from (`rlfabric.learner.tracking`). A tracker that fails is disabled with a warning;
    training goes on."""

    wandb: WandbSpec | None = None
    """Weights & Biases; None: not tracked there."""
    mlflow: MlflowSpec | None = None
    """MLflow; None: not tracked there."""
