"""`rlfabric up`: the whole system on one machine, every service its own process on loopback.

    1. prepare   the run directory, the run spec (the built-in demo when no file is given) checked before
                 anything starts (`rlfabric.validate`: a run that cannot run is refused naming the field),
                 the run's credentials (RUN_DIR/credentials.json, mode 0600; see `up_credentials`) and
                 up.json (what `--resume` needs)
    2. start     redis-server (AOF in the run directory) unless --redis-url; then the reward service, the
                 rollout replicas and the learner at once (a compiling vLLM replica takes longest), the
                 coordinator once the reward service listens (an offline preference run starts only the
                 learner and the coordinator); the run waits for every ready line. Each
                 process runs under `rlfabric.runtime.guard` on a port chosen here, so a restart reuses it
    3. submit    the run to the coordinator's REST API, with the run's API token
    4. watch     a progress bar (step, reward, KL, tokens/s) until the run ends or Ctrl-C stops it; a
                 service that dies is restarted with backoff (`supervisor`), a coordinator that does not
                 answer is waited for
    5. stop      every process (SIGTERM, then SIGKILL of its process group past the grace), print the
                 summary, plot

`up --resume RUN_DIR` repeats 2-5 for the run of an earlier `up` in RUN_DIR (stopped, or left running by a
crash): same options, run id, Redis data and credentials. The exit code is 0 only when the run completed;
nothing `up` started outlives it, even when it is killed (the guards see to that).
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

from rlfabric.local.credentials import Credentials, CredentialsError, for_run
from rlfabric.local.handoff import TWIN_SUFFIX, Handoff
from rlfabric.local.procs import ServiceProcess
from rlfabric.local.scaler import LocalScaler, ScalePolicy
from rlfabric.local.supervisor import Supervisor

STATE_FILE = "up.json"
"""In the run directory: the options and run spec of the `up` that created it, read by `--resume`."""
RESTART_EVENT = "learner_restart"
"""The `event` of the metrics row a learner writes when it resumes from a checkpoint."""
SAVED_OPTIONS = (
    "run_file", "steps", "replicas", "min_replicas", "max_replicas", "scale_up_after", "scale_down_after",
    "learner_ranks", "redis_url", "engine", "compile", "eager_start", "replica_cores",
)  # fmt: skip
"""The options `--resume` takes over from the first `up` of a run directory."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_file", nargs="?", help="run file (TOML/YAML/JSON); default: the built-in demo")
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run of an earlier `up` in RUN_DIR (stopped or crashed) with its options, Redis "
        "data and credentials; takes no run file and no other option but --no-progress",
    )
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
        "--eager-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --compile: serve from an eager replica while its compiled twin builds, then hand over "
        "(the first steps need not wait for the compile; default on)",
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
    """A port free now on loopback: chosen up front, so that a restarted service binds the same one."""
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
    """The processes of one `up`, each under a guard, stopped in reverse start order."""

    def __init__(self, run_dir: Path, credentials: Credentials | None = None) -> None:
        self.run_dir = run_dir
        self.credentials = credentials
        self.procs: list[ServiceProcess] = []

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


def load_spec(args: argparse.Namespace, run_dir: Path) -> Any:
    from rlfabric.coordinator.demo import demo_spec
    from rlfabric.runspec import RunSpec
    from rlfabric.runtime.config import load_config

    if args.run_file:
        spec = load_config(RunSpec, path=args.run_file)
    else:
        spec = demo_spec(run_dir, steps=args.steps or 40)
    updates: dict[str, Any] = {"output_dir": str(run_dir), "name": spec.name or f"run-{int(time.time())}"}
    if args.steps:
        updates["train"] = spec.train.model_copy(update={"steps": args.steps})
    return spec.model_copy(update=updates)


