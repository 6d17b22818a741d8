"""Generate with a real vLLM engine on CPU and write the results as JSON (a helper run in a subprocess).

vLLM's CPU platform spawns processes and keeps global state, so the engine is not built inside the pytest
process: `tests/integration/test_tiny_model.py` runs this file with the environment it needs and reads
`--out`. Each prompt is completed twice, greedily and sampled at temperature 1 (seeded).

Usage: python _vllm_generate.py MODEL_DIR --out RESULT.json --prompt TEXT [--prompt TEXT ...]
    [--max-tokens N] [--seed S]

Output: {"startup_s", "generate_s", "greedy": [RESULT, ...], "sampled": [RESULT, ...]} with one RESULT
per prompt, in order: {"prompt", "prompt_token_ids", "token_ids", "text", "logprobs"}, where
`logprobs[i]` is the log-probability of `token_ids[i]` under the raw model output (no temperature).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def result(output: Any) -> dict[str, Any]:
    """One request's output as plain JSON: token ids aligned with their log-probabilities."""
    completion = output.outputs[0]
    steps = zip(completion.logprobs, completion.token_ids, strict=True)
    return {
        "prompt": output.prompt,
        "prompt_token_ids": list(output.prompt_token_ids),
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "logprobs": [step[token].logprob for step, token in steps],
    }


def main() -> None:
    args = parse_args()
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=str(args.model),
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=512,
        seed=args.seed,
    )
    report: dict[str, Any] = {"startup_s": time.perf_counter() - start}
    start = time.perf_counter()
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        params = SamplingParams(
            temperature=temperature, max_tokens=args.max_tokens, logprobs=1, seed=args.seed, ignore_eos=True
        )
        report[name] = [result(o) for o in llm.generate(args.prompt, params, use_tqdm=False)]
    report["generate_s"] = time.perf_counter() - start
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
