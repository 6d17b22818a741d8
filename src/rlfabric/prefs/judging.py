"""Judging: every judge asked about every pair in both orders, the two answers folded into one vote, the
judges' votes folded into one label, and how far the judges agree.

A judge answers an ordered question (`types.Comparison`: is `first` or `second` better?). Each candidate
(a, b) is asked as (a, b) and as (b, a); the judge's vote is

    a             when it prefers a in both orders
    b             when it prefers b in both orders
    tie           when it answers tie in both orders           (an abstention, counted)
    disagreement  when the two orders disagree: position bias  (an abstention, counted)
    error         when either answer is an error               (an abstention, counted)

and the ensemble (`EnsembleSpec`) makes the pair's label from the votes, or drops the pair naming why
(`tie`, `disagreement`, `error` when every judge abstained that way; `no_vote` for mixed abstentions;
`split`, `low_agreement`, `not_unanimous`; `label_flip` when a labelled pair's judges disagree with
its label under `on_source_label = "filter"`).

Agreement between judges is reported two ways, both over the judges' votes (abstentions left out): per
pair of judges, the plain share of pairs both voted on where they voted alike and Cohen's kappa of those
votes; and Fleiss' kappa over the pairs every judge voted on (with three judges or more it is the one
number). Kappa is None where it is undefined (every vote the same category).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Literal

from rlfabric.prefs.sources import Candidate, Dropped, Side
from rlfabric.prefs.spec import EnsembleSpec, PipelineSpec, ScorerJudgeSpec
from rlfabric.prefs.types import Comparison, Judgement, PairwiseJudge, Preference, Prompt

STAGE = "judging"
Vote = Literal["first", "second", "tie", "disagreement", "error"]
FLIP: dict[Preference, Preference] = {"first": "second", "second": "first", "tie": "tie", "error": "error"}
DETAIL_CHARS = 500
"""A judge's answer is kept in a row's meta up to this many characters."""


class JudgeError(RuntimeError):
    """A judge as a whole does not work (its `judge` raised, or answered the wrong number of items)."""


# -- one judge, both orders -----------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgeVote:
    """One judge on one candidate: its vote (in the candidate's terms: "first" is the source's first
    completion) and its two answers: `forward` asked (first, second), `backward` asked (second, first),
    each in the judge's own terms."""

    judge: str
    vote: Vote
    forward: Preference
    backward: Preference
    detail: tuple[str, str] = ("", "")

    def as_meta(self, chosen: Side | None) -> dict[str, Any]:
        """The vote as a row's meta records it: "chosen"/"rejected" once the row's label is `chosen`."""
        vote: str = self.vote
        if chosen is not None and self.vote in ("first", "second"):
            vote = "chosen" if self.vote == chosen else "rejected"
        return {
            "vote": vote,
            "forward": self.forward,
            "backward": self.backward,
            "detail": [d[:DETAIL_CHARS] for d in self.detail],
        }


def fold_orders(judge: str, forward: Judgement, backward: Judgement) -> JudgeVote:
    """The vote of one judge from its answers in both orders (module docstring)."""
    detail = (forward.detail, backward.detail)
    if "error" in (forward.preference, backward.preference):
        vote: Vote = "error"
    elif forward.preference == FLIP[backward.preference]:
        vote = forward.preference
    else:
        vote = "disagreement"
    return JudgeVote(judge, vote, forward.preference, backward.preference, detail)


