"""Hygiene catches what is planted and keeps what is clean: exact duplicates (after normalisation) and
conflicting labels, identical pairs, near-duplicates (a few words changed) within a prompt and across
prompts, and rows overlapping a named evaluation set; every drop names its rule and the other row."""

from __future__ import annotations

from pathlib import Path

from rlfabric.prefs.hygiene import EvalSet, normalize, run_hygiene
from rlfabric.prefs.sources import Candidate
from rlfabric.prefs.spec import DecontaminateSpec, HygieneSpec, NearDupSpec, NormalizeSpec

LONG_A = (
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and release oxygen; it happens mostly in the leaves, inside the chloroplasts, where the "
    "pigment chlorophyll absorbs red and blue light and passes its energy on to the reactions."
)
LONG_B = (
    "Plants get all of their food from the soil through their roots, which is why they need to be "
    "watered and given fertiliser; sunlight only keeps them warm and has nothing to do with how they "
    "grow, and leaves are mainly there to protect the stem from the rain and the wind."
)
CLEAN = [
    ("Explain in a few sentences how green plants make their own food from sunlight.", LONG_A, LONG_B),
    ("What is the capital of France?", "The capital of France is Paris.", "France has no capital city."),
    ("Name a primary colour.", "Red is a primary colour.", "Green is the only colour there is."),
    ("Why is the sky blue?", "Air scatters blue light more than red light.", "Because the sea is blue."),
]
EVAL = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
    "many clips did Natalia sell altogether in April and May?",
    "Weng earns 12 dollars an hour for babysitting. Yesterday she did 50 minutes of babysitting. How much "
    "did she earn?",
]


def change(text: str, *swaps: tuple[str, str]) -> str:
    for old, new in swaps:
        assert old in text
        text = text.replace(old, new, 1)
    return text


def numbered(rows: list[tuple[object, str, str]]) -> list[Candidate]:
    candidates = [Candidate(p, c, r, "first", meta={"row": i}) for i, (p, c, r) in enumerate(rows)]  # type: ignore[arg-type]
    for i, c in enumerate(candidates):
        c.index = i
    return candidates


def eval_set(**overrides: object) -> EvalSet:
    spec = DecontaminateSpec.model_validate({"name": "gsm", "path": "unused.jsonl", **overrides})
    return EvalSet(spec, EVAL)


def by_index(result: object) -> dict[int, object]:
    return {d.candidate.index: d for d in result.dropped}  # type: ignore[attr-defined]


def test_clean_rows_all_survive() -> None:
    result = run_hygiene(numbered(CLEAN), HygieneSpec(), [eval_set()])
    assert [c.index for c in result.kept] == [0, 1, 2, 3]
    assert result.dropped == []


def test_planted_exact_duplicates_and_identical_pairs_are_caught() -> None:
    p, c, r = CLEAN[1]
    rows = [
        *CLEAN,
        (p, c, r),  # 4: verbatim copy of 1
        ("  what is the CAPITAL of france?", c.upper(), "france  has no capital city."),  # 5: case/space
        ("Say hi.", "Hello there!", "hello   THERE!"),  # 6: identical after normalisation
        (CLEAN[2][0], CLEAN[2][2], CLEAN[2][1]),  # 7: row 2 with the opposite label
    ]
    result = run_hygiene(numbered(rows), HygieneSpec(near_dup=NearDupSpec(enabled=False)))
    dropped = by_index(result)
    assert dropped[4].rule == dropped[5].rule == "exact_duplicate"  # type: ignore[attr-defined]
    assert dropped[4].other.index == 1 and dropped[5].other.index == 1  # type: ignore[attr-defined]
    assert dropped[6].rule == "identical"  # type: ignore[attr-defined]
    assert dropped[7].rule == dropped[2].rule == "conflict"  # type: ignore[attr-defined]
    assert [c.index for c in result.kept] == [0, 1, 3]
    assert result.counts == {"conflict": 2, "exact_duplicate": 2, "identical": 1}


