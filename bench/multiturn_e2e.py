"""Multi-turn GRPO end to end: rlfabric (`rlfabric up` with an `[environment]`) against TRL's
`GRPOTrainer(environment_factory=...)`, on the same 4-turn tool task and the same environment class.

The task (`bench/_multiturn_env.py`): the model reads three secret words with the `read_word` tool, one
call a turn, then answers with the three words (4 model turns; the words change from task to task).
`SecretWords` is written for TRL's `environment_factory` and runs unchanged in rlfabric's environment
service (`kind = "trl"`); `words_reward` (the share of the three words given in their places) is the
reward function of both. TRL's multi-turn loop goes on only while the model calls tools, which a random
model never does, so both start from the same supervised warm start: a BPE tiny model made locally
(`mid`: 4 layers, hidden 256, 3.4M parameters; `tiny` in --quick) with TRL's Qwen2.5 chat template (the
one TRL parses tool calls with; rlfabric's chat-template self-test passes on it), fine-tuned by `rlfabric
up` (mode "sft") on 1,024 demonstrations of the task, once per run of this script, before anything is
measured. It starts GRPO calling the tool three times and answering, copying ~10 % of the words right.

Both systems then train from that model with the same hyperparameters (group size, prompts per step, lr
constant, KL coefficient k3 in the loss, token-mean loss, std-scaled group advantages, gradient clip,
micro-batch, steps, float32), on the same two cores, one after the other, interleaved repeat by repeat:

- rlfabric: redis-server, the reward service, the environment service, one vLLM replica (`up`'s default:
  eager; its OpenMP threads on both cores) and the learner (as many torch threads), on-policy
  (`max_staleness` 0, as TRL) so generation and training take turns; the replica plays every trajectory
  on its own (the trajectory driver: token-in/token-out, prefix cache), each model turn at most
  `turn_tokens` tokens, a trajectory at most `max_total_tokens` after the prompt;
- TRL: one process, `transformers.generate` for each turn of the tool loop (its vLLM modes need CUDA),
  then the training step; `max_completion_length` = `max_total_tokens` (TRL has no per-turn limit) and
  `max_tool_calling_iterations` = turns - 1.

Reported per system (median and min..max over the repeats): samples trained per second in the steady
state (end of step 1 to end of the last step) and with start-up, the mean training reward of the last
quarter of the steps, tool calls per sample, cores used. Goal (issue 21): rlfabric >= 1.5x TRL's
samples/s at equal reward. `--quick` proves the code path (tiny model, 2 steps); its figures mean nothing.

    python bench/multiturn_e2e.py [--quick] [--repeats K] [--output-dir DIR] [--steps N]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from _e2e_report import comparison, reward_verdict, split_lines, table_rows
from _e2e_systems import Task, rlfabric_step, run_tree, summarize
from _multiturn_env import WORDS, SecretWords, word_tasks
from common import (
    BENCH_DIR,
    Bar,
    Stats,
    bar_plot,
    base_parser,
    effective_repeats,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    report_results,
)

NAME = "multiturn_e2e"
GOAL = 1.5
SYSTEMS = ("rlfabric", "trl")
ENV_FILE = BENCH_DIR / "_multiturn_env.py"
"""Holds the environment class and the reward function; `rlfabric up` runs user code from the run file's
folder only, so each rlfabric run gets a copy of this file next to its run file (the same code TRL's
process imports)."""
HEADERS = [
    "system", "samples/s (steady)", "min..max", "samples/s (with start-up)", "s / step", "reward (last 1/4)",
    "min..max", "first step ends (s)", "cores used", "CPU s / sample", "CPU stolen by the host",
]  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The warm start and the GRPO runs both systems make."""

    preset: str
    sft_steps: int
    sft_lr: float
    steps: int
    group_size: int
    prompts_per_step: int
    turns: int
    turn_tokens: int
    max_total_tokens: int
    lr: float
    kl_coef: float
    micro_batch_size: int
    max_model_len: int = 512


