"""Judging: each pair asked in both orders, a vote only when both orders agree (ties and disagreements
counted), judges combined by the ensemble with their agreement measured; the scorer judge on a real
registered scorer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from rlfabric.prefs.judging import (
    ScorerJudge,
    cohen_kappa,
    combine,
    fleiss_kappa,
    fold_orders,
    judge_candidates,
)
from rlfabric.prefs.sources import Candidate
from rlfabric.prefs.spec import EnsembleSpec, ScorerJudgeSpec
from rlfabric.prefs.types import Comparison, Judgement, Preference


class ScriptedJudge:
    """Answers by a script keyed on (first, second) as shown; records what it was asked."""

    def __init__(self, name: str, script: dict[tuple[str, str], Preference]) -> None:
        self.name, self.script = name, script
        self.asked: list[tuple[str, str]] = []

    async def judge(self, comparisons: Sequence[Comparison]) -> list[Judgement]:
        self.asked += [(c.first, c.second) for c in comparisons]
        return [Judgement(self.script[(c.first, c.second)], "scripted") for c in comparisons]

    def describe(self) -> dict[str, Any]:
        return {"kind": "scripted", "name": self.name}


def candidates(*pairs: tuple[str, str]) -> list[Candidate]:
    out = [Candidate("q", a, b, None) for a, b in pairs]
    for i, c in enumerate(out):
        c.index = i
    return out


def prefers(winner: str, loser: str) -> dict[tuple[str, str], Preference]:
    """A consistent judge's answers on one pair, in both orders."""
    return {(winner, loser): "first", (loser, winner): "second"}


def test_both_orders_fold_into_one_vote() -> None:
    j = Judgement
    assert fold_orders("x", j("first"), j("second")).vote == "first"
    assert fold_orders("x", j("second"), j("first")).vote == "second"
    assert fold_orders("x", j("tie"), j("tie")).vote == "tie"
    assert fold_orders("x", j("first"), j("first")).vote == "disagreement"  # always the first position
    assert fold_orders("x", j("tie"), j("second")).vote == "disagreement"
    assert fold_orders("x", j("error", "boom"), j("second")).vote == "error"


async def test_a_judge_is_asked_each_pair_in_both_orders_and_counted() -> None:
    script = {
        **prefers("good", "bad"),  # consistent: a vote
        ("A", "B"): "first",  # always the first position: a disagreement (position bias)
        ("B", "A"): "first",
        ("same", "same2"): "tie",
        ("same2", "same"): "tie",
    }
    judge = ScriptedJudge("s", script)
    pairs = candidates(("bad", "good"), ("A", "B"), ("same", "same2"))
    result = await judge_candidates({"s": judge}, pairs, EnsembleSpec(), batch_size=2)
    assert sorted(judge.asked) == sorted([*script])
    assert [(k.candidate.index, k.winner) for k in result.kept] == [(0, "second")]
    assert sorted((d.candidate.index, d.rule) for d in result.dropped) == [(1, "disagreement"), (2, "tie")]
    stats = result.judges["s"]
    assert (stats["votes"], stats["ties"], stats["disagreements"], stats["errors"]) == (1, 1, 1, 0)
    assert stats["position_first_rate"] == pytest.approx(3 / 4)  # first, second | first, first
    assert stats["describe"] == {"kind": "scripted", "name": "s"}


