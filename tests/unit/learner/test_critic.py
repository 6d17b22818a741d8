"""PPO with a critic and GAE in one process (a gloo world of one): learning, the value fit, exact
accumulation, checkpoints and the config rule."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from test_trainer_step import make_spec, random_groups

from rlfabric.learner.batch import GroupSamples, Rollout, build_micro_batches
from rlfabric.learner.critic import critic_metrics
from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.trainer import Trainer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world() -> World:
    return init_distributed(CPU)


def ppo_spec(model_dir: Path, **overrides: Any) -> Any:
    """`make_spec` with the gae estimator; `overrides` are nested section dicts."""
    algorithm = {"advantage": "gae", "lam": 0.95, **overrides.pop("algorithm", {})}
    return make_spec(model_dir, algorithm=algorithm, **overrides)


def _critic_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    assert trainer.critic is not None
    return {name: p.grad.full_tensor().clone() for name, p in trainer.critic.model.named_parameters()}


def test_ppo_raises_the_rewarded_completion_over_the_unrewarded_one(
    tiny_model_dir: Path, world: World
) -> None:
    trainer = Trainer(ppo_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    prompt, good, bad = [10, 11, 12], [40, 41, 42, 43], [50, 51, 52, 53]
    group = GroupSamples(prompt, [Rollout(good, [-4.0] * 4, 1.0), Rollout(bad, [-4.0] * 4, 0.0)] * 2)
    before = trainer.sequence_logprobs([group])
    for _ in range(4):
        metrics = trainer.train_step([group])
    after = trainer.sequence_logprobs([group])
    assert (after[0] - after[1]) - (before[0] - before[1]) > 1.0
    assert after[0] > before[0]
    assert metrics["tokens"] == 16
    for name in ("value_loss", "value_clip_fraction", "value_mean", "return_mean", "explained_variance"):
        assert name in metrics
    assert metrics["critic_grad_norm"] > 0
    assert metrics["critic_lr"] == pytest.approx(10 * trainer.spec.optim.lr)


def test_critic_values_align_with_the_targets(tiny_model_dir: Path, world: World) -> None:
    """Values of one padded micro-batch equal each sequence's own unpadded forward pass."""
    trainer = Trainer(ppo_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    assert trainer.critic is not None
    groups = random_groups(4, n_groups=1)
    mb = build_micro_batches(groups, 4, trainer.pad_id)[0]
    values = trainer.critic.values(mb)
    assert values.shape == mb.input_ids.shape and values.dtype == torch.float32
    for b in range(mb.input_ids.shape[0]):
        length = int(mb.attention_mask[b].sum())
        alone = trainer.critic.model(mb.input_ids[b : b + 1, :length], mb.attention_mask[b : b + 1, :length])
        torch.testing.assert_close(values[b, :length], alone[0].detach(), atol=1e-5, rtol=0)


def test_value_loss_decreases_on_a_fixed_batch(tiny_model_dir: Path, world: World) -> None:
    """With lam = 1 the returns are the plain rewards-to-go: fixed targets, whatever the critic says."""
    spec = ppo_spec(tiny_model_dir, algorithm={"lam": 1.0}, optim={"critic_lr": 3e-4})
    trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    groups = random_groups(5)
    metrics = [trainer.train_step(groups) for _ in range(6)]
    losses = [m["value_loss"] for m in metrics]
    assert losses[-1] < 0.5 * losses[0]
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert metrics[-1]["explained_variance"] > metrics[0]["explained_variance"]


@pytest.mark.parametrize("kl_mode", ["loss", "reward"])
def test_accumulating_over_micro_batches_gives_the_same_critic_gradient(
    tiny_model_dir: Path, world: World, kl_mode: str
) -> None:
    groups = random_groups(6)
    algorithm = {"kl": {"coef": 0.1, "mode": kl_mode}, "loss_aggregation": "seq_mean_token_mean"}
    grads, metrics = [], []
    for micro in (8, 2):  # 1 vs 4 micro-batches
        spec = ppo_spec(tiny_model_dir, algorithm=algorithm, train={"micro_batch_size": micro})
        trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
        metrics.append(trainer.accumulate_gradients(groups))
        grads.append(_critic_grads(trainer))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=0, msg=name)
    assert any(float(g.abs().max()) > 0 for g in grads[0].values())
    for name in ("value_loss", "value_mean", "return_mean", "explained_variance", "loss"):
        assert metrics[1][name] == pytest.approx(metrics[0][name], abs=1e-5), name


def test_checkpoint_resume_reproduces_the_following_steps_with_the_critic(
    tiny_model_dir: Path, world: World, tmp_path: Path
) -> None:
    spec = ppo_spec(tiny_model_dir, optim={"warmup_steps": 2, "schedule": "cosine"})
    batches = [random_groups(seed) for seed in range(4)]
    a = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    for groups in batches[:2]:
        a.train_step(groups)
    path = a.save_checkpoint(tmp_path)
    metrics_a = [a.train_step(groups) for groups in batches[2:]]

    torch.manual_seed(123)  # a different fresh value head: the checkpoint must overwrite it
    b = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    b.load_checkpoint(path)
    metrics_b = [b.train_step(groups) for groups in batches[2:]]

    for ma, mb in zip(metrics_a, metrics_b, strict=True):
        assert mb == pytest.approx(ma, abs=1e-6)
    assert a.critic is not None and b.critic is not None
    critic_a, critic_b = a.critic, b.critic
    for (name, pa), pb in zip(critic_a.model.named_parameters(), critic_b.model.parameters(), strict=True):
        torch.testing.assert_close(pb.full_tensor(), pa.full_tensor(), atol=1e-6, rtol=0, msg=name)
    state_a, state_b = critic_a.optimizer.state_dict()["state"], critic_b.optimizer.state_dict()["state"]
    for key, sa in state_a.items():
        assert state_b[key]["step"] == sa["step"]
        torch.testing.assert_close(state_b[key]["exp_avg"].full_tensor(), sa["exp_avg"].full_tensor())
    assert critic_b.scheduler.get_last_lr() == pytest.approx(critic_a.scheduler.get_last_lr())


def test_gae_without_a_value_loss_is_rejected(tiny_model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="value_coef must be > 0"):
        ppo_spec(tiny_model_dir, algorithm={"value_coef": 0.0})
    assert ppo_spec(tiny_model_dir).optim.critic_peak_lr == pytest.approx(10 * 5e-3)
    assert ppo_spec(tiny_model_dir, optim={"critic_lr": 1e-4}).optim.critic_peak_lr == 1e-4


def test_explained_variance_from_summed_statistics() -> None:
    returns, values = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.9, 0.1, 0.8, 0.0])
    error = returns - values
    total = {
        "tokens": 4.0,
        "value_loss": 0.1,
        "value_clip_fraction": 1.0,
        "value_sum": float(values.sum()),
        "return_sum": float(returns.sum()),
        "return_sq": float((returns**2).sum()),
        "value_error_sum": float(error.sum()),
        "value_error_sq": float((error**2).sum()),
    }
    metrics = critic_metrics(total)
    expected = 1 - error.var(unbiased=False) / returns.var(unbiased=False)
    assert metrics["explained_variance"] == pytest.approx(float(expected))
    assert metrics["value_clip_fraction"] == 0.25
    assert metrics["return_mean"] == 0.5
