"""Start a real vLLM engine on CPU, receive weight broadcasts into it, then generate (a test subprocess).

`tests/integration/test_broadcast.py` runs this file and plays the learner: for each `--transfer SPEC`
(a JSON file {"metas", "port", "bucket_bytes", "timeout_s"}) the engine's worker joins the broadcast as
rank 1 of 2 through `collective_rpc("rlfabric_receive_broadcast")`. After the transfers it generates
greedily with log-probabilities.

Usage: python _broadcast_vllm_receiver.py MODEL_DIR --out RESULT.json --ready READY_FILE
    --transfer SPEC [--transfer SPEC ...] --prompt TEXT [--prompt TEXT ...] [--max-tokens N]

Output: {"transfers": [{"ok", "stats" | "error"}, ...], "greedy": [{"prompt_token_ids", "token_ids",
"logprobs"}, ...]}, one transfer entry per SPEC and one greedy entry per prompt, in order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ready", type=Path, required=True)
    parser.add_argument("--transfer", type=Path, action="append", required=True)
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--max-tokens", type=int, default=8)
    return parser.parse_args()


def receive(llm: Any, spec_path: Path) -> dict[str, Any]:
    """One broadcast into the engine; a refusal or failure is recorded rather than raised."""
    spec = json.loads(spec_path.read_text())
    kwargs = {
        "metas_json": spec["metas"], "host": "127.0.0.1", "port": spec["port"], "rank": 1, "world_size": 2,
        "backend": "gloo", "bucket_bytes": spec["bucket_bytes"], "timeout_s": spec["timeout_s"],
    }  # fmt: skip
    try:
        stats = llm.collective_rpc("rlfabric_receive_broadcast", kwargs=kwargs)
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    llm.reset_prefix_cache()
    return {"ok": True, "stats": stats}


def greedy(llm: Any, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    results = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        steps = zip(completion.logprobs, completion.token_ids, strict=True)
        results.append({
            "prompt_token_ids": list(output.prompt_token_ids),
            "token_ids": list(completion.token_ids),
            "logprobs": [step[token].logprob for step, token in steps],
        })  # fmt: skip
    return results


def main() -> None:
    args = parse_args()
    from vllm import LLM

    llm = LLM(
        model=str(args.model),
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=512,
        worker_extension_cls="rlfabric.rollout.worker_ext.RlfabricWorkerExtension",
    )
    args.ready.write_text("ready")
    transfers = [receive(llm, spec) for spec in args.transfer]
    report = {"transfers": transfers, "greedy": greedy(llm, args.prompt, args.max_tokens)}
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
