"""The processes of one `rlfabric up`: how each service is launched (argv, environment, ports, tokens)
and waited for, each under a guard, and stopped together.

One run (`start_services`) gets replicas bound to it. Several runs (`start_fleet_services`) share one
rollout fleet: its replicas follow the fleet (`fleet=<name>`, an adapter slot per run) instead of a run,
each run has its own learner, and one reward service and one coordinator serve them all.
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

from rlfabric.local.credentials import Credentials
from rlfabric.local.handoff import TWIN_SUFFIX, Handoff
from rlfabric.local.ports import free_port
from rlfabric.local.procs import ServiceProcess
from rlfabric.local.scaler import LocalScaler, ScalePolicy
from rlfabric.runtime.guard import cpu_list

ANY_METRICS_PORT = ("--set", "server.metrics_port=0")
"""Several services of a kind share this host: each serves /metrics on a free port (printed at start),
not its kind's default."""


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlfabric.cli", *args]


@dataclass
class Starting:
    """A launched process whose ready line is still to come."""

    proc: ServiceProcess
    ready: str
    deadline: float
    launched: float


class Stack:
    """The processes of one `up`, each under a guard, stopped in reverse start order."""

    def __init__(self, run_dir: Path, credentials: Credentials | None = None) -> None:
        self.run_dir = run_dir
        self.credentials = credentials
        self.procs: list[ServiceProcess] = []
        self.environment_port: int | None = None

    def process(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        service: str | None = None,
        cpus: str | None = None,
    ) -> ServiceProcess:
        """A new, not yet started process of this stack (stopped with the rest at the end). `service`
        ("reward", "rollout", ...) adds that service's tokens to its environment; `cpus` confines it to
        those cores."""
        env = dict(os.environ if env is None else env)
        if service is not None and self.credentials is not None:
            env.update(self.credentials.env(service))
        log = self.run_dir / "logs" / f"{name}.log"
        proc = ServiceProcess(name, argv, log_path=log, env=env, guarded=True, cpus=cpus)
        self.procs.append(proc)
        return proc

    def launch(self, proc: ServiceProcess, ready: str, *, timeout_s: float = 300) -> Starting:
        """Starts `proc` without waiting; `wait` for its ready line (within `timeout_s` of now)."""
        proc.launch()
        print(f"  starting {proc.name} ...", flush=True)
        now = time.monotonic()
        return Starting(proc, ready, now + timeout_s, now)

    def wait(self, starting: Starting) -> str:
        """Waits for the ready line; returns its first group ("" without one)."""
        match = starting.proc.wait_for(
            starting.ready, timeout_s=max(starting.deadline - time.monotonic(), 0.01)
        )
        took = time.monotonic() - starting.launched
        print(f"  {starting.proc.name} ready (pid {starting.proc.service_pid}, {took:.0f} s)", flush=True)
        return match.group(1) if match.groups() else ""

    def start(self, proc: ServiceProcess, ready: str, *, timeout_s: float = 300) -> str:
        return self.wait(self.launch(proc, ready, timeout_s=timeout_s))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(grace_s=30)


def vllm_env(*, compile_: bool) -> dict[str, str]:
    """The replicas' environment. The compile caches stay where vLLM and torch keep them, shared by runs
    (`VLLM_CACHE_ROOT`, default ~/.cache/vllm; on CPU the compiled graphs are in torch inductor's
    `TORCHINDUCTOR_CACHE_DIR`, default /tmp/torchinductor_<user>): a compiled replica of a model and
    engine configuration seen before spends ~10 s compiling instead of ~40-70 s on two cores."""
    env = {
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_NO_USAGE_STATS": "1",
        **os.environ,  # the caller's choices win
    }
    if not compile_:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def start_redis(stack: Stack, args: argparse.Namespace) -> str:
    if args.redis_url:
        return str(args.redis_url)
    port, data = free_port(), stack.run_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
    argv += ["--appendonly", "yes", "--maxmemory-policy", "noeviction", "--save", ""]
    stack.start(stack.process("redis", argv), REDIS_READY)
    return f"redis://127.0.0.1:{port}/0"


REDIS_READY = r"Ready to accept connections()"


REPLICA_READY = r"serving version (\d+)"


REWARD_READY = r"listening on (\S+)"
ENVIRONMENT_READY = r"environment service listening on (\S+)"


LEARNER_READY = r"listening on (\S+)"


COORDINATOR_READY = r"listening on (http://\S+)"


OFFLINE_LEARNER_READY = r"rlfabric offline learner (started)"
LEARNER_FINISH_S = 300.0
"""How long `up` lets a learner whose run ended write its final checkpoint and model before stopping it."""


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


@dataclass(frozen=True)
class FleetRun:
    """One of several runs that one `up` starts on a shared fleet: its spec (`rollout.fleet` set) and the
    run file it came from (None: the built-in demo)."""

    spec: Any
    run_file: str | None


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


def eager_start(args: argparse.Namespace) -> bool:
    """Whether replicas start eager and hand over to compiled twins (`rlfabric.local.handoff`)."""
    return bool(args.compile and getattr(args, "eager_start", True) and args.engine == "vllm")


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
