"""Path confinement: a spec's dataset and model paths must resolve into their roots (`..` and symlinks
followed); hub ids pass for models and datasets; the verdict never depends on whether the file exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlfabric.runspec import RunSpec
from rlfabric.runtime.paths import Roots, allowed, is_hub_id, violations, within


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """tmp/{data/a.jsonl, models/m/, outside/secret.json, data/escape -> outside, data/loop -> loop}."""
    for folder in ("data", "models/m", "outside"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "data" / "a.jsonl").write_text('{"prompt": "p"}\n')
    (tmp_path / "outside" / "secret.json").write_text('{"aws_secret_access_key": "x"}\n')
    (tmp_path / "data" / "escape").symlink_to(tmp_path / "outside")
    (tmp_path / "data" / "loop").symlink_to(tmp_path / "data" / "loop")
    return tmp_path


def roots(tree: Path) -> Roots:
    return Roots.of([str(tree / "data")], [str(tree / "models")])


@pytest.mark.parametrize(
    ("relative", "inside"),
    [
        ("data/a.jsonl", True),
        ("data/missing.jsonl", True),  # not there yet: still inside
        ("data", True),
        ("data/../outside/secret.json", False),
        ("data/../outside/missing.json", False),  # same answer whether the file exists or not
        ("data/escape/secret.json", False),  # a symlink inside the root pointing out
        ("data/escape/missing.json", False),
        ("data/loop/x", False),  # cannot be resolved
        ("datax/a.jsonl", False),  # a sibling sharing the root's prefix
        ("outside/secret.json", False),
    ],
)
def test_within_follows_dotdot_and_symlinks(tree: Path, relative: str, inside: bool) -> None:
    assert within(str(tree / relative), roots(tree).data) is inside


def test_relative_paths_and_roots_are_taken_from_the_working_directory(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tree)
    local = Roots.of(["data"], ["."])
    assert within("data/a.jsonl", local.data) and within("./data/../data/a.jsonl", local.data)
    assert not within("../etc/passwd", local.data) and not within("/etc/passwd", local.data)
    assert not within("data/a\0.jsonl", local.data)


def test_hub_ids_pass_for_models_and_datasets(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tree / "outside")  # the working directory is in no root
    r = roots(tree)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and allowed("Qwen/Qwen2.5-0.5B-Instruct", "model", r)
    assert allowed("openai/gsm8k", "data", r)
    not_hubs = ("/etc/passwd", "./org/name", "../org/name", "org/../name", "org/.hidden", "a/b/c", "tiny")
    for not_hub in not_hubs:
        assert not is_hub_id(not_hub), not_hub
        assert not allowed(not_hub, "model", r) and not allowed(not_hub, "data", r), not_hub
    (tree / "outside" / "org").symlink_to(tree / "outside")
    assert not is_hub_id("org/secret.json")  # a local symlink would be loaded instead of the hub


def spec(tree: Path, **model: Any) -> RunSpec:
    paths = {"path": str(tree / "models" / "m"), **model}
    return RunSpec.model_validate({"model": paths, "dataset": {"path": str(tree / "data" / "a.jsonl")}})


def test_violations_name_each_field_and_never_the_file(tree: Path) -> None:
    assert violations(spec(tree), roots(tree)) == []
    bad = spec(tree, reference_path=str(tree / "outside"), critic_path="org/name")
    bad.dataset.path = str(tree / "data" / "escape" / "secret.json")
    found = violations(bad, roots(tree))
    assert [(v.field, v.kind) for v in found] == [("dataset.path", "data"), ("model.reference_path", "model")]
    for v in found:
        assert "secret.json" not in v.message and str(tree) not in v.message
        assert f"{v.kind}_roots" in v.message
