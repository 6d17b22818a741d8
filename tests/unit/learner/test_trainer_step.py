"""The training core in one process (a gloo world of one): learning, exact accumulation, checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from rlfabric.learner.batch import GroupSamples, Rollout
from rlfabric.learner.checkpoint import COMPLETE, checkpoint_dir, latest_complete, prune
from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.parts import lr_multiplier
from rlfabric.learner.trainer import Trainer, sampling_temperature
from rlfabric.runspec import RunSpec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world() -> World:
    return init_distributed(CPU)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model (another seed): a reference the policy differs from from the start."""
    from rlfabric.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("reference"), seed=1)


def make_spec(model_dir: Path, **overrides: Any) -> RunSpec:
    """A run spec for the tiny model; `overrides` are nested section dicts."""
    raw: dict[str, Any] = {
        "model": {"path": str(model_dir)},
        "dataset": {"path": "unused.jsonl"},
        "rollout": {"sampling": {"n": 4, "max_tokens": 16}},
        "optim": {"lr": 5e-3},
        "train": {"micro_batch_size": 4, "steps": 20},
    }
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return RunSpec.model_validate(raw)


def random_groups(seed: int, n_groups: int = 2, n: int = 4) -> list[GroupSamples]:
    """Groups with varied prompt/completion lengths, rewards and rollout log-probs."""
    gen = torch.Generator().manual_seed(seed)

    def ints(low: int, high: int, size: int) -> list[int]:
        return torch.randint(low, high, (size,), generator=gen).tolist()

    groups = []
    for _ in range(n_groups):
        prompt = ints(6, 100, int(torch.randint(2, 7, (1,), generator=gen)))
        rollouts = []
        for _ in range(n):
            length = int(torch.randint(1, 9, (1,), generator=gen))
            logprobs = (-torch.rand(length, generator=gen) * 3).tolist()
            reward = float(torch.randint(0, 2, (1,), generator=gen))
            rollouts.append(Rollout(ints(6, 100, length), logprobs, reward))
        groups.append(GroupSamples(prompt, rollouts))
    return groups


def test_sequence_logprobs_match_a_plain_forward_pass(tiny_model_dir: Path, world: World) -> None:
    from transformers import AutoModelForCausalLM

    trainer = Trainer(make_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    groups = random_groups(0, n_groups=1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    expected = []
    for rollout in groups[0].rollouts:
        ids = torch.tensor([groups[0].prompt_token_ids + rollout.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
        p = len(groups[0].prompt_token_ids)
        expected.append(sum(float(logp[p - 1 + j, tok]) for j, tok in enumerate(rollout.token_ids)))
    assert trainer.sequence_logprobs(groups).tolist() == pytest.approx(expected, abs=1e-4)


def test_grpo_raises_the_rewarded_completion_over_the_unrewarded_one(
    tiny_model_dir: Path, world: World
) -> None:
    trainer = Trainer(make_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    prompt, good, bad = [10, 11, 12], [40, 41, 42, 43], [50, 51, 52, 53]
    group = GroupSamples(
        prompt, [Rollout(good, [-4.0] * 4, 1.0), Rollout(bad, [-4.0] * 4, 0.0)] * 2, group_id="g"
    )
    before = trainer.sequence_logprobs([group])
    for _ in range(4):
        metrics = trainer.train_step([group])
    after = trainer.sequence_logprobs([group])
    assert (after[0] - after[1]) - (before[0] - before[1]) > 1.0
    assert after[0] > before[0]
    assert metrics["reward_mean"] == pytest.approx(0.5)
    assert metrics["tokens"] == 16
    assert metrics["samples"] == 4
    assert metrics["grad_norm"] > 0
    assert trainer.step == trainer.policy_version == 4


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor().clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize(
    ("aggregation", "kl_mode"),
    [("token_mean", "loss"), ("token_mean", "reward"), ("seq_mean_token_mean", "loss"), ("constant", "loss")],
)
def test_accumulating_over_micro_batches_gives_the_same_gradient(
    tiny_model_dir: Path, reference_dir: Path, world: World, aggregation: str, kl_mode: str
) -> None:
    groups = random_groups(1)
    algorithm = {"loss_aggregation": aggregation, "entropy_coef": 0.01, "kl": {"coef": 0.1, "mode": kl_mode}}
    model = {"path": str(tiny_model_dir), "reference_path": str(reference_dir)}
    grads, metrics = [], []
    for micro in (8, 2):
        spec = make_spec(tiny_model_dir, model=model, algorithm=algorithm, train={"micro_batch_size": micro})
        trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
        metrics.append(trainer.accumulate_gradients(groups))
        grads.append(_grads(trainer))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=0, msg=name)
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], abs=1e-6)
    assert metrics[1]["entropy"] == pytest.approx(metrics[0]["entropy"], abs=1e-5)
    assert metrics[0]["kl"] > 1e-3
    assert metrics[1]["kl"] == pytest.approx(metrics[0]["kl"], abs=1e-5)


def test_checkpoint_resume_reproduces_the_following_steps(
    tiny_model_dir: Path, world: World, tmp_path: Path
) -> None:
    spec = make_spec(
        tiny_model_dir, optim={"warmup_steps": 2, "schedule": "cosine"}, algorithm={"kl": {"coef": 0.05}}
    )
    batches = [random_groups(seed) for seed in range(4)]
    a = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    for groups in batches[:2]:
        a.train_step(groups)
    path = a.save_checkpoint(tmp_path, extra={"ledger": b"\x00\x01", "note": "two"})
    metrics_a = [a.train_step(groups) for groups in batches[2:]]

    b = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    assert b.load_checkpoint(path) == {"ledger": b"\x00\x01", "note": "two"}
    assert (b.step, b.policy_version) == (2, 2)
    metrics_b = [b.train_step(groups) for groups in batches[2:]]

    for ma, mb in zip(metrics_a, metrics_b, strict=True):
        assert mb == pytest.approx(ma, abs=1e-6)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pb.full_tensor(), pa.full_tensor(), atol=1e-6, rtol=0, msg=name)
    state_a, state_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for key, sa in state_a.items():
        assert state_b[key]["step"] == sa["step"]
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                state_b[key][name].full_tensor(), sa[name].full_tensor(), atol=1e-6, rtol=0
            )
    assert b.scheduler.get_last_lr() == pytest.approx(a.scheduler.get_last_lr())


