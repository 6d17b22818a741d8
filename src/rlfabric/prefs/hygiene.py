"""Hygiene: the rules that remove candidate pairs before anyone judges them, each removal recorded.

Applied in this order to the candidates in build order; a rule sees only what the earlier ones kept,
and the later of two colliding rows is the one dropped:

1. `identical`       the two completions are equal after normalisation (no preference to learn)
2. `exact_duplicate` the same prompt and the same two completions after normalisation (either order,
                     the same label); `conflict`: the same pair with the opposite label, both dropped
3. `near_duplicate_within_prompt` / `near_duplicate_across_prompts`: MinHash + LSH (`datasketch`) over
                     word shingles, confirmed by the exact Jaccard similarity of the shingle sets: each of
                     one pair's completions is a near-duplicate of a different one of the other's, and
                     the prompts are equal (within) or near-duplicates (across)
4. `contaminated`    a row overlaps a named evaluation set (word n-grams, `DecontaminateSpec`)

Normalisation (`normalize`): Unicode NFKC, case folding, optionally no punctuation, whitespace collapsed.
Shingles and n-grams are made of words (`\\w+` runs) of the case-folded NFKC text.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfabric.data import Source, read_records
from rlfabric.prefs.sources import Candidate, Dropped
from rlfabric.prefs.spec import DecontaminateSpec, HygieneSpec, NearDupSpec, NormalizeSpec
from rlfabric.prefs.types import Prompt

STAGE = "hygiene"
WORD = re.compile(r"\w+")
SPACE = re.compile(r"\s+")
LSH_WEIGHTS = (0.1, 0.9)
"""MinHashLSH's (false positive, false negative) weights: tuned for recall, since every LSH candidate is
confirmed by its exact Jaccard similarity (128 permutations, threshold 0.7: 20 bands of 6 rows; a pair
at similarity 0.7 is found with probability 0.92, at 0.8 with 0.998)."""
CONFLICT = "the same pair with the opposite label"
MAX_ITEMS_PER_GRAM = 16
"""Evaluation items remembered per n-gram (enough to find the closest; common n-grams stay cheap)."""


# -- text -----------------------------------------------------------------------------------------------


def prompt_text(prompt: Prompt) -> str:
    """A prompt as plain text: chat messages one per line as `role: content`."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', 'user')}: {content_text(m.get('content', ''))}" for m in prompt)


def content_text(content: Any) -> str:
    """A message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def value_text(value: Any) -> str:
    """Any column value as text (strings, chat messages, other values as JSON-ish text)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return prompt_text(value)
    return "" if value is None else str(value)


def normalize(text: str, spec: NormalizeSpec) -> str:
    """The text exact comparisons compare (see the module docstring)."""
    text = unicodedata.normalize("NFKC", text)
    if spec.lowercase:
        text = text.casefold()
    if spec.strip_punctuation:
        text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))
    return SPACE.sub(" ", text).strip()


def words(text: str) -> list[str]:
    """The words of a text, case-folded (shingles and n-grams are made of these)."""
    return WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def grams(tokens: Sequence[str], n: int) -> set[str]:
    """The word n-grams of `tokens`; a text shorter than n words is one gram (the whole text)."""
    if len(tokens) <= n:
        return {" ".join(tokens)} if tokens else set()
    return {" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


# -- results --------------------------------------------------------------------------------------------


@dataclass
class HygieneResult:
    """The candidates kept (in order), the ones dropped with their reasons, and the count of each rule."""

    kept: list[Candidate]
    dropped: list[Dropped] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(d.rule for d in self.dropped).items()))


def run_hygiene(
    candidates: Sequence[Candidate],
    spec: HygieneSpec,
    eval_sets: Sequence[EvalSet] = (),
    progress: Callable[[str], None] | None = None,
) -> HygieneResult:
    """Every rule of the module docstring, in order, on `candidates` (their `index` set)."""
    result = HygieneResult(list(candidates))
    steps: list[tuple[str, Callable[[list[Candidate]], tuple[list[Candidate], list[Dropped]]]]] = []
    if spec.drop_identical:
        steps.append(("identical", lambda c: drop_identical(c, spec.normalize)))
    if spec.exact_dedup:
        steps.append(("exact duplicates", lambda c: drop_exact_duplicates(c, spec.normalize)))
    if spec.near_dup.enabled:
        steps.append(("near-duplicates", lambda c: drop_near_duplicates(c, spec.near_dup)))
    if eval_sets:
        steps.append(("decontamination", lambda c: decontaminate(c, eval_sets)))
    for label, step in steps:
        if progress is not None:
            progress(label)
        result.kept, dropped = step(result.kept)
        result.dropped += dropped
    return result


# -- exact ----------------------------------------------------------------------------------------------


def drop_identical(
    candidates: Sequence[Candidate], norm: NormalizeSpec
) -> tuple[list[Candidate], list[Dropped]]:
    """Rule 1: a pair whose two completions are equal after normalisation."""
    kept, dropped = [], []
    for c in candidates:
        if normalize(c.first, norm) == normalize(c.second, norm):
            dropped.append(Dropped(STAGE, "identical", c))
        else:
            kept.append(c)
    return kept, dropped


