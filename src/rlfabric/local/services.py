"""The services of one `rlfabric up`, launched and waited for together.

One run (`start_services`) gets replicas bound to it. Several runs (`start_fleet_services`) share one
rollout fleet: its replicas follow the fleet (`fleet=<name>`, an adapter slot per run) instead of a run,
each run has its own learner, and one reward service and one coordinator serve them all. An offline run
(`start_offline_services`) needs only its learner and the coordinator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from rlfabric.local.handoff import TWIN_SUFFIX, Handoff
from rlfabric.local.ports import free_port
from rlfabric.local.procs import ServiceProcess
from rlfabric.local.replicas import (
    environment_port,
    fleet_replica_process,
    replica_process,
)
from rlfabric.local.scaler import LocalScaler, ScalePolicy
from rlfabric.local.stack import (
    ANY_METRICS_PORT,
    COORDINATOR_READY,
    ENVIRONMENT_READY,
    LEARNER_FINISH_S,
    LEARNER_READY,
    OFFLINE_LEARNER_READY,
    REPLICA_READY,
    REWARD_READY,
    FleetRun,
    Stack,
    Starting,
    cli,
    eager_start,
)
from rlfabric.runtime.guard import cpu_list


@dataclass
class Services:
    """What `start_services` started: the coordinator's URL and the processes to supervise."""

    url: str
    supervised: list[tuple[ServiceProcess, str]]
    """(process, ready pattern) of every service process started."""
    learners: list[ServiceProcess]
    """The learner of each run (one, but for several runs on a fleet)."""
    scaler: LocalScaler | None
    handoffs: list[Handoff]
    """Eager replicas and their compiled twins still building (`rlfabric.local.handoff`)."""
    starting_learners: list[Starting] = field(default_factory=list)
    """Learners launched but not yet ready: the run may be submitted meanwhile (the replicas generate the
    first groups from the base model while the learner imports and loads); `wait_for_learners`."""

    def wait_for_learners(self, stack: Stack) -> None:
        """Waits for the ready line of every learner still starting (ServiceStartError if one fails)."""
        while self.starting_learners:
            stack.wait(self.starting_learners.pop(0))

    def let_learners_finish(self, timeout_s: float = LEARNER_FINISH_S) -> None:
        """Waits up to `timeout_s` for the learners to exit by themselves: after a run's last step (or a
        stop) a learner writes its final checkpoint and model, which stopping it would cut short."""
        start = time.monotonic()
        told = False
        while any(proc.returncode is None for proc in self.learners) and time.monotonic() < start + timeout_s:
            if not told and time.monotonic() > start + 2:
                print("  waiting for the learner to write the final model ...", flush=True)
                told = True
            time.sleep(0.1)


class ReplicaFactory(Protocol):
    """Makes rollout replica `i` (not started): compiled as `--compile` says unless `compile_` is given;
    `suffix` makes another replica id for the same slot (a compiled twin)."""

    def __call__(self, i: int, *, compile_: bool | None = None, suffix: str = "") -> ServiceProcess: ...


@dataclass
class OnlineParts:
    """The services of an online `up`, made (not started) in the order they are stopped in reverse: one
    run's, or several runs' on a shared fleet."""

    reward: ServiceProcess
    environment: ServiceProcess | None
    replica: ReplicaFactory
    learners: Callable[[], list[ServiceProcess]]
    """Makes the learner of each run."""
    coordinator: Callable[[str], ServiceProcess]
    """Makes the coordinator, given the reward service's address."""


