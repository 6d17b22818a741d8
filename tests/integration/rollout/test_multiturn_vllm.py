"""Multi-turn trajectories as users run them: `rlfabric serve rollout` (real vLLM on CPU) playing tasks
against `rlfabric serve environment` (a real process, its token required), over real gRPC.

The model is the BPE tiny model rigged to end a turn after ~12 tokens (`make-tiny-model --turn-length`),
the environment a user class that answers each turn and is done after three. Checked on every
trajectory: the tokens with loss mask 1 are exactly the engine's (their log-probs equal a transformers
forward pass over the whole trajectory: no token the engine did not sample, at the positions it sampled
them), the environment's tokens decode to the template's rendering of its messages, the turns partition
the completion, and the turns after the first found their prefix in vLLM's cache.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from rlfabric.contracts import wire
from rlfabric.local.procs import ServiceProcess
from rlfabric.tools.tiny_model import make_tiny_model
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.vllm
ENV_TOKEN = "environment-token"
USER_ENV = '''
from rlfabric.environment.base import Environment
from rlfabric.environment.types import Observation, StepResult


class Echo(Environment):
    """Answers each model turn with how many turns are left; done (reward 1) after `turns`."""

    def reset(self, task, *, seed=None):
        if task.get("fail"):
            raise RuntimeError("no such task")
        self.left = int(task["turns"])
        return Observation([{"role": "user", "content": task["prompt"]}])

    def step(self, action):
        self.left -= 1
        message = {"role": "user", "content": f"{self.left} to go, you said {len(action)} characters"}
        return StepResult([] if self.left == 0 else [message], reward=0.5, done=self.left == 0)
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bpe-model"), tokenizer="bpe", turn_length=12)


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("env")
    (folder / "echo.py").write_text(USER_ENV)
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
        "--set", f"environment.address={environment}",
    ]  # fmt: skip
    env = {**vllm_env, "RLFABRIC_ROLLOUT__ENVIRONMENT__TOKEN": ENV_TOKEN}
    log = tmp_path_factory.mktemp("multiturn-replica") / "rollout.log"
    proc = ServiceProcess("rollout", argv, log_path=log, env=env)
    address = proc.start(r"listening on (\S+)", timeout_s=300).group(1)
    proc.wait_for(r"serving version", timeout_s=300)
    assert "chat template self-test passed" in log.read_text()
    yield address
    assert proc.stop(grace_s=30) == 0


def play(replica: str, tasks: list[dict[str, object]], n: int = 2) -> list[rollout_pb2.GeneratedSample]:
    request = rollout_pb2.GenerateRequest(
        request_id=f"mt-{torch.randint(1 << 30, ()).item()}",
        prompts=[
            rollout_pb2.GeneratePrompt(prompt_id=f"p{i}", task_json=json.dumps(task))
            for i, task in enumerate(tasks)
        ],
        sampling=rollout_pb2.SamplingParams(n=n, temperature=1.0, max_tokens=96, seed=3),
        multi_turn=rollout_pb2.MultiTurn(max_turns=5),
    )
    with grpc.insecure_channel(replica) as channel:
        return list(rollout_pb2_grpc.RolloutServiceStub(channel).Generate(request, timeout=300))


def forward_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_trajectories_carry_exactly_the_sampled_tokens(replica: str, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = play(
        replica,
        [
            {
                "prompt": "Say something, anything at all: a word, a sentence or a story about the sea.",
                "turns": 3,
            },
            {"prompt": "Hello!", "turns": 3},
        ],
    )
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    done = [s for s in samples if s.trajectory.status == rollout_pb2.TRAJECTORY_STATUS_DONE]
    assert len(done) >= 3, [(s.trajectory.status, s.trajectory.message) for s in samples]
    for s in done:
        t = s.trajectory
        mask = list(t.loss_mask)
        assert len(mask) == len(s.token_ids) == len(s.logprobs)
        roles = [turn.role for turn in t.turns]
        assert roles == [common_pb2.TURN_ROLE_MODEL, common_pb2.TURN_ROLE_ENVIRONMENT] * 2 + [
            common_pb2.TURN_ROLE_MODEL
        ]
        starts = [turn.start for turn in t.turns] + [len(s.token_ids)]
        for turn, start, end in zip(t.turns, starts, starts[1:], strict=False):
            assert set(mask[start:end]) == {1 if turn.role == common_pb2.TURN_ROLE_MODEL else 0}
        # the policy's tokens: each model turn ends with <|im_end|>, log-probs as a forward pass gives
        model_ends = [
            s.token_ids[end - 1] for turn, end in zip(t.turns, starts[1:], strict=False) if turn.role == 1
        ]
        assert {tokenizer.decode([i]) for i in model_ends} == {"<|im_end|>"}
        expected = forward_logprobs(model_dir, list(s.prompt_token_ids), list(s.token_ids))
        policy = torch.tensor(mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(list(s.logprobs))[policy], expected[policy], atol=1e-4)
        # the environment's tokens: its message rendered by the template, then the generation prompt
        env_text = tokenizer.decode(s.token_ids[t.turns[1].start : t.turns[2].start])
        assert env_text.startswith("\n<|im_start|>user\n2 to go, you said ")
        assert env_text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert [m.role for m in t.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
        assert s.text == t.messages[-1].content and t.turns[-1].reward == 0.5
        assert t.cached_prompt_tokens > 0 and t.prompt_tokens > t.cached_prompt_tokens
        assert s.finish_reason == common_pb2.FINISH_REASON_STOP


def test_an_environment_failure_is_a_status(replica: str) -> None:
    samples = play(replica, [{"prompt": "x", "turns": 2, "fail": True}], n=1)
    assert [wire.trajectory_status_from_proto(s.trajectory.status) for s in samples] == ["env_error"]
    assert "no such task" in samples[0].trajectory.message and list(samples[0].token_ids) == []


def test_max_turns_truncates(replica: str) -> None:
    samples = play(replica, [{"prompt": "x", "turns": 50}], n=2)
    for s in samples:
        assert wire.trajectory_status_from_proto(s.trajectory.status) == "truncated"
        assert s.finish_reason == common_pb2.FINISH_REASON_LENGTH