def save_state(run_dir: Path, args: argparse.Namespace, spec: Any) -> None:
    """RUN_DIR/up.json: the options and the run spec `--resume` starts from."""
    options = {name: getattr(args, name) for name in SAVED_OPTIONS}
    if options["run_file"]:
        options["run_file"] = str(Path(options["run_file"]).resolve())
    state = {"options": options, "spec": json.loads(spec.model_dump_json())}
    (run_dir / STATE_FILE).write_text(json.dumps(state, indent=2))


def load_state(run_dir: Path, args: argparse.Namespace) -> tuple[argparse.Namespace, Any]:
    """The options (this call's --no-progress kept) and run spec of the `up` that created RUN_DIR;
    FileNotFoundError when it holds no up.json."""
    from rlfabric.runspec import RunSpec

    state = json.loads((run_dir / STATE_FILE).read_text())
    options = argparse.Namespace(**{**vars(args), **state["options"]})
    return options, RunSpec.model_validate(state["spec"])


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
    if spec.mode == "offline_preference":
        return start_offline_services(stack, args, spec, redis_url)
    reward = stack.launch(reward_process(stack, args, spec), REWARD_READY)
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
    from rlfabric.reward.check import allowed_functions

    allowed = allowed_functions(spec.reward, args.run_file)
    argv = cli("serve", "reward", "--port", str(free_port()), "--set", "workers=1")
    argv += ["--set", f"allowed_functions={json.dumps(allowed)}"]
    return stack.process("reward", argv, service="reward")


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
    argv = cli("serve", "rollout", "--model", spec.model.path, "--port", str(free_port()))
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
    if args.replica_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.replica_cores[i % len(args.replica_cores)]
    return stack.process(name, argv, env, service="rollout")


