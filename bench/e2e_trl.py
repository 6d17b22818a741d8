"""End-to-end GRPO: rlfabric (`rlfabric up`, every service a real process) against TRL's GRPOTrainer.

    python bench/e2e_trl.py [--repeats 3] [--steps 10] [--lr 2e-3] [--dtype auto|bfloat16|float32]
                            [--max-staleness 0|1] [--old-policy trainer|rollout]
                            [--placement split|shared|per-core] [--learner-threads N] [--learner-ranks N]
                            [--no-compile] [--stand-in transformers|vllm] [--no-learner-compile]
                            [--systems rlfabric trl] [--keep]
                            [--quick]
                            [--output-dir bench/results]

Both systems train the same locally made model (`bench` preset, 24M parameters; `tiny` in quick mode)
on the same prompts (the demo's 72 plain-text instructions to write the letter x) with the same
TRL-signature reward function (`rlfabric.coordinator.demo:letter_reward`) and the same hyperparameters:
group size, prompts per step, max completion tokens, lr (constant), KL coefficient (k3, in the loss),
token-mean loss, std-scaled group advantages, gradient clip 1.0, micro-batch size, steps, compute dtype
(bfloat16 over float32 master weights by default). TRL needs the `bench` extra (`pip install -e .[bench]`).

How each one runs on the machine's two cores:

- rlfabric: redis-server, the reward service, one vLLM replica (compiled unless --no-compile), the
  learner (its norms and MLPs compiled, `train.compile`, unless --no-learner-compile) and the
  coordinator. By default on-policy, as TRL (`max_staleness` 0): generation and training
  take turns, each on every core (placement `shared`: the replica's OpenMP threads bound to all cores,
  the learner on as many torch threads). With `--max-staleness 1` generation of the next step overlaps
  training, the replica bound to core 0 and the learner on one thread (placement `split`): faster per
  step, but on this toy task one Adam step moves the policy so far (KL ~1-2 nats/token) that samples one
  version stale derail the run for a few steps (docs/benchmarks.md);
- TRL: one process, torch on both cores, `transformers.generate` then the training step, in turn
  (TRL's default; its vLLM modes need a CUDA device).

Each repeat runs both, interleaved (rlfabric first in even repeats). Measured per run:

- samples trained per second in the steady state (end of step 1 to end of the last step; for rlfabric
  with its eager-first start, from the end of the step after the compiled replica took over, the
  end of the start-up; `samples_per_s_after_first_step` in the JSON keeps step 1's end), and with
  start-up included (process start to the end of the last step);
- reward after the same number of samples: the mean training reward of the last quarter of the steps.
  "Equal or better" when rlfabric's median is within or above TRL's repeats, or below them by less than
  two standard errors of the difference (each system's from its steps' reward spread over their
  samples): TRL's runs are seeded and repeat exactly, so its spread alone would call any shortfall,
  however small against the sampling noise, worse;
- where the time goes: TRL's generate / prepare (reward, reference log-probs) / train seconds per step
  (timers around its own methods); rlfabric's learner train and publish seconds per step and the
  replica's busy fraction (share of the run it had work in flight: generation overlaps training);
- cores each system got (CPU seconds of its whole process tree per second): on a shared machine the
  wall-clock ratio is only as fair as this column is even;
- the share of the machine's CPU time the hypervisor took during the steady state (steal time, from
  /proc/stat), per repeat: on a virtual machine whose host is busy, a two-thread learner or generator
  loses more than the stolen share, since each OpenMP thread waits at every barrier for the other.

Goal (issue 9): rlfabric >= 1.3x TRL's samples/s at equal or better reward. `--quick` proves the code
path (tiny model, 2 steps, transformers engine for rlfabric); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from _e2e_systems import Placement, Task, run_rlfabric, run_trl
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


def prepare(work: Path, args: Any) -> Task:
    """The model and prompts both systems train on, made here (nothing is downloaded)."""
    from rlfabric.coordinator.demo import write_dataset
    from rlfabric.tools.tiny_model import PRESETS, save_tiny_model

    preset = "tiny" if args.quick else "bench"
    model = save_tiny_model(PRESETS[preset], work / f"model-{preset}")
    prompts = work / "prompts.jsonl"
    write_dataset(prompts)
    knobs = dict(lr=args.lr, kl_coef=args.kl_coef, dtype=args.dtype, max_staleness=args.max_staleness,
                 old_policy=args.old_policy, rollout_correction=args.rollout_correction,
                 rollout_trust_kl=args.rollout_trust_kl, learner_compile=args.learner_compile,
                 learner_packing=args.learner_packing)  # fmt: skip
    if args.quick:
        return Task(str(model), str(prompts), steps=2, group_size=4, prompts_per_step=2, max_tokens=16,
                    micro_batch_size=8, **knobs)  # fmt: skip
    return Task(str(model), str(prompts), steps=args.steps, group_size=args.group_size,
                prompts_per_step=args.prompts_per_step, max_tokens=args.max_tokens,
                micro_batch_size=args.micro_batch_size, **knobs)  # fmt: skip


def measure(
    task: Task, repeats: int, work: Path, args: Any, save: Callable[[dict[str, list[dict[str, Any]]]], None]
) -> dict[str, list[dict[str, Any]]]:
    """Both systems per repeat, interleaved; `save` is called after every complete repeat, so an
    interrupted run keeps the repeats it finished."""
    engine = "transformers" if args.quick else "vllm"
    systems = [s for s in SYSTEMS if s in args.systems]
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for k in range(repeats):
        for system in systems if k % 2 == 0 else reversed(systems):
            print(f"repeat {k + 1}/{repeats}: {system} ...", flush=True)
            where = work / f"r{k}"
            if system == "rlfabric":
                run = run_rlfabric(
                    task,
                    where,
                    engine=engine,
                    compile_=args.compile,
                    stand_in=args.stand_in,
                    placement=placement(args),
                    timeout_s=args.timeout,
                    compile_cache=work / "compile-cache" if args.compile_cache == "warm" else where / "cache",
                )
            else:
                run = run_trl(task, where, timeout_s=args.timeout)
            results[system].append(run)
            brief = {k: v for k, v in run.items() if k != "steps"}
            print(f"  {brief}", flush=True)
        save(results)
    return results


def placement(args: Any) -> Placement:
    """The cores of rlfabric's replica and learner: `--placement`, by default split when generation
    overlaps training and shared when the run is on-policy."""
    name = args.placement or ("shared" if args.max_staleness == 0 else "split")
    where = Placement.of(name, os.cpu_count() or 1, args.learner_threads)
    if args.learner_ranks:
        where = replace(where, learner_ranks=args.learner_ranks)
    return replace(where, vllm_cores=args.vllm_cores) if args.vllm_cores else where


def stats(runs: list[dict[str, Any]], key: str, unit: str = "") -> Stats:
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
) -> str:
    per_repeat = cmp["throughput_ratio_per_repeat"]
    where = placement(args)

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


def add_task_args(parser: argparse.ArgumentParser) -> None:
    """The task both systems run: steps, sizes, hyperparameters, dtype."""
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step (default 8)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max completion tokens (default 128)")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate, constant (default 2e-3)")
    parser.add_argument("--kl-coef", type=float, default=0.001, help="KL coefficient, k3 (default 0.001)")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="compute dtype of both systems, over float32 master weights (default auto: bfloat16 where "
        "the hardware computes it natively: a GPU, a CPU with AMX, or with AVX-512 BF16 where a matmul probe "
        "measures bfloat16 faster; else float32)",
    )
    parser.add_argument("--micro-batch-size", type=int, default=16, help="sequences per pass (default 16)")


def add_async_args(parser: argparse.ArgumentParser) -> None:
    """rlfabric's policy lag and its off-policy corrections."""
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="rlfabric's policy lag (default 0: on-policy, generation and training in turn, as TRL; 1: "
        "generation of the next step overlaps training, one version stale)",
    )
    parser.add_argument(
        "--old-policy",
        choices=["trainer", "rollout"],
        default="trainer",
        help="rlfabric's algorithm.old_policy: the PPO ratio against the learner's log-probs (default, "
        "with TIS) or the engine's (the behaviour policy: stale samples are clipped against it)",
    )
    parser.add_argument(
        "--rollout-correction",
        choices=["truncate", "mask_token", "mask_sequence"],
        default="truncate",
        help="rlfabric's algorithm.rollout_correction with --old-policy trainer: TIS (default) or the "
        "IcePop/MIS masks that drop tokens or samples whose engine/trainer ratio leaves [0.5, 2]",
    )
    parser.add_argument(
        "--rollout-trust-kl",
        type=float,
        default=None,
        help="rlfabric's algorithm.rollout_trust_kl: a step whose samples are further than this (KL per "
        "token, engine to trainer) from the current policy has its learning rate and its gradient's weight "
        "in Adam's moments scaled down by the ratio (for --max-staleness 1; default off)",
    )


