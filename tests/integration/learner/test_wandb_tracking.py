"""Weights & Biases tracking against the real `wandb` package in offline mode (no network): the run files
it writes are read back (their records are protobuf `Record`s in a LevelDB-style log) and hold the run
spec as config, the versions trained from, each step's metrics at its step, and the curves image. Once
through `Trackers` directly, once through a short SFT run of the tiny model (a world of one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.tracking import Trackers
from rlfabric.runspec import RunSpec
from rlfabric.tools.tiny_model import make_tiny_model

wandb = pytest.importorskip("wandb")

HEADER = 7
"""A run file's header: b":W&B", a magic number and a version."""
BLOCK = 32768
"""Records are chunked into blocks of this size, each chunk behind a 7-byte header (crc, length, type)."""
FULL, LAST = 1, 4


@dataclass
class OfflineRun:
    """What a W&B offline run file holds, read back."""

    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)


def chunks(raw: bytes) -> Iterator[bytes]:
    """The records of a W&B run file (the LevelDB log format), joined from their chunks."""
    pos, record = HEADER, b""
    while pos + 7 <= len(raw):
        left = BLOCK - pos % BLOCK
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # block trailer or padding
            pos += left
            continue
        record += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            yield record
            record = b""


def history_key(item: Any) -> str:
    """A history item's name: `key`, or its `nested_key` parts joined with "/" (an image's fields)."""
    return item.key or "/".join(item.nested_key)


def read_offline_run(wandb_dir: Path) -> OfflineRun:
    """The run file, once complete: `run.finish()` returns before W&B's service process has written the
    file's last block, so the service is shut down first (which flushes it)."""
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()
    (path,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    run = OfflineRun()
    for data in chunks(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.tags = list(record.run.tags)
            run.config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run.config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run.history.append({history_key(i): json.loads(i.value_json) for i in record.history.item})
    return run


def metric(run: OfflineRun, name: str) -> dict[int, Any]:
    """Each logged value of `name`, by step."""
    return {row["_step"]: row[name] for row in run.history if name in row}


@pytest.fixture
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B offline and silent, every file it writes under tmp_path; its service process shut down after."""
    home = tmp_path / "wandb-home"
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield tmp_path
    wandb.teardown()


def tracked_spec(**run: Any) -> RunSpec:
    tracking = {"wandb": {"project": "tests", "mode": "offline", "tags": ["nightly"]}}
    return RunSpec.model_validate({"tracking": tracking, **run})


def test_trackers_mirror_config_versions_metrics_and_curves(wandb_dir: Path) -> None:
    spec = tracked_spec(model={"path": "tiny"}, dataset={"path": "prefs/v3", "revision": "abc"})
    run_dir = wandb_dir / "runs" / "run-1"
    run_dir.mkdir(parents=True)
    trackers = Trackers.start(spec, "run-1", run_dir, dataset_version="v3-0123")
    rows = [
        {"step": s, "policy_version": s, "time": 0.0, "reward_mean": s / 4, "ids": ["a"]} for s in (1, 2, 3)
    ]
    for row in rows:
        (run_dir / "metrics.jsonl").open("a").write(json.dumps(row) + "\n")
        trackers.step(row)
        if row["step"] == 2:  # a checkpoint: the curves follow the step's row
            trackers.curves(2)
    trackers.close(3)
    assert trackers.failed == []

    run = read_offline_run(wandb_dir)
    assert metric(run, "reward_mean") == {1: 0.25, 2: 0.5, 3: 0.75}
    assert metric(run, "policy_version") == {1: 1, 2: 2, 3: 3}
    assert set(metric(run, "curves/path")) == {2, 3}
    assert run.config["model"]["path"] == "tiny"
    assert run.config["tracking"]["wandb"]["project"] == "tests"
    versions = run.config["rlfabric"]
    assert versions == {
        "run_id": "run-1",
        "mode": "online",
        "model": "tiny",
        "dataset": "prefs/v3",
        "dataset_revision": "abc",
        "dataset_version": "v3-0123",
    }
    assert set(run.tags) == {"nightly", "online"}
    assert list(wandb_dir.glob("wandb/offline-run-*/files/media/images/curves_*.png"))


def test_a_short_sft_run_is_tracked(wandb_dir: Path) -> None:
    import torch

    from rlfabric.learner.sft_run import run_sft

    model = make_tiny_model(wandb_dir / "model", tokenizer="char")
    data = wandb_dir / "sft.jsonl"
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tracked_spec(
        mode="sft",
        output_dir=str(wandb_dir / "runs"),
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

    run = read_offline_run(wandb_dir)
    jsonl = [json.loads(line) for line in (wandb_dir / "runs" / "sft-tracked" / "metrics.jsonl").open()]
    assert metric(run, "loss") == {row["step"]: row["loss"] for row in jsonl}
    assert set(metric(run, "loss")) == {1, 2, 3}
    assert set(metric(run, "curves/path")) == {2, 3}  # the checkpoint at step 2, the end at step 3
    assert run.config["mode"] == "sft"
    assert run.config["rlfabric"]["model"] == str(model)
