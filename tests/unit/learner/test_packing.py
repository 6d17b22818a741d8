"""Packed micro-batches (`rlfabric.learner.packing`): the layout, and a packed step computing what the padded
layout computes (log-probs, entropy, gradients, metrics) through the real trainer, with and without a
reference, LoRA, activation checkpointing, multi-turn masks and two ranks' padding micro-batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.learner.batch import GroupSamples, Rollout, build_micro_batches, empty_micro_batch
from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.packing import PACKED_ATTENTION, Piece, pack, packing_supported
from rlfabric.learner.trainer import Trainer
from rlfabric.runspec import RunSpec

CPU = torch.device("cpu")
PAD = 0


@pytest.fixture(scope="module")
def world() -> World:
    return init_distributed(CPU)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlfabric.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("reference"), seed=1)


def test_pack_puts_each_prompt_once_and_maps_every_segment_token_back() -> None:
    rows = [([5, 6, 7], [8, 9], 0), ([5, 6, 7], [10], 0), ([4], [11, 12], 1)]
    packed = pack(rows, width=5, pad_id=PAD)
    # group 0's prefix [5, 6], its two segments [7, 8, 9] and [7, 10]; group 1's prompt has no prefix
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 7, 10, 4, 11, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1, 2]]
    assert packed.layout.pieces == (Piece(0, 2), Piece(2, 3, 0, 2), Piece(5, 2, 0, 2), Piece(7, 3, 7, 0))
    assert packed.keep.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert packed.targets.tolist() == [[8, 9, PAD, 10, PAD, 11, 12, PAD]]
    # (row, target position): row 0 from position 2 (its first completion token's), row 2 from 0
    assert packed.destination.tolist() == [2, 3, 4, 7, 8, 10, 11, 12]
    values = torch.arange(1.0, 9.0).unsqueeze(0)
    assert packed.to_target_layout(values, torch.Size((3, 5))).tolist() == [
        [0, 0, 1, 2, 3],
        [0, 0, 4, 5, 0],
        [6, 7, 8, 0, 0],
    ]
    assert packed.num_tokens == 10  # padded: 15


def test_a_prompt_that_differs_within_a_group_gets_its_own_prefix() -> None:
    packed = pack([([1, 2, 3], [4], 0), ([1, 2, 9], [4], 0)], width=4, pad_id=PAD)
    assert packed.layout.pieces == (Piece(0, 2), Piece(2, 2, 0, 2), Piece(4, 2), Piece(6, 2, 4, 2))


def test_micro_batches_keep_groups_together_when_packed() -> None:
    groups = _groups(seed=0, n_groups=3, n=4)
    packed = build_micro_batches(groups, 6, PAD, by_length=True, packed=True)
    assert [mb.sample_index.tolist() for mb in packed] == [list(range(6)), list(range(6, 12))]
    padded_tokens = sum(mb.input_ids.numel() for mb in packed)
    assert all(mb.packed is not None for mb in packed)
    assert sum(mb.packed.num_tokens for mb in packed if mb.packed) < padded_tokens
    assert empty_micro_batch(PAD, packed=True).packed is not None


def test_models_with_sliding_window_layers_are_not_packed() -> None:
    from transformers import Qwen2Config

    assert packing_supported(Qwen2Config())
    assert not packing_supported(Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0))


CASES: dict[str, dict[str, Any]] = {
    "reference in the loss, entropy": {
        "algorithm": {"entropy_coef": 0.01, "kl": {"coef": 0.1, "mode": "loss"}},
        "reference": True,
    },
    "kl in the reward, several epochs": {
        "algorithm": {"kl": {"coef": 0.1, "mode": "reward"}, "ppo_epochs": 2},
        "reference": True,
    },
    "lora, adapters off as the reference": {
        "model": {"lora": {"rank": 4, "alpha": 8}},
        "algorithm": {"kl": {"coef": 0.1}},
    },
    "activation checkpointing": {"train": {"activation_checkpointing": True}},
    "micro-batches splitting groups": {"train": {"micro_batch_size": 3}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_step_computes_what_the_padded_step_computes(
    tiny_model_dir: Path, reference_dir: Path, world: World, case: str
) -> None:
    options = CASES[case]
    groups = _groups(seed=1, n_groups=3, n=4, multi_turn=True)
    grads, metrics, logprobs = [], [], []
    for packing in (False, True):
        spec = _spec(tiny_model_dir, reference_dir if options.get("reference") else None, options, packing)
        trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
        assert trainer.packed is packing
        assert (trainer.model.config._attn_implementation == PACKED_ATTENTION) is packing
        metrics.append(trainer.accumulate_gradients(groups))
        grads.append(
            {
                n: p.grad.full_tensor().clone()
                for n, p in trainer.model.named_parameters()
                if p.grad is not None
            }
        )
        logprobs.append(trainer.sequence_logprobs(groups))
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=2e-6, rtol=1e-4, msg=name)
    for name in ("loss", "entropy", "kl", "tokens", "rollout_logp_diff_mean"):
        if name in metrics[0]:
            assert metrics[1][name] == pytest.approx(metrics[0][name], abs=1e-5), name
    torch.testing.assert_close(logprobs[1], logprobs[0], atol=1e-5, rtol=0)


def test_a_reference_that_cannot_be_packed_reads_the_padded_rows(
    tiny_model_dir: Path, reference_dir: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy packs, the reference (another architecture, here made to look like one with sliding
    windows) does not: its log-probs come from the padded rows and the step is still the padded one's."""
    from rlfabric.learner import parts

    groups = _groups(seed=2, n_groups=2, n=4)
    options: dict[str, Any] = {"algorithm": {"kl": {"coef": 0.1, "mode": "loss"}}, "reference": True}
    expected = Trainer(
        _spec(tiny_model_dir, reference_dir, options, False), tiny_model_dir, device=CPU, world=world
    )
    want = expected.accumulate_gradients(groups)
    supported = parts.packing_supported
    reference = str(reference_dir)
    monkeypatch.setattr(
        parts, "packing_supported", lambda config: supported(config) and config._name_or_path != reference
    )
    trainer = Trainer(
        _spec(tiny_model_dir, reference_dir, options, True), tiny_model_dir, device=CPU, world=world
    )
    assert trainer.packed and trainer.reference is not None and not parts.is_packed(trainer.reference)
    got = trainer.accumulate_gradients(groups)
    assert got["kl"] > 1e-3
    assert got["kl"] == pytest.approx(want["kl"], abs=1e-5) and got["loss"] == pytest.approx(
        want["loss"], abs=1e-5
    )