def start_services(
    stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str, policy: ScalePolicy | None
) -> Services:
    """Starts reward, rollout, learner and coordinator, each on a port chosen here (an offline run needs
    only the learner and the coordinator)."""
    if spec.mode != "online":
        return start_offline_services(stack, args, spec, redis_url)

    def replica(i: int, *, compile_: bool | None = None, suffix: str = "") -> ServiceProcess:
        return replica_process(stack, args, spec, redis_url, i, compile_=compile_, suffix=suffix)

    parts = OnlineParts(
        reward=reward_process(stack, args, spec),
        environment=environment_process(stack, args, spec),
        replica=replica,
        learners=lambda: [learner_process(stack, args, spec, redis_url)],
        coordinator=lambda reward: coordinator_process(stack, args, spec, redis_url, reward),
    )
    return start_online(stack, args, parts, policy)


def start_online(
    stack: Stack, args: argparse.Namespace, parts: OnlineParts, policy: ScalePolicy | None
) -> Services:
    """Launches the parts at once, the coordinator once the reward service listens; waits for every
    ready line."""
    reward = stack.launch(parts.reward, REWARD_READY)
    if parts.environment is not None:
        stack.start(parts.environment, ENVIRONMENT_READY)
    eager_first = eager_start(args)
    replicas = [parts.replica(i, compile_=not eager_first and args.compile) for i in range(args.replicas)]
    starting = [stack.launch(proc, REPLICA_READY) for proc in replicas]
    twins = [parts.replica(i, compile_=True, suffix=TWIN_SUFFIX) for i in range(args.replicas) if eager_first]
    handoffs = [Handoff(eager, twin, REPLICA_READY) for eager, twin in zip(replicas, twins, strict=False)]
    learners = [stack.launch(proc, LEARNER_READY) for proc in parts.learners()]
    reward_address = stack.wait(reward)
    coordinator = parts.coordinator(reward_address)
    url = stack.start(coordinator, COORDINATOR_READY)
    for pending in starting:
        stack.wait(pending)
    supervised = [(reward.proc, REWARD_READY), (coordinator, COORDINATOR_READY)]
    supervised += [(learner.proc, LEARNER_READY) for learner in learners]
    supervised += [(proc, REPLICA_READY) for proc in replicas]
    if parts.environment is not None:
        supervised.append((parts.environment, ENVIRONMENT_READY))
    scaler = LocalScaler(policy, parts.replica, REPLICA_READY, replicas) if policy else None
    return Services(url, supervised, [learner.proc for learner in learners], scaler, handoffs, learners)


def start_fleet_services(
    stack: Stack, args: argparse.Namespace, runs: list[FleetRun], redis_url: str, policy: ScalePolicy | None
) -> Services:
    """Starts one reward service (the runs' functions allowed), the fleet's replicas (scaled by `policy`
    when given), a learner per run and one coordinator (every run's roots allowed)."""

    def replica(i: int, *, compile_: bool | None = None, suffix: str = "") -> ServiceProcess:
        return fleet_replica_process(stack, args, runs, redis_url, i, compile_=compile_, suffix=suffix)

    def coordinator(reward: str) -> ServiceProcess:
        roots = [root for run in runs for root in allowed_roots(run_args(args, run), stack.run_dir, run.spec)]
        return coordinator_process(
            stack, args, runs[0].spec, redis_url, reward, roots=list(dict.fromkeys(roots))
        )

    parts = OnlineParts(
        reward=reward_service(stack, fleet_allowed_functions(runs)),
        environment=None,
        replica=replica,
        learners=lambda: [fleet_learner(stack, args, run.spec, redis_url, i) for i, run in enumerate(runs)],
        coordinator=coordinator,
    )
    return start_online(stack, args, parts, policy)


def run_args(args: argparse.Namespace, run: FleetRun) -> argparse.Namespace:
    """The options as one run of a fleet sees them: its own run file."""
    return argparse.Namespace(**{**vars(args), "run_file": run.run_file})


def start_offline_services(stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str) -> Services:
    """An offline preference run's learner and coordinator: nothing generates or scores."""
    learner = stack.launch(learner_process(stack, args, spec, redis_url, alone=True), OFFLINE_LEARNER_READY)
    coordinator = coordinator_process(stack, args, spec, redis_url, reward_address=None)
    url = stack.start(coordinator, COORDINATOR_READY)
    stack.wait(learner)
    supervised = [(coordinator, COORDINATOR_READY), (learner.proc, OFFLINE_LEARNER_READY)]
    return Services(url, supervised, [learner.proc], None, [])


