"""LoRA on the learner (a gloo world of one, tiny model): adapters train, the base stays, the reference is
the base, the published weights are the merged model, checkpoints resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.learner.batch import GroupSamples, Rollout
from rlfabric.learner.dist import World, init_distributed, reshard
from rlfabric.learner.lora import (
    AdaptersDisabled,
    adapter_config,
    adapter_state_dict,
    merged_state_dict,
    trainable_parameters,
)
from rlfabric.learner.trainer import Trainer
from rlfabric.runspec import LoraSpec, RunSpec

CPU = torch.device("cpu")
LORA = {"rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def world() -> World:
    return init_distributed(CPU)


def lora_spec(model_dir: Path, **overrides: Any) -> RunSpec:
    raw: dict[str, Any] = {
        "model": {"path": str(model_dir), "lora": LORA},
        "dataset": {"path": "unused.jsonl"},
        "rollout": {"sampling": {"n": 4, "max_tokens": 16}},
        "optim": {"lr": 2e-2},
        "train": {"micro_batch_size": 4, "steps": 20},
    }
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return RunSpec.model_validate(raw)


def contrast_group() -> GroupSamples:
    prompt, good, bad = [10, 11, 12], [40, 41, 42, 43], [50, 51, 52, 53]
    return GroupSamples(
        prompt, [Rollout(good, [-4.0] * 4, 1.0), Rollout(bad, [-4.0] * 4, 0.0)] * 2, group_id="g"
    )


def completion_logprobs(model: torch.nn.Module, group: GroupSamples) -> torch.Tensor:
    """Each completion's summed log-prob under a plain `model`: (N,)."""
    out = []
    for rollout in group.rollouts:
        ids = torch.tensor([group.prompt_token_ids + rollout.token_ids])
        with torch.no_grad():
            logp = model(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        out.append(logp[len(group.prompt_token_ids) - 1 :].sum())
    return torch.stack(out)


def plain_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def test_only_the_adapters_train_and_the_policy_learns(tiny_model_dir: Path, world: World) -> None:
    trainer = Trainer(lora_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    trainable, total = trainable_parameters(trainer.model)
    assert 0 < trainable < total / 5
    optimised = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
    assert optimised == trainable
    base_before = {k: v.clone() for k, v in trainer.full_state_dict().items()}  # adapters B = 0: the base
    group = contrast_group()
    before = trainer.sequence_logprobs([group])
    for _ in range(4):
        metrics = trainer.train_step([group])
    after = trainer.sequence_logprobs([group])
    assert (after[0] - after[1]) - (before[0] - before[1]) > 1.0
    assert metrics["grad_norm"] > 0
    reshard(trainer.model)  # a world of one leaves the layers unsharded after a step
    frozen = {n: p for n, p in trainer.model.named_parameters() if "lora_" not in n}
    plain = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in frozen.items()}
    for name, param in plain.items():
        torch.testing.assert_close(param.full_tensor(), base_before[name], msg=name)


def test_the_reference_is_the_base_model_with_no_second_copy(tiny_model_dir: Path, world: World) -> None:
    spec = lora_spec(tiny_model_dir, algorithm={"kl": {"coef": 0.1}}, train={"micro_batch_size": 2})
    trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    assert isinstance(trainer.reference, AdaptersDisabled)
    assert list(trainer.reference.parameters()) == []
    group = contrast_group()
    for _ in range(3):
        metrics = trainer.train_step([group])
        # the reference's forward leaves the adapters trainable (PEFT's disable_adapter() did not, under FSDP)
        assert metrics["grad_norm"] > 0
    assert metrics["kl"] > 0  # the policy moved away from its reference
    plan = trainer.plan([group])
    ref = torch.cat([mb.ref_logp[mb.loss_mask.bool()] for mb in plan.micro_batches])
    per_sample = ref.view(len(group.rollouts), -1).sum(-1)
    torch.testing.assert_close(
        per_sample, completion_logprobs(plain_model(tiny_model_dir), group), atol=1e-4, rtol=0
    )


def test_published_weights_are_the_merged_model(tiny_model_dir: Path, world: World) -> None:
    trainer = Trainer(lora_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    group = contrast_group()
    for _ in range(3):
        trainer.train_step([group])
    merged = trainer.full_state_dict()
    served = plain_model(tiny_model_dir)
    assert set(merged) == set(served.state_dict())
    served.load_state_dict(merged)
    trained = trainer.sequence_logprobs([group])
    torch.testing.assert_close(completion_logprobs(served, group), trained, atol=1e-4, rtol=0)
    assert not torch.allclose(completion_logprobs(plain_model(tiny_model_dir), group), trained, atol=1e-3)


def test_merge_agrees_with_peft_merge_and_unload(tiny_model_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model

    spec = LoraSpec(rank=2, alpha=6, target_modules=["q_proj", "down_proj"])
    model = plain_model(tiny_model_dir)
    config = LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    ours = merged_state_dict(peft_model.state_dict(), spec)
    theirs = peft_model.merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, atol=1e-6, rtol=0, msg=name)


def test_checkpoint_resume_with_adapters(tiny_model_dir: Path, world: World, tmp_path: Path) -> None:
    spec = lora_spec(tiny_model_dir)
    group = contrast_group()
    a = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    a.train_step([group])
    path = a.save_checkpoint(tmp_path)
    expected = a.train_step([group])
    b = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    b.load_checkpoint(path)
    assert b.train_step([group]) == pytest.approx(expected, abs=1e-6)


def test_lora_is_refused_outside_online_runs(tiny_model_dir: Path) -> None:
    raw = {
        "model": {"path": str(tiny_model_dir), "lora": LORA},
        "dataset": {"path": "x.jsonl"},
        "mode": "sft",
    }
    with pytest.raises(ValueError, match=r"model\.lora: only an online run"):
        RunSpec.model_validate(raw)


def test_the_adapter_alone_is_what_peft_saves_and_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json

    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(plain_model(tiny_model_dir), config)
    ours = adapter_state_dict(model.state_dict())
    theirs = get_peft_model_state_dict(model)
    assert set(ours) == set(theirs) and ours
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, atol=0, rtol=0, msg=name)
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter_config(model)))
    save_file({k: v.contiguous() for k, v in ours.items()}, str(tmp_path / "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(plain_model(tiny_model_dir), str(tmp_path))
    ids = torch.tensor([[10, 11, 12, 40, 41]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-6, rtol=0)
