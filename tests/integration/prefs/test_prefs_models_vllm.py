"""The preference pipeline's model-backed pieces against real engines on CPU, with the tiny random model:
the rollout generator against `rlfabric serve rollout` (vLLM) over gRPC, and the OpenAI generator and the
LLM pairwise judge against vLLM's own OpenAI-compatible server.

The random model never writes a verdict, so every judgement is "error" (its raw text kept): what is
tested here is the plumbing (requests reach the server, n completions come back, a failure is an error
and never a preference). Verdict parsing and the judge's first/second mapping are unit-tested
(tests/unit/prefs). Both engines start together (~30 s on two cores).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rlfabric.local.procs import ServiceProcess
from rlfabric.prefs.generation import (
    GenerationError,
    GeneratorUnusable,
    OpenAIGeneratorSpec,
    RolloutGeneratorSpec,
    make_generator,
)
from rlfabric.prefs.llm_judge import LlmJudgeSpec, LlmPairwiseJudge
from rlfabric.prefs.types import Comparison

pytestmark = pytest.mark.vllm
API_KEY = "sk-test-vllm"
KEY_ENV = "RLF_TEST_PREFS_VLLM_KEY"
MAX_MODEL_LEN = 256
"""The replica's context: a longer prompt is refused (INVALID_ARGUMENT)."""
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


@dataclass(frozen=True)
class Engines:
    replica: str
    """The rollout replica's gRPC address."""
    openai: str
    """vLLM's OpenAI-compatible API root."""
    model: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    """A rollout replica and vLLM's OpenAI server, launched together, stopped by PID afterwards."""
    logs = tmp_path_factory.mktemp("prefs-engines")
    replica = ServiceProcess(
        "rollout",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "rollout", "--model", str(tiny_model_dir),
            "--port", "0", "--insecure", "--set", "engine.enforce_eager=true",
            "--set", "engine.kv_cache_bytes=268435456", "--set", f"engine.max_model_len={MAX_MODEL_LEN}",
            "--set", "log.format=text", "--set", "max_tokens=64",
        ],
        log_path=logs / "rollout.log",
        env=vllm_env,
    )  # fmt: skip
    port = free_port()
    server = ServiceProcess(
        "vllm-openai",
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
            "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
        ],
        log_path=logs / "vllm-openai.log",
        env={**vllm_env, "VLLM_API_KEY": API_KEY},
    )  # fmt: skip
    replica.launch()
    server.launch()
    try:
        address = replica.wait_for(r"listening on (\S+)", timeout_s=300).group(1)
        replica.wait_for(r"serving version", timeout_s=300)
        server.wait_for(r"Application startup complete", timeout_s=300)
        yield Engines(address, f"http://127.0.0.1:{port}/v1", tiny_model_dir)
    finally:
        assert server.stop(grace_s=30) is not None
        assert replica.stop(grace_s=30) == 0


def requests_served(engines: Engines) -> float:
    """vLLM's count of finished requests (its Prometheus /metrics)."""
    text = httpx.get(engines.openai.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


async def test_rollout_generator_samples_k_completions_per_prompt(engines: Engines) -> None:
    prompts = ["hello world", CHAT, "abc"]
    async with make_generator(RolloutGeneratorSpec(address=engines.replica, batch_size=2)) as gen:
        out = await gen.generate(prompts, n=3, max_tokens=12, temperature=1.0, seed=5)
        again = await gen.generate(prompts, n=3, max_tokens=12, temperature=1.0, seed=5)
        described = gen.describe()
    assert [len(texts) for texts in out] == [3, 3, 3]
    assert all(isinstance(t, str) for texts in out for t in texts)
    assert all(len(set(texts)) > 1 for texts in out)  # sampled, not one completion copied
    assert out == again  # seeded
    assert described["kind"] == "rollout" and described["model"] == str(engines.model)
    assert described["engine"] == "vllm" and len(described["policy_versions"]) == 1


async def test_rollout_generator_fails_only_the_prompt_the_replica_refuses(engines: Engines) -> None:
    too_long = "x" * (MAX_MODEL_LEN + 10)
    async with make_generator(RolloutGeneratorSpec(address=engines.replica, chat_template=False)) as gen:
        ok, refused = await gen.generate_each(["fine", too_long], n=2, max_tokens=8)
    assert isinstance(ok, list) and len(ok) == 2
    assert isinstance(refused, GenerationError) and "INVALID_ARGUMENT" in str(refused)


async def test_openai_generator_against_vllms_server(
    engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    spec = OpenAIGeneratorSpec(base_url=engines.openai, model="tiny", api_key_env=KEY_ENV)
    before = requests_served(engines)
    async with make_generator(spec) as gen:
        out = await gen.generate(["hello", CHAT], n=4, max_tokens=8, temperature=1.0, seed=3)
        described = gen.describe()
    assert [len(texts) for texts in out] == [4, 4]
    assert all(len(set(texts)) > 1 for texts in out)
    assert requests_served(engines) - before == 8  # vLLM counts each of the n sequences
    assert described["served_models"] == ["tiny"] and API_KEY not in str(described)
    monkeypatch.setenv(KEY_ENV, "wrong")
    async with make_generator(spec) as gen:
        with pytest.raises(GeneratorUnusable, match="HTTP 401"):
            await gen.generate(["hello"])


async def test_llm_judge_against_vllms_server(engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    generator = {"kind": "openai", "base_url": engines.openai, "model": "tiny", "api_key_env": KEY_ENV}
    judge = LlmPairwiseJudge(LlmJudgeSpec(name="tiny-judge", generator=generator, max_tokens=24))
    pairs = [
        Comparison("What is 2+2?", "4", "5", reference="4"),
        Comparison("What is 2+2?", "5", "4", reference="4"),
    ]
    pairs.append(Comparison(CHAT, "Hi!", "Go away."))
    before = requests_served(engines)
    try:
        judgements = await judge.judge(pairs)
        described = judge.describe()
    finally:
        await judge.close()
    assert requests_served(engines) - before == len(pairs)
    assert [j.preference for j in judgements] == ["error"] * 3  # a random model writes no verdict
    assert described["generator"]["served_models"] == ["tiny"] and API_KEY not in str(described)


async def test_llm_judge_through_a_replica_counts_refused_requests_as_errors(engines: Engines) -> None:
    """The default template alone is longer than the replica's context: every request is refused, and
    every judgement is an error naming why, never a preference."""
    spec = LlmJudgeSpec(generator={"kind": "rollout", "address": engines.replica}, max_tokens=8)
    judge = LlmPairwiseJudge(spec)
    try:
        judgements = await judge.judge([Comparison("q", "a", "b"), Comparison("q", "b", "a")])
    finally:
        await judge.close()
    assert [j.preference for j in judgements] == ["error", "error"]
    assert all("INVALID_ARGUMENT" in j.detail for j in judgements)
