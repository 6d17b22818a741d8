"""What `bench/e2e_trl.py` makes of its runs: the rlfabric / TRL comparison against the goals, the markdown
report and the plot. `bench/multiturn_e2e.py` reports its runs with the same pieces."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _e2e_systems import Placement, Task
from common import Bar, Stats, bar_plot, fmt, machine_info, machine_line, markdown_table

NAME = "e2e_trl"
GOAL = 1.5
"""rlfabric / TRL steady samples/s, at equal or better reward."""
GOAL_WITH_STARTUP = 1.0
"""rlfabric / TRL samples/s counting start-up (a cold first run); and a first step no later than TRL's."""
SYSTEMS = ("rlfabric", "trl")
HEADERS = [
    "system", "samples/s (steady)", "min..max", "samples/s (with start-up)", "s / step", "reward (last 1/4)",
    "min..max", "first step ends (s)", "cores used", "CPU s / sample", "CPU stolen by the host",
]  # fmt: skip


def stats(runs: list[dict[str, Any]], key: str, unit: str = "") -> Stats:
    """The runs' `key` as statistics."""
    return Stats.of([float(r[key]) for r in runs], unit)


def comparison(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """rlfabric / TRL: throughput (ratio of medians and median of per-repeat ratios), reward, goal;
    NaN (and the goal unmet) when a run measured only one of them."""
    if set(results) != set(SYSTEMS):
        nan = float("nan")
        per_repeat_nan = Stats.of([nan], "x").to_dict()
        return {"throughput_ratio": nan, "throughput_ratio_per_repeat": per_repeat_nan,
                "throughput_ratio_with_startup": nan, "reward_difference": nan,
                "reward_noise_2se": nan, "reward_within_trl_spread": False, "reward_within_noise": False,
                "reward_equal_or_better": False, "first_step_ratio": nan, "goal_steady_met": False,
                "goal_startup_met": False, "goal_first_step_met": False, "goal_met": False}  # fmt: skip
    ours, trl = results["rlfabric"], results["trl"]
    per_repeat = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(ours, trl, strict=True)]
    ratio = stats(ours, "samples_per_s").median / stats(trl, "samples_per_s").median
    reward_ours, reward_trl = stats(ours, "reward_final"), stats(trl, "reward_final")
    difference = reward_ours.median - reward_trl.median
    noise = 2.0 * math.hypot(stats(ours, "reward_final_se").median, stats(trl, "reward_final_se").median)
    within_spread = reward_ours.median >= reward_trl.min  # within or above TRL's own run-to-run spread
    within_noise = difference >= -noise  # NaN (spreads not reported) compares False
    reward_ok = within_spread or within_noise

    def ratio_of(key: str) -> float:
        return stats(ours, key).median / stats(trl, key).median

    with_startup, first_step = ratio_of("samples_per_s_with_startup"), ratio_of("first_step_end_s")
    return {
        "throughput_ratio": ratio,
        "throughput_ratio_per_repeat": Stats.of(per_repeat, "x").to_dict(),
        "throughput_ratio_with_startup": with_startup,
        "first_step_ratio": first_step,
        "reward_difference": difference,
        "reward_noise_2se": noise,
        "reward_within_trl_spread": within_spread,
        "reward_within_noise": within_noise,
        "reward_equal_or_better": reward_ok,
        "goal_steady_met": ratio >= GOAL and reward_ok,
        "goal_startup_met": with_startup >= GOAL_WITH_STARTUP and reward_ok,
        "goal_first_step_met": first_step <= 1.0,
        "goal_met": ratio >= GOAL and with_startup >= GOAL_WITH_STARTUP and reward_ok,
    }


def reward_verdict(cmp: dict[str, Any]) -> str:
    """The reward comparison in words: TRL's run-to-run spread first, then sampling noise."""
    noise = (
        "two standard errors of the difference, from each step's reward spread over its samples, are "
        f"{cmp['reward_noise_2se']:.4f}"
    )
    if cmp["reward_within_trl_spread"]:
        return "equal or better (rlfabric's median is within or above TRL's repeats)"
    if cmp["reward_within_noise"]:
        return f"equal within sampling noise (below TRL's lowest repeat, but {noise})"
    return f"worse (below TRL's lowest repeat, and {noise})"