async def test_ensemble_majority_agreement_and_label_filter() -> None:
    pairs = candidates(("a", "b"), ("c", "d"), ("e", "f"))
    one = ScriptedJudge("one", {**prefers("a", "b"), **prefers("c", "d"), **prefers("e", "f")})
    two = ScriptedJudge("two", {**prefers("a", "b"), **prefers("d", "c"), **prefers("e", "f")})
    three = ScriptedJudge("three", {**prefers("a", "b"), **prefers("c", "d"), **prefers("f", "e")})
    judges = {"one": one, "two": two, "three": three}
    result = await judge_candidates(judges, pairs, EnsembleSpec())
    assert [(k.winner, round(k.outcome.agreement, 3)) for k in result.kept] == [
        ("first", 1.0),
        ("first", 0.667),
        ("first", 0.667),
    ]
    agreement = result.agreement
    # one-two and one-three agree on 2 of 3 pairs; two-three (opposite on pairs 2 and 3) on 1
    assert [p["agreement"] for p in agreement["pairwise"]] == [0.6667, 0.6667, 0.3333]
    assert agreement["fleiss_pairs"] == 3 and agreement["mean_pair_agreement"] == pytest.approx(0.7778)
    unanimous = await judge_candidates(judges, pairs, EnsembleSpec(rule="unanimous"))
    assert [d.rule for d in unanimous.dropped] == ["not_unanimous", "not_unanimous"]
    labelled = candidates(("a", "b"), ("d", "c"))
    for c in labelled:
        c.label = "first"
    filtered = await judge_candidates({"one": one}, labelled, EnsembleSpec(on_source_label="filter"))
    assert [d.rule for d in filtered.dropped] == ["label_flip"]


async def test_split_and_low_agreement_drop_the_pair() -> None:
    pairs = candidates(("a", "b"))
    yes, no = ScriptedJudge("yes", prefers("a", "b")), ScriptedJudge("no", prefers("b", "a"))
    tie = ScriptedJudge("tie", {("a", "b"): "tie", ("b", "a"): "tie"})
    split = await judge_candidates({"yes": yes, "no": no}, pairs, EnsembleSpec())
    assert [d.rule for d in split.dropped] == ["split"]
    low = await judge_candidates({"yes": yes, "t1": tie, "t2": tie}, pairs, EnsembleSpec(min_agreement=0.5))
    assert [d.rule for d in low.dropped] == ["low_agreement"]


def test_combine_names_a_uniform_abstention() -> None:
    tie = fold_orders("t", Judgement("tie"), Judgement("tie"))
    err = fold_orders("e", Judgement("error"), Judgement("first"))
    assert combine([tie, tie], EnsembleSpec()).reason == "tie"
    assert combine([tie, err], EnsembleSpec()).reason == "no_vote"


def test_kappas_on_hand_computed_values() -> None:
    # 4 items: agree on 3; marginals a: 3 first / 1 second, b: 2 / 2 -> p_e = (3*2 + 1*2) / 16 = 0.5
    assert cohen_kappa(["f", "f", "f", "s"], ["f", "f", "s", "s"]) == pytest.approx((0.75 - 0.5) / 0.5)
    assert cohen_kappa(["f", "f"], ["f", "f"]) is None  # chance agreement is 1: undefined
    # 2 items, 3 raters: [f, f, s], [f, f, f]: P_i = 1/3, 1; P_bar 2/3; p_f = 5/6 -> P_e = 26/36
    assert fleiss_kappa([["f", "f", "s"], ["f", "f", "f"]]) == pytest.approx(
        (2 / 3 - 26 / 36) / (1 - 26 / 36)
    )


async def test_the_scorer_judge_scores_both_completions_once_and_ties_within_the_margin() -> None:
    spec = ScorerJudgeSpec.model_validate(
        {"kind": "scorer", "scorer": "length_penalty", "params": {"target_length": 5, "unit": "chars"},
         "tie_margin": 0.05}
    )  # fmt: skip
    judge = ScorerJudge("short", spec)
    asked = [Comparison("q", "tiny", "much too long"), Comparison("q", "much too long", "tiny"),
             Comparison("q", "tiny", "tiny!")]  # fmt: skip
    answers = await judge.judge(asked)
    assert [a.preference for a in answers] == ["first", "second", "tie"]
    assert len(judge.scores) == 3  # "tiny", "much too long", "tiny!": each scored once
    assert judge.describe()["scorer"] == "length_penalty"
    judge.close()


async def test_a_failed_score_is_an_error_judgement_never_a_preference() -> None:
    params = {"extract": "boxed", "extract_reference": True}
    spec = ScorerJudgeSpec.model_validate({"kind": "scorer", "scorer": "exact_match", "params": params})
    judge = ScorerJudge("exact", spec)
    answers = await judge.judge([Comparison("q", "\\boxed{1}", "2", reference="no box here")])
    assert answers[0].preference == "error" and "scorer_error" in answers[0].detail
