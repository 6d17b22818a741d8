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
                 every ready line but the learner's. Each process runs under `rlfabric.runtime.guard` on a
                 port chosen here, so a restart reuses it
    3. submit    the run to the coordinator's REST API (which does not check it again: step 1 did), with
                 the run's API token, while the learner still
                 loads (the replicas generate the first groups from the base model meanwhile); then wait
                 for the learner, put every process under the supervisor and, once the run's first step
                 is trained, start the compiled twins
    4. watch     a progress bar (step, reward, KL, tokens/s) until the run ends or Ctrl-C stops it; a
                 service that dies is restarted with backoff (`supervisor`), a coordinator that does not
                 answer is waited for
    5. stop      every process (SIGTERM, then SIGKILL of its process group past the grace), print the
                 summary, plot

`up --resume RUN_DIR` repeats 2-5 for the run of an earlier `up` in RUN_DIR (stopped, or left running by a
crash): same options, run id, Redis data and credentials. The exit code is 0 only when the run completed;
nothing `up` started outlives it, even when it is killed (the guards see to that).

Several runs on one shared rollout fleet: `up --runs K` (the built-in demo K times, demo-1 .. demo-K, each
its prompts shuffled with its own seed) or `up RUN_FILE RUN_FILE ...`. Every run must publish LoRA
adapters (`--lora RANK` gives them all some); each gets `rollout.fleet` ("local" unless its run file names
one), and the same steps start one reward service (every run's functions allowed), `--replicas` replicas
following the fleet (an adapter slot per run), a learner per run and one coordinator; each run is
submitted, the watch prints one line per step per run, every run's summary follows, and the exit code is
0 only when all of them completed. With `--max-replicas` the local scaler follows the fleet's desired
replica count (summed over its runs, `keys.fleet_scaling`). `--resume` continues them together: the runs
that completed stay done, the others are resumed (or submitted, when the first `up` never submitted them)
on the fleet as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfabric.local.credentials import CredentialsError, for_run
from rlfabric.local.procs import ServiceStartError
from rlfabric.local.replicas import check_adapters
from rlfabric.local.services import Services, scale_policy, start_fleet_services, start_services
from rlfabric.local.stack import REDIS_READY, FleetRun, Stack, start_redis
from rlfabric.local.supervisor import Supervisor
from rlfabric.local.warm_start import WarmStartFailed

STATE_FILE = "up.json"
"""In the run directory: the options and run spec of the `up` that created it, read by `--resume`."""
SAVED_OPTIONS = (
    "run_file", "steps", "replicas", "min_replicas", "max_replicas", "scale_up_after", "scale_down_after",
    "learner_ranks", "redis_url", "engine", "compile", "eager_start", "stand_in", "replica_cores",
    "learner_cores", "learner_threads", "lora", "overrides",
)  # fmt: skip
"""The options `--resume` takes over from the first `up` of a run directory."""
LOCAL_FLEET = "local"
"""The fleet several runs of one `up` share unless their run files name one."""
SEVERAL_RUNS = "not supported for several runs"
"""How `up` refuses an option that takes one run."""


def load_spec(args: argparse.Namespace, run_dir: Path, *, demo_name: str = "demo", demo_seed: int = 0) -> Any:
    """The run file's spec (the built-in demo's, named `demo_name`, prompts shuffled with `demo_seed`,
    without one) with the options applied: `--set` first, then --lora and --steps."""
    from rlfabric.coordinator.demo import demo_spec
    from rlfabric.runspec import LoraSpec, RunSpec
    from rlfabric.runtime.config import load_config

    overrides = args.overrides
    if args.run_file:
        spec = load_config(RunSpec, path=args.run_file, overrides=overrides)
    else:
        steps = args.steps or 40
        spec = demo_spec(run_dir, steps=steps, lora_rank=args.lora, name=demo_name, seed=demo_seed)
        if overrides:
            base = (spec.model_dump(mode="json"), "the built-in demo")
            spec = load_config(RunSpec, base=base, overrides=overrides)
    updates: dict[str, Any] = {"output_dir": str(run_dir), "name": spec.name or f"run-{int(time.time())}"}
    if args.run_file and args.lora:
        lora = LoraSpec(rank=args.lora, alpha=2 * args.lora)
        spec = RunSpec.model_validate({**dict(spec), "model": spec.model.model_copy(update={"lora": lora})})
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
    """The options (this call's --no-progress kept) and run spec of the `up` that created RUN_DIR (a list
    of specs when it ran several runs on a fleet); FileNotFoundError when it holds no up.json."""
    from rlfabric.runspec import RunSpec

    state = json.loads((run_dir / STATE_FILE).read_text())
    options = argparse.Namespace(**{**vars(args), **state["options"]})
    if FLEET_STATE in state:
        options.run_file = None
        return options, [RunSpec.model_validate(spec) for spec in state[FLEET_STATE]]
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
    runs: list[FleetRun] = field(default_factory=list)
    """Several runs on one shared fleet (`spec` the first of them); empty for one run."""


def plan(args: argparse.Namespace) -> Plan:
    """The run directory, options and spec; ValueError (the message for the user) for bad options."""
    if args.resume is not None:
        if args.runs is not None or args.run_files or args.run_dir or args.overrides:
            raise ValueError(
                "--resume takes no run file, --runs, --run-dir or --set: it reuses those of the run(s)"
            )
        run_dir = args.resume.resolve()
        if not (run_dir / STATE_FILE).exists():
            raise ValueError(f"{run_dir} holds no {STATE_FILE}: not the run directory of an `rlfabric up`")
        options, spec = load_state(run_dir, args)
        scale_policy(options)
        if isinstance(spec, list):  # several runs on a fleet, their specs as joined then
            files = options.run_files or [None] * len(spec)  # each run's file: its folder's code and data
            runs = [FleetRun(one, file) for one, file in zip(spec, files, strict=True)]
            return Plan(run_dir, options, spec[0], resume=True, runs=runs)
        return Plan(run_dir, options, spec, resume=True)
    if args.runs is not None or len(args.run_files) > 1:
        return plan_fleet(args)
    run_dir = fresh_run_dir(args)
    scale_policy(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = load_spec(args, run_dir)
    check_adapters(args, spec)
    make_tiny_model_if_missing(spec)
    check_run(spec, args.run_file)
    save_state(run_dir, args, spec)
    return Plan(run_dir, args, spec, resume=False)


def fresh_run_dir(args: argparse.Namespace) -> Path:
    """`--run-dir` (default runs/<time>), resolved; ValueError when an earlier `up` used it."""
    run_dir = (args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    if (run_dir / STATE_FILE).exists():
        raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir}")
    return run_dir


FLEET_STATE = "runs"
"""In up.json of several runs: their specs, joined to the fleet (what `--resume` starts them from)."""


def plan_fleet(args: argparse.Namespace) -> Plan:
    """Several runs on one shared fleet: each spec loaded, joined to the fleet and checked."""
    check_fleet_options(args)
    run_dir = fresh_run_dir(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    runs = join_fleet(load_fleet_runs(args, run_dir))
    for run in runs:
        check_adapters(args, run.spec)
        make_tiny_model_if_missing(run.spec)
        check_run(run.spec, run.run_file)
    save_fleet_state(run_dir, args, runs)
    return Plan(run_dir, args, runs[0].spec, resume=False, runs=runs)


def check_fleet_options(args: argparse.Namespace) -> None:
    """ValueError for options several runs cannot take."""
    if args.runs is not None and args.run_files:
        raise ValueError("--runs K runs the built-in demo K times: give run files or --runs, not both")
    if args.runs is not None and args.runs < 2:
        raise ValueError(f"--runs needs 2 or more runs, got {args.runs} (one run: leave --runs out)")
    scale_policy(args)
    if args.runs is not None and args.lora is None:
        raise ValueError(NO_ADAPTER.format(run="the demo"))


NO_ADAPTER = (
    "model.lora: {run} trains no LoRA adapter published alone, which runs sharing a rollout fleet need"
    " (set model.lora, or pass --lora RANK)"
)


def load_fleet_runs(args: argparse.Namespace, run_dir: Path) -> list[FleetRun]:
    """Each run's spec with the options applied: demo-1 .. demo-K (prompt seeds 0 .. K-1), or each run
    file's."""
    if args.runs is not None:
        demo = argparse.Namespace(**{**vars(args), "run_file": None})
        specs = [load_spec(demo, run_dir, demo_name=f"demo-{i + 1}", demo_seed=i) for i in range(args.runs)]
        return [FleetRun(spec, None) for spec in specs]
    runs = []
    for run_file in args.run_files:
        spec = load_spec(argparse.Namespace(**{**vars(args), "run_file": run_file}), run_dir)
        runs.append(FleetRun(spec, run_file))
    return runs


def join_fleet(runs: list[FleetRun]) -> list[FleetRun]:
    """The runs with `rollout.fleet` set (the one their run files name, else "local") and their weights
    root explicit; ValueError naming the field when they cannot share one fleet."""
    from rlfabric.runspec import RunSpec

    specs = [run.spec for run in runs]
    for spec in specs:
        check_fleet_run(spec)
    check_shared(specs, "name", lambda spec: spec.name, same=False)
    check_shared(specs, "model.path", lambda spec: str(Path(spec.model.path).resolve()), same=True)
    named = {spec.rollout.fleet for spec in specs} - {None}
    if len(named) > 1:
        raise ValueError(f"rollout.fleet: the runs name different fleets ({', '.join(sorted(named))})")
    fleet = named.pop() if named else LOCAL_FLEET
    joined = []
    for run in runs:
        spec = run.spec
        updates = {
            "rollout": spec.rollout.model_copy(update={"fleet": fleet}),
            "weights": spec.weights.model_copy(update={"url": spec.weights_root()}),
        }
        joined.append(FleetRun(RunSpec.model_validate({**dict(spec), **updates}), run.run_file))
    return joined


def check_fleet_run(spec: Any) -> None:
    """ValueError naming the field that keeps one run off a shared fleet."""
    if spec.model.published_adapter is None:
        raise ValueError(NO_ADAPTER.format(run=f"run {spec.name}"))
    unshared = {
        "mode": spec.mode != "online",
        "environment": spec.environment is not None,
        "warm_start": spec.warm_start is not None,
    }
    for name, found in unshared.items():
        if found:
            raise ValueError(f"{name}: run {spec.name}: only single-turn online runs without a warm start"
                             f" share a fleet in `up`")  # fmt: skip


def check_shared(specs: list[Any], name: str, value: Any, *, same: bool) -> None:
    """ValueError naming field `name` unless `value(spec)` is the same for every run (`same`) or
    different for each."""
    values = [value(spec) for spec in specs]
    if (len(set(values)) == 1) if same else (len(set(values)) == len(values)):
        return
    wanted = "the same base model (one fleet serves one)" if same else "a different name each"
    raise ValueError(f"{name}: runs sharing a fleet need {wanted}; got {', '.join(map(str, values))}")


def save_fleet_state(run_dir: Path, args: argparse.Namespace, runs: list[FleetRun]) -> None:
    """RUN_DIR/up.json of several runs: the options and every run's spec, joined (for `--resume`)."""
    options = {name: getattr(args, name) for name in SAVED_OPTIONS if name != "run_file"}
    options["run_files"] = [str(Path(f).resolve()) for f in args.run_files]
    options["runs"] = args.runs
    specs = [json.loads(run.spec.model_dump_json()) for run in runs]
    (run_dir / STATE_FILE).write_text(json.dumps({"options": options, FLEET_STATE: specs}, indent=2))


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
    bring = bring_up_fleet if chosen.runs else bring_up
    try:
        return bring(chosen, Stack(chosen.run_dir, credentials), Supervisor())
    except (ServiceStartError, WarmStartFailed) as exc:  # everything stopped; the message names the log
        print(f"rlfabric up: {exc}", file=sys.stderr)
        return 1


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
        api = Api(services.url, stack.credentials.api if stack.credentials else "")
        try:  # before the learner is ready: the replicas generate the first groups while it loads
            announce(api, spec, chosen.run_dir, submit=action == "submit")
        except RunRefused as exc:
            print(f"rlfabric up: {exc}", file=sys.stderr)
            return 2
        supervise(stack, services, supervisor, first_step_done(api.url, api.token, spec.name))
        status = watch(api, spec.name, spec.train.steps, progress=not options.no_progress,
                       supervisor=supervisor, scaler=services.scaler)  # fmt: skip
        if status.get("state") in (RunState.COMPLETED, RunState.STOPPED):
            services.let_learners_finish()
    finally:
        supervisor.close()
        stack.stop()
    summarize(status, chosen.run_dir, spec.name, services.scaler, supervisor)
    return 0 if status.get("state") == RunState.COMPLETED else 1


def first_step_done(url: str, token: str, run_id: str) -> Callable[[], bool]:
    """Whether the run has trained its first step (asked of the coordinator; false while it does not
    answer): the compiled twins start then, not beside the first generation and the learner's load, which
    they slowed on a small machine."""
    import httpx

    from rlfabric.local.watch import Api

    api = Api(url, token, timeout_s=5.0)

    def done() -> bool:
        try:
            return int(api.status(run_id).get("step") or 0) >= 1
        except (httpx.HTTPError, ValueError):  # a coordinator restarting is asked again
            return False

    return done


def supervise(
    stack: Stack, services: Services, supervisor: Supervisor, twins_after: Callable[[], bool] | None = None
) -> None:
    """Waits for the learners still starting, then puts Redis (unless --redis-url) and every service under
    the supervisor (a learner that exits 0 has finished and is not restarted) and starts the compiled
    twins once `twins_after()` is true (at once without it)."""
    services.wait_for_learners(stack)
    redis = [(proc, REDIS_READY) for proc in stack.procs if proc.name == "redis"]
    for proc, ready in redis + services.supervised:
        learner = any(proc is learner for learner in services.learners)
        supervisor.watch(proc, ready, restart_clean_exit=not learner)
    if services.scaler is not None:
        services.scaler.supervisor = supervisor
    for handoff in services.handoffs:
        handoff.begin(supervisor, services.scaler, twins_after)


def bring_up_fleet(chosen: Plan, stack: Stack, supervisor: Supervisor) -> int:
    """Steps 2-5 for several runs on one shared fleet; the exit code (0 only when every run completed)."""
    from rlfabric.coordinator.runs import RunState
    from rlfabric.local.watch import Api, FleetSignal, prepare_resume, summarize, watch_runs

    signal = None
    try:
        redis_url = start_redis(stack, chosen.args)
        actions = {run.spec.name: "submit" for run in chosen.runs}
        if chosen.resume:  # runs that completed stay done; the others are submitted or resumed
            actions = {name: prepare_resume(redis_url, name) for name in actions}
        runs = [run for run in chosen.runs if actions[run.spec.name] != "done"]
        if not runs:
            return 0
        names = [run.spec.name for run in runs]
        policy = scale_policy(chosen.args)
        services = start_fleet_services(stack, chosen.args, runs, redis_url, policy)
        supervise(stack, services, supervisor)
        api = Api(services.url, stack.credentials.api if stack.credentials else "")
        try:
            for run in runs:
                submit = actions[run.spec.name] == "submit"
                announce(api, run.spec, chosen.run_dir, submit=submit, token=run is runs[-1])
        except RunRefused as exc:
            print(f"rlfabric up: {exc}", file=sys.stderr)
            return 2
        if services.scaler is not None:
            signal = FleetSignal(redis_url, chosen.spec.rollout.fleet)
        statuses = watch_runs(api, names, supervisor=supervisor, scaler=services.scaler, signal=signal)
        if all(status.get("state") in (RunState.COMPLETED, RunState.STOPPED) for status in statuses.values()):
            services.let_learners_finish()
    finally:
        supervisor.close()
        stack.stop()
        if signal is not None:
            signal.close()
    for name in names:
        last = name == names[-1]  # the processes' restarts and the scaling are the fleet's: said once
        summarize(statuses[name], chosen.run_dir, name, services.scaler if last else None,
                  supervisor if last else None)  # fmt: skip
    return 0 if all(status.get("state") == RunState.COMPLETED for status in statuses.values()) else 1


def announce(api: Any, spec: Any, run_dir: Path, *, submit: bool, token: bool = True) -> None:
    """Submits the run unless the coordinator resumes it; prints the API token once, with the
    submission (`token`), on a terminal only: printed to a pipe or a file it would end in logs (a CI job's
    output), so there `up` points at the credentials file, as it does for a resumed run."""
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
    if token and sys.stdout.isatty():
        print(f"API token (also in {credentials}, mode 0600): {api.token}", flush=True)
    elif token:
        print(f"API token: in {credentials} (mode 0600; printed only to a terminal)", flush=True)
