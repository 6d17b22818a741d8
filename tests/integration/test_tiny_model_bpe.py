"""The tiny model with the trained BPE tokenizer (`make-tiny-model --tokenizer bpe`): the saved folder loads
with transformers and with real vLLM on CPU, its vocabulary matches the model, and its tool chat template
passes the chat-template self-test, through the function and through `rlfabric config check-template`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfabric.cli import main
from rlfabric.rollout.chat_template import SELF_TEST_CONVERSATION, SELF_TEST_TOOLS, check_model_template
from rlfabric.tools.bpe_tokenizer import BPE_VOCAB_SIZE, TOOL_CHAT_TEMPLATE, TOOL_TOKENS, build_bpe_tokenizer
from rlfabric.tools.tiny_model import make_tiny_model

HELPER = Path(__file__).with_name("_vllm_generate.py")
SHOWN_CONTENT = "{%- if message['content'] -%}{{- '\\n' + message['content'] -}}{%- endif -%}"
DROPS_EARLIER_REASONING = (
    "{%- if message['content'] -%}{{- '\\n' + (message['content'] if loop.last else "
    "message['content'].split('</think>')[-1].lstrip('\\n')) -}}{%- endif -%}"
)
"""An assistant tool-call turn that is no longer last loses its `<think>` block (as Qwen3's template does)."""


@pytest.fixture(scope="module")
def bpe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-bpe"), tokenizer="bpe")


@pytest.fixture(scope="module")
def hf_tokenizer(bpe_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(bpe_model_dir)


def prompt_text(tokenizer: Any) -> str:
    """The self-test conversation up to the final answer, with the generation prompt."""
    return str(
        tokenizer.apply_chat_template(
            SELF_TEST_CONVERSATION[:5], tools=SELF_TEST_TOOLS, tokenize=False, add_generation_prompt=True
        )
    )


def test_saved_tokenizer_is_the_trained_one(hf_tokenizer: Any) -> None:
    built = build_bpe_tokenizer()
    text = prompt_text(built)
    assert type(hf_tokenizer).__name__ == "Qwen2Tokenizer"
    assert hf_tokenizer.chat_template == TOOL_CHAT_TEMPLATE
    assert prompt_text(hf_tokenizer) == text
    assert hf_tokenizer(text)["input_ids"] == built(text)["input_ids"]
    assert len(hf_tokenizer) == BPE_VOCAB_SIZE
    assert [len(hf_tokenizer(token)["input_ids"]) for token in TOOL_TOKENS] == [1, 1, 1, 1]


def test_model_vocabulary_matches_and_runs(bpe_model_dir: Path, hf_tokenizer: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(bpe_model_dir, dtype=torch.float32).eval()
    assert model.config.vocab_size == len(hf_tokenizer) == BPE_VOCAB_SIZE
    ids = torch.tensor([hf_tokenizer(prompt_text(hf_tokenizer))["input_ids"]])  # (1, T)
    with torch.no_grad():
        logits = model(ids).logits  # (1, T, V)
    assert logits.shape == (1, ids.shape[1], BPE_VOCAB_SIZE)


def test_self_test_passes_on_the_saved_folder(
    bpe_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check_model_template(bpe_model_dir).ok
    assert main(["config", "check-template", str(bpe_model_dir)]) == 0
    assert "self-test passed" in capsys.readouterr().out


def test_check_template_refuses_a_history_rewriting_template(
    bpe_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rewriting = tmp_path / "rewriting"
    shutil.copytree(bpe_model_dir, rewriting)
    template = TOOL_CHAT_TEMPLATE.replace(SHOWN_CONTENT, DROPS_EARLIER_REASONING)
    assert template != TOOL_CHAT_TEMPLATE
    (rewriting / "chat_template.jinja").write_text(template)
    assert main(["config", "check-template", str(rewriting)]) == 2
    err = capsys.readouterr().err
    assert "turn 2 (assistant): the template rewrites earlier turns" in err


@pytest.mark.vllm
def test_vllm_loads_the_bpe_model(
    bpe_model_dir: Path, hf_tokenizer: Any, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    prompt = prompt_text(hf_tokenizer)
    args = [sys.executable, str(HELPER), str(bpe_model_dir), "--out", str(out), f"--prompt={prompt}"]
    env = {**vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("vLLM helper did not finish in 240 s")
    assert proc.returncode == 0, log.decode(errors="replace")[-4000:]
    report = json.loads(out.read_text())
    print(f"vLLM start-up {report['startup_s']:.1f} s")
    for result in report["greedy"] + report["sampled"]:
        assert result["prompt_token_ids"] == hf_tokenizer(prompt)["input_ids"]
        assert len(result["token_ids"]) == 16
        assert max(result["token_ids"]) < BPE_VOCAB_SIZE
