"""Multi-turn rollout: rlfabric's trajectory driver against the naive loop, on one vLLM engine in one run.

The task (`bench/_multiturn_env.py`): a user asks four questions, one per model turn; the environment
answers each turn with the next question and is done after the fourth. T tasks x n samples are played
per run, by three loops sharing one in-process `VllmEngine` (the replica's engine settings) and one
in-process `SessionTable` of that environment:

- rlfabric: the replica's multi-turn path as `Generate` with `multi_turn` runs it, without the gRPC hops
  (`Replica.play` with a `TrajectoryDriver` on `Replica.engine_turn`, the environment in-process):
  every trajectory advances on its own, as soon as its last turn and environment step are done; each
  turn's prompt is the previous prompt + the sampled ids + the environment's reply appended as ids
  (incremental rendering), so vLLM's prefix cache holds the conversation so far;
- naive, as simple trainers and hand-written loops do: per turn, re-render every running conversation's
  whole message list with `apply_chat_template` and tokenize it, submit the turn of all of them at once
  and wait for the last one, step every environment, next turn;
- lockstep: the driver's token-in prompts, but every turn waits for all trajectories' previous turn (a
  barrier per turn). This is what TRL 1.16's tool loop does (`GRPOTrainer._tool_call_loop`: prompt +
  completion + tool-suffix ids concatenated, one generation call per iteration for every sample still
  calling tools), and it splits the gain in two: re-tokenizing (naive -> lockstep) and waiting for the
  batch's slowest turn (lockstep -> rlfabric).

Same engine, sampling (temperature 1, seeded: trajectory k of a run samples turn t with seed
s + k + t * 7919 in every loop, so first turns agree), limits and environment. vLLM's prefix cache is on
for every loop (its default) and reset before each run. Measured per run: model-generated tokens per
wall second, trajectories per second, the prefix-cache hit rate (vLLM's `num_cached_tokens` over the
prompt tokens of every model turn), mean model-turn length, statuses, the environment's reward, and for
the naive loop how many trajectories' re-tokenized ids differed from the ids sampled (turns where the
re-rendered prompt does not extend the previous prompt + the sampled ids: the learner would train on
tokens the policy never produced, and the prefix cache misses from there on).

The prefix cache reuses whole KV blocks: 128 tokens by vLLM's default on CPU, which a conversation of
~50-token turns fills slowly. `engine.block_size` is the replica setting for that (its docstring advises
smaller blocks for multi-turn): the headline engine uses 32, a second engine vLLM's default, each
running every loop (`--block-sizes`).

The model is the BPE tiny model (`bench` preset, 24M parameters; `tiny` in --quick) rigged by
`make-tiny-model --turn-length N` to end a turn with `<|im_end|>` with probability ~1/N at every step,
whatever the context (a geometric turn length of mean ~N, the same law in every loop). On top, the bench
unties the output head and gives the five other special tokens a logit ~-30 there (input embeddings
unchanged): a random model would otherwise sample `<|endoftext|>` or `<|im_start|>` inside a turn ~1 %
of steps, which ends the driver's trajectory `template_mismatch` (the turn's ids no longer render as the
template does) while the naive loop would carry on. `max_tokens` per turn is ~8x the mean turn length,
so turns cut at max_tokens (which truncate a trajectory in every loop) are rare; they are counted.

Repeats: one warm-up round, then K rounds, each running every loop once in rotating order (seed per
round, the same for every loop of the round). Median and min..max. Goal (issue 21): rlfabric >= 1.5x
the naive loop's tokens/s. The machine is shared, and a two-thread vLLM worker loses far more than the
CPU another process takes (its OpenMP threads wait for each other): each run starts once the rest of the
machine has been quiet for 2 s (waiting `--quiet-wait` seconds at most), a run during which the rest
used more than 0.3 cores is run again (three times at most, every loop alike; the discarded runs are in the
JSON), and the report shows the load average and the cores the rest of the machine used in each run.

    python bench/multiturn.py [--quick] [--repeats K] [--output-dir DIR] [--eager] [--block-sizes 32 0]
                              [--quiet-wait S]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from _multiturn_env import TripPlanner, make_tasks
from _multiturn_loops import PLAYERS, Load, Played, Setup
from common import (
    Bar,
    Stats,
    bar_plot,
    base_parser,
    child_pids,
    cpu_seconds,
    effective_repeats,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    ratio,
    report_results,
)
from rollout_service import vllm_env

NAME = "multiturn"
GOAL = 1.5
LOOPS = ("rlfabric", "lockstep", "naive")
QUIET_CORES = 0.25
"""A run starts once the rest of the machine used fewer cores than this (or after --quiet-wait s)."""
NOISY_CORES = 0.3
"""A run during which the rest of the machine used more cores than this is run again (RETRIES times at
most; the last is kept); the discarded runs are in the JSON."""
RETRIES = 3
SUPPRESSED_LOGIT = 10.0
"""The other special tokens' output row is -this x `<|im_end|>`'s (a logit of about -30 at mean 30)."""


FULL = Load("bench", 16, 4, 4, 30, 256, kv_cache_bytes=2 << 30, max_model_len=2048, eager=False)
QUICK = Load("tiny", 4, 2, 4, 12, 96, kv_cache_bytes=256 << 20, max_model_len=1024, eager=True)


# --- the model -------------------------------------------------------------------------------------------


def make_model(load: Load, out: Path) -> Path:
    """The BPE tiny model of `load.preset`, rigged to end turns after ~`turn_length` tokens, whose output
    head never picks a special token other than `<|im_end|>` (module docstring)."""
    from rlfabric.tools.tiny_model import PRESETS, build_model, spec_tokenizer

    spec = replace(PRESETS[load.preset], tokenizer="bpe", turn_length=load.turn_length)
    model = build_model(spec)
    untie_and_suppress_specials(model)
    model.save_pretrained(out)
    spec_tokenizer(spec).save_pretrained(out)
    return out


def untie_and_suppress_specials(model: Any) -> None:
    """A separate output head, a copy of the embeddings, whose rows of the special tokens other than
    `<|im_end|>` are -SUPPRESSED_LOGIT x `<|im_end|>`'s (which only reads the constant hidden dimension
    `end_turns_after` set up): those tokens get a large negative logit at every step."""
    import torch

    from rlfabric.tools.tiny_model import IM_END, special_ids

    ids = special_ids()
    head = model.model.embed_tokens.weight.detach().clone()
    for token, i in ids.items():
        if token != IM_END:
            head[i] = -SUPPRESSED_LOGIT * head[ids[IM_END]]
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)


# --- measuring -------------------------------------------------------------------------------------------


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its descendants (vLLM's engine core and worker are children)."""
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        total += cpu_seconds(current) or 0.0
        stack += child_pids(current)
    return total


