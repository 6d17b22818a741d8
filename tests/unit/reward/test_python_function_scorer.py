"""python_function: TRL-signature user functions from a module or a file."""

import math
import textwrap

import pytest

from rlfabric.reward.scorers import InvalidScorerSpec, build_scorer, run_scorer

SOURCE = """
def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

def uses_columns(prompts, completions, reference, difficulty, **kwargs):
    return [float(c == r) * (d or 1) for c, r, d in zip(completions, reference, difficulty)]

def only_named(prompts, completions, reference):
    return [1.0 if c == r else 0.0 for c, r in zip(completions, reference)]

def some_none(prompts, completions, **kwargs):
    return [None if c == "skip" else 1.0 for c in completions]

def too_short(prompts, completions, **kwargs):
    return [1.0]

def raises(prompts, completions, **kwargs):
    raise RuntimeError("boom")

def not_numbers(prompts, completions, **kwargs):
    return ["high", True]

def sees_prompts(prompts, completions, **kwargs):
    return [float(isinstance(p, list)) for p in prompts]

NOT_CALLABLE = 3
"""


@pytest.fixture
def module_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(SOURCE))
    return path


def score(path, attr, items, **params):
    return run_scorer(build_scorer("python_function", {"function": f"{path}:{attr}", **params}), items)


def test_file_function_scores_each_completion(module_file, item):
    results = score(module_file, "length_reward", [item("ab"), item("abcd")])
    assert [r.reward for r in results] == [2.0, 4.0]


def test_metadata_columns_and_reference_are_passed(module_file, item):
    items = [item("x", "x", difficulty=3), item("x", "y", difficulty=2), item("z", "z")]
    assert [r.reward for r in score(module_file, "uses_columns", items)] == [3.0, 0.0, 1.0]


def test_function_without_kwargs_receives_only_named_columns(module_file, item):
    assert [r.reward for r in score(module_file, "only_named", [item("a", "a", extra=1)])] == [1.0]


def test_none_is_a_per_item_error(module_file, item):
    results = score(module_file, "some_none", [item("skip"), item("keep")])
    assert results[0].status == "scorer_error" and math.isnan(results[0].reward)
    assert (results[1].status, results[1].reward) == ("ok", 1.0)


@pytest.mark.parametrize("attr", ["too_short", "raises"])
def test_wrong_length_or_exception_fails_every_item(module_file, item, attr):
    results = score(module_file, attr, [item("a"), item("b")])
    assert [r.status for r in results] == ["scorer_error", "scorer_error"]


def test_non_numbers_are_errors(module_file, item):
    assert [r.status for r in score(module_file, "not_numbers", [item("a"), item("b")])] == [
        "scorer_error"
    ] * 2


def test_chat_prompts_are_passed_as_messages(module_file, item):
    items = [item("a", prompt=[{"role": "user", "content": "hi"}]), item("b", prompt="plain")]
    assert [r.reward for r in score(module_file, "sees_prompts", items)] == [1.0, 0.0]


def test_module_reference_and_constant_kwargs(module_file, item, monkeypatch):
    monkeypatch.syspath_prepend(str(module_file.parent))
    params = {"function": "my_rewards:uses_columns", "kwargs": {"difficulty": [5]}}
    [result] = run_scorer(build_scorer("python_function", params), [item("a", "a", difficulty=1)])
    assert result.reward == 5.0


@pytest.mark.parametrize(
    "spec", ["no_colon", "missing_file.py:f", "json:no_such_attr", "{file}:NOT_CALLABLE", "{file}:"]
)
def test_bad_function_references_name_the_field(module_file, spec):
    with pytest.raises(InvalidScorerSpec) as err:
        build_scorer("python_function", {"function": spec.format(file=module_file)})
    assert err.value.field == "params.function"
