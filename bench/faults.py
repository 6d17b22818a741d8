"""Fault table: kill each service of a running `rlfabric up` and measure what the recovery cost.

    python bench/faults.py [--repeats 3] [--scenarios none learner replica reward coordinator redis
                                                      learner-hang replica-hang]
                           [--steps 10] [--fault-at-step 3] [--stall-timeout 30]
                           [--engine transformers|vllm] [--quick] [--output-dir bench/results]

Each run is a real `rlfabric up` (every service its own process on loopback) training the built-in demo
task with checkpoints every 2 steps. Once the learner has written step `--fault-at-step`, the scenario's
process is SIGKILLed (found by its command line among `up`'s descendants); `up` must bring it back
without a human, and the run must complete. The two `-hang` scenarios leave the process alive and stuck
instead (a failpoint that blocks, fired once: `RLFABRIC_FAILPOINTS_FIRED`): the learner after step
`--fault-at-step`, the replica while it holds a request at about that step. Its watchdog
(`stall_timeout_s`, set to `--stall-timeout` for the run) must end it, and `up` restart it. Afterwards
the run's Redis is reopened from its AOF and the books are reconciled (`rlfabric.tools.ledger`). Per run:

- recovery: seconds from the kill (or the hang) to the next step row the learner writes to
  metrics.jsonl. For a reward, coordinator or replica fault the learner may still hold groups queued
  before it, so this is the time until training went on, not the time until the service served again
  (`up`'s log has one line per restart). A hang's recovery includes the `--stall-timeout` it waited;
- prompts lost: groups with no outcome, entries acknowledged but never trained, prompts taken from the
  dataset but never recorded (must be 0);
- groups trained twice (must be 0);
- samples wasted: samples generated but never trained (a group's samples count as trained when the
  group did, as dropped when it was dropped with a reason), minus the median of the no-fault runs:
  what the crash cost in generation;
- dropped stale: groups the learner discarded as older than `max_staleness` (a crash should add none);
- survivors: processes of the run still alive after `up` exited (must be 0);
- run s: the whole `up` run's wall time; against `none`'s, what the fault cost the run (a replica's hang
  shows here: training goes on from queued groups at once, while the replica waits out its timeout).

`none` is the baseline run without a fault, measured in the same invocation. `--quick` runs `none` and
one learner kill on a 6-step run: it proves the code path, its figures mean nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Stats,
    base_parser,
    effective_repeats,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    report_results,
)

from rlfabric.runtime import failpoints

SCENARIOS = ("none", "learner", "replica", "reward", "coordinator", "redis", "learner-hang", "replica-hang")
RUN_ID = "faults"
REWARD_FILE = '''"""The demo's reward, as a function defined in a file of the run file's own folder (the
folder `up` allows): a name merely re-exported from another module is refused as that module's."""

from rlfabric.coordinator import demo


def letter_reward(prompts, completions, **columns):
    return demo.letter_reward(prompts, completions, **columns)
