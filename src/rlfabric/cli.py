"""The `rlfabric` command line.

Parses arguments and configuration first and imports heavy modules (grpc servers, torch, vLLM) only in
the branch that needs them, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

from rlfabric import __version__
from rlfabric.runtime.overrides_arg import add_set_argument


@dataclass(frozen=True)
class ServiceEntry:
    """How `rlfabric serve NAME` finds a service's schema and entry point."""

    summary: str
    config: str
    """"module:Class" of the service's pydantic config model."""
    main: str
    """Module with `serve(config) -> int`."""
    host_key: str
    port_key: str
    flags: tuple[tuple[str, str, str], ...] = ()
    """Extra (flag, config key, help) shortcuts, e.g. ("--model", "engine.model", ...)."""

    @property
    def env_prefix(self) -> str:
        return f"RLFABRIC_{self.main.split('.')[1].upper()}__"

    def config_model(self) -> Any:
        module, _, cls = self.config.partition(":")
        return getattr(importlib.import_module(module), cls)


SERVICES: dict[str, ServiceEntry] = {
    "coordinator": ServiceEntry(
        "REST API, prompt source and the generate -> score -> enqueue pipeline",
        "rlfabric.coordinator.config:CoordinatorServiceConfig",
        "rlfabric.coordinator.main",
        "api.host",
        "api.port",
    ),
    "rollout": ServiceEntry(
        "a generation replica: a vLLM engine behind the RolloutService gRPC API",
        "rlfabric.rollout.config:RolloutServiceConfig",
        "rlfabric.rollout.main",
        "server.host",
        "server.port",
        flags=(
            ("--model", "engine.model", "model folder (or hub id) to serve as version 0"),
            ("--engine", "engine.kind", "vllm (default) or transformers (the reference engine)"),
        ),
    ),
    "reward": ServiceEntry(
        "the batch scorer behind the RewardService gRPC API",
        "rlfabric.reward.config:RewardServiceConfig",
        "rlfabric.reward.main",
        "server.host",
        "server.port",
    ),
    "environment": ServiceEntry(
        "multi-turn environments and tools behind the EnvironmentService gRPC API",
        "rlfabric.environment.config:EnvironmentServiceConfig",
        "rlfabric.environment.main",
        "server.host",
        "server.port",
    ),
    "learner": ServiceEntry(
        "the FSDP2 learner (run it under torchrun for several ranks)",
        "rlfabric.learner.config:LearnerServiceConfig",
        "rlfabric.learner.main",
        "server.host",
        "server.port",
    ),
}


def fields_epilog(entry: ServiceEntry) -> str:
    """The service's configuration keys, defaults and meanings, for `serve NAME --help`."""
    from rlfabric.runtime.config import describe_fields

    rows = describe_fields(entry.config_model())
    width = max(len(k) for k, _, _ in rows)
    lines = [f"  {k:<{width}}  {d:<14}  {desc}" for k, d, desc in rows]
    return (
        "configuration (file < environment < --set < --host/--port):\n"
        f"  environment variables: {entry.env_prefix}KEY__SUBKEY=value\n\n"
        f"  {'key':<{width}}  {'default':<14}  meaning\n" + "\n".join(lines)
    )


