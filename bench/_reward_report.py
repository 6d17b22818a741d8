"""The markdown report and the plot of `bench/reward_service.py`, from its result dictionary (the JSON).

The explanations are computed from the measurements (busy cores, CPU per call), so the report says why a
goal was missed with this run's numbers, not with a story written for another run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import Bar, Stats, bar_plot, fmt, machine_line, markdown_table

BASELINE_LABEL = "in-process, `safe_score_batch`, 1 thread"
MATH_HEADERS = [
    "path",
    "cores",
    "in flight",
    "items/s",
    "min..max",
    "ratio per core",
    "goal",
    "ratio per CPU-s",
]
EXACT_HEADERS = ["path", "in flight", "items/s", "min..max", "vs in-process", "goal", "service CPU ms/call"]
CALL_HEADERS = ["p50 ms", "p99 ms", "busy cores client/server/workers"]


def render_markdown(result: dict[str, Any]) -> str:
    """The whole report: the conditions, one table per part, and why the figures are what they are."""
    math_result, exact_result, goals = result["math_verify"], result["exact_match"], result["goals"]
    quick = " (**--quick: a smoke run, the figures mean nothing**)" if result["quick"] else ""
    parts = [
        "## reward_service: gRPC service vs in-process scoring (batch 64)",
        "",
        f"Machine: {machine_line(result['machine'])}. Repeats: {result['repeats']}{quick}.",
        "",
        "Cells: median items/s over the repeats and their min..max; p50/p99 of every Score call of every "
        "repeat; busy cores = CPU seconds per wall second of this client, the server process and its "
        "scorer workers; ratio per CPU-s = service items per CPU-second (server + workers) over in-process "
        "items per CPU-second of the scoring thread (robust to other load on the machine). Cores used by "
        "the service = its scorer workers + the server process's measured share (CPU-s per wall-s); the "
        "ratio per core = service items/s / cores used / in-process items/s.",
        "",
        f"### (a) math_verify: {math_result['items']} distinct items, "
        f"goal ≥ {goals['math_verify_ratio_per_core']} per core",
        "",
        markdown_table(MATH_HEADERS + CALL_HEADERS, math_rows(math_result)),
        "",
        f"### (b) exact_match: {exact_result['items']} distinct items, "
        f"goal ≥ {fmt(goals['exact_match_items_per_s'])} items/s",
        "",
        markdown_table(EXACT_HEADERS + CALL_HEADERS, exact_rows(exact_result)),
        "",
        "### Reading the figures",
        "",
        *machine_notes(result),
        *overload_notes(result),
        *math_notes(math_result),
        *exact_notes(exact_result, goals["exact_match_items_per_s"]),
    ]
    return "\n".join(parts)


def math_rows(math_result: dict[str, Any]) -> list[list[str]]:
    base = Stats(**math_result["in_process"]["items_per_s"])
    rows = [
        [BASELINE_LABEL, "1", "-", fmt(base.median), base.spread(), "1.00 (baseline)", "", "1.00", "", "", ""]
    ]
    for name, s in math_result["service"].items():
        stats = Stats(**s["items_per_s"])
        head = [
            f"gRPC service, {name}",
            f"{s['cores']:.2f}",
            str(s["in_flight"]),
            fmt(stats.median),
            stats.spread(),
        ]
        met = verdict(s["goal_met"], math_result["in_process"]["wall_clock_reliable"])
        verdicts = [f"{s['ratio_per_core']:.2f}", met, f"{s['ratio_per_cpu_s']:.2f}"]
        rows.append([*head, *verdicts, *call_cells(s)])
    return rows


def exact_rows(exact_result: dict[str, Any]) -> list[list[str]]:
    base = Stats(**exact_result["in_process"]["items_per_s"])
    rows = [[BASELINE_LABEL, "-", fmt(base.median), base.spread(), "1.00", "", "", "", "", ""]]
    for name, s in exact_result["service"].items():
        stats = Stats(**s["items_per_s"])
        head = [f"gRPC, raw aio stub, {name}", str(s["in_flight"]), fmt(stats.median), stats.spread()]
        verdicts = [f"{s['vs_in_process']:.2f}", verdict(s["goal_met"]), fmt(s["service_cpu_ms_per_call"])]
        rows.append([*head, *verdicts, *call_cells(s)])
    return rows


def call_cells(summary: dict[str, Any]) -> list[str]:
    """p50 and p99 per call, and the cores each process kept busy (median over the repeats)."""
    cores = summary["cpu_cores"]
    busy = f"{cores['client']:.2f} / {cores['server']:.2f} / {cores['workers']:.2f}"
    return [fmt(summary["latency_ms"]["p50"]), fmt(summary["latency_ms"]["p99"]), busy]


def verdict(met: bool, reliable: bool = True) -> str:
    """ "met" / "**missed**"; with a "?" when the machine was too loaded for wall-clock figures."""
    return ("met" if met else "**missed**") + ("" if reliable else " (?)")


def machine_notes(result: dict[str, Any]) -> list[str]:
    machine = result["machine"]
    return [
        f"- {machine['cpu_count']} cores (load average {machine['load_avg_1m']:.2f} when the run began) "
        "shared by the client, the server process, its scorer workers and anything else running: a "
        "configuration that needs every core competes with the rest, and the wall-clock ratios move with "
        "the machine's load; the per-CPU-second ratios do not.",
        "- The baseline scores on one non-main thread, as the service's workers do (off the main thread "
        "math-verify arms no `signal.alarm` timeouts), so both sides do the same work per item.",
    ]


def overload_notes(result: dict[str, Any]) -> list[str]:
    """A warning for each part whose baseline thread did not get a whole core."""
    lines = []
    for scorer in ("math_verify", "exact_match"):
        base = result[scorer]["in_process"]
        if not base["wall_clock_reliable"]:
            lines.append(
                f"- **{scorer}: the machine was overloaded**: the in-process scoring thread got only "
                f"{base['busy_cores']:.2f} of a core (median), so its wall-clock items/s, and every ratio "
                "against it, understate the baseline; verdicts marked (?) are unreliable, trust the "
                "per-CPU-second figures."
            )
    return lines


def math_notes(math_result: dict[str, Any]) -> list[str]:
    reliable = math_result["in_process"]["wall_clock_reliable"]
    base_us = 1e6 / Stats(**math_result["in_process"]["items_per_cpu_s"]).median
    lines = []
    for name, s in math_result["service"].items():
        busy, per_item = s["cpu_cores"]["workers"], s["cpu_us_per_item"]
        lines.append(
            f"- math_verify {name}: {s['ratio_per_core']:.2f} of in-process items/s per core used "
            f"({verdict(s['goal_met'], reliable)}). Its workers kept {busy:.2f} of {s['workers']} cores busy"
            + (" (they did not get their cores)" if busy < 0.9 * s["workers"] else "")
            + f"; per item they used {per_item['workers'] / 1000:.2f} ms of CPU and the server process "
            f"{per_item['server'] / 1000:.3f} ms, against {base_us / 1000:.2f} ms in-process "
            f"(ratio per CPU-second {s['ratio_per_cpu_s']:.2f})."
        )
    if any(not s["goal_met"] for s in math_result["service"].values()):
        lines.append(
            "- A configuration whose workers did not get their cores misses the wall-clock goal whatever "
            "the service's own cost; the ratio per CPU-second says what the service path itself costs "
            "(JSON framing to and from the worker, the supervised per-item thread that lets a hung item "
            "time out alone, proto conversion in the server process)."
        )
    return lines


def exact_notes(exact_result: dict[str, Any], goal: float) -> list[str]:
    best = max(exact_result["service"].values(), key=lambda s: s["items_per_s"]["median"])
    base_cpu = Stats(**exact_result["in_process"]["items_per_cpu_s"]).median
    per_item_us = 1000 * best["service_cpu_ms_per_call"] / exact_result["batch_size"]
    ceiling = Stats(**best["items_per_service_cpu_s"]).median
    cores = best["cpu_cores"]
    processes = best.get("processes", 1)
    line = (
        f"- exact_match: best {fmt(best['items_per_s']['median'])} items/s with {processes} server "
        f"process{'es' if processes > 1 else ''} at {best['in_flight']} in flight "
        f"({verdict(exact_result['goal_met'])}). The service kept {cores['server'] + cores['workers']:.2f} "
        f"cores busy and spent {fmt(best['service_cpu_ms_per_call'])} ms of CPU per call "
        f"({per_item_us:.0f} µs per item, against {1e6 / base_cpu:.1f} µs in-process): each core it gets "
        f"is worth about {fmt(ceiling)} items/s; the client used {cores['client']:.2f} cores."
    )
    if not exact_result["goal_met"]:
        line += (
            f" Reaching {fmt(goal)} items/s at batch {exact_result['batch_size']} takes more than one core "
            "for the service (one server process's event-loop thread does all its work: gRPC aio's "
            "per-call machinery, the proto conversions and the scoring, under one GIL) and the client's "
            "share besides; whatever else runs on the cores takes from that."
        )
    notes = [line]
    if any(s.get("processes", 1) > 1 for s in exact_result["service"].values()):
        notes.append(
            '- With processes > 1 the busy-cores column\'s "server" is the supervisor (it only watches) '
            'and "workers" its server processes, which share the port (SO_REUSEPORT): the kernel '
            "spreads the client's connections over them."
        )
    return notes


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Bar plot of items/s (median, min..max whiskers): one panel per scorer."""
    panels = []
    for scorer in ("math_verify", "exact_match"):
        part = result[scorer]
        bars = [Bar("in-process", Stats(**part["in_process"]["items_per_s"]))]
        bars += [Bar(k, Stats(**s["items_per_s"])) for k, s in part["service"].items()]
        panels.append((scorer, "items/s", bars))
    goals = [None, result["goals"]["exact_match_items_per_s"]]
    return bar_plot(path, panels, "reward service vs in-process, batch 64 (median, min..max)", goals)
