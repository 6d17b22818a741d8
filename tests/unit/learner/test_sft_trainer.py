"""The SFT trainer in one process (a gloo world of one) on the tiny model: the loss is the mean negative
log-prob over every assistant token of the step, computed here by hand with a plain transformers
forward; its gradient is that loss's gradient whatever the micro-batch size, packed (each micro-batch's
shared untrained prefix computed once) or padded; evaluation changes nothing."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.parts import is_packed
from rlfabric.learner.sft import SFTTrainer, examples_as_groups, shared_prefix_groups, shared_prefix_runs
from rlfabric.learner.sft_data import SFTExample
from rlfabric.runspec import RunSpec

CPU = torch.device("cpu")
EXAMPLES = [
    SFTExample([4, 93, 6, 80, 81, 5, 6, 4, 73, 6, 90, 95, 5], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1], "a"),
    SFTExample([4, 30, 31, 5, 6, 4, 73, 6, 40, 5], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1], "b"),
    SFTExample([9, 10, 11, 12, 13], [0, 1, 0, 1, 1], "c"),
]
"""Three sequences with 3, 2 and 3 trained tokens (the last with two assistant turns)."""
SHARED = [
    *EXAMPLES,
    SFTExample([4, 93, 6, 80, 81, 5, 6, 4, 73, 6, 70, 71, 72, 5], [0] * 10 + [1, 1, 1, 1], "d"),
    SFTExample([4, 93, 6, 80, 81, 5, 6, 4, 30, 6, 90, 5], [0] * 8 + [1, 1, 1, 1], "e"),
]
"""EXAMPLES and two more opening as the first does (a shared system turn): "d" shares its 10 untrained
ids with "a", "e" shares 8 ids and trains from the ninth."""


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield init_distributed(CPU)
    torch.set_num_threads(threads)


def make_trainer(
    model_dir: Path, world: World, micro_batch_size: int = 1, packing: bool = True, **optim: Any
) -> SFTTrainer:
    spec = RunSpec.model_validate(
        {
            "mode": "sft",
            "model": {"path": str(model_dir)},
            "dataset": {"path": "unused.jsonl"},
            "optim": {"lr": 1e-2, "grad_clip": None, **optim},
            "train": {"micro_batch_size": micro_batch_size, "packing": packing},
        }
    )
    return SFTTrainer(spec, model_dir, device=CPU, world=world, total_steps=10)


def by_hand(model_dir: Path, examples: list[SFTExample] = EXAMPLES) -> tuple[float, float, float]:
    """(loss, token accuracy, gradient norm) of the mean NLL over every trained token of `examples`,
    from a plain forward of each sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    nll, correct, tokens = torch.zeros(()), 0, 0
    for example in examples:
        ids = torch.tensor([example.token_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # (T, V)
        for t in range(len(example.token_ids) - 1):
            if example.loss_mask[t + 1]:
                nll = nll - logp[t, example.token_ids[t + 1]]
                correct += int(logp[t].argmax()) == example.token_ids[t + 1]
                tokens += 1
    loss = nll / tokens
    loss.backward()
    norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), correct / tokens, float(norm)


def test_examples_become_one_token_prompts_with_the_mask_on_the_completion() -> None:
    group = examples_as_groups(EXAMPLES[2:])[0]
    assert group.prompt_token_ids == [9] and group.group_id == "c"
    assert group.rollouts[0].token_ids == [10, 11, 12, 13] and group.rollouts[0].loss_mask == [1, 0, 1, 1]


def test_packed_groups_share_the_prefix_no_example_trains_on() -> None:
    """Sorted by ids (b, e, d, a, c), two per micro-batch: "b" and "e" share only their first id, "d" and
    "a" their 10 untrained ids (both train from the 11th), "c" is alone and keeps its first id as its
    prompt (it trains on its second)."""
    groups = shared_prefix_groups(SHARED, 2)
    assert [[r.token_ids for r in g.rollouts] for g in groups] == [
        [[30, 31, 5, 6, 4, 73, 6, 40, 5], [93, 6, 80, 81, 5, 6, 4, 30, 6, 90, 5]],
        [[70, 71, 72, 5], [90, 95, 5]],
        [[10, 11, 12, 13]],
    ]
    assert [g.prompt_token_ids for g in groups] == [[4], SHARED[0].token_ids[:10], [9]]
    for group in groups:  # each example is its group's prompt and its completion, the mask on the latter
        shared = len(group.prompt_token_ids)
        for rollout in group.rollouts:
            example = next(e for e in SHARED if e.token_ids == group.prompt_token_ids + rollout.token_ids)
            assert rollout.loss_mask == example.loss_mask[shared:] and not any(example.loss_mask[1:shared])
    # all five in one micro-batch: "e", "d" and "a" share 8 ids (16 computed once), more than "b" and "e"
    # sharing one and "d" and "a" ten (11); "c" opens otherwise
    groups = shared_prefix_groups(SHARED, 5)
    ids = {tuple(e.token_ids): e.example_id for e in SHARED}
    members = [[ids[tuple(g.prompt_token_ids + r.token_ids)] for r in g.rollouts] for g in groups]
    assert members == [["b"], ["e", "d", "a"], ["c"]]
    assert [len(g.prompt_token_ids) for g in groups] == [8, 8, 1]


def exhaustive_best(chunk: list[SFTExample]) -> int:
    """The most ids computed once over every way to cut `chunk` into runs, tried one by one."""

    def untrained(e: SFTExample) -> int:
        return next((i for i, m in enumerate(e.loss_mask) if m), len(e.token_ids) - 1)

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    best = 0
    for count in range(len(chunk)):
        for cuts in itertools.combinations(range(1, len(chunk)), count):
            bounds, total = [0, *cuts, len(chunk)], 0
            for start, end in itertools.pairwise(bounds):
                run = chunk[start:end]
                shared = min(min(untrained(e), common(run[0].token_ids, e.token_ids)) for e in run)
                if len(run) > 1 and shared < 1:
                    break
                total += (len(run) - 1) * shared
            else:
                best = max(best, total)
    return best


def test_the_runs_save_the_most_ids_any_cut_could() -> None:
    rng = random.Random(0)
    for _ in range(300):
        examples = []
        for k in range(rng.randint(1, 7)):
            ids = [rng.choice([1, 2, 3]) for _ in range(rng.randint(2, 9))]
            first = rng.randint(1, len(ids) - 1)
            examples.append(SFTExample(ids, [0] * first + [1] * (len(ids) - first), str(k)))
        chunk = sorted(examples, key=lambda e: e.token_ids)
        runs = shared_prefix_runs(chunk)
        assert [e for _, run in runs for e in run] == chunk
        assert sum((len(run) - 1) * shared for shared, run in runs) == exhaustive_best(chunk)
        for shared, run in runs:
            assert len(run) == 1 or shared >= 1
            assert all(e.token_ids[:shared] == run[0].token_ids[:shared] for e in run)
            assert not any(m for e in run for m in e.loss_mask[1:shared])


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("micro_batch_size", [1, 2, 5])
def test_shared_prefixes_change_neither_loss_nor_gradient(
    tiny_model_dir: Path, world: World, packing: bool, micro_batch_size: int
) -> None:
    loss, accuracy, norm = by_hand(tiny_model_dir, SHARED)
    trainer = make_trainer(tiny_model_dir, world, micro_batch_size, packing)
    assert is_packed(trainer.model) == packing
    metrics = trainer.train_step(SHARED)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["token_accuracy"] == pytest.approx(accuracy)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert metrics["tokens"] == 8 + 4 + 4 and metrics["sequences"] == 5


def test_loss_and_gradient_are_the_token_mean_by_hand(tiny_model_dir: Path, world: World) -> None:
    loss, accuracy, norm = by_hand(tiny_model_dir)
    metrics = make_trainer(tiny_model_dir, world).train_step(EXAMPLES)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["token_accuracy"] == pytest.approx(accuracy)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert metrics["tokens"] == 8 and metrics["sequences"] == 3 and metrics["lr"] == 1e-2


def test_micro_batch_size_changes_nothing(tiny_model_dir: Path, world: World) -> None:
    one, all_at_once = make_trainer(tiny_model_dir, world, 1), make_trainer(tiny_model_dir, world, 3)
    for _ in range(2):
        a, b = one.train_step(EXAMPLES), all_at_once.train_step(EXAMPLES)
        for name in ("loss", "grad_norm", "token_accuracy"):
            assert a[name] == pytest.approx(b[name], rel=1e-4), name


def test_evaluation_measures_without_training_and_training_lowers_the_loss(
    tiny_model_dir: Path, world: World
) -> None:
    trainer = make_trainer(tiny_model_dir, world)
    before = trainer.evaluate(EXAMPLES)
    assert before["eval_loss"] == pytest.approx(by_hand(tiny_model_dir)[0], rel=1e-5)
    assert trainer.evaluate(EXAMPLES) == before and (trainer.step, trainer.policy_version) == (0, 0)
    losses = [trainer.train_step(EXAMPLES)["loss"] for _ in range(5)]
    after = trainer.evaluate(EXAMPLES)
    assert losses[-1] < losses[0] and after["eval_loss"] < before["eval_loss"]
    assert (trainer.step, trainer.policy_version) == (5, 5)
