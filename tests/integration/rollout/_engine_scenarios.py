"""The behavioural scenarios every rollout engine must pass, run against one engine and reported as JSON.

`test_engines.py` runs them in-process for the transformers engine and through this file as a subprocess
for vLLM (vLLM's CPU platform spawns processes and keeps global state, so it stays out of pytest's
process). One engine serves all scenarios, in this order: generate (without, then with a stop string),
refused weights, generate, good weights, generate (twice), cancel, abort, throughput.

Usage: python _engine_scenarios.py {vllm,transformers} MODEL_DIR --new DIR --wrong-shape DIR
    --missing DIR --out REPORT.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rlfabric.rollout.engine import Engine, EngineSample, SamplingSettings

MAX_MODEL_LEN = 512
PROMPT_TEXTS = ["Hello, world", "a b\nc"]
CHAT = [{"role": "user", "content": "1+1="}]
SAMPLED = SamplingSettings(n=3, temperature=1.0, top_p=1.0, top_k=0, max_tokens=12, seed=7)
"""Temperature 1, no filters: processed and raw logprobs agree, so a plain forward pass is the reference."""
TEMPERED = SamplingSettings(n=3, temperature=0.7, top_p=0.9, top_k=20, max_tokens=12, seed=7)
"""Every filter on: "processed" logprobs are those of the tempered, truncated distribution."""
WARM = dataclasses.replace(SAMPLED, temperature=0.7)
"""A temperature alone (no top-k/top-p): the learner's log-probs at the run's temperature must be these."""
NEVER_STOPPED = dataclasses.replace(SAMPLED, stop=("~" * 8,))
"""SAMPLED with a stop string no 12-token sample contains: vLLM then detokenizes while it generates."""
LONG = SamplingSettings(n=4, temperature=1.0, top_p=1.0, top_k=0, max_tokens=400, ignore_eos=True)
"""Long enough that no sample finishes before the scenario stops it."""
BENCH = SamplingSettings(n=4, temperature=1.0, top_p=1.0, top_k=0, max_tokens=64, ignore_eos=True)


def build_engine(kind: str, model: str) -> Engine:
    """The engine under test, sized for the tiny model (float32, eager, small KV cache);
    "transformers-batched" batches unseeded prompts (the cancel, abort and throughput scenarios)."""
    if kind == "vllm":
        from rlfabric.rollout.vllm_engine import VllmEngine

        return VllmEngine(
            model, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=256 << 20, enforce_eager=True
        )
    from rlfabric.rollout.hf_engine import HfEngine

    batch = 8 if kind == "transformers-batched" else 1
    return HfEngine(model, dtype="float32", max_model_len=MAX_MODEL_LEN, batch_prompts=batch)


async def collect(samples: AsyncIterator[EngineSample], into: list[dict[str, Any]] | None = None):
    """Every sample of a request as a dict, in arrival order (appended to `into` as they come)."""
    got = [] if into is None else into
    async for sample in samples:
        got.append(dataclasses.asdict(sample))
    return got


async def try_load(engine: Engine, path: str) -> str | None:
    """None if the folder loaded, else the refusal as "ExceptionType: message"."""
    try:
        await engine.load_weights_dir(path)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


async def wait_for_tokens(engine: Engine, since: int, timeout_s: float = 60.0) -> None:
    """Until the engine has generated tokens past the count `since`."""
    deadline = time.perf_counter() + timeout_s
    while engine.stats().tokens_generated <= since and time.perf_counter() < deadline:
        await asyncio.sleep(0.02)


async def quiet_tokens(engine: Engine) -> dict[str, Any]:
    """Stats after the engine settles, and the tokens it generated over one more second (0 = idle)."""
    await asyncio.sleep(0.5)
    before = engine.stats().tokens_generated
    await asyncio.sleep(1.0)
    stats = engine.stats()
    return {"tokens_after_stop": stats.tokens_generated - before, "stats": dataclasses.asdict(stats)}


async def cancel_scenario(engine: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    """Cancel the task consuming a long request once tokens flow; the engine must stop working on it."""
    got: list[dict[str, Any]] = []
    start = engine.stats().tokens_generated
    task = asyncio.create_task(collect(engine.generate("cancel", prompts, LONG), got))
    await wait_for_tokens(engine, start)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return {"yielded": len(got), **await quiet_tokens(engine)}


async def abort_scenario(engine: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    """`abort(request_id)` on a long request: the iterator ends by itself with every sample, aborted."""
    got: list[dict[str, Any]] = []
    start = engine.stats().tokens_generated
    task = asyncio.create_task(collect(engine.generate("abort", prompts, LONG), got))
    await wait_for_tokens(engine, start)
    await engine.abort("abort")
    await asyncio.wait_for(task, timeout=60)
    return {"samples": got, **await quiet_tokens(engine)}


async def throughput(engine: Engine, prompts: list[list[int]]) -> dict[str, float]:
    """Tokens per second over 4 x len(prompts) prompts x BENCH (fixed-length samples)."""
    start = time.perf_counter()
    samples = await collect(engine.generate("bench", prompts * 4, BENCH))
    seconds = time.perf_counter() - start
    tokens = sum(len(s["token_ids"]) for s in samples)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


async def run_scenarios(engine: Engine, weights: dict[str, str]) -> dict[str, Any]:
    """All scenarios against a fresh `engine`; `weights` maps new / wrong_shape / missing to folders."""
    start = time.perf_counter()
    await engine.start()
    report: dict[str, Any] = {"kind": engine.kind, "start_s": time.perf_counter() - start}
    prompts = [engine.tokenize_text(text) for text in PROMPT_TEXTS] + [engine.tokenize_chat(CHAT)]
    report["prompts"] = prompts
    report["base"] = await collect(engine.generate("base", prompts, SAMPLED))
    report["detokenized"] = await collect(engine.generate("detokenized", prompts, NEVER_STOPPED))
    report["rejected"] = {name: await try_load(engine, weights[name]) for name in ("wrong_shape", "missing")}
    report["after_rejected"] = await collect(engine.generate("after-rejected", prompts, SAMPLED))
    start = time.perf_counter()
    report["new_error"] = await try_load(engine, weights["new"])
    report["reload_s"] = time.perf_counter() - start
    report["new"] = await collect(engine.generate("new", prompts, SAMPLED))
    report["tempered"] = await collect(engine.generate("tempered", prompts, TEMPERED))
    report["warm"] = await collect(engine.generate("warm", prompts, WARM))
    report["cancel"] = await cancel_scenario(engine, prompts)
    report["abort"] = await abort_scenario(engine, prompts)
    report["throughput"] = await throughput(engine, prompts)
    await engine.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["vllm", "transformers"])
    parser.add_argument("model")
    for name in ("new", "wrong-shape", "missing"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    weights = {"new": args.new, "wrong_shape": args.wrong_shape, "missing": args.missing}
    report = asyncio.run(run_scenarios(build_engine(args.kind, args.model), weights))
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
