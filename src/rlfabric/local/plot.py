"""The plot `rlfabric up` leaves in the run directory: reward, KL and the rest per step, with a break at
each learner restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlfabric.contracts.lineage import RESTART_EVENT


def restart_steps(rows: list[dict[str, Any]]) -> list[int]:
    """The steps of the learner-restart markers among the metrics rows."""
    return [int(r["step"]) for r in rows if r.get("event") == RESTART_EVENT]


def segments(rows: list[dict[str, Any]], name: str) -> list[list[tuple[int, float]]]:
    """The (step, value) points of metric `name`, split at each learner-restart marker: a curve is never
    joined across a restart (the steps after it repeat those rolled back)."""
    parts: list[list[tuple[int, float]]] = [[]]
    for row in rows:
        if row.get("event") == RESTART_EVENT:
            parts.append([])
        elif isinstance(row.get(name), int | float) and "step" in row:
            parts[-1].append((int(row["step"]), float(row[name])))
    return [part for part in parts if part]


def plot(metrics_path: Path, out: Path) -> Path | None:
    """A PNG of the run's curves, if matplotlib is installed; a dotted vertical line marks each learner
    restart, and no curve is joined across one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = (
        [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    )
    names = ["reward_mean", "eval_reward_mean", "kl", "entropy", "response_length_mean", "tokens_per_s"]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, name in zip(axes.flat, names, strict=True):
        for part in segments(rows, name):
            ax.plot(*zip(*part, strict=True), marker=".", color="tab:blue")
        for step in restart_steps(rows):
            ax.axvline(step, color="tab:red", linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
