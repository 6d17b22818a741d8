"""The operator's limits on a submitted pipeline (`coordinator.prefs_limits`): what they allow, beside the
refusals the coordinator's integration test draws through the API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlfabric.coordinator.config import PrefsBuildsConfig
from rlfabric.coordinator.prefs_limits import function_refusal, pipeline_issues, sends_to
from rlfabric.prefs.spec import PipelineSpec
from rlfabric.runtime.paths import Roots
from rlfabric.runtime.user_code import FunctionAllowlist


def issues(pipeline: dict[str, Any], roots: Roots, **limits: Any) -> dict[str, str]:
    spec = PipelineSpec.model_validate({"name": "p", **pipeline})
    found = pipeline_issues(spec, PrefsBuildsConfig.model_validate(limits), roots)
    return {".".join(map(str, i.loc)): i.kind for i in found}


def test_the_configured_store_parents_by_id_and_listed_credentials_are_allowed(tmp_path: Path) -> None:
    roots = Roots.of([str(tmp_path / "data")], [str(tmp_path / "models")])
    generator = {"kind": "rollout", "address": "10.0.0.5:50051", "token_env": "REPLICA_TOKEN"}
    pipeline = {
        "store": str(tmp_path / "store"),
        "parents": ["69834d7fdbfb", "arithmetic-pairs"],
        "source": {"kind": "sample", "prompts": str(tmp_path / "data" / "p.jsonl"), "generator": generator},
        "judges": [{"kind": "scorer", "scorer": "exact_match"}],
    }
    allowed = {"store": str(tmp_path / "store"), "credential_envs": {"REPLICA_TOKEN": "10.0.0.5:50051"}}
    assert issues(pipeline, roots, **allowed) == {}
    elsewhere = {**generator, "address": "10.0.0.6:50051"}
    moved = {**pipeline, "source": {**pipeline["source"], "generator": elsewhere}, "store": "other"}
    assert issues(moved, roots, **allowed) == {
        "store": "store_not_allowed",
        "source.generator.token_env": "credential_not_allowed",
    }


def test_local_generators_when_enabled_serve_models_within_the_roots(tmp_path: Path) -> None:
    roots = Roots.of([str(tmp_path)], [str(tmp_path / "models")])
    inside = {"kind": "local", "model": str(tmp_path / "models" / "tiny")}
    outside = {"kind": "local", "model": str(tmp_path / "tiny")}
    source = {"kind": "sample", "prompts": str(tmp_path / "p.jsonl"), "generator": inside}
    llm = {"kind": "llm", "generator": outside}
    pipeline = {"source": source, "judges": [llm]}
    assert issues(pipeline, roots, allow_local_generators=True) == {
        "judges.0.generator.model": "path_not_allowed"
    }
    assert issues(pipeline, roots) == {
        "source.generator.kind": "local_generator_not_enabled",
        "judges.0.generator.kind": "local_generator_not_enabled",
        "judges.0.generator.model": "path_not_allowed",
    }


def test_function_references_are_judged_as_strings(tmp_path: Path) -> None:
    allowlist = FunctionAllowlist.parse([str(tmp_path / "code"), "mypkg.rewards", "other.mod:fn"])
    assert function_refusal(f"{tmp_path / 'code' / 'missing.py'}:score", allowlist) is None  # not looked at
    assert function_refusal("mypkg.rewards.sub:score", allowlist) is None
    assert function_refusal("other.mod:fn", allowlist) is None
    assert function_refusal("other.mod:gn", allowlist) is not None
    assert function_refusal(f"{tmp_path / 'code' / 'x.py'}:_private", allowlist) is not None
    assert function_refusal(f"{tmp_path / 'code' / '..' / 'x.py'}:score", allowlist) is not None
    assert function_refusal("score", allowlist) is not None


def test_a_url_credential_goes_only_to_its_endpoint_or_below() -> None:
    assert sends_to("https://judge.internal/v1/", "https://judge.internal/v1")
    assert sends_to("https://judge.internal/v1/chat", "https://judge.internal/v1")
    assert not sends_to("https://judge.internal/v10", "https://judge.internal/v1")
    assert not sends_to("10.0.0.5:50051/x", "10.0.0.5:50051")