def drop_exact_duplicates(
    candidates: Sequence[Candidate], norm: NormalizeSpec
) -> tuple[list[Candidate], list[Dropped]]:
    """Rule 2: the first of each (prompt, {completions}) is kept; a later copy with the same preferred
    completion (or unlabelled) is an `exact_duplicate`, one with the other preferred is a `conflict` and
    takes the first down with it."""
    first_of: dict[tuple[str, ...], Candidate] = {}
    dropped: list[Dropped] = []
    conflicted: set[int] = set()
    for c in candidates:
        a, b = normalize(c.first, norm), normalize(c.second, norm)
        key = (normalize(prompt_text(c.prompt), norm), *sorted((a, b)))
        seen = first_of.get(key)
        if seen is None:
            first_of[key] = c
            continue
        if preferred(seen, norm) != preferred(c, norm):
            dropped.append(Dropped(STAGE, "conflict", c, seen, {"reason": CONFLICT}))
            if seen.index not in conflicted:
                conflicted.add(seen.index)
                dropped.append(Dropped(STAGE, "conflict", seen, c, {"reason": CONFLICT}))
        else:
            dropped.append(Dropped(STAGE, "exact_duplicate", c, seen))
    drop = {d.candidate.index for d in dropped}
    return [c for c in candidates if c.index not in drop], dropped


def preferred(c: Candidate, norm: NormalizeSpec) -> str | None:
    """The normalised text of the side the source prefers (None: unlabelled)."""
    if c.label is None:
        return None
    return normalize(c.first if c.label == "first" else c.second, norm)


# -- near-duplicates ------------------------------------------------------------------------------------


class TextIndex:
    """Distinct texts with their shingle sets and MinHashes in one MinHash-LSH index; `neighbours(t)`
    are the texts whose shingle sets' exact Jaccard similarity with t's reaches the threshold, among the
    LSH's candidates (t itself included)."""

    def __init__(self, texts: Iterable[str], spec: NearDupSpec) -> None:
        from datasketch import MinHash, MinHashLSH

        self.spec = spec
        self.ids: dict[str, int] = {}
        for text in texts:
            self.ids.setdefault(text, len(self.ids))
        self.shingles = [grams(words(t), spec.shingle_size) for t in self.ids]
        encoded = [[s.encode() for s in sh] for sh in self.shingles]
        hashes = MinHash.bulk(encoded, num_perm=spec.num_perm, seed=spec.seed)
        self.lsh = MinHashLSH(threshold=spec.threshold, num_perm=spec.num_perm, weights=LSH_WEIGHTS)
        with self.lsh.insertion_session() as session:
            for i, mh in enumerate(hashes):
                session.insert(i, mh)
        self.hashes = hashes
        self._near: dict[int, dict[int, float]] = {}

    def id(self, text: str) -> int:
        return self.ids[text]

    def neighbours(self, i: int) -> dict[int, float]:
        """Text id -> exact Jaccard similarity, for every confirmed near-duplicate of text `i`."""
        if i not in self._near:
            found = {i: 1.0}
            for j in self.lsh.query(self.hashes[i]):
                sim = jaccard(self.shingles[i], self.shingles[j])
                if sim >= self.spec.threshold:
                    found[int(j)] = sim
            self._near[i] = found
        return self._near[i]


@dataclass(frozen=True)
class Keys:
    """A candidate's texts as ids of the two `TextIndex`es: prompt, first and second completion."""

    prompt: int
    exact_prompt: str
    """The prompt's words: equal ones are one prompt ("within")."""
    first: int
    second: int


def drop_near_duplicates(
    candidates: Sequence[Candidate], spec: NearDupSpec
) -> tuple[list[Candidate], list[Dropped]]:
    """Rule 3 (module docstring); the earlier row of a near-duplicate pair is kept."""
    prompts = [prompt_text(c.prompt) for c in candidates]
    prompt_index = TextIndex(prompts, spec)
    text_index = TextIndex([t for c in candidates for t in (c.first, c.second)], spec)
    kept_by_prompt: dict[int, list[tuple[Candidate, Keys]]] = defaultdict(list)
    kept, dropped = [], []
    for c, p in zip(candidates, prompts, strict=True):
        keys = Keys(prompt_index.id(p), " ".join(words(p)), text_index.id(c.first), text_index.id(c.second))
        hit = near_duplicate_of(keys, kept_by_prompt, prompt_index, text_index, spec)
        if hit is None:
            kept.append(c)
            kept_by_prompt[keys.prompt].append((c, keys))
        else:
            rule, other, detail = hit
            dropped.append(Dropped(STAGE, rule, c, other, detail))
    return kept, dropped


