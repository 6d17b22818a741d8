"""The plot `rlfabric up` leaves in the run directory: reward, KL and the rest per step, with a break at
each learner restart; and the over-optimisation view: each held-out evaluation's proxy (the run's own)
reward and gold reward (`dataset.eval.reward`) against the learner's mean KL to the reference at its step
(`health.evaluations`), where the classic curve shows (the proxy keeps rising while the gold reward peaks
and falls)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlfabric.contracts.lineage import RESTART_EVENT

GOLD = "eval_gold_reward_mean"
"""The held-out gold reward of a run with `dataset.eval.reward`, plotted beside `eval_reward_mean`."""


def restart_steps(rows: list[dict[str, Any]]) -> list[int]:
    """The steps of the learner-restart markers among the metrics rows."""
    return [int(r["step"]) for r in rows if r.get("event") == RESTART_EVENT]


def segments(rows: list[dict[str, Any]], name: str) -> list[list[tuple[int, float]]]:
    """The (step, value) points of metric `name`, split at each learner-restart marker: a curve is never
    joined across a restart (the steps after it repeat those rolled back). A held-out evaluation (`eval_*`)
    is placed at the step whose policy it evaluated (`health.evaluated_step`), not at the later row that
    reports it."""
    from rlfabric.coordinator.health import evaluated_step

    parts: list[list[tuple[int, float]]] = [[]]
    for row in rows:
        if row.get("event") == RESTART_EVENT:
            parts.append([])
        elif isinstance(row.get(name), int | float) and "step" in row:
            step = int(row["step"])
            step = evaluated_step(row, step) if name.startswith("eval_") else step
            parts[-1].append((step, float(row[name])))
    return [part for part in parts if part]


def measured(rows: list[dict[str, Any]], name: str) -> bool:
    """False for a metric that reads 0 at every step: KL without a reference (`algorithm.kl.coef = 0`
    loads none), where a flat line at 0 would look like a measurement."""
    return any(value for part in segments(rows, name) for _, value in part)


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
    panels = [("reward_mean",), ("eval_reward_mean", GOLD), ("kl",), ("entropy",)]
    panels += [("response_length_mean",), ("tokens_per_s",), ("uniform_reward_groups_fraction",)]
    fig, axes = plt.subplots(2, 4, figsize=(16, 6))
    for ax, names in zip(axes.flat, panels, strict=False):
        for name, color in zip(names, ("tab:blue", "tab:orange"), strict=False):
            for i, part in enumerate(segments(rows, name)):
                label = name if i == 0 and len(names) > 1 else None
                ax.plot(*zip(*part, strict=True), marker=".", color=color, label=label)
        for step in restart_steps(rows):
            ax.axvline(step, color="tab:red", linestyle=":", linewidth=1)
        if any(segments(rows, name) for name in names[1:]):
            ax.legend(fontsize="small")
        if names == ("kl",) and segments(rows, "kl") and not measured(rows, "kl"):
            ax.text(0.5, 0.6, "not measured: algorithm.kl.coef = 0", ha="center", transform=ax.transAxes)
        ax.set_title(names[0])
        ax.set_xlabel("step")
    overoptimization(axes.flat[len(panels)], rows)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def kl_curve(rows: list[dict[str, Any]]) -> tuple[str, list[tuple[float, float | None, float | None]]]:
    """The over-optimisation points: (x, proxy, gold) per held-out evaluation, x the learner's mean KL to
    the reference at its step, and the x label. Without a measured KL (`algorithm.kl.coef = 0` loads no
    reference: KL reads 0) x is the evaluation's step."""
    from rlfabric.coordinator.health import evaluations

    evals = evaluations(rows)
    if any(e.kl for e in evals):
        return "KL to the reference", [(e.kl, e.proxy, e.gold) for e in evals if e.kl is not None]
    return "step (no KL measured)", [(float(e.step), e.proxy, e.gold) for e in evals]


def overoptimization(ax: Any, rows: list[dict[str, Any]]) -> None:
    """The held-out proxy and gold rewards against KL (gold on its own axis: its units are its own); the
    gold peak is marked."""
    label, points = kl_curve(rows)
    ax.set_title("held-out reward vs KL")
    ax.set_xlabel(label)
    proxy = [(x, p) for x, p, _ in points if p is not None]
    gold = [(x, g) for x, _, g in points if g is not None]
    if proxy:
        ax.plot(*zip(*proxy, strict=True), marker=".", color="tab:blue", label="proxy (eval_reward_mean)")
        ax.set_ylabel("proxy reward", color="tab:blue")
    if not proxy and not gold:
        ax.text(0.5, 0.5, "no evaluations yet", ha="center", transform=ax.transAxes)
        return
    if not gold:
        ax.legend(fontsize="small")
        return
    twin = ax.twinx()
    twin.plot(*zip(*gold, strict=True), marker=".", color="tab:orange", label="gold (eval_gold_reward_mean)")
    peak = max(gold, key=lambda point: point[1])
    twin.plot([peak[0]], [peak[1]], marker="*", markersize=12, color="tab:red", label="gold peak")
    twin.set_ylabel("gold reward", color="tab:orange")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize="small")
