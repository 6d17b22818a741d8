"""An environment written for TRL's `environment_factory` (examples/trl_key_value_env.py), unchanged, in
TRL itself and in rlfabric's environment service.

TRL side: a real `trl.GRPOTrainer(environment_factory=...)` on a tiny local model accepts the class (and
its zero-argument factory), and one training step runs TRL's own reset and tool-calling loop on a
scripted model turn (the generation is replaced by fixed token ids; everything after it is TRL's): the
prompt TRL renders, the tool messages it builds and the reward `get_reward` gives are recorded.

rlfabric side: `rlfabric serve environment` as a real process with `kind = "trl"`, called over gRPC with
the same row and the same model turn, answers the same prompt, tool messages and reward; a ref outside
`allowed_functions` stops the service at start.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlfabric.environment import base
from rlfabric.environment.client import AsyncEnvironmentClient
from rlfabric.local.procs import ServiceProcess
from rlfabric.runtime.user_code import FunctionAllowlist, load_reference

TOKEN = "trl-environment-suite-token"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
REF = f"{EXAMPLES}/trl_key_value_env.py:KeyValueEnv"
ROW = {
    "prompt": [{"role": "user", "content": "What is the city?"}],
    "facts": {"city": "Oslo", "code": "7", "color": "blue"},
    "key": "city",
}
CALLS = [
    {"name": "lookup", "arguments": {"key": "city"}},
    {"name": "lookup", "arguments": {"key": "planet"}},
    {"name": "answer", "arguments": {"value": "Oslo"}},
    {"name": "count", "arguments": {"prefix": "c"}},  # async: GRPOTrainer answers those after the sync ones
]
TOOL_TURN = "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in CALLS)
FINAL_TURN = "It is Oslo."


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlfabric.cli", "serve", "environment", "--port", "0", *args]


def trl_settings(ref: str) -> list[str]:
    environment = json.dumps({"kind": "trl", "ref": ref})
    settings = [f"environment={environment}", f"allowed_functions={json.dumps([str(EXAMPLES)])}"]
    return [arg for setting in [*settings, "log.format=text"] for arg in ("--set", setting)]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `serve environment` process running the example TRL environment; yields its address."""
    log = tmp_path_factory.mktemp("trl-env") / "service.log"
    env = {**os.environ, "RLFABRIC_ENVIRONMENT__TOKEN": TOKEN}
    proc = ServiceProcess("trl-env", cli(*trl_settings(REF)), log_path=log, env=env)
    yield proc.start(r"listening on (\S+)", timeout_s=60).group(1)
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One GRPOTrainer step on ROW with a scripted model: the prompt TRL rendered, the completion (the
    assistant turns and TRL's tool messages), the reward logged for the environment, and the tools."""
    trl = pytest.importorskip("trl")
    trainer = grpo_trainer(trl, tmp_path_factory.mktemp("grpo"), load_reference(REF, allowlist()))
    seen: dict[str, Any] = {"tools": list(trainer.tools), "reward_names": list(trainer.reward_func_names)}
    script_the_model(trainer, seen)
    trainer.train()
    seen["logged"] = trainer.state.log_history[0]
    return seen


def allowlist() -> FunctionAllowlist:
    return FunctionAllowlist.parse([str(EXAMPLES)])


def grpo_trainer(trl: Any, out: Path, factory: Any) -> Any:
    """A GRPOTrainer on a tiny local model with TRL's Qwen2.5 chat template (one TRL knows how to parse),
    no reward function but the environment's `get_reward`."""
    from datasets import Dataset
    from trl.chat_template_utils import qwen2_5_chat_template

    from rlfabric.tools.tiny_model import TinyModelSpec, build_model, spec_tokenizer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    spec = TinyModelSpec(tokenizer="bpe", layers=1, hidden=64, heads=2)
    tokenizer = spec_tokenizer(spec)
    tokenizer.chat_template = qwen2_5_chat_template
    args = trl.GRPOConfig(
        output_dir=str(out), use_cpu=True, report_to=[], save_strategy="no", max_steps=1, logging_steps=1,
        per_device_train_batch_size=2, num_generations=2, max_completion_length=512,
    )  # fmt: skip
    return trl.GRPOTrainer(
        model=build_model(spec),
        reward_funcs=None,
        args=args,
        train_dataset=Dataset.from_list([ROW]),
        processing_class=tokenizer,
        environment_factory=factory,
    )


def script_the_model(trainer: Any, seen: dict[str, Any]) -> None:
    """Replaces generation by TOOL_TURN, then FINAL_TURN; records the prompts TRL renders and the
    completions it scores (with its tool messages)."""
    import torch

    tokenize, turns = trainer._tokenize_prompts, iter([TOOL_TURN, FINAL_TURN])

    def tokenize_prompts(prompts: list[Any]) -> Any:
        seen.setdefault("prompts", copy.deepcopy(prompts))  # TRL's tool loop extends them in place
        return tokenize(prompts)

    def generate(prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> tuple[list[list[int]], None]:
        ids = trainer.processing_class.encode(next(turns) + "<|im_end|>", add_special_tokens=False)
        return [list(ids) for _ in prompt_ids], None

    def record(completions: list[Any], **kwargs: Any) -> list[float]:
        seen.setdefault("completion", completions[0])
        return [0.0] * len(completions)

    trainer._tokenize_prompts, trainer._generate_single_turn = tokenize_prompts, generate
    trainer.reward_funcs.append(record)
    trainer.reward_func_names.append("record")
    trainer.reward_processing_classes.append(None)
    trainer.reward_weights = torch.cat([trainer.reward_weights, torch.zeros(1)])


def test_grpo_trainer_accepts_the_class_and_its_factory_function(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    make_env = load_reference(f"{EXAMPLES}/trl_key_value_env.py:make_env", allowlist())
    trainer = grpo_trainer(trl, tmp_path, make_env)
    assert [tool.__name__ for tool in trainer.tools] == ["answer", "count", "lookup"]
    assert trainer.reward_func_names == ["KeyValueEnv"]


async def test_the_service_answers_what_trl_does(service: str, trl_run: dict[str, Any]) -> None:
    from transformers.utils import get_json_schema

    async with AsyncEnvironmentClient(service, token=TOKEN) as client:
        reset = await client.reset(ROW)
        assert reset.status == "ok", reset.message
        assert reset.observation.messages == trl_run["prompts"][0]
        trl_schemas = [get_json_schema(tool) for tool in trl_run["tools"]]
        for schema in trl_schemas:
            schema["function"].pop("return", None)  # not carried by rlfabric's ToolSchema
        assert [tool.as_openai() for tool in reset.observation.tools] == trl_schemas
        step = await client.step(reset.session_id, TOOL_TURN)
        final = await client.step(reset.session_id, FINAL_TURN)
        await client.close(reset.session_id)
    trl_tools = [m for m in trl_run["completion"] if m["role"] == "tool"]
    assert [m["content"] for m in trl_tools] == [
        "Oslo",
        "{'error': \"no key 'planet'\"}",
        "{'recorded': 'Oslo'}",
        "3",
    ]
    # over gRPC a tool message's name travels in the step's tool_calls, one per message
    records = zip(step.result.tool_calls, step.result.messages, strict=True)
    assert [{"role": "tool", "name": c.name, "content": m["content"]} for c, m in records] == trl_tools
    assert step.result.info == {"tool_calls": "4", "tool_errors": "1"} and not step.result.done
    logged = trl_run["logged"]
    assert (logged["tools/call_frequency"], logged["tools/failure_frequency"]) == (4.0, 0.25)
    assert trl_run["reward_names"] == ["KeyValueEnv"]
    assert (final.status, final.result.done, final.result.reward) == ("ok", True, 1.0)
    assert logged["rewards/KeyValueEnv/mean"] == 1.0


def test_a_ref_outside_allowed_functions_stops_the_service() -> None:
    argv = cli(*trl_settings(f"{base.__file__}:Environment"), "--insecure")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "listening" not in result.stdout
    assert "environment.ref:" in result.stderr and "is not in allowed_functions" in result.stderr