FULL = Plan("mid", sft_steps=300, sft_lr=2e-3, steps=10, group_size=8, prompts_per_step=4, turns=4,
            turn_tokens=48, max_total_tokens=192, lr=5e-4, kl_coef=0.001, micro_batch_size=16)  # fmt: skip
QUICK = Plan("tiny", sft_steps=20, sft_lr=2e-3, steps=2, group_size=4, prompts_per_step=2, turns=4,
             turn_tokens=48, max_total_tokens=192, lr=5e-4, kl_coef=0.001, micro_batch_size=8)  # fmt: skip


def model_spec(preset: str) -> Any:
    """The tiny-model shape of `preset`: make-tiny-model's presets, and `mid` (4 layers, hidden 256, MLP 768,
    3.4M parameters with the BPE vocabulary), which learns the task's format and some of its copying in a
    300-step warm start on two cores (~10 min) where `tiny` does not, and trains ~7x faster than `bench`."""
    from rlfabric.tools.tiny_model import PRESETS, TinyModelSpec

    shapes = {**PRESETS, "mid": TinyModelSpec(layers=4, hidden=256, heads=4, intermediate=768)}
    return replace(shapes[preset], tokenizer="bpe")


# --- the warm start --------------------------------------------------------------------------------------


def base_model(plan: Plan, out: Path) -> Path:
    """The BPE tiny model of the plan's shape, its tokenizer carrying TRL's Qwen2.5 chat template."""
    from trl.chat_template_utils import qwen2_5_chat_template

    from rlfabric.tools.tiny_model import build_model, spec_tokenizer

    spec = model_spec(plan.preset)
    build_model(spec).save_pretrained(out)
    tokenizer = spec_tokenizer(spec)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(out)
    return out


def tools_json() -> str:
    """`read_word`'s schema as both systems show it to the model (transformers' get_json_schema)."""
    from transformers.utils import get_json_schema

    return json.dumps([get_json_schema(SecretWords().read_word)])


