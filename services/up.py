"""`rlfabric up`: the whole system on one machine, every service its own process on loopback.

    1. prepare   the run directory, the run spec (the built-in demo when no file is given)
    2. start     redis-server (AOF in the run directory) unless --redis-url; then the reward service, the
                 rollout replicas and the learner at once (a compiling vLLM replica takes longest), the
                 coordinator once the reward service listens; the run waits for every ready line
    3. submit    the run to the coordinator's REST API
    4. watch     a progress bar (step, reward, KL, tokens/s) until the run ends or Ctrl-C stops it
    5. stop      every process by PID (SIGTERM, then SIGKILL past the grace), print the summary, plot

The exit code is 0 only when the run completed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlfabric.common.procs import ServiceProcess
from rlfabric.scaler import LocalScaler, ScalePolicy

FINAL_STATES = ("completed", "failed", "stopped")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_file", nargs="?", help="run file (TOML/YAML/JSON); default: the built-in demo")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--run-dir", type=Path, help="where everything is written (default runs/<time>)")
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
        "--replica-cores",
        type=replica_cores,
        help="CPU cores of each replica's vLLM threads, '|' between replicas: replica i takes entry i modulo "
        "their count, e.g. '0|1' puts one replica on each of two cores (default: vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND from the environment, else unbound)",
    )
    parser.add_argument("--no-progress", action="store_true", help="print one line per step, no bar")


def replica_cores(text: str) -> list[str]:
    """`--replica-cores`: one VLLM_CPU_OMP_THREADS_BIND value per replica ("0|1", "0-3|4-7")."""
    entries = [e.strip() for e in text.split("|")]
    for entry in entries:
        parts = [p for chunk in entry.split(",") for p in chunk.split("-")]
        if not entry or not all(p.isdigit() for p in parts):
            raise argparse.ArgumentTypeError(f"expected core lists like '0|1' or '0-3|4-7', got {text!r}")
    return entries


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    """The processes of one `up`, stopped in reverse start order."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[ServiceProcess] = []

    def process(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ServiceProcess:
        """A new, not yet started process of this stack (stopped with the rest at the end)."""
        proc = ServiceProcess(name, argv, log_path=self.run_dir / "logs" / f"{name}.log", env=env)
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
        print(f"  {starting.proc.name} ready (pid {starting.proc.pid}, {took:.0f} s)", flush=True)
        return match.group(1) if match.groups() else ""

    def start(
        self,
        name: str,
        argv: list[str],
        ready: str,
        *,
        env: dict[str, str] | None = None,
        timeout_s: float = 300,
    ) -> str:
        return self.wait(self.launch(self.process(name, argv, env), ready, timeout_s=timeout_s))

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


def load_spec(args: argparse.Namespace, run_dir: Path) -> Any:
    from rlfabric.common.config import load_config
    from rlfabric.common.runspec import RunSpec
    from rlfabric.coordinator.demo import demo_spec

    if args.run_file:
        spec = load_config(RunSpec, path=args.run_file)
    else:
        spec = demo_spec(run_dir, steps=args.steps or 40)
    updates: dict[str, Any] = {"output_dir": str(run_dir), "name": spec.name or f"run-{int(time.time())}"}
    if args.steps:
        updates["train"] = spec.train.model_copy(update={"steps": args.steps})
    return spec.model_copy(update=updates)


def start_redis(stack: Stack, args: argparse.Namespace) -> str:
    if args.redis_url:
        return str(args.redis_url)
    port, data = free_port(), stack.run_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
    argv += ["--appendonly", "yes", "--maxmemory-policy", "noeviction", "--save", ""]
    stack.start("redis", argv, r"Ready to accept connections()")
    return f"redis://127.0.0.1:{port}/0"


REPLICA_READY = r"serving version (\d+)"


def start_services(
    stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str, policy: ScalePolicy | None
) -> tuple[str, LocalScaler | None]:
    """Starts reward, rollout, learner and coordinator; returns the coordinator's URL and the replica
    scaler (None without --max-replicas)."""
    reward_argv = cli("serve", "reward", "--port", "0", "--set", "workers=1")
    reward = stack.launch(stack.process("reward", reward_argv), r"listening on (\S+)")

    def replica(i: int) -> ServiceProcess:
        return replica_process(stack, args, spec, redis_url, i)

    replicas = [replica(i) for i in range(args.replicas)]
    starting = [stack.launch(proc, REPLICA_READY) for proc in replicas]
    learner = launch_learner(stack, args, spec, redis_url)
    coordinator = cli("serve", "coordinator", "--port", "0", "--set", f"redis.url={redis_url}")
    coordinator += ["--set", f"reward_address={stack.wait(reward)}"]
    url = stack.start("coordinator", coordinator, r"listening on (http://\S+)")
    for pending in (learner, *starting):
        stack.wait(pending)
    return url, LocalScaler(policy, replica, REPLICA_READY, replicas) if policy else None


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
    stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str, i: int
) -> ServiceProcess:
    """Rollout replica `i` of the run (not started)."""
    weights = str(Path(spec.output_dir) / spec.name / "weights")
    argv = cli("serve", "rollout", "--model", spec.model.path, "--port", "0", "--engine", args.engine)
    settings = [
        f"run_id={spec.name}", f"redis.url={redis_url}", f"weights_root={weights}", f"replica_id=rollout-{i}",
        f"engine.max_model_len={spec.model.max_model_len}", f"engine.dtype={spec.model.dtype}",
        "engine.kv_cache_bytes=268435456",
        f"engine.enforce_eager={str(not args.compile).lower()}", "log.format=text",
    ]  # fmt: skip
    for setting in settings:
        argv += ["--set", setting]
    env = vllm_env(compile_=args.compile)
    if args.replica_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.replica_cores[i % len(args.replica_cores)]
    return stack.process(f"rollout-{i}", argv, env)


