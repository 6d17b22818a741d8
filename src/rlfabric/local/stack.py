"""The processes of one `rlfabric up`: how each service is launched (argv, environment, ports, tokens)
and waited for, each under a guard, and stopped together."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlfabric.local.credentials import Credentials
from rlfabric.local.handoff import TWIN_SUFFIX, Handoff
from rlfabric.local.procs import ServiceProcess
from rlfabric.local.scaler import LocalScaler, ScalePolicy


def free_port() -> int:
    """A port free now on loopback: chosen up front, so that a restarted service binds the same one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        self, name: str, argv: list[str], env: dict[str, str] | None = None, *, service: str | None = None
    ) -> ServiceProcess:
        """A new, not yet started process of this stack (stopped with the rest at the end). `service`
        ("reward", "rollout", ...) adds that service's tokens to its environment."""
        env = dict(os.environ if env is None else env)
        if service is not None and self.credentials is not None:
            env.update(self.credentials.env(service))
        log = self.run_dir / "logs" / f"{name}.log"
        proc = ServiceProcess(name, argv, log_path=log, env=env, guarded=True)
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


@dataclass
class Services:
    """What `start_services` started: the coordinator's URL and the processes to supervise."""

    url: str
    supervised: list[tuple[ServiceProcess, str]]
    """(process, ready pattern) of every service process started."""
    learner: ServiceProcess
    scaler: LocalScaler | None
    handoffs: list[Handoff]
    """Eager replicas and their compiled twins still building (`rlfabric.local.handoff`)."""


def start_services(
    stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str, policy: ScalePolicy | None
) -> Services:
    """Starts reward, rollout, learner and coordinator, each on a port chosen here (an offline run needs
    only the learner and the coordinator)."""
    if spec.mode != "online":
        return start_offline_services(stack, args, spec, redis_url)
    reward = stack.launch(reward_process(stack, args, spec), REWARD_READY)
    environment = environment_process(stack, args, spec)
    if environment is not None:
        stack.start(environment, ENVIRONMENT_READY)
    eager_first = eager_start(args)
    replicas = [
        replica_process(stack, args, spec, redis_url, i, compile_=not eager_first and args.compile)
        for i in range(args.replicas)
    ]
    starting = [stack.launch(proc, REPLICA_READY) for proc in replicas]
    twins = [compiled_twin(stack, args, spec, redis_url, i) for i in range(args.replicas) if eager_first]
    handoffs = [Handoff(eager, twin, REPLICA_READY) for eager, twin in zip(replicas, twins, strict=False)]
    learner = stack.launch(learner_process(stack, args, spec, redis_url), LEARNER_READY)
    reward_address = stack.wait(reward)
    coordinator = coordinator_process(stack, args, spec, redis_url, reward_address)
    url = stack.start(coordinator, COORDINATOR_READY)
    for pending in (learner, *starting):
        stack.wait(pending)
    supervised = [
        (reward.proc, REWARD_READY),
        (coordinator, COORDINATOR_READY),
        (learner.proc, LEARNER_READY),
    ]
    supervised += [(proc, REPLICA_READY) for proc in replicas]
    if environment is not None:
        supervised.append((environment, ENVIRONMENT_READY))

    def replica(i: int) -> ServiceProcess:
        return replica_process(stack, args, spec, redis_url, i)

    scaler = LocalScaler(policy, replica, REPLICA_READY, replicas) if policy else None
    return Services(url, supervised, learner.proc, scaler, handoffs)


def start_offline_services(stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str) -> Services:
    """An offline preference run's learner and coordinator: nothing generates or scores."""
    learner = stack.launch(learner_process(stack, args, spec, redis_url), OFFLINE_LEARNER_READY)
    coordinator = coordinator_process(stack, args, spec, redis_url, reward_address=None)
    url = stack.start(coordinator, COORDINATOR_READY)
    stack.wait(learner)
    supervised = [(coordinator, COORDINATOR_READY), (learner.proc, OFFLINE_LEARNER_READY)]
    return Services(url, supervised, learner.proc, None, [])


def eager_start(args: argparse.Namespace) -> bool:
    """Whether replicas start eager and hand over to compiled twins (`rlfabric.local.handoff`)."""
    return bool(args.compile and getattr(args, "eager_start", True) and args.engine == "vllm")


def compiled_twin(
    stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str, i: int
) -> ServiceProcess:
    """The compiled twin of eager replica `i` (not started)."""
    return replica_process(stack, args, spec, redis_url, i, compile_=True, suffix=TWIN_SUFFIX)


def reward_process(stack: Stack, args: argparse.Namespace, spec: Any) -> ServiceProcess:
    """The reward service: user functions only from the run file's folder and the functions the run
    spec names by module (the operator's own run file, or the demo)."""
    from rlfabric.reward.check import allowed_functions, run_rewards

    allowed = allowed_functions(run_rewards(spec), args.run_file)
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
    stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str, reward_address: str | None
) -> ServiceProcess:
    """The coordinator: datasets and models confined to `allowed_roots`; `reward_address` None when the
    run scores nothing (offline)."""
    argv = cli("serve", "coordinator", "--port", str(free_port()), "--set", f"redis.url={redis_url}")
    if reward_address is not None:
        argv += ["--set", f"reward_address={reward_address}"]
    roots = json.dumps(allowed_roots(args, stack.run_dir, spec))
    argv += ["--set", f"data_roots={roots}", "--set", f"model_roots={roots}"]
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
    compile_ = args.compile if compile_ is None else compile_
    name = f"rollout-{i}{suffix}"
    weights = str(Path(spec.output_dir) / spec.name / "weights")
    argv = cli("serve", "rollout", "--model", spec.model.path, "--port", str(free_port()), *ANY_METRICS_PORT)
    argv += ["--engine", args.engine]
    settings = [
        f"run_id={spec.name}", f"redis.url={redis_url}", f"weights_root={weights}", f"replica_id={name}",
        f"engine.max_model_len={spec.model.max_model_len}", f"engine.dtype={spec.model.dtype}",
        "engine.kv_cache_bytes=268435456",
        f"engine.enforce_eager={str(not compile_).lower()}", "log.format=text",
    ]  # fmt: skip
    for setting in settings:
        argv += ["--set", setting]
    env = vllm_env(compile_=compile_)
    address = environment_address(stack, spec)
    if address is not None:
        argv += ["--set", f"environment.address={address}"]
        if stack.credentials is not None:
            env["RLFABRIC_ROLLOUT__ENVIRONMENT__TOKEN"] = stack.credentials.environment
    if args.replica_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.replica_cores[i % len(args.replica_cores)]
    return stack.process(name, argv, env, service="rollout")


def learner_process(stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str) -> ServiceProcess:
    config = {
        "run_id": spec.name,
        "redis": {"url": redis_url},
        "server": {"port": free_port(), "metrics_port": 0},
        "log": {"format": "text"},
        "run": json.loads(spec.model_dump_json()),
        "report_to_redis": spec.mode != "online",
    }
    path = stack.run_dir / "learner.yaml"
    path.write_text(yaml.safe_dump(config))
    if args.learner_ranks > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc_per_node", str(args.learner_ranks), "-m", "rlfabric.cli"]
        argv += ["serve", "learner", "--config", str(path)]
    else:
        argv = cli("serve", "learner", "--config", str(path))
    env = {"OMP_NUM_THREADS": "1", **os.environ}  # one torch thread unless the caller chooses
    return stack.process("learner", argv, env, service="learner")
