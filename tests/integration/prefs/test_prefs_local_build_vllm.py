"""`rlfabric prefs build` with every model-backed stage, for real: a sampling source whose generator is
`kind = "local"` (the build starts its own rollout replica, vLLM on CPU, on the tiny random model), a
`[cai]` stage under examples/rlhf/principles.toml and an `llm` judge through the same generator, beside a
programmatic scorer judge. The three stages name the same generator, so the build starts one replica.

The random model never writes a verdict: every llm judgement is an "error" abstention, which must be
counted as such and never as a preference, while the scorer judge still labels the pairs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlfabric.prefs import store

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[3]
PRINCIPLES = ROOT / "examples" / "rlhf" / "principles.toml"
PROMPTS = ["What is 2 + 3?", "Name a colour."]
SCORER = '''
def score(completions, **kwargs):
    """Deterministic and order-blind: the sum of the code points (distinct completions differ)."""
    return [float(sum(map(ord, c))) for c in completions]
'''
CREDENTIAL_KEY = re.compile(r"(^|_)(token|key|secret|password)$", re.IGNORECASE)
"""A key whose value could be a credential (`max_tokens` is not; a `*_env` name of one ends otherwise)."""


def pipeline_text(model: Path) -> str:
    generator = f'{{kind = "local", model = "{model}", max_model_len = 2048, max_tokens = 16}}'
    return f"""
name = "local-models"

[source]
kind = "sample"
prompts = "prompts.jsonl"
k = 2
max_tokens = 8
temperature = 1.0
seed = 7
generator = {generator}

[cai]
principles = "{PRINCIPLES}"
max_tokens = 8
seed = 7
generator = {generator}

[[judges]]
kind = "scorer"
name = "codepoints"
scorer = "python_function"
params = {{function = "judge.py:score"}}

[[judges]]
kind = "llm"
name = "tiny-llm"
template = "{{prompt}}\\nA: {{first}}\\nB: {{second}}\\nVerdict:"
max_tokens = 8
generator = {generator}

[hygiene.near_dup]
enabled = false
"""


@pytest.fixture(scope="module")
def built(
    tiny_model_dir: Path, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("prefs-local")
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (work / "judge.py").write_text(SCORER)
    (work / "pipeline.toml").write_text(pipeline_text(tiny_model_dir))
    argv = [sys.executable, "-m", "rlfabric.cli", "prefs", "build", "pipeline.toml"]
    argv += ["--store", str(work / "store"), "--no-progress", "--json"]
    done = subprocess.run(argv, cwd=work, env=vllm_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return {**json.loads(done.stdout), "replicas_started": done.stderr.count("prefs: starting a replica")}


def rows_of(path: Path) -> list[dict[str, Any]]:
    rows = []
    for shard in sorted((path / "data").iterdir()):
        rows += [json.loads(line) for line in shard.read_text().splitlines()]
    return [{**r, "meta": json.loads(r["meta"])} for r in rows]


def test_the_version_verifies_and_the_report_counts_its_rows(built: dict[str, Any]) -> None:
    path = Path(built["path"])
    assert built["verified"] and store.verify(path).ok
    rows, report = rows_of(path), built["report"]
    stages = report["stages"]
    assert report["rows"] == stages["rows"]["written"] == len(rows)
    assert stages["source"]["prompts"] == len(PROMPTS) and stages["source"]["generation_errors"] == 0
    assert stages["cai"]["added"] == len(PROMPTS)
    cai_rows = [r for r in rows if r["meta"]["source"] == "cai"]
    judged_rows = [r for r in rows if r["meta"]["label_by"] == "judges"]
    assert len(cai_rows) + len(judged_rows) == len(rows)
    assert stages["judging"]["kept"] == len(judged_rows)
    assert stages["hygiene"]["kept"] == stages["judging"]["in"] + stages["cai"]["added"]


def test_the_llm_judges_answers_are_errors_and_the_scorer_labels(built: dict[str, Any]) -> None:
    judges = built["report"]["judging"]["judges"]
    asked = built["report"]["stages"]["judging"]["in"]
    assert asked >= 1
    assert judges["tiny-llm"]["errors"] == judges["tiny-llm"]["pairs"] == asked
    assert judges["tiny-llm"]["votes"] == 0 and judges["tiny-llm"]["ties"] == 0
    assert judges["codepoints"]["votes"] >= 1 and judges["codepoints"]["errors"] == 0
    judged = [r for r in rows_of(Path(built["path"])) if r["meta"]["label_by"] == "judges"]
    assert judged, "the scorer judge labelled no pair"
    for row in judged:
        votes = row["meta"]["votes"]
        assert votes["tiny-llm"]["vote"] == "error" and votes["codepoints"]["vote"] == "chosen"


def test_cai_rows_carry_their_chain(built: dict[str, Any]) -> None:
    principles = ["helpful", "honest", "harmless", "concise"]
    cai_rows = [r for r in rows_of(Path(built["path"])) if r["meta"]["source"] == "cai"]
    assert len(cai_rows) == len(PROMPTS)
    for row in cai_rows:
        chain = row["meta"]["cai"]
        assert [s["principle"] for s in chain["steps"]] == principles
        assert chain["original"] == row["rejected"] and chain["revised"] == row["chosen"]
        for step in chain["steps"]:
            assert isinstance(step["critique"], str) and isinstance(step["revision"], str)
            assert step["revision_prompt"][-1]["role"] == "user"  # the revision request
            assert step["revision_prompt"][-2] == {"role": "assistant", "content": step["critique"]}
            assert step["critique_prompt"] == step["revision_prompt"][:-2]
        assert chain["steps"][-1]["revision"] == row["chosen"]


def test_the_manifest_records_the_generators_and_judges_without_credentials(
    built: dict[str, Any], tiny_model_dir: Path
) -> None:
    manifest = store.read_manifest(Path(built["path"]))
    generators = manifest["generators"]
    llm = manifest["judges"]["tiny-llm"]["generator"]
    for described in (generators["source"], generators["cai"], llm):
        assert described["kind"] == "local" and described["model_path"] == str(tiny_model_dir)
        assert described["policy_versions"] == [0]
    assert "replica_id" not in generators["source"]  # a process detail: equal builds, equal ids
    assert built["replicas_started"] == 1  # one replica served every stage
    assert manifest["judges"]["codepoints"]["scorer"] == "python_function"
    assert not credential_keys(manifest["generators"]) and not credential_keys(manifest["judges"])


def credential_keys(value: Any) -> list[str]:
    """Keys anywhere in `value` that could hold a credential."""
    if isinstance(value, dict):
        found = [k for k in value if CREDENTIAL_KEY.search(k)]
        return found + [k for v in value.values() for k in credential_keys(v)]
    if isinstance(value, list):
        return [k for v in value for k in credential_keys(v)]
    return []
