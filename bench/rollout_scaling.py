"""Rollout scaling: one vs two rollout replicas on the same cores; one replica's cost as the load grows.

Three replicas (`rlfabric serve rollout`, real processes on loopback ports) serve the same model for the
whole run, each with its vLLM OpenMP threads bound deliberately (`VLLM_CPU_OMP_THREADS_BIND`, no core
reserved): `r01` on cores 0-1, `r0` on core 0, `r1` on core 1. On a 2-core machine "2 replicas" thus
means one replica's model worker per core against one worker spanning both. The binding covers the
worker's OpenMP threads only: each replica's gRPC front end and vLLM engine-core processes may run on
either core. vLLM's engine keeps polling for about a second after its last request, so every drive
starts once the replicas are quiet; each drive measures every replica tree's CPU seconds (idle: ~0).

(a) Replicas. The same load, G groups (one token-id prompt with n samples each, one `Generate` per group,
as the coordinator sends them), goes to `r01` alone and to `r0` + `r1` together, alternately repeat by
repeat. The client keeps at most S groups in flight per replica (the coordinator's
`max_in_flight_per_replica`): each replica's S streams take the next waiting group as soon as theirs
finishes, so the groups spread least-in-flight first. Reported: generated tokens/s, samples/s and their
ratio 2 replicas / 1 replica.

(b) Cost curve, on `r01`: tokens/s, seconds per group (wall time / groups) and a group's latency (its
request until its last sample) at each max_tokens with the base n, and at each n with the base max_tokens;
every cell once per repeat, in rotating order; ratios against the base cell of the same repeat.

Sampling is at temperature 1 and unseeded (see bench/rollout_service.py: seeded requests kill vLLM 0.32's
CPU engine when a prefill is chunked) and with `ignore_eos`, so every completion is max_tokens long
(a random-init model would otherwise stop at end-of-sequence early); every figure counts the tokens
actually generated, and the tables give the mean completion length of each cell.

vLLM runs eager unless `--compiled`; `--quick` runs the `tiny` model on the transformers reference engine
(`--engine vllm` to run vLLM anyway), which ignores the OpenMP binding. Replica logs are kept in
`$TMPDIR/rlfabric-bench-rollout-logs-<uid>/rollout-scaling-<replica>.log`.

Usage: python bench/rollout_scaling.py [--quick] [--repeats K] [--output-dir DIR] [--compiled]
       [--engine vllm|transformers]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from common import (
    Bar,
    Stats,
    bar_plot,
    base_parser,
    child_pids,
    cpu_seconds,
    effective_repeats,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    ratio,
    report_results,
)
from rollout_service import (
    Load,
    cell,
    generate_request,
    make_model,
    make_prompts,
    run_service,
    start_replica,
    vllm_env,
)

NAME = "rollout_scaling"
BINDINGS = {"r01": "0-1", "r0": "0", "r1": "1"}
"""Each replica's OpenMP cores (`VLLM_CPU_OMP_THREADS_BIND`)."""
CONFIGS = {"1 replica": ("r01",), "2 replicas": ("r0", "r1")}
"""(a)'s configurations: the replicas that share the load."""
CURVE_REPLICA = "r01"
QUIET_CORES = 0.1
"""Replicas using less than this together count as idle (see `settle`)."""


@dataclass(frozen=True)
class Plan:
    """Sizes of a run. `load` is (a)'s repeat (`load.prompts` groups of `load.n` samples, up to
    `load.max_tokens` tokens each) and the replicas' engine settings; (b)'s base cell is (`load.max_tokens`,
    `load.n`), which `lengths` and `group_sizes` both contain."""

    load: Load
    streams: int
    """Groups in flight per replica."""
    lengths: tuple[int, ...]
    """(b): max_tokens at n = load.n."""
    group_sizes: tuple[int, ...]
    """(b): n at max_tokens = load.max_tokens."""
    curve_groups: int
    """(b): groups per cell, all in flight at once."""

    def cells(self) -> list[tuple[int, int]]:
        """(b)'s (max_tokens, n) cells, the base one once."""
        cells = [(length, self.load.n) for length in self.lengths]
        return cells + [(self.load.max_tokens, n) for n in self.group_sizes if n != self.load.n]


