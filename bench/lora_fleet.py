"""Benchmark: K LoRA runs sharing one rollout replica against the same K runs one after another.

    python bench/lora_fleet.py [--runs 4] [--steps 16] [--quick] [--output-dir bench/results]

Issue 26's second goal ("fleet"): four concurrent LoRA runs on one replica against the same four one after
another on the same cores: total samples/s, goal >= 1.5x, each run reaching the same reward as alone.

Both sides are the real `rlfabric up` on the same run files: the built-in demo K times (`demo_spec`,
rank-16 LoRA, demo-1 .. demo-K, prompt seeds 0 .. K-1, one base model and dataset shared by all), written as
JSON run files.

- `sequential`: `rlfabric up RUN_FILE` once per run, one after another (each its own replica, learner,
  coordinator, reward service and Redis, as a user running the runs in turn would);
- `fleet`: one `rlfabric up RUN_FILE ... RUN_FILE` with all K files: one shared replica (`fleet=local`,
  K adapter slots), one learner per run, one coordinator scheduling all runs with weighted fair share.

Each learner step's metrics row carries its wall time (`time`). Throughput is measured over the runs'
training span, start-up excluded on both sides: samples trained after each run's first step divided by
the time from the first step to the last (sequential: the sum of each run's span; fleet: from the earliest
first step of any run to the latest last step). `fleet_ratio` = fleet samples/s / sequential samples/s.
`cold_ratio` compares whole commands (start-up included: K starts sequentially against one). Each run's
reward at the end (mean of its last three steps' `reward_mean`, and its last held-out `eval_reward_mean`)
is reported on both sides; `same_reward` holds when every run's fleet eval reward is within
`REWARD_TOLERANCE` of its sequential one.

`--placement split` pins the replica to core 0 and the learners to core 1 (as on separate devices);
`--staleness S` sets every run's `rollout.max_staleness` (0: on-policy); `--replica-max-in-flight P` the
replicas' capacity on both sides. Results of such a configuration are written as
`lora_fleet_<placement>_s<S>[_<model>][_m<P>][_bf16]` (`_bf16` where `dtype auto` is bfloat16 on this
machine) beside the default's `lora_fleet` (which alone is copied into `lora.json`).

What bounds the ratio: the fleet can only fill the replica time a run alone leaves idle. Alone, the demo
(max_staleness 1) overlaps generation with training and keeps its replica busy, so on the same cores four
runs at once have little idle time to fill; on-policy (`--staleness 0`) a run alone leaves its replica
waiting while its learner trains and publishes.

`--quick` (CI): two runs of 4 steps, to run every code path; its ratio means little.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import base_parser, fmt, machine_info, machine_line, markdown_table, report_results

from rlfabric.runtime.hardware import auto_dtype
from rlfabric.tools.tiny_model import PRESETS, TinyModelSpec, save_tiny_model

NAME = "lora_fleet"
FLEET_GOAL = 1.5
"""Issue 26: four LoRA runs on one replica give >= 1.5x the samples/s of the same four one after another."""
REWARD_TOLERANCE = 0.1
"""How far a run's last held-out reward on the fleet may lie from its reward alone to count as the same
(the demo's held-out reward moves by ~0.05 between repeats of one run)."""
RANK = 16


MODELS: dict[str, TinyModelSpec | None] = {
    "tiny": None,
    "small": TinyModelSpec(layers=4, hidden=256, heads=4, intermediate=768),
    "bench": PRESETS["bench"],
}
"""`--model`: the base model every run trains adapters on. `tiny` is the demo's own (440,576 parameters);
`small` (4 layers, hidden 256: 3.3 M) and `bench` (24.2 M) make the learner's step a larger share of a
run's step, as on real models, where training takes about as long as generation or longer."""


def write_run_files(
    workdir: Path, runs: int, steps: int, staleness: int | None = None, model: str = "tiny"
) -> list[Path]:
    """The K demo run files (one base model and prompt file under `workdir/base`), with `staleness` as
    `rollout.max_staleness` when given (the demo's own otherwise) and `model` (`MODELS`) as the base."""
    from rlfabric.coordinator.demo import demo_spec

    preset = MODELS[model]
    model_dir = None if preset is None else save_tiny_model(preset, workdir / "base" / f"model-{model}")
    files = []
    for i in range(1, runs + 1):
        spec = demo_spec(workdir / "base", steps=steps, lora_rank=RANK, name=f"demo-{i}", seed=i - 1)
        if staleness is not None:
            rollout = spec.rollout.model_copy(update={"max_staleness": staleness})
            spec = spec.model_copy(update={"rollout": rollout})
        if model_dir is not None:
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"path": str(model_dir)})})
        path = workdir / "files" / f"demo-{i}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(spec.model_dump_json(indent=1))
        files.append(path)
    return files


