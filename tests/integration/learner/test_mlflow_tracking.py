"""MLflow tracking against the real `mlflow` package with a file store in tmp_path (no server, no network):
the run is read back with `MlflowClient` and holds the run spec as flattened params, the versions trained
from as `rlfabric.*` tags, each step's metrics at its step, and curves.png as an artifact. Once through
`Trackers` directly (and once more to see a restart continue the same MLflow run), once through a short
SFT run of the tiny model (a world of one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.tracking import Trackers
from rlfabric.learner.tracking_mlflow import MAX_PARAM_VALUE, RUN_ID_TAG
from rlfabric.runspec import RunSpec
from rlfabric.tools.tiny_model import make_tiny_model

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture(autouse=True)
def quiet_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """No telemetry, and no tracking URI from the environment."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def tracked_spec(store: Path | None, **run: Any) -> RunSpec:
    mlflow_spec: dict[str, Any] = {"experiment": "tests", "tags": {"team": "rl"}}
    if store is not None:
        mlflow_spec["tracking_uri"] = store.as_uri()
    return RunSpec.model_validate({"tracking": {"mlflow": mlflow_spec}, **run})


def only_run(client: MlflowClient, run_id: str) -> Any:
    """The one MLflow run of the "tests" experiment, which must carry `run_id`."""
    experiment = client.get_experiment_by_name("tests")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags[RUN_ID_TAG] == run_id
    return run


def history(client: MlflowClient, run: Any, name: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}


def track(spec: RunSpec, run_dir: Path, steps: range) -> Trackers:
    trackers = Trackers.start(spec, "run-1", run_dir, dataset_version="v3-0123")
    for s in steps:
        row = {"step": s, "policy_version": s, "time": 0.0, "reward_mean": s / 4, "ids": ["a"]}
        with (run_dir / "metrics.jsonl").open("a") as out:
            out.write(json.dumps(row) + "\n")
        trackers.step(row)
        if s == 2:  # a checkpoint: the curves follow the step's row
            trackers.curves(2)
    trackers.close(steps[-1])
    return trackers


def test_trackers_mirror_params_versions_metrics_and_curves(tmp_path: Path) -> None:
    store = tmp_path / "store"
    long_prompt = "x" * (MAX_PARAM_VALUE + 50)
    spec = tracked_spec(
        store,
        model={"path": "tiny"},
        dataset={"path": "prefs/v3", "revision": "abc", "system_prompt": long_prompt},
    )
    run_dir = tmp_path / "runs" / "run-1"
    run_dir.mkdir(parents=True)
    assert track(spec, run_dir, range(1, 4)).failed == []
    assert track(spec, run_dir, range(4, 5)).failed == []  # a restart: the same MLflow run goes on

    client = MlflowClient(tracking_uri=store.as_uri())
    run = only_run(client, "run-1")
    assert history(client, run, "reward_mean") == {1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0}
    assert history(client, run, "policy_version") == {1: 1, 2: 2, 3: 3, 4: 4}
    params = run.data.params
    assert params["model.path"] == "tiny"
    assert params["train.steps"] == json.dumps(spec.train.steps)
    assert params["tracking.mlflow.experiment"] == "tests"
    assert len(params["dataset.system_prompt"]) == MAX_PARAM_VALUE
    assert params["dataset.system_prompt"].endswith("...")
    tags = run.data.tags
    assert {k: v for k, v in tags.items() if k.startswith("rlfabric.")} == {
        "rlfabric.run_id": "run-1",
        "rlfabric.mode": "online",
        "rlfabric.model": "tiny",
        "rlfabric.dataset": "prefs/v3",
        "rlfabric.dataset_revision": "abc",
        "rlfabric.dataset_version": "v3-0123",
    }
    assert tags["team"] == "rl" and tags["mlflow.runName"] == "run-1"
    assert run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["curves.png"]
    png = Path(client.download_artifacts(run.info.run_id, "curves.png", str(tmp_path / "got")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_short_sft_run_is_tracked_in_the_run_directory(tmp_path: Path) -> None:
    import torch

    from rlfabric.learner.sft_run import run_sft

    model = make_tiny_model(tmp_path / "model", tokenizer="char")
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tracked_spec(
        None,  # the default: a file store in the run directory
        mode="sft",
        output_dir=str(tmp_path / "runs"),
        model={"path": str(model), "max_model_len": 64},
        dataset={"path": str(data), "chat_template": False},
        train={"steps": 3, "groups_per_step": 4, "micro_batch_size": 4, "checkpoint_every": 2},
    )
    config = LearnerServiceConfig(run_id="sft-tracked", run=spec)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_sft(config, torch.device("cpu")) == 3
    finally:
        torch.set_num_threads(threads)

    run_dir = tmp_path / "runs" / "sft-tracked"
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    run = only_run(client, "sft-tracked")
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert history(client, run, "loss") == pytest.approx({row["step"]: row["loss"] for row in jsonl})
    assert set(history(client, run, "loss")) == {1, 2, 3}
    assert run.data.params["mode"] == "sft"
    assert run.data.tags["rlfabric.model"] == str(model)
    assert "curves.png" in [a.path for a in client.list_artifacts(run.info.run_id)]
