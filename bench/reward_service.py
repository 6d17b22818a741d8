"""Benchmark: the reward service over gRPC against scoring in-process, at batch 64, in one run.

    python bench/reward_service.py [--quick] [--repeats 5] [--output-dir bench/results]

(a) `math_verify` (CPU-heavy, runs in the service's worker processes): in-process throughput of
    `safe_score_batch` on one thread against the service with workers=1 and workers=2, each fed
    2 x workers batches in flight; the figure of merit is the service's items/s per core used divided by
    the in-process items/s (goal ≥ 0.9), where the cores used are the workers plus the server process's
    own measured share (CPU seconds per wall second).
(b) `exact_match` (cheap, runs on the event loop of a server process): in-process items/s against the
    RPC driven by 8 and 32 concurrent calls (over up to 16 connections) of pre-built ScoreRequests on the
    raw asyncio stub, so the figure is the service's and not the client's proto conversion (goal ≥ 50,000
    items/s), on one server process and on two sharing the port (`processes=2`); p50/p99 per call.

The services (workers=1, workers=2 and processes=2) run side by side for the whole benchmark and every
repeat measures each configuration once, baseline included, so slow phases of a noisy machine hit them
alike.
Besides wall-clock rates, every measurement records the CPU seconds it cost (the baseline's thread; the
service's server process and workers): items per CPU-second is what the path costs whatever else the
machine is doing.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from _reward_items import exact_items, math_items
from _reward_report import plot, render_markdown
from common import (
    CpuSnapshot,
    Stats,
    base_parser,
    effective_repeats,
    fmt,
    machine_info,
    percentile,
    ratio,
    report_results,
)

from rlfabric.local.procs import ServiceProcess
from rlfabric.reward.client import build_request, to_spec
from rlfabric.reward.scorers import ScoreInput, Scorer, build_scorer, safe_score_batch
from rlfabric.v1 import common_pb2, reward_pb2, reward_pb2_grpc

NAME = "reward_service"
BATCH = 64
GOAL_RATIO_PER_CORE = 0.9
GOAL_EXACT_ITEMS_PER_S = 50_000.0
CALL_TIMEOUT_S = 300.0
TOKEN = "bench-reward-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
# The baseline thread must get at least this much of a core for wall-clock ratios to mean anything.
MIN_BASELINE_BUSY = 0.9
# Client connections the calls in flight are spread over (the kernel spreads connections, not calls, over
# the server processes of a `processes` > 1 service).
MAX_CONNECTIONS = 16
STATUS_NAMES = {
    common_pb2.REWARD_STATUS_OK: "ok",
    common_pb2.REWARD_STATUS_SCORER_ERROR: "scorer_error",
    common_pb2.REWARD_STATUS_TIMEOUT: "timeout",
}


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does. `quick` is for CI: every code path, tiny numbers."""

    math_items: int = 2048
    exact_items: int = 2048
    exact_seconds: float = 4.0
    concurrencies: tuple[int, ...] = (8, 32)
    workers: tuple[int, ...] = (1, 2)
    processes: tuple[int, ...] = (1, 2)

    @classmethod
    def for_run(cls, quick: bool) -> Sizes:
        return cls(128, 256, 0.3, (8,), (1, 2), (1, 2)) if quick else cls()


