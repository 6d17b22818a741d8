"""A seeded batch whose prefills do not fit one engine step, through `VllmEngine`, reported as JSON.

vLLM 0.32's CPU engine dies (`EngineDeadError`) when a seeded request's prefill is chunked: the worker
rewinds the request's generator by a Philox offset, which a CPU `torch.Generator` does not have. The
rollout engine turns chunked prefill off on CPU (`rlfabric.rollout.vllm_engine.chunked_prefill`); this
helper submits a batch that vLLM would chunk (8 distinct 400-token prompts, 2 seeded samples each:
3,200 prompt tokens that share no prefix, against a 2,048-token step budget) twice and reports the
samples of both rounds.
`--upstream-chunked-prefill` restores vLLM's default instead, to reproduce the crash by hand.

Usage: python _seeded_batch.py MODEL_DIR --out REPORT.json [--upstream-chunked-prefill]
Output: {"rounds": [[SAMPLE, ...], [SAMPLE, ...]]} with the samples sorted by (prompt, sample index),
or {"error": "ExceptionType: message"} when generation failed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from rlfabric.rollout.engine import SamplingSettings

PROMPT_TOKENS = 400
PROMPTS = 8
SEEDED = SamplingSettings(n=2, temperature=1.0, top_p=1.0, top_k=0, max_tokens=8, seed=11, ignore_eos=True)


async def rounds(model: str) -> dict[str, Any]:
    from rlfabric.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(
        model, dtype="float32", max_model_len=512, kv_cache_bytes=256 << 20, enforce_eager=True
    )
    await engine.start()
    letters = "abcdefghijklmnopqrstuvwxyz"
    texts = [(letters[i:] + letters[:i]) * (PROMPT_TOKENS // len(letters) + 1) for i in range(PROMPTS)]
    prompts = [engine.tokenize_text(text)[:PROMPT_TOKENS] for text in texts]
    report: dict[str, Any] = {"prompt_tokens": [len(p) for p in prompts], "rounds": []}
    try:
        for index in range(2):
            samples = [
                dataclasses.asdict(s) async for s in engine.generate(f"seeded-{index}", prompts, SEEDED)
            ]
            report["rounds"].append(sorted(samples, key=lambda s: (s["prompt_index"], s["sample_index"])))
    except Exception as e:  # the report says how the engine failed; the test asserts there is none
        report["error"] = f"{type(e).__name__}: {e}"
    await engine.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--upstream-chunked-prefill", action="store_true")
    args = parser.parse_args()
    if args.upstream_chunked_prefill:
        from rlfabric.rollout import vllm_engine

        vllm_engine.chunked_prefill = lambda *, cpu: None  # vLLM's own choice (on)
    args.out.write_text(json.dumps(asyncio.run(rounds(args.model))))


if __name__ == "__main__":
    main()