def add_rlfabric_args(parser: argparse.ArgumentParser) -> None:
    """How rlfabric runs: compilation, stand-in, packing, caches, cores."""
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compiled vLLM (default; ~1 min more start-up, excluded from the steady figure) or eager",
    )
    parser.add_argument(
        "--learner-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rlfabric's train.compile: the learner's norms and MLPs compiled (default; ~20-40 s more "
        "start-up, excluded from the steady figure) or eager",
    )
    parser.add_argument(
        "--stand-in",
        choices=["transformers", "vllm"],
        default="transformers",
        help="rlfabric's `up --stand-in`: what serves while the compiled replica builds (default "
        "transformers, prompts batched; vllm: eager vLLM)",
    )
    parser.add_argument(
        "--learner-packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rlfabric's train.packing: a micro-batch's samples packed, each prompt once (default) or padded",
    )
    parser.add_argument(
        "--compile-cache",
        choices=["cold", "warm"],
        default="cold",
        help="rlfabric's vLLM and inductor compile caches: cold (default: a fresh one per run, a first "
        "start on a new machine) or warm (one shared by this bench's runs: the first run fills it, the "
        "later ones start as a user's second run does); start-up only, the steady figure leaves it out",
    )
    parser.add_argument(
        "--placement",
        choices=["split", "shared", "per-core"],
        help="rlfabric's cores: split (one vLLM replica on core 0, learner 1 thread; default with "
        "--max-staleness >= 1), shared (one replica on every core, learner on as many threads; default "
        "with --max-staleness 0) or per-core (a replica on each core, learner on every core)",
    )
    parser.add_argument(
        "--learner-threads",
        type=int,
        help="OMP_NUM_THREADS of rlfabric's services (default: the placement's)",
    )
    parser.add_argument(
        "--learner-ranks", type=int, help="rlfabric's learner processes (default: the placement's)"
    )
    parser.add_argument(
        "--vllm-cores",
        help="VLLM_CPU_OMP_THREADS_BIND of rlfabric's replicas, '|' between replicas (default: the "
        "placement's)",
    )


