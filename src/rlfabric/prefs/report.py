"""The build report: counts per stage, what hygiene removed and why, the judges (votes, ties,
disagreements between the two orders, position bias, agreement with each other), and the balance of the
rows kept (chosen/rejected length ratio, label balance).

`report.json` holds `build_report`'s dict (the manifest holds it too); `report.md` is `markdown(report)`,
a page a person reads. Length is in characters. Label balance is the share of judged rows whose
source-first completion won: far from 0.5 on a sampling source means the judges (or the generator's
order) favour a position; on a labelled file it is the share of rows whose source label the judges kept.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from rlfabric.prefs.types import PrefPair

RATIO_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<0.5", 0.5),
    ("0.5-0.8", 0.8),
    ("0.8-1.25", 1.25),
    ("1.25-2", 2.0),
    (">=2", float("inf")),
)
"""Histogram of chosen/rejected length ratios: (label, upper bound, exclusive)."""


def length_balance(rows: Sequence[PrefPair]) -> dict[str, Any]:
    """Chosen/rejected length ratio (characters; an empty rejected counts as 1): mean, quantiles, the
    share of rows whose chosen is longer, and a histogram (`RATIO_BUCKETS`)."""
    if not rows:
        return {"rows": 0}
    ratios = sorted(len(r.chosen) / max(len(r.rejected), 1) for r in rows)
    histogram = dict.fromkeys((label for label, _ in RATIO_BUCKETS), 0)
    for ratio in ratios:
        label = next(label for label, upper in RATIO_BUCKETS if ratio < upper)
        histogram[label] += 1
    return {
        "rows": len(rows),
        "ratio_mean": round(statistics.fmean(ratios), 4),
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_p10": round(quantile(ratios, 0.1), 4),
        "ratio_p90": round(quantile(ratios, 0.9), 4),
        "chosen_longer_share": round(sum(len(r.chosen) > len(r.rejected) for r in rows) / len(rows), 4),
        "chosen_chars_mean": round(statistics.fmean(len(r.chosen) for r in rows), 2),
        "rejected_chars_mean": round(statistics.fmean(len(r.rejected) for r in rows), 2),
        "histogram": histogram,
    }


def quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values (nearest rank below)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def label_balance(rows: Sequence[PrefPair]) -> dict[str, Any]:
    """How often the source's first completion became the chosen one, over rows the judges labelled."""
    judged = [r for r in rows if r.meta.get("label_by") == "judges"]
    first_won = sum(r.meta.get("source_first") == "chosen" for r in judged)
    return {
        "judged_rows": len(judged),
        "source_first_won": first_won,
        "source_first_won_share": round(first_won / len(judged), 4) if judged else None,
    }


def build_report(
    stages: dict[str, Any],
    hygiene: dict[str, int],
    judging: dict[str, Any] | None,
    rows: Sequence[PrefPair],
) -> dict[str, Any]:
    """The report of one build (module docstring)."""
    return {
        "stages": stages,
        "hygiene": {"dropped": hygiene, "dropped_total": sum(hygiene.values())},
        "judging": judging,
        "balance": {"length": length_balance(rows), "labels": label_balance(rows)},
        "rows": len(rows),
    }


def markdown(report: dict[str, Any], title: str) -> str:
    """`report.md`: the stages, hygiene, judges and balance as short tables."""
    lines = [
        f"# {title}",
        "",
        f"{report['rows']} rows.",
        "",
        "## Stages",
        "",
        "| stage | counts |",
        "|---|---|",
    ]
    for stage, counts in report["stages"].items():
        text = ", ".join(f"{k} {v}" for k, v in counts.items()) if isinstance(counts, dict) else str(counts)
        lines.append(f"| {stage} | {text} |")
    lines += ["", "## Hygiene", "", "| rule | dropped |", "|---|---|"]
    for rule, n in report["hygiene"]["dropped"].items():
        lines.append(f"| {rule} | {n} |")
    if not report["hygiene"]["dropped"]:
        lines.append("| (none) | 0 |")
    lines += judges_markdown(report["judging"])
    lines += balance_markdown(report["balance"])
    return "\n".join(lines) + "\n"


def judges_markdown(judging: dict[str, Any] | None) -> list[str]:
    if judging is None:
        return ["", "## Judges", "", "None: the source's labels are kept."]
    lines = [
        "",
        "## Judges",
        "",
        "Each pair asked in both orders; a vote counts when both orders agree.",
        "",
        "| judge | pairs | votes | ties | disagreements | errors | first-position rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in judging["judges"].items():
        lines.append(
            f"| {name} | {s['pairs']} | {s['votes']} | {s['ties']} | {s['disagreements']} | {s['errors']} "
            f"| {s['position_first_rate']} |"
        )
    dropped = ", ".join(f"{k} {v}" for k, v in judging["dropped"].items()) or "none"
    agreement = judging["agreement"]
    lines += ["", f"Pairs dropped by the judges: {dropped}."]
    lines.append(f"Mean per-pair agreement of kept pairs: {agreement['mean_pair_agreement']}.")
    for pair in agreement["pairwise"]:
        a, b = pair["judges"]
        lines.append(
            f"{a} vs {b}: agreement {pair['agreement']}, Cohen's kappa {pair['cohen_kappa']} "
            f"({pair['pairs']} pairs both voted on)."
        )
    if len(agreement["judges"]) >= 2:
        lines.append(f"Fleiss' kappa: {agreement['fleiss_kappa']} ({agreement['fleiss_pairs']} pairs).")
    return lines


def balance_markdown(balance: dict[str, Any]) -> list[str]:
    length, labels = balance["length"], balance["labels"]
    lines = ["", "## Balance", ""]
    if length["rows"]:
        lines.append(
            f"Chosen/rejected length ratio: mean {length['ratio_mean']}, median {length['ratio_median']}, "
            f"p10 {length['ratio_p10']}, p90 {length['ratio_p90']}; chosen longer in "
            f"{length['chosen_longer_share']:.0%} of rows."
        )
        histogram = ", ".join(f"{k}: {v}" for k, v in length["histogram"].items())
        lines.append(f"Ratio histogram: {histogram}.")
    if labels["judged_rows"]:
        lines.append(
            f"The source's first completion won {labels['source_first_won']} of {labels['judged_rows']} "
            f"judged rows ({labels['source_first_won_share']})."
        )
    return lines
