"""`rlfabric prefs` end to end on the example pipeline (examples/prefs/pipeline.toml, the real CLI in a
subprocess from the repository root): the build writes a version that verifies, every problem planted in
the pairs file (its `planted` column) is dropped by the rule that names it, the judges relabel the
mislabelled pair, an identical build finds the same id, and show, list, verify and diff read the store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "prefs"


def prefs(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    argv = [sys.executable, "-m", "rlfabric.cli", "prefs", *args]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def ok_json(*args: str) -> Any:
    result = prefs(*args, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    store = tmp_path_factory.mktemp("prefs-store")
    out = ok_json("build", "examples/prefs/pipeline.toml", "--store", str(store), "--no-progress")
    return {**out, "store": str(store)}


def planted() -> dict[int, str]:
    rows = [json.loads(line) for line in (EXAMPLE / "pairs.jsonl").read_text().splitlines()]
    return {i: r["planted"] for i, r in enumerate(rows) if r.get("planted")}


def test_the_example_builds_a_verified_version(built: dict[str, Any]) -> None:
    assert built["verified"] and built["problems"] == [] and not built["existed"]
    assert Path(built["path"]).name == built["id"]
    report = built["report"]
    assert report["hygiene"]["dropped"] == {
        "contaminated": 2, "exact_duplicate": 2, "identical": 1,
        "near_duplicate_across_prompts": 1, "near_duplicate_within_prompt": 1,
    }  # fmt: skip
    judges = report["judging"]["judges"]
    assert set(judges) == {"correct", "boxed"} and judges["correct"]["disagreements"] == 0
    assert judges["correct"]["position_first_rate"] == 0.5  # a scorer has no position bias


def test_every_planted_problem_is_caught_by_its_rule(built: dict[str, Any]) -> None:
    dropped = [json.loads(line) for line in (Path(built["path"]) / "dropped.jsonl").read_text().splitlines()]
    rule_of_row = {d["row"]["meta"]["row"]: d for d in dropped}
    problems = {i: kind for i, kind in planted().items() if kind != "mislabelled"}
    assert {i: rule_of_row[i]["rule"] for i in problems} == problems
    assert set(rule_of_row) == set(problems)  # nothing clean was dropped
    contaminated = [d for d in dropped if d["rule"] == "contaminated"]
    assert {d["detail"]["eval_set"] for d in contaminated} == {"gsm8k-sample"}
    assert sorted(d["detail"]["eval_row"] for d in contaminated) == [0, 1]
    for d in dropped:
        if d["rule"] in ("exact_duplicate", "near_duplicate_within_prompt", "near_duplicate_across_prompts"):
            assert d["other"]["meta"]["row"] < d["row"]["meta"]["row"]  # the earlier row is kept


def test_the_judges_relabel_the_mislabelled_pair(built: dict[str, Any]) -> None:
    (mislabelled,) = [i for i, kind in planted().items() if kind == "mislabelled"]
    rows = []
    for shard in sorted((Path(built["path"]) / "data").iterdir()):
        rows += [json.loads(line) for line in shard.read_text().splitlines()]
    metas = {json.loads(r["meta"])["row"]: (r, json.loads(r["meta"])) for r in rows}
    row, meta = metas[mislabelled]
    assert meta["source_label"] == "rejected" and meta["votes"]["correct"]["vote"] == "chosen"
    assert "multiply" in row["chosen"]
    assert all(m["label_by"] == "judges" for _, m in metas.values())


def test_an_identical_build_finds_the_same_version(built: dict[str, Any]) -> None:
    again = ok_json("build", "examples/prefs/pipeline.toml", "--store", built["store"], "--no-progress")
    assert again["id"] == built["id"] and again["existed"] and again["verified"]


def test_show_list_and_verify(built: dict[str, Any]) -> None:
    store = built["store"]
    shown = ok_json("show", built["id"][:10], "--store", store)
    assert shown["summary"]["id"] == built["id"] and shown["summary"]["rows"] == built["report"]["rows"]
    assert {i["field"] for i in shown["inputs"]} == {"source.path", "hygiene.decontaminate[0].path"}
    listed = ok_json("list", "--store", store, "--verify")
    assert [(v["id"], v["verified"]) for v in listed] == [(built["id"], True)]
    text = prefs("show", "arithmetic-pairs", "--store", store)
    assert text.returncode == 0 and "## Hygiene" in text.stdout
    assert ok_json("verify", built["id"], "--store", store)["ok"]


def test_verify_fails_on_a_tampered_copy(built: dict[str, Any], tmp_path: Path) -> None:
    copy = Path(shutil.copytree(built["path"], tmp_path / "copy"))
    shard = copy / "data" / "shard-00000.jsonl"
    shard.chmod(0o644)
    shard.write_text(shard.read_text().replace("multiply", "multiplY", 1))
    result = prefs("verify", str(copy))
    assert result.returncode == 1
    assert "data/shard-00000.jsonl: sha256 differs" in result.stderr


def test_diff_of_a_changed_pipeline(built: dict[str, Any], tmp_path: Path) -> None:
    text = (EXAMPLE / "pipeline.toml").read_text()
    pipeline = tmp_path / "no-decontamination.toml"
    pipeline.write_text(text[: text.index("[[hygiene.decontaminate]]")])
    other = ok_json("build", str(pipeline), "--store", built["store"], "--no-progress")
    assert other["id"] != built["id"]
    diff = ok_json("diff", built["id"], other["id"], "--store", built["store"])
    assert diff["rows"]["added"] == 2 and diff["rows"]["removed"] == 0  # the evaluation questions
    assert diff["pipeline_changed"] and any(line.startswith("-[[hygiene.decontaminate]]")
                                            for line in diff["pipeline_diff"])  # fmt: skip
    text_diff = prefs("diff", built["id"], other["id"], "--store", built["store"])
    assert "+2 added, -0 removed" in text_diff.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["build", "examples/prefs/missing.toml"], "config file not found"),
        (["show", "0000000000", "--store", "/nonexistent-store"], "no version"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str) -> None:
    result = prefs(*args)
    assert result.returncode == 2 and needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_bad_judge_names_its_field(tmp_path: Path) -> None:
    pipeline = tmp_path / "bad.toml"
    pipeline.write_text(
        'name = "bad"\n[source]\nkind = "file"\npath = "examples/prefs/pairs.jsonl"\n'
        '[[judges]]\nkind = "scorer"\nscorer = "regex"\nparams = {pattern = "("}\n'
    )
    result = prefs("build", str(pipeline), "--store", str(tmp_path / "store"), "--no-progress")
    assert result.returncode == 2 and "judges[0].params.pattern" in result.stderr
