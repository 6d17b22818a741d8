"""python_function: TRL-signature user functions from a module or a file, loaded only where the
server's `allowed_functions` allow it (refusals come before any import)."""

import math
import os
import sys
import textwrap

import pytest

from rlfabric.reward.scorers import InvalidScorerSpec, build_scorer, run_scorer
from rlfabric.reward.scorers.policy import ScorerPolicy

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


def allowing(*entries):
    return ScorerPolicy(tuple(str(e) for e in entries))


def build(function, *entries, **params):
    return build_scorer("python_function", {"function": function, **params}, allowing(*entries))


def score(path, attr, items, **params):
    return run_scorer(build(f"{path}:{attr}", path.parent, **params), items)


def test_file_function_scores_each_completion(module_file, item):
    results = score(module_file, "length_reward", [item("ab"), item("abcd")])
    assert [r.reward for r in results] == [2.0, 4.0]


def test_metadata_columns_and_reference_are_passed(module_file, item):
    items = [item("x", "x", difficulty=3), item("x", "y", difficulty=2), item("z", "z")]
    assert [r.reward for r in score(module_file, "uses_columns", items)] == [3.0, 0.0, 1.0]


def test_function_without_kwargs_receives_only_named_columns(module_file, item):
    assert [r.reward for r in score(module_file, "only_named", [item("a", "a", extra=1)])] == [1.0]


def test_none_is_not_applicable_never_a_reward_nor_an_error(module_file, item):
    results = score(module_file, "some_none", [item("skip"), item("keep")])
    assert results[0].status == "not_applicable" and math.isnan(results[0].reward)
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
    scorer = build("my_rewards:uses_columns", "my_rewards", kwargs={"difficulty": [5]})
    [result] = run_scorer(scorer, [item("a", "a", difficulty=1)])
    assert result.reward == 5.0


@pytest.mark.parametrize(
    "spec", ["no_colon", "missing_file.py:f", "json:no_such_attr", "{file}:NOT_CALLABLE", "{file}:"]
)
def test_bad_function_references_name_the_field(module_file, spec):
    with pytest.raises(InvalidScorerSpec) as err:
        build(spec.format(file=module_file), module_file.parent, "json")
    assert err.value.field == "params.function"


IMPORT_SIDE_EFFECT = """
open({marker!r}, "w").write("imported")

def reward(prompts, completions, **kwargs):
    return [1.0] * len(completions)
"""


@pytest.fixture
def trap(tmp_path, monkeypatch):
    """A module `trapmod` on sys.path (and a file `outside/trap.py`) that write `marker` when imported."""
    marker = tmp_path / "imported"
    source = IMPORT_SIDE_EFFECT.format(marker=str(marker))
    (tmp_path / "trapmod.py").write_text(source)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "trap.py").write_text(source)
    (tmp_path / "allowed").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path, marker
    sys.modules.pop("trapmod", None)


@pytest.mark.parametrize(
    "function",
    [
        "trapmod:reward",  # importable, but not allowed
        "trapmodule.x:reward",  # a prefix match on characters, not on module names
        "pty:spawn",
        "os:system",
        "subprocess:run",
        "builtins:exec",
        "{tmp}/outside/trap.py:reward",  # a file outside the allowed directory
        "{tmp}/allowed/../outside/trap.py:reward",  # .. out of it
        "{tmp}/allowed/link.py:reward",  # a symlink out of it
    ],
)
def test_refused_references_import_nothing(trap, function):
    tmp, marker = trap
    (tmp / "allowed" / "link.py").symlink_to(tmp / "outside" / "trap.py")
    with pytest.raises(InvalidScorerSpec) as err:
        build(function.format(tmp=tmp), tmp / "allowed", "trap", "allowed_pkg:f")
    assert err.value.field == "params.function"
    assert "not in allowed_functions" in str(err.value)
    assert not marker.exists(), "the refused module ran its import-time code"
    assert "trapmod" not in sys.modules


def test_no_user_code_by_default(module_file):
    with pytest.raises(InvalidScorerSpec, match="not in allowed_functions"):
        build_scorer("python_function", {"function": f"{module_file}:length_reward"})


def test_missing_file_is_reported_only_inside_an_allowed_directory(tmp_path):
    with pytest.raises(InvalidScorerSpec, match="not in allowed_functions"):
        build(f"{tmp_path}/elsewhere/nope.py:f", tmp_path / "allowed")
    with pytest.raises(InvalidScorerSpec, match="no such file"):
        build(f"{tmp_path}/nope.py:f", tmp_path)


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        ("{mod}:_private", "private"),
        ("{mod}:length_reward.__globals__", "private"),
        ("{mod}:os.system", "goes through the module 'os'"),
        ("{mod}:system", "defined in 'posix'"),  # imported into the allowed module, defined elsewhere
    ],
)
def test_attribute_paths_stay_in_the_allowed_module(module_file, function, reason):
    module_file.write_text(textwrap.dedent(SOURCE) + "\nimport os\nfrom os import system\n_private = 1\n")
    with pytest.raises(InvalidScorerSpec, match=reason):
        build(function.format(mod=module_file), module_file.parent)


def test_an_exact_entry_allows_that_function_only(module_file, monkeypatch):
    monkeypatch.syspath_prepend(str(module_file.parent))
    assert build("my_rewards:length_reward", "my_rewards:length_reward") is not None
    with pytest.raises(InvalidScorerSpec, match="not in allowed_functions"):
        build("my_rewards:some_none", "my_rewards:length_reward")
    exact = build("os:getcwd", "os:getcwd")  # the operator's explicit choice, even from another module
    assert exact._fns == [os.getcwd]


def test_composite_parts_obey_the_policy(module_file):
    part = {"alias": "u", "scorer": "python_function", "params": {"function": f"{module_file}:length_reward"}}
    with pytest.raises(InvalidScorerSpec) as err:
        build_scorer("composite", {"parts": [part]})
    assert err.value.field == "params.parts[0].params.function"
    assert build_scorer("composite", {"parts": [part]}, allowing(module_file.parent)) is not None