def machine_busy_seconds() -> float:
    """CPU seconds every CPU of the machine spent on anything but idle and iowait so far (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


async def wait_for_quiet(max_wait_s: float) -> float:
    """Waits (at most `max_wait_s`) until the rest of the machine used under QUIET_CORES over the last
    2 s; returns the seconds waited. Every loop's run waits alike: it lowers the noise, not a side."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait_s:
        ours, machine = tree_cpu_seconds(os.getpid()), machine_busy_seconds()
        await asyncio.sleep(2.0)
        others = (machine_busy_seconds() - machine) - (tree_cpu_seconds(os.getpid()) - ours)
        if others / 2.0 < QUIET_CORES:
            break
    return time.perf_counter() - start


async def measure(setup: Setup, loop: str, request_id: str, seed: int, quiet_wait_s: float) -> dict[str, Any]:
    """One run of `loop` on a cold prefix cache, once the machine is quiet: its figures and the CPU this
    process tree and the rest of the machine used meanwhile."""
    await setup.replica.engine.reset_prefix_cache()
    waited = await wait_for_quiet(quiet_wait_s) if quiet_wait_s > 0 else 0.0
    load_1m = os.getloadavg()[0]
    ours, machine, start = tree_cpu_seconds(os.getpid()), machine_busy_seconds(), time.perf_counter()
    played = await PLAYERS[loop](setup, request_id, seed)
    wall = time.perf_counter() - start
    ours = tree_cpu_seconds(os.getpid()) - ours
    machine = machine_busy_seconds() - machine
    return summarise_run(played, wall) | {
        "quiet_wait_s": waited,
        "load_1m": load_1m,
        "cores_ours": ours / wall,
        "cores_others": max(machine - ours, 0.0) / wall,
    }


def summarise_run(played: list[Played], wall: float) -> dict[str, Any]:
    tokens = sum(p.model_tokens for p in played)
    prompt = sum(p.prompt_tokens for p in played)
    turns = sum(p.model_turns for p in played)
    rewards = [p.reward for p in played if p.reward is not None]
    return {
        "wall_s": wall,
        "trajectories": len(played),
        "statuses": dict(Counter(p.status for p in played)),
        "model_tokens": tokens,
        "model_turns": turns,
        "tokens_per_s": tokens / wall,
        "trajectories_per_s": len(played) / wall,
        "mean_turn_tokens": tokens / max(turns, 1),
        "prompt_tokens": prompt,
        "cached_tokens": sum(p.cached_tokens for p in played),
        "cache_hit_rate": sum(p.cached_tokens for p in played) / max(prompt, 1),
        "drifted_trajectories": sum(p.drifted_turns > 0 for p in played),
        "drifted_turns": sum(p.drifted_turns for p in played),
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
    }


