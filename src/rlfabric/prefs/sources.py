"""Candidate pairs from a pipeline's source: a pairs file, a ratings file, or completions sampled from a
generator; and the drop records every later stage writes.

A `Candidate` is a pair before the judges: two completions of one prompt in the source's order (`first`,
`second`) and the source's label when it has one. Files are read through `rlfabric.data`, as runs read
their datasets; a column the source names is checked on every row (the error names the field and the
row, never the row's data).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Literal

from rlfabric.data import DatasetError, Source, read_records
from rlfabric.prefs.spec import FileSource, SampleSource
from rlfabric.prefs.types import Prompt

Side = Literal["first", "second"]


@dataclass
class Candidate:
    """Two completions of one prompt in the source's order. `label` is the source's preferred side
    (a pairs or ratings file, CAI), None when the judges must decide (a sampling source). `index` is the
    candidate's position among all of a build's candidates: drop records name rows by it."""

    prompt: Prompt
    first: str
    second: str
    label: Side | None = None
    reference: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    """Provenance (JSON): `source` ("file", "sample", "cai") and where in it (`row`, `rows`,
    `completions`, `scores`), a CAI chain."""
    index: int = -1

    def as_record(self) -> dict[str, Any]:
        """The candidate as JSON (drop records)."""
        return {
            "index": self.index,
            "prompt": self.prompt,
            "first": self.first,
            "second": self.second,
            "label": self.label,
            "meta": self.meta,
        }


@dataclass
class Dropped:
    """A candidate a stage removed: which `rule` (e.g. "exact_duplicate", "contaminated", "tie"), the
    other candidate it collided with, and the rule's evidence (`detail`: an evaluation
    set's name and overlap, a similarity, the judges' votes)."""

    stage: str
    rule: str
    candidate: Candidate
    other: Candidate | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        """One line of the version's `dropped.jsonl`: the row, and the other row as its index and
        provenance."""
        other = None if self.other is None else {"index": self.other.index, "meta": self.other.meta}
        return {
            "stage": self.stage,
            "rule": self.rule,
            "other": other,
            "detail": self.detail,
            "row": self.candidate.as_record(),
        }


@dataclass
class SourceResult:
    """What the source stage made: candidates, the prompts with one answer each for CAI, its counts and
    the generator's description (sampling)."""

    candidates: list[Candidate]
    counts: dict[str, int]
    cai_answers: list[tuple[Prompt, str, dict[str, Any]]] = field(default_factory=list)
    """(prompt, answer to revise, provenance) per prompt, for the CAI stage."""
    generator: dict[str, Any] | None = None


def prompt_key(prompt: Prompt) -> str:
    """A prompt as a dict key (chat messages as canonical JSON)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def text_value(value: Any) -> str:
    """A completion column's value as text: a string, or the content of TRL's one-message form."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return str(value[-1].get("content", ""))
    raise TypeError("not a string or a list of messages")


# -- files ----------------------------------------------------------------------------------------------


def read_rows(source: Source, limit: int | None) -> list[dict[str, Any]]:
    rows = read_records(source)
    if not rows:
        raise DatasetError(f"{source.field}.path {source.path}: the split {source.split!r} is empty")
    return rows[:limit] if limit is not None else rows


def column(
    rows: Sequence[dict[str, Any]], source: Source, field_name: str, name: str, text: bool = True
) -> list[Any]:
    """Column `name` of every row (`field_name` is the spec field naming it): text, or any value."""
    values = []
    for number, row in enumerate(rows, 1):
        value = row.get(name)
        if value is None:
            raise DatasetError(f"source.{field_name}: row {number} of {source.path} has no column {name!r}")
        if text:
            try:
                value = text_value(value)
            except TypeError:
                raise DatasetError(
                    f"source.{field_name}: row {number} of {source.path}: column {name!r} is not text"
                ) from None
        values.append(value)
    return values


def read_file_source(spec: FileSource) -> SourceResult:
    """The candidates of a pairs or ratings file."""
    source = Source("source", spec.path, spec.split, spec.name, spec.revision)
    rows = read_rows(source, spec.limit)
    prompts = column(rows, source, "prompt_field", spec.prompt_field, text=False)
    references = references_of(rows, spec.reference_field)
    if spec.format == "pairs":
        return pairs_from_rows(rows, source, spec, prompts, references)
    return pairs_from_ratings(rows, source, spec, prompts, references)


def references_of(rows: Sequence[dict[str, Any]], name: str | None) -> list[str]:
    if name is None:
        return [""] * len(rows)
    return ["" if r.get(name) is None else str(r.get(name)) for r in rows]


def pairs_from_rows(
    rows: Sequence[dict[str, Any]], source: Source, spec: FileSource, prompts: list[Any], refs: list[str]
) -> SourceResult:
    """One labelled candidate per row: chosen first."""
    chosen = column(rows, source, "chosen_field", spec.chosen_field)
    rejected = column(rows, source, "rejected_field", spec.rejected_field)
    candidates = [
        Candidate(p, c, r, "first", ref, {"source": "file", "row": i})
        for i, (p, c, r, ref) in enumerate(zip(prompts, chosen, rejected, refs, strict=True))
    ]
    answers = [(c.prompt, c.second, {"source": "file", "row": c.meta["row"]}) for c in candidates]
    return SourceResult(candidates, {"rows": len(rows), "candidates": len(candidates)}, answers)


