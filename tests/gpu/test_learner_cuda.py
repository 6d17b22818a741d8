"""The learner's training core on a CUDA device: an NCCL world of one, FSDP2, bfloat16 compute.

Deselected by default (`-m gpu`); run on a GPU machine with `pytest tests/gpu -m gpu`. The CPU suite
proves the same properties in float32 over gloo (tests/unit/learner/test_trainer_step.py); here they must
hold on the path a GPU user runs: `dtype = "auto"` resolves to bfloat16, log-probs agree with a float32
forward pass on the CPU, GRPO learns, a bfloat16 step's gradient points where the float32 one does, and a
checkpoint written on the GPU resumes the same training.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.learner.batch import GroupSamples, Rollout
from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.trainer import Trainer
from rlfabric.runspec import RunSpec
from rlfabric.runtime import hardware

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def world() -> World:
    if not torch.cuda.is_available():
        pytest.fail("no CUDA device: run this module only on a GPU machine (-m gpu)")
    world = init_distributed(CUDA)
    assert world.backend == "nccl"
    return world


def make_spec(model_dir: Path, dtype: str, **overrides: Any) -> RunSpec:
    raw: dict[str, Any] = {
        "model": {"path": str(model_dir), "dtype": dtype},
        "dataset": {"path": "unused.jsonl"},
        "rollout": {"sampling": {"n": 4, "max_tokens": 16}},
        "optim": {"lr": 5e-3},
        "train": {"micro_batch_size": 4, "steps": 20},
    }
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return RunSpec.model_validate(raw)


def random_groups(seed: int, n_groups: int = 2, n: int = 4) -> list[GroupSamples]:
    gen = torch.Generator().manual_seed(seed)

    def ints(size: int) -> list[int]:
        return torch.randint(6, 100, (size,), generator=gen).tolist()

    groups = []
    for _ in range(n_groups):
        prompt = ints(int(torch.randint(2, 7, (1,), generator=gen)))
        rollouts = []
        for _ in range(n):
            length = int(torch.randint(1, 9, (1,), generator=gen))
            logprobs = (-torch.rand(length, generator=gen) * 3).tolist()
            rollouts.append(Rollout(ints(length), logprobs, float(torch.randint(0, 2, (1,), generator=gen))))
        groups.append(GroupSamples(prompt, rollouts))
    return groups


def test_auto_is_bfloat16_on_this_gpu(
    tiny_model_dir: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(hardware.AUTO_DTYPE_ENV, raising=False)  # the suite pins float32 for CPU checks
    assert hardware.native_bfloat16("cuda") and hardware.auto_dtype("cuda") == "bfloat16"
    trainer = Trainer(make_spec(tiny_model_dir, "auto"), tiny_model_dir, device=CUDA, world=world)
    assert trainer.dtype == torch.bfloat16
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in trainer.model.parameters())


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 2e-3), ("bfloat16", 0.15)])
def test_sequence_logprobs_match_a_float32_cpu_forward(
    tiny_model_dir: Path, world: World, dtype: str, tolerance: float
) -> None:
    from transformers import AutoModelForCausalLM

    trainer = Trainer(make_spec(tiny_model_dir, dtype), tiny_model_dir, device=CUDA, world=world)
    (group,) = random_groups(0, n_groups=1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    expected = []
    for rollout in group.rollouts:
        ids = torch.tensor([group.prompt_token_ids + rollout.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
        p = len(group.prompt_token_ids)
        expected.append(sum(float(logp[p - 1 + j, t]) for j, t in enumerate(rollout.token_ids)))
    got = trainer.sequence_logprobs([group]).cpu().tolist()
    assert got == pytest.approx(expected, abs=tolerance * max(len(r.token_ids) for r in group.rollouts))


def test_grpo_learns_in_bfloat16(tiny_model_dir: Path, world: World) -> None:
    trainer = Trainer(make_spec(tiny_model_dir, "bfloat16"), tiny_model_dir, device=CUDA, world=world)
    prompt, good, bad = [10, 11, 12], [40, 41, 42, 43], [50, 51, 52, 53]
    group = GroupSamples(prompt, [Rollout(good, [-4.0] * 4, 1.0), Rollout(bad, [-4.0] * 4, 0.0)] * 2)
    before = trainer.sequence_logprobs([group]).cpu()
    for _ in range(4):
        metrics = trainer.train_step([group])
    after = trainer.sequence_logprobs([group]).cpu()
    assert (after[0] - after[1]) - (before[0] - before[1]) > 1.0 and after[0] > before[0]
    assert metrics["grad_norm"] > 0 and trainer.step == 4


def flat_grad(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.grad.full_tensor().flatten().float() for p in trainer.model.parameters()])


def test_a_bfloat16_step_points_where_the_float32_step_does(tiny_model_dir: Path, world: World) -> None:
    groups = random_groups(1)
    grads, losses = [], []
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(make_spec(tiny_model_dir, dtype), tiny_model_dir, device=CUDA, world=world)
        losses.append(trainer.accumulate_gradients(groups)["loss"])
        grads.append(flat_grad(trainer))
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item()
    assert cosine > 0.98, cosine
    assert losses[1] == pytest.approx(losses[0], abs=0.02)


def test_a_gpu_checkpoint_resumes_the_same_training(
    tiny_model_dir: Path, world: World, tmp_path: Path
) -> None:
    spec = make_spec(tiny_model_dir, "bfloat16", algorithm={"kl": {"coef": 0.05}})
    batches = [random_groups(seed) for seed in range(4)]
    a = Trainer(spec, tiny_model_dir, device=CUDA, world=world)
    for groups in batches[:2]:
        a.train_step(groups)
    path = a.save_checkpoint(tmp_path)
    metrics_a = [a.train_step(groups) for groups in batches[2:]]
    b = Trainer(spec, tiny_model_dir, device=CUDA, world=world)
    b.load_checkpoint(path)
    metrics_b = [b.train_step(groups) for groups in batches[2:]]
    for ma, mb in zip(metrics_a, metrics_b, strict=True):
        assert mb["loss"] == pytest.approx(ma["loss"], abs=1e-4)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pb.full_tensor(), pa.full_tensor(), atol=1e-5, rtol=0)


def test_step_time_on_the_gpu_is_reported(tiny_model_dir: Path, world: World, capsys: Any) -> None:
    """Not a benchmark (bench/learner_step.py is): the figure lands in the test output for the record."""
    trainer = Trainer(make_spec(tiny_model_dir, "bfloat16"), tiny_model_dir, device=CUDA, world=world)
    groups = random_groups(2, n_groups=8, n=8)
    trainer.train_step(groups)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        trainer.train_step(groups)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 5
    with capsys.disabled():
        print(
            f"\n[gpu] {torch.cuda.get_device_name()}: tiny-model step of 64 samples in {seconds * 1e3:.1f} ms"
        )
    assert seconds > 0
