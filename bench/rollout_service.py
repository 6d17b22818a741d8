"""Rollout service: generation throughput through gRPC against the same vLLM engine in-process, and the
time a weight update takes until the replica serves the new version.

(a) Throughput. A replica (`rlfabric serve rollout`, a real process on a loopback port) and an in-process
`VllmEngine` (built in this process's event loop) run the same model with the same engine settings and
are measured alternately, repeat by repeat: one `Generate` of P prompts x n samples (token-id prompts,
unseeded sampling at temperature 1) against one `engine.generate` of the same. The proto has no
`ignore_eos`, so neither side ignores end-of-sequence: both report tokens actually generated (the sum of
`len(token_ids)`) per second of wall time. Sampling is unseeded because vLLM 0.32 on CPU kills its engine
when a seeded request's prefill is chunked ("CPU Generator does not use offset"), which a batch this
size triggers. Goal: service tokens/s >= 0.95 x in-process. The transformers reference engine
(`HfEngine`, in a subprocess with two torch threads) runs the same load for the record.

(b) Weight updates, on a replica of each model size: object store (`publish_version` then
`UpdateWeights(object_store=...)`) and broadcast (`send_state_dict` in a thread while
`UpdateWeights(broadcast=...)` receives), interleaved. Time is from the start of the transfer (publish,
or the sender starting) until a one-token `Generate` returns a sample of the new version.

vLLM runs eager (`enforce_eager`, dynamo off) unless `--compiled`; its OpenMP threads are not bound
(`VLLM_CPU_OMP_THREADS_BIND=nobind` unless set) and no core is reserved. Replica logs are kept in
`$TMPDIR/rlfabric-bench-rollout-logs-<uid>/`.

Usage: python bench/rollout_service.py [--quick] [--repeats K] [--output-dir DIR] [--compiled]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from common import (
    Bar,
    Stats,
    bar_plot,
    base_parser,
    effective_repeats,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    ratio,
    report_results,
)

NAME = "rollout_service"
GOAL = 0.95
HOST = "127.0.0.1"
LEARNER_TOKEN = "bench-learner-token"  # the replicas' UpdateWeights token
AUTH = (("authorization", f"Bearer {LEARNER_TOKEN}"),)
CLIENT_TOKEN = "bench-client-token"  # the replicas' Generate token
CLIENT_AUTH = (("authorization", f"Bearer {CLIENT_TOKEN}"),)
LOG_DIR = Path(tempfile.gettempdir()) / f"rlfabric-bench-rollout-logs-{os.getuid()}"


@dataclass(frozen=True)
class Load:
    """One throughput repeat: `prompts` token-id prompts of `prompt_min`..`prompt_max` tokens, `n`
    samples each, up to `max_tokens` tokens per sample; the engines' model preset and settings."""

    preset: str
    prompts: int
    n: int
    max_tokens: int
    prompt_min: int
    prompt_max: int
    kv_cache_bytes: int
    max_model_len: int
    eager: bool


FULL = Load("bench", 32, 4, 64, 16, 32, kv_cache_bytes=1 << 30, max_model_len=256, eager=True)
QUICK = Load("tiny", 8, 2, 16, 8, 16, kv_cache_bytes=256 << 20, max_model_len=128, eager=True)
UPDATE_PRESETS_FULL = ("tiny", "bench")
UPDATE_PRESETS_QUICK = ("tiny",)


