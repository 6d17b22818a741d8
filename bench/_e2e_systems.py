"""The two systems `bench/e2e_trl.py` compares, each run as real processes, and what is read off them.

- `run_rlfabric`: `rlfabric up RUN_FILE` (redis-server, reward service, a vLLM replica, the learner and
  the coordinator, each its own process); figures come from the learner's metrics.jsonl.
- `run_trl`: TRL's `GRPOTrainer` in one process (`_e2e_trl_worker.py`); figures from its step rows.

Both are sampled for CPU seconds (the whole process tree, from /proc, once a second), so a table can say
how many cores each system actually got on a shared machine. The shared `Task` is the single source of
every hyperparameter both sides use.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import BENCH_DIR, child_pids, cpu_seconds, machine_cpu_times

REWARD_FUNCTION = "rlfabric.coordinator.demo:letter_reward"
"""The TRL-signature reward both systems call: the fraction of the reply's characters that are "x"."""


@dataclass(frozen=True)
class Task:
    """What both systems train: the same model, prompts, reward function and hyperparameters."""

    model: str
    prompts: str
    steps: int
    group_size: int
    prompts_per_step: int
    max_tokens: int
    lr: float
    kl_coef: float
    micro_batch_size: int
    dtype: str = "float32"
    """Compute dtype of both systems ("float32" or "bfloat16"): rlfabric's `model.dtype` (the vLLM
    replica's weights, and the learner's forward/backward over float32 master weights); for TRL the model
    loaded in bfloat16 (its `bf16=True` alone changes nothing on a CPU: neither generation nor training
    runs under autocast there, measured: identical samples and step times to float32)."""
    max_staleness: int = 1
    """rlfabric's policy lag bound (1: generation of the next step overlaps training; 0: on-policy, in
    turn, as TRL). TRL has no such knob: it always generates with the current weights."""
    old_policy: str = "trainer"
    """rlfabric's `algorithm.old_policy`: what its PPO ratio is taken against ("rollout": the engine's
    log-probs, so stale samples are clipped against the policy that generated them). TRL generates with
    the current weights and takes one step per batch: its ratio is 1."""
    rollout_correction: str = "truncate"
    """rlfabric's `algorithm.rollout_correction` (with old_policy "trainer"): TIS's truncation, or the
    IcePop/MIS masks (`mask_token`, `mask_sequence`) that drop tokens or samples too far off-policy."""
    rollout_trust_kl: float | None = None
    """rlfabric's `algorithm.rollout_trust_kl`: a step on samples further than this (KL per token, engine
    to trainer) from the current policy has its learning rate and its gradient's weight in Adam's moments
    scaled down by the ratio (async runs)."""
    learner_compile: bool = False
    """rlfabric's `train.compile`: the learner's normalisation layers and MLPs compiled into fused kernels
    (attention and matmuls eager). TRL's own `torch_compile` compiles the whole model for training only
    (generation runs the eager model); it is not turned on here."""
    learner_packing: bool = True
    """rlfabric's `train.packing`: each micro-batch packed into one row, each group's prompt once."""
    seed: int = 0
    threads: int = 2
    """torch threads of the TRL process (the machine's cores)."""

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.prompts_per_step


@dataclass(frozen=True)
class Placement:
    """Where rlfabric's vLLM replicas and learner run on the machine's cores.

    `split` (the default with max_staleness >= 1, when generation overlaps training): one replica, its
    OpenMP threads bound to core 0, the learner on one torch thread (`rlfabric up`'s default), so each
    keeps a core. `shared` (the default on-policy, when they take turns): one replica bound to every core
    and the learner on as many threads, each using the whole machine in its turn. `per-core`: one replica
    per core, each bound to its own, and the learner on every core in its turn (measured on the bench
    model: slower than `shared`, 19 against 16.5 s a step)."""

    name: str
    vllm_cores: str
    """VLLM_CPU_OMP_THREADS_BIND of each replica, '|' between replicas, e.g. "0", "0-1" or "0|1"."""
    learner_threads: int | None
    """OMP_NUM_THREADS of the services (the learner's torch threads); None keeps `up`'s default, 1."""
    replicas: int = 1
    """Rollout replicas (`rlfabric up --replicas`); replica i takes entry i of `vllm_cores`."""
    learner_ranks: int = 1
    """Learner processes (`rlfabric up --learner-ranks`: FSDP2 data parallel over gloo)."""

    @classmethod
    def of(cls, name: str, cores: int, learner_threads: int | None) -> Placement:
        if name == "split":
            return cls(name, "0", learner_threads)
        if name == "per-core":
            bind = "|".join(str(c) for c in range(cores))
            return cls(name, bind, learner_threads or cores, replicas=cores)
        return cls(name, f"0-{cores - 1}", learner_threads or cores)