FULL = Plan(
    Load("bench", 32, 8, 128, 16, 32, kv_cache_bytes=1 << 30, max_model_len=512, eager=True),
    streams=8, lengths=(64, 128, 256), group_sizes=(4, 8, 16), curve_groups=8,
)  # fmt: skip
QUICK = Plan(
    Load("tiny", 4, 2, 8, 8, 16, kv_cache_bytes=256 << 20, max_model_len=128, eager=True),
    streams=2, lengths=(4, 8), group_sizes=(2, 4), curve_groups=2,
)  # fmt: skip


# --- the replicas ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    """A started replica: its name in BINDINGS, its process (a `ServiceProcess`) and gRPC address."""

    name: str
    proc: Any
    address: str


def replica_env(name: str, engine: str, scratch: Path, eager: bool) -> dict[str, str]:
    """rollout_service's vLLM environment with this replica's binding; engine and id through the config's
    environment layer."""
    return {
        **vllm_env(scratch, eager),
        "VLLM_CPU_OMP_THREADS_BIND": BINDINGS[name],
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "RLFABRIC_ROLLOUT__ENGINE__KIND": engine,
        "RLFABRIC_ROLLOUT__REPLICA_ID": name,
    }


def start_one(name: str, model: Path, load: Load, engine: str, workdir: Path) -> Replica:
    """One replica; its model folder is a link named after it, so that its log file is its own."""
    link = workdir / f"scaling-{name}"
    link.symlink_to(model, target_is_directory=True)
    env = replica_env(name, engine, workdir, load.eager)
    proc, address = start_replica(link, load, workdir / f"weights-{name}", env)
    return Replica(name, proc, address)


@contextlib.contextmanager
def replicas(model: Path, load: Load, engine: str, workdir: Path) -> Iterator[dict[str, Replica]]:
    """Every replica of BINDINGS, started together; all that started are stopped (by PID) at the end."""
    with ThreadPoolExecutor(len(BINDINGS)) as pool:
        futures = {name: pool.submit(start_one, name, model, load, engine, workdir) for name in BINDINGS}
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for future in futures.values():
            future.result()  # raises the first start failure, once the started ones are known
        yield started
    finally:
        for replica in started.values():
            replica.proc.stop(grace_s=60)


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its live descendants (the engine processes a replica spawns)."""
    return (cpu_seconds(pid) or 0.0) + sum(tree_cpu(child) for child in child_pids(pid))


def cpu_now(pool: dict[str, Replica]) -> dict[str, float]:
    return {**{name: tree_cpu(r.proc.pid) for name, r in pool.items()}, "client": time.process_time()}


async def settle(pool: dict[str, Replica], timeout_s: float = 30.0) -> float:
    """Waits until the replicas together use under QUIET_CORES over a quarter second; returns the seconds
    waited. vLLM's engine keeps polling, a core busy, for about a second after its last request: without
    this, that spin would land in the next drive, on the cores of the replicas measured there."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        before = sum(tree_cpu(r.proc.pid) for r in pool.values())
        await asyncio.sleep(0.25)
        if sum(tree_cpu(r.proc.pid) for r in pool.values()) - before < QUIET_CORES * 0.25:
            break
    return time.perf_counter() - start


# --- driving a load --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drive:
    """One load sent to some replicas: totals, wall seconds, each group's latency, which replica served
    how many groups; the CPU seconds of every replica's process tree and of this client over `cpu_window_s`
    (the drive and the reading of the counters around it); the seconds waited for quiet replicas first."""

    groups: int
    samples: int
    tokens: int
    wall_s: float
    group_s: list[float]
    groups_per_replica: dict[str, int]
    cpu_s: dict[str, float]
    cpu_window_s: float
    settle_s: float

    def figures(self) -> dict[str, float]:
        return {
            "tokens_per_s": self.tokens / self.wall_s,
            "samples_per_s": self.samples / self.wall_s,
            "seconds_per_group": self.wall_s / self.groups,
            "group_latency_s": statistics.median(self.group_s),
            "mean_completion": self.tokens / self.samples,
        }


async def drive(stubs: dict[str, Any], pool: dict[str, Replica], requests: list[Any], streams: int) -> Drive:
    """Sends `requests` (one group each) over `stubs`, at most `streams` in flight per replica, once every
    replica of `pool` is quiet."""
    waiting = list(reversed(requests))
    served = dict.fromkeys(stubs, 0)
    results: list[tuple[int, float]] = []

    async def stream(name: str) -> None:
        while waiting:
            request = waiting.pop()
            served[name] += 1
            results.append(await run_service(stubs[name], request))

    settled = await settle(pool)
    opened = time.perf_counter()
    before, start = cpu_now(pool), time.perf_counter()
    await asyncio.gather(*(stream(name) for name in stubs for _ in range(streams)))
    wall, after = time.perf_counter() - start, cpu_now(pool)
    samples = sum(r.sampling.n * len(r.prompts) for r in requests)
    return Drive(
        len(requests), samples, sum(t for t, _ in results), wall, [s for _, s in results], served,
        {name: after[name] - before[name] for name in after}, time.perf_counter() - opened, settled,
    )  # fmt: skip


