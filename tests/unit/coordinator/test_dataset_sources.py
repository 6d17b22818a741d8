"""Datasets as users have them: every source through `datasets` (files, save_to_disk folders, folders of
data files, hub ids), split selection, a separate evaluation set (never trained on) or the held-out
fallback, the system prompt and the chat template's extra variables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
from pydantic import ValidationError

from rlfabric.contracts import wire
from rlfabric.coordinator.dataset import (
    DatasetError,
    PromptRow,
    chat_prompt,
    load_prompt_sets,
    load_rows,
)
from rlfabric.coordinator.evaluation import eval_sampling
from rlfabric.runspec import DatasetSpec, RunSpec

ROWS = [{"id": f"r{i}", "prompt": f"say {i}", "answer": str(i)} for i in range(6)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts(spec: DatasetSpec) -> list[str]:
    return [str(r.prompt) for r in load_rows(spec)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_file_format_loads(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"data{suffix}"
    table = datasets.Dataset.from_list(ROWS)
    if suffix == ".json":
        path.write_text(json.dumps(ROWS))  # one JSON array, not JSON lines
    else:
        {".jsonl": table.to_json, ".parquet": table.to_parquet, ".csv": table.to_csv}[suffix](str(path))
    rows = load_rows(DatasetSpec(path=str(path)))
    assert [(r.prompt_id, r.prompt, r.reference) for r in rows] == [
        (f"r{i}", f"say {i}", str(i)) for i in range(6)
    ]


def test_save_to_disk_dataset_and_dataset_dict_splits(tmp_path: Path) -> None:
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert prompts(DatasetSpec(path=str(tmp_path / "one"))) == [r["prompt"] for r in ROWS]
    both = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS[:4]), test=datasets.Dataset.from_list(ROWS[4:])
    )
    both.save_to_disk(str(tmp_path / "dict"))
    assert prompts(DatasetSpec(path=str(tmp_path / "dict"), split="test")) == ["say 4", "say 5"]
    with pytest.raises(DatasetError, match=r"^dataset.split: no split 'validation'"):
        load_rows(DatasetSpec(path=str(tmp_path / "dict"), split="validation"))


def test_a_folder_of_data_files_has_its_splits_and_slices(tmp_path: Path) -> None:
    folder = tmp_path / "gsm"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS[:4])
    write_jsonl(folder / "test.jsonl", ROWS[4:])
    assert prompts(DatasetSpec(path=str(folder), split="test")) == ["say 4", "say 5"]
    assert prompts(DatasetSpec(path=str(folder), split="train[:2]")) == ["say 0", "say 1"]


def test_a_single_file_has_only_the_train_split(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert prompts(DatasetSpec(path=str(path), split="train[-2:]")) == ["say 4", "say 5"]
    with pytest.raises(DatasetError, match=r"^dataset.split: a single file has only the split 'train'"):
        load_rows(DatasetSpec(path=str(path), split="test"))


def test_a_hub_id_goes_to_load_dataset_with_its_name_split_and_revision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_load_dataset(*args: Any, **kwargs: Any) -> datasets.Dataset:
        calls.append((args, kwargs))
        return datasets.Dataset.from_list(ROWS[:2])

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    spec = DatasetSpec(path="openai/gsm8k", name="main", split="train[:2]", revision="abc123")
    assert [r.prompt for r in load_rows(spec)] == ["say 0", "say 1"]
    assert calls == [(("openai/gsm8k", "main"), {"split": "train[:2]", "revision": "abc123"})]


def test_a_hub_failure_names_the_field_and_what_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetError, match=r"^dataset.path no-such-org/no-such-set: the hub dataset"):
        load_rows(DatasetSpec(path="no-such-org/no-such-set"))
    with pytest.raises(DatasetError, match=r"no such file or folder"):
        load_rows(DatasetSpec(path="not/a/hub/id.jsonl"))


def test_a_separate_eval_file_is_evaluated_and_never_trained_on(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held = write_jsonl(tmp_path / "test.jsonl", [{"prompt": f"eval {i}"} for i in range(5)])
    spec = DatasetSpec(path=str(train), held_out_fraction=0.0, eval={"path": str(held), "max_prompts": 3})
    sets = load_prompt_sets(spec)
    assert sets.eval_source == "eval_set"
    assert [r.prompt for r in sets.train] == [r["prompt"] for r in ROWS]
    assert [r.prompt for r in sets.evaluation] == ["eval 0", "eval 1", "eval 2"]


def test_an_eval_split_of_the_training_dataset(tmp_path: Path) -> None:
    folder = tmp_path / "gsm"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS[:4])
    write_jsonl(folder / "test.jsonl", ROWS[4:])
    sets = load_prompt_sets(DatasetSpec(path=str(folder), eval={"split": "test"}))
    assert [r.prompt_id for r in sets.train] == ["r0", "r1", "r2", "r3"]
    assert [r.prompt_id for r in sets.evaluation] == ["r4", "r5"]


def test_without_an_eval_set_the_held_out_fraction_is_the_fallback(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(200)])
    sets = load_prompt_sets(DatasetSpec(path=str(path), held_out_fraction=0.2))
    assert sets.eval_source == "held_out" and 20 < len(sets.evaluation) < 60
    assert not {r.prompt_id for r in sets.train} & {r.prompt_id for r in sets.evaluation}
    assert load_prompt_sets(DatasetSpec(path=str(path))).eval_source == "none"


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ({"eval": {"split": "train"}}, "dataset.eval.split: 'train' is the training split"),
        ({"split": "test", "eval": {"path": "d.jsonl", "split": "test"}}, "dataset.eval.split"),
        ({"held_out_fraction": 0.1, "eval": {"split": "test"}}, "dataset.held_out_fraction"),
        ({"system_prompt": "be brief", "chat_template": False}, "dataset.system_prompt"),
    ],
)
def test_eval_rows_can_never_be_training_rows(dataset: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DatasetSpec.model_validate({"path": "d.jsonl", **dataset})


def test_run_files_of_before_stay_valid() -> None:
    spec = DatasetSpec.model_validate({"path": "d.jsonl", "held_out_fraction": 0.2, "eval_every_steps": 5})
    assert spec.split == "train" and not spec.eval.separate and spec.eval_every_steps == 5


def test_local_paths_name_the_eval_set_for_confinement() -> None:
    run = RunSpec.model_validate(
        {"model": {"path": "m"}, "dataset": {"path": "d.jsonl", "eval": {"path": "e.jsonl"}}}
    )
    assert run.local_paths()["dataset.eval.path"] == ("data", "e.jsonl")


def test_eval_sampling_overrides_only_what_it_names() -> None:
    run = RunSpec.model_validate(
        {
            "model": {"path": "m"},
            "dataset": {"path": "d.jsonl", "eval": {"split": "test", "n": 1, "temperature": 0.0}},
            "algorithm": {"advantage": "reinforce_pp"},
            "rollout": {"sampling": {"n": 4, "max_tokens": 7}},
        }
    )
    sampling = eval_sampling(run)
    assert (sampling.n, sampling.temperature, sampling.max_tokens) == (1, 0.0, 7)


def test_the_system_prompt_leads_every_chat_prompt() -> None:
    spec = DatasetSpec(path="d.jsonl", system_prompt="be brief")
    system = {"role": "system", "content": "be brief"}
    assert chat_prompt(PromptRow("a", "hi"), spec) == [system, {"role": "user", "content": "hi"}]
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert chat_prompt(PromptRow("b", own), spec) == own
    assert chat_prompt(PromptRow("c", "hi"), DatasetSpec(path="d.jsonl")) == "hi"


def test_template_kwargs_travel_in_the_prompt() -> None:
    proto = wire.prompt_to_proto("hi", chat_template=True, template_kwargs={"enable_thinking": False, "k": 3})
    assert wire.messages_from_proto(proto.messages) == [{"role": "user", "content": "hi"}]
    assert wire.template_kwargs_from_proto(proto.messages) == {"enable_thinking": False, "k": 3}
    assert wire.template_kwargs_from_proto(wire.prompt_to_proto("hi", chat_template=True).messages) == {}


def test_a_too_long_refusal_is_told_from_other_refusals() -> None:
    assert wire.is_prompt_too_long(wire.prompt_too_long_details(0, 300, 64, 256))
    assert not wire.is_prompt_too_long("prompts[0]: the prompt is empty")
