"""composite: weighted sums, components per alias, and failure propagation."""

import math

from rlfabric.reward.scorers import build_scorer, run_scorer

FORMAT = {"alias": "format", "scorer": "regex", "weight": 0.2, "params": {"pattern": r"\\boxed\{"}}
CORRECT = {"alias": "correct", "scorer": "exact_match", "weight": 1.0, "params": {"extract": "boxed"}}


def test_weighted_sum_and_components(item):
    scorer = build_scorer("composite", {"parts": [CORRECT, FORMAT]})
    results = run_scorer(scorer, [item(r"\boxed{4}", "4"), item(r"\boxed{5}", "4"), item("4", "4")])
    assert [r.reward for r in results] == [1.2, 0.2, 0.0]
    assert results[0].components == {
        "correct": 1.0,
        "correct.extracted": 1.0,
        "format": 1.0,
        "format.matched": 1.0,
    }


def test_negative_weights_and_penalties(item):
    length = {"alias": "len", "scorer": "length_penalty", "weight": 0.5, "params": {"target_length": 10}}
    scorer = build_scorer("composite", {"parts": [CORRECT, length]})
    [result] = run_scorer(scorer, [item(r"\boxed{4}" + " " * 11, "4")])
    assert result.reward == 1.0 + 0.5 * -1.0


def test_a_failing_part_fails_the_item_with_its_status(item):
    tokens = {"alias": "len", "scorer": "length_penalty", "params": {"target_length": 10, "unit": "tokens"}}
    scorer = build_scorer("composite", {"parts": [CORRECT, tokens]})
    ok, failed = run_scorer(scorer, [item(r"\boxed{4}", "4", completion_tokens=5), item(r"\boxed{4}", "4")])
    assert (ok.status, ok.reward) == ("ok", 1.0)
    assert failed.status == "scorer_error" and math.isnan(failed.reward)
    assert failed.message.startswith("part 'len' (length_penalty):")


def test_nested_composite(item):
    inner = {"alias": "inner", "scorer": "composite", "weight": 2.0, "params": {"parts": [CORRECT]}}
    [result] = run_scorer(build_scorer("composite", {"parts": [inner]}), [item(r"\boxed{1}", "1")])
    assert result.reward == 2.0 and result.components["inner.correct"] == 1.0