def test_checkpoint_files_load_without_pickle(tiny_model_dir: Path, world: World, tmp_path: Path) -> None:
    trainer = Trainer(make_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    path = trainer.save_checkpoint(tmp_path)
    assert path == checkpoint_dir(tmp_path, 0) and (path / COMPLETE).is_file()
    assert not list(tmp_path.glob("*.tmp"))
    json.loads((path / "meta.json").read_text())
    for rng in path.glob("rng-*.pt"):
        torch.load(rng, weights_only=True)


def test_latest_complete_ignores_unfinished_checkpoints_and_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 5):
        checkpoint_dir(tmp_path, step).mkdir()
        (checkpoint_dir(tmp_path, step) / COMPLETE).write_text("{}")
    (tmp_path / "step-000004.tmp").mkdir()
    (tmp_path / "step-000006.tmp").mkdir()
    checkpoint_dir(tmp_path, 7).mkdir()  # no marker: not complete
    assert latest_complete(tmp_path) == checkpoint_dir(tmp_path, 5)
    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-000001", "step-000002", "step-000004.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000003",
        "step-000005",
        "step-000006.tmp",
        "step-000007",
    ]
    assert latest_complete(tmp_path / "missing") is None


def test_lr_schedule_warms_up_then_decays() -> None:
    optim = make_spec(Path("m"), optim={"warmup_steps": 4, "schedule": "linear"}).optim
    assert [lr_multiplier(s, optim, 12) for s in (0, 3, 4, 8, 12)] == pytest.approx([0.25, 1, 1, 0.5, 0])
    cosine = make_spec(Path("m"), optim={"schedule": "cosine"}).optim
    assert lr_multiplier(5, cosine, 10) == pytest.approx(0.5)