def vllm_env(scratch: Path, eager: bool) -> dict[str, str]:
    """Environment of every vLLM engine here: loopback, scratch folders, threads unbound. The vLLM cache
    (model-class metadata and compiled graphs) is shared across runs: a fresh one slows every start."""
    env = {
        "VLLM_HOST_IP": HOST,
        "VLLM_CACHE_ROOT": str(Path(tempfile.gettempdir()) / f"rlfabric-bench-vllm-cache-{os.getuid()}"),
        "TMPDIR": str(scratch),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def make_model(preset: str, out_dir: Path) -> Path:
    from rlfabric.tools.tiny_model import PRESETS, save_tiny_model

    return save_tiny_model(PRESETS[preset], out_dir)


def make_prompts(load: Load, vocab_size: int) -> list[list[int]]:
    """Random prompts over the ordinary (non-special) tokens."""
    import random

    from rlfabric.tools.tiny_model import SPECIAL_TOKENS

    rng = random.Random(0)
    low = len(SPECIAL_TOKENS)
    return [
        [rng.randrange(low, vocab_size) for _ in range(rng.randint(load.prompt_min, load.prompt_max))]
        for _ in range(load.prompts)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# --- a replica -------------------------------------------------------------------------------------------


def start_replica(model: Path, load: Load, weights_root: Path, env: dict[str, str]) -> Any:
    """`rlfabric serve rollout` on an ephemeral port, serving version 0; returns (process, address). Its
    log goes to LOG_DIR, which outlives the run."""
    from rlfabric.local.procs import ServiceProcess

    argv = [
        sys.executable, "-m", "rlfabric.cli", "serve", "rollout", "--model", str(model), "--port", "0",
        "--set", "server.metrics_port=0",
        "--set", f"engine.enforce_eager={str(load.eager).lower()}", "--set", "engine.dtype=float32",
        "--set", f"engine.kv_cache_bytes={load.kv_cache_bytes}",
        "--set", f"engine.max_model_len={load.max_model_len}",
        "--set", f"weights_root={weights_root}", "--set", "log.format=text",
    ]  # fmt: skip
    proc = ServiceProcess(
        f"rollout-{model.name}",
        argv,
        log_path=LOG_DIR / f"rollout-{model.name}.log",
        env={
            **os.environ,
            **env,
            "RLFABRIC_ROLLOUT__LEARNER_TOKEN": LEARNER_TOKEN,
            "RLFABRIC_ROLLOUT__CLIENT_TOKEN": CLIENT_TOKEN,
        },
    )
    address = proc.start(r"listening on (\S+)", timeout_s=600).group(1)
    proc.wait_for(r"serving version", timeout_s=600)
    return proc, address


# --- (a) throughput --------------------------------------------------------------------------------------


def generate_request(request_id: str, prompts: list[list[int]], load: Load) -> Any:
    from rlfabric.v1 import common_pb2, rollout_pb2

    return rollout_pb2.GenerateRequest(
        request_id=request_id,
        prompts=[
            rollout_pb2.GeneratePrompt(
                prompt_id=str(i), prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=p))
            )
            for i, p in enumerate(prompts)
        ],
        sampling=rollout_pb2.SamplingParams(n=load.n, temperature=1.0, top_p=1.0, max_tokens=load.max_tokens),
    )


def sampling_settings(load: Load) -> Any:
    from rlfabric.rollout.engine import SamplingSettings

    return SamplingSettings(n=load.n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=load.max_tokens)


async def run_service(stub: Any, request: Any) -> tuple[int, float]:
    """(tokens generated, seconds) of one streamed Generate."""
    start, tokens = time.perf_counter(), 0
    async for sample in stub.Generate(request, timeout=600, metadata=CLIENT_AUTH):
        tokens += len(sample.token_ids)
    return tokens, time.perf_counter() - start


async def run_engine(engine: Any, request_id: str, prompts: list[list[int]], load: Load) -> tuple[int, float]:
    """(tokens generated, seconds) of one `engine.generate`."""
    start, tokens = time.perf_counter(), 0
    async for sample in engine.generate(request_id, prompts, sampling_settings(load)):
        tokens += len(sample.token_ids)
    return tokens, time.perf_counter() - start


async def throughput(model: Path, address: str, load: Load, repeats: int) -> dict[str, Any]:
    """One warm-up each, then `repeats` alternating repeats (which side goes first alternates too)."""
    import grpc

    from rlfabric.rollout.vllm_engine import VllmEngine
    from rlfabric.v1 import rollout_pb2_grpc

    engine = VllmEngine(
        str(model), dtype="float32", max_model_len=load.max_model_len,
        kv_cache_bytes=load.kv_cache_bytes, enforce_eager=load.eager,
    )  # fmt: skip
    await engine.start()
    prompts = make_prompts(load, engine.vocab_size)
    runs: dict[str, list[tuple[int, float]]] = {"service": [], "in_process": []}
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            sides = {
                "service": lambda i: run_service(stub, generate_request(f"svc-{i}", prompts, load)),
                "in_process": lambda i: run_engine(engine, f"eng-{i}", prompts, load),
            }
            for i in range(repeats + 1):
                for side in ("service", "in_process") if i % 2 == 0 else ("in_process", "service"):
                    result = await sides[side](i)
                    if i > 0:
                        runs[side].append(result)
    finally:
        await engine.close()
    return summarise_throughput(runs)