def demonstration(row: dict[str, str], tools: str) -> dict[str, Any]:
    """One SFT row: three `read_word` calls, one a turn, each answered by the tool, then the words."""
    call = json.dumps({"name": "read_word", "arguments": {}})
    messages: list[dict[str, str]] = [{"role": "user", "content": row["prompt"]}]
    for word in row["answer"].split():
        messages += [
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": word},
        ]
    messages.append({"role": "assistant", "content": row["answer"]})
    return {"tools": tools, "messages": messages}


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def warm_start(plan: Plan, base: Path, work: Path) -> Path:
    """`rlfabric up` of an SFT run on the demonstrations; returns its final model folder."""
    tools = tools_json()
    demos = write_jsonl(work / "sft.jsonl", [demonstration(r, tools) for r in word_tasks(1024, seed=1)])
    spec = {
        "name": "sft",
        "mode": "sft",
        "model": {"path": str(base), "max_model_len": plan.max_model_len, "dtype": "float32"},
        "dataset": {"path": str(demos), "epochs": 100, "shuffle_seed": 0},
        "optim": {"lr": plan.sft_lr, "schedule": "constant"},
        "train": {"steps": plan.sft_steps, "groups_per_step": 16, "micro_batch_size": 16,
                  "checkpoint_every": plan.sft_steps},
    }  # fmt: skip
    run_dir = work / "sft-run"
    run_dir.mkdir(exist_ok=True)
    run_file = write_json(run_dir / "run.json", spec)
    argv = [
        sys.executable,
        "-m",
        "rlfabric.cli",
        "up",
        str(run_file),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    run_logged(argv, run_dir / "up.out", dict(os.environ), timeout_s=3600)
    return run_dir / "sft" / "model"


def run_logged(argv: list[str], log: Path, env: dict[str, str], timeout_s: float) -> tuple[float, Any]:
    """`run_tree`, printing the end of the process's log when it fails (the work folder is temporary)."""
    try:
        return run_tree(argv, log, env, timeout_s)
    except RuntimeError:
        print("".join(log.read_text().splitlines(keepends=True)[-60:]), file=sys.stderr)
        raise


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.write_text(json.dumps(payload))
    return path


# --- the two systems -------------------------------------------------------------------------------------


def task_of(plan: Plan, model: Path, tasks: Path) -> Task:
    """The shared hyperparameters in `_e2e_systems.Task`'s form (its `summarize` reads them)."""
    return Task(
        str(model), str(tasks), steps=plan.steps, group_size=plan.group_size,
        prompts_per_step=plan.prompts_per_step, max_tokens=plan.turn_tokens, lr=plan.lr,
        kl_coef=plan.kl_coef, micro_batch_size=plan.micro_batch_size, max_staleness=0,
        threads=os.cpu_count() or 1,
    )  # fmt: skip


def rlfabric_spec(plan: Plan, task: Task, env_file: Path) -> dict[str, Any]:
    """The run file: the task's prompts and columns, the environment and reward of `env_file`, the shared
    hyperparameters."""
    return {
        "name": "mt",
        "model": {"path": task.model, "max_model_len": plan.max_model_len, "dtype": "float32"},
        "dataset": {
            "path": task.prompts, "prompt_field": "prompt", "reference_field": "answer",
            "shuffle_seed": task.seed, "epochs": 1000,
        },
        "environment": {
            "max_turns": plan.turns, "max_total_tokens": plan.max_total_tokens,
            "service": {"kind": "trl", "ref": f"{env_file}:SecretWords"},
        },
        "rollout": {
            "sampling": {"n": task.group_size, "max_tokens": task.max_tokens, "temperature": 1.0},
            "max_staleness": 0,
        },
        "reward": {"scorer": "python_function", "params": {"function": f"{env_file}:words_reward"}},
        "algorithm": {
            "advantage": "grpo", "loss_aggregation": "token_mean",
            "kl": {"coef": task.kl_coef, "estimator": "k3"},
        },
        "optim": {"lr": task.lr, "schedule": "constant", "grad_clip": 1.0},
        "train": {
            "steps": task.steps, "groups_per_step": task.prompts_per_step,
            "micro_batch_size": task.micro_batch_size, "checkpoint_every": task.steps, "seed": task.seed,
        },
    }  # fmt: skip


def run_rlfabric(plan: Plan, task: Task, work: Path, *, engine: str, timeout_s: float) -> dict[str, Any]:
    """One `rlfabric up`: the replica's OpenMP threads on every core, the learner on as many threads."""
    run_dir = work / "rlfabric"
    run_dir.mkdir(parents=True)
    env_file = run_dir / ENV_FILE.name
    shutil.copyfile(ENV_FILE, env_file)
    run_file = write_json(run_dir / "run.json", rlfabric_spec(plan, task, env_file))
    cores = os.cpu_count() or 1
    argv = [sys.executable, "-m", "rlfabric.cli", "up", str(run_file), "--run-dir", str(run_dir)]
    argv += ["--no-progress", "--engine", engine, "--replica-cores", f"0-{cores - 1}"]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(cores)}
    start, cpu = run_logged(argv, run_dir / "up.out", env, timeout_s)
    end = time.time()
    rows = [json.loads(line) for line in (run_dir / "mt" / "metrics.jsonl").read_text().splitlines()]
    steps = [rlfabric_step(r) | multi_turn_figures(r) for r in rows]
    return summarize(steps, task, start, end, cpu)


def multi_turn_figures(row: dict[str, Any]) -> dict[str, float]:
    """The learner row's multi-turn means: model turns and tool calls per sample."""
    return {
        "turns": float(row.get("turns_mean", float("nan"))),
        "tool_calls": float(row.get("tool_calls_mean", float("nan"))),
    }


def run_trl(plan: Plan, task: Task, work: Path, *, timeout_s: float) -> dict[str, Any]:
    """One TRL GRPOTrainer run in its own process (`_multiturn_trl_worker.py`)."""
    run_dir = work / "trl"
    run_dir.mkdir(parents=True)
    config = {
        **asdict(task),
        "tasks": task.prompts,
        "turns": plan.turns,
        "max_total_tokens": plan.max_total_tokens,
    }
    out = run_dir / "steps.json"
    argv = [
        sys.executable,
        str(BENCH_DIR / "_multiturn_trl_worker.py"),
        str(write_json(run_dir / "config.json", config)),
        str(out),
    ]
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    start, cpu = run_logged(argv, run_dir / "trl.out", env, timeout_s)
    end = time.time()
    rows = json.loads(out.read_text())["rows"]
    steps = [{**r, "samples": float(task.samples_per_step)} for r in rows]
    return summarize(steps, task, start, end, cpu)