def rlfabric_spec(task: Task, name: str) -> dict[str, Any]:
    """The run file: overrides only, every one of them a field of `Task` (or a choice the TRL side
    makes the same way: plain-text prompts, constant lr, token-mean loss, std-scaled advantages)."""
    return {
        "name": name,
        "model": {"path": task.model, "max_model_len": 64 + task.max_tokens, "dtype": task.dtype},
        "dataset": {
            "path": task.prompts,
            "reference_field": None,
            "chat_template": False,
            "shuffle_seed": task.seed,
            "epochs": 1000,
        },
        "rollout": {
            "sampling": {"n": task.group_size, "max_tokens": task.max_tokens, "temperature": 1.0},
            "max_staleness": task.max_staleness,
        },
        "reward": {"scorer": "python_function", "params": {"function": REWARD_FUNCTION}},
        "algorithm": {
            "advantage": "grpo",
            "loss_aggregation": "token_mean",
            "kl": {"coef": task.kl_coef, "estimator": "k3"},
            "old_policy": task.old_policy,
            "rollout_correction": task.rollout_correction,
            "rollout_trust_kl": task.rollout_trust_kl,
        },
        "optim": {"lr": task.lr, "schedule": "constant", "grad_clip": 1.0},
        "train": {
            "steps": task.steps,
            "groups_per_step": task.prompts_per_step,
            "micro_batch_size": task.micro_batch_size,
            "checkpoint_every": task.steps,
            "seed": task.seed,
            "compile": task.learner_compile,
            "packing": task.learner_packing,
        },
    }


class TreeCpu:
    """Samples the CPU seconds of a process and all its descendants once a second, in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float]] = []  # (epoch seconds, CPU seconds so far)
        self.machine: list[tuple[float, float, float]] = []  # (epoch seconds, stolen, total CPU seconds)
        self.seen: dict[int, float] = {}  # last CPU reading of every process ever seen (the dead keep it)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.done.wait(1.0):
            self.sample()

    def sample(self) -> None:
        stack = [self.pid]
        while stack:
            pid = stack.pop()
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self.seen[pid] = cpu
                stack += child_pids(pid)
        now = time.time()
        self.samples.append((now, sum(self.seen.values())))
        times = machine_cpu_times()
        if times is not None:
            self.machine.append((now, *times))

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def at(self, t: float) -> float:
        """CPU seconds used by time `t` (the last sample at or before it)."""
        before = [cpu for when, cpu in self.samples if when <= t]
        return before[-1] if before else 0.0

    def stolen_between(self, t0: float, t1: float) -> float:
        """Share of the machine's CPU time the hypervisor took between `t0` and `t1` (NaN unknown)."""
        inside = [m for m in self.machine if t0 <= m[0] <= t1]
        if len(inside) < 2 or inside[-1][2] <= inside[0][2]:
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])

    def cores_between(self, t0: float, t1: float) -> float:
        return (self.at(t1) - self.at(t0)) / (t1 - t0) if t1 > t0 else float("nan")


