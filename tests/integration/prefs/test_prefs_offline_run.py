"""A run trains on a preference dataset version and records it, and refuses one that does not verify:
an offline DPO run (in this process, a world of one, the tiny model) on a version written by the store
writes its id into every metrics row and checkpoint; the same run on a tampered copy stops before
training with an error naming `dataset.path`, and `rlfabric.validate` (`config check`) reports it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlfabric.data import DatasetVersionError
from rlfabric.learner.checkpoint import META, latest_complete
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.offline import run_offline
from rlfabric.prefs import store
from rlfabric.prefs.types import PrefPair
from rlfabric.validate_data import check_dataset


@pytest.fixture(scope="module")
def version(tmp_path_factory: pytest.TempPathFactory) -> store.Written:
    rows = [PrefPair(f"is {i} a number?", "yes", "no", {"row": i}) for i in range(8)]
    fields = {"name": "yes-no", "pipeline": {"text": "", "sha256": ""}, "parents": []}
    return store.write_version(tmp_path_factory.mktemp("prefs"), rows, fields=fields, report={}, shard_rows=3)


def config(model_dir: Path, data: Path, out: Path) -> LearnerServiceConfig:
    run = {
        "mode": "offline_preference",
        "output_dir": str(out),
        "model": {"path": str(model_dir), "max_model_len": 64},
        "dataset": {"path": str(data), "shuffle_seed": 3},
        "optim": {"lr": 2e-3},
        "train": {"steps": 2, "groups_per_step": 2, "micro_batch_size": 2, "checkpoint_every": 2},
    }
    return LearnerServiceConfig.model_validate({"run_id": "dpo", "run": run})


def run_here(cfg: LearnerServiceConfig) -> int:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_offline(cfg, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


def test_a_run_records_the_version_it_trained_on(
    tiny_model_dir: Path, version: store.Written, tmp_path: Path
) -> None:
    assert run_here(config(tiny_model_dir, version.path, tmp_path)) == 2
    rows = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["dataset_version"] for r in rows] == [version.id, version.id]
    latest = latest_complete(tmp_path / "dpo" / "checkpoints")
    assert latest is not None
    extra = json.loads((latest / META).read_text())["extra"]
    assert extra["dataset_version"]["str"] == version.id


def test_a_run_refuses_a_version_that_does_not_verify(
    tiny_model_dir: Path, version: store.Written, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(version.path, tmp_path / "tampered"))
    shard = copy / "data" / "shard-00001.jsonl"
    shard.chmod(0o644)
    shard.write_text(shard.read_text().replace('"yes"', '"no!"', 1))
    cfg = config(tiny_model_dir, copy, tmp_path / "out")
    with pytest.raises(DatasetVersionError, match=r"^dataset.path .*does not verify.*shard-00001"):
        run_here(cfg)
    assert not (tmp_path / "out" / "dpo" / "metrics.jsonl").exists()
    issues = check_dataset(cfg.run).issues
    assert [(i.field, i.kind) for i in issues] == [("dataset.path", "unverified")]
    assert check_dataset(config(tiny_model_dir, version.path, tmp_path).run).issues == []
