"""What an offline preference run (`mode = "offline_preference"`) reads from a dataset row, without torch:
`validate` checks the first rows with it, `offline.load_pairs` and `offline.load_kto_examples` read every
row with it.

Pair losses (dpo, ipo, orpo, simpo) read (prompt, `chosen_field`, `rejected_field`). KTO reads TRL's two
formats, decided by the first row (`kto_reads_pairs`) for the whole dataset:
    unpaired  (prompt, `completion_field`, `label_field`): one row, desirable when the label is true
    paired    (prompt, `chosen_field`, `rejected_field`) and no `completion_field`: two rows, the chosen
              completion desirable and the rejected one undesirable (TRL's `unpair_preference_dataset`)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlfabric.runspec import PreferenceSpec

REFERENCE_FREE_LOSSES = ("orpo", "simpo")
"""The losses that read no reference model (`algorithms.preference.LOSS_KINDS`, which needs torch)."""


class PreferenceRowError(ValueError):
    """A row the run cannot read: the run-spec field naming the column, and what is wrong."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field, self.detail = field, detail


def kto_reads_pairs(pref: PreferenceSpec, first_row: Mapping[str, Any] | None) -> bool:
    """Whether a KTO run reads (chosen, rejected) pairs: the first row holds both columns and no
    completion column. False for every other loss (they read pairs, never rows)."""
    if pref.loss != "kto" or not isinstance(first_row, Mapping):
        return False
    has = first_row.keys()
    return pref.chosen_field in has and pref.rejected_field in has and pref.completion_field not in has


def preference_columns(pref: PreferenceSpec, first_row: Mapping[str, Any] | None) -> dict[str, str]:
    """The completion columns every row must hold (besides the prompt), by the field naming them."""
    if pref.loss == "kto" and not kto_reads_pairs(pref, first_row):
        return {
            "preference.completion_field": pref.completion_field,
            "preference.label_field": pref.label_field,
        }
    return {"preference.chosen_field": pref.chosen_field, "preference.rejected_field": pref.rejected_field}


def kto_label(pref: PreferenceSpec, row: Mapping[str, Any], index: int) -> bool:
    """Row `index`'s (from 0) label: a bool, or 1 / 0; `PreferenceRowError` naming the field otherwise."""
    if pref.label_field not in row:
        raise PreferenceRowError(
            "preference.label_field", f"row {index + 1} has no column {pref.label_field!r}"
        )
    value = row[pref.label_field]
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise PreferenceRowError(
        "preference.label_field",
        f"row {index + 1}: the label {value!r} in column {pref.label_field!r} is not a bool"
        " (true: desirable)",
    )