def run_tree(argv: list[str], log: Path, env: dict[str, str], timeout_s: float) -> tuple[float, TreeCpu]:
    """Runs `argv` with its output in `log`, sampling its CPU; returns (start epoch, sampler)."""
    start = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        cpu = TreeCpu(proc.pid)
        try:
            code = proc.wait(timeout=timeout_s)
        except BaseException:  # a timeout, Ctrl-C or SIGTERM: stop the child, which stops its own
            proc.terminate()  # (`rlfabric up` stops every process it started on SIGTERM)
            proc.wait(timeout=120)
            raise
        finally:
            cpu.stop()
    if code != 0:
        raise RuntimeError(f"{argv[1:4]} exited {code}; see {log}")
    return start, cpu


def run_rlfabric(
    task: Task,
    work: Path,
    *,
    engine: str,
    compile_: bool,
    placement: Placement,
    timeout_s: float,
    compile_cache: Path | None = None,
    stand_in: str = "transformers",
) -> dict[str, Any]:
    """One `rlfabric up`, its vLLM replica and learner placed on the cores as `placement` says.
    `compile_cache`: where vLLM's and torch inductor's compile caches go (VLLM_CACHE_ROOT and
    TORCHINDUCTOR_CACHE_DIR); None leaves them where the environment says. `stand_in`: `up --stand-in`."""
    run_dir = work / "rlfabric"
    run_dir.mkdir(parents=True)
    run_file = run_dir / "run.json"
    run_file.write_text(json.dumps(rlfabric_spec(task, "e2e")))
    argv = [sys.executable, "-m", "rlfabric.cli", "up", str(run_file), "--run-dir", str(run_dir)]
    argv += ["--no-progress", "--engine", engine]
    argv += ["--compile", "--stand-in", stand_in] if compile_ else []
    argv += ["--replicas", str(placement.replicas), "--replica-cores", placement.vllm_cores]
    argv += ["--learner-ranks", str(placement.learner_ranks)]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if placement.learner_threads is not None:
        env["OMP_NUM_THREADS"] = str(placement.learner_threads)
    if compile_cache is not None:
        env["VLLM_CACHE_ROOT"] = str(compile_cache / "vllm")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache / "inductor")
    start, cpu = run_tree(argv, run_dir / "up.out", env, timeout_s)
    end = time.time()
    rows = [json.loads(line) for line in (run_dir / "e2e" / "metrics.jsonl").read_text().splitlines()]
    steps = [rlfabric_step(r) for r in rows]
    handed_over = handover_version(run_dir / "logs")
    return {
        **summarize(steps, task, start, end, cpu, warm_up_steps=handed_over + 1),
        "ready_s": ready_times((run_dir / "up.out").read_text()),
        "handover_version": handed_over,
    }


def handover_version(logs: Path) -> int:
    """The policy version the compiled twin first served (its "serving version N" line), 0 without one:
    the run's steps up to N + 1 were generated, wholly or partly, by the eager replica while the twin
    compiled beside them (`rlfabric.local.handoff`), a start-up phase."""
    versions = [
        int(m[1])
        for log in logs.glob("rollout-*-compiled.log")
        if (m := re.search(r"serving version (\d+)", log.read_text(errors="replace")))
    ]
    return max(versions, default=0)