def pairs_from_ratings(
    rows: Sequence[dict[str, Any]], source: Source, spec: FileSource, prompts: list[Any], refs: list[str]
) -> SourceResult:
    """Pairs of each prompt's scored completions, the higher first (`spec.pairing`)."""
    completions = column(rows, source, "completion_field", spec.completion_field)
    raw_scores = column(rows, source, "score_field", spec.score_field, text=False)
    scores = [score_of(value, number, source) for number, value in enumerate(raw_scores, 1)]
    by_prompt: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_prompt[prompt_key(p)].append(i)
    candidates: list[Candidate] = []
    answers = []
    ties = 0
    for indexes in by_prompt.values():
        ranked = sorted(indexes, key=lambda i: (-scores[i], i))
        pairs, skipped = rated_pairs(ranked, scores, spec)
        ties += skipped
        for hi, lo in pairs:
            meta = {"source": "file", "rows": [hi, lo], "scores": [scores[hi], scores[lo]]}
            candidates.append(
                Candidate(prompts[hi], completions[hi], completions[lo], "first", refs[hi], meta)
            )
        worst = ranked[-1]
        answers.append((prompts[worst], completions[worst], {"source": "file", "row": worst}))
    counts = {"rows": len(rows), "prompts": len(by_prompt), "candidates": len(candidates), "score_ties": ties}
    return SourceResult(candidates, counts, answers)


def score_of(value: Any, number: int, source: Source) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DatasetError(f"source.score_field: row {number} of {source.path}: the score is not a number")
    return float(value)


def rated_pairs(
    ranked: list[int], scores: list[float], spec: FileSource
) -> tuple[list[tuple[int, int]], int]:
    """(higher, lower) row pairs of one prompt's rows `ranked` best first, and the pairs skipped as ties."""
    gap = spec.min_score_gap
    if spec.pairing == "best_worst":
        if len(ranked) < 2:
            return [], 0
        best, worst = ranked[0], ranked[-1]
        return ([(best, worst)], 0) if scores[best] - scores[worst] > gap else ([], 1)
    pairs = [(a, b) for a, b in combinations(ranked, 2) if scores[a] - scores[b] > gap]
    return pairs, len(ranked) * (len(ranked) - 1) // 2 - len(pairs)


# -- sampling -------------------------------------------------------------------------------------------


async def sample_source(
    spec: SampleSource, progress: Callable[[int], None] | None = None, generator: Any | None = None
) -> SourceResult:
    """`k` completions of each prompt from the generator, paired (`spec.pairing`), unlabelled. A given
    `generator` (shared with other stages) is used and left open; else one is made from the spec and
    closed."""
    from rlfabric.prefs.generation import make_generator

    source = Source("source", spec.prompts, spec.split, spec.name, spec.revision)
    rows = read_rows(source, spec.limit)
    prompts = column(rows, source, "prompt_field", spec.prompt_field, text=False)
    refs = references_of(rows, spec.reference_field)
    owned = generator is None
    generator = make_generator(spec.generator) if generator is None else generator
    try:
        completions, failed = await generate_all(generator, prompts, spec, progress)
        described = generator.describe()
    finally:
        if owned:
            await generator.close()
    candidates, answers = sampled_pairs(prompts, refs, completions, spec.pairing)
    counts = {
        "prompts": len(prompts),
        "generation_errors": failed,
        "completions": sum(len(c) for c in completions if c is not None),
        "candidates": len(candidates),
    }
    return SourceResult(candidates, counts, answers, described)


async def generate_all(
    generator: Any, prompts: list[Any], spec: SampleSource, progress: Callable[[int], None] | None
) -> tuple[list[list[str] | None], int]:
    """`k` completions of each prompt (None for a prompt the generator failed on) and the failures."""
    from rlfabric.prefs.generation import GenerationError

    out: list[list[str] | None] = []
    failed = 0
    for start in range(0, len(prompts), spec.batch_size):
        batch = prompts[start : start + spec.batch_size]
        seed = None if spec.seed is None else spec.seed + start * spec.k
        outcomes = await generator.generate_each(
            batch, n=spec.k, max_tokens=spec.max_tokens, temperature=spec.temperature, seed=seed
        )
        if len(outcomes) != len(batch):
            raise RuntimeError(f"the generator answered {len(outcomes)} prompts for {len(batch)}")
        for outcome in outcomes:
            ok = not isinstance(outcome, GenerationError) and len(outcome) == spec.k
            out.append(list(outcome) if ok else None)
            failed += not ok
        if progress is not None:
            progress(len(batch))
    return out, failed


def sampled_pairs(
    prompts: list[Any], refs: list[str], completions: list[list[str] | None], pairing: str
) -> tuple[list[Candidate], list[tuple[Prompt, str, dict[str, Any]]]]:
    """The pairs of each prompt's completions (`pairing`), and each prompt's first completion for CAI;
    a prompt without completions (the generator failed) gives none."""
    candidates = []
    answers = []
    for row, (prompt, ref, texts) in enumerate(zip(prompts, refs, completions, strict=True)):
        if texts is None:
            continue
        if pairing == "all":
            indexes = list(combinations(range(len(texts)), 2))
        else:
            indexes = [(i, i + 1) for i in range(0, len(texts) - 1, 2)]
        for i, j in indexes:
            meta = {"source": "sample", "row": row, "completions": [i, j]}
            candidates.append(Candidate(prompt, texts[i], texts[j], None, ref, meta))
        answers.append((prompt, texts[0], {"source": "sample", "row": row, "completion": 0}))
    return candidates, answers