def group_requests(tag: str, load: Load) -> list[Any]:
    """`load.prompts` one-prompt requests (the same prompts every time: make_prompts is seeded), each
    sampled to exactly max_tokens (`ignore_eos`), so that every cell does the work its label says."""
    from rlfabric.tools.tiny_model import PRESETS

    prompts = make_prompts(load, PRESETS[load.preset].vocab_size)
    requests = [generate_request(f"{tag}-g{i}", [p], load) for i, p in enumerate(prompts)]
    for request in requests:
        request.sampling.ignore_eos = True
    return requests


# --- (a) replicas and (b) the cost curve -----------------------------------------------------------------


async def measure(plan: Plan, pool: dict[str, Replica], repeats: int) -> dict[str, Any]:
    """One warm-up round each, then `repeats` rounds of (a), then of (b)."""
    import grpc

    from rlfabric.v1 import rollout_pb2_grpc

    channels = {name: grpc.aio.insecure_channel(r.address) for name, r in pool.items()}
    try:
        stubs = {name: rollout_pb2_grpc.RolloutServiceStub(ch) for name, ch in channels.items()}
        scaling = await measure_replicas(plan, pool, stubs, repeats)
        cost = await measure_cost(plan, pool, stubs, repeats)
    finally:
        await asyncio.gather(*(ch.close() for ch in channels.values()))
    return {"replicas": scaling, "cost": cost}


async def measure_replicas(
    plan: Plan, pool: dict[str, Replica], stubs: dict[str, Any], repeats: int
) -> dict[str, Any]:
    runs: dict[str, list[Drive]] = {config: [] for config in CONFIGS}
    for i in range(repeats + 1):
        for config in list(CONFIGS) if i % 2 == 0 else list(reversed(CONFIGS)):
            config_stubs = {name: stubs[name] for name in CONFIGS[config]}
            result = await drive(config_stubs, pool, group_requests(f"a{i}", plan.load), plan.streams)
            print(f"(a) {round_label(i)}, {config}: {result.figures()}", flush=True)
            if i > 0:
                runs[config].append(result)
    return summarise_replicas(runs)


async def measure_cost(
    plan: Plan, pool: dict[str, Replica], stubs: dict[str, Any], repeats: int
) -> dict[str, Any]:
    cells = plan.cells()
    runs: dict[tuple[int, int], list[Drive]] = {c: [] for c in cells}
    curve_stub = {CURVE_REPLICA: stubs[CURVE_REPLICA]}
    for i in range(repeats + 1):
        for max_tokens, n in cells[i % len(cells) :] + cells[: i % len(cells)]:
            load = replace(plan.load, prompts=plan.curve_groups, max_tokens=max_tokens, n=n)
            result = await drive(curve_stub, pool, group_requests(f"b{i}", load), plan.curve_groups)
            print(f"(b) {round_label(i)}, max_tokens {max_tokens}, n {n}: {result.figures()}", flush=True)
            if i > 0:
                runs[max_tokens, n].append(result)
    return summarise_cost(runs, base=(plan.load.max_tokens, plan.load.n))


def round_label(i: int) -> str:
    return "warm-up round" if i == 0 else f"round {i}"


def stats(drives: list[Drive], key: str, unit: str) -> dict[str, Any]:
    return Stats.of([d.figures()[key] for d in drives], unit).to_dict()


def cores(drives: list[Drive], names: Sequence[str]) -> dict[str, Any]:
    """Cores the named processes kept busy (CPU seconds per wall second), over the repeats."""
    return Stats.of([sum(d.cpu_s[n] for n in names) / d.cpu_window_s for d in drives], "cores").to_dict()


def summary(drives: list[Drive]) -> dict[str, Any]:
    units = {
        "tokens_per_s": "tokens/s", "samples_per_s": "samples/s", "seconds_per_group": "s",
        "group_latency_s": "s", "mean_completion": "tokens",
    }  # fmt: skip
    return {key: stats(drives, key, unit) for key, unit in units.items()}