def add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run one service in the foreground")
    names = serve.add_subparsers(dest="service", required=True, metavar="SERVICE")
    for name, entry in SERVICES.items():
        p = names.add_parser(
            name,
            help=entry.summary,
            description=f"Run the {name} service: {entry.summary}.",
            epilog=fields_epilog(entry),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--config", metavar="FILE", help="TOML, YAML or JSON configuration file")
        add_set_argument(p, "override one key (dotted path, value parsed as YAML); repeatable")
        p.add_argument("--host", help=f"address to bind (sets {entry.host_key})")
        p.add_argument("--port", type=int, help=f"port to bind, 0 for any free one (sets {entry.port_key})")
        for flag, key, text in entry.flags:
            p.add_argument(flag, dest=key, help=f"{text} (sets {key})")
        p.add_argument(
            "--insecure",
            action="store_true",
            default=None,
            help="serve without the required credentials (logs a warning; tests and loopback only; "
            "sets insecure)",
        )
        p.add_argument(
            "--print-config", action="store_true", help="print the effective configuration as JSON and exit"
        )


def add_config_commands(sub: Any) -> None:
    cfg = sub.add_parser("config", help="inspect and check configuration")
    verbs = cfg.add_subparsers(dest="verb", required=True, metavar="VERB")
    check = verbs.add_parser("check", help="validate a run file (or a service config with --service)")
    check.add_argument("file")
    check.add_argument("--service", choices=sorted(SERVICES), help="validate as this service's config")
    add_set_argument(
        check,
        "check the file with this key overridden (dotted path, value parsed as YAML), as "
        "`up --set` and `serve --set` would run it; repeatable",
    )
    check.add_argument(
        "--schema-only",
        action="store_true",
        help="a run file: check its schema only, not whether it can run here (its scorer, paths, model "
        "files and dataset columns); for a run file meant for another machine",
    )
    template = verbs.add_parser(
        "check-template",
        help="self-test a model's chat template for multi-turn tool trajectories",
        description="Render a multi-turn tool conversation with the chat template of MODEL_DIR whole and "
        "incrementally (as multi-turn trajectories are built) and compare the token ids; exit 2 naming the "
        "turn and the reason when they differ or the template rewrites earlier turns.",
    )
    template.add_argument("model_dir", metavar="MODEL_DIR", help="a local model folder (its tokenizer)")
    schema = verbs.add_parser("schema", help="print the JSON schema of a run file or a service config")
    schema.add_argument("target", choices=["run", *sorted(SERVICES)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlfabric",
        description="rlfabric: RL post-training of language models as gRPC microservices.",
    )
    parser.add_argument("--version", action="version", version=f"rlfabric {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve(sub)
    add_config_commands(sub)
    tiny = sub.add_parser(
        "make-tiny-model",
        help="build a random tiny Qwen2 model with a character or BPE tokenizer (tests, demo, benchmarks)",
        description="Build a randomly initialised Qwen2-architecture causal LM and a character-level "
        "tokenizer (or a byte-level BPE trained locally, --tokenizer bpe), saved so that transformers and "
        "vLLM load it. Nothing is downloaded.",
    )
    from rlfabric.tools import tiny_model

    tiny_model.add_arguments(tiny)
    up = sub.add_parser(
        "up",
        help="run everything on this machine: redis, reward, rollout, learner, coordinator, and a run",
        description="Start every service as its own process on loopback, submit a run (the built-in demo "
        "when no run file is given), show its progress, and stop everything at the end or on Ctrl-C.",
    )
    from rlfabric.local import up_args

    up_args.add_arguments(up)
    runs = sub.add_parser("runs", help="submit, list, inspect and stop runs on a running coordinator")
    from rlfabric.coordinator import runs_cli

    runs_cli.add_arguments(runs)
    reward = sub.add_parser("reward", help="score files with the reward scorers, in-process or on a service")
    from rlfabric.reward import cli as reward_cli

    reward_cli.add_arguments(reward)
    prefs = sub.add_parser(
        "prefs", help="build and inspect versioned preference datasets (AI feedback, hygiene)"
    )
    from rlfabric.prefs import cli as prefs_cli

    prefs_cli.add_arguments(prefs)
    plan = sub.add_parser(
        "plan",
        help="the memory and throughput plan of a run file before launch: fits or not, and what to change",
        description="Read the model's config.json only (no weights) and the run file's [resources] (or "
        "--devices), and print per device and role the memory each line takes with its formula "
        "(docs/plan.md), whether it fits and what to change, and the tokens/s each role can make. "
        "Exit 0 when it fits, 1 when it does not, 2 when the plan cannot be made.",
    )
    from rlfabric.plan import cli as plan_cli

    plan_cli.add_arguments(plan)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from rlfabric.runtime.config import load_config

    entry = SERVICES[args.service]
    config = load_config(
        entry.config_model(),
        path=args.config,
        overrides=args.overrides,
        env_prefix=entry.env_prefix,
        environ=os.environ,
        explicit={
            entry.host_key: args.host,
            entry.port_key: args.port,
            **{key: getattr(args, key) for _, key, _ in entry.flags},
            "insecure": args.insecure,
        },
        flags={
            entry.host_key: "--host",
            entry.port_key: "--port",
            **{key: flag for flag, key, _ in entry.flags},
            "insecure": "--insecure",
        },
    )
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    try:
        main_module = importlib.import_module(entry.main)
    except ModuleNotFoundError as e:
        if e.name != entry.main:
            raise
        print(f"rlfabric: the {args.service} service is not part of this build yet", file=sys.stderr)
        return 2
    from rlfabric.runtime.logs import enable_stack_dumps

    enable_stack_dumps()
    return int(main_module.serve(config))


def run_config(args: argparse.Namespace) -> int:
    import json

    from rlfabric.runspec import RunSpec
    from rlfabric.runtime.config import load_config

    if args.verb == "check-template":
        return check_template(args.model_dir)
    if args.verb == "schema":
        model = RunSpec if args.target == "run" else SERVICES[args.target].config_model()
        print(json.dumps(model.model_json_schema(), indent=2))
        return 0
    model = SERVICES[args.service].config_model() if args.service else RunSpec
    config = load_config(model, path=args.file, overrides=args.overrides)
    if isinstance(config, RunSpec) and not args.schema_only:
        return check_run_file(args.file, config)
    print(f"{args.file}: valid {model.__name__}")
    return 0


def check_run_file(path: str, spec: Any) -> int:
    """`config check RUN_FILE` past the schema: can the run run here (`rlfabric.validate`, the scorer built
    in-process)? Prints each issue naming its field; 2 when there is any."""
    from rlfabric.validate import check_local

    report = check_local(spec, path)
    for line in report.skipped:
        print(f"{path}: not checked: {line}")
    for line in report.notes:
        print(f"{path}: note: {line}")
    for issue in report.issues:
        print(f"{path}: {issue}", file=sys.stderr)
    if report.issues:
        return 2
    print(f"{path}: valid RunSpec")
    return 0


def check_template(model_dir: str) -> int:
    """`config check-template MODEL_DIR`: the chat-template self-test (`rollout.chat_template`); 2 when it
    fails."""
    from rlfabric.rollout.chat_template import check_model_template

    report = check_model_template(model_dir)
    if report.mismatch is not None:
        print(f"{model_dir}: chat template self-test failed: {report.mismatch}", file=sys.stderr)
        return 2
    turns = len(report.turn_starts)
    print(f"{model_dir}: chat template self-test passed ({turns} turns, {len(report.whole_ids)} tokens)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from rlfabric.runtime.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(args)
        if args.command == "config":
            return run_config(args)
        if args.command == "up":
            from rlfabric.local import up as up_cmd

            return up_cmd.run(args)
        if args.command == "runs":
            from rlfabric.coordinator import runs_cli

            return runs_cli.run(args)
        if args.command == "reward":
            from rlfabric.reward import cli as reward_cli

            return reward_cli.run(args)
        if args.command == "prefs":
            from rlfabric.prefs import cli as prefs_cli

            return prefs_cli.run(args)
        if args.command == "plan":
            from rlfabric.plan import cli as plan_cli

            return plan_cli.run(args)
        from rlfabric.tools import tiny_model

        return tiny_model.run(args)
    except ConfigError as e:
        print(f"rlfabric: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
