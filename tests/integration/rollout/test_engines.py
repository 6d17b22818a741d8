"""Both rollout engines (real vLLM on CPU, and the transformers reference) pass the same behavioural
scenarios: per-sample streaming, logprobs equal to a forward pass of the serving weights, all-or-nothing
weight loads, cancel and abort. One engine per kind runs every scenario (`_engine_scenarios.py`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _engine_scenarios import (
    CHAT,
    LONG,
    PROMPT_TEXTS,
    SAMPLED,
    TEMPERED,
    WARM,
    build_engine,
    collect,
    run_scenarios,
)
from safetensors.torch import load_file, save_file

from rlfabric.rollout.engine import SamplingSettings
from rlfabric.rollout.hf_engine import HfEngine
from rlfabric.tools.tiny_model import EOS, IM_END, make_tiny_model, special_ids

HELPER = Path(__file__).with_name("_engine_scenarios.py")
STOP_IDS = (special_ids()[EOS], special_ids()[IM_END])
KINDS = ["transformers", "transformers-batched", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="module")
def weights(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Weight folders: `new` (same shapes, other seed: a full model folder), `wrong_shape` (one tensor
    resized) and `missing` (one tensor left out) derived from the base checkpoint."""
    root = tmp_path_factory.mktemp("weights")
    base = load_file(tiny_model_dir / "model.safetensors")
    wrong = {**base, "model.norm.weight": torch.ones(base["model.norm.weight"].shape[0] // 2)}
    missing = {k: v for k, v in base.items() if k != "model.layers.1.mlp.down_proj.weight"}
    folders = {"wrong_shape": wrong, "missing": missing}
    for name, tensors in folders.items():
        (root / name).mkdir()
        save_file(tensors, root / name / "model.safetensors")
    return {"new": make_tiny_model(root / "new", seed=1), **{n: root / n for n in folders}}


def run_vllm(model: Path, weights: dict[str, Path], env: dict[str, str], out: Path) -> dict[str, Any]:
    """The scenarios in a subprocess with vLLM's environment; its report.

    `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the CPU worker inside vLLM's engine-core process (the
    engine core itself stays a separate process under AsyncLLM): one process spawn fewer, engine start
    ~3x faster here; same AsyncLLM, collective_rpc and reload path as the default multiprocess executor."""
    env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    flags = [f"--{name.replace('_', '-')}={path}" for name, path in weights.items()]
    command = [sys.executable, str(HELPER), "vllm", str(model), *flags, f"--out={out}"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=KINDS)
def report(request: pytest.FixtureRequest, tiny_model_dir: Path, weights: dict[str, Path], tmp_path_factory):
    """One engine of each kind through every scenario."""
    if request.param == "vllm":
        env = request.getfixturevalue("vllm_env")
        out = tmp_path_factory.mktemp("vllm-report") / "report.json"
        return run_vllm(tiny_model_dir, weights, env, out)
    engine = build_engine(request.param, str(tiny_model_dir))
    return asyncio.run(run_scenarios(engine, {k: str(v) for k, v in weights.items()}))


def forward_logprobs(
    model_dir: Path, prompt: list[int], tokens: list[int], sampling: SamplingSettings = SAMPLED
) -> list[float]:
    """log p(tokens[i] | prompt + tokens[:i]) from one transformers forward pass (float32), under the
    distribution `sampling` draws from: logits / temperature, then top-k, then top-p (vLLM's rules)."""
    model = _model(model_dir)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (T, vocab)
    logits = truncate(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    chosen = logits.log_softmax(-1).gather(-1, torch.tensor(tokens).unsqueeze(-1))
    return chosen.squeeze(-1).tolist()


def truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits (T, vocab) with tokens outside the top k, then outside the top-p nucleus, set to -inf."""
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ascending, order = logits.sort(dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


_MODELS: dict[Path, Any] = {}


def _model(model_dir: Path) -> Any:
    """The transformers model of a folder, loaded once per test session."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _MODELS:
        _MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _MODELS[model_dir]


def max_logprob_error(
    samples: list[dict[str, Any]], model_dir: Path, sampling: SamplingSettings = SAMPLED
) -> float:
    """Largest |engine logprob - forward-pass logprob| over every token of every sample."""
    errors = [0.0]
    for s in samples:
        reference = forward_logprobs(model_dir, s["prompt_token_ids"], s["token_ids"], sampling)
        errors += [abs(a - b) for a, b in zip(s["logprobs"], reference, strict=True)]
    return max(errors)


def test_streams_every_sample_once(report: dict[str, Any]) -> None:
    samples = report["base"]
    keys = [(s["prompt_index"], s["sample_index"]) for s in samples]
    prompts = report["prompts"]
    assert sorted(keys) == [(p, s) for p in range(len(prompts)) for s in range(SAMPLED.n)]
    for s in samples:
        assert s["prompt_token_ids"] == prompts[s["prompt_index"]]
        assert 1 <= len(s["token_ids"]) == len(s["logprobs"]) <= SAMPLED.max_tokens
        assert s["finish_reason"] in ("stop", "length")
        if s["finish_reason"] == "length":
            assert len(s["token_ids"]) == SAMPLED.max_tokens
        else:  # no stop strings: stopped on an end-of-sequence token, kept as the last token
            assert s["token_ids"][-1] in STOP_IDS
        assert 0 < s["first_token_s"] <= s["total_s"]
        assert all(lp <= 0 for lp in s["logprobs"])


def test_text_is_the_decoded_completion(report: dict[str, Any], tiny_model_dir: Path) -> None:
    """Without stop strings vLLM's detokenizer is off and the text is decoded once from the final token
    ids; with a stop string (one that never matches) vLLM detokenizes as it generates. Same seeds, same
    tokens: the two texts agree, and equal the tokenizer's decode without the end-of-sequence token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = {(s["prompt_index"], s["sample_index"]): s for s in report["base"]}
    detokenized = {(s["prompt_index"], s["sample_index"]): s for s in report["detokenized"]}
    assert plain.keys() == detokenized.keys()
    for key, s in plain.items():
        assert s["token_ids"] == detokenized[key]["token_ids"]
        assert s["text"] == detokenized[key]["text"]
        kept = s["token_ids"][:-1] if s["finish_reason"] == "stop" else s["token_ids"]
        assert s["text"] == tokenizer.decode(kept, skip_special_tokens=True)
    assert any(s["text"] for s in plain.values())


def test_logprobs_match_forward_pass(report: dict[str, Any], tiny_model_dir: Path) -> None:
    assert max_logprob_error(report["base"], tiny_model_dir) <= 1e-4


def test_new_weights_serve_after_load(report: dict[str, Any], weights: dict[str, Path]) -> None:
    assert report["new_error"] is None
    assert max_logprob_error(report["new"], weights["new"]) <= 1e-4
    assert [s["token_ids"] for s in report["new"]] != [s["token_ids"] for s in report["base"]]


def test_logprobs_are_those_of_the_sampling_distribution(
    report: dict[str, Any], weights: dict[str, Path]
) -> None:
    """ "processed" logprobs (the default) follow temperature, top-k and top-p, and are never -inf."""
    assert max_logprob_error(report["tempered"], weights["new"], TEMPERED) <= 1e-4


def test_the_learner_trains_the_distribution_sampled_at_the_runs_temperature(
    report: dict[str, Any], weights: dict[str, Path]
) -> None:
    """The learner divides the logits by `rollout.sampling.temperature` (TRL's and verl's convention):
    its log-probs of the engine's samples at 0.7 are the engine's own, which at temperature 1 they are
    not (the policy it would train is not the one sampled)."""
    from rlfabric.learner.dist import init_distributed
    from rlfabric.learner.samples import GroupSamples, Rollout
    from rlfabric.learner.trainer import Trainer
    from rlfabric.runspec import RunSpec

    samples = sorted(report["warm"], key=lambda s: (s["prompt_index"], s["sample_index"]))  # step order
    groups = [
        GroupSamples(s["prompt_token_ids"], [Rollout(s["token_ids"], s["logprobs"], 0.0)]) for s in samples
    ]
    engine_sums = torch.tensor([sum(s["logprobs"]) for s in samples])
    world = init_distributed(torch.device("cpu"))
    learned = {}
    for temperature in (WARM.temperature, 1.0):
        spec = RunSpec.model_validate({
            "model": {"path": str(weights["new"]), "dtype": "float32"}, "dataset": {"path": "unused.jsonl"},
            "rollout": {"sampling": {"temperature": temperature}},
        })  # fmt: skip
        trainer = Trainer(spec, weights["new"], device=torch.device("cpu"), world=world)
        learned[temperature] = trainer.sequence_logprobs(groups)
    torch.testing.assert_close(learned[WARM.temperature], engine_sums, atol=1e-3, rtol=0)
    assert (learned[1.0] - engine_sums).abs().max() > 0.1


def test_mismatched_weights_are_refused_and_old_weights_serve(
    report: dict[str, Any], tiny_model_dir: Path
) -> None:
    rejected = report["rejected"]
    assert (
        rejected["wrong_shape"].startswith("WeightsRejected")
        and "model.norm.weight" in rejected["wrong_shape"]
    )
    assert rejected["missing"].startswith("WeightsRejected") and "down_proj" in rejected["missing"]
    assert max_logprob_error(report["after_rejected"], tiny_model_dir) <= 1e-4


def test_cancel_stops_engine_work(report: dict[str, Any]) -> None:
    cancel = report["cancel"]
    assert cancel["yielded"] < 3 * LONG.n
    assert cancel["tokens_after_stop"] == 0
    assert cancel["stats"]["running"] == cancel["stats"]["waiting"] == 0


def test_abort_ends_every_sample(report: dict[str, Any]) -> None:
    abort = report["abort"]
    samples = abort["samples"]
    keys = sorted((s["prompt_index"], s["sample_index"]) for s in samples)
    assert keys == [(p, s) for p in range(3) for s in range(LONG.n)]
    assert {s["finish_reason"] for s in samples} == {"abort"}
    assert all(len(s["token_ids"]) == len(s["logprobs"]) < LONG.max_tokens for s in samples)
    assert abort["tokens_after_stop"] == 0
    assert abort["stats"]["running"] == 0


def test_timings(report: dict[str, Any], record_property: Any) -> None:
    """Start time, reload time and throughput, recorded in the JUnit properties for the report."""
    bench = report["throughput"]
    for key in ("start_s", "reload_s"):
        record_property(f"{report['kind']}_{key}", round(report[key], 3))
    record_property(f"{report['kind']}_tokens_per_s", round(bench["tokens_per_s"]))
    print(f"{report['kind']}: start {report['start_s']:.1f} s, reload {report['reload_s']:.3f} s, {bench}")
    assert bench["tokens"] == 4 * 3 * 4 * 64


BATCHED = dataclasses.replace(TEMPERED, seed=None)
"""TEMPERED unseeded: a batching engine generates such requests together."""


def test_concurrent_requests_share_one_batch_and_keep_their_logprobs(tiny_model_dir: Path) -> None:
    """Three requests at once, prompts of different lengths (left-padded together): one `generate`
    call, every sample's logprobs those of its own prompt under the tempered, truncated distribution; a
    seeded request runs by itself."""

    async def scenario() -> tuple[list[list[dict[str, Any]]], int, int]:
        engine = HfEngine(str(tiny_model_dir), dtype="float32", max_model_len=512, batch_prompts=8)
        await engine.start()
        prompts = [engine.tokenize_text(t) for t in PROMPT_TEXTS] + [engine.tokenize_chat(CHAT)]
        assert len({len(p) for p in prompts}) == 3
        requests = [collect(engine.generate(f"r{i}", [p], BATCHED)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*requests)
        batches = engine.batches
        await collect(engine.generate("seeded", prompts, TEMPERED))
        return results, batches, engine.batches

    results, batches, after_seeded = asyncio.run(scenario())
    assert batches == 1 and after_seeded == 1
    samples = [s for result in results for s in result]
    assert [len(result) for result in results] == [BATCHED.n] * 3
    assert {s["prompt_index"] for s in samples} == {0}
    assert max_logprob_error(samples, tiny_model_dir, BATCHED) <= 1e-4


def test_an_abort_in_a_batch_stops_only_its_rows(tiny_model_dir: Path) -> None:
    """Two requests in one batch; aborting one ends its samples where they stopped (no padding after
    them: their logprobs still match a forward pass) while the other runs to max_tokens."""

    async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        engine = HfEngine(str(tiny_model_dir), dtype="float32", max_model_len=512, batch_prompts=8)
        await engine.start()
        prompts = [engine.tokenize_text(t) for t in PROMPT_TEXTS[:2]]
        kept = asyncio.create_task(collect(engine.generate("kept", [prompts[0]], LONG)))
        cut = asyncio.create_task(collect(engine.generate("cut", [prompts[1]], LONG)))
        while engine.stats().tokens_generated < 40 * 2 * LONG.n:
            await asyncio.sleep(0.01)
        await engine.abort("cut")
        return await kept, await cut

    kept, cut = asyncio.run(scenario())
    assert {s["finish_reason"] for s in cut} == {"abort"}
    assert all(40 <= len(s["token_ids"]) < LONG.max_tokens for s in cut)
    assert {s["finish_reason"] for s in kept} == {"length"}
    assert all(len(s["token_ids"]) == LONG.max_tokens for s in kept)
    assert max_logprob_error(cut + kept, tiny_model_dir, LONG) <= 1e-4