def batches(items: Sequence[ScoreInput], size: int = BATCH) -> list[list[ScoreInput]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def requests_for(items: Sequence[ScoreInput], scorer: str) -> list[reward_pb2.ScoreRequest]:
    """Pre-built ScoreRequests of BATCH items each, so a call costs the client no conversion."""
    return [build_request(batch, to_spec(scorer), None) for batch in batches(items)]


def mean_item_bytes(items: Sequence[ScoreInput]) -> float:
    """Mean serialized size of one ScoreItem."""
    request = build_request(items, to_spec("exact_match"), None)
    return sum(item.ByteSize() for item in request.items) / max(len(items), 1)


# ---------------------------------------------------------------- in-process baseline


@dataclass(frozen=True)
class Rate:
    """Items done in `wall_s` seconds using `cpu_s` CPU seconds."""

    items: int
    wall_s: float
    cpu_s: float

    @property
    def per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def per_cpu_s(self) -> float:
        return self.items / self.cpu_s if self.cpu_s > 0 else 0.0


def on_one_thread(work: Callable[[], int]) -> Rate:
    """Runs `work` (which returns the items it did) on a fresh non-main thread, as the service's workers
    do: off the main thread math-verify arms no signal-based timeouts, so this is the pure scoring cost."""
    box: list[Rate] = []

    def timed() -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        done = work()
        box.append(Rate(done, time.perf_counter() - wall, time.thread_time() - cpu))

    thread = threading.Thread(target=timed, name="bench-baseline")
    thread.start()
    thread.join()
    return box[0]


def in_process_pass(scorer: Scorer, work: list[list[ScoreInput]]) -> Rate:
    """`safe_score_batch` over every batch once, on one thread."""
    return on_one_thread(lambda: sum(len(safe_score_batch(scorer, batch)) for batch in work))


def in_process_for(scorer: Scorer, work: list[list[ScoreInput]], seconds: float) -> Rate:
    """`safe_score_batch` cycling over the batches for about `seconds`, on one thread."""

    def run() -> int:
        done, end = 0, time.perf_counter() + seconds
        for batch in itertools.cycle(work):
            done += len(safe_score_batch(scorer, batch))
            if time.perf_counter() >= end:
                return done
        return done

    return on_one_thread(run)


# ---------------------------------------------------------------- the service


@dataclass(frozen=True)
class Service:
    """A running reward service: where to call it and its PID (for its CPU use)."""

    address: str
    pid: int


@contextmanager
def reward_service(workers: int, log_dir: Path, processes: int = 1) -> Iterator[Service]:
    """A `rlfabric serve reward` process with `workers` scorer workers; with `processes` > 1, the
    supervisor of that many server processes (its children), `workers` shared out among them."""
    argv = [
        sys.executable, "-m", "rlfabric.cli", "serve", "reward", "--port", "0",
        "--set", f"workers={workers}", "--set", f"processes={processes}",
        "--set", "server.metrics_port=0", "--set", "log.format=text",
    ]  # fmt: skip
    name = f"reward-w{workers}-p{processes}"
    env = {**os.environ, "RLFABRIC_REWARD__TOKEN": TOKEN}  # as deployed: every call pays the token check
    proc = ServiceProcess(name, argv, log_path=log_dir / f"{name}.log", env=env)
    try:
        proc.start(r"metrics on http://\S+", timeout_s=120)
        address = proc.wait_for(r"listening on (\S+)", timeout_s=120).group(1)
        yield Service(address, proc.pid)
    finally:
        proc.stop()


@dataclass
class CallRun:
    """One drive of the service: items, wall seconds, one latency per call, item statuses, and the CPU
    seconds used meanwhile by the client, the server process and its workers."""

    items: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else 0.0

    @property
    def service_cpu_s(self) -> float:
        return self.cpu_s["server"] + self.cpu_s["workers"]


async def drive(
    address: str, requests: Sequence[reward_pb2.ScoreRequest], concurrency: int, seconds: float | None
) -> CallRun:
    """Keeps `concurrency` Score calls in flight: over every request once (`seconds` None), or cycling
    over them until `seconds` have passed. Times from ready channels to the last answer.

    The calls are spread over up to MAX_CONNECTIONS channels, each its own HTTP/2 connection (a local
    subchannel pool, else gRPC shares one connection between identical channels), as several trainer
    or rollout clients would be."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(address, options=options) for _ in range(min(concurrency, MAX_CONNECTIONS))
    ]
    try:
        await asyncio.gather(*(c.channel_ready() for c in channels))
        stubs = [reward_pb2_grpc.RewardServiceStub(c) for c in channels]
        source = itertools.cycle(requests) if seconds else iter(requests)
        run = CallRun()
        start = time.perf_counter()
        end = start + seconds if seconds else math.inf
        await asyncio.gather(*(_lane(stubs[i % len(stubs)], source, end, run) for i in range(concurrency)))
        run.seconds = time.perf_counter() - start
        return run
    finally:
        await asyncio.gather(*(c.close() for c in channels))


async def _lane(
    stub: reward_pb2_grpc.RewardServiceStub,
    source: Iterator[reward_pb2.ScoreRequest],
    end: float,
    run: CallRun,
) -> None:
    """One stream of back-to-back calls; lanes share `source` (safe: the event loop is one thread)."""
    for request in source:
        if time.perf_counter() >= end:
            return
        began = time.perf_counter()
        response = await stub.Score(request, timeout=CALL_TIMEOUT_S, metadata=AUTH)
        run.latencies_s.append(time.perf_counter() - began)
        run.items += len(response.results)
        run.statuses.update(STATUS_NAMES.get(r.reward.status, "unknown") for r in response.results)


def drive_sync(
    service: Service,
    requests: Sequence[reward_pb2.ScoreRequest],
    concurrency: int,
    seconds: float | None = None,
) -> CallRun:
    """`drive` on a fresh event loop, with the CPU seconds used meanwhile."""
    before = CpuSnapshot.take(service.pid)
    run = asyncio.run(drive(service.address, requests, concurrency, seconds))
    run.cpu_s = CpuSnapshot.take(service.pid).used_since(before)
    return run


# ---------------------------------------------------------------- measurements


@dataclass
class Series:
    """The repeats of one service configuration."""

    runs: list[CallRun] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        latencies = [s for run in self.runs for s in run.latencies_s]
        calls = len(latencies)
        service_cpu = sum(run.service_cpu_s for run in self.runs)
        return {
            "items_per_s": Stats.of([r.items_per_s for r in self.runs], "items/s").to_dict(),
            "items_per_service_cpu_s": Stats.of(
                [r.items / max(r.service_cpu_s, 1e-9) for r in self.runs], "items/CPU-s"
            ).to_dict(),
            "service_cpu_ms_per_call": 1000 * service_cpu / max(calls, 1),
            "cpu_us_per_item": cpu_per_item(self.runs),
            "cpu_cores": median_cores(self.runs),
            "latency_ms": latency_summary(latencies),
            "calls": calls,
            "statuses": dict(sum((r.statuses for r in self.runs), Counter())),
        }


def cpu_per_item(runs: Sequence[CallRun]) -> dict[str, float]:
    """CPU microseconds per scored item on each side, over all the runs."""
    items = max(sum(r.items for r in runs), 1)
    return {side: 1e6 * sum(r.cpu_s[side] for r in runs) / items for side in ("client", "server", "workers")}


def median_cores(runs: Sequence[CallRun]) -> dict[str, float]:
    """Median over the runs of the cores each side kept busy (CPU seconds per wall second)."""
    sides = ("client", "server", "workers")
    return {
        side: statistics.median(r.cpu_s[side] / max(r.cpu_s["wall"], 1e-9) for r in runs) for side in sides
    }


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in latencies_s]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms, default=math.nan)}


def baseline_summary(rates: Sequence[Rate]) -> dict[str, Any]:
    """The in-process repeats. `busy_cores` below MIN_BASELINE_BUSY means the machine was overloaded: the
    scoring thread did not even get its one core, and wall-clock ratios against it are not trustworthy."""
    busy = statistics.median(r.cpu_s / max(r.wall_s, 1e-9) for r in rates)
    return {
        "items_per_s": Stats.of([r.per_s for r in rates], "items/s").to_dict(),
        "items_per_cpu_s": Stats.of([r.per_cpu_s for r in rates], "items/CPU-s").to_dict(),
        "threads": 1,
        "busy_cores": busy,
        "wall_clock_reliable": busy >= MIN_BASELINE_BUSY,
    }


def bench_math(services: dict[int, Service], sizes: Sizes, repeats: int) -> dict[str, Any]:
    """(a): in-process vs the service at each worker count, interleaved repeat by repeat."""
    items = math_items(sizes.math_items, seed=1)
    scorer = build_scorer("math_verify", {})
    in_process_pass(scorer, batches(math_items(BATCH, seed=99)))  # imports, parser set-up
    requests = requests_for(items, "math_verify")
    warm = requests_for(math_items(BATCH * 4, seed=98), "math_verify")
    for workers, service in services.items():
        drive_sync(service, warm, 2 * workers)  # every worker builds its scorer
    baseline: list[Rate] = []
    series = {w: Series() for w in services}
    for r in range(repeats):
        baseline.append(in_process_pass(scorer, batches(items)))
        for workers, service in services.items():
            series[workers].runs.append(drive_sync(service, requests, 2 * workers))
        progress(f"math_verify {r + 1}/{repeats}", baseline[-1], series)
    return math_report(items, baseline, series)


def math_report(
    items: Sequence[ScoreInput], baseline: list[Rate], series: dict[int, Series]
) -> dict[str, Any]:
    base = baseline_summary(baseline)
    service = {}
    for workers, s in series.items():
        summary = s.summary()
        cores = workers + summary["cpu_cores"]["server"]
        per_core = ratio(summary["items_per_s"]["median"], cores * base["items_per_s"]["median"])
        paired = [
            ratio(run.items_per_s, (workers + run.cpu_s["server"] / max(run.cpu_s["wall"], 1e-9)) * b.per_s)
            for run, b in zip(s.runs, baseline, strict=True)
        ]
        summary |= {
            "workers": workers,
            "cores": cores,
            "in_flight": 2 * workers,
            "ratio_per_core": per_core,
            "ratio_per_core_paired": Stats.of(paired, "ratio").to_dict(),
            "ratio_per_cpu_s": ratio(
                summary["items_per_service_cpu_s"]["median"], base["items_per_cpu_s"]["median"]
            ),
            "goal_met": per_core >= GOAL_RATIO_PER_CORE,
        }
        service[f"workers={workers}"] = summary
    return {
        "items": len(items),
        "batch_size": BATCH,
        "mean_item_bytes": mean_item_bytes(items),
        "in_process": base,
        "service": service,
        "goal_ratio_per_core": GOAL_RATIO_PER_CORE,
    }


def bench_exact(services: dict[int, Service], sizes: Sizes, repeats: int) -> dict[str, Any]:
    """(b): in-process vs the RPC on each service (by server processes) at each concurrency, interleaved
    repeat by repeat."""
    items = exact_items(sizes.exact_items, seed=2)
    scorer = build_scorer("exact_match", {})
    work = batches(items)
    requests = requests_for(items, "exact_match")
    for service in services.values():
        drive_sync(service, requests, max(sizes.concurrencies), seconds=min(sizes.exact_seconds, 1.0))
    baseline: list[Rate] = []
    series = {(p, c): Series() for p in services for c in sizes.concurrencies}
    for r in range(repeats):
        baseline.append(in_process_for(scorer, work, sizes.exact_seconds))
        for (processes, concurrency), s in series.items():
            service = services[processes]
            s.runs.append(drive_sync(service, requests, concurrency, seconds=sizes.exact_seconds))
        progress(f"exact_match {r + 1}/{repeats}", baseline[-1], series)
    return exact_report(items, baseline, series)


def exact_report(
    items: Sequence[ScoreInput], baseline: list[Rate], series: dict[tuple[int, int], Series]
) -> dict[str, Any]:
    base = baseline_summary(baseline)
    service = {}
    for (processes, concurrency), s in series.items():
        summary = s.summary()
        summary |= {
            "processes": processes,
            "in_flight": concurrency,
            "vs_in_process": ratio(summary["items_per_s"]["median"], base["items_per_s"]["median"]),
            "goal_met": summary["items_per_s"]["median"] >= GOAL_EXACT_ITEMS_PER_S,
        }
        service[f"processes={processes}, in_flight={concurrency}"] = summary
    best = max(s["items_per_s"]["median"] for s in service.values())
    return {
        "items": len(items),
        "batch_size": BATCH,
        "mean_item_bytes": mean_item_bytes(items),
        "in_process": base,
        "service": service,
        "best_service_items_per_s": best,
        "goal_items_per_s": GOAL_EXACT_ITEMS_PER_S,
        "goal_met": best >= GOAL_EXACT_ITEMS_PER_S,
    }


def progress(label: str, baseline: Rate, series: dict[Any, Series]) -> None:
    rates = ", ".join(f"{k}: {fmt(s.runs[-1].items_per_s)}" for k, s in series.items())
    print(f"  {label}: in-process {fmt(baseline.per_s)} items/s; service {rates}", flush=True)


# ---------------------------------------------------------------- main


def run(sizes: Sizes, repeats: int, quick: bool) -> dict[str, Any]:
    """Starts one service per worker count, runs (a) and (b), stops the services."""
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="rlfabric-bench-") as logs, ExitStack() as stack:
        services = {w: stack.enter_context(reward_service(w, Path(logs))) for w in sizes.workers}
        by_processes = {1: services[min(services)]}
        for p in (p for p in sizes.processes if p > 1):
            by_processes[p] = stack.enter_context(reward_service(p, Path(logs), processes=p))
        print(f"services up: {services}, by server processes: {by_processes}", flush=True)
        math_result = bench_math(services, sizes, repeats)
        exact_result = bench_exact(by_processes, sizes, repeats)
    return {
        "name": NAME,
        "quick": quick,
        "repeats": repeats,
        "batch_size": BATCH,
        "machine": machine,
        "goals": {
            "math_verify_ratio_per_core": GOAL_RATIO_PER_CORE,
            "exact_match_items_per_s": GOAL_EXACT_ITEMS_PER_S,
        },
        "math_verify": math_result,
        "exact_match": exact_result,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = base_parser(__doc__.splitlines()[0]).parse_args(argv)
    result = run(Sizes.for_run(args.quick), effective_repeats(args), args.quick)
    markdown = render_markdown(result)
    report_results(args.output_dir, NAME, result, markdown, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