async def ask_judge(
    name: str,
    judge: PairwiseJudge,
    candidates: Sequence[Candidate],
    batch_size: int,
    progress: Callable[[int], None] | None = None,
) -> list[JudgeVote]:
    """`judge`'s vote on every candidate: each batch asks (a, b) for its candidates, then (b, a)."""
    votes: list[JudgeVote] = []
    per_call = max(1, batch_size // 2)
    for start in range(0, len(candidates), per_call):
        batch = candidates[start : start + per_call]
        forward = [Comparison(c.prompt, c.first, c.second, c.reference) for c in batch]
        backward = [Comparison(c.prompt, c.second, c.first, c.reference) for c in batch]
        try:
            answers = await judge.judge(forward + backward)
        except Exception as exc:  # the judge as a whole failed: the build stops, naming it
            raise JudgeError(f"judge {name!r} failed: {type(exc).__name__}: {exc}") from exc
        if len(answers) != 2 * len(batch):
            raise JudgeError(f"judge {name!r} answered {len(answers)} comparisons for {2 * len(batch)}")
        votes += [fold_orders(name, answers[i], answers[len(batch) + i]) for i in range(len(batch))]
        if progress is not None:
            progress(len(batch))
    return votes


# -- the ensemble ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairOutcome:
    """The judges' verdict on one candidate: the winning side, or why there is none (`reason`), with
    every judge's vote and the share of all judges that voted for the winner."""

    winner: Side | None
    reason: str | None
    votes: tuple[JudgeVote, ...]
    agreement: float


def combine(votes: Sequence[JudgeVote], spec: EnsembleSpec) -> PairOutcome:
    """The ensemble's verdict on one candidate (module docstring)."""
    tally = Counter(v.vote for v in votes)
    first, second = tally["first"], tally["second"]
    n = len(votes)
    if first == second == 0:
        kinds = {v.vote for v in votes}
        return PairOutcome(None, kinds.pop() if len(kinds) == 1 else "no_vote", tuple(votes), 0.0)
    if first == second:
        return PairOutcome(None, "split", tuple(votes), first / n)
    winner: Side = "first" if first > second else "second"
    share = max(first, second) / n
    if spec.rule == "unanimous" and share < 1.0:
        return PairOutcome(None, "not_unanimous", tuple(votes), share)
    if spec.rule == "majority" and share < spec.min_agreement:
        return PairOutcome(None, "low_agreement", tuple(votes), share)
    return PairOutcome(winner, None, tuple(votes), share)


# -- statistics -----------------------------------------------------------------------------------------


@dataclass
class JudgeStats:
    """One judge's answers over a build: its votes by kind, and its ordered answers by position
    (`position_first_rate`: the share of its first/second answers that were "first"; 0.5 is no bias)."""

    votes: Counter[str] = field(default_factory=Counter)
    positions: Counter[str] = field(default_factory=Counter)

    def add(self, vote: JudgeVote) -> None:
        self.votes[vote.vote] += 1
        self.positions.update(p for p in (vote.forward, vote.backward))

    def as_report(self, described: dict[str, Any]) -> dict[str, Any]:
        decided = self.positions["first"] + self.positions["second"]
        asked = sum(self.votes.values())
        return {
            "describe": described,
            "pairs": asked,
            "votes": self.votes["first"] + self.votes["second"],
            "ties": self.votes["tie"],
            "disagreements": self.votes["disagreement"],
            "errors": self.votes["error"],
            "disagreement_rate": round(self.votes["disagreement"] / asked, 4) if asked else None,
            "position_first_rate": round(self.positions["first"] / decided, 4) if decided else None,
        }


def cohen_kappa(a: Sequence[str], b: Sequence[str]) -> float | None:
    """Cohen's kappa of two raters' labels on the same items (None: undefined, chance agreement 1)."""
    n = len(a)
    if n == 0:
        return None
    observed = sum(x == y for x, y in zip(a, b, strict=True)) / n
    ca, cb = Counter(a), Counter(b)
    expected = sum(ca[k] * cb[k] for k in set(ca) | set(cb)) / (n * n)
    return None if expected >= 1.0 else (observed - expected) / (1.0 - expected)


def fleiss_kappa(items: Sequence[Sequence[str]]) -> float | None:
    """Fleiss' kappa of items each rated by the same number (>= 2) of raters (None: undefined)."""
    if not items or len(items[0]) < 2:
        return None
    m, n = len(items[0]), len(items)
    totals: Counter[str] = Counter()
    agreement = 0.0
    for ratings in items:
        counts = Counter(ratings)
        totals.update(counts)
        agreement += (sum(c * c for c in counts.values()) - m) / (m * (m - 1))
    p_bar = agreement / n
    p_e = sum((c / (n * m)) ** 2 for c in totals.values())
    return None if p_e >= 1.0 else (p_bar - p_e) / (1.0 - p_e)


def agreement_report(names: Sequence[str], outcomes: Sequence[PairOutcome]) -> dict[str, Any]:
    """Agreement between judges (module docstring) and the mean per-pair agreement of kept pairs."""
    decided = ("first", "second")
    pairwise = []
    for i, j in combinations(range(len(names)), 2):
        both = [(o.votes[i].vote, o.votes[j].vote) for o in outcomes]
        both = [(x, y) for x, y in both if x in decided and y in decided]
        a, b = [x for x, _ in both], [y for _, y in both]
        same = sum(x == y for x, y in both)
        kappa = cohen_kappa(a, b)
        pairwise.append(
            {
                "judges": [names[i], names[j]],
                "pairs": len(both),
                "agreement": round(same / len(both), 4) if both else None,
                "cohen_kappa": None if kappa is None else round(kappa, 4),
            }
        )
    full = [[v.vote for v in o.votes] for o in outcomes if all(v.vote in decided for v in o.votes)]
    fleiss = fleiss_kappa(full) if len(names) >= 2 else None
    kept = [o.agreement for o in outcomes if o.winner is not None]
    return {
        "judges": list(names),
        "pairwise": pairwise,
        "fleiss_kappa": None if fleiss is None else round(fleiss, 4),
        "fleiss_pairs": len(full) if len(names) >= 2 else 0,
        "mean_pair_agreement": round(sum(kept) / len(kept), 4) if kept else None,
    }


# -- the stage ------------------------------------------------------------------------------------------


@dataclass
class Judged:
    """A candidate the judges labelled: `winner` is the side chosen."""

    candidate: Candidate
    outcome: PairOutcome

    @property
    def winner(self) -> Side:
        assert self.outcome.winner is not None
        return self.outcome.winner


@dataclass
class JudgingResult:
    """The judged candidates kept, the ones dropped with their reason, and the per-judge and agreement
    statistics of the report."""

    kept: list[Judged]
    dropped: list[Dropped]
    judges: dict[str, dict[str, Any]]
    agreement: dict[str, Any]


async def judge_candidates(
    judges: dict[str, PairwiseJudge],
    candidates: Sequence[Candidate],
    spec: EnsembleSpec,
    batch_size: int = 64,
    progress: Callable[[int], None] | None = None,
) -> JudgingResult:
    """Every judge on every candidate (judges concurrently), folded and combined (module docstring)."""
    names = list(judges)
    per_judge = await asyncio.gather(
        *(ask_judge(n, judges[n], candidates, batch_size, progress) for n in names)
    )
    stats = {n: JudgeStats() for n in names}
    outcomes, kept, dropped = [], [], []
    for i, candidate in enumerate(candidates):
        votes = [per_judge[j][i] for j in range(len(names))]
        for vote in votes:
            stats[vote.judge].add(vote)
        outcome = combine(votes, spec)
        outcomes.append(outcome)
        reason = outcome.reason or label_problem(candidate, outcome, spec)
        if reason is None:
            kept.append(Judged(candidate, outcome))
        else:
            detail = {"votes": {v.judge: v.as_meta(None) for v in votes}, "agreement": outcome.agreement}
            dropped.append(Dropped(STAGE, reason, candidate, None, detail))
    described = {n: describe(judges[n]) for n in names}
    report = {n: stats[n].as_report(described[n]) for n in names}
    return JudgingResult(kept, dropped, report, agreement_report(names, outcomes))


def label_problem(candidate: Candidate, outcome: PairOutcome, spec: EnsembleSpec) -> str | None:
    """ "label_flip" when a labelled candidate's judges prefer the other side and the ensemble filters."""
    flipped = candidate.label is not None and outcome.winner != candidate.label
    return "label_flip" if flipped and spec.on_source_label == "filter" else None


def describe(judge: PairwiseJudge) -> dict[str, Any]:
    """`judge.describe()` as JSON (a value that is not JSON becomes its text)."""
    return json.loads(json.dumps(judge.describe(), default=str))


# -- judges ---------------------------------------------------------------------------------------------


class ScorerJudge:
    """A registered reward scorer as a `PairwiseJudge`: both completions scored in-process (off the event
    loop, with the scorer's timeouts), the higher preferred, a difference within `tie_margin` a tie, a
    failed score an error. Each distinct (prompt, completion, reference) is scored once, so the second
    order costs nothing (and a deterministic scorer is never position-biased)."""

    def __init__(
        self, name: str, spec: ScorerJudgeSpec, pipeline_file: str | None = None, policy: Any | None = None
    ) -> None:
        """`policy` (a `ScorerPolicy`): the operator's, e.g. a coordinator build's; None allows user code
        from the pipeline file's folder and the modules the spec names, as `rlfabric up` does."""
        from rlfabric.reward.check import allowed_functions
        from rlfabric.reward.scorers import build_scorer
        from rlfabric.reward.scorers.policy import ScorerPolicy
        from rlfabric.reward.spec import spec_from_reward_spec

        self.name, self.spec = name, spec
        self.scorer_spec = spec_from_reward_spec(spec)
        if policy is None:
            policy = ScorerPolicy(allowed_functions=tuple(allowed_functions(spec, pipeline_file)))
        self.scorer = build_scorer(self.scorer_spec.name, self.scorer_spec.params, policy)
        self.scores: dict[str, Any] = {}

    async def judge(self, comparisons: Sequence[Comparison]) -> list[Judgement]:
        await self.score_missing(comparisons)
        return [self.compare(c) for c in comparisons]

    async def score_missing(self, comparisons: Sequence[Comparison]) -> None:
        from rlfabric.reward.scorers import ScoreInput, arun_scorer

        todo: dict[str, tuple[Prompt, str, str]] = {}
        for c in comparisons:
            for text in (c.first, c.second):
                key = score_key(c.prompt, text, c.reference)
                if key not in self.scores:
                    todo[key] = (c.prompt, text, c.reference)
        keys = list(todo)
        for start in range(0, len(keys), self.spec.batch_size):
            batch = keys[start : start + self.spec.batch_size]
            items = [ScoreInput(str(i), *todo[k]) for i, k in enumerate(batch)]
            results = await arun_scorer(self.scorer, items, item_timeout_s=self.spec.item_timeout_s)
            self.scores.update(zip(batch, results, strict=True))

    def compare(self, c: Comparison) -> Judgement:
        a = self.scores[score_key(c.prompt, c.first, c.reference)]
        b = self.scores[score_key(c.prompt, c.second, c.reference)]
        if a.status != "ok" or b.status != "ok":
            failed = a if a.status != "ok" else b
            return Judgement("error", f"{failed.status}: {failed.message}"[:DETAIL_CHARS])
        detail = f"{a.reward:.6g} vs {b.reward:.6g}"
        if abs(a.reward - b.reward) <= self.spec.tie_margin:
            return Judgement("tie", detail)
        return Judgement("first" if a.reward > b.reward else "second", detail)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "scorer",
            "scorer": self.scorer_spec.name,
            "version": self.scorer.version,
            "params": self.scorer_spec.params,
            "tie_margin": self.spec.tie_margin,
        }

    def close(self) -> None:
        self.scorer.close()