def per_repeat_ratio(drives: list[Drive], base: list[Drive], key: str) -> dict[str, Any]:
    values = [ratio(d.figures()[key], b.figures()[key]) for d, b in zip(drives, base, strict=True)]
    return Stats.of(values, "x").to_dict()


def summarise_replicas(runs: dict[str, list[Drive]]) -> dict[str, Any]:
    configs: dict[str, Any] = {}
    for config, drives in runs.items():
        serving = CONFIGS[config]
        idle = [name for name in BINDINGS if name not in serving]
        configs[config] = {
            "replicas": {name: BINDINGS[name] for name in serving},
            **summary(drives),
            "replica_cores": cores(drives, serving),
            "idle_replica_cores": cores(drives, idle),
            "client_cores": cores(drives, ["client"]),
            "runs": [asdict(d) for d in drives],
        }
    one, two = (configs[config] for config in CONFIGS)
    return {
        "configs": configs,
        "ratio_tokens_per_s": ratio(two["tokens_per_s"]["median"], one["tokens_per_s"]["median"]),
        "ratio_samples_per_s": ratio(two["samples_per_s"]["median"], one["samples_per_s"]["median"]),
        "ratio_tokens_per_s_per_repeat": per_repeat_ratio(
            runs["2 replicas"], runs["1 replica"], "tokens_per_s"
        ),
    }


def summarise_cost(runs: dict[tuple[int, int], list[Drive]], base: tuple[int, int]) -> dict[str, Any]:
    cells = []
    for (max_tokens, n), drives in runs.items():
        cells.append({
            "max_tokens": max_tokens, "n": n, "base": (max_tokens, n) == base, **summary(drives),
            "tokens_per_s_vs_base": per_repeat_ratio(drives, runs[base], "tokens_per_s"),
            "seconds_per_group_vs_base": per_repeat_ratio(drives, runs[base], "seconds_per_group"),
            "replica_cores": cores(drives, [CURVE_REPLICA]),
            "runs": [asdict(d) for d in drives],
        })  # fmt: skip
    return {"replica": CURVE_REPLICA, "base": {"max_tokens": base[0], "n": base[1]}, "cells": cells}


# --- the run and its report ------------------------------------------------------------------------------


def run(plan: Plan, engine: str, repeats: int, workdir: Path) -> dict[str, Any]:
    model = make_model(plan.load.preset, workdir / f"model-{plan.load.preset}")
    with replicas(model, plan.load, engine, workdir) as pool:
        return asyncio.run(measure(plan, pool, repeats))


def binding_note(engine: str) -> str:
    if engine == "vllm":
        return (
            "each replica's model worker bound to the cores shown (`VLLM_CPU_OMP_THREADS_BIND`, no core "
            "reserved), its gRPC front end and engine-core processes unbound"
        )
    return "transformers engine: the OpenMP binding shown does not apply (torch threads unbound)"


def replicas_section(payload: dict[str, Any]) -> list[str]:
    plan, result = payload["plan"], payload["result"]["replicas"]
    load = plan["load"]
    rows = []
    for config, c in result["configs"].items():
        binding = ", ".join(f"{name}: {cores}" for name, cores in c["replicas"].items())
        rows.append([
            config, binding, cell(c["tokens_per_s"]), cell(c["samples_per_s"]),
            fmt(c["mean_completion"]["median"]), fmt(c["replica_cores"]["median"]),
            fmt(c["idle_replica_cores"]["median"]), fmt(c["client_cores"]["median"]),
        ])  # fmt: skip
    headers = [
        "", "replica: OpenMP cores", "tokens/s", "samples/s", "mean completion (tokens)",
        "busy cores: serving", "idle replicas", "client",
    ]  # fmt: skip
    return [
        f"### (a) 1 vs 2 replicas\n\nOne repeat = {load['prompts']} groups (one token-id prompt of "
        f"{load['prompt_min']}..{load['prompt_max']} tokens, n={load['n']} samples, max_tokens "
        f"{load['max_tokens']}; one `Generate` each), at most {plan['streams']} groups in flight per "
        f"replica, spread least-in-flight first; {binding_note(payload['engine'])}. Median (min..max) of "
        f"{payload['repeats']} alternating repeats after one warm-up each.",
        markdown_table(headers, rows),
        f"2 replicas / 1 replica: tokens/s **{fmt(result['ratio_tokens_per_s'])}** (per-repeat ratios "
        f"{cell(result['ratio_tokens_per_s_per_repeat'])}), samples/s {fmt(result['ratio_samples_per_s'])}.",
    ]


