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
  training, the replica bound to core 0 and the learner on one thread (placement `split`, or `shared`).
  On this toy task one Adam step moves the policy so far (KL ~1-2 nats/token) that samples one version
  stale derail the run without `--rollout-trust-kl` (docs/benchmarks.md);
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

Goals (`_e2e_report`): rlfabric >= 1.5x TRL's steady samples/s and >= 1.0x counting start-up, at equal or
better reward, and its first step no later than TRL's. The comparison and the report are in
`bench/_e2e_report.py`. `--quick` proves the code path (tiny model, 2 steps, transformers engine for
rlfabric); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from _e2e_report import GOAL, NAME, SYSTEMS, comparison, plot, report
from _e2e_systems import Placement, Task, run_rlfabric, run_trl
from common import base_parser, effective_repeats, machine_info, write_results


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
    markdown = report(results, task, cmp, args, machine, placement(args))
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
