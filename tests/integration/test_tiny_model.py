"""The tiny model folder loads and generates with transformers and with real vLLM on CPU, and both agree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfabric.tools.tiny_model import (
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    PRESETS,
    build_model,
    build_tokenizer,
    special_ids,
)

HELPER = Path(__file__).with_name("_vllm_generate.py")
TEXT = "Hello, world!\n  two  spaces\tand a tab ~{}|"
PROMPTS = ["Hello, world", "a b\nc", "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_tokenizer_round_trips_and_matches_model(hf_tokenizer: Any, hf_model: Any) -> None:
    ids = hf_tokenizer(TEXT)["input_ids"]
    assert len(ids) == len(TEXT)
    assert hf_tokenizer.decode(ids) == TEXT
    assert len(hf_tokenizer) == hf_model.config.vocab_size == PRESETS["tiny"].vocab_size
    assert ids == build_tokenizer()(TEXT)["input_ids"]


def test_saved_special_tokens_and_generation_config(tiny_model_dir: Path, hf_tokenizer: Any) -> None:
    ids = special_ids()
    assert hf_tokenizer.eos_token_id == ids[EOS]
    assert hf_tokenizer.convert_tokens_to_ids(IM_END) == ids[IM_END]
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids[EOS], ids[IM_END]]
    assert hf_tokenizer.chat_template == CHAT_TEMPLATE


def test_chat_template_renders(hf_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered == expected
    assert hf_tokenizer.apply_chat_template(messages, tokenize=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )
    ids = hf_tokenizer(rendered)["input_ids"]
    assert ids.count(hf_tokenizer.convert_tokens_to_ids(IM_END)) == 2


def test_generates_greedy_and_sampled(hf_model: Any, hf_tokenizer: Any) -> None:
    hf_tokenizer.padding_side = "left"
    batch = hf_tokenizer(["Hello", "abc"], return_tensors="pt", padding=True)
    greedy = [hf_model.generate(**batch, max_new_tokens=8, do_sample=False) for _ in range(2)]
    assert greedy[0].shape == (2, batch["input_ids"].shape[1] + 8)
    assert torch.equal(greedy[0], greedy[1])
    torch.manual_seed(0)
    sampled = hf_model.generate(**batch, max_new_tokens=32, do_sample=True, temperature=1.0)
    new = sampled[:, batch["input_ids"].shape[1] :]
    assert int(new.max()) < hf_model.config.vocab_size
    assert len(set(new.flatten().tolist())) > 2
    assert isinstance(hf_tokenizer.decode(new[0], skip_special_tokens=True), str)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_count_formula(preset: str) -> None:
    spec = PRESETS[preset]
    assert build_model(spec).num_parameters() == spec.num_parameters()


def run_vllm(model_dir: Path, out: Path, env: dict[str, str], timeout: float = 240) -> dict[str, Any]:
    """Run the vLLM helper in its own process group; kill that group by the child's PID on timeout."""
    args = [sys.executable, str(HELPER), str(model_dir), "--out", str(out), "--max-tokens", "24"]
    args += [f"--prompt={prompt}" for prompt in PROMPTS]
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
    return json.loads(out.read_text())


def hf_logprobs(model: Any, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """Log-probabilities over the vocabulary at each completion position, by one forward pass. (T, V)"""
    ids = torch.tensor([prompt_ids + token_ids])  # (1, P + T)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]  # (T, V)
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def vllm_report(
    tiny_model_dir: Path, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Any:
    # One process for the engine and its worker: start-up ~3 s instead of ~20 s of spawning.
    env = {**vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return run_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm-out") / "result.json", env)


@pytest.mark.vllm
def test_vllm_generates_with_logprobs(vllm_report: dict[str, Any], hf_tokenizer: Any) -> None:
    print(f"vLLM start-up {vllm_report['startup_s']:.1f} s, generate {vllm_report['generate_s']:.2f} s")
    for mode in ("greedy", "sampled"):
        for prompt, result in zip(PROMPTS, vllm_report[mode], strict=True):
            assert result["prompt_token_ids"] == hf_tokenizer(prompt)["input_ids"]
            assert len(result["token_ids"]) == len(result["logprobs"]) == 24
            assert result["text"] == hf_tokenizer.decode(result["token_ids"], skip_special_tokens=True)
            assert all(lp <= 0 for lp in result["logprobs"])


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_vllm_logprobs_match_transformers(vllm_report: dict[str, Any], hf_model: Any, mode: str) -> None:
    for result in vllm_report[mode]:
        logprobs = hf_logprobs(hf_model, result["prompt_token_ids"], result["token_ids"])  # (T, V)
        expected = logprobs.gather(1, torch.tensor(result["token_ids"])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result["logprobs"]), expected, atol=1e-4, rtol=0)


@pytest.mark.vllm
def test_vllm_greedy_is_transformers_argmax(vllm_report: dict[str, Any], hf_model: Any) -> None:
    for result in vllm_report["greedy"]:
        logprobs = hf_logprobs(hf_model, result["prompt_token_ids"], result["token_ids"])  # (T, V)
        assert logprobs.argmax(dim=-1).tolist() == result["token_ids"]