def test_a_packed_bfloat16_step_learns(tiny_model_dir: Path, world: World) -> None:
    spec = _spec(tiny_model_dir, None, {"model": {"dtype": "bfloat16"}}, packing=True)
    trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    assert trainer.packed
    group = GroupSamples(
        [10, 11, 12], [Rollout([20] * 4, [-1.0] * 4, 1.0), Rollout([30] * 4, [-1.0] * 4, 0.0)]
    )
    before = trainer.sequence_logprobs([group])
    for _ in range(3):
        trainer.train_step([group])
    after = trainer.sequence_logprobs([group])
    assert (after[0] - after[1]) - (before[0] - before[1]) > 1.0


def _spec(model_dir: Path, reference: Path | None, options: dict[str, Any], packing: bool) -> RunSpec:
    raw: dict[str, Any] = {
        "model": {"path": str(model_dir), **({"reference_path": str(reference)} if reference else {})},
        "dataset": {"path": "unused.jsonl"},
        "rollout": {"sampling": {"n": 4, "max_tokens": 16}},
        "optim": {"lr": 5e-3},
        "train": {"micro_batch_size": 8, "steps": 20, "packing": packing},
    }
    for section, values in options.items():
        if section != "reference":
            raw[section] = {**raw.get(section, {}), **values}
    return RunSpec.model_validate(raw)


def _groups(seed: int, n_groups: int, n: int, multi_turn: bool = False) -> list[GroupSamples]:
    """Groups with varied prompt and completion lengths (a one-token prompt among them), rewards, rollout
    log-probs, and with `multi_turn` environment tokens (loss mask 0) inside some completions."""
    gen = torch.Generator().manual_seed(seed)

    def ints(low: int, high: int, size: int) -> list[int]:
        return torch.randint(low, high, (size,), generator=gen).tolist()

    groups = []
    for g in range(n_groups):
        prompt = ints(6, 100, 1 if g == n_groups - 1 else int(torch.randint(4, 12, (1,), generator=gen)))
        rollouts = []
        for i in range(n):
            length = int(torch.randint(2, 10, (1,), generator=gen))
            logprobs = (-torch.rand(length, generator=gen) * 3).tolist()
            mask = [0 if multi_turn and i % 2 and 0 < j < 3 else 1 for j in range(length)]
            reward = float(torch.randint(0, 2, (1,), generator=gen))
            rollouts.append(Rollout(ints(6, 100, length), logprobs, reward, loss_mask=mask))
        groups.append(GroupSamples(prompt, rollouts))
    return groups