def ready_times(up_output: str) -> dict[str, float]:
    """Seconds from launch to ready line of each process `rlfabric up` started ("rollout-0 ready (pid
    123, 51 s)")."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^\s*(\S+) ready \(pid \d+, (\d+) s\)", up_output, re.M)}


def rlfabric_step(row: dict[str, Any]) -> dict[str, Any]:
    """One learner row as a step record; the final checkpoint's write is left out of the step's end
    (TRL's run saves nothing)."""
    checkpoint = float(row.get("checkpoint_seconds", 0.0))
    return {
        "step": int(row["step"]),
        "time": float(row["time"]) - checkpoint,
        "reward": float(row["reward_mean"]),
        "reward_std": float(row.get("reward_std", float("nan"))),
        "completion_length": float(row.get("response_length_mean", float("nan"))),
        "samples": float(row["samples"]),
        "train_s": float(row["step_seconds"]),
        "publish_s": float(row.get("publish_seconds", 0.0)),
        "busy_fraction_run": float(row.get("rollout_busy_fraction_run", float("nan"))),
        "rollout_mismatch_kl": float(row.get("rollout_mismatch_kl", float("nan"))),
        "lr_scale": float(row.get("lr_scale", 1.0)),
    }


def run_trl(task: Task, work: Path, *, timeout_s: float) -> dict[str, Any]:
    """One TRL GRPOTrainer run in its own process."""
    run_dir = work / "trl"
    run_dir.mkdir(parents=True)
    config, out = run_dir / "config.json", run_dir / "steps.json"
    config.write_text(json.dumps(asdict(task)))
    argv = [sys.executable, str(BENCH_DIR / "_e2e_trl_worker.py"), str(config), str(out)]
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    start, cpu = run_tree(argv, run_dir / "trl.out", env, timeout_s)
    end = time.time()
    result = json.loads(out.read_text())
    steps = [{**r, "samples": float(task.samples_per_step)} for r in result["rows"]]
    return summarize(steps, task, start, end, cpu)


def summarize(
    steps: list[dict[str, Any]],
    task: Task,
    start: float,
    end: float,
    cpu: TreeCpu,
    warm_up_steps: int = 1,
) -> dict[str, Any]:
    """Figures of one run. Steady state: from the end of step `warm_up_steps` (1, or with rlfabric's
    eager-first start the step after the compiled twin took over; at most all but two steps) to the end of
    the last, so start-up (engines, model loads, compiling) is out of the throughput; `samples_per_s_after_
    first_step` keeps the window from the end of step 1 whatever happened after it."""
    if len(steps) != task.steps:
        raise RuntimeError(f"expected {task.steps} steps, got {len(steps)}")
    skip = min(max(warm_up_steps, 1), max(len(steps) - 2, 1))
    first, last = steps[skip - 1], steps[-1]
    steady = steps[skip:]
    span = last["time"] - first["time"]
    after_first = last["time"] - steps[0]["time"]
    tail = steps[-max(1, len(steps) // 4) :]
    return {
        "samples_per_s": sum(s["samples"] for s in steady) / span if span > 0 else float("nan"),
        "steady_from_step": skip,
        "samples_per_s_after_first_step": sum(s["samples"] for s in steps[1:]) / after_first
        if after_first > 0
        else float("nan"),
        "seconds_per_step": span / len(steady) if steady else float("nan"),
        "samples_per_s_with_startup": sum(s["samples"] for s in steps) / (last["time"] - start),
        "first_step_end_s": steps[0]["time"] - start,
        "wall_s": end - start,
        "reward_final": sum(s["reward"] for s in tail) / len(tail),
        "reward_final_se": reward_standard_error(tail),
        "reward_first": steps[0]["reward"],
        "samples_trained": sum(s["samples"] for s in steps),
        "cores_used_steady": cpu.cores_between(first["time"], last["time"]),
        "cpu_stolen_steady": cpu.stolen_between(first["time"], last["time"]),
        "cpu_s_per_sample": (cpu.at(last["time"]) - cpu.at(first["time"]))
        / max(sum(s["samples"] for s in steady), 1.0),
        "split": split(steady),
        "steps": steps,
    }


def reward_standard_error(tail: list[dict[str, Any]]) -> float:
    """Standard error of `reward_final` (the mean of the tail steps' mean rewards) from each step's
    reward spread over its samples: sqrt(sum(std_i^2 / n_i)) / k for k steps; NaN where a step did not
    report its spread."""
    variance = sum(s.get("reward_std", float("nan")) ** 2 / max(s["samples"], 1.0) for s in tail)
    return math.sqrt(variance) / len(tail)


def split(steady: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step in each phase a system reports (keys ending in `_s`), plus rlfabric's
    replica busy fraction at the end of the run."""
    keys = sorted({k for s in steady for k in s if k.endswith("_s")})
    out = {k: sum(s.get(k, 0.0) for s in steady) / len(steady) for k in keys} if steady else {}
    if steady and "busy_fraction_run" in steady[-1]:
        out["replica_busy_fraction"] = steady[-1]["busy_fraction_run"]
    return out
