"""math_verify: equivalent answers in different notations, wrong answers, bad references, threads."""

import threading

import pytest

from rlfabric.reward.scorers import build_scorer, run_scorer


@pytest.fixture(scope="module")
def scorer():
    return build_scorer("math_verify", {})


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        (r"The answer is \boxed{1/2}", "0.5"),
        (r"The answer is \boxed{\frac{1}{2}}", "0.5"),
        ("So the result is $0.5$.", r"\frac{1}{2}"),
        (r"\boxed{0.5}", r"\boxed{1/2}"),
        (r"Thus $\boxed{1+x^2}$", "x^2+1"),
        ("The answer is 12.", "12"),
    ],
)
def test_equivalent_answers_score_one(scorer, item, completion, reference):
    [result] = run_scorer(scorer, [item(completion, reference)])
    assert (result.status, result.reward) == ("ok", 1.0)


@pytest.mark.parametrize(
    ("completion", "reference"),
    [(r"\boxed{1/3}", "0.5"), (r"\boxed{4}", "3"), ("I don't know", "3"), (r"\boxed{x^2}", "x^2+1")],
)
def test_wrong_or_missing_answers_score_zero(scorer, item, completion, reference):
    [result] = run_scorer(scorer, [item(completion, reference)])
    assert (result.status, result.reward) == ("ok", 0.0)


def test_no_parseable_answer_is_flagged_in_components(scorer, item):
    [result] = run_scorer(scorer, [item("no numbers here", "3")])
    assert result.components == {"parsed": 0.0}


def test_unparseable_reference_is_a_scorer_error_not_zero(scorer, item):
    [result] = run_scorer(scorer, [item(r"\boxed{1}", "")])
    assert result.status == "scorer_error" and "reference" in result.message


def test_scoring_on_worker_threads_and_main_thread_agree(scorer, item):
    items = [item(rf"\boxed{{{n}/4}}", str(n / 4)) for n in range(1, 9)]
    threaded = run_scorer(scorer, items, timeout_s=60, max_workers=4)
    on_main = scorer.score_batch(items)
    assert [r.reward for r in threaded] == [r.reward for r in on_main] == [1.0] * 8
    errors = []
    thread = threading.Thread(
        target=lambda: errors.extend(r for r in scorer.score_batch(items) if r.status != "ok")
    )
    thread.start()
    thread.join()
    assert errors == []
