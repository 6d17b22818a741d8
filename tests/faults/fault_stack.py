"""The whole loop as real processes for the fault scenarios: redis-server (AOF), the reward service, rollout
replicas, the learner and the coordinator, each a `rlfabric serve` process, and a run submitted over REST. A
scenario breaks one part, lets the run finish, and checks the books with the ledger.

Every service runs on loopback unless a `Place` puts it elsewhere: another address, and a command prefix
that runs it there (`ip netns exec NS` for a network namespace, see `hosts.py`). Each binds and announces
its place's address.

Ports that a restarted process must keep (Redis, the reward service) are chosen once; everything else binds
port 0. Every process is stopped by PID (`ServiceProcess`), its log kept under the scenario's folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from rlfabric.local.procs import ServiceProcess
from rlfabric.runspec import RunSpec
from rlfabric.tools import ledger

RUN = "faults"
TOKEN = "fault-suite-token"
# Each service's credentials, by the variables it reads (as `rlfabric up` passes them): every process gets
# the whole set, and each reads only its own prefix.
CREDENTIALS = {
    "RLFABRIC_COORDINATOR__API__TOKEN": TOKEN,
    "RLFABRIC_COORDINATOR__REWARD_TOKEN": "fault-suite-reward-token",
    "RLFABRIC_COORDINATOR__ROLLOUT_TOKEN": "fault-suite-rollout-token",
    "RLFABRIC_ROLLOUT__CLIENT_TOKEN": "fault-suite-rollout-token",
    "RLFABRIC_REWARD__TOKEN": "fault-suite-reward-token",
    "RLFABRIC_ROLLOUT__LEARNER_TOKEN": "fault-suite-publish-token",
    "RLFABRIC_LEARNER__PUBLISH_TOKEN": "fault-suite-publish-token",
    "RLFABRIC_LEARNER__TOKEN": "fault-suite-learner-token",
}
HERE = Path(__file__).resolve().parent
ROLES = ("redis", "reward", "rollout", "learner", "coordinator")


@dataclass(frozen=True)
class Place:
    """Where a service runs: the address it binds and announces, and the prefix that runs a command there."""

    address: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()


LOOPBACK = Place()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlfabric.cli", *args]


def write_prompts(path: Path, count: int = 40) -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"say {i} now"}) + "\n" for i in range(count))
    )
    return path


def run_spec(folder: Path, model: Path, **overrides: Any) -> RunSpec:
    """A short run that a tiny model on two cores gets through in seconds per step. Rewards come from the
    length penalty (cheap, inline, varied), so few groups are dropped as zero-variance."""
    spec: dict[str, Any] = {
        "name": RUN,
        "output_dir": str(folder / "runs"),
        "model": {"path": str(model), "max_model_len": 256},
        "dataset": {
            "path": str(write_prompts(folder / "prompts.jsonl")),
            "reference_field": None,
            "epochs": 50,
        },
        "rollout": {"sampling": {"n": 4, "max_tokens": 8}, "max_staleness": 1},
        "reward": {"scorer": "length_penalty", "params": {"target_length": 4}},
        "optim": {"lr": 0.003},
        "train": {"steps": 6, "groups_per_step": 4, "micro_batch_size": 16, "checkpoint_every": 2},
    }
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and key in spec else value
    return RunSpec.model_validate(spec)


class Stack:
    """One scenario's processes. `start()` brings everything up and submits the run."""

    def __init__(
        self,
        folder: Path,
        spec: RunSpec,
        *,
        engine: str = "transformers",
        vllm_env: dict[str, str] | None = None,
        reward_address: str | None = None,
        places: Mapping[str, Place] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.folder, self.spec, self.engine = folder, spec, engine
        self.places = {role: (places or {}).get(role, LOOPBACK) for role in ROLES}
        """Where each role (`ROLES`) runs; every replica runs at the "rollout" place."""
        self.service_env = {**CREDENTIALS, **(env or {})}
        """What every service gets besides its inherited environment: the credentials, and `env` (an
        object store's endpoint and keys)."""
        self.env = {**(vllm_env or os.environ), **self.service_env}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), self.env.get("PYTHONPATH")]))
        self.redis_port, self.reward_port = free_port(), free_port()
        self.redis_url = f"redis://{self.places['redis'].address}:{self.redis_port}/0"
        self.reward_address = reward_address or f"{self.places['reward'].address}:{self.reward_port}"
        self.replica_binds_every_interface = False
        """Replicas bind 0.0.0.0 and announce their place's address through `advertise_address`."""
        self.procs: dict[str, ServiceProcess] = {}
        self.url = ""
        self.run_dir = Path(spec.output_dir) / spec.name
        self.weights_root = spec.weights.url or str(self.run_dir / "weights")
        """Where the learner publishes versions and the replicas load them (a folder or an fsspec URL)."""
        self.client: redis.Redis | None = None
        self.appendfsync = "everysec"
        """Redis's AOF fsync policy: "always" makes a SIGKILLed Redis lose nothing it acknowledged."""

    # --- processes --------------------------------------------------------------------------------

    def _proc(
        self, name: str, role: str, argv: list[str], ready: str, timeout_s: float = 180, **kw: Any
    ) -> str:
        argv = [*self.places[role].prefix, *argv]
        proc = ServiceProcess(name, argv, log_path=self.folder / "logs" / f"{name}.log", env=kw.get("env"))
        self.procs[name] = proc
        match = proc.start(ready, timeout_s=timeout_s)
        return match.group(1) if match.groups() else ""

    def start_redis(self) -> None:
        data = self.folder / "redis"
        data.mkdir(parents=True, exist_ok=True)
        bind = self.places["redis"].address
        argv = ["redis-server", "--port", str(self.redis_port), "--bind", bind, "--dir", str(data)]
        argv += ["--appendonly", "yes", "--appendfsync", self.appendfsync, "--maxmemory-policy", "noeviction"]
        if bind != LOOPBACK.address:  # clients on other hosts: the scenario's private network is the guard
            argv += ["--protected-mode", "no"]
        self._proc("redis", "redis", [*argv, "--save", ""], r"Ready to accept connections()", timeout_s=30)
        self.client = redis.Redis.from_url(self.redis_url)

    def start_reward(self, *settings: str) -> None:
        argv = cli(
            "serve", "reward", "--host", self.places["reward"].address, "--port", str(self.reward_port)
        )
        argv += ["--set", "workers=1"]
        for setting in settings:
            argv += ["--set", setting]
        self._proc("reward", "reward", argv, r"listening on (\S+)", timeout_s=60, env=self.env)

    def start_replica(
        self,
        name: str,
        ready: str = r"serving version (\d+)",
        failpoints: str = "",
        settings: tuple[str, ...] = (),
    ) -> str:
        argv = cli(
            "serve", "rollout", "--model", self.spec.model.path, "--port", "0", "--engine", self.engine
        )
        address = self.places["rollout"].address
        if self.replica_binds_every_interface:
            argv += ["--host", "0.0.0.0", "--set", f"advertise_address={address}"]
        else:
            argv += ["--host", address]
        every = (
            f"run_id={self.spec.name}", f"redis.url={self.redis_url}", f"replica_id={name}",
            f"weights_root={self.weights_root}", "heartbeat_s=0.5", "version_poll_s=0.2",
            "engine.max_model_len=256", "engine.kv_cache_bytes=134217728", "engine.enforce_eager=true",
            *settings,
        )  # fmt: skip
        for setting in every:
            argv += ["--set", setting]
        env = {**self.env, "RLFABRIC_FAILPOINTS": failpoints} if failpoints else self.env
        return self._proc(name, "rollout", argv, ready, env=env)

    def start_learner(
        self, failpoints: str = "", name: str = "learner", settings: dict[str, Any] | None = None
    ) -> None:
        config = {
            **(settings or {}),
            "run_id": self.spec.name,
            "redis": {"url": self.redis_url},
            "server": {"host": self.places["learner"].address, "port": 0},
            "log": {"format": "text"},
            "consumer_name": "learner-0",
            "run": json.loads(self.spec.model_dump_json()),
        }
        path = self.folder / "learner.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {**os.environ, **self.service_env, "OMP_NUM_THREADS": "1", "RLFABRIC_FAILPOINTS": failpoints}
        self._proc(
            name, "learner", cli("serve", "learner", "--config", str(path)), r"listening on (\S+)", env=env
        )

    def start_coordinator(self) -> None:
        argv = cli("serve", "coordinator", "--host", self.places["coordinator"].address, "--port", "0")
        argv += ["--set", f"redis.url={self.redis_url}"]
        argv += ["--set", f"reward_address={self.reward_address}"]
        env = {**os.environ, **self.service_env, **self.roots}
        self.url = self._proc(
            "coordinator", "coordinator", argv, r"listening on (http://\S+)", timeout_s=60, env=env
        )

    @property
    def roots(self) -> dict[str, str]:
        """The coordinator's allowed folders for this run's dataset (the scenario's folder) and model."""
        model_root = str(Path(self.spec.model.path).parent)
        return {
            "RLFABRIC_COORDINATOR__DATA_ROOTS": json.dumps([str(self.folder)]),
            "RLFABRIC_COORDINATOR__MODEL_ROOTS": json.dumps([model_root]),
        }

    def start(
        self,
        replicas: int = 1,
        failpoints: str = "",
        reward_settings: tuple[str, ...] = (),
        replica_failpoints: dict[str, str] | None = None,
        learner_settings: dict[str, Any] | None = None,
        replica_settings: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        """Everything, the slow starters in parallel, then the run (`failpoints` the learner's,
        `replica_failpoints` those of the named replicas, `learner_settings` the learner's configuration
        beyond the stack's, `replica_settings` the named replicas' `--set`s beyond the stack's)."""
        self.start_redis()
        armed = replica_failpoints or {}
        with ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(self.start_reward, *reward_settings)]
            names = [f"rollout-{i}" for i in range(replicas)]
            extra = replica_settings or {}
            jobs += [
                pool.submit(self.start_replica, n, failpoints=armed.get(n, ""), settings=extra.get(n, ()))
                for n in names
            ]
            jobs.append(pool.submit(self.start_learner, failpoints, settings=learner_settings))
            for job in jobs:
                job.result()
        self.start_coordinator()
        self.submit()

    def submit(self) -> None:
        body = json.loads(self.spec.model_dump_json())
        response = httpx.post(f"{self.url}/v1/runs", json=body, headers=self.auth, timeout=30)
        assert response.status_code == 201, response.text

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}

    def kill(self, name: str) -> None:
        """SIGKILL the process (and what it spawned) by PID."""
        self.procs[name].kill()

    def restart_redis(self, *, sigkill: bool = False) -> None:
        proc = self.procs["redis"]
        proc.kill() if sigkill else proc.stop(grace_s=30)
        self.start_redis()

    def freeze_redis(self, seconds: float) -> None:
        """SIGSTOP redis-server for `seconds`, then SIGCONT: alive, its connections open, answering
        nothing (a paused VM, a stalled disk under `appendfsync always`)."""
        proc = self.procs["redis"]
        proc.signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            proc.signal(signal.SIGCONT)

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop(grace_s=20)
        if self.client is not None:
            self.client.close()

    # --- observing --------------------------------------------------------------------------------

    def step(self) -> int:
        assert self.client is not None
        try:
            return int(self.client.get(f"rlfabric:{self.spec.name}:step") or 0)
        except redis.ConnectionError:
            return 0

    def counters(self) -> dict[str, int]:
        assert self.client is not None
        raw = self.client.hgetall(f"rlfabric:{self.spec.name}:counters")
        return {k.decode(): int(v) for k, v in raw.items()}

    def status(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/runs/{self.spec.name}", headers=self.auth, timeout=10)
        response.raise_for_status()
        return dict(response.json())

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 180, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(f"not reached in {timeout_s} s: {what}\n{self.tails()}\n{self.stacks()}")

    def wait_for_step(self, step: int, timeout_s: float = 180) -> None:
        self.wait(lambda: self.step() >= step, timeout_s, f"learner step {step}")

    def finish(self, timeout_s: float = 240) -> dict[str, Any]:
        """Waits for the run to complete and the learner to exit; returns the run's status."""
        self.wait(lambda: self.status()["state"] in ("completed", "failed", "stopped"), timeout_s, "run end")
        status = self.status()
        assert status["state"] == "completed", status
        learner = self.procs["learner"]
        assert learner.proc is not None
        assert learner.proc.wait(120) == 0, self.tails()
        return status

    def books(self) -> ledger.Ledger:
        """The ledger check of this run (raises LedgerViolation when the books do not balance)."""
        assert self.client is not None
        checkpoints = self.run_dir / "checkpoints"
        return ledger.check(self.client, self.spec.name, checkpoints, weights_root=self.weights_root)

    def assert_every_step_trained(self) -> None:
        """Each of the run's steps, in the newest checkpoint's lineage, trained between one group and
        groups_per_step (a step takes what arrived in time: fewer when groups are dropped or slow)."""
        found = ledger.read_checkpoint(self.run_dir / "checkpoints")
        assert found is not None, "no complete checkpoint"
        per_step = Counter(step for step, _ in found[1])
        assert sorted(per_step) == list(range(1, self.spec.train.steps + 1)), per_step
        assert all(1 <= n <= self.spec.train.groups_per_step for n in per_step.values()), per_step

    def last_metrics(self) -> dict[str, Any]:
        """The learner's newest metrics row (from the run's Redis metrics stream)."""
        assert self.client is not None
        [(_, fields)] = self.client.xrevrange(f"rlfabric:{self.spec.name}:metrics", count=1)
        return dict(json.loads(fields[b"row"]))

    def drops(self) -> list[dict[str, str]]:
        """The records of `rlfabric:{run}:dropped` (group_id, reason, detail ...), in order."""
        assert self.client is not None
        raw = self.client.xrange(f"rlfabric:{self.spec.name}:dropped")
        return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw]

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n" + "\n".join(list(p.tail)[-15:]) for n, p in self.procs.items())

    def stacks(self, wait_s: float = 3.0, max_lines: int = 400) -> str:
        """Every live service's thread and asyncio-task stacks, as its SIGUSR1 writes them
        (`runtime.logs.enable_stack_dumps`): where a service that stopped making progress waits."""
        offsets = {}
        for name, proc in self.procs.items():
            if name != "redis" and proc.running():
                offsets[name] = proc.log_path.stat().st_size
                proc.signal(signal.SIGUSR1)
        time.sleep(wait_s)
        shown = []
        for name, offset in offsets.items():
            with self.procs[name].log_path.open("rb") as log:
                log.seek(offset)
                lines = log.read().decode(errors="replace").splitlines()
            shown.append(f"--- {name} stacks\n" + "\n".join(lines[:max_lines]))
        return "\n".join(shown)
