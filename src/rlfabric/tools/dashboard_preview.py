"""A picture of the Grafana dashboard without Grafana: each time-series panel of the dashboard JSON, with
its title and its own PromQL (template variables substituted), asked of a Prometheus server over the run
(`/api/v1/query_range`) and drawn as one matplotlib plot in a grid, in the dashboard's order.

    python -m rlfabric.tools.dashboard_preview --prometheus http://127.0.0.1:9090 \\
        --dashboard deploy/monitoring/grafana/rlfabric.json --run-id demo --out dashboard.png

The run's time span is where its coordinator and learner gauges have samples (within `--lookback`), unless
`--start` and `--end` give it. Legends follow each target's `legendFormat` (`{{label}}` filled from the
series' labels). The integration test tests/integration/test_dashboard_live.py uses the same queries.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPAN_METRICS = "rlfabric_learner_step|rlfabric_coordinator_desired_replicas"
"""The metrics whose samples mark a run's time span: the coordinator exports its desired replicas from the
run's start, the learner its step from the first step (the dashboard's `run_id` variable uses the same)."""
POINTS = 240
"""About how many points each series gets over the span."""
COLUMNS = 4
"""Plots per row of the grid."""
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
"""A `{{label}}` in a Grafana legend format."""
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
"""A Grafana template variable in a query: `${name}` or `$name`."""
PANEL_TYPES = ("timeseries", "graph")
"""Panel types drawn (rows and text panels are layout, not queries)."""


@dataclass(frozen=True)
class Target:
    """One query of a panel: PromQL with the variables substituted, and its legend format."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """A time-series panel: its title and targets, in the dashboard's order."""

    title: str
    targets: list[Target]


@dataclass(frozen=True)
class Series:
    """One series of a query_range result: its labels and its (unix time, value) points."""

    labels: dict[str, str]
    points: list[tuple[float, float]]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` with each `$name` and `${name}` of `variables` replaced by its value (others kept)."""

    def value(match: re.Match[str]) -> str:
        return variables.get(match.group(1) or match.group(2), match.group(0))

    return VARIABLE.sub(value, expr)


def load_panels(dashboard: dict[str, Any], variables: dict[str, str]) -> list[Panel]:
    """The dashboard's time-series panels (nested row panels included), variables substituted."""
    panels = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            if inner.get("type") in PANEL_TYPES:
                targets = [
                    Target(substitute(t["expr"], variables), t.get("legendFormat", ""))
                    for t in inner.get("targets", [])
                ]
                panels.append(Panel(inner["title"], targets))
    return panels


def run_variables(run_id: str) -> dict[str, str]:
    """The dashboard's template variables for one run (`run_id` is matched with `=~`: escaped)."""
    return {"run_id": re.escape(run_id)}


def api(prometheus: str, path: str, params: dict[str, str]) -> Any:
    """The `data` of a Prometheus HTTP API answer (ValueError unless its status is success)."""
    url = f"{prometheus.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as response:
        answer = json.load(response)
    if answer.get("status") != "success":
        raise ValueError(f"{path} {params}: {answer}")
    return answer["data"]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[Series]:
    """Each series `expr` yields over [start, end] at `step` seconds."""
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:.3f}"}
    data = api(prometheus, "/api/v1/query_range", params)
    return [
        Series(item["metric"], [(float(t), float(v)) for t, v in item["values"]]) for item in data["result"]
    ]


def run_span(prometheus: str, run_id: str, lookback: str) -> tuple[float, float]:
    """(first, last) sample time of `SPAN_METRICS` for the run within `lookback` of now."""
    expr = f'{{__name__=~"{SPAN_METRICS}", run_id="{run_id}"}}[{lookback}]'
    data = api(prometheus, "/api/v1/query", {"query": expr, "time": f"{time.time():.3f}"})
    times = [float(t) for item in data["result"] for t, _ in item["values"]]
    if not times:
        raise LookupError(f"no samples of {SPAN_METRICS} for run {run_id!r} in the last {lookback}")
    return min(times), max(times)


def step_for(start: float, end: float) -> float:
    """A query_range step giving about `POINTS` points over the span (at least 1 s)."""
    return max(1.0, (end - start) / POINTS)


def legend(target: Target, series: Series) -> str:
    """The series' legend: the target's format filled from its labels, else its labels."""
    if target.legend:
        return LEGEND_LABEL.sub(lambda m: series.labels.get(m.group(1), ""), target.legend)
    return ",".join(f"{k}={v}" for k, v in sorted(series.labels.items()) if k != "__name__") or target.expr


def fetch(prometheus: str, panels: list[Panel], start: float, end: float) -> list[list[tuple[str, Series]]]:
    """Per panel, (legend, series) of each of its targets' results."""
    step = step_for(start, end)
    return [
        [(legend(t, s), s) for t in panel.targets for s in query_range(prometheus, t.expr, start, end, step)]
        for panel in panels
    ]


def draw(
    panels: list[Panel], data: list[list[tuple[str, Series]]], start: float, title: str, out: Path
) -> Path:
    """The grid of plots, x in minutes since `start`, written to `out` as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(4.2 * COLUMNS, 2.8 * rows), squeeze=False)
    for ax, panel, lines in zip(axes.flat, panels, data, strict=False):
        ax.set_title(panel.title, fontsize=9)
        ax.tick_params(labelsize=7)
        for name, series in lines:
            ax.plot([(t - start) / 60 for t, _ in series.points], [v for _, v in series.points], label=name)
        if lines:
            ax.legend(fontsize=6, loc="best")
        else:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{title} (x: minutes since the run started)", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def preview(prometheus: str, dashboard_path: Path, run_id: str, out: Path, span: tuple[float, float]) -> Path:
    """The dashboard's panels for `run_id` over `span`, drawn to `out`."""
    dashboard = json.loads(dashboard_path.read_text())
    panels = load_panels(dashboard, run_variables(run_id))
    data = fetch(prometheus, panels, *span)
    return draw(panels, data, span[0], f"{dashboard.get('title', 'dashboard')}: run {run_id}", out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlfabric.tools.dashboard_preview", description=__doc__)
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--dashboard", required=True, type=Path, help="Grafana dashboard JSON")
    parser.add_argument("--run-id", required=True, help="the run to show ($run_id)")
    parser.add_argument("--out", required=True, type=Path, help="PNG to write")
    parser.add_argument("--start", type=float, help="span start, unix seconds (default: the run's)")
    parser.add_argument("--end", type=float, help="span end, unix seconds (default: the run's)")
    parser.add_argument("--lookback", default="6h", help="how far back to look for the run (default 6h)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    first, last = (
        (args.start, args.end)
        if args.start is not None and args.end is not None
        else run_span(args.prometheus, args.run_id, args.lookback)
    )
    out = preview(args.prometheus, args.dashboard, args.run_id, args.out, (first, last))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
