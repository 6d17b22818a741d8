"""The scorer registry: self-description from Params, construction errors that name the field."""

import json
import math
import subprocess
import sys

import pytest

from rlfabric.reward.scorers import (
    SCORERS,
    InvalidScorerSpec,
    ScoreResult,
    build_scorer,
    describe_scorers,
)

EXPECTED = {
    "code_exec",
    "composite",
    "exact_match",
    "length_penalty",
    "llm_judge",
    "math_verify",
    "overlong_penalty",
    "python_function",
    "regex",
    "reward_model",
}


def test_registry_holds_the_builtin_scorers():
    assert set(SCORERS) == EXPECTED


def test_describe_scorers_lists_params_from_the_pydantic_model():
    infos = {info.name: info for info in describe_scorers()}
    assert set(infos) == EXPECTED
    regex = infos["regex"]
    assert regex.version == "1" and regex.description
    params = {p.name: p for p in regex.params}
    assert params["pattern"].required and params["pattern"].default is None
    assert params["pattern"].type == "string"
    assert params["mode"].default == '"search"' and params["mode"].choices == ("search", "fullmatch")
    assert params["flags"].type == "array" and json.loads(params["flags"].default) == []
    assert params["reward_match"].type == "number" and params["reward_match"].default == "1.0"
    judge = {p.name: p for p in infos["llm_judge"].params}
    assert judge["api_key_env"].type == "string|null" and judge["api_key_env"].default == "null"
    assert {p.name for p in infos["composite"].params} == {"parts"}


def test_every_param_is_described_and_optional_ones_have_json_defaults():
    for info in describe_scorers():
        for param in info.params:
            assert param.description, (info.name, param.name)
            if not param.required:
                json.loads(param.default)


def test_unknown_scorer_names_the_name_field():
    with pytest.raises(InvalidScorerSpec) as err:
        build_scorer("nope", {})
    assert err.value.field == "name"
    assert "exact_match" in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("regex", {}, "params.pattern"),
        ("regex", {"pattern": "("}, "params.pattern"),
        ("regex", {"pattern": "a", "mode": "partial"}, "params.mode"),
        ("exact_match", {"bogus": 1}, "params.bogus"),
        ("overlong_penalty", {"max_len": 10, "cache_len": 20}, "params"),
        ("length_penalty", {"target_length": 0}, "params.target_length"),
        ("reward_model", {"path": "/does/not/exist"}, "params.path"),
        ("python_function", {"function": "no_such_module_xyz:f"}, "params.function"),
        ("llm_judge", {"base_url": "http://x/v1", "model": "m", "template": "no slot"}, "params.template"),
        (
            "llm_judge",
            {"base_url": "http://x/v1", "model": "m", "api_key_env": "RLF_UNSET_KEY"},
            "params.api_key_env",
        ),
        ("composite", {"parts": []}, "params.parts"),
        ("composite", {"parts": [{"alias": "a", "scorer": "zzz"}]}, "params.parts[0].scorer"),
        (
            "composite",
            {
                "parts": [
                    {"alias": "a", "scorer": "exact_match"},
                    {"alias": "b", "scorer": "regex", "params": {}},
                ]
            },
            "params.parts[1].params.pattern",
        ),
        (
            "composite",
            {"parts": [{"alias": "a", "scorer": "regex", "weight": "x"}]},
            "params.parts[0].weight",
        ),
    ],
)
def test_bad_params_name_the_offending_field(name, params, field):
    with pytest.raises(InvalidScorerSpec) as err:
        build_scorer(name, params)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_score_result_failures_are_nan_not_zero():
    assert math.isnan(ScoreResult.error("x").reward)
    assert math.isnan(ScoreResult.timed_out("x").reward)
    assert ScoreResult.error("x").status == "scorer_error"
    assert ScoreResult.ok(1).reward == 1.0 and ScoreResult.ok(1).status == "ok"
    with pytest.raises(ValueError):
        ScoreResult.ok(math.nan)


def test_importing_the_scorers_pulls_in_no_heavy_or_grpc_modules():
    code = (
        "import sys, rlfabric.reward.scorers as s; s.describe_scorers();"
        "print([m for m in ('torch', 'transformers', 'grpc', 'math_verify', 'sympy') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
