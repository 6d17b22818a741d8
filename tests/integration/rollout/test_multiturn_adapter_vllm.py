"""A multi-turn request on a LoRA adapter: `rlfabric serve rollout` (real vLLM on CPU, `max_adapters=1`)
playing against `rlfabric serve environment` (real processes, real gRPC).

Every model turn of every trajectory is generated with the adapter version admitted at the start: the
policy's tokens (loss mask 1) have the log-probs of a transformers + PEFT forward pass over the whole
trajectory, not the base model's, and every sample carries the adapter's version.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from rlfabric.local.procs import ServiceProcess
from rlfabric.tools.tiny_model import make_tiny_model
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from rlfabric.weights.adapters import publish_adapter

pytestmark = pytest.mark.vllm
ENV_TOKEN = "environment-token"
ECHO_ENV = '''
from rlfabric.environment.base import Environment
from rlfabric.environment.types import Observation, StepResult


class Echo(Environment):
    """Answers each model turn with how many turns are left; done after `turns`."""

    def reset(self, task, *, seed=None):
        self.left = int(task["turns"])
        return Observation([{"role": "user", "content": task["prompt"]}])

    def step(self, action):
        self.left -= 1
        message = {"role": "user", "content": f"{self.left} to go"}
        return StepResult([] if self.left == 0 else [message], reward=0.5, done=self.left == 0)
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bpe-model"), tokenizer="bpe", turn_length=12)


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("env")
    (folder / "echo.py").write_text(ECHO_ENV)
    spec = json.dumps({"kind": "python", "ref": f"{folder}/echo.py:Echo"})
    argv = [sys.executable, "-m", "rlfabric.cli", "serve", "environment", "--port", "0"]
    argv += ["--set", f"environment={spec}", "--set", f"allowed_functions={json.dumps([str(folder)])}"]
    env = {**os.environ, "RLFABRIC_ENVIRONMENT__TOKEN": ENV_TOKEN}
    proc = ServiceProcess("environment", argv, log_path=folder / "environment.log", env=env)
    yield proc.start(r"listening on (\S+)", timeout_s=60).group(1)
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def replica(
    model_dir: Path, environment: str, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    argv = [
        sys.executable, "-m", "rlfabric.cli", "serve", "rollout", "--model", str(model_dir), "--port", "0",
        "--insecure", "--set", "engine.enforce_eager=true", "--set", "engine.kv_cache_bytes=268435456",
        "--set", "engine.max_model_len=1024", "--set", "engine.block_size=32", "--set", "log.format=text",
        "--set", "engine.dtype=float32", "--set", "engine.max_adapters=1",
        "--set", "engine.max_adapter_rank=8", "--set", f"environment.address={environment}",
    ]  # fmt: skip
    env = {**vllm_env, "RLFABRIC_ROLLOUT__ENVIRONMENT__TOKEN": ENV_TOKEN}
    log = tmp_path_factory.mktemp("multiturn-adapter-replica") / "rollout.log"
    proc = ServiceProcess("rollout", argv, log_path=log, env=env)
    address = proc.start(r"listening on (\S+)", timeout_s=300).group(1)
    proc.wait_for(r"serving version", timeout_s=300)
    yield address
    assert proc.stop(grace_s=30) == 0


def peft_model(model_dir: Path) -> Any:
    """The model with a random, non-zero rank-8 LoRA adapter on the MLP projections, scaled down so that the
    model still ends its turns (the tiny model's rigging, `end_turns_after`, lives in the last attention)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(21)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.1)
    return model


def forward_logprobs(model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_every_turn_is_generated_with_the_adapter(replica: str, model_dir: Path, tmp_path: Path) -> None:
    from peft import get_peft_model_state_dict

    model = peft_model(model_dir)
    config = {
        k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config["default"].to_dict().items()
    }
    publish_adapter(tmp_path, 4, get_peft_model_state_dict(model), config)
    request = rollout_pb2.GenerateRequest(
        request_id="mt-adapter",
        prompts=[
            rollout_pb2.GeneratePrompt(prompt_id="p", task_json=json.dumps({"prompt": "Hi!", "turns": 2}))
        ],
        sampling=rollout_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=128, seed=3),
        multi_turn=rollout_pb2.MultiTurn(max_turns=2),
        adapter="run",
    )
    with grpc.insecure_channel(replica) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        source = rollout_pb2.ObjectStoreSource(root_url=str(tmp_path))
        stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=4, adapter="run", object_store=source))
        samples = list(stub.Generate(request, timeout=300))
    assert len(samples) == 2 and {s.policy_version for s in samples} == {4}
    for s in samples:
        mask = torch.tensor(list(s.trajectory.loss_mask), dtype=torch.bool)
        assert len(s.trajectory.turns) >= 2, s.trajectory  # at least one environment turn in between
        got = torch.tensor(list(s.logprobs))[mask]
        expected = forward_logprobs(model, list(s.prompt_token_ids), list(s.token_ids))[mask]
        assert torch.allclose(got, expected, atol=1e-4), (got, expected)
        with model.disable_adapter():
            base = forward_logprobs(model, list(s.prompt_token_ids), list(s.token_ids))[mask]
        assert (got - base).abs().max() > 1e-3  # ten times the tolerance of the match above
