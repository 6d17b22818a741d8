"""`PreferenceSpec` for KTO, ORPO and SimPO (per-loss beta default, fields of other losses refused, specs
surviving a dump and reload) and `rlfabric.validate` on their datasets: a KTO run file whose rows lack
the label column, or hold a label that is not a bool, is refused naming `preference.label_field`; KTO
also reads (chosen, rejected) pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rlfabric.learner.preference_data import kto_reads_pairs, preference_columns
from rlfabric.runspec import PreferenceSpec, RunSpec
from rlfabric.validate import check_local


def preference(**fields: Any) -> PreferenceSpec:
    return PreferenceSpec.model_validate(fields)


def test_beta_defaults_to_the_losss_own() -> None:
    assert preference(loss="simpo").beta == 2.0
    assert preference(loss="simpo", beta=2.5).beta == 2.5
    assert preference(loss="kto").beta == preference(loss="dpo").beta == 0.1


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"loss": "dpo", "kto_desirable_weight": 1.33}, "preference.kto_desirable_weight"),
        ({"loss": "simpo", "label_field": "ok"}, "preference.label_field"),
        ({"loss": "orpo", "label_smoothing": 0.1}, "preference.label_smoothing"),
        ({"loss": "dpo", "simpo_gamma": 1.0}, "preference.simpo_gamma"),
        ({"loss": "kto", "orpo_lambda": 0.2}, "preference.orpo_lambda"),
        ({"loss": "orpo", "beta": 0.5}, "preference.beta"),
    ],
)
def test_a_field_of_another_loss_is_refused_naming_it(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        preference(**fields)


@pytest.mark.parametrize("loss", ["dpo", "ipo", "kto", "orpo", "simpo"])
def test_every_loss_survives_a_dump_and_reload(loss: str) -> None:
    """Services pass specs along as full dumps, defaults included."""
    spec = RunSpec.model_validate(
        {"mode": "offline_preference", "model": {"path": "m"}, "dataset": {"path": "d"},
         "preference": {"loss": loss}}
    )  # fmt: skip
    assert RunSpec.model_validate(spec.model_dump()) == spec


def test_kto_format_is_decided_by_the_first_row() -> None:
    kto = preference(loss="kto")
    assert kto_reads_pairs(kto, {"prompt": "p", "chosen": "a", "rejected": "b"})
    assert not kto_reads_pairs(
        kto, {"prompt": "p", "completion": "a", "label": True, "chosen": "x", "rejected": "y"}
    )
    assert preference_columns(kto, {"prompt": "p"}) == {
        "preference.completion_field": "completion",
        "preference.label_field": "label",
    }
    assert not kto_reads_pairs(preference(loss="dpo"), {"chosen": "a", "rejected": "b"})


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kto_run(model: Path, data: Path, **pref: Any) -> RunSpec:
    return RunSpec.model_validate(
        {"mode": "offline_preference", "model": {"path": str(model)}, "dataset": {"path": str(data)},
         "preference": {"loss": "kto", **pref}}
    )  # fmt: skip


def test_a_kto_run_without_its_label_column_is_refused_naming_the_field(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = write_rows(tmp_path / "kto.jsonl", [{"prompt": "hi", "completion": "yes"}] * 2)
    report = check_local(kto_run(tiny_model_dir, data))
    assert [(i.field, i.kind) for i in report.issues] == [("preference.label_field", "missing_column")]
    assert "'label'" in report.issues[0].message
    renamed = check_local(kto_run(tiny_model_dir, data, label_field="good"))
    assert [i.field for i in renamed.issues] == ["preference.label_field"] and "'good'" in str(
        renamed.issues[0]
    )


def test_a_kto_label_that_is_not_a_bool_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [
        {"prompt": "hi", "completion": "yes", "label": True},
        {"prompt": "a", "completion": "b", "label": "no"},
    ]
    report = check_local(kto_run(tiny_model_dir, write_rows(tmp_path / "kto.jsonl", rows)))
    assert [(i.field, i.kind) for i in report.issues] == [("preference.label_field", "bad_row")]
    assert "row 2" in report.issues[0].message


def test_kto_reads_labelled_rows_or_pairs(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [
        {"prompt": "hi", "completion": "yes", "label": True},
        {"prompt": "a", "completion": "b", "label": 0},
    ]
    assert check_local(kto_run(tiny_model_dir, write_rows(tmp_path / "rows.jsonl", rows))).ok
    pairs = write_rows(tmp_path / "pairs.jsonl", [{"prompt": "hi", "chosen": "yes", "rejected": "no"}])
    assert check_local(kto_run(tiny_model_dir, pairs)).ok


def test_a_reference_free_loss_notes_an_unused_reference(tiny_model_dir: Path, tmp_path: Path) -> None:
    pairs = write_rows(tmp_path / "pairs.jsonl", [{"prompt": "hi", "chosen": "yes", "rejected": "no"}])
    run = RunSpec.model_validate(
        {"mode": "offline_preference", "dataset": {"path": str(pairs)}, "preference": {"loss": "orpo"},
         "model": {"path": str(tiny_model_dir), "reference_path": str(tiny_model_dir)}}
    )  # fmt: skip
    report = check_local(run)
    assert report.ok and any(n.startswith("model.reference_path") for n in report.notes)