def test_chunked_logprobs_and_entropy_match_a_full_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlfabric.learner import parts

    monkeypatch.setattr(parts, "LOGPROB_CHUNK", 3)
    logits = torch.randn(2, 7, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 7))
    logp, entropy = parts.token_logprobs_and_entropy(logits, targets, entropy_grad=False)
    full = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(logp, full.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach())
    assert logp.requires_grad and not entropy.requires_grad
    logp, entropy = parts.token_logprobs_and_entropy(logits, targets, entropy_grad=False, temperature=0.5)
    tempered = torch.log_softmax(logits / 0.5, dim=-1)
    torch.testing.assert_close(logp, tempered.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(entropy, -(tempered.exp() * tempered).sum(-1).detach())


def test_the_logits_are_divided_by_the_sampling_temperature_unless_greedy(tiny_model_dir: Path) -> None:
    for temperature, divisor in ((0.7, 0.7), (1.3, 1.3), (1.0, 1.0), (0.0, 1.0)):
        spec = make_spec(tiny_model_dir, rollout={"sampling": {"temperature": temperature}})
        assert sampling_temperature(spec) == divisor


def test_activation_checkpointing_gives_the_same_gradient(tiny_model_dir: Path, world: World) -> None:
    groups = random_groups(2)
    grads = []
    for checkpointing in (False, True):
        spec = make_spec(tiny_model_dir, train={"activation_checkpointing": checkpointing})
        trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
        trainer.accumulate_gradients(groups)
        grads.append(_grads(trainer))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=0, msg=name)


def test_several_epochs_step_once_and_see_a_moved_policy(tiny_model_dir: Path, world: World) -> None:
    spec = make_spec(tiny_model_dir, algorithm={"ppo_epochs": 3})
    trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    metrics = trainer.train_step(random_groups(3))
    assert trainer.step == 1
    assert trainer.scheduler.last_epoch == 3
    assert metrics["approx_kl"] > 0  # the last epoch's ratios are no longer 1


def test_truncated_completions_can_be_masked_out_of_the_loss(tiny_model_dir: Path, world: World) -> None:
    spec = make_spec(
        tiny_model_dir, algorithm={"overlong": {"mask_truncated": True, "penalty": True, "buffer_tokens": 4}}
    )
    trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    cut = Rollout([20] * 16, [-1.0] * 16, 1.0, finish_reason="length")
    done = Rollout([21] * 3, [-1.0] * 3, 0.0)
    metrics = trainer.train_step([GroupSamples([10, 11], [cut, done, cut, done])])
    assert metrics["tokens"] == 6
    assert metrics["response_length_mean"] == pytest.approx(9.5)


def test_bfloat16_on_cpu_attends_in_float32_and_matches_float32_attention(
    tiny_model_dir: Path, world: World
) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rlfabric.learner.parts import FLOAT32_ATTENTION, load_model, sdpa_in_float32

    model = load_model(tiny_model_dir, CPU, torch.bfloat16, trainable=True, checkpointing=False)
    assert model.config._attn_implementation == FLOAT32_ATTENTION
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    module = model.model.layers[0].self_attn
    out, _ = sdpa_in_float32(module, q, k, v, None, is_causal=True)
    expected, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), None, is_causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16), atol=0, rtol=0)
    fp32_model = load_model(tiny_model_dir, CPU, torch.float32, trainable=True, checkpointing=False)
    assert fp32_model.config._attn_implementation == "sdpa"


