"""`rlfabric plan RUN_FILE`: the memory and throughput plan of a run before it is launched.

Imports only argparse when the parser is built (`rlfabric --help` stays fast); the planner is imported when
the command runs. Errors are one line on stderr with exit code 2; a plan that does not fit exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rlfabric.runtime.overrides_arg import add_set_argument

if TYPE_CHECKING:
    from rlfabric.plan.planner import Plan
    from rlfabric.plan.resources import ResourcesSpec

DEVICES_HELP = (
    "the placement, overriding the run file's [resources]: [ROLE=]COUNTxKIND:MEMORY items, comma-separated."
    " learner=4xcuda:80GiB,rollout=4xcuda:80GiB,reward=1xcuda:24GiB puts each role on its own devices;"
    " 8xcuda:80GiB (no role) colocates every role on the same 8 devices; 1xcpu:64GiB plans one host's"
    " memory. MEMORY takes B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_file", metavar="RUN_FILE", help="run file (TOML/YAML/JSON)")
    parser.add_argument("--devices", metavar="SPEC", help=DEVICES_HELP)
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan as JSON (schema: docs/plan.md)")
    out.add_argument(
        "--k8s",
        action="store_true",
        help="print a strategic-merge patch (resources, GPU counts, learner nodes, rollout replica bounds) "
        "for a deploy/k8s overlay's `patches:`",
    )
    parser.add_argument(
        "--autoscaler",
        choices=["keda", "hpa", "none"],
        default="keda",
        help="with --k8s: which rollout autoscaler's replica bounds to patch (default keda)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=256,
        help="prompt length assumed in tokens (default 256); sequences are prompt + rollout.sampling."
        "max_tokens, at most model.max_model_len",
    )
    parser.add_argument("--seq-len", type=int, help="override model.max_model_len")
    add_set_argument(
        parser,
        "plan the run file with this key overridden (dotted path, value parsed as YAML), e.g. to try a "
        "suggestion: --set train.micro_batch_size=2; repeatable",
    )


def run(args: argparse.Namespace) -> int:
    """Exit code: 0 fits, 1 does not fit, 2 the plan cannot be made."""
    try:
        plan, resources = make(args)
    except ValueError as exc:
        print(f"rlfabric plan: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    from rlfabric.plan import report

    if args.json:
        print(json.dumps(report.to_json(plan), indent=2))
    elif args.k8s:
        if resources.placement == "colocated":
            print("rlfabric plan: --k8s: the overlays run each role in its own pods; plan a disaggregated "
                  "placement (--devices learner=...,rollout=...)", file=sys.stderr)  # fmt: skip
            return 2
        print(report.k8s_patch(plan, resources, args.autoscaler), end="")
    else:
        print(report.text(plan))
    return 0 if plan.fits else 1


def make(args: argparse.Namespace) -> tuple[Plan, ResourcesSpec]:
    """(plan, resources) of the command's run file and options; ValueError (one line) when it cannot."""
    from rlfabric.plan.planner import make_plan
    from rlfabric.plan.resources import resources_from_devices
    from rlfabric.runspec import RunSpec
    from rlfabric.runtime.config import load_config

    if args.prompt_tokens < 1:
        raise ValueError("--prompt-tokens must be at least 1")
    spec = load_config(RunSpec, path=args.run_file, overrides=args.overrides)
    if args.seq_len is not None:
        spec = spec.model_copy(
            update={"model": spec.model.model_copy(update={"max_model_len": args.seq_len})}
        )
    resources = resources_from_devices(args.devices, spec.resources) if args.devices else spec.resources
    if resources is None:
        raise ValueError(f"{args.run_file} declares no [resources]; give --devices (see --help)")
    base = Path(args.run_file).resolve().parent
    return make_plan(spec, resources, base_dir=base, prompt_tokens=args.prompt_tokens), resources