def measure(plan: Plan, task: Task, repeats: int, work: Path, quick: bool) -> dict[str, list[dict[str, Any]]]:
    """Both systems per repeat, interleaved (rlfabric first in even repeats)."""
    engine = "transformers" if quick else "vllm"
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    for i in range(repeats):
        for system in SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]:
            where = work / f"repeat-{i}"
            if system == "rlfabric":
                run = run_rlfabric(plan, task, where, engine=engine, timeout_s=3600)
            else:
                run = run_trl(plan, task, where, timeout_s=3600)
            run["load_1m_after"] = os.getloadavg()[0]
            results[system].append(run)
            figures = f"{run['samples_per_s']:.2f} samples/s, reward {run['reward_final']:.3f}"
            print(f"{system} repeat {i}: {figures}", flush=True)
    return results


# --- report ----------------------------------------------------------------------------------------------


def tool_calls(runs: list[dict[str, Any]]) -> float:
    """Median over the repeats of the steady steps' mean tool calls per sample."""
    per_run = [
        statistics.fmean(s.get("tool_calls", float("nan")) for s in r["steps"][1:] or r["steps"])
        for r in runs
    ]
    return statistics.median(per_run)


def course(runs: list[dict[str, Any]]) -> str:
    """How a system's runs went, medians over the repeats: reward and tool calls per sample at the first
    and the last step, and the load average after each run."""

    def med(key: str, index: int) -> float:
        return statistics.median(r["steps"][index].get(key, float("nan")) for r in runs)

    loads = ", ".join(f"{r.get('load_1m_after', float('nan')):.1f}" for r in runs)
    return (
        f"reward {med('reward', 0):.3f} -> {med('reward', -1):.3f}, tool calls per sample "
        f"{fmt(med('tool_calls', 0))} -> {fmt(med('tool_calls', -1))}; load after each run {loads}"
    )


def rlfabric_split(runs: list[dict[str, Any]]) -> str:
    """Where rlfabric's steady step goes, on-policy: the learner, then the replica playing the next step's
    trajectories while the learner waits."""

    def med(key: str) -> float:
        return statistics.median(r["split"].get(key, float("nan")) for r in runs)

    step = statistics.median(r["seconds_per_step"] for r in runs)
    train, publish = med("train_s"), med("publish_s")
    return (
        f"- rlfabric, {fmt(step)} s per step: learner train {fmt(train)} s ({fmt(100 * train / step)} %), "
        f"publish {fmt(publish)} s, the rest ({fmt(max(step - train - publish, 0.0))} s) the replica playing "
        "the next step's trajectories while the learner waits (on-policy: they take turns); the replica "
        f"was busy {fmt(100 * med('replica_busy_fraction'))} % of the run."
    )