def reward_process(stack: Stack, args: argparse.Namespace, spec: Any) -> ServiceProcess:
    """The reward service: user functions only from the run file's folder and the functions the run
    spec names by module (the operator's own run file, or the demo)."""
    from rlfabric.reward.check import allowed_functions, run_rewards

    return reward_service(stack, allowed_functions(run_rewards(spec), args.run_file))


def fleet_allowed_functions(runs: list[FleetRun]) -> list[str]:
    """The reward service's `allowed_functions` for several runs: the union of each run's."""
    from rlfabric.reward.check import allowed_functions, run_rewards

    allowed = [name for run in runs for name in allowed_functions(run_rewards(run.spec), run.run_file)]
    return list(dict.fromkeys(allowed))


def reward_service(stack: Stack, allowed: list[str]) -> ServiceProcess:
    """The reward service (not started), user code only from `allowed`."""
    argv = cli("serve", "reward", "--port", str(free_port()), "--set", "workers=1", *ANY_METRICS_PORT)
    argv += ["--set", f"allowed_functions={json.dumps(allowed)}"]
    return stack.process("reward", argv, service="reward")


def environment_process(stack: Stack, args: argparse.Namespace, spec: Any) -> ServiceProcess | None:
    """A multi-turn run's environment service (not started), on the port `environment_address` names;
    None for a single-turn run or one whose environment runs elsewhere (`environment.address`). User code
    only from the run file's folder and what the run file names by module."""
    env = spec.environment
    if env is None or env.address is not None:
        return None
    port = environment_port(stack)
    config = {
        "server": {"port": port, "metrics_port": 0},
        "environment": env.service.model_dump(mode="json"),
        "allowed_functions": env.allowed_functions(args.run_file),
        "step_timeout_s": env.step_timeout_s,
        "max_sessions": env.max_sessions,
        "max_steps": env.max_turns + 1,
        "log": {"format": "text"},
    }
    path = stack.run_dir / "environment.yaml"
    path.write_text(yaml.safe_dump(config))
    return stack.process(
        "environment", cli("serve", "environment", "--config", str(path)), service="environment"
    )


def coordinator_process(
    stack: Stack,
    args: argparse.Namespace,
    spec: Any,
    redis_url: str,
    reward_address: str | None,
    *,
    roots: list[str] | None = None,
) -> ServiceProcess:
    """The coordinator: datasets and models confined to `roots` (default: the run's `allowed_roots`);
    `reward_address` None when the run scores nothing (offline). It does not check the runs submitted to
    it (`checks.on_submit`): `up` checked each of them before starting anything (`check_run`, the scorer
    built in-process), and the same check again at submit costs the first step ~5 s of importing
    transformers while the other services start on the same cores."""
    argv = cli("serve", "coordinator", "--port", str(free_port()), "--set", f"redis.url={redis_url}")
    argv += ["--set", "checks.on_submit=false"]
    if reward_address is not None:
        argv += ["--set", f"reward_address={reward_address}"]
    allowed = json.dumps(allowed_roots(args, stack.run_dir, spec) if roots is None else roots)
    argv += ["--set", f"data_roots={allowed}", "--set", f"model_roots={allowed}"]
    return stack.process("coordinator", argv, service="coordinator")


def allowed_roots(args: argparse.Namespace, run_dir: Path, spec: Any) -> list[str]:
    """Where a run's dataset and model may lie: the working directory, the run file's folder, the run
    directory (the demo's model and prompts), and the folders holding the datasets and models the run
    file itself names (hub ids aside)."""
    roots = [Path.cwd(), run_dir, *([Path(args.run_file).resolve().parent] if args.run_file else [])]
    named = [path for _, path in spec.local_paths().values()]
    roots += [Path(path).resolve().parent for path in named if path and Path(path).exists()]
    return list(dict.fromkeys(str(root.resolve()) for root in roots))


