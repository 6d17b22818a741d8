"""`rlfabric up`'s command line: its options and their parsers, apart from `up` itself so that building
the CLI's parser (every command's `--help`, every command) does not import what `up` runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlfabric.runtime.overrides_arg import add_set_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_file",
        nargs="*",
        action=RunFiles,
        metavar="RUN_FILE",
        help="run file (TOML/YAML/JSON); default: the built-in demo. Several: the runs share one rollout "
        "fleet (each must train LoRA adapters)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        metavar="K",
        help="run the built-in demo K times at once (demo-1 .. demo-K, K >= 2) on one shared rollout fleet; "
        "needs --lora",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run (or the runs sharing a fleet) of an earlier `up` in RUN_DIR (stopped or "
        "crashed) with its options, Redis data and credentials; takes no run file and no other option "
        "but --no-progress",
    )
    add_set_argument(
        parser,
        "override one key of the run file (or of the built-in demo), a dotted path with the value parsed "
        "as YAML, e.g. --set optim.lr=1e-3 --set rollout.max_staleness=0; repeatable; with several run "
        "files, each gets it",
    )
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument(
        "--lora",
        type=lora_rank,
        metavar="RANK",
        help="train LoRA adapters of this rank (alpha 2 x RANK, every attention and MLP projection) instead "
        "of the full weights; sets the run file's model.lora, or for the built-in demo also its learning "
        "rate (0.01)",
    )
    parser.add_argument("--run-dir", type=Path, help="where everything is written (default runs/<time>)")
    add_scaling_arguments(parser)
    parser.add_argument(
        "--learner-ranks", type=int, default=1, help="learner ranks under torchrun (default 1)"
    )
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument(
        "--engine", choices=["vllm", "transformers"], default="vllm", help="rollout engine (default vllm)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM compile: faster generation; the first start of a model and settings compiles for "
        "~1 min on two cores, later runs start from the compile cache",
    )
    parser.add_argument(
        "--eager-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --compile: serve from an eager replica while its compiled twin builds, then hand over "
        "(the first steps need not wait for the compile; default on)",
    )
    parser.add_argument(
        "--stand-in",
        choices=["transformers", "vllm"],
        default="transformers",
        help="the eager replica of --eager-start: transformers (prompts batched, serves in seconds; "
        "default) or vLLM eager (ready later, generates a little faster). Multi-turn runs and LoRA "
        "adapters always get vLLM",
    )
    add_placement_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="print one line per step, no bar")


def add_scaling_arguments(parser: argparse.ArgumentParser) -> None:
    """The rollout replicas at start and the local autoscaler's bounds and delays."""
    parser.add_argument("--replicas", type=int, default=1, help="rollout replicas at start (default 1)")
    parser.add_argument(
        "--min-replicas",
        type=int,
        help="autoscale rollout replicas by the run's desired-replica signal, never below this (default:"
        " --replicas); needs --max-replicas",
    )
    parser.add_argument(
        "--max-replicas", type=int, help="autoscale rollout replicas up to this many (default: none)"
    )
    parser.add_argument(
        "--scale-up-after",
        type=float,
        default=10.0,
        help="seconds the signal must ask for more replicas before one is added (default 10)",
    )
    parser.add_argument(
        "--scale-down-after",
        type=float,
        default=60.0,
        help="seconds the signal must ask for fewer replicas before one is removed (default 60)",
    )


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the replicas and learners run (their cores) and what each replica holds at once."""
    parser.add_argument(
        "--replica-cores",
        type=core_lists,
        help="CPU cores of each replica (its vLLM worker's threads bound one per core, its front end and "
        "engine core on the same cores), '|' between replicas: replica i takes entry i modulo their count, "
        "e.g. '0|1' puts one replica on each of two cores (default: vLLM's VLLM_CPU_OMP_THREADS_BIND from "
        "the environment, else unbound)",
    )
    parser.add_argument(
        "--replica-max-in-flight",
        type=prompt_count,
        metavar="PROMPTS",
        help="prompts each replica holds at once (its max_in_flight, default 256); on a shared fleet the "
        "slots the runs' fair share hands out: near one or two runs' steps (train.groups_per_step), the "
        "runs' steps generate in turn and each trains while the next one generates",
    )
    parser.add_argument(
        "--learner-cores",
        type=core_lists,
        help="CPU cores of each learner (and everything it starts), '|' between learners: learner i "
        "takes entry i modulo their count, with one torch thread per core, e.g. '--replica-cores 0 "
        "--learner-cores 1' keeps generation and training apart as on separate devices (default: any "
        "core; threads: --learner-threads)",
    )
    parser.add_argument(
        "--learner-threads",
        type=thread_count,
        metavar="N",
        help="torch threads of each learner rank, over OMP_NUM_THREADS (default: OMP_NUM_THREADS when "
        "set; else one per core of --learner-cores; else every core this process may use for a learner "
        "that runs alone (a warm start, an SFT, reward-model or offline preference run), shared by its "
        "ranks, and 1 for a learner beside the replicas)",
    )


class RunFiles(argparse.Action):
    """The positional run files: `run_files` every one given, `run_file` the one (None for none or
    several)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        files = [str(value) for value in values or []]
        namespace.run_files = files
        namespace.run_file = files[0] if len(files) == 1 else None


def lora_rank(text: str) -> int:
    """`--lora`: a rank from 1 to 1024."""
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise argparse.ArgumentTypeError(f"expected a LoRA rank from 1 to 1024, got {text!r}")
    return int(text)


def thread_count(text: str) -> int:
    """`--learner-threads`: a count of threads from 1 to 1024."""
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise argparse.ArgumentTypeError(f"expected a number of threads from 1 to 1024, got {text!r}")
    return int(text)


def prompt_count(text: str) -> int:
    """`--replica-max-in-flight`: a count of prompts, at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of prompts, at least 1, got {text!r}")
    return int(text)


def core_lists(text: str) -> list[str]:
    """`--replica-cores`, `--learner-cores`: one core list per process ("0|1", "0-3|4-7"), for a replica
    its VLLM_CPU_OMP_THREADS_BIND value."""
    from rlfabric.runtime.guard import cpu_list  # the one parser of a core list (the guard's --cpus)

    entries = [e.strip() for e in text.split("|")]
    for entry in entries:
        try:
            cpu_list(entry)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected core lists like '0|1' or '0-3|4-7', got {text!r}"
            ) from None
    return entries
