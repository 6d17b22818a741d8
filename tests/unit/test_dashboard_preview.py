"""The dashboard preview's reading of a Grafana dashboard without a Prometheus: template variables
substituted in every query, panels in the dashboard's order (rows skipped, nested row panels kept),
legends filled from series labels; and the repo's dashboard read that way."""

from __future__ import annotations

import json
from pathlib import Path

from rlfabric.tools.dashboard_preview import (
    Series,
    Target,
    legend,
    load_panels,
    run_variables,
    step_for,
    substitute,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "grafana" / "rlfabric.json"


def test_variables_are_substituted_in_both_spellings() -> None:
    expr = 'a{run_id=~"$run_id"} + b{run_id=~"${run_id}"} + c{x="$run_idx"}'
    assert substitute(expr, {"run_id": "r1"}) == 'a{run_id=~"r1"} + b{run_id=~"r1"} + c{x="$run_idx"}'


def test_a_run_id_is_escaped_for_the_regex_match() -> None:
    assert run_variables("run.1") == {"run_id": r"run\.1"}


def test_panels_keep_their_order_and_skip_rows() -> None:
    nested = {"type": "timeseries", "title": "B", "targets": [{"expr": "y", "legendFormat": "y"}]}
    dashboard = {
        "panels": [
            {"type": "row", "title": "Run", "panels": []},
            {"type": "timeseries", "title": "A", "targets": [{"expr": 'x{run_id=~"$run_id"}'}]},
            {"type": "row", "title": "Collapsed", "panels": [nested]},
            {"type": "text", "title": "Notes"},
        ]
    }
    panels = load_panels(dashboard, {"run_id": "r"})
    assert [(p.title, p.targets) for p in panels] == [
        ("A", [Target('x{run_id=~"r"}', "")]),
        ("B", [Target("y", "y")]),
    ]


def test_legends_follow_the_legend_format_else_the_labels() -> None:
    series = Series({"__name__": "m", "run_id": "r", "scorer": "math"}, [])
    assert legend(Target("m", "train {{run_id}} {{ scorer }}"), series) == "train r math"
    assert legend(Target("m", ""), series) == "run_id=r,scorer=math"
    assert legend(Target("sum(m)", ""), Series({}, [])) == "sum(m)"


def test_the_step_gives_a_few_hundred_points_and_at_least_a_second() -> None:
    assert step_for(0, 60) == 1.0
    assert step_for(0, 24_000) == 100.0


def test_the_repo_dashboard_reads_as_templated_panels() -> None:
    panels = load_panels(json.loads(DASHBOARD.read_text()), run_variables("demo"))
    assert len(panels) >= 15 and all(p.targets for p in panels)
    exprs = [t.expr for p in panels for t in p.targets]
    assert not any("$" in e for e in exprs), "a template variable the preview does not fill"
    assert 'rlfabric_learner_kl{run_id=~"demo"}' in exprs
