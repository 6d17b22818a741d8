"""`rlfabric.validate` and `rlfabric config check`: every broken run file of issue 20 (a misspelt
scorer, unknown scorer params, a missing model path, a missing dataset path, a missing column) is refused
naming the field; a good one passes. Also the estimator names a run file may use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants

from rlfabric import cli
from rlfabric.learner.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlfabric.runspec import AlgorithmSpec, RunSpec
from rlfabric.validate import SpecIssue, check_local, reward_field


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "what is 2+2?", "answer": "4"}, {"prompt": "and 3+3?", "answer": "6"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def spec(model: Path | str, data: Path | str, **extra: Any) -> RunSpec:
    base: dict[str, Any] = {"model": {"path": str(model)}, "dataset": {"path": str(data)}}
    return RunSpec.model_validate({**base, **extra})


BROKEN: dict[str, tuple[dict[str, Any], str]] = {
    "misspelt scorer": ({"reward": {"scorer": "exact_matc"}}, "reward.scorer"),
    "unknown scorer params": (
        {"reward": {"scorer": "exact_match", "params": {"bogus": 1}}},
        "reward.params.bogus",
    ),
    "bad composite part": (
        {"reward": {"scorer": "composite", "parts": [{"scorer": "regex"}]}},
        "reward.parts[0].params.pattern",
    ),
    "missing column": ({"dataset": {"metadata_fields": ["tags"]}}, "dataset.metadata_fields[0]"),
    "no room for a prompt": ({"model": {"max_model_len": 256}}, "rollout.sampling.max_tokens"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_broken_run_file_is_refused_naming_the_field(
    case: str, tiny_model_dir: Path, data: Path
) -> None:
    extra, field = BROKEN[case]
    base = spec(tiny_model_dir, data).model_dump()
    report = check_local(RunSpec.model_validate({**base, **{k: {**base[k], **v} for k, v in extra.items()}}))
    assert [i.field for i in report.issues] == [field], report.issues


def test_missing_paths_are_refused_and_hub_ids_pass_where_they_may_download(
    tiny_model_dir: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = check_local(spec(tmp_path / "no-model", tmp_path / "no-data.jsonl"))
    assert [(i.field, i.kind) for i in report.issues] == [
        ("model.path", "not_found"),
        ("dataset.path", "not_found"),
    ]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the tests run with HF_HUB_OFFLINE=1
    hub = check_local(spec("no-such-org/no-such-model", data))
    assert hub.ok and any("hub cache" in s for s in hub.skipped)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    offline = check_local(spec("no-such-org/no-such-model", data))
    assert [(i.field, i.kind) for i in offline.issues] == [("model.path", "model_not_cached")]


def test_a_hub_id_not_cached_is_refused_where_nothing_may_download(data: Path, tmp_path: Path) -> None:
    run_file = tmp_path / "run.json"
    run_file.write_text(
        json.dumps({"model": {"path": "no-such-org/no-such-model"}, "dataset": {"path": str(data)}})
    )
    argv = [sys.executable, "-m", "rlfabric.cli", "config", "check", str(run_file)]
    offline = subprocess.run(argv, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    assert offline.returncode == 2, offline.stderr
    refusal = "model.path: no folder 'no-such-org/no-such-model' here, and as a hub id it is not in the local"
    assert refusal in offline.stderr and "HF_HUB_OFFLINE is set" in offline.stderr
    online = subprocess.run(argv, env={**os.environ, "HF_HUB_OFFLINE": "0"}, capture_output=True, text=True)
    assert online.returncode == 0 and "not checked: model.path" in online.stdout, online.stderr


def test_a_model_folder_that_does_not_load_is_refused(tmp_path: Path, data: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    report = check_local(spec(broken, data))
    assert [(i.field, i.kind) for i in report.issues] == [("model.path", "model_unloadable")]


def test_a_good_run_file_passes_and_offline_runs_check_their_pair_columns(
    tiny_model_dir: Path, data: Path
) -> None:
    assert check_local(spec(tiny_model_dir, data)).ok
    offline = check_local(spec(tiny_model_dir, data, mode="offline_preference"))
    assert [i.field for i in offline.issues] == ["preference.chosen_field", "preference.rejected_field"]


def test_issue_locations_split_indexes() -> None:
    assert SpecIssue("reward.parts[1].params.x", "m", "k").loc == ["reward", "parts", 1, "params", "x"]
    assert reward_field("name") == "reward.scorer"
    assert reward_field("params.parts[2].scorer") == "reward.parts[2].scorer"


def test_config_check_prints_the_field_and_exits_2(
    tiny_model_dir: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({**spec(tiny_model_dir, data).model_dump(), "reward": {"scorer": "exact_matc"}})
    )
    assert cli.main(["config", "check", str(bad)]) == 2
    assert "reward.scorer: unknown scorer 'exact_matc'" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(spec(tiny_model_dir, data).model_dump_json())
    assert cli.main(["config", "check", str(good)]) == 0
    assert "valid RunSpec" in capsys.readouterr().out


def test_ppo_is_the_name_of_gae_and_every_registered_estimator_is_selectable() -> None:
    assert AlgorithmSpec.model_validate({"advantage": "ppo"}).advantage == "gae"
    names = typing.get_args(AlgorithmSpec.model_fields["advantage"].annotation)
    assert set(names) == set(ADVANTAGE_ESTIMATORS)
    for name in ADVANTAGE_ESTIMATORS:
        assert AlgorithmSpec.model_validate({"advantage": name}).advantage == name


def save_splits(folder: Path, train: list[dict[str, Any]], test: list[dict[str, Any]]) -> Path:
    """A `save_to_disk` DatasetDict with a train and a test split."""
    import datasets

    splits = {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    return folder


def test_the_dataset_is_read_with_its_split_as_the_run_reads_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [{"prompt": "what is 2+2?", "answer": "4"}]
    folder = save_splits(tmp_path / "saved", rows, [{"question": "q", "answer": "1"}])
    assert check_local(spec(tiny_model_dir, folder)).ok
    test_split = check_local(spec(tiny_model_dir, folder, dataset={"path": str(folder), "split": "test"}))
    assert [(i.field, i.kind) for i in test_split.issues] == [("dataset.prompt_field", "missing_column")]
    missing = check_local(spec(tiny_model_dir, folder, dataset={"path": str(folder), "split": "dev"}))
    assert [(i.field, i.kind) for i in missing.issues] == [("dataset.path", "unreadable")]
    assert "no split 'dev'" in missing.issues[0].message


def test_the_evaluation_set_must_exist_and_hold_the_columns(
    tiny_model_dir: Path, data: Path, tmp_path: Path
) -> None:
    def with_eval(**evaluation: Any) -> RunSpec:
        return spec(tiny_model_dir, data, dataset={"path": str(data), "eval": evaluation})

    absent = check_local(with_eval(path=str(tmp_path / "no-eval.jsonl")))
    assert [(i.field, i.kind) for i in absent.issues] == [("dataset.eval.path", "not_found")]
    hub = check_local(with_eval(path="some-org/some-eval-set"))
    assert hub.ok and any(s.startswith("dataset.eval.path") for s in hub.skipped)
    other = tmp_path / "eval.parquet"
    import datasets

    datasets.Dataset.from_list([{"question": "q", "answer": "1"}]).to_parquet(str(other))
    wrong = check_local(with_eval(path=str(other)))
    assert [(i.field, i.kind) for i in wrong.issues] == [("dataset.prompt_field", "missing_column")]
    assert "the evaluation set" in wrong.issues[0].message
    datasets.Dataset.from_list([{"prompt": "q", "answer": "1"}]).to_parquet(str(other))
    assert check_local(with_eval(path=str(other))).ok


def test_a_truncated_sampling_is_noted_for_rl_runs(data: Path, tiny_model_dir: Path) -> None:
    truncated = check_local(spec(tiny_model_dir, data, rollout={"sampling": {"top_p": 0.9, "top_k": 20}}))
    assert truncated.ok and any(
        note.startswith("rollout.sampling.top_p = 0.9 and top_k = 20: the replicas sample from the truncated")
        for note in truncated.notes
    )
    plain = check_local(spec(tiny_model_dir, data))
    assert not [note for note in plain.notes if note.startswith("rollout.sampling")]
