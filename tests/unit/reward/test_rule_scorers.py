"""exact_match, regex, length_penalty, overlong_penalty and the text helpers, with hand-checked values."""

import math

import pytest

from rlfabric.reward.scorers import build_scorer, run_scorer
from rlfabric.reward.scorers.overlong_penalty import overlong_penalty
from rlfabric.reward.scorers.text import extract_boxed, extract_code, extract_tag, normalize


def rewards(name, params, items):
    return [r.reward for r in run_scorer(build_scorer(name, params), items)]


def test_extract_helpers():
    assert extract_tag("<answer>1</answer> then <answer> 2 </answer>", "answer") == " 2 "
    assert extract_tag("no tag", "answer") is None
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert extract_code("text\n```python\nprint(1)\n```\nmore\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```bash\nls\n```") == "```bash\nls\n```"
    assert normalize("  Hello,   World! ", whitespace=True, case=True, punctuation=True) == "hello world"


def test_exact_match_default_normalises_whitespace_and_case(item):
    items = [
        item("  Paris ", "paris"),
        item("PARIS\n", "Paris"),
        item("Lyon", "Paris"),
        item("Paris.", "Paris"),
    ]
    assert rewards("exact_match", {}, items) == [1.0, 1.0, 0.0, 0.0]


def test_exact_match_options(item):
    assert rewards("exact_match", {"case_sensitive": True}, [item("paris", "Paris")]) == [0.0]
    assert rewards("exact_match", {"strip_punctuation": True}, [item("Paris.", "Paris")]) == [1.0]
    assert rewards("exact_match", {"normalize_whitespace": False}, [item(" Paris", "Paris")]) == [0.0]
    assert rewards(
        "exact_match", {"reward_match": 2, "reward_mismatch": -1}, [item("a", "a"), item("a", "b")]
    ) == [
        2.0,
        -1.0,
    ]


def test_exact_match_extraction(item):
    tag = [item("think... <answer> 42 </answer>", "42"), item("42", "42")]
    assert rewards("exact_match", {"extract": "tag"}, tag) == [1.0, 0.0]
    boxed = [item(r"so \boxed{42}.", "42"), item(r"\boxed{41}", "42")]
    assert rewards("exact_match", {"extract": "boxed"}, boxed) == [1.0, 0.0]
    either = [item(r"\boxed{7}", "7"), item("<answer>7</answer> \\boxed{8}", "7")]
    assert rewards("exact_match", {"extract": "tag_or_boxed"}, either) == [1.0, 1.0]
    result = run_scorer(build_scorer("exact_match", {"extract": "tag"}), [item("none", "x")])[0]
    assert result.components == {"extracted": 0.0}


def test_exact_match_reference_without_answer_is_an_error(item):
    result = run_scorer(
        build_scorer("exact_match", {"extract": "boxed", "extract_reference": True}), [item("x", "7")]
    )
    assert result[0].status == "scorer_error" and math.isnan(result[0].reward)


def test_regex_search_and_fullmatch(item):
    fmt = r"<think>.*?</think>\s*<answer>.*?</answer>"
    good = item("<think>hmm</think>\n<answer>4</answer>")
    tail = item("<think>hmm</think><answer>4</answer> trailing")
    assert rewards("regex", {"pattern": fmt, "flags": ["DOTALL"]}, [good, tail]) == [1.0, 1.0]
    assert rewards("regex", {"pattern": fmt, "mode": "fullmatch", "flags": ["DOTALL"]}, [good, tail]) == [
        1.0,
        0.0,
    ]
    assert rewards("regex", {"pattern": "^ANSWER", "flags": ["IGNORECASE"]}, [item("answer: 1")]) == [1.0]
    params = {"pattern": "x", "reward_match": 0.5, "reward_no_match": -0.5}
    assert rewards("regex", params, [item("x"), item("y")]) == [0.5, -0.5]


def test_length_penalty_over_and_deviation(item):
    items = [item("a" * 50), item("a" * 100), item("a" * 150), item("a" * 500)]
    assert rewards("length_penalty", {"target_length": 100}, items) == [0.0, 0.0, -0.5, -1.0]
    dev = {"target_length": 100, "mode": "deviation", "scale": 0.5}
    assert rewards("length_penalty", dev, items) == [-0.25, 0.0, -0.25, -1.0]


def test_length_penalty_uses_token_counts_from_metadata(item):
    items = [item("short", completion_tokens=300), item("short")]
    assert rewards("length_penalty", {"target_length": 200, "unit": "auto"}, items) == [-0.5, 0.0]
    results = run_scorer(build_scorer("length_penalty", {"target_length": 200, "unit": "tokens"}), items)
    assert results[0].reward == -0.5 and results[0].components == {"length": 300.0}
    assert results[1].status == "scorer_error" and "completion_tokens" in results[1].message


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (3584, 0.0), (3585, -1 / 512), (3840, -0.5), (4096, -1.0), (4097, -1.0), (10_000, -1.0)],
)
def test_overlong_penalty_dapo_formula(length, expected):
    assert overlong_penalty(length, 4096, 512) == pytest.approx(expected)


def test_overlong_penalty_scorer(item):
    params = {"max_len": 20, "cache_len": 10, "penalty_factor": 2.0}
    items = [item("x" * 5), item("x" * 15), item("x" * 25), item("x", completion_tokens=18)]
    assert rewards("overlong_penalty", params, items) == [0.0, -1.0, -2.0, -1.6]
    assert rewards("overlong_penalty", {"max_len": 20, "cache_len": 0}, [item("x" * 20), item("x" * 21)]) == [
        0.0,
        -1.0,
    ]