def table_rows(results: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """One row of `HEADERS` per system, medians over its repeats."""
    rows = []
    for system, runs in results.items():
        sps, reward = stats(runs, "samples_per_s"), stats(runs, "reward_final")
        rows.append([
            system, fmt(sps.median), sps.spread(), fmt(stats(runs, "samples_per_s_with_startup").median),
            fmt(stats(runs, "seconds_per_step").median), f"{reward.median:.3f}",
            f"{reward.min:.3f}..{reward.max:.3f}", fmt(stats(runs, "first_step_end_s").median),
            fmt(stats(runs, "cores_used_steady").median), fmt(stats(runs, "cpu_s_per_sample").median),
            stolen(runs),
        ])  # fmt: skip
    return rows


def stolen(runs: list[dict[str, Any]]) -> str:
    """Per repeat, the share of the machine's CPU time the hypervisor took during the steady state."""
    shares = [r.get("cpu_stolen_steady", float("nan")) for r in runs]
    return ", ".join("n/a" if s != s else f"{100 * s:.0f} %" for s in shares)


def split_lines(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Where the time of a steady step goes, median over the repeats."""

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r["split"].get(key, float("nan")) for r in runs)

    lines = []
    if "trl" in results:
        lines.append(trl_split(results["trl"], med))
    if "rlfabric" in results:
        lines.append(rlfabric_split(results["rlfabric"], med))
    return lines


def trl_split(trl: list[dict[str, Any]], med: Callable[[list[dict[str, Any]], str], float]) -> str:
    s_trl = stats(trl, "seconds_per_step").median
    gen, prep, train = med(trl, "generate_s"), med(trl, "prepare_s"), med(trl, "train_s")
    return (
        f"- TRL, {fmt(s_trl)} s per step: generate {fmt(gen)} s ({fmt(100 * gen / s_trl)} %), prepare "
        f"(reward, reference log-probs) {fmt(prep)} s, train {fmt(train)} s ({fmt(100 * train / s_trl)} %), "
        "one after another."
    )


def rlfabric_split(ours: list[dict[str, Any]], med: Callable[[list[dict[str, Any]], str], float]) -> str:
    s_ours = stats(ours, "seconds_per_step").median
    busy = med(ours, "replica_busy_fraction")
    l_train, l_pub = med(ours, "train_s"), med(ours, "publish_s")
    return (
        f"- rlfabric, {fmt(s_ours)} s per step: learner train {fmt(l_train)} s "
        f"({fmt(100 * l_train / s_ours)} %), publish {fmt(l_pub)} s, waiting for groups "
        f"{fmt(max(s_ours - l_train - l_pub, 0.0))} s; the replica was busy {fmt(100 * busy)} % of the run "
        f"(~{fmt(busy * s_ours)} s of generation per step, overlapping training)."
    )


def startup_lines(results: dict[str, list[dict[str, Any]]], args: Any) -> list[str]:
    """Start-up, median over the repeats: each system's first step, and rlfabric's processes' ready times
    (launched together, so they overlap)."""
    lines = ["", f"Start-up (medians; rlfabric's compile cache {args.compile_cache}):", ""]
    for system, runs in results.items():
        first = f"- {system}: first step ends after {fmt(stats(runs, 'first_step_end_s').median)} s"
        ready = [r.get("ready_s", {}) for r in runs]
        names = [n for n in ready[0] if n != "redis"] if ready else []
        times = [f"{n} {fmt(statistics.median(r[n] for r in ready if n in r))} s" for n in names]
        lines.append(first + (f"; ready after launch: {', '.join(times)}" if times else "") + ".")
        handed = [r["handover_version"] for r in runs if r.get("handover_version")]
        if handed:
            starts = ", ".join(str(r["steady_from_step"]) for r in runs)
            lines.append(
                f"  The compiled replica served from version {', '.join(map(str, handed))} (per repeat): the "
                f"steady window starts at the end of step {starts}; "
                f"from the end of step 1 instead: "
                f"{fmt(stats(runs, 'samples_per_s_after_first_step').median)} samples/s."
            )
    return lines


def report(
    results: dict[str, list[dict[str, Any]]],
    task: Task,
    cmp: dict[str, Any],
    args: Any,
    machine: dict[str, Any],
    where: Placement,
) -> str:
    """The markdown report: setup, table, ratios against the goals, where a step's time goes, start-up,
    reward by step, machine and command."""
    per_repeat = cmp["throughput_ratio_per_repeat"]

    def verdict(key: str) -> str:
        return "met" if cmp[key] else "missed"

    lines = [
        f"## {NAME}",
        "",
        f"GRPO end to end, {task.steps} steps x {task.prompts_per_step} prompts x {task.group_size} samples, "
        f"max {task.max_tokens} completion tokens, lr {task.lr:g}, KL {task.kl_coef:g}, micro-batch "
        f"{task.micro_batch_size}; {'tiny' if args.quick else 'bench (24M)'} model; "
        f"{len(next(iter(results.values())))} repeat(s) per system, interleaved; rlfabric vLLM "
        f"{'transformers engine' if args.quick else ('compiled' if args.compile else 'eager')}"
        f"{f' (stand-in {args.stand_in})' if args.compile and not args.quick else ''}, "
        f"learner blocks {'compiled' if task.learner_compile else 'eager'}, "
        f"learner micro-batches {'packed' if task.learner_packing else 'padded'}, "
        f"{task.dtype}, max_staleness {task.max_staleness} (old_policy {task.old_policy}, rollout "
        f"correction {task.rollout_correction}, trust KL {task.rollout_trust_kl or 'off'}), "
        f"placement {where.name} (vLLM on cores "
        f"{where.vllm_cores}, learner torch threads {where.learner_threads or 1}); TRL {task.dtype}.",
        "",
        markdown_table(HEADERS, table_rows(results)),
        "",
        f"rlfabric / TRL samples/s: **{fmt(cmp['throughput_ratio'])}** (median of per-repeat ratios "
        f"{fmt(per_repeat['median'])}, {fmt(per_repeat['min'])}..{fmt(per_repeat['max'])}; with start-up "
        f"{fmt(cmp['throughput_ratio_with_startup'])}). Reward, rlfabric - TRL: "
        f"{cmp['reward_difference']:+.4f}: {reward_verdict(cmp)}. "
        f"Goals at equal or better reward: steady >= {GOAL}x {verdict('goal_steady_met')}, with start-up >= "
        f"{GOAL_WITH_STARTUP}x {verdict('goal_startup_met')}; first step no later than TRL's "
        f"{verdict('goal_first_step_met')} ({fmt(cmp['first_step_ratio'])}x TRL's time)"
        f"{' (quick mode: figures mean nothing)' if args.quick else ''}.",
        "",
        "Where a steady step's time goes (medians):",
        "",
        *split_lines(results),
        *startup_lines(results, args),
        "",
        "Reward by step (each repeat; rlfabric's learner LR scale by its trust region where below 1):",
        "",
        *reward_lines(results),
        "",
        f"Machine: {machine_line(machine)}; load at the end {machine_info()['load_avg_1m']:.2f}.",
        "",
        f"Command: `{' '.join(['python bench/e2e_trl.py', *sys.argv[1:]])}`.",
    ]
    return "\n".join(lines)


def reward_lines(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """One line per system and repeat: the mean reward of each step's samples, so a dip or a collapse
    shows, and where rlfabric's trust region scaled a step's LR (`algorithm.rollout_trust_kl`), by how
    much."""
    lines = []
    for system, runs in results.items():
        for i, run in enumerate(runs, 1):
            rewards = " ".join(f"{step['reward']:.2f}" for step in run["steps"])
            scales = [step.get("lr_scale", 1.0) for step in run["steps"]]
            scaled = "" if min(scales) >= 1.0 else f" (LR scale {' '.join(f'{x:.2f}' for x in scales)})"
            lines.append(f"- {system} #{i}: {rewards}{scaled}")
    return lines


def plot(results: dict[str, list[dict[str, Any]]], output_dir: Path, task: Task) -> None:
    """Throughput, reward and cores used per system, as bars with their repeats' spread."""

    def bars(key: str, unit: str) -> list[Bar]:
        return [Bar(system, stats(runs, key, unit)) for system, runs in results.items()]

    bar_plot(
        output_dir / f"{NAME}.png",
        [
            ("throughput (steady)", "samples trained / s", bars("samples_per_s", "samples/s")),
            ("reward after equal samples", "mean reward, last 1/4 of steps", bars("reward_final", "")),
            ("cores used", "CPU s / s", bars("cores_used_steady", "cores")),
        ],
        title=f"GRPO end to end: rlfabric vs TRL GRPOTrainer ({task.steps} steps x {task.samples_per_step})",
    )