def test_a_bfloat16_step_on_cpu_learns(tiny_model_dir: Path, world: World) -> None:
    spec = make_spec(tiny_model_dir, model={"path": str(tiny_model_dir), "dtype": "bfloat16"})
    trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    group = GroupSamples([10, 11], [Rollout([20] * 4, [-1.0] * 4, 1.0), Rollout([30] * 4, [-1.0] * 4, 0.0)])
    before = trainer.sequence_logprobs([group])
    for _ in range(3):
        metrics = trainer.train_step([group])
    after = trainer.sequence_logprobs([group])
    assert (after[0] - after[1]) - (before[0] - before[1]) > 1.0
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_no_grad_passes_attend_in_bfloat16_and_a_frozen_model_is_held_in_it(
    tiny_model_dir: Path, world: World
) -> None:
    """Forward-only passes (the reference, old log-probs) skip the float32 detour, whose gain is in the
    backward; a frozen model in a world of one is held in the compute dtype, unsharded, and computes
    exactly what the sharded mixed-precision policy computes."""
    from torch.distributed.fsdp import FSDPModule
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rlfabric.learner.parts import load_model, sdpa_in_float32

    frozen = load_model(tiny_model_dir, CPU, torch.bfloat16, trainable=False, checkpointing=False)
    policy = load_model(tiny_model_dir, CPU, torch.bfloat16, trainable=True, checkpointing=False)
    assert not isinstance(frozen, FSDPModule) and isinstance(policy, FSDPModule)
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    module = frozen.model.layers[0].self_attn
    with torch.no_grad():
        out, _ = sdpa_in_float32(module, q, k, v, None, is_causal=True)
        native, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True)
    torch.testing.assert_close(out, native, atol=0, rtol=0)
    ids = torch.tensor([[10, 11, 12, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        got = frozen(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def _own_logprobs(model_dir: Path, groups: list[GroupSamples]) -> list[list[list[float]]]:
    """The float32 model's log-prob of every completion token: [group][sample][token]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    for group in groups:
        rows = []
        for rollout in group.rollouts:
            ids = torch.tensor([group.prompt_token_ids + rollout.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
            p = len(group.prompt_token_ids)
            rows.append([float(logp[p - 1 + j, tok]) for j, tok in enumerate(rollout.token_ids)])
        out.append(rows)
    return out


def _with_logprobs(groups: list[GroupSamples], logprobs: list[list[list[float]]]) -> list[GroupSamples]:
    return [
        GroupSamples(
            g.prompt_token_ids,
            [Rollout(r.token_ids, lp, r.reward) for r, lp in zip(g.rollouts, rows, strict=True)],
            g.group_id,
        )
        for g, rows in zip(groups, logprobs, strict=True)
    ]


def test_old_policy_rollout_takes_the_ratio_against_the_engine_logprobs(
    tiny_model_dir: Path, world: World
) -> None:
    """With `old_policy: rollout` the PPO ratio is pi / pi_rollout: engine log-probs equal to the
    trainer's own give the on-policy gradient exactly; log-probs that put every token's ratio past the
    clip in its advantage's direction (the policy already moved that way) leave no gradient at all."""
    groups = random_groups(3)
    own = _own_logprobs(tiny_model_dir, groups)
    no_kl = {"kl": {"coef": 0.0}}
    spec = make_spec(tiny_model_dir, algorithm={**no_kl, "old_policy": "rollout"})
    trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    trainer.accumulate_gradients(_with_logprobs(groups, own))
    got = _grads(trainer)
    baseline = Trainer(make_spec(tiny_model_dir, algorithm={**no_kl, "tis_cap": None}), tiny_model_dir,
                       device=CPU, world=world)  # fmt: skip
    baseline.accumulate_gradients(groups)
    for name, grad in _grads(baseline).items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=name)

    def moved(group: GroupSamples, rows: list[list[float]]) -> list[list[float]]:
        mean = sum(r.reward for r in group.rollouts) / len(group.rollouts)
        # reward above the group's mean: positive advantage, ratio e^3 > 1 + eps; below: e^-3 < 1 - eps
        shift = [-3.0 if r.reward > mean else 3.0 for r in group.rollouts]
        return [[lp + d for lp in row] for d, row in zip(shift, rows, strict=True)]

    far = [moved(g, rows) for g, rows in zip(groups, own, strict=True)]
    metrics = trainer.accumulate_gradients(_with_logprobs(groups, far))
    assert metrics["clip_fraction"] > 0.5
    for name, grad in _grads(trainer).items():
        assert grad.abs().max() == 0, name
    trainer.accumulate_gradients(_with_logprobs(groups, own))
    assert any(grad.abs().max() > 0 for grad in _grads(trainer).values())


def test_forward_only_passes_leave_no_stale_weights_behind(
    tiny_model_dir: Path, world: World, tmp_path: Path
) -> None:
    """In a world of one the layers stay unsharded (compute-dtype copies) after forward-only passes and
    through a step's micro-batches; an optimizer step, a checkpoint loaded or a state dict taken after
    them must act on the master weights, and the next forward must see them."""
    spec = make_spec(tiny_model_dir, model={"path": str(tiny_model_dir), "dtype": "bfloat16"})
    trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    groups = random_groups(5)
    path = trainer.save_checkpoint(tmp_path)
    before = trainer.sequence_logprobs(groups)
    trainer.accumulate_gradients(groups)
    assert torch.equal(trainer.sequence_logprobs(groups), before)  # forward only, after the backward
    assert not any(isinstance(p, DTensor) for p in trainer.model.parameters())  # unsharded
    trainer._optimizer_step()
    moved = trainer.sequence_logprobs(groups)
    assert not torch.allclose(moved, before)
    stepped = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    stepped.load_checkpoint(trainer.save_checkpoint(tmp_path / "stepped"))
    torch.testing.assert_close(stepped.sequence_logprobs(groups), moved, atol=0, rtol=0)
    trainer.load_checkpoint(path)
    torch.testing.assert_close(trainer.sequence_logprobs(groups), before, atol=0, rtol=0)
    state = trainer.full_state_dict()
    fresh = Trainer(spec, tiny_model_dir, device=CPU, world=world).full_state_dict()
    for name, tensor in fresh.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0, msg=name)


def test_compiled_blocks_train_as_the_eager_ones(tiny_model_dir: Path, world: World) -> None:
    """`train.compile` compiles every norm and MLP of the policy and the reference (attention stays
    eager), and a bfloat16 step computes the same gradients as eager up to bfloat16 rounding."""
    groups = random_groups(7)
    grads, metrics = [], []
    for compiled in (False, True):
        spec = make_spec(
            tiny_model_dir,
            model={"path": str(tiny_model_dir), "dtype": "bfloat16"},
            algorithm={"kl": {"coef": 0.1}},
            train={"compile": compiled},
        )
        trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
        for model in (trainer.model, trainer.reference):
            assert model is not None
            blocks = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
            attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
            assert len(blocks) == 3 * len(attention) + 1 > 1  # two norms and an MLP a layer, the final norm
            assert all((m._compiled_call_impl is not None) == compiled for m in blocks)
            assert all(m._compiled_call_impl is None for m in attention)
        metrics.append(trainer.accumulate_gradients(groups))
        grads.append(_grads(trainer))
    assert metrics[1]["kl"] == pytest.approx(metrics[0]["kl"], abs=1e-3)
    for name, grad in grads[0].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(grads[1][name], grad, atol=0.02 * scale + 1e-6, rtol=0.05, msg=name)


def test_a_step_before_warm_up_runs_eager_and_warm_up_leaves_no_trace(
    tiny_model_dir: Path, world: World
) -> None:
    """With `train.compile`, a step before `Trainer.warm_up` compiles nothing (the loop warms up after the
    first step, while the replicas generate the next); warm-up compiles the blocks and changes nothing:
    the first real step after it is the eager step a trainer without it takes."""
    from torch._dynamo.utils import counters

    groups = random_groups(8)
    results = []
    for warm in (False, True):
        spec = make_spec(tiny_model_dir, algorithm={"kl": {"coef": 0.1}}, train={"compile": True})
        trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
        before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
        torch._dynamo.reset()
        counters.clear()  # reset() keeps the counts of earlier tests' compiles
        if warm:
            trainer.warm_up()
            assert counters["frames"]["ok"] > 0, "warm-up compiled nothing"
            assert all(p.grad is None for p in trainer.model.parameters())
            assert trainer.step == 0 and trainer.kl.value == pytest.approx(0.1)
            assert not trainer.optimizer.state
            for name, param in trainer.model.named_parameters():
                torch.testing.assert_close(param.full_tensor(), before[name], atol=0, rtol=0, msg=name)
        metrics = trainer.train_step(groups)
        if not warm:
            assert counters["frames"]["total"] == 0, "a step before warm-up compiled"
        results.append((metrics, {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}))
    (cold, cold_weights), (warmed, warm_weights) = results
    assert warmed["loss"] == pytest.approx(cold["loss"], abs=1e-6)
    for name, weight in cold_weights.items():
        # compiled and eager blocks round differently: up to ~1.3e-5 apart after one Adam step (whose first
        # update is ~lr = 5e-3 per weight, larger where a gradient is near Adam's eps): 1 % of the move
        torch.testing.assert_close(warm_weights[name], weight, atol=5e-5, rtol=0, msg=name)


def test_reinforce_pp_baseline_chosen_in_the_run_spec_trains(tiny_model_dir: Path, world: World) -> None:
    """The estimator a run file names is the one the trainer uses: the rewarded completion rises."""
    spec = make_spec(tiny_model_dir, algorithm={"advantage": "reinforce_pp_baseline"})
    trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
    prompt, good, bad = [10, 11, 12], [40, 41, 42, 43], [50, 51, 52, 53]
    group = GroupSamples(
        prompt, [Rollout(good, [-4.0] * 4, 1.0), Rollout(bad, [-4.0] * 4, 0.0)] * 2, group_id="g"
    )
    before = trainer.sequence_logprobs([group])
    for _ in range(4):
        trainer.train_step([group])
    after = trainer.sequence_logprobs([group])
    assert (after[0] - after[1]) - (before[0] - before[1]) > 1.0


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().full_tensor().clone() for name, p in trainer.model.named_parameters()}


def test_rollout_trust_kl_scales_a_stale_step_and_leaves_an_on_policy_one_alone(
    tiny_model_dir: Path, world: World
) -> None:
    """`algorithm.rollout_trust_kl`: engine log-probs one nat below the trainer's on every token (k3
    mismatch e - 2) make the step move the weights by `trust / mismatch` of the move without the trust
    region (a first AdamW step is about `lr * sign(grad)`; the gradient is scaled too, so weights whose
    gradient then nears Adam's eps move a little less), the stale gradient enters Adam's first moment at
    that weight, and the next step's scheduled LR is unchanged; engine log-probs equal to the trainer's
    take exactly the step without the trust region."""
    groups = random_groups(5)
    own = _own_logprobs(tiny_model_dir, groups)
    lagged = _with_logprobs(groups, [[[lp - 1.0 for lp in row] for row in rows] for rows in own])
    trust = 0.05

    def step(
        groups_: list[GroupSamples], trust_kl: float | None
    ) -> tuple[dict[str, torch.Tensor], Trainer, dict[str, float]]:
        algorithm = {"kl": {"coef": 0.0}, "tis_cap": None, "rollout_trust_kl": trust_kl}
        trainer = Trainer(
            make_spec(tiny_model_dir, algorithm=algorithm), tiny_model_dir, device=CPU, world=world
        )
        before = _weights(trainer)
        metrics = trainer.train_step(groups_)
        return {n: w - before[n] for n, w in _weights(trainer).items()}, trainer, metrics

    def first_moment(trainer: Trainer) -> torch.Tensor:
        return torch.cat(
            [
                trainer.optimizer.state[p]["exp_avg"].full_tensor().flatten()
                for p in trainer.model.parameters()
            ]
        )

    plain, plain_trainer, _ = step(lagged, None)
    scaled, trainer, metrics = step(lagged, trust)
    scale = metrics["lr_scale"]
    assert metrics["rollout_mismatch_kl"] == pytest.approx(math.e - 2, rel=1e-3)
    assert scale == pytest.approx(trust / metrics["rollout_mismatch_kl"])
    assert metrics["lr"] == pytest.approx(5e-3 * scale)
    all_plain = torch.cat([d.flatten() for d in plain.values()])
    all_scaled = torch.cat([scaled[n].flatten() for n in plain])
    assert all_plain.abs().max() > 1e-4
    assert bool((all_scaled.abs() <= all_plain.abs() * scale * (1 + 1e-3) + 1e-9).all())
    assert all_scaled.norm().item() == pytest.approx(scale * all_plain.norm().item(), rel=0.05)
    torch.testing.assert_close(
        first_moment(trainer), first_moment(plain_trainer) * scale, atol=1e-9, rtol=1e-4
    )
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)  # the next step's LR

    on_policy, _, metrics = step(_with_logprobs(groups, own), trust)
    assert metrics["lr_scale"] == 1.0 and metrics["rollout_mismatch_kl"] < 1e-4
    unscaled, _, _ = step(_with_logprobs(groups, own), None)
    for name, delta in unscaled.items():
        torch.testing.assert_close(on_policy[name], delta, atol=0, rtol=0, msg=name)


def test_a_step_reports_the_share_of_groups_whose_samples_all_got_one_reward(
    tiny_model_dir: Path, world: World
) -> None:
    trainer = Trainer(make_spec(tiny_model_dir), tiny_model_dir, device=CPU, world=world)
    groups = random_groups(3, n_groups=4)
    for group, rewards in zip(groups, ([1.0] * 4, [0.0] * 4, [0.5] * 4, [1.0, 0.0, 1.0, 1.0]), strict=True):
        for rollout, reward in zip(group.rollouts, rewards, strict=True):
            rollout.reward = reward
    assert trainer.accumulate_gradients(groups)["uniform_reward_groups_fraction"] == pytest.approx(0.75)
    assert "uniform_reward_groups_fraction" not in trainer.accumulate_gradients(random_groups(3, n=1))
