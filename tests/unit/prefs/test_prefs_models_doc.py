"""Every TOML snippet of docs/prefs_models.md validates: its generator tables as `GeneratorSpec`, its
llm judges as `LlmJudgeSpec`, its principles as `Principle`."""

import re
import tomllib
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from rlfabric.prefs.cai import Principle
from rlfabric.prefs.generation import GeneratorSpec
from rlfabric.prefs.llm_judge import LlmJudgeSpec

DOC = Path(__file__).resolve().parents[3] / "docs" / "prefs_models.md"
SNIPPETS = [tomllib.loads(s) for s in re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.DOTALL)]


def test_the_doc_has_snippets_of_each_part():
    keys = {key for snippet in SNIPPETS for key in snippet}
    assert keys == {"source", "judges", "cai", "principles"}


@pytest.mark.parametrize("snippet", SNIPPETS)
def test_each_snippet_validates(snippet):
    for table in (snippet.get("source", {}), snippet.get("cai", {})):
        if "generator" in table:
            TypeAdapter(GeneratorSpec).validate_python(table["generator"])
    for judge in snippet.get("judges", []):
        assert judge.pop("kind") == "llm"
        LlmJudgeSpec.model_validate(judge)
    for principle in snippet.get("principles", []):
        Principle.model_validate(principle)
