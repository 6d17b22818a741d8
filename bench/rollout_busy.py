"""Rollout busy fraction: the async pipeline (`max_staleness` 1) against synchronous on-policy training
(`max_staleness` 0), the same run otherwise, side by side in one invocation.

    python bench/rollout_busy.py [--repeats 3] [--steps 16] [--quick] [--output-dir bench/results]

Each repeat runs `rlfabric up` on the built-in demo twice, once per mode, interleaved (async first in
even repeats, sync first in odd ones). Everything is a real process: redis-server, the reward service, a
vLLM replica, the learner and the coordinator. Measured per run, from the run's own metrics.jsonl:

- busy fraction: the coordinator's share of time since the run's first dispatch that the replica had at
  least one group in flight (`rollout_busy_fraction_run` on the last learner row; it is what the
  autoscaling signal is built on). A request the replica holds while it loads the next version counts
  as busy, so the synchronous figure is, if anything, flattering;
- the same over the coordinator's last 30 s window at the final step (steady state, start-up excluded);
- seconds per step after the first two (start-up excluded), samples trained per second, and the groups
  the learner dropped as stale (the lag bound should make that 0 in both modes).

Goal (issue: coordinator): busy fraction >= 0.9 in async mode. `--quick` runs 2 steps per mode with the
transformers reference engine to prove the code path; its figures mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    Bar,
    Stats,
    bar_plot,
    base_parser,
    effective_repeats,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    write_results,
)

NAME = "rollout_busy"
MODES = {"async (max_staleness 1)": 1, "sync (max_staleness 0)": 0}
GOAL = 0.9
HEADERS = [
    "mode", "busy fraction (median)", "min..max", "busy, last 30 s", "s / step", "samples / s",
    "stale drops (max)", "final reward",
]  # fmt: skip


def run_file(run_dir: Path, staleness: int, steps: int) -> Path:
    """The demo's run spec with `max_staleness` set (the demo builds its model and prompts here)."""
    from rlfabric.coordinator.demo import demo_spec

    spec = demo_spec(run_dir, steps=steps)
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"max_staleness": staleness})})
    path = run_dir / "run.json"
    path.write_text(spec.model_dump_json(indent=2))
    return path


def run_once(staleness: int, steps: int, *, engine: str, workdir: Path, quick: bool) -> dict[str, Any]:
    """One `rlfabric up`; the figures of its metrics rows."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"busy-s{staleness}-", dir=workdir))
    argv = [sys.executable, "-m", "rlfabric.cli", "up", str(run_file(run_dir, staleness, steps))]
    argv += ["--run-dir", str(run_dir), "--no-progress", "--engine", engine]
    # The learner copies the coordinator's latest exported busy fraction into its rows; a quick run ends
    # within one default export interval (2 s), so it exports more often.
    env = {**os.environ, "RLFABRIC_COORDINATOR__SCALING__INTERVAL_S": "0.2"} if quick else None
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False, env=env)
    (run_dir / "up.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"rlfabric up failed ({proc.returncode}); see {run_dir / 'up.out'}")
    rows = [json.loads(line) for line in (run_dir / "demo" / "metrics.jsonl").read_text().splitlines()]
    return figures(rows, wall_s=time.perf_counter() - start)


def figures(rows: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    last = {k: v for row in rows if "event" not in row for k, v in row.items()}  # latest value of each key
    steady = rows[2:] if len(rows) > 3 else rows
    span = steady[-1]["time"] - steady[0]["time"]
    seconds_per_step = span / max(len(steady) - 1, 1) if len(steady) > 1 else float("nan")
    samples = sum(r.get("samples", 0.0) for r in steady[1:])
    return {
        "busy_fraction": float(last.get("rollout_busy_fraction_run", float("nan"))),
        "busy_fraction_last_30s": float(last.get("rollout_busy_fraction", float("nan"))),
        "seconds_per_step": seconds_per_step,
        "samples_per_s": samples / span if span > 0 else float("nan"),
        "dropped_stale": int(last.get("groups_dropped_stale", 0)),
        "reward_last": float(last["reward_mean"]),
        "steps": len(rows),
        "wall_s": wall_s,
    }


def measure(
    repeats: int, steps: int, engine: str, workdir: Path, quick: bool
) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for k in range(repeats):
        order = list(MODES) if k % 2 == 0 else list(reversed(MODES))
        for mode in order:
            print(f"repeat {k + 1}/{repeats}: {mode} ...", flush=True)
            results[mode].append(run_once(MODES[mode], steps, engine=engine, workdir=workdir, quick=quick))
            print(f"  {results[mode][-1]}", flush=True)
    return results


def stats_of(runs: list[dict[str, Any]], key: str, unit: str) -> Stats:
    return Stats.of([float(r[key]) for r in runs], unit)


def report(results: dict[str, list[dict[str, Any]]], args: Any, steps: int, engine: str) -> str:
    busy = {mode: stats_of(runs, "busy_fraction", "fraction") for mode, runs in results.items()}
    async_mode, sync_mode = list(MODES)
    rows = []
    for mode, runs in results.items():
        rows.append([
            mode, fmt(busy[mode].median), f"{fmt(busy[mode].min)}..{fmt(busy[mode].max)}",
            fmt(stats_of(runs, "busy_fraction_last_30s", "fraction").median),
            fmt(stats_of(runs, "seconds_per_step", "s").median),
            fmt(stats_of(runs, "samples_per_s", "samples/s").median),
            max(r["dropped_stale"] for r in runs), fmt(stats_of(runs, "reward_last", "").median),
        ])  # fmt: skip
    met = busy[async_mode].median >= GOAL
    ratio = busy[async_mode].median / busy[sync_mode].median if busy[sync_mode].median else float("nan")
    lines = [
        f"## {NAME}",
        "",
        f"`rlfabric up` on the demo, {steps} steps per run, engine {engine}, {len(results[async_mode])} "
        "repeat(s) per mode, interleaved. Busy fraction: share of the run (from its first dispatch) the "
        "replica had work in flight.",
        "",
        markdown_table(HEADERS, rows),
        "",
        f"Async / sync busy fraction: {fmt(ratio)}. Goal: async busy fraction >= {GOAL}: "
        f"{'met' if met else 'missed'}{' (quick mode: figures mean nothing)' if args.quick else ''}.",
        "",
        f"Machine: {machine_line(machine_info())}.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="learner steps per run (default 16)")
    args = parser.parse_args()
    steps = 2 if args.quick else args.steps
    engine = "transformers" if args.quick else "vllm"
    with tempfile.TemporaryDirectory(prefix="rollout-busy-") as workdir:
        results = measure(effective_repeats(args), steps, engine, Path(workdir), args.quick)
    markdown = report(results, args, steps, engine)
    busy = {mode: stats_of(runs, "busy_fraction", "fraction") for mode, runs in results.items()}
    payload = {
        "quick": args.quick,
        "steps": steps,
        "engine": engine,
        "goal": GOAL,
        "runs": results,
        "busy_fraction": {mode: s.to_dict() for mode, s in busy.items()},
        "goal_met": busy[next(iter(MODES))].median >= GOAL,
        "machine": machine_info(),
    }
    write_results(args.output_dir, NAME, payload, markdown)
    bars = [Bar(mode, s) for mode, s in busy.items()]
    bar_plot(
        args.output_dir / f"{NAME}.png",
        [("busy fraction", "share of the run with work in flight", bars)],
        title=f"rollout busy fraction, async vs sync ({steps} steps per run)",
        goals=[GOAL],
    )
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
