"""The processes of one `rlfabric up` and how each is launched from here: under a guard, with its tokens,
its log in the run directory, waited for by its ready line and stopped together.

`local/services.py` starts the services of a run (or of several runs on a shared fleet) with these;
`local/replicas.py` makes the rollout replicas.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfabric.local.credentials import Credentials
from rlfabric.local.ports import free_port
from rlfabric.local.procs import ServiceProcess

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


@dataclass(frozen=True)
class FleetRun:
    """One of several runs that one `up` starts on a shared fleet: its spec (`rollout.fleet` set) and the
    run file it came from (None: the built-in demo)."""

    spec: Any
    run_file: str | None


def eager_start(args: argparse.Namespace) -> bool:
    """Whether replicas start eager and hand over to compiled twins (`rlfabric.local.handoff`)."""
    return bool(args.compile and getattr(args, "eager_start", True) and args.engine == "vllm")