def near_duplicate_of(
    keys: Keys,
    kept_by_prompt: dict[int, list[tuple[Candidate, Keys]]],
    prompt_index: TextIndex,
    text_index: TextIndex,
    spec: NearDupSpec,
) -> tuple[str, Candidate, dict[str, Any]] | None:
    """The rule, the kept candidate and the similarities of the first near-duplicate of `keys`, if any."""
    near_first = text_index.neighbours(keys.first)
    near_second = text_index.neighbours(keys.second)
    for prompt_id, prompt_sim in prompt_index.neighbours(keys.prompt).items():
        for other, their in kept_by_prompt.get(prompt_id, []):
            within = their.exact_prompt == keys.exact_prompt
            if (spec.scope == "within_prompt" and not within) or (spec.scope == "across_prompts" and within):
                continue
            sims = completion_match(their, near_first, near_second)
            if sims is None:
                continue
            rule = "near_duplicate_within_prompt" if within else "near_duplicate_across_prompts"
            detail = {"prompt_similarity": round(prompt_sim, 4), "completion_similarity": sims}
            return rule, other, detail
    return None


def completion_match(
    their: Keys, near_first: dict[int, float], near_second: dict[int, float]
) -> list[float] | None:
    """The similarities of our first and second completion to the other's matching ones, when each of
    ours is a near-duplicate of a different one of theirs (either order); else None."""
    for a, b in ((their.first, their.second), (their.second, their.first)):
        if a in near_first and b in near_second:
            return [round(near_first[a], 4), round(near_second[b], 4)]
    return None


# -- decontamination ------------------------------------------------------------------------------------


@dataclass
class Overlap:
    """How much one text overlaps an evaluation set: the share of its n-grams found in the set, and the
    share of the closest evaluation item's n-grams found in it (that item's row number)."""

    row_overlap: float
    eval_overlap: float
    item: int | None

    @property
    def worst(self) -> float:
        return max(self.row_overlap, self.eval_overlap)


class EvalSet:
    """A named evaluation set's word n-grams, each mapped to (some of) the items holding it."""

    def __init__(self, spec: DecontaminateSpec, texts: Sequence[str]) -> None:
        self.spec = spec
        self.size = len(texts)
        self.items_of: dict[str, list[int]] = defaultdict(list)
        self.item_grams: list[int] = []
        for item, text in enumerate(texts):
            its = grams(words(text), spec.ngram)
            self.item_grams.append(len(its))
            for gram in its:
                holders = self.items_of[gram]
                if len(holders) < MAX_ITEMS_PER_GRAM:
                    holders.append(item)

    @classmethod
    def read(cls, spec: DecontaminateSpec, index: int) -> EvalSet:
        """The set's rows through `rlfabric.data`, the text of `spec.fields` joined per row."""
        from rlfabric.data import DatasetError

        source = Source(
            f"hygiene.decontaminate[{index}]", spec.path, spec.split, spec.config_name, spec.revision
        )
        rows = read_records(source)
        for name in spec.fields:
            if rows and all(r.get(name) is None for r in rows):
                raise DatasetError(f"{source.field}.fields: no row of {spec.path} has a column {name!r}")
        return cls(spec, ["\n".join(value_text(r.get(f)) for f in spec.fields) for r in rows])

    def overlap(self, text: str) -> Overlap:
        mine = grams(words(text), self.spec.ngram)
        if not mine:
            return Overlap(0.0, 0.0, None)
        hits: Counter[int] = Counter()
        found = 0
        for gram in mine:
            holders = self.items_of.get(gram)
            if holders:
                found += 1
                hits.update(holders)
        best, best_share = None, 0.0
        for item, count in hits.items():
            share = count / max(self.item_grams[item], 1)
            if share > best_share or (share == best_share and best is not None and item < best):
                best, best_share = item, share
        return Overlap(found / len(mine), best_share, best)


def decontaminate(
    candidates: Sequence[Candidate], eval_sets: Sequence[EvalSet]
) -> tuple[list[Candidate], list[Dropped]]:
    """Rule 4: a row whose checked texts overlap an evaluation set at its threshold or above is dropped,
    with the set's name, the text, both overlaps and the closest evaluation row (0-based)."""
    kept, dropped = [], []
    for c in candidates:
        hit = contamination(c, eval_sets)
        if hit is None:
            kept.append(c)
        else:
            dropped.append(Dropped(STAGE, "contaminated", c, None, hit))
    return kept, dropped


def checked_texts(c: Candidate, part: str) -> list[str]:
    """The texts of a row that `check` entry `part` names: the prompt, or the completion the source
    prefers ("chosen") or not ("rejected"); both completions when the row is not labelled yet."""
    if part == "prompt":
        return [prompt_text(c.prompt)]
    if c.label is None:
        return [c.first, c.second]
    chosen_first = c.label == "first"
    return [c.first if chosen_first == (part == "chosen") else c.second]


def contamination(c: Candidate, eval_sets: Sequence[EvalSet]) -> dict[str, Any] | None:
    for ev in eval_sets:
        for part in ev.spec.check:
            found = max((ev.overlap(t) for t in checked_texts(c, part)), key=lambda o: o.worst)
            if found.worst >= ev.spec.threshold:
                return {
                    "eval_set": ev.spec.name,
                    "field": part,
                    "row_overlap": round(found.row_overlap, 4),
                    "eval_overlap": round(found.eval_overlap, 4),
                    "eval_row": found.item,
                    "ngram": ev.spec.ngram,
                }
    return None
