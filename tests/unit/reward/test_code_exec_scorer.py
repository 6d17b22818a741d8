"""code_exec pieces that need no sandbox: test-case parsing, output comparison, refusing without isolation.

Running code is covered in tests/integration/reward/test_sandbox.py.
"""

import pytest

from rlfabric.reward.scorers import ItemError, build_scorer, code_exec, run_scorer, sandbox
from rlfabric.reward.scorers.code_exec import CodeTest, outputs_match, parse_tests


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
