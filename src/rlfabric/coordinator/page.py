"""The live page of a run, served by the coordinator at `/runs/{run_id}`.

One self-contained HTML file (`static/run.html`: inline CSS and JS, charts drawn on <canvas>, no external
requests) that polls `/v1/runs/{id}` and `/v1/runs/{id}/metrics?since=` every 2 s. The HTML shell needs
no token; the data does: the operator's or the run's own (`run_token`; another run's gets 403, shown as
the error). Open the page as `/runs/<id>#token=<token>` (the fragment never reaches the server or its
logs) or `/runs/<id>?token=<token>`: the script keeps the token in sessionStorage, removes it from the
address bar and sends it as `Authorization: Bearer`. Without one, a 401 shows a token field.
"""

from __future__ import annotations

import html
import json
from functools import cache
from importlib.resources import files

CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean", "eval_reward_mean", "eval_gold_reward_mean")),
    (
        "over-optimisation: held-out proxy and gold reward vs KL",
        ("eval_reward_mean", "eval_gold_reward_mean"),
    ),
    ("KL", ("kl",)),
    ("entropy", ("entropy",)),
    ("response length", ("response_length_mean",)),
    ("groups with one reward for every sample", ("uniform_reward_groups_fraction",)),
    ("clip fraction", ("clip_fraction",)),
    ("tokens / s", ("tokens_per_s",)),
    ("rollout utilisation", ("rollout_busy_fraction",)),
    ("staleness", ("staleness_mean",)),
    ("turns per trajectory (multi-turn)", ("turns_mean",)),
    ("tool calls (multi-turn)", ("tool_call_success_rate", "tool_calls_mean")),
)
"""(title, metrics-row keys) of each chart, in page order. Environment failures of a multi-turn run are in
the counters table (`environment_errors`, `template_mismatches`, `dropped_environment_error`). Charts plot
against the step, but those in `KL_CHARTS`."""
KL_CHARTS = frozenset({CHARTS[1][0]})
"""Charts of held-out evaluations against KL: each evaluation at the learner's mean KL to the reference at
its step (`health.evaluations`: `kl` of the row of `eval_step`, else of the row carrying it); the classic
over-optimisation curve (the proxy keeps rising while the gold reward peaks and falls). Without a measured
KL (`algorithm.kl.coef = 0` loads no reference: KL reads 0) they plot against the step instead."""


@cache
def _template() -> str:
    return files("rlfabric.coordinator").joinpath("static/run.html").read_text(encoding="utf-8")


def render_run_page(run_id: str) -> str:
    """The page for `run_id` (escaped into an attribute; the script reads it from there)."""
    charts = json.dumps(
        [{"title": t, "keys": list(keys), "x": "kl" if t in KL_CHARTS else "step"} for t, keys in CHARTS]
    )
    return (
        _template()
        .replace("__RUN_ID__", html.escape(run_id, quote=True))
        .replace("__CHARTS__", html.escape(charts, quote=True))
    )