def cost_row(c: dict[str, Any]) -> list[Any]:
    return [
        c["max_tokens"], f"{c['n']} (base)" if c["base"] else c["n"], fmt(c["mean_completion"]["median"]),
        cell(c["tokens_per_s"]), cell(c["seconds_per_group"]), cell(c["group_latency_s"]),
        fmt(c["tokens_per_s_vs_base"]["median"]), fmt(c["seconds_per_group_vs_base"]["median"]),
    ]  # fmt: skip


def cost_section(payload: dict[str, Any]) -> list[str]:
    cost, plan = payload["result"]["cost"], payload["plan"]
    rows = [cost_row(c) for c in sorted(cost["cells"], key=lambda c: (c["n"], c["max_tokens"]))]
    headers = [
        "max_tokens", "n", "mean completion (tokens)", "tokens/s", "s / group", "group latency (s)",
        "tokens/s vs base", "s / group vs base",
    ]  # fmt: skip
    return [
        f"### (b) Cost curve on one replica ({cost['replica']}, cores {BINDINGS[cost['replica']]})\n\n"
        f"One cell = {plan['curve_groups']} groups, all in flight; s / group = wall time / groups; group "
        "latency = median over the groups of request to last sample. Ratios: median of the per-repeat "
        f"ratios against the base cell; {payload['repeats']} repeats, cells in rotating order. "
        "Sampled with `ignore_eos`: every completion runs to max_tokens (see the mean completion column).",
        markdown_table(headers, rows),
    ]


def render_markdown(payload: dict[str, Any]) -> str:
    load = payload["plan"]["load"]
    engine = payload["engine"] if payload["engine"] != "vllm" else f"vLLM {payload['mode']}"
    intro = (
        f"Model preset `{load['preset']}`, float32, {engine}, KV cache {load['kv_cache_bytes'] >> 20} MiB "
        "per replica; three replicas run for the whole benchmark (r01 on cores 0-1, r0 on core 0, r1 on "
        "core 1). Temperature 1, unseeded; tokens are those actually generated. No goal: recorded."
    )
    quick = ["Quick mode: the figures mean nothing."] if payload["quick"] else []
    machine = f"{machine_line(payload['machine'])}; load {payload['load_avg_1m_end']:.2f} at the end"
    return "\n\n".join([
        "## rollout_scaling: 1 vs 2 rollout replicas, and the cost of longer completions and larger groups",
        machine, intro, *quick, *replicas_section(payload), *cost_section(payload),
    ])  # fmt: skip


def plot(payload: dict[str, Any], path: Path) -> None:
    result, base = payload["result"], payload["plan"]["load"]
    scaling = [Bar(config, Stats(**c["tokens_per_s"])) for config, c in result["replicas"]["configs"].items()]
    cells = result["cost"]["cells"]

    def curve(key: str, fixed: str) -> list[Bar]:
        chosen = sorted((c for c in cells if c[fixed] == base[fixed]), key=lambda c: c[key])
        return [
            Bar(
                f"{key} {c[key]} ({fmt(c['mean_completion']['median'])} tok)", Stats(**c["seconds_per_group"])
            )
            for c in chosen
        ]

    panels = [
        ("(a) generation", "tokens/s", scaling),
        (f"(b) by max_tokens, n={base['n']}", "seconds per group", curve("max_tokens", "n")),
        (f"(b) by n, max_tokens {base['max_tokens']}", "seconds per group", curve("n", "max_tokens")),
    ]
    bar_plot(path, panels, NAME)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--compiled", action="store_true", help="vLLM with torch.compile (default eager)")
    parser.add_argument(
        "--engine", choices=["vllm", "transformers"], help="default: vllm, transformers with --quick"
    )
    args = parser.parse_args(argv)
    repeats = effective_repeats(args)
    engine = args.engine or ("transformers" if args.quick else "vllm")
    plan = QUICK if args.quick else replace(FULL, load=replace(FULL.load, eager=not args.compiled))
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as workdir:
        result = run(plan, engine, repeats, Path(workdir))
    payload = {
        "machine": machine, "load_avg_1m_end": os.getloadavg()[0], "quick": args.quick, "repeats": repeats,
        "engine": engine, "mode": "eager" if plan.load.eager else "compiled", "goal": None,
        "plan": asdict(plan), "bindings": BINDINGS, "result": result,
    }  # fmt: skip
    markdown = render_markdown(payload)
    report_results(args.output_dir, NAME, payload, markdown, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
