"""The rollout replicas of one `rlfabric up`: argv, settings and environment of a replica bound to a run,
or to several runs' shared fleet (`fleet=<name>`, an adapter slot per run); the eager stand-in that serves
until its compiled twin takes over (`rlfabric.local.handoff`); the LoRA adapter slots a replica reserves.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from rlfabric.local.ports import free_port
from rlfabric.local.procs import ServiceProcess
from rlfabric.local.stack import ANY_METRICS_PORT, FleetRun, Stack, cli, eager_start, vllm_env


def environment_port(stack: Stack) -> int:
    """The environment service's port: chosen once per `up` (replicas started later reach it there)."""
    if stack.environment_port is None:
        stack.environment_port = free_port()
    return stack.environment_port


def environment_address(stack: Stack, spec: Any) -> str | None:
    """Where a multi-turn run's replicas find the environment service; None for a single-turn run."""
    env = spec.environment
    if env is None:
        return None
    return env.address or f"127.0.0.1:{environment_port(stack)}"


def replica_process(
    stack: Stack,
    args: argparse.Namespace,
    spec: Any,
    redis_url: str,
    i: int,
    *,
    compile_: bool | None = None,
    suffix: str = "",
) -> ServiceProcess:
    """Rollout replica `i` of the run (not started): compiled as `--compile` says unless `compile_` is
    given; `suffix` makes another replica id for the same slot (a compiled twin)."""
    binding = [f"run_id={spec.name}", f"weights_root={spec.weights_root()}", *adapter_settings(spec)]
    address = environment_address(stack, spec)
    return new_replica(stack, args, spec.model, redis_url, i, binding, address, compile_, suffix)


def fleet_replica_process(
    stack: Stack,
    args: argparse.Namespace,
    runs: list[FleetRun],
    redis_url: str,
    i: int,
    *,
    compile_: bool | None = None,
    suffix: str = "",
) -> ServiceProcess:
    """Rollout replica `i` of the runs' shared fleet (not started): it follows the fleet, not a run, with
    the runs' longest context (they share the base model)."""
    model = runs[0].spec.model
    longest = max(run.spec.model.max_model_len for run in runs)
    model = model.model_copy(update={"max_model_len": longest})
    binding = fleet_settings([run.spec for run in runs])
    return new_replica(stack, args, model, redis_url, i, binding, None, compile_, suffix)


def new_replica(
    stack: Stack,
    args: argparse.Namespace,
    model: Any,
    redis_url: str,
    i: int,
    binding: list[str],
    environment: str | None,
    compile_: bool | None,
    suffix: str,
) -> ServiceProcess:
    """A replica of `model` (not started) with the settings that say what it follows (`binding`) and
    where it reaches the environment service (None: single-turn)."""
    compile_ = args.compile if compile_ is None else compile_
    name = f"rollout-{i}{suffix}"
    stand_in = not compile_ and eager_start(args)
    engine = stand_in_engine(args, binding, environment) if stand_in else args.engine
    argv = cli("serve", "rollout", "--model", model.path, "--port", str(free_port()), *ANY_METRICS_PORT)
    argv += ["--engine", engine]
    settings = [
        f"redis.url={redis_url}", f"replica_id={name}",
        f"engine.max_model_len={model.max_model_len}", f"engine.dtype={model.dtype}",
        "engine.kv_cache_bytes=268435456",
        f"engine.enforce_eager={str(not compile_).lower()}", "log.format=text",
    ]  # fmt: skip
    if args.replica_max_in_flight is not None:
        settings.append(f"max_in_flight={args.replica_max_in_flight}")
    if engine == "transformers" and stand_in:
        settings.append(f"engine.batch_prompts={STAND_IN_BATCH_PROMPTS}")
    for setting in [*binding, *settings]:
        argv += ["--set", setting]
    env = vllm_env(compile_=compile_)
    if environment is not None:
        argv += ["--set", f"environment.address={environment}"]
        if stack.credentials is not None:
            env["RLFABRIC_ROLLOUT__ENVIRONMENT__TOKEN"] = stack.credentials.environment
    cores = args.replica_cores[i % len(args.replica_cores)] if args.replica_cores else None
    if cores:  # the model worker's OpenMP threads, and the whole replica (front end, engine core) there
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    if stand_in and engine == "vllm" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        env.update(STAND_IN_ENV)
    return stack.process(name, argv, env, service="rollout", cpus=cores)


def stand_in_engine(args: argparse.Namespace, binding: list[str], environment: str | None) -> str:
    """The engine of the eager replica that serves until its compiled twin takes over: transformers
    (`--stand-in`, the default) unless the replica plays multi-turn trajectories (`environment`) or
    serves LoRA adapters (`binding`), which need vLLM."""
    adapters = any(setting.startswith("engine.max_adapters=") for setting in binding)
    wanted = getattr(args, "stand_in", "transformers")  # run directories saved before the option: default
    return "transformers" if wanted == "transformers" and environment is None and not adapters else "vllm"


STAND_IN_BATCH_PROMPTS = 64
"""Prompts the transformers stand-in generates together: a step's worth of groups on the demo and the e2e
bench. It is ready in seconds (no vLLM imports, no engine processes) and, batched, generates the bench's
first step's 64 x 128 tokens in ~11 s on two cores, against ~28 s for the eager vLLM replica to start."""


STAND_IN_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""An eager replica that serves only until its compiled twin takes over runs its model worker inside the
engine core: one process fewer to spawn (each spawn re-imports torch and vLLM, ~8 s on two cores) before
the first sample. vLLM can then not pin the worker's OpenMP threads; the replica's cores (`--cpus`) still
hold the whole process."""


def fleet_settings(specs: list[Any]) -> list[str]:
    """A fleet replica's binding: the runs' fleet instead of a run, an adapter slot per run at the
    smallest rank vLLM reserves that holds the largest of theirs."""
    rank = max(spec.model.published_adapter.rank for spec in specs)
    return [
        f"fleet={specs[0].rollout.fleet}",
        f"engine.max_adapters={len(specs)}",
        f"engine.max_adapter_rank={adapter_slot_rank(rank)}",
    ]


def adapter_settings(spec: Any) -> list[str]:
    """A replica's LoRA settings for a run that publishes adapters: one adapter slot (the run's own) at
    the smallest rank vLLM reserves that holds the run's; none otherwise. ValueError when no replica
    could serve the run's adapters (`check_adapters`)."""
    lora = spec.model.published_adapter
    if lora is None:
        return []
    return ["engine.max_adapters=1", f"engine.max_adapter_rank={adapter_slot_rank(lora.rank)}"]


def adapter_slot_rank(rank: int) -> int:
    """The smallest rank vLLM reserves adapter slots for that holds `rank`; ValueError past the largest."""
    from typing import get_args

    from rlfabric.rollout.config import AdapterRank

    fitting = [r for r in get_args(AdapterRank) if r >= rank]
    if not fitting:
        raise ValueError(
            f"model.lora.rank: replicas serve adapters up to rank {max(get_args(AdapterRank))}, not {rank};"
            " use model.lora.publish = 'merged'"
        )
    return int(fitting[0])


def check_adapters(args: argparse.Namespace, spec: Any) -> None:
    """ValueError when this `up` cannot serve the run's published adapters (before anything starts)."""
    lora = spec.model.published_adapter
    if lora is None:
        return
    if args.engine != "vllm":
        raise ValueError(
            f"--engine {args.engine} serves no LoRA adapters: use --engine vllm or"
            " model.lora.publish = 'merged'"
        )
    adapter_slot_rank(lora.rank)
