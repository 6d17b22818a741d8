"""SimPO, ORPO and KTO trainers in one process (a gloo world of one) on the tiny model: the reference-free
losses load one model; each loss's steps lower it; accumulation over micro-batches is exact; KTO starts at
half its weights with z0 = 0, and its z0 is the mean policy-reference log-ratio of the step's mismatched
rows, recomputed here with plain forward passes. Also KTO's rows loaded from both TRL formats."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.learner import preference as preference_module
from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.kto import KTOExample, KTOTrainer, mismatched
from rlfabric.learner.offline import load_kto_examples
from rlfabric.learner.preference import PreferencePair, PreferenceTrainer
from rlfabric.runspec import RunSpec

CPU = torch.device("cpu")
CHOSEN, REJECTED = [40, 41, 42, 43], [60, 61, 62]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """A world of one; one intra-op thread (the tiny model's matmuls only lose from more), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield init_distributed(CPU)
    torch.set_num_threads(threads)


def make_spec(model_dir: Path, loss: str, **overrides: Any) -> RunSpec:
    """An offline preference run spec with `loss` for the tiny model; `overrides` are nested section dicts."""
    raw: dict[str, Any] = {
        "mode": "offline_preference",
        "model": {"path": str(model_dir), "max_model_len": 64},
        "dataset": {"path": "unused.jsonl"},
        "optim": {"lr": 5e-3},
        "train": {"micro_batch_size": 4, "steps": 20},
        "preference": {"loss": loss},
    }
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return RunSpec.model_validate(raw)


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 6, (n,), generator=gen).tolist()
    return [torch.randint(6, 100, (length,), generator=gen).tolist() for length in lengths]


def consistent_pairs(n: int = 4, seed: int = 0) -> list[PreferencePair]:
    """Random prompts; the chosen completion is always one string of tokens, the rejected another."""
    return [PreferencePair(p, CHOSEN, REJECTED, pair_id=str(i)) for i, p in enumerate(prompts(n, seed))]


def consistent_rows(n: int = 6, seed: int = 0) -> list[KTOExample]:
    """Random prompts, alternately with the good completion (desirable) and the bad one."""
    return [
        KTOExample(p, CHOSEN if i % 2 == 0 else REJECTED, i % 2 == 0, pair_id=str(i))
        for i, p in enumerate(prompts(n, seed))
    ]


