"""Every TOML snippet of the user guide (docs/your-own-task.md) is a valid part of a run file: each
parses, and, completed with a model and a dataset path where it names none, validates as a `RunSpec`."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from rlfabric.runspec import RunSpec

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "your-own-task.md"
SNIPPETS = re.findall(r"```toml\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
BASE = {"model": {"path": "org/model"}, "dataset": {"path": "org/data"}}


def completed(snippet: dict[str, Any]) -> dict[str, Any]:
    """The snippet with `BASE`'s model and dataset path where it has none."""
    out = dict(snippet)
    for section, values in BASE.items():
        out[section] = {**values, **out.get(section, {})}
    return out


def test_the_guide_has_snippets() -> None:
    assert len(SNIPPETS) >= 4


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_each_toml_snippet_of_the_guide_validates(index: int) -> None:
    RunSpec.model_validate(completed(tomllib.loads(SNIPPETS[index])))