'''


def target_matcher(scenario: str) -> Callable[[list[str]], bool]:
    """Whether a process's command line is the scenario's service (the first one found is killed)."""
    if scenario == "redis":
        return lambda argv: bool(argv) and Path(argv[0]).name.startswith("redis-server")
    service = "rollout" if scenario == "replica" else scenario

    def is_service(argv: list[str]) -> bool:
        if "rlfabric.runtime.guard" in argv:  # the guard `up` runs it under: the service is the target
            return False
        return "serve" in argv and argv[argv.index("serve") + 1 : argv.index("serve") + 2] == [service]

    return is_service


@dataclass
class RunResult:
    """One run of one scenario."""

    scenario: str
    completed: bool
    exit_code: int | None
    wall_s: float
    recovery_s: float | None
    """Kill (or hang) to the next metrics.jsonl step row; None for `none` or when training never went on."""
    killed_pid: int | None
    prompts_lost: int
    trained_twice: int
    violations: list[str]
    outcomes: dict[str, int]
    samples_generated: int
    samples_accounted: int
    counters: dict[str, int]
    survivors: list[int]
    restarts_logged: int
    samples_wasted: float = 0.0
    notes: list[str] = field(default_factory=list)


def make_run_file(work: Path, steps: int) -> Path:
    """The demo spec with checkpoints every 2 steps and its reward loaded from the run file's folder."""
    from rlfabric.coordinator.demo import demo_spec

    spec = demo_spec(work, steps=steps)
    (work / "fault_reward.py").write_text(REWARD_FILE)
    data = json.loads(spec.model_dump_json())
    data["name"] = RUN_ID
    data["train"]["checkpoint_every"] = 2
    data["reward"]["params"]["function"] = f"{work / 'fault_reward.py'}:letter_reward"
    path = work / "run.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def step_rows(metrics: Path) -> list[dict[str, Any]]:
    """The learner's step rows so far (rows with an "event" are markers, not steps)."""
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "event" not in row and "step" in row:
            rows.append(row)
    return rows


def descendants(pid: int) -> list[Any]:
    import psutil

    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def find_target(up_pid: int, scenario: str) -> int | None:
    import psutil

    matches = target_matcher(scenario)
    for proc in descendants(up_pid):
        try:
            if matches(proc.cmdline()):
                return int(proc.pid)
        except psutil.Error:
            continue
    return None


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def inject(up: subprocess.Popen[bytes], scenario: str, metrics: Path, fault_at: int) -> tuple[int, float]:
    """Waits for step `fault_at`, SIGKILLs the scenario's process; returns its pid and the kill time."""
    if not wait_until(lambda: len(step_rows(metrics)) >= fault_at or up.poll() is not None, 900):
        raise RuntimeError(f"step {fault_at} never came")
    pid = find_target(up.pid, scenario)
    if pid is None:
        raise RuntimeError(f"no {scenario} process among up's descendants")
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    return pid, killed_at


def recovery_time(metrics: Path, rows_before: int, killed_at: float) -> float | None:
    """Seconds from the kill to the first step row written after it (by the row's own time)."""
    rows = step_rows(metrics)[rows_before:]
    times = [float(r["time"]) for r in rows if isinstance(r.get("time"), int | float)]
    later = [t for t in times if t >= killed_at]
    return min(later) - killed_at if later else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def audit(run_dir: Path) -> dict[str, Any]:
    """Reopens the run's Redis from its AOF and reconciles the books."""
    import redis

    from rlfabric.tools import ledger

    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(run_dir / "redis")]
    server = subprocess.Popen(
        [*argv, "--appendonly", "yes", "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    client = redis.Redis(port=port)
    try:
        wait_until(lambda: _pings(client), 30)
        run = run_dir / RUN_ID
        books = ledger.read_books(client, RUN_ID, run / "checkpoints", weights_root=str(run / "weights"))
        result = ledger.reconcile(books)
        return {"books": books, "ledger": result}
    finally:
        client.close()
        server.terminate()
        server.wait(10)


def _pings(client: Any) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


LOST = re.compile(r"has 0 outcomes|acknowledged but never trained|never recorded|missing from the stream")
TWICE = re.compile(r"trained (\d+) times")


def books_figures(audited: dict[str, Any], group_size: int) -> dict[str, Any]:
    """Prompts lost, groups trained twice and samples generated / accounted for, from the ledger."""
    books, result = audited["books"], audited["ledger"]
    counts = result.count()
    no_outcome = sum(1 for found in result.outcomes.values() if not found)
    lost = no_outcome + sum(1 for v in result.violations if LOST.search(v))
    twice = sum(int(m.group(1)) - 1 for v in result.violations if (m := TWICE.search(v)))
    accounted = sum(n for outcome, n in counts.items() if outcome != "in_flight") * group_size
    return {
        "prompts_lost": lost,
        "trained_twice": twice,
        "violations": list(result.violations),
        "outcomes": dict(counts),
        "samples_generated": int(books.counters.get("samples_generated", 0)),
        "samples_accounted": accounted,
        "counters": {k: int(v) for k, v in books.counters.items()},
    }


HANG_POINTS = {
    "learner-hang": ("learner.after_step", "LEARNER"),
    "replica-hang": ("rollout.mid_generate", "ROLLOUT"),
}
"""A `-hang` scenario's blocking failpoint and the service section its watchdog timeout is set in."""


def hang_env(scenario: str, args: Any, fired: Path) -> dict[str, str]:
    """The environment that makes a `-hang` scenario's service hang once (empty for the others): a
    blocking failpoint, the folder that makes it fire once, and the service's watchdog timeout."""
    if scenario not in HANG_POINTS:
        return {}
    point, section = HANG_POINTS[scenario]
    nth = args.fault_at_step  # the learner: after that step; a replica: one hit per sample generated
    if section == "ROLLOUT":
        nth *= args.groups_per_step * args.group_size
    return {
        failpoints.ENV: f"{point}={nth}:hang",
        failpoints.FIRED_ENV: str(fired),
        f"RLFABRIC_{section}__STALL_TIMEOUT_S": str(args.stall_timeout),
    }


def run_once(scenario: str, args: Any, root: Path, index: int) -> RunResult:
    """One `rlfabric up` run with the scenario's fault; the run folder is removed unless --keep."""
    work = root / f"{scenario}-{index}"
    work.mkdir(parents=True)
    run_file = make_run_file(work, args.steps)
    run_dir = work / "up"
    argv = [sys.executable, "-m", "rlfabric.cli", "up", str(run_file), "--run-dir", str(run_dir)]
    argv += ["--engine", args.engine, "--no-progress"]
    log = (work / "up.log").open("wb")
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **hang_env(scenario, args, work / "fired")}
    up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    metrics = run_dir / RUN_ID / "metrics.jsonl"
    tree: set[int] = set()
    pid, killed_at, rows_before, notes = None, 0.0, 0, []
    try:
        if scenario != "none" and scenario not in HANG_POINTS:
            pid, killed_at = inject(up, scenario, metrics, args.fault_at_step)
            rows_before = len(step_rows(metrics))
        while up.poll() is None:
            tree |= {p.pid for p in descendants(up.pid)}
            time.sleep(0.5)
            if time.monotonic() - started > args.run_timeout:
                notes.append("timed out: up killed")
                up.send_signal(signal.SIGTERM)
                up.wait(60)
    except Exception as exc:  # a scenario that breaks is a result, not a crashed benchmark
        notes.append(f"{type(exc).__name__}: {exc}")
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    finally:
        log.close()
    wall = time.monotonic() - started
    recovery = None if pid is None else recovery_time(metrics, rows_before, killed_at)
    if scenario in HANG_POINTS:
        hung_at = failpoints.fired_at(work / "fired", HANG_POINTS[scenario][0])
        if hung_at is None:
            notes.append("the hang never fired")
        else:
            recovery = recovery_time(metrics, 0, hung_at)
    survivors = sorted(p for p in tree if _alive(p))
    text = (work / "up.log").read_text(errors="replace")
    figures = books_figures(audit(run_dir), args.group_size)
    result = RunResult(
        scenario=scenario,
        completed=up.returncode == 0,
        exit_code=up.returncode,
        wall_s=wall,
        recovery_s=recovery,
        killed_pid=pid,
        survivors=survivors,
        restarts_logged=len(re.findall(r"(?im)^.*restart", text)),
        notes=notes,
        **figures,
    )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def one_line(r: RunResult) -> str:
    return (
        f"completed={r.completed} recovery_s={r.recovery_s} lost={r.prompts_lost} "
        f"twice={r.trained_twice} survivors={len(r.survivors)} {' '.join(r.notes)}"
    )


def summarise(results: list[RunResult]) -> dict[str, Any]:
    """Per scenario: the figures over its runs; samples wasted relative to the no-fault runs."""
    baseline = [r.samples_generated - r.samples_accounted for r in results if r.scenario == "none"]
    base = statistics.median(baseline) if baseline else 0.0
    for r in results:
        r.samples_wasted = max(0.0, r.samples_generated - r.samples_accounted - base)
    table: dict[str, Any] = {}
    for scenario in dict.fromkeys(r.scenario for r in results):
        runs = [r for r in results if r.scenario == scenario]
        recoveries = [r.recovery_s for r in runs if r.recovery_s is not None]
        table[scenario] = {
            "runs": len(runs),
            "completed": sum(r.completed for r in runs),
            "recovery_s": Stats.of(recoveries, "s").to_dict() if recoveries else None,
            "prompts_lost": sum(r.prompts_lost for r in runs),
            "trained_twice": sum(r.trained_twice for r in runs),
            "violations": sum(len(r.violations) for r in runs),
            "samples_wasted": statistics.median(r.samples_wasted for r in runs),
            "dropped_stale": statistics.median(r.counters.get("dropped_stale", 0) for r in runs),
            "survivors": sum(len(r.survivors) for r in runs),
            "wall_s": statistics.median(r.wall_s for r in runs),
        }
    return table


def table_row(scenario: str, t: dict[str, Any]) -> list[Any]:
    rec = t["recovery_s"]
    if scenario == "none":
        recovery = "-"
    elif rec is None:
        recovery = "never"
    else:
        recovery = f"{fmt(rec['median'])} ({fmt(rec['min'])}..{fmt(rec['max'])})"
    counts = [t["prompts_lost"], t["trained_twice"], t["violations"]]
    wasted = [fmt(t["samples_wasted"]), fmt(t["dropped_stale"]), t["survivors"]]
    return [scenario, f"{t['completed']}/{t['runs']}", fmt(t["wall_s"]), recovery, *counts, *wasted]


def markdown(table: dict[str, Any], machine: dict[str, Any], args: Any) -> str:
    headers = [
        "fault (SIGKILL, or -hang)", "runs completed", "run s (median)", "recovery s (median, min..max)",
        "prompts lost", "trained twice", "ledger violations", "samples wasted (median)",
        "dropped stale (median)", "processes left",
    ]  # fmt: skip
    rows = [table_row(scenario, t) for scenario, t in table.items()]
    head = (
        f"## faults\n\n`rlfabric up --engine {args.engine}`, the demo task, {args.steps} steps of "
        f"{args.groups_per_step} groups x {args.group_size} samples, checkpoint every 2 steps; the kill (or "
        f"hang) at step {args.fault_at_step}; a hung service's `stall_timeout_s` {args.stall_timeout:g} s. "
        f"{machine_line(machine)}\n\n"
    )
    return head + markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(repeats=3)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--steps", type=int, default=10, help="learner steps per run (default 10)")
    parser.add_argument("--fault-at-step", type=int, default=3, help="kill after this step (default 3)")
    parser.add_argument("--stall-timeout", type=float, default=30,
                        help="the hung service's stall_timeout_s (default 30)")  # fmt: skip
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds per run before giving up")
    parser.add_argument("--keep", action="store_true", help="keep every run's folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.scenarios, args.steps, args.fault_at_step = ["none", "learner"], 6, 2
    args.group_size, args.groups_per_step = 8, 8  # the demo's
    machine = machine_info()
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="rlfabric-faults-") as tmp:
        root = Path(tmp) if not args.keep else Path(tempfile.mkdtemp(prefix="rlfabric-faults-keep-"))
        for index in range(effective_repeats(args)):
            for scenario in args.scenarios:
                print(f"[faults] repeat {index + 1}: {scenario} ...", flush=True)
                results.append(run_once(scenario, args, root, index))
                r = results[-1]
                print(f"[faults]   {one_line(r)}", flush=True)
    table = summarise(results)
    payload = {
        "quick": args.quick,
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "table": table,
        "runs": [asdict(r) for r in results],
    }
    report_results(args.output_dir, "faults", payload, markdown(table, machine, args))
    clean = all(
        t["prompts_lost"] == 0 and t["trained_twice"] == 0 and t["survivors"] == 0 for t in table.values()
    )
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