async def run_block_size(
    model: Path, load: Load, block_size: int | None, repeats: int, quiet_wait_s: float
) -> dict[str, Any]:
    """Every loop on one engine: a warm-up round, then `repeats` rounds in rotating order."""
    setup = await start(model, load, block_size)
    runs: dict[str, list[dict[str, Any]]] = {loop: [] for loop in LOOPS}
    discarded: list[dict[str, Any]] = []
    try:
        for i in range(repeats + 1):
            order = LOOPS[i % len(LOOPS) :] + LOOPS[: i % len(LOOPS)]
            for loop in order:
                name = f"{loop}-{block_size}-{i}"
                result, noisy = await measure_quietly(setup, loop, name, 1000 * (i + 1), quiet_wait_s)
                discarded += [run | {"loop": loop, "round": i} for run in noisy]
                print(f"  block {block_size or 'default'} round {i} {loop}: {brief(result)}", flush=True)
                if i > 0:
                    runs[loop].append(result)
    finally:
        await setup.replica.engine.close()
    return summarise_loops(runs) | {"block_size": block_size, "discarded_runs": discarded}


async def measure_quietly(
    setup: Setup, loop: str, name: str, seed: int, quiet_wait_s: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`measure`, run again (at most RETRIES times, when waiting for quiet is on) while the rest of the
    machine used more than NOISY_CORES during the run; returns the run kept and the ones discarded."""
    discarded: list[dict[str, Any]] = []
    for attempt in range(RETRIES + 1):
        result = await measure(setup, loop, f"{name}-{attempt}", seed, quiet_wait_s)
        if quiet_wait_s <= 0 or result["cores_others"] <= NOISY_CORES or attempt == RETRIES:
            return result, discarded
        print(f"  {name}: discarded ({result['cores_others']:.2f} cores used by others)", flush=True)
        discarded.append(result)
    raise AssertionError("unreachable")


async def start(model: Path, load: Load, block_size: int | None) -> Setup:
    """The engine as a replica runs it on CPU (blocking waits between its processes), serving version 0."""
    from rlfabric.environment.sessions import SessionLimits, SessionTable
    from rlfabric.rollout.replica import Limits, Replica
    from rlfabric.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(
        str(model), dtype="float32", max_model_len=load.max_model_len, kv_cache_bytes=load.kv_cache_bytes,
        block_size=block_size, enforce_eager=load.eager, worker_wait="block",
    )  # fmt: skip
    await engine.start()
    trajectories = load.tasks * load.n
    replica = Replica(engine, Limits(trajectories, load.n, load.max_tokens, load.tasks))

    async def restore() -> None:
        return None

    replica.start_serving(0, restore)
    sessions = SessionTable(TripPlanner, SessionLimits(max_sessions=4 * trajectories, step_timeout_s=60))
    return Setup(replica, sessions, engine.hf_tokenizer(), make_tasks(load.tasks, load.turns), load)


def brief(run: dict[str, Any]) -> str:
    return (
        f"{run['tokens_per_s']:.0f} tok/s, {run['trajectories_per_s']:.2f} traj/s, "
        f"hit {run['cache_hit_rate']:.0%}, turn {run['mean_turn_tokens']:.1f} tok, {run['statuses']}, "
        f"drift {run['drifted_trajectories']}, load {run['load_1m']:.2f}, others {run['cores_others']:.2f}"
    )


def summarise_loops(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    keys = {
        "tokens_per_s": "tokens/s", "trajectories_per_s": "trajectories/s", "cache_hit_rate": "fraction",
        "mean_turn_tokens": "tokens", "wall_s": "s", "cores_ours": "cores", "cores_others": "cores",
        "load_1m": "load",
    }  # fmt: skip
    loops = {
        loop: {key: Stats.of([r[key] for r in values], unit).to_dict() for key, unit in keys.items()}
        | {"runs": values}
        for loop, values in runs.items()
    }
    median = {loop: loops[loop]["tokens_per_s"]["median"] for loop in LOOPS}
    traj = {loop: loops[loop]["trajectories_per_s"]["median"] for loop in LOOPS}
    paired = [
        r["tokens_per_s"] / n["tokens_per_s"] for r, n in zip(runs["rlfabric"], runs["naive"], strict=True)
    ]
    return {
        "loops": loops,
        "ratio": ratio(median["rlfabric"], median["naive"]),
        "ratio_trajectories_per_s": ratio(traj["rlfabric"], traj["naive"]),
        "ratio_per_round": Stats.of(paired, "x").to_dict(),
        "lockstep_vs_naive": ratio(median["lockstep"], median["naive"]),
        "rlfabric_vs_lockstep": ratio(median["rlfabric"], median["lockstep"]),
    }


def run(
    load: Load, block_sizes: Sequence[int | None], repeats: int, quiet_wait_s: float, workdir: Path
) -> list[dict[str, Any]]:
    os.environ.update(vllm_env(workdir, load.eager))  # before vLLM is imported in this process
    model = make_model(load, workdir / f"model-{load.preset}")
    return [asyncio.run(run_block_size(model, load, size, repeats, quiet_wait_s)) for size in block_sizes]


# --- report ----------------------------------------------------------------------------------------------


def cell(stats: dict[str, Any], scale: float = 1.0, percent: bool = False) -> str:
    s = Stats(**stats)
    if percent:
        return f"{s.median:.0%} ({s.min:.0%}..{s.max:.0%})"
    return f"{fmt(s.median * scale)} ({fmt(s.min * scale)}..{fmt(s.max * scale)})"


LABELS = {
    "rlfabric": "rlfabric (driver, trajectories independent)",
    "lockstep": "lockstep (driver's ids, barrier per turn)",
    "naive": "naive (re-render + re-tokenize, barrier per turn)",
}
HEADERS = [
    "loop", "tokens/s", "trajectories/s", "prefix-cache hits", "prompt tokens computed / trajectory",
    "tokens / model turn", "statuses (all rounds)", "re-tokenized ids differ", "reward", "cores (bench)",
    "cores (others)", "load 1 min",
]  # fmt: skip


def loop_rows(config: dict[str, Any]) -> list[list[Any]]:
    return [loop_row(loop, config["loops"][loop]) for loop in LOOPS]


def loop_row(loop: str, entry: dict[str, Any]) -> list[Any]:
    runs = entry["runs"]
    statuses = Counter[str]()
    for r in runs:
        statuses.update(r["statuses"])
    trajectories = sum(r["trajectories"] for r in runs)
    computed = sum(r["prompt_tokens"] - r["cached_tokens"] for r in runs) / trajectories
    drifted = sum(r["drifted_trajectories"] for r in runs)
    drift = (
        f"{drifted}/{trajectories} ({sum(r['drifted_turns'] for r in runs)} turns)"
        if loop == "naive"
        else "0 (ids kept)"
    )
    return [
        LABELS[loop], cell(entry["tokens_per_s"]), cell(entry["trajectories_per_s"]),
        cell(entry["cache_hit_rate"], percent=True), fmt(computed), fmt(entry["mean_turn_tokens"]["median"]),
        ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())), drift,
        fmt(statistics.fmean(r["reward_mean"] for r in runs)), cell(entry["cores_ours"]),
        cell(entry["cores_others"]), cell(entry["load_1m"]),
    ]  # fmt: skip


def render_markdown(payload: dict[str, Any]) -> str:
    load = payload["load"]
    mode = "eager" if load["eager"] else "compiled"
    parts = [
        "## multiturn: multi-turn rollout, rlfabric's trajectory driver vs the naive loop",
        machine_line(payload["machine"]),
        f"Model: BPE tiny model, preset `{load['preset']}`, float32, vLLM {mode} in-process (the replica's "
        f"engine settings), turns ending on `<|im_end|>` with probability ~1/{load['turn_length']} per step. "
        f"One run = {load['tasks']} tasks x n={load['n']} trajectories of {load['turns']} model turns "
        f"(the environment asks 4 questions), max_tokens {load['max_tokens']} per turn, temperature 1, "
        f"seeded. Median of {payload['repeats']} rounds (min..max) after a warm-up round; the loops of a "
        "round run in rotating order, each on a cold prefix cache, each once the rest of the machine used "
        f"< {QUIET_CORES} cores for 2 s (waiting at most {payload['quiet_wait_s']:g} s); a run during "
        f"which the rest used > {NOISY_CORES} cores was run again ({RETRIES} times at most).",
    ]
    for config in payload["results"]:
        size = config["block_size"] or "vLLM's default (128 on CPU)"
        verdict = "met" if config["ratio"] >= GOAL else "**not met**"
        parts += [
            f"### KV-cache block size {size}",
            markdown_table(HEADERS, loop_rows(config)),
            f"rlfabric / naive tokens/s: **{fmt(config['ratio'])}** (per round "
            f"{cell(config['ratio_per_round'])}; trajectories/s {fmt(config['ratio_trajectories_per_s'])}); "
            f"goal >= {GOAL}: {verdict}. Split: lockstep / naive {fmt(config['lockstep_vs_naive'])} "
            f"(token-in prompts: the prefix cache kept), rlfabric / lockstep "
            f"{fmt(config['rlfabric_vs_lockstep'])} (no barrier per turn). The naive loop prefilled "
            f"{fmt(computed_ratio(config))}x the prompt tokens of the driver's. Runs discarded as noisy: "
            f"{len(config['discarded_runs'])}.",
        ]
    parts.append(
        "Prefix-cache hits: vLLM's cached prompt tokens over all prompt tokens of every model turn; prompt "
        "tokens computed: the rest (prefill work). Re-tokenized ids differ: naive trajectories with a turn "
        "whose re-rendered, re-tokenized prompt is not the previous prompt + the ids sampled (a random "
        "model's ids are rarely the tokenizer's canonical split, and its non-ASCII bytes decode to U+FFFD, "
        "which re-encodes longer; a trained model drifts less and keeps more of the cache). Cores (others): "
        "CPU the rest of the machine used during each run (/proc/stat over all CPUs, less this bench's "
        "process tree); the load average counts this bench's own processes too (~2 while it keeps two cores "
        f"busy). Load average at the start: {payload['machine']['load_avg_1m']:.2f}.",
    )
    parts.append(
        "Why not more: on two CPU cores a decode step's time grows nearly in proportion to the batch "
        "(compute-bound; `rollout_scaling`: 605 tokens/s at 32 sequences, 789 at 64), so a batch draining to "
        "its turn's slowest trajectory wastes less than it would where a step costs about the same whatever "
        "the batch (a GPU; not measured here)."
    )
    parts.append(
        "The same kind of task end to end, GRPO with TRL's `GRPOTrainer(environment_factory=...)` against "
        "`rlfabric up`, one environment class on both sides: `bench/multiturn_e2e.py` (`multiturn_e2e.md`)."
    )
    return "\n\n".join(parts)


def computed_ratio(config: dict[str, Any]) -> float:
    """Prompt tokens the naive loop computed (not prefix-cached) over the driver's, all rounds."""
    computed = {
        loop: sum(r["prompt_tokens"] - r["cached_tokens"] for r in config["loops"][loop]["runs"])
        for loop in ("rlfabric", "naive")
    }
    return ratio(computed["naive"], computed["rlfabric"])


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    panels, goals = [], []
    for config in payload["results"]:
        size = config["block_size"] or "default"
        loops = config["loops"]
        for key, label in (("tokens_per_s", "tokens/s"), ("cache_hit_rate", "prefix-cache hit rate")):
            bars = [Bar(loop, Stats(**loops[loop][key])) for loop in LOOPS]
            panels.append((f"{label}, block {size}", label, bars))
            goals.append(GOAL * loops["naive"][key]["median"] if key == "tokens_per_s" else None)
    return bar_plot(path, panels, "multiturn: rlfabric vs naive multi-turn loop", goals)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="vLLM eager (default: compiled, as a replica)")
    parser.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        metavar="N",
        help="KV-cache block sizes, one engine each, the first the headline; 0 is vLLM's default "
        "(128 on CPU). Default: 32 0 (quick: 32)",
    )
    parser.add_argument(
        "--quiet-wait", type=float, metavar="S",
        help=f"before each run, wait up to S seconds for the rest of the machine to use < {QUIET_CORES} "
        "cores (default 600; 0 in quick mode)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    repeats = effective_repeats(args)
    load = QUICK if args.quick else replace(FULL, eager=args.eager)
    sizes = args.block_sizes or ([32] if args.quick else [32, 0])
    quiet_wait = args.quiet_wait if args.quiet_wait is not None else (0.0 if args.quick else 600.0)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-multiturn-") as workdir:
        results = run(load, [size or None for size in sizes], repeats, quiet_wait, Path(workdir))
    payload = {
        "machine": machine,
        "quick": args.quick,
        "repeats": repeats,
        "goal": GOAL,
        "load": asdict(load),
        "quiet_wait_s": quiet_wait,
        "results": results,
        "ratio": results[0]["ratio"],
    }
    payload["goal_met"] = results[0]["ratio"] >= GOAL
    report_results(args.output_dir, NAME, payload, render_markdown(payload), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
