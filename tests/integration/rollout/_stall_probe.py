"""Stream tokens from a real vLLM engine with `worker_wait="block"` and report the longest gap between two
engine steps. Run by `test_vllm_wait.py` in a subprocess (vLLM spawns its engine core, which needs a
main module guarded by `__main__`).

Usage: python _stall_probe.py MODEL_DIR --out REPORT.json [--rounds R] [--requests N] [--tokens T]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind

from rlfabric.rollout.vllm_engine import VllmEngine


async def stream_gaps(engine: VllmEngine, request_id: str, prompt: list[int], tokens: int) -> list[float]:
    """Seconds between consecutive outputs of one request streamed token by token (one per engine step)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    gaps: list[float] = []
    last = time.perf_counter()
    async for _ in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id):
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return gaps[1:]  # the first output also waits for the prefill


async def probe(model: str, rounds: int, requests: int, tokens: int) -> dict[str, float]:
    """`rounds` batches of `requests` concurrent requests, a short idle pause between batches (so that
    the engine's readers go back to sleep on their queues)."""
    engine = VllmEngine(model, dtype="float32", enforce_eager=True, max_model_len=256,
                        kv_cache_bytes=1 << 27, worker_wait="block")  # fmt: skip
    await engine.start()
    gaps: list[float] = []
    started = time.perf_counter()
    try:
        for r in range(rounds):
            prompt = engine.tokenize_text(f"round {r}")
            batch = [stream_gaps(engine, f"{r}-{i}", prompt, tokens) for i in range(requests)]
            gaps += [g for request_gaps in await asyncio.gather(*batch) for g in request_gaps]
            await asyncio.sleep(0.05)
    finally:
        await engine.close()
    return {"max_gap_s": max(gaps), "steps": len(gaps), "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=100)
    args = parser.parse_args()
    report = asyncio.run(probe(args.model, args.rounds, args.requests, args.tokens))
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