def scale_policy(args: argparse.Namespace) -> ScalePolicy | None:
    """The local scaler's policy from the flags; None without --max-replicas. ValueError when the
    bounds do not hold --replicas."""
    if args.max_replicas is None:
        if args.min_replicas is not None:
            raise ValueError("--min-replicas needs --max-replicas")
        return None
    minimum = args.replicas if args.min_replicas is None else args.min_replicas
    if not minimum <= args.replicas <= args.max_replicas:
        raise ValueError(
            f"--replicas {args.replicas} must lie within --min-replicas {minimum} and --max-replicas "
            f"{args.max_replicas}"
        )
    return ScalePolicy(minimum, args.max_replicas, args.scale_up_after, args.scale_down_after)


def fleet_learner(
    stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str, index: int
) -> ServiceProcess:
    """The learner of the `index`th of several runs: its process and config file named after the run."""
    name, config = f"learner-{spec.name}", f"{spec.name}.learner.yaml"
    return learner_process(stack, args, spec, redis_url, name=name, config=config, index=index)


def learner_process(
    stack: Stack,
    args: argparse.Namespace,
    spec: Any,
    redis_url: str,
    *,
    name: str = "learner",
    config: str = "learner.yaml",
    index: int = 0,
    alone: bool = False,
) -> ServiceProcess:
    """The run's learner (not started), its settings in `config` in the run directory; with
    `--learner-cores`, on the `index`th entry's cores (modulo their count), one torch thread per core (the
    ranks of `--learner-ranks` share them) and taking turns to train with the other learners of that entry
    (`compute_lock`, `learner.core_lock`). Its torch threads: `learner_env` (`alone`: nothing else
    computes beside it)."""
    cores = args.learner_cores[index % len(args.learner_cores)] if args.learner_cores else None
    settings = {
        "run_id": spec.name,
        "redis": {"url": redis_url},
        "server": {"port": free_port(), "metrics_port": 0},
        "log": {"format": "text"},
        "run": json.loads(spec.model_dump_json()),
        "report_to_redis": spec.mode != "online",
    }
    if cores:
        settings["compute_lock"] = str(stack.run_dir / f"learner-cores-{cores}.lock")
    path = stack.run_dir / config
    path.write_text(yaml.safe_dump(settings))
    if args.learner_ranks > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc_per_node", str(args.learner_ranks), "-m", "rlfabric.cli"]
        argv += ["serve", "learner", "--config", str(path)]
    else:
        argv = cli("serve", "learner", "--config", str(path))
    if cores:  # one torch thread per core a rank may use: the ranks share the cores
        default = len(cpu_list(cores)) // args.learner_ranks
    else:
        default = len(os.sched_getaffinity(0)) // args.learner_ranks if alone else 1
    return stack.process(name, argv, learner_env(args, default), service="learner", cpus=cores)


def learner_env(args: argparse.Namespace, default_threads: int) -> dict[str, str]:
    """A learner's environment: this process's, with OMP_NUM_THREADS (torch's threads in each rank) from
    `--learner-threads`, else from the environment, else `default_threads` (at least 1). A learner beside
    the replicas defaults to one thread (its cores are theirs too: OpenMP threads waiting at every op's
    barrier for a descheduled sibling made a step 4x slower on a busy 2-core machine), one that runs
    alone (a warm start, an SFT, reward-model or offline preference run) to the cores it may use."""
    chosen = getattr(args, "learner_threads", None)
    if chosen:
        return {**os.environ, "OMP_NUM_THREADS": str(chosen)}
    return {"OMP_NUM_THREADS": str(max(1, default_threads)), **os.environ}
