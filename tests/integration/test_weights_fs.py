"""Published weights at realistic size, and read by the consumer that matters: vLLM's `reload_weights`.

- A 24 M-parameter Qwen2-shaped state dict (~97 MB fp32, half of it cast to bf16) published in several
  shards round-trips bitwise through a local directory and through `memory://`; one flipped byte deep
  inside a shard is caught and the shard named.
- A version published from a transformers model's `state_dict()` (tied embeddings included) is loaded by a
  real vLLM engine from `version_dir(...)`, after which its log-probabilities match transformers with the
  same weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.tools.tiny_model import PRESETS, build_model, build_tokenizer
from rlfabric.weights.versions import (
    WeightsCorrupted,
    latest_committed,
    load_version,
    publish_version,
    verify_version,
    version_dir,
)

PROMPT = "Hello, world"
ROOT = Path(__file__).resolve().parents[2]


def qwen2_sized_state_dict() -> dict[str, torch.Tensor]:
    """Random tensors shaped like the `bench` preset's parameters; MLP weights in bf16, the rest fp32."""
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):  # shapes only: no 24 M-parameter initialisation
        shapes = {name: p.shape for name, p in build_model(PRESETS["bench"]).named_parameters()}
    return {
        name: torch.randn(shape, generator=gen).to(torch.bfloat16 if "mlp" in name else torch.float32)
        for name, shape in shapes.items()
    }


@pytest.fixture(scope="module")
def big_state() -> dict[str, torch.Tensor]:
    return qwen2_sized_state_dict()


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A local directory or a memory:// root (removed afterwards: the memory filesystem is process-wide)."""
    if request.param == "local":
        yield str(tmp_path / "weights")
        return
    import fsspec

    url = f"memory://weights-fs-{os.getpid()}"
    yield url
    fsspec.filesystem("memory").rm(url, recursive=True)


def test_a_large_sharded_version_round_trips_bitwise(big_state: dict[str, torch.Tensor], root: str) -> None:
    published = publish_version(root, 1, big_state, shard_bytes=16 << 20, metadata={"preset": "bench"})
    assert published.num_files >= 4
    assert published.total_bytes > 60 << 20
    loaded = load_version(root, 1)
    assert list(loaded) == list(big_state)
    for name, tensor in big_state.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert latest_committed(root) == 1


def test_one_flipped_byte_deep_in_a_large_shard_is_caught(
    big_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    published = publish_version(tmp_path, 1, big_state, shard_bytes=32 << 20)
    victim = published.manifest.files[1]
    path = Path(version_dir(tmp_path, 1)) / victim.name
    with open(path, "r+b") as f:
        f.seek(victim.size // 2)
        byte = f.read(1)
        f.seek(victim.size // 2)
        f.write(bytes([byte[0] ^ 0x80]))
    with pytest.raises(WeightsCorrupted, match=victim.name):
        verify_version(tmp_path, 1)


def test_publish_bench_quick(tmp_path: Path) -> None:
    """`bench/weights_publish.py --quick`, as CI runs it: every method measured, results written."""
    args = [
        sys.executable,
        str(ROOT / "bench" / "weights_publish.py"),
        "--quick",
        "--output-dir",
        str(tmp_path),
    ]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "weights_publish.json").read_text())
    assert result["quick"] is True
    (case,) = result["cases"]
    assert set(case["seconds"]) == {"baseline", "baseline+fsync", "publish", "publish-4-shards"}
    assert all(stats["median"] > 0 for stats in case["seconds"].values())
    assert case["ratio_vs_baseline"]["publish"] > 0
    assert "publish / baseline" in (tmp_path / "weights_publish.md").read_text()


VLLM_HELPER = """
import json, sys

def main():
    model_dir, weights_dir, out, prompt = sys.argv[1:5]
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20,
              max_model_len=256, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)

    def greedy():
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        completion = output.outputs[0]
        steps = zip(completion.logprobs, completion.token_ids)
        return {"prompt_token_ids": list(output.prompt_token_ids), "token_ids": list(completion.token_ids),
                "logprobs": [step[token].logprob for step, token in steps]}

    report = {"before": greedy()}
    llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_dir})
    llm.reset_prefix_cache()
    report["after"] = greedy()
    with open(out, "w") as f:
        json.dump(report, f)

if __name__ == "__main__":
    main()
"""


def run_helper(args: list[str], env: dict[str, str], timeout: float = 300) -> None:
    """Runs the helper in its own process group; kills that group by the child's PID on timeout."""
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"vLLM helper did not finish in {timeout} s")
    assert proc.returncode == 0, log.decode(errors="replace")[-4000:]


def hf_logprobs(model: Any, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """Log-probability of each completion token under `model`, by one forward pass. (T,)"""
    ids = torch.tensor([prompt_ids + token_ids])  # (1, P + T)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]  # (T, V)
    return torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(token_ids)[:, None])[:, 0]


@pytest.mark.vllm
def test_vllm_reloads_a_published_version_from_its_directory(
    tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    base = PRESETS["tiny"]
    model_dir = tmp_path / "model"
    build_model(base).save_pretrained(model_dir)
    build_tokenizer(base.vocab_chars, base.max_position).save_pretrained(model_dir)
    new_model = build_model(dataclasses.replace(base, seed=1))  # other weights, embeddings tied
    state = new_model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    publish_version(tmp_path / "weights", 1, state)
    verify_version(tmp_path / "weights", 1)

    helper, out = tmp_path / "helper.py", tmp_path / "report.json"
    helper.write_text(VLLM_HELPER)
    env = {**vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    weights_dir = version_dir(tmp_path / "weights", 1)
    run_helper([sys.executable, str(helper), str(model_dir), weights_dir, str(out), PROMPT], env)
    report = json.loads(out.read_text())

    after = report["after"]
    expected = hf_logprobs(new_model, after["prompt_token_ids"], after["token_ids"])
    assert torch.allclose(torch.tensor(after["logprobs"]), expected, atol=1e-4), (after["logprobs"], expected)
    assert report["before"]["logprobs"] != after["logprobs"]
