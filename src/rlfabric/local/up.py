"""`rlfabric up`: the whole system on one machine, every service its own process on loopback.

    1. prepare   the run directory, the run spec (the built-in demo when no file is given) checked before
                 anything starts (`rlfabric.validate`: a run that cannot run is refused naming the field),
                 the run's credentials (RUN_DIR/credentials.json, mode 0600; see `local.credentials`) and
                 up.json (what `--resume` needs)
    2. start     redis-server (AOF in the run directory) unless --redis-url; then the reward service, the
                 rollout replicas and the learner at once (a compiling vLLM replica takes longest), the
                 coordinator once the reward service listens (an offline preference run starts only the
                 learner and the coordinator; a `[warm_start]` runs its SFT learner to the end first, and
                 an SFT or reward-model run file only its learner: `local.warm_start`); the run waits for
                 every ready line. Each process runs under `rlfabric.runtime.guard` on a port chosen here,
                 so a restart reuses it
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
import dataclasses
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfabric.local.credentials import CredentialsError, for_run
from rlfabric.local.stack import REDIS_READY, Stack, scale_policy, start_redis, start_services
from rlfabric.local.supervisor import Supervisor

STATE_FILE = "up.json"
"""In the run directory: the options and run spec of the `up` that created it, read by `--resume`."""
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
    make_tiny_model_if_missing(spec)
    check_run(spec, args.run_file)
    save_state(run_dir, args, spec)
    return Plan(run_dir, args, spec, resume=False)


def make_tiny_model_if_missing(spec: Any) -> None:
    """Builds the run's tiny model (`model.tiny`) at `model.path` unless a folder is there."""
    recipe, path = spec.model.tiny, Path(spec.model.path)
    if recipe is None or path.exists():
        return
    from rlfabric.tools.tiny_model import PRESETS, save_tiny_model

    tiny = dataclasses.replace(PRESETS[recipe.preset], tokenizer=recipe.tokenizer, seed=recipe.seed)
    save_tiny_model(tiny, path)
    print(
        f"rlfabric up: made a random {recipe.preset} model ({recipe.tokenizer} tokenizer) in {path}",
        flush=True,
    )


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
    from rlfabric.local.warm_start import run_reward_model_file, run_sft_file, warm_started
    from rlfabric.local.watch import Api, prepare_resume, summarize, watch

    options, spec = chosen.args, chosen.spec
    services = None
    try:
        if spec.mode == "sft":  # the learner alone (`local.warm_start`)
            return run_sft_file(stack, options, spec)
        if spec.mode == "reward_model":
            return run_reward_model_file(stack, options, spec)
        redis_url = start_redis(stack, options)
        action = prepare_resume(redis_url, spec.name) if chosen.resume else "submit"
        if action == "done":
            return 0
        spec = warm_started(stack, options, spec)  # the SFT run first, when the run has a warm start
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