def launch_learner(stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str) -> Starting:
    config = {
        "run_id": spec.name,
        "redis": {"url": redis_url},
        "server": {"port": 0},
        "log": {"format": "text"},
        "run": json.loads(spec.model_dump_json()),
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
    return stack.launch(stack.process("learner", argv, env), r"listening on (\S+)")


def submit(url: str, spec: Any) -> str:
    import httpx

    response = httpx.post(f"{url}/v1/runs", json=json.loads(spec.model_dump_json()), timeout=30)
    response.raise_for_status()
    return str(response.json()["run_id"])


def watch(
    url: str, run_id: str, steps: int, *, progress: bool, scaler: LocalScaler | None = None
) -> dict[str, Any]:
    """Polls the run until it ends (scaling the replicas by its signal when there is a scaler); Ctrl-C
    asks the coordinator to stop it and keeps watching."""
    import httpx
    from tqdm import tqdm

    bar = tqdm(total=steps, unit="step", disable=not progress, dynamic_ncols=True)
    bar.last_step = 0
    status: dict[str, Any] = {}
    while status.get("state") not in FINAL_STATES:
        try:
            time.sleep(1.0)
            status = httpx.get(f"{url}/v1/runs/{run_id}", timeout=10).json()
        except KeyboardInterrupt:
            print("\nstopping the run ...", flush=True)
            httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=10)
            continue
        show_progress(bar, status, progress=progress)
        if scaler is not None:
            follow_signal(scaler, status, bar)
    bar.close()
    return status


def follow_signal(scaler: LocalScaler, status: dict[str, Any], bar: Any) -> None:
    """One reading of the run's desired replica count for the local scaler."""
    desired = (status.get("scaling") or {}).get("desired_replicas")
    event = scaler.observe(None if desired is None else int(desired), time.monotonic())
    if event is not None:
        verb = "adding" if event.action == "out" else "removing"
        wanted = f"{event.running_before} running, {event.desired} wanted"
        bar.write(f"autoscale: {verb} {event.replica} ({wanted})")


def show_progress(bar: Any, status: dict[str, Any], *, progress: bool) -> None:
    """Advances the bar to the run's step; without a bar, prints one line per new step."""
    metrics = status.get("latest_metrics") or {}
    step = int(status.get("step") or 0)
    fields = {k: metrics.get(k) for k in ("reward_mean", "eval_reward_mean", "kl", "tokens_per_s")}
    shown = {k: f"{v:.3g}" for k, v in fields.items() if isinstance(v, int | float)}
    if step > bar.last_step:
        bar.last_step = step
        bar.update(step - bar.n)
        if not progress:
            print(f"step {step}: " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    bar.set_postfix(shown, refresh=True)


def plot(metrics_path: Path, out: Path) -> Path | None:
    """A PNG of the run's curves, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = (
        [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    )
    names = ["reward_mean", "eval_reward_mean", "kl", "entropy", "response_length_mean", "tokens_per_s"]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, name in zip(axes.flat, names, strict=True):
        points = [(r["step"], r[name]) for r in rows if name in r]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".")
        ax.set_title(name)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out)
    return out


def summarize(status: dict[str, Any], run_dir: Path, run_id: str, scaler: LocalScaler | None) -> None:
    run_path = run_dir / run_id
    png = plot(run_path / "metrics.jsonl", run_path / "curves.png")
    print(f"\nrun {run_id}: {status.get('state')} at step {status.get('step')}")
    for key in ("error", "stop_reason", "last_good_checkpoint"):
        if status.get(key) is not None:
            print(f"  {key.replace('_', ' ')}: {status[key]}")
    for warning in status.get("warnings") or []:
        print(f"  warning: {warning}")
    if scaler is not None:
        outs = sum(e.action == "out" for e in scaler.events)
        ins = len(scaler.events) - outs
        print(f"  autoscaling: {outs} added, {ins} removed, {scaler.failed_starts} failed to start")
    for name, value in sorted((status.get("counters") or {}).items()):
        print(f"  {name}: {value}")
    print(f"  run directory: {run_path} (metrics.jsonl, checkpoints/, weights/, logs in {run_dir / 'logs'})")
    if png:
        print(f"  curves: {png}")


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM behaves like Ctrl-C: stop the run, then every process."""
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    run_dir = (args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"rlfabric up: run directory {run_dir}", flush=True)
    try:
        policy = scale_policy(args)
    except ValueError as exc:
        print(f"rlfabric up: {exc}", file=sys.stderr)
        return 2
    spec = load_spec(args, run_dir)
    stack = Stack(run_dir)
    signal.signal(signal.SIGTERM, interrupt)
    scaler = None
    try:
        redis_url = start_redis(stack, args)
        url, scaler = start_services(stack, args, spec, redis_url, policy)
        run_id = submit(url, spec)
        print(f"run {run_id} submitted; page: {url}/runs/{run_id}", flush=True)
        status = watch(url, run_id, spec.train.steps, progress=not args.no_progress, scaler=scaler)
    finally:
        stack.stop()
    summarize(status, run_dir, spec.name, scaler)
    return 0 if status.get("state") == "completed" else 1