def score_key(prompt: Prompt, completion: str, reference: str) -> str:
    return json.dumps([prompt, completion, reference], sort_keys=True, ensure_ascii=False)


def make_judges(
    spec: PipelineSpec,
    pipeline_file: str | None = None,
    policy: Any | None = None,
    generators: Callable[[Any], Any] | None = None,
) -> dict[str, PairwiseJudge]:
    """The pipeline's judges by name; a scorer that does not build raises `InvalidScorerSpec` naming
    `judges[i].<field>` (the llm judge is imported only when one is declared). `policy` (a
    `ScorerPolicy`) replaces the default one of scorer judges; `generators` gives an llm judge a
    generator for its spec that the caller owns (shared with other stages)."""
    from rlfabric.reward.scorers import InvalidScorerSpec

    judges: dict[str, PairwiseJudge] = {}
    for i, (name, entry) in enumerate(zip(spec.judge_names(), spec.judges, strict=True)):
        if isinstance(entry, ScorerJudgeSpec):
            try:
                judges[name] = ScorerJudge(name, entry, pipeline_file, policy)
            except InvalidScorerSpec as exc:
                field_name = "scorer" if exc.field == "name" else exc.field
                raise InvalidScorerSpec(f"judges[{i}].{field_name}", exc.reason) from None
        else:
            from rlfabric.prefs.llm_judge import LlmPairwiseJudge

            llm = entry.spec.model_copy(update={"name": name})
            shared = generators(llm.generator) if generators is not None else None
            judges[name] = LlmPairwiseJudge(llm, shared)
    return judges


async def close_judges(judges: dict[str, PairwiseJudge]) -> None:
    """Release what the judges hold (a scorer's model, a client): `close()`, awaited when async."""
    for judge in judges.values():
        closer = getattr(judge, "close", None)
        if closer is not None:
            result = closer()
            if inspect.isawaitable(result):
                await result
