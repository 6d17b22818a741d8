"""Sanity of the memory formulas: how the lines move with world size, micro-batch, checkpointing, roles."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlfabric.plan.arch import ModelArch
from rlfabric.plan.memory import (
    CPU_BLOCK_TOKENS,
    LearnerShape,
    RoleMemory,
    kv_cache_needed,
    learner_memory,
    learner_shape,
    rank_total,
    reward_model_memory,
    rollout_memory,
)
from rlfabric.runspec import RunSpec

ARCH = ModelArch(
    model_type="qwen2",
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=1280,
    vocab_size=32000,
    tie_word_embeddings=False,
)
SHAPE = LearnerShape(world=1, micro_batch=4, seq_len=512, dtype="float32")
SHARDED = ("weights", "gradients", "optimizer states")


def spec(**overrides: object) -> RunSpec:
    data: dict[str, object] = {"model": {"path": "m", "dtype": "float32"}, "dataset": {"path": "d.jsonl"}}
    data.update(overrides)
    return RunSpec.model_validate(data)


def line(role: RoleMemory, name: str) -> int:
    (found,) = [x.bytes for x in role.lines if x.name == name]
    return found


def test_every_line_has_a_formula_and_nonnegative_bytes() -> None:
    for role in learner_memory(replace(SHAPE, critic=True, reference=True), ARCH):
        assert role.total == sum(x.bytes for x in role.lines)
        for x in role.lines:
            assert x.bytes >= 0 and x.formula


def test_world_two_halves_the_sharded_lines() -> None:
    (one,) = learner_memory(replace(SHAPE, world=2), ARCH)
    (four,) = learner_memory(replace(SHAPE, world=4), ARCH)
    p = ARCH.params()
    assert line(one, "weights") == p * 4 // 2 and line(four, "weights") == p * 4 // 4
    for name in SHARDED:
        assert line(four, name) == pytest.approx(line(one, name) / 2, abs=1)


def test_world_one_keeps_gathered_weights_and_gradient_accumulators() -> None:
    (policy,) = learner_memory(SHAPE, ARCH)
    p = ARCH.params()
    assert line(policy, "gradients") == 2 * p * 4
    assert line(policy, "communication buckets") == p * 4
    (sharded,) = learner_memory(replace(SHAPE, world=2), ARCH)
    assert line(sharded, "communication buckets") < p * 4


def test_checkpointing_lowers_activations() -> None:
    (plain,) = learner_memory(SHAPE, ARCH)
    (ckpt,) = learner_memory(replace(SHAPE, checkpointing=True), ARCH)
    assert line(ckpt, "activations") < line(plain, "activations") / 2
    assert line(ckpt, "weights") == line(plain, "weights")


def test_bytes_grow_with_micro_batch_and_sequence() -> None:
    totals = [rank_total(learner_memory(replace(SHAPE, micro_batch=b), ARCH)) for b in (1, 4, 16)]
    assert totals == sorted(totals) and len(set(totals)) == 3
    (short,) = learner_memory(replace(SHAPE, seq_len=128), ARCH)
    (long,) = learner_memory(replace(SHAPE, seq_len=1024), ARCH)
    assert line(long, "activations") == 8 * line(short, "activations")
    assert line(long, "logits buffers") == 8 * line(short, "logits buffers")


def test_critic_and_reference_add_roles() -> None:
    base = learner_memory(SHAPE, ARCH)
    both = learner_memory(replace(SHAPE, critic=True, reference=True), ARCH)
    assert [r.role for r in base] == ["policy"]
    assert [r.role for r in both] == ["policy", "reference", "critic"]
    assert rank_total(both) > rank_total(base)
    critic = both[2]
    assert line(critic, "optimizer states") < line(base[0], "optimizer states")  # no LM head


def test_bfloat16_shrinks_the_compute_copies_not_the_master_state() -> None:
    (fp32,) = learner_memory(SHAPE, ARCH)
    (bf16,) = learner_memory(replace(SHAPE, dtype="bfloat16"), ARCH)
    assert line(bf16, "weights") == line(fp32, "weights")
    assert line(bf16, "optimizer states") == line(fp32, "optimizer states")
    assert line(bf16, "activations") == line(fp32, "activations") // 2
    assert line(bf16, "communication buckets") == line(fp32, "communication buckets") // 2


def test_learner_shape_reads_the_run_spec() -> None:
    s = spec(
        rollout={"sampling": {"max_tokens": 300}},
        algorithm={"advantage": "gae", "kl": {"coef": 0.1}},
        train={"micro_batch_size": 6, "activation_checkpointing": True},
    )
    shape = learner_shape(s, 2, prompt_tokens=100)
    assert (shape.world, shape.micro_batch, shape.seq_len, shape.dtype) == (2, 6, 400, "float32")
    assert shape.critic and shape.reference and shape.checkpointing
    assert not learner_shape(spec(), 1).critic and not learner_shape(spec(), 1).reference
    capped = spec(model={"path": "m", "max_model_len": 256}, rollout={"sampling": {"max_tokens": 300}})
    assert learner_shape(capped, 1).seq_len == 256
    assert learner_shape(spec(model={"path": "m"}), 1, device="cuda").dtype == "bfloat16"


def test_kv_cache_rounds_to_blocks_and_scales_with_concurrency() -> None:
    one = kv_cache_needed(
        ARCH, concurrency=1, seq_len=CPU_BLOCK_TOKENS + 1, dtype="float32", block=CPU_BLOCK_TOKENS
    )
    assert one == 2 * CPU_BLOCK_TOKENS * 2 * 8 * 512 * 4
    many = kv_cache_needed(ARCH, concurrency=64, seq_len=CPU_BLOCK_TOKENS + 1, dtype="float32", block=128)
    assert many == 64 * one


def test_rollout_uses_the_configured_kv_cache_when_given() -> None:
    s = spec(rollout={"sampling": {"max_tokens": 256}})
    sized = rollout_memory(s, ARCH, concurrency=8, prompt_tokens=0)
    assert line(sized, "kv cache") == 8 * 256 * 2 * 8 * 512 * 4
    configured = rollout_memory(s, ARCH, concurrency=8, kv_cache_bytes=1 << 30)
    assert line(configured, "kv cache") == 1 << 30
    assert line(configured, "weights") == ARCH.params() * 4


def test_reward_model_has_no_lm_head() -> None:
    role = reward_model_memory(ARCH, batch=8, seq_len=512)
    assert line(role, "weights") == (ARCH.params() - ARCH.lm_head_params() + ARCH.hidden_size) * 4
    assert reward_model_memory(ARCH, batch=16, seq_len=512).total > role.total