def parse_args() -> Any:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(repeats=3)
    add_task_args(parser)
    add_async_args(parser)
    add_rlfabric_args(parser)
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="what to run (default both)"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed")
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (every run's logs and metrics.jsonl)"
    )
    args = parser.parse_args()
    if args.dtype == "auto":
        import torch

        from rlfabric.runtime.hardware import auto_dtype

        args.dtype = auto_dtype("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # unwinds into run_tree's cleanup
    started, machine = time.time(), machine_info()
    work = Path(tempfile.mkdtemp(prefix="e2e-trl-"))
    task = prepare(work, args)

    def save(results: dict[str, list[dict[str, Any]]]) -> None:
        write_all(results, task, args, machine, started)

    results = measure(task, effective_repeats(args), work, args, save)  # on failure `work` keeps the logs
    if args.keep:
        print(f"work directory kept: {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(write_all(results, task, args, machine, started))
    return 0


def write_all(
    results: dict[str, list[dict[str, Any]]], task: Task, args: Any, machine: dict[str, Any], started: float
) -> str:
    """JSON, markdown and plot of the repeats so far; returns the markdown."""
    cmp = comparison(results)
    markdown = report(results, task, cmp, args, machine)
    payload = {
        "quick": args.quick,
        "task": {k: v for k, v in asdict(task).items() if k not in ("model", "prompts")},
        "preset": "tiny" if args.quick else "bench",
        "vllm_compiled": bool(args.compile and not args.quick),
        "compile_cache": args.compile_cache,
        "placement": asdict(placement(args)),
        "goal": GOAL,
        "comparison": cmp,
        "runs": results,
        "machine": machine,
        "load_avg_1m_end": machine_info()["load_avg_1m"],
        "bench_wall_s": time.time() - started,
    }
    write_results(args.output_dir, NAME, payload, markdown)
    plot(results, args.output_dir, task)
    return markdown


if __name__ == "__main__":
    sys.exit(main())
