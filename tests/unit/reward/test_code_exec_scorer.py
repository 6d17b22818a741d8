"""code_exec pieces that need no sandbox: test-case parsing, output comparison, refusing without isolation,
and the server's limits that a request may only tighten.

Running code is covered in tests/integration/reward/test_sandbox.py.
"""

import pytest

from rlfabric.reward.config import SandboxConfig
from rlfabric.reward.scorers import InvalidScorerSpec, ItemError, build_scorer, code_exec, run_scorer
from rlfabric.reward.scorers.code_exec import CodeTest, outputs_match, parse_tests
from rlfabric.reward.scorers.policy import ScorerPolicy
from rlfabric.runtime import sandbox


def test_parse_tests_accepts_the_three_shapes():
    assert parse_tests([{"input": "1\n", "output": "2\n"}]) == [CodeTest(stdin="1\n", expected="2\n")]
    assert parse_tests({"inputs": ["a"], "outputs": ["b"]}) == [CodeTest(stdin="a", expected="b")]
    assert parse_tests(["assert f() == 1"]) == [CodeTest(statement="assert f() == 1")]


@pytest.mark.parametrize("raw", [None, [], "assert x", [{"input": "1"}], [3], {"inputs": [1], "outputs": []}])
def test_parse_tests_rejects_malformed_tests(raw):
    with pytest.raises(ItemError):
        parse_tests(raw)


def test_outputs_match_modes():
    assert outputs_match("1 \n2\n\n", "1\n2", "trailing_whitespace")
    assert not outputs_match("1\n 2", "1\n2", "trailing_whitespace")
    assert outputs_match("1\n 2", "1 2", "tokens")
    assert not outputs_match("1\n", "1", "exact")


def test_missing_tests_are_a_scorer_error(item):
    [result] = run_scorer(build_scorer("code_exec", {}), [item("print(1)")])
    assert result.status == "scorer_error" and "tests" in result.message


def test_refuses_to_run_without_isolation(item, monkeypatch):
    none = sandbox.Isolation("none", "/usr/bin/python3", "unshare: operation not permitted")
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: none)
    monkeypatch.setattr(code_exec, "probe_isolation", lambda: none)
    scorer = build_scorer("code_exec", {})
    [result] = run_scorer(scorer, [item("print(2)", tests=[{"input": "", "output": "2"}])])
    assert result.status == "scorer_error"
    assert "refusing to run untrusted code without isolation" in result.message
    assert "allow_unisolated" in result.message


def server(**limits):
    return ScorerPolicy(sandbox=SandboxConfig(**limits))


@pytest.mark.parametrize(
    ("params", "field", "limit"),
    [
        ({"cpu_s": 6}, "cpu_s", "sandbox.cpu_s = 5"),
        ({"memory_mb": 4096}, "memory_mb", "sandbox.memory_mb = 512"),
        ({"max_processes": 1000}, "max_processes", "sandbox.max_processes = 32"),
        ({"wall_s": 10.5}, "wall_s", "sandbox.wall_s = 10.0"),
        ({"file_size_mb": 9}, "file_size_mb", "sandbox.file_size_mb = 8"),
    ],
)
def test_a_request_may_not_loosen_the_servers_limits(params, field, limit):
    with pytest.raises(InvalidScorerSpec) as err:
        build_scorer("code_exec", params, server())
    assert err.value.field == f"params.{field}"
    assert limit in str(err.value) and "exceeds the server's limit" in str(err.value)


def test_unisolated_only_where_the_server_allows_it():
    with pytest.raises(InvalidScorerSpec) as err:
        build_scorer("code_exec", {"allow_unisolated": True}, server())
    assert err.value.field == "params.allow_unisolated"
    assert build_scorer("code_exec", {"allow_unisolated": True}, server(allow_unisolated=True))


def test_unset_limits_are_the_servers_and_set_ones_tighten():
    scorer = build_scorer("code_exec", {"cpu_s": 1}, server(cpu_s=2, memory_mb=128, allow_unisolated=True))
    assert (scorer.limits.cpu_s, scorer.limits.memory_mb, scorer.limits.allow_unisolated) == (1, 128, True)
    assert build_scorer("code_exec", {"allow_unisolated": False}, server(allow_unisolated=True)).limits == (
        SandboxConfig(allow_unisolated=False)
    )


def test_refused_without_isolation_even_when_the_server_allows_but_the_request_declines(item, monkeypatch):
    none = sandbox.Isolation("none", "/usr/bin/python3", "unshare: operation not permitted")
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: none)
    monkeypatch.setattr(code_exec, "probe_isolation", lambda: none)
    scorer = build_scorer("code_exec", {"allow_unisolated": False}, server(allow_unisolated=True))
    [result] = run_scorer(scorer, [item("print(2)", tests=[{"input": "", "output": "2"}])])
    assert result.status == "scorer_error" and "without isolation" in result.message
