"""Run files of `mode = "sft"` and online runs with a `[warm_start]`: the schema (a warm start only on an
online run, its SFT spec, its data among the spec's paths) and `rlfabric config check` (a missing data
file or a bad column is one issue naming the field; the warm start's are named `warm_start.*`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rlfabric import cli
from rlfabric.rollout.chat_template import SELF_TEST_CONVERSATION, SELF_TEST_TOOLS
from rlfabric.runspec import RunSpec
from rlfabric.validate import check_local

CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.fixture
def sft_data(tmp_path: Path) -> Path:
    path = tmp_path / "sft.jsonl"
    rows = [{"messages": CHAT}, {"prompt": "3+3?", "completion": "6"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "what is 2+2?", "answer": "4"}) + "\n")
    return path


def sft_spec(model: Path, data: Path | str, **sections: Any) -> RunSpec:
    raw: dict[str, Any] = {"mode": "sft", "model": {"path": str(model)}, "dataset": {"path": str(data)}}
    return RunSpec.model_validate({**raw, **sections})


def online_spec(model: Path, prompts: Path, warm_data: Path | str, **warm: Any) -> RunSpec:
    warm_start = {"dataset": {"path": str(warm_data)}, "optim": {"lr": 1e-4}, **warm}
    raw = {"model": {"path": str(model)}, "dataset": {"path": str(prompts)}, "warm_start": warm_start}
    return RunSpec.model_validate(raw)


def issues(spec: RunSpec) -> list[tuple[str, str]]:
    return [(i.field, i.kind) for i in check_local(spec).issues]


def test_a_warm_start_is_an_sft_run_of_the_same_model(
    tiny_model_dir: Path, prompts: Path, sft_data: Path
) -> None:
    spec = online_spec(tiny_model_dir, prompts, sft_data, train={"steps": 7}, sft={"tools": SELF_TEST_TOOLS})
    warm = spec.warm_start_spec()
    assert warm.mode == "sft" and warm.warm_start is None and warm.model == spec.model
    assert warm.dataset.path == str(sft_data) and warm.train.steps == 7 and warm.optim.lr == 1e-4
    assert warm.sft.tools == SELF_TEST_TOOLS and spec.optim.lr == 1e-6  # the online run's own
    assert spec.local_paths()["warm_start.dataset.path"] == ("data", str(sft_data))
    with pytest.raises(ValidationError, match="only an online run has a warm start"):
        RunSpec.model_validate({**spec.model_dump(), "mode": "sft"})
    with pytest.raises(ValueError, match="no warm_start"):
        online_spec(tiny_model_dir, prompts, sft_data).model_copy(
            update={"warm_start": None}
        ).warm_start_spec()


def test_good_sft_and_warm_start_runs_pass(tiny_model_dir: Path, prompts: Path, sft_data: Path) -> None:
    assert check_local(sft_spec(tiny_model_dir, sft_data)).ok
    report = check_local(online_spec(tiny_model_dir, prompts, sft_data))
    assert report.ok, report.issues


def test_a_missing_warm_start_file_is_one_issue(tiny_model_dir: Path, prompts: Path, tmp_path: Path) -> None:
    spec = online_spec(tiny_model_dir, prompts, tmp_path / "nope.jsonl")
    assert issues(spec) == [("warm_start.dataset.path", "not_found")]
    assert issues(sft_spec(tiny_model_dir, tmp_path / "nope.jsonl")) == [("dataset.path", "not_found")]


@pytest.mark.parametrize(
    ("rows", "field", "words"),
    [
        ([{"text": "hi"}], "sft.messages_field", "row 1 holds neither 'messages' nor both"),
        (
            [{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}]}],
            "sft.messages_field",
            "row 2",
        ),
        ([{"prompt": "p", "completion": 4}], "sft.completion_field", "row 1 is not"),
        ([{"messages": CHAT, "tools": "{oops"}], "sft.tools_field", "not JSON"),
    ],
)
def test_a_bad_column_is_one_issue_naming_the_field(
    tiny_model_dir: Path, prompts: Path, tmp_path: Path, rows: list[dict[str, Any]], field: str, words: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = check_local(sft_spec(tiny_model_dir, path))
    assert [(i.field, i.kind) for i in report.issues] == [(field, "bad_row")]
    assert words in report.issues[0].message
    warm = check_local(online_spec(tiny_model_dir, prompts, path))
    assert [(i.field, i.kind) for i in warm.issues] == [(f"warm_start.{field}", "bad_row")]


def test_renamed_columns_are_read(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "renamed.jsonl"
    path.write_text(json.dumps({"conversation": CHAT}) + "\n" + json.dumps({"q": "x", "a": "y"}) + "\n")
    spec = sft_spec(tiny_model_dir, path, sft={"messages_field": "conversation", "completion_field": "a"})
    assert issues(spec) == [("sft.messages_field", "bad_row")]  # row 2's prompt is not `prompt`
    spec = spec.model_copy(update={"dataset": spec.dataset.model_copy(update={"prompt_field": "q"})})
    assert check_local(spec).ok


def test_long_rows_are_a_note_and_a_template_refusal_an_issue(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"messages": [dict(m) for m in SELF_TEST_CONVERSATION]}) + "\n")
    short = sft_spec(tiny_model_dir, path)
    short = short.model_copy(update={"model": short.model.model_copy(update={"max_model_len": 64})})
    report = check_local(short)
    assert report.ok and len(report.notes) == 1
    assert report.notes[0].startswith("model.max_model_len: 1 of the first 1 rows exceed model.max_model_len")
    no_template = tmp_path / "no-template"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(no_template)
    for name in ("config.json", "generation_config.json"):
        (no_template / name).write_text((tiny_model_dir / name).read_text())
    assert issues(sft_spec(no_template, path)) == [("model.path", "chat_template_mismatch")]


def test_config_check_names_the_warm_start_field(
    tiny_model_dir: Path, prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_file = tmp_path / "run.json"
    run_file.write_text(online_spec(tiny_model_dir, prompts, tmp_path / "nope.jsonl").model_dump_json())
    assert cli.main(["config", "check", str(run_file)]) == 2
    assert "warm_start.dataset.path: no such file or folder" in capsys.readouterr().err