def render_markdown(payload: dict[str, Any]) -> str:
    plan, cmp, results = payload["plan"], payload["comparison"], payload["results"]
    verdict = "met" if payload["goal_met"] else "**not met**"
    calls = ", ".join(f"{s} {fmt(tool_calls(results[s]))}" for s in SYSTEMS)
    return "\n\n".join([
        "## multiturn_e2e: multi-turn GRPO end to end, rlfabric vs TRL's environment_factory",
        f"{plan['steps']} steps x {plan['prompts_per_step']} prompts x {plan['group_size']} samples of the "
        f"4-turn tool task (three `read_word` calls, then the answer), <= {plan['turn_tokens']} tokens a "
        "model "
        f"turn (rlfabric), <= {plan['max_total_tokens']} tokens after the prompt, lr {plan['lr']:g}, KL "
        f"{plan['kl_coef']:g}, micro-batch {plan['micro_batch_size']}, float32; `{plan['preset']}` model "
        f"after a {plan['sft_steps']}-step SFT warm start; {payload['repeats']} repeat(s) per system, "
        "interleaved; "
        f"rlfabric on-policy, its replica on the {payload['engine']} engine on both cores; TRL transformers "
        "generate.",
        markdown_table(HEADERS, table_rows(results)),
        f"rlfabric / TRL samples/s: **{fmt(cmp['throughput_ratio'])}** (median of per-repeat ratios "
        f"{fmt(cmp['throughput_ratio_per_repeat']['median'])}, with start-up "
        f"{fmt(cmp['throughput_ratio_with_startup'])}). Reward, rlfabric - TRL: "
        f"{cmp['reward_difference']:+.4f}: "
        f"{reward_verdict(cmp)}. Goal >= {GOAL}x at equal reward: {verdict}. Tool calls per sample: {calls}.",
        "From the first step to the last: "
        + "; ".join(f"{system}: {course(results[system])}" for system in SYSTEMS)
        + ". TRL's runs are seeded (each repeat samples and trains the same), so their spread is the "
        "machine's (other jobs shared it: the load includes ~1 from the run itself); rlfabric's sampling is "
        "not seeded by the run file. Each rlfabric model turn is cut at "
        f"{plan['turn_tokens']} tokens; TRL has no per-turn limit (both cap a trajectory at "
        f"{plan['max_total_tokens']} tokens after the prompt). A policy that answers three words without "
        f"reading them scores 1/{len(WORDS)} a word on average ({len(WORDS)} words): "
        f"{1 / len(WORDS):.3f}.",
        "Where a steady step's time goes (medians):",
        "\n".join([*split_lines({"trl": results["trl"]}), rlfabric_split(results["rlfabric"])]),
        f"Machine: {machine_line(payload['machine'])}.",
    ])  # fmt: skip


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    results = payload["results"]
    bars = {key: [Bar(s, Stats.of([r[key] for r in results[s]], "")) for s in SYSTEMS]
            for key in ("samples_per_s", "reward_final")}  # fmt: skip
    panels = [("samples/s (steady)", "samples/s", bars["samples_per_s"]),
              ("reward (last 1/4)", "reward", bars["reward_final"])]  # fmt: skip
    trl = statistics.median(r["samples_per_s"] for r in results["trl"])
    return bar_plot(path, panels, NAME, [GOAL * trl, None])


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help=f"GRPO steps per run (default {FULL.steps})")
    parser.add_argument(
        "--keep", type=Path, metavar="DIR",
        help="work in DIR and keep it (logs, run folders); a warm start already there is reused",
    )  # fmt: skip
    args = parser.parse_args(argv)
    repeats = effective_repeats(args)
    plan = QUICK if args.quick else replace(FULL, steps=args.steps or FULL.steps)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-multiturn-e2e-") as workdir:
        work = args.keep or Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        results = run(plan, repeats, work, args.quick)
    cmp = comparison(results)
    payload = {
        "machine": machine, "quick": args.quick, "repeats": repeats, "goal": GOAL, "plan": asdict(plan),
        "comparison": cmp, "ratio": cmp["throughput_ratio"], "results": results,
        "engine": "transformers" if args.quick else "vllm",
    }  # fmt: skip
    payload["goal_met"] = cmp["throughput_ratio"] >= GOAL and cmp["reward_equal_or_better"]
    report_results(args.output_dir, NAME, payload, render_markdown(payload), plot)
    return 0


def run(plan: Plan, repeats: int, work: Path, quick: bool) -> dict[str, list[dict[str, Any]]]:
    """The warm start (reused when `work` holds a committed one), then the measured runs."""
    from rlfabric.learner.export import is_committed

    model = work / "sft-run" / "sft" / "model"
    if not is_committed(model):
        model = warm_start(plan, base_model(plan, work / "base"), work)
    tasks = write_jsonl(work / "tasks.jsonl", word_tasks(256, seed=0))
    stamp = time.strftime("%H%M%S")
    return measure(plan, task_of(plan, model, tasks), repeats, work / f"runs-{stamp}", quick)


if __name__ == "__main__":
    raise SystemExit(main())