PLACEMENTS = {"shared": [], "split": ["--replica-cores", "0", "--learner-cores", "1"]}
"""`--placement`: `shared`, every process may run on any core; `split`, the replica's threads on core 0 and
every learner on core 1 (generation and training on separate devices, as disaggregated deployments run
them; the coordinator, reward service and Redis may run anywhere)."""


def up(files: Sequence[Path], run_dir: Path, env: dict[str, str], options: Sequence[str]) -> float:
    """Runs `rlfabric up FILES OPTIONS` to the end; returns its wall seconds (ValueError when it fails)."""
    argv = [sys.executable, "-m", "rlfabric.cli", "up", *map(str, files), "--run-dir", str(run_dir)]
    argv += options
    start = time.monotonic()
    result = subprocess.run([*argv, "--no-progress"], env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    (run_dir.parent / f"{run_dir.name}.out").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise ValueError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr[-2000:]}")
    print(f"  {' '.join(f.stem for f in files)}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return seconds


def rows(run_dir: Path, run: str) -> list[dict[str, Any]]:
    lines = (run_dir / run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r and "time" in r]


def run_summary(series: list[dict[str, Any]], samples_per_step: int) -> dict[str, Any]:
    """One run's span (first to last step), samples trained after its first step, and its rewards."""
    evals = [r["eval_reward_mean"] for r in series if "eval_reward_mean" in r]
    return {
        "steps": len(series),
        "first_step_time": series[0]["time"],
        "last_step_time": series[-1]["time"],
        "span_s": series[-1]["time"] - series[0]["time"],
        "samples": (len(series) - 1) * samples_per_step,
        "reward_last3": sum(r["reward_mean"] for r in series[-3:]) / len(series[-3:]),
        "eval_reward_last": evals[-1] if evals else None,
        # waits for the learners' turn on shared cores (`--learner-cores`: `learner.core_lock`); None without
        "core_wait_s": (
            sum(r["core_wait_seconds"] for r in series if "core_wait_seconds" in r)
            if any("core_wait_seconds" in r for r in series)
            else None
        ),
    }


def samples_per_step(file: Path) -> int:
    spec = json.loads(file.read_text())
    return int(spec["train"]["groups_per_step"]) * int(spec["rollout"]["sampling"]["n"])


def up_options(placement: str, max_in_flight: int | None) -> list[str]:
    """`up`'s options of a placement (`PLACEMENTS`) and replica capacity (None: the replica's default)."""
    capacity = [] if max_in_flight is None else ["--replica-max-in-flight", str(max_in_flight)]
    return [*PLACEMENTS[placement], *capacity]


def measure(files: list[Path], workdir: Path, env: dict[str, str], options: list[str]) -> dict[str, Any]:
    per_step = samples_per_step(files[0])
    names = [f.stem for f in files]
    print(f"sequential: {len(files)} runs one after another", file=sys.stderr, flush=True)
    sequential: dict[str, Any] = {"wall_s": 0.0, "runs": {}}
    for file in files:
        run_dir = workdir / "sequential" / file.stem
        sequential["wall_s"] += up([file], run_dir, env, options)
        sequential["runs"][file.stem] = run_summary(rows(run_dir, file.stem), per_step)
    print(f"fleet: {len(files)} runs on one replica", file=sys.stderr, flush=True)
    fleet_dir = workdir / "fleet"
    fleet: dict[str, Any] = {"wall_s": up(files, fleet_dir, env, options)}
    fleet["runs"] = {name: run_summary(rows(fleet_dir, name), per_step) for name in names}
    seq_runs, fleet_runs = sequential["runs"].values(), fleet["runs"].values()
    sequential["span_s"] = sum(r["span_s"] for r in seq_runs)
    fleet["span_s"] = max(r["last_step_time"] for r in fleet_runs) - min(
        r["first_step_time"] for r in fleet_runs
    )
    for side in (sequential, fleet):
        side["samples"] = sum(r["samples"] for r in side["runs"].values())
        side["samples_per_s"] = side["samples"] / side["span_s"]
    return {"sequential": sequential, "fleet": fleet}


def same_reward(result: dict[str, Any]) -> bool:
    """Every run's last held-out reward on the fleet within `REWARD_TOLERANCE` of its reward alone."""
    pairs = [(result["sequential"]["runs"][n], r) for n, r in result["fleet"]["runs"].items()]
    return all(
        a["eval_reward_last"] is not None
        and b["eval_reward_last"] is not None
        and abs(a["eval_reward_last"] - b["eval_reward_last"]) <= REWARD_TOLERANCE
        for a, b in pairs
    )


def render_markdown(payload: dict[str, Any]) -> str:
    result = payload["result"]
    rows_ = []
    for name, seq in result["sequential"]["runs"].items():
        flt = result["fleet"]["runs"][name]
        rows_.append([
            name, f"{seq['span_s']:.0f}", f"{flt['span_s']:.0f}", fmt(seq["reward_last3"]),
            fmt(flt["reward_last3"]), fmt(seq["eval_reward_last"] or 0), fmt(flt["eval_reward_last"] or 0),
            "-" if flt.get("core_wait_s") is None else f"{flt['core_wait_s']:.0f}",
        ])  # fmt: skip
    seq, flt = result["sequential"], result["fleet"]
    per_run = markdown_table(
        ["run", "span alone (s)", "span on fleet (s)", "reward alone", "reward on fleet",
         "held-out alone", "held-out on fleet", "fleet: waits for the learners' core (s)"],
        rows_,
    )  # fmt: skip
    sides = markdown_table(
        ["", "samples", "span (s)", "samples/s", "whole commands (s)"],
        [
            ["one after another", seq["samples"], f"{seq['span_s']:.0f}", fmt(seq["samples_per_s"]),
             f"{seq['wall_s']:.0f}"],
            ["on one fleet", flt["samples"], f"{flt['span_s']:.0f}", fmt(flt["samples_per_s"]),
             f"{flt['wall_s']:.0f}"],
        ],
    )  # fmt: skip
    verdict = "met" if payload["goal_met"] else "**not met**"
    return "\n\n".join(
        [
            f"## lora_fleet: {payload['runs']} LoRA runs on one replica vs one after another",
            machine_line(payload["machine"]),
            f"The built-in demo {payload['runs']} times (rank-{RANK} LoRA, {payload['steps']} steps, prompt "
            f"seeds differ, {configuration(payload)}), each side the real `rlfabric up` on the same run "
            "files. Training span: first step to last (start-up excluded).",
            per_run,
            sides,
            f"**fleet_ratio {fmt(payload['fleet_ratio'])}x** samples/s (goal >= {FLEET_GOAL:g}: {verdict}); "
            f"whole commands, start-up included: {fmt(payload['cold_ratio'])}x; same held-out reward "
            f"(within {REWARD_TOLERANCE:g}) for every run: {'yes' if payload['same_reward'] else 'no'}.",
            f"Command: `{payload['command']}`",
        ]
    )


def configuration(payload: dict[str, Any]) -> str:
    """The placement and staleness in words."""
    placement = payload.get("placement", "shared")
    where = "replica on core 0, learners on core 1" if placement == "split" else "every process on any core"
    staleness = payload.get("staleness")
    lag = "the demo's max_staleness 1" if staleness is None else f"max_staleness {staleness}"
    model = payload.get("model", "tiny")
    base = "the demo's tiny model" if model == "tiny" else f"the `{model}` model"
    capacity = payload.get("replica_max_in_flight")
    held = "" if capacity is None else f", replica capacity {capacity} prompts"
    dtype = f", {payload['dtype']}" if "dtype" in payload else ""
    return f"{base}, {where}, {lag}" + (" (on-policy)" if staleness == 0 else "") + held + dtype


def merge_into_lora_results(output_dir: Path, payload: dict[str, Any]) -> None:
    """Copies the fleet figures into `lora.json` (the sync benchmark's results, which the issue asks for)
    and renders its `lora.md` again."""
    path = output_dir / "lora.json"
    if not path.exists():
        return
    lora = json.loads(path.read_text())
    lora.update(
        fleet_ratio=payload["fleet_ratio"],
        fleet_goal_met=payload["goal_met"],
        fleet_same_reward=payload["same_reward"],
        fleet_note=f"measured by `{payload['command']}` (bench/results/{NAME}.json)",
    )
    path.write_text(json.dumps(lora, indent=2) + "\n")
    from lora import render_markdown  # bench/lora.py, the sync benchmark

    (output_dir / "lora.md").write_text(render_markdown(lora).rstrip() + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="runs on each side (default 4)")
    parser.add_argument("--steps", type=int, default=16, help="steps per run (default 16)")
    parser.add_argument(
        "--placement",
        choices=sorted(PLACEMENTS),
        default="shared",
        help="shared: any process on any core (default); split: the replica on core 0, learners on core 1",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        help="every run's rollout.max_staleness (default: the demo's, 1); 0 is on-policy: alone, a run's "
        "replica waits while its learner trains",
    )
    parser.add_argument(
        "--model",
        choices=list(MODELS),
        default="tiny",
        help="the base model: tiny (the demo's, default), small (3.3 M parameters) or bench (24.2 M)",
    )
    parser.add_argument(
        "--replica-max-in-flight",
        type=int,
        metavar="PROMPTS",
        help="the replicas' capacity on both sides (`up --replica-max-in-flight`; default the replica's "
        "256, which holds every run's step at once): near one or two steps' groups, the fleet's runs "
        "generate their steps in turn and train while the next one generates",
    )
    args = parser.parse_args(argv)
    runs, steps = (2, 4) if args.quick else (args.runs, args.steps)
    machine = machine_info()
    env = {**vllm_env(), "PYTHONUNBUFFERED": "1"}
    dtype = auto_dtype("cpu")  # what the run files' `dtype auto` means in every process of both sides
    with tempfile.TemporaryDirectory(prefix="bench-lora-fleet-") as tmp:
        workdir = Path(tmp)
        files = write_run_files(workdir, runs, steps, args.staleness, args.model)
        result = measure(files, workdir, env, up_options(args.placement, args.replica_max_in_flight))
    fleet_ratio = result["fleet"]["samples_per_s"] / result["sequential"]["samples_per_s"]
    payload = {
        "name": NAME,
        "machine": machine,
        "quick": args.quick,
        "runs": runs,
        "steps": steps,
        "placement": args.placement,
        "staleness": args.staleness,
        "model": args.model,
        "replica_max_in_flight": args.replica_max_in_flight,
        "dtype": dtype,
        "command": " ".join(["python bench/lora_fleet.py", *(argv if argv is not None else sys.argv[1:])]),
        "fleet_goal": FLEET_GOAL,
        "fleet_ratio": fleet_ratio,
        "cold_ratio": result["sequential"]["wall_s"] / result["fleet"]["wall_s"],
        "same_reward": same_reward(result),
        "goal_met": fleet_ratio >= FLEET_GOAL and same_reward(result),
        "result": result,
    }
    default = (
        args.placement == "shared"
        and args.staleness is None
        and args.model == "tiny"
        and args.replica_max_in_flight is None
    )
    staleness = 1 if args.staleness is None else args.staleness  # the demo's
    model = "" if args.model == "tiny" else f"_{args.model}"
    capacity = "" if args.replica_max_in_flight is None else f"_m{args.replica_max_in_flight}"
    precision = "_bf16" if dtype == "bfloat16" else ""
    name = NAME if default else f"{NAME}_{args.placement}_s{staleness}{model}{capacity}{precision}"
    report_results(args.output_dir, name, payload, render_markdown(payload))
    if default and not args.quick:
        merge_into_lora_results(args.output_dir, payload)
    return 0


def vllm_env() -> dict[str, str]:
    """The replicas' settings `rlfabric up` uses (eager, unbound threads, loopback)."""
    from rlfabric.local.stack import vllm_env as up_env

    return up_env(compile_=False)


if __name__ == "__main__":
    raise SystemExit(main())