def test_planted_near_duplicates_within_and_across_prompts_are_caught() -> None:
    p, a, b = CLEAN[0]
    within = (
        p,
        change(a, ("green plants", "plants"), ("mostly", "mainly")),
        change(b, ("all of their", "all their")),
    )
    across = (
        "Explain in a few sentences how green plants make their food from sunlight.",
        change(a, ("passes its energy on", "hands its energy on")),
        b,
    )
    result = run_hygiene(numbered([*CLEAN, within, across]), HygieneSpec())
    dropped = by_index(result)
    assert dropped[4].rule == "near_duplicate_within_prompt"  # type: ignore[attr-defined]
    assert dropped[5].rule == "near_duplicate_across_prompts"  # type: ignore[attr-defined]
    for index in (4, 5):
        record = dropped[index].as_record()  # type: ignore[attr-defined]
        assert record["other"]["index"] == 0 and min(record["detail"]["completion_similarity"]) >= 0.7
    assert [c.index for c in result.kept] == [0, 1, 2, 3]


def test_near_duplicate_scope_limits_what_is_dropped() -> None:
    p, a, b = CLEAN[0]
    within = (p, change(a, ("mostly", "mainly")), b)
    only_across = HygieneSpec(near_dup=NearDupSpec(scope="across_prompts"))
    assert run_hygiene(numbered([*CLEAN, within]), only_across).dropped == []


def test_pairs_sharing_one_completion_are_not_near_duplicates() -> None:
    """k sampled completions paired all ways share completions: (a, b) and (a, c) are different pairs."""
    p, a, b = CLEAN[0]
    c = "The leaves catch sunlight, and the plant turns light, water and air into sugar it can use."
    result = run_hygiene(numbered([(p, a, b), (p, a, c), (p, b, c)]), HygieneSpec())
    assert result.dropped == []


def test_planted_eval_contamination_is_caught_verbatim_and_inside_a_longer_prompt() -> None:
    rows = [
        *CLEAN,
        (EVAL[0], "She sold 72 clips.", "She sold 48 clips."),
        ("You are a careful tutor; solve step by step. " + EVAL[1] + " Answer with a number.", "10", "12"),
        ("Natalia sold clips in April. How many?", "Some.", "None."),  # shares a few words only
    ]
    result = run_hygiene(numbered(rows), HygieneSpec(), [eval_set()])
    dropped = by_index(result)
    assert sorted(dropped) == [4, 5]
    first, second = dropped[4].detail, dropped[5].detail  # type: ignore[attr-defined]
    assert first["eval_set"] == "gsm" and first["eval_row"] == 0 and first["row_overlap"] == 1.0
    assert second["eval_row"] == 1 and second["eval_overlap"] == 1.0 and second["row_overlap"] < 1.0
    assert [c.index for c in result.kept] == [0, 1, 2, 3, 6]


def test_contamination_in_completions_is_checked_when_asked() -> None:
    rows = [*CLEAN, ("Give me a word problem.", EVAL[0], "No.")]
    assert run_hygiene(numbered(rows), HygieneSpec(), [eval_set()]).dropped == []
    result = run_hygiene(numbered(rows), HygieneSpec(), [eval_set(check=["prompt", "chosen"])])
    assert [(d.rule, d.detail["field"]) for d in result.dropped] == [("contaminated", "chosen")]


def test_eval_sets_are_read_through_rlfabric_data(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(f'{{"question": "{q}", "answer": "1"}}\n' for q in EVAL))
    ev = EvalSet.read(DecontaminateSpec(name="gsm", path=str(path), fields=["question"]), 0)
    assert ev.size == 2 and ev.overlap(EVAL[1]).row_overlap == 1.0


def test_normalisation() -> None:
    spec = NormalizeSpec()
    assert normalize("  \uff28ello\n\tWORLD ", spec) == "hello world"  # fullwidth H: NFKC
    assert normalize("Hi, there!", NormalizeSpec(strip_punctuation=True)) == "hi there"