def learner_process(stack: Stack, args: argparse.Namespace, spec: Any, redis_url: str) -> ServiceProcess:
    config = {
        "run_id": spec.name,
        "redis": {"url": redis_url},
        "server": {"port": free_port()},
        "log": {"format": "text"},
        "run": json.loads(spec.model_dump_json()),
        "report_to_redis": spec.mode == "offline_preference",
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


def restart_steps(rows: list[dict[str, Any]]) -> list[int]:
    """The steps of the learner-restart markers among the metrics rows."""
    return [int(r["step"]) for r in rows if r.get("event") == RESTART_EVENT]


def segments(rows: list[dict[str, Any]], name: str) -> list[list[tuple[int, float]]]:
    """The (step, value) points of metric `name`, split at each learner-restart marker: a curve is never
    joined across a restart (the steps after it repeat those rolled back)."""
    parts: list[list[tuple[int, float]]] = [[]]
    for row in rows:
        if row.get("event") == RESTART_EVENT:
            parts.append([])
        elif isinstance(row.get(name), int | float) and "step" in row:
            parts[-1].append((int(row["step"]), float(row[name])))
    return [part for part in parts if part]


def plot(metrics_path: Path, out: Path) -> Path | None:
    """A PNG of the run's curves, if matplotlib is installed; a dotted vertical line marks each learner
    restart, and no curve is joined across one."""
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
        for part in segments(rows, name):
            ax.plot(*zip(*part, strict=True), marker=".", color="tab:blue")
        for step in restart_steps(rows):
            ax.axvline(step, color="tab:red", linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM behaves like Ctrl-C: stop the run, then every process."""
    raise KeyboardInterrupt


class RunRefused(RuntimeError):
    """The coordinator answered the submission with an error; the message has its answer."""


@dataclass
class Plan:
    """What one `up` runs: where, with which options and spec, and whether it resumes."""

    run_dir: Path
    args: argparse.Namespace
    spec: Any
    resume: bool


def plan(args: argparse.Namespace) -> Plan:
    """The run directory, options and spec; ValueError (the message for the user) for bad options."""
    if args.resume is not None:
        if args.run_file or args.run_dir:
            raise ValueError("--resume takes neither a run file nor --run-dir: it reuses those of the run")
        run_dir = args.resume.resolve()
        if not (run_dir / STATE_FILE).exists():
            raise ValueError(f"{run_dir} holds no {STATE_FILE}: not the run directory of an `rlfabric up`")
        options, spec = load_state(run_dir, args)
        scale_policy(options)
        return Plan(run_dir, options, spec, resume=True)
    run_dir = (args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    if (run_dir / STATE_FILE).exists():
        raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir}")
    scale_policy(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = load_spec(args, run_dir)
    check_run(spec, args.run_file)
    save_state(run_dir, args, spec)
    return Plan(run_dir, args, spec, resume=False)


def check_run(spec: Any, run_file: str | None) -> None:
    """ValueError naming each field that keeps the run from running (`rlfabric.validate`, the scorer
    built in-process), before any process starts."""
    from rlfabric.validate import check_local

    report = check_local(spec, run_file)
    for line in report.notes:
        print(f"rlfabric up: note: {line}", flush=True)
    if report.issues:
        lines = "\n  ".join(str(issue) for issue in report.issues)
        raise ValueError(f"the run cannot run:\n  {lines}")


def run(args: argparse.Namespace) -> int:
    try:
        chosen = plan(args)
        credentials = for_run(chosen.run_dir, resume=chosen.resume)
    except (ValueError, CredentialsError) as exc:
        print(f"rlfabric up: {exc}", file=sys.stderr)
        return 2
    print(f"rlfabric up: run directory {chosen.run_dir}", flush=True)
    signal.signal(signal.SIGTERM, interrupt)
    return bring_up(chosen, Stack(chosen.run_dir, credentials), Supervisor())


def bring_up(chosen: Plan, stack: Stack, supervisor: Supervisor) -> int:
    """Steps 2-5 of the module docstring; the exit code."""
    from rlfabric.coordinator.runs import RunState
    from rlfabric.local.watch import Api, prepare_resume, summarize, watch

    options, spec = chosen.args, chosen.spec
    services = None
    try:
        redis_url = start_redis(stack, options)
        action = prepare_resume(redis_url, spec.name) if chosen.resume else "submit"
        if action == "done":
            return 0
        services = start_services(stack, options, spec, redis_url, scale_policy(options))
        redis = [(proc, REDIS_READY) for proc in stack.procs if proc.name == "redis"]  # unless --redis-url
        for proc, ready in redis + services.supervised:
            supervisor.watch(proc, ready, restart_clean_exit=proc is not services.learner)
        if services.scaler is not None:
            services.scaler.supervisor = supervisor
        for handoff in services.handoffs:
            handoff.begin(supervisor, services.scaler)
        api = Api(services.url, stack.credentials.api if stack.credentials else "")
        try:
            announce(api, spec, chosen.run_dir, submit=action == "submit")
        except RunRefused as exc:
            print(f"rlfabric up: {exc}", file=sys.stderr)
            return 2
        status = watch(api, spec.name, spec.train.steps, progress=not options.no_progress,
                       supervisor=supervisor, scaler=services.scaler)  # fmt: skip
    finally:
        supervisor.close()
        stack.stop()
    summarize(status, chosen.run_dir, spec.name, services.scaler, supervisor)
    return 0 if status.get("state") == RunState.COMPLETED else 1


def announce(api: Any, spec: Any, run_dir: Path, *, submit: bool) -> None:
    """Submits the run unless the coordinator resumes it; prints the API token once, with the
    submission (a resumed run points at the credentials file instead)."""
    credentials = run_dir / "credentials.json"
    if not submit:
        print(f"run {spec.name} resumed; page: {api.url}/runs/{spec.name} (token: {credentials})", flush=True)
        return
    import httpx

    try:
        run_id = api.submit(spec)
    except httpx.HTTPStatusError as exc:
        answer = f"({exc.response.status_code}): {exc.response.text}"
        raise RunRefused(f"the coordinator refused the run {answer}") from exc
    print(f"run {run_id} submitted; page: {api.url}/runs/{run_id}", flush=True)
    print(f"API token (also in {credentials}, mode 0600): {api.token}", flush=True)