def summarise_throughput(runs: dict[str, list[tuple[int, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side, values in runs.items():
        out[side] = {
            "tokens_per_s": Stats.of([t / s for t, s in values], "tokens/s").to_dict(),
            "tokens": [t for t, _ in values],
            "seconds": [s for _, s in values],
        }
    per_repeat = [s / e for (_, s), (_, e) in zip(runs["in_process"], runs["service"], strict=True)]
    out["ratio"] = ratio(
        out["service"]["tokens_per_s"]["median"], out["in_process"]["tokens_per_s"]["median"]
    )
    out["ratio_per_repeat"] = Stats.of(per_repeat, "x").to_dict()
    out["tokens_ratio"] = ratio(sum(out["service"]["tokens"]), sum(out["in_process"]["tokens"]))
    return out


def hf_throughput(model: Path, load: Load, repeats: int) -> dict[str, Any]:
    """The transformers reference engine on the same load, in a subprocess (vLLM's import here has cut
    this process's torch threads to one)."""
    argv = [
        sys.executable,
        __file__,
        "--role",
        "hf",
        "--model",
        str(model),
        "--load",
        json.dumps(asdict(load)),
    ]
    argv += ["--repeats", str(repeats)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=1200).stdout
    runs = json.loads(out.strip().splitlines()[-1])
    return {
        "tokens_per_s": Stats.of([t / s for t, s in runs], "tokens/s").to_dict(),
        "tokens": [t for t, _ in runs],
        "seconds": [s for _, s in runs],
    }


async def hf_role(model: str, load: Load, repeats: int) -> list[tuple[int, float]]:
    from rlfabric.rollout.hf_engine import HfEngine

    engine = HfEngine(model, dtype="float32", max_model_len=load.max_model_len)
    await engine.start()
    prompts = make_prompts(load, engine.vocab_size)
    runs = [await run_engine(engine, f"hf-{i}", prompts, load) for i in range(repeats + 1)]
    await engine.close()
    return runs[1:]


# --- (b) weight updates ----------------------------------------------------------------------------------


def state_dict_of(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def probe(stub: Any, version: int) -> None:
    """Generate one token; raise unless the replica served it with `version`."""
    from rlfabric.v1 import common_pb2, rollout_pb2

    request = rollout_pb2.GenerateRequest(
        request_id=f"probe-{version}",
        prompts=[rollout_pb2.GeneratePrompt(prompt_id="p", prompt=common_pb2.Prompt(text="hello"))],
        sampling=rollout_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=1),
    )
    served = {s.policy_version for s in stub.Generate(request, timeout=120, metadata=CLIENT_AUTH)}
    if served != {version}:
        raise RuntimeError(f"expected version {version}, replica served {served}")


def update_object_store(stub: Any, root: Path, version: int, sd: dict[str, Any]) -> dict[str, float]:
    from rlfabric.v1 import rollout_pb2
    from rlfabric.weights.versions import publish_version

    start = time.perf_counter()
    publish_version(str(root), version, sd)
    published = time.perf_counter()
    source = rollout_pb2.ObjectStoreSource(root_url=str(root))
    reply = stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(version=version, object_store=source), timeout=300, metadata=AUTH
    )
    updated = time.perf_counter()
    probe(stub, version)
    return phases(start, published, updated, time.perf_counter(), reply)


def update_broadcast(stub: Any, version: int, sd: dict[str, Any]) -> dict[str, float]:
    from rlfabric.contracts import wire
    from rlfabric.v1 import rollout_pb2
    from rlfabric.weights import broadcast

    port, metas = free_port(), broadcast.metas_from_state_dict(sd)
    source = rollout_pb2.BroadcastSource(
        master_address=HOST, master_port=port, rank=1, world_size=2, backend="gloo",
        tensors=wire.metas_to_proto(metas),
    )  # fmt: skip
    sent: dict[str, Any] = {}

    def send() -> None:
        sent["stats"] = broadcast.send_state_dict(sd, host=HOST, port=port, world_size=2, timeout_s=300)

    start = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    request = rollout_pb2.UpdateWeightsRequest(version=version, broadcast=source, timeout_seconds=300)
    reply = stub.UpdateWeights(request, timeout=330, metadata=AUTH)
    sender.join(330)
    if "stats" not in sent:
        raise RuntimeError("the broadcast sender did not finish")
    updated = time.perf_counter()
    probe(stub, version)
    return phases(start, start, updated, time.perf_counter(), reply)


def phases(start: float, staged: float, updated: float, served: float, reply: Any) -> dict[str, float]:
    """Seconds of each phase of one update (`staged` is the end of publishing; = start for broadcast)."""
    return {
        "total_s": served - start,
        "publish_s": staged - start,
        "update_rpc_s": updated - staged,
        "probe_s": served - updated,
        "replica_transfer_s": reply.transfer_seconds,
        "replica_load_s": reply.load_seconds,
    }


def weight_updates(preset: str, model: Path, address: str, root: Path, repeats: int) -> dict[str, Any]:
    """`repeats` interleaved updates through each path (after one warm-up of each), new weights each."""
    import grpc
    import torch

    from rlfabric.v1 import rollout_pb2_grpc

    base = state_dict_of(model)
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    runs: dict[str, list[dict[str, float]]] = {"object_store": [], "broadcast": []}
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        version = 0
        for i in range(repeats + 1):
            for path in ("object_store", "broadcast"):
                version += 1
                sd = {k: v + 1e-3 * torch.randn_like(v) for k, v in base.items()}
                if path == "object_store":
                    result = update_object_store(stub, root, version, sd)
                else:
                    result = update_broadcast(stub, version, sd)
                if i > 0:
                    runs[path].append(result)
    return {
        "preset": preset,
        "bytes": nbytes,
        "paths": {path: summarise_phases(values) for path, values in runs.items()},
    }


def summarise_phases(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {key: Stats.of([r[key] for r in runs], "s").to_dict() for key in runs[0]}


# --- the run ---------------------------------------------------------------------------------------------


def run(load: Load, repeats: int, workdir: Path) -> dict[str, Any]:
    """(a) on the load's model, then (b) on each size (reusing the (a) replica for its size)."""
    os.environ.update(vllm_env(workdir, load.eager))  # before vLLM is imported in this process
    presets = UPDATE_PRESETS_QUICK if load.preset == "tiny" else UPDATE_PRESETS_FULL
    models = {p: make_model(p, workdir / f"model-{p}") for p in {load.preset, *presets}}
    proc, address = start_replica(models[load.preset], load, workdir / f"weights-{load.preset}", {})
    try:
        vllm = asyncio.run(throughput(models[load.preset], address, load, repeats))
        hf = hf_throughput(models[load.preset], load, repeats)
        updates = {
            load.preset: weight_updates(
                load.preset, models[load.preset], address, workdir / f"weights-{load.preset}", repeats
            )
        }
    finally:
        proc.stop(grace_s=60)
    for preset in presets:
        if preset in updates:
            continue
        small = replace(load, preset=preset, kv_cache_bytes=256 << 20)
        proc, address = start_replica(models[preset], small, workdir / f"weights-{preset}", {})
        try:
            updates[preset] = weight_updates(
                preset, models[preset], address, workdir / f"weights-{preset}", repeats
            )
        finally:
            proc.stop(grace_s=60)
    vllm["hf_in_process"] = hf
    vllm["vllm_vs_hf"] = ratio(vllm["in_process"]["tokens_per_s"]["median"], hf["tokens_per_s"]["median"])
    return {"load": asdict(load), "throughput": vllm, "weight_updates": [updates[p] for p in presets]}


# --- report ----------------------------------------------------------------------------------------------


def cell(stats: dict[str, Any], scale: float = 1.0) -> str:
    s = Stats(**stats)
    return f"{fmt(s.median * scale)} ({fmt(s.min * scale)}..{fmt(s.max * scale)})"


def render_markdown(payload: dict[str, Any]) -> str:
    load, tp = payload["result"]["load"], payload["result"]["throughput"]
    mode = "eager" if load["eager"] else "compiled"
    labels = {
        "service": "rollout service (gRPC)",
        "in_process": "vLLM in-process",
        "hf_in_process": "transformers in-process (HfEngine)",
    }
    rows = [[label, cell(tp[key]["tokens_per_s"]), sum(tp[key]["tokens"])] for key, label in labels.items()]
    verdict = "met" if tp["ratio"] >= GOAL else "**not met**"
    update_rows = []
    for u in payload["result"]["weight_updates"]:
        for path, ph in u["paths"].items():
            update_rows.append([
                u["preset"], f"{u['bytes'] / 1e6:.1f}", path.replace("_", " "), cell(ph["total_s"], 1e3),
                cell(ph["publish_s"], 1e3), cell(ph["update_rpc_s"], 1e3), cell(ph["replica_load_s"], 1e3),
                cell(ph["probe_s"], 1e3),
            ])  # fmt: skip
    return "\n\n".join([
        "## rollout_service: generation through the rollout service vs in-process, and weight updates",
        machine_line(payload["machine"]),
        f"### (a) Throughput\n\nModel preset `{load['preset']}`, float32, vLLM {mode}; one repeat = "
        f"{load['prompts']} prompts x n={load['n']}, max_tokens {load['max_tokens']}, temperature 1, "
        "unseeded (end-of-sequence not ignored: tokens actually generated per second). "
        f"Median of {payload['repeats']} alternating repeats after one warm-up each (min..max).",
        markdown_table(["", "tokens/s", "tokens (all repeats)"], rows),
        f"Service / in-process: **{fmt(tp['ratio'])}** (per-repeat ratios {cell(tp['ratio_per_repeat'])}); "
        f"goal >= {GOAL}: {verdict}. Tokens generated, service / in-process: {fmt(tp['tokens_ratio'])}. "
        f"vLLM / transformers in-process: {fmt(tp['vllm_vs_hf'])}.",
        "### (b) Weight updates\n\nMilliseconds, median (min..max) of "
        f"{payload['repeats']} interleaved updates after one warm-up each. Total = from the start of the "
        "transfer until a one-token Generate returns the new version; publish = writing the version to the "
        "object store (0 for broadcast); update RPC = UpdateWeights round trip (broadcast: the transfer "
        "too); replica load = the replica's own load time as it reports it; probe = the one-token Generate.",
        markdown_table(
            ["model", "MB", "path", "total", "publish", "update RPC", "replica load", "probe"], update_rows
        ),
    ])  # fmt: skip


def plot(payload: dict[str, Any], path: Path) -> None:
    tp = payload["result"]["throughput"]
    bars = [
        Bar("service", Stats(**tp["service"]["tokens_per_s"])),
        Bar("vLLM in-process", Stats(**tp["in_process"]["tokens_per_s"])),
        Bar("transformers", Stats(**tp["hf_in_process"]["tokens_per_s"])),
    ]
    panels = [("(a) generation", "tokens/s", bars)]
    for u in payload["result"]["weight_updates"]:
        update_bars = [Bar(p.replace("_", " "), Stats(**ph["total_s"])) for p, ph in u["paths"].items()]
        panels.append((f"(b) update, {u['preset']} ({u['bytes'] / 1e6:.0f} MB)", "seconds", update_bars))
    bar_plot(path, panels, "rollout_service")


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--compiled", action="store_true", help="vLLM with torch.compile (default eager)")
    parser.add_argument("--role", choices=["main", "hf"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats = effective_repeats(args)
    if args.role == "hf":
        print(json.dumps(asyncio.run(hf_role(args.model, Load(**json.loads(args.load)), repeats))))
        return 0
    load = QUICK if args.quick else replace(FULL, eager=not args.compiled)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as workdir:
        result = run(load, repeats, Path(workdir))
    payload = {"machine": machine, "quick": args.quick, "repeats": repeats, "goal": GOAL, "result": result}
    payload["goal_met"] = result["throughput"]["ratio"] >= GOAL
    markdown = render_markdown(payload)
    report_results(args.output_dir, NAME, payload, markdown, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