@pytest.mark.parametrize("loss", ["orpo", "simpo"])
def test_reference_free_losses_load_one_model(
    loss: str, tiny_model_dir: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded: list[bool] = []
    real = preference_module.load_model

    def counting(*args: Any, **kwargs: Any) -> Any:
        loaded.append(kwargs["trainable"])
        return real(*args, **kwargs)

    monkeypatch.setattr(preference_module, "load_model", counting)
    spec = make_spec(tiny_model_dir, loss, model={"reference_path": str(tiny_model_dir)})
    trainer = PreferenceTrainer(spec, tiny_model_dir, device=CPU, world=world)
    assert loaded == [True] and trainer.reference is None
    metrics = trainer.train_step(consistent_pairs())
    assert metrics["pairs"] == 4 and metrics["grad_norm"] > 0
    dpo = PreferenceTrainer(make_spec(tiny_model_dir, "dpo"), tiny_model_dir, device=CPU, world=world)
    assert loaded == [True, True, False] and dpo.reference is not None


def test_simpo_learns(tiny_model_dir: Path, world: World) -> None:
    spec = make_spec(tiny_model_dir, "simpo", preference={"loss": "simpo", "simpo_gamma": 1.0})
    trainer = PreferenceTrainer(spec, tiny_model_dir, device=CPU, world=world)
    history = [trainer.train_step(consistent_pairs()) for _ in range(4)]
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["reward_margin"] > history[0]["reward_margin"]
    assert history[-1]["reward_accuracy"] == 1.0
    # rewards are beta times the per-token mean log-prob (beta defaults to 2.0 with simpo)
    assert history[0]["rewards_chosen"] == pytest.approx(2.0 * history[0]["logps_chosen"], rel=1e-5)


def test_orpo_learns(tiny_model_dir: Path, world: World) -> None:
    spec = make_spec(tiny_model_dir, "orpo", preference={"loss": "orpo", "orpo_lambda": 0.5})
    trainer = PreferenceTrainer(spec, tiny_model_dir, device=CPU, world=world)
    history = [trainer.train_step(consistent_pairs()) for _ in range(4)]
    first, last = history[0], history[-1]
    assert last["loss"] < first["loss"]
    assert last["nll_loss"] < first["nll_loss"] and last["odds_ratio_loss"] < first["odds_ratio_loss"]
    assert first["nll_loss"] == pytest.approx(-first["logps_chosen"], rel=1e-5)
    assert first["loss"] == pytest.approx(first["nll_loss"] + 0.5 * first["odds_ratio_loss"], rel=1e-5)
    assert last["reward_accuracy"] == 1.0


def test_kto_starts_at_half_its_weights_and_learns(tiny_model_dir: Path, world: World) -> None:
    weights = {"kto_desirable_weight": 1.5, "kto_undesirable_weight": 1.0}
    spec = make_spec(tiny_model_dir, "kto", preference={"loss": "kto", "beta": 0.5, **weights})
    trainer = KTOTrainer(spec, tiny_model_dir, device=CPU, world=world)
    rows = consistent_rows()
    history = [trainer.train_step(rows) for _ in range(4)]
    first, last = history[0], history[-1]
    # policy = reference: r = 0, z0 = 0, each row's loss is lambda (1 - sigmoid(0)) = lambda / 2
    assert first["kl"] == 0.0
    assert first["loss"] == pytest.approx((3 * 1.5 / 2 + 3 * 1.0 / 2) / 6, abs=1e-6)
    assert (first["desirable"], first["undesirable"], first["rows"]) == (3, 3, 6)
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert last["loss"] < first["loss"]
    assert last["rewards_chosen"] > 0 > last["rewards_rejected"]


def test_kto_reference_point_is_the_mismatched_log_ratio(tiny_model_dir: Path, world: World) -> None:
    """After one update, z0 = max(0, mean over rows of log pi(y_{i-1}|x_i) - log pi_ref(y_{i-1}|x_i)):
    recomputed with plain forward passes of both models."""
    spec = make_spec(tiny_model_dir, "kto", preference={"loss": "kto", "beta": 0.5}, optim={"lr": 2e-2})
    trainer = KTOTrainer(spec, tiny_model_dir, device=CPU, world=world)
    rows = consistent_rows(n=5, seed=3)
    trainer.train_step(rows)
    _, _, z0 = trainer.plan(rows)

    def logp(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> float:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logps = model(input_ids=ids).logits.float().log_softmax(-1)[0]
        return sum(logps[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion))

    ratios = [
        logp(trainer.model, row.prompt_token_ids, rows[i - 1].completion_token_ids)
        - logp(trainer.reference, row.prompt_token_ids, rows[i - 1].completion_token_ids)
        for i, row in enumerate(rows)
    ]
    assert sum(ratios) != 0.0
    assert z0 == pytest.approx(max(0.0, sum(ratios) / len(rows)), abs=1e-5)


def test_mismatched_rows_rotate_by_one_and_fit_the_context() -> None:
    rows = [KTOExample([1] * 3, [10, 11, 12, 13], True, "0"), KTOExample([2] * 6, [20], False, "1")]
    kl = mismatched(rows, max_len=8)
    assert [r.prompt_token_ids for r in kl] == [[1] * 3, [2] * 6]
    assert [r.completion_token_ids for r in kl] == [[20], [10, 11]]  # 6 + 2 = 8 tokens


@pytest.mark.parametrize("loss", ["simpo", "orpo", "kto"])
def test_accumulation_is_exact(loss: str, tiny_model_dir: Path, world: World) -> None:
    """One pair (row) per forward pass trains like all in one: the second step's metrics agree."""
    results = []
    for micro_batch_size in (2, 8):
        spec = make_spec(tiny_model_dir, loss, train={"micro_batch_size": micro_batch_size})
        if loss == "kto":
            trainer: Any = KTOTrainer(spec, tiny_model_dir, device=CPU, world=world)
            items: Any = consistent_rows(n=5, seed=1)
        else:
            trainer = PreferenceTrainer(spec, tiny_model_dir, device=CPU, world=world)
            items = consistent_pairs(n=3, seed=1)
        trainer.train_step(items)
        results.append(trainer.train_step(items))  # after one update: a nonzero z0 for KTO
    first, second = results
    names = ["loss", "grad_norm", "rewards_chosen", "rewards_rejected"] + (["kl"] if loss == "kto" else [])
    for name in names:
        assert first[name] == pytest.approx(second[name], rel=1e-4, abs=1e-6), name


def test_kto_rows_load_from_labelled_rows_and_from_pairs(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def ids(text: str) -> list[int]:
        return [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]

    def load(rows: list[dict[str, Any]]) -> list[KTOExample]:
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load_kto_examples(make_spec(tiny_model_dir, "kto", dataset={"path": str(path)}))

    unpaired = load(
        [
            {"prompt": "q", "completion": "yes", "label": True},
            {"prompt": "r", "completion": "no", "label": False},
        ]
    )
    assert [(e.pair_id, e.desirable, e.completion_token_ids) for e in unpaired] == [
        ("0", True, ids("yes")),
        ("1", False, ids("no")),
    ]
    paired = load([{"prompt": "q", "chosen": "yes", "rejected": "no"}])
    assert [(e.pair_id, e.desirable, e.completion_token_ids) for e in paired] == [
        ("0/chosen", True, ids("yes")),
        ("0/rejected", False, ids("no")),
    ]
    assert paired[0].prompt_token_ids == paired[1].prompt_token_ids == unpaired[0].prompt_token_ids
