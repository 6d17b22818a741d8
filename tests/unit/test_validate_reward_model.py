"""Run files of `mode = "reward_model"` in `rlfabric config check` (`rlfabric.validate`): TRL's pair
formats pass; a missing column, a margin that is not a number, messages without the chat template, a
separate evaluation set without the columns and pairs that cannot fit are each one issue naming the field;
and the rows encode as the run encodes them (explicit, implicit and conversational prompts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlfabric.learner.reward_model_data import load_reward_data
from rlfabric.runspec import RunSpec
from rlfabric.validate import check_local

USER = [{"role": "user", "content": "hi"}]


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def spec(model: Path, data: Path, **sections: Any) -> RunSpec:
    dataset = {"path": str(data), **sections.pop("dataset", {})}
    raw = {"mode": "reward_model", "model": {"path": str(model)}, "dataset": dataset, **sections}
    return RunSpec.model_validate(raw)


def issues(run: RunSpec) -> list[tuple[str, str]]:
    return [(i.field, i.kind) for i in check_local(run).issues]


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "hi", "chosen": "yes", "rejected": "no"},  # explicit prompt
        {"chosen": "hi yes", "rejected": "hi no"},  # implicit prompt
        {"prompt": USER, "chosen": [{"role": "assistant", "content": "y"}],
         "rejected": [{"role": "assistant", "content": "n"}]},  # conversational, explicit prompt
        {"chosen": [*USER, {"role": "assistant", "content": "y"}],
         "rejected": [*USER, {"role": "assistant", "content": "n"}]},  # conversational, implicit prompt
    ],
)  # fmt: skip
def test_trl_pair_formats_pass(tiny_model_dir: Path, tmp_path: Path, row: dict[str, Any]) -> None:
    assert issues(spec(tiny_model_dir, write(tmp_path / "p.jsonl", [row]))) == []


def test_a_missing_column_names_its_field(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write(tmp_path / "p.jsonl", [{"prompt": "hi", "good": "yes", "rejected": "no"}])
    assert issues(spec(tiny_model_dir, data)) == [("reward_model.chosen_field", "missing_column")]
    run = spec(tiny_model_dir, data, reward_model={"chosen_field": "good", "margin_field": "m"})
    assert issues(run) == [("reward_model.margin_field", "missing_column")]


def test_a_margin_must_be_a_number(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write(tmp_path / "p.jsonl", [{"prompt": "hi", "chosen": "y", "rejected": "n", "m": "big"}])
    run = spec(tiny_model_dir, data, reward_model={"margin_field": "m"})
    assert issues(run) == [("reward_model.margin_field", "bad_row")]


def test_messages_need_the_chat_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write(tmp_path / "p.jsonl", [{"prompt": USER, "chosen": "y", "rejected": "n"}])
    run = spec(tiny_model_dir, data, dataset={"chat_template": False})
    assert issues(run) == [("dataset.chat_template", "bad_row")]


def test_a_separate_evaluation_set_is_checked(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write(tmp_path / "p.jsonl", [{"prompt": "hi", "chosen": "y", "rejected": "n"}])
    held = write(tmp_path / "e.jsonl", [{"prompt": "hi", "chosen": "y"}])
    run = spec(tiny_model_dir, data, dataset={"eval": {"path": str(held)}})
    assert issues(run) == [("reward_model.rejected_field", "missing_column")]


def test_pairs_longer_than_the_limit_are_an_issue_when_none_fits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = write(tmp_path / "p.jsonl", [{"chosen": "y" * 40, "rejected": "n"}])
    run = spec(tiny_model_dir, data, reward_model={"max_length": 8})
    assert issues(run) == [("reward_model.max_length", "too_long")]


def test_rows_encode_as_the_scorer_renders_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = [
        {"prompt": "hi", "chosen": "yes", "rejected": "no", "m": 2},
        {"chosen": "ab", "rejected": "cd", "m": 0},
    ]
    data = write(tmp_path / "p.jsonl", rows)
    pairs = load_reward_data(spec(tiny_model_dir, data, reward_model={"margin_field": "m"})).train
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    rendered = tok.apply_chat_template(chat, tokenize=False)
    assert pairs[0].chosen_ids == tok.encode(rendered, add_special_tokens=False) and pairs[0].margin == 2.0
    assert pairs[1].chosen_ids == tok.encode("ab") and pairs[1].pair_id == "1"
    plain = load_reward_data(spec(tiny_model_dir, data, dataset={"chat_template": False})).train
    assert plain[0].rejected_ids == tok.encode("hino") and plain[0].margin == 0.0
