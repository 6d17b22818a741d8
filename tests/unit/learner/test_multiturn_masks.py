"""Multi-turn samples: environment tokens are context, never loss; turn rewards give turn-level credit.

The running example is a 2-turn trajectory with environment tokens in the middle:

    completion  40 41 | 60 61 62 | 42 43
    mask         1  1 |  0  0  0 |  1  1
    turns       model (reward 0.5) | environment | model        final reward 1.0

so the turn reward sits on column 1 (the model turn's last token) and the final reward on column 6.
Hand-built "model tokens only" tensors keep columns 0, 1, 5, 6.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from rlfabric.contracts import wire
from rlfabric.learner.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    PolicyLossConfig,
    aggregate,
    apply_kl_penalty,
    entropy_bonus,
    entropy_from_logits,
    gae,
    policy_loss,
    rollout_mismatch,
)
from rlfabric.learner.batch import GroupSamples, Rollout, StepBatch, build_micro_batches
from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.samples import Turn
from rlfabric.learner.trainer import Trainer
from rlfabric.runspec import RunSpec
from rlfabric.v1 import common_pb2, queue_pb2

CPU = torch.device("cpu")
PROMPT = [10, 11, 12]
MODEL_COLUMNS = [0, 1, 5, 6]


def two_turn(final: float = 1.0, turn_reward: float | None = 0.5) -> Rollout:
    """The module docstring's trajectory; env tokens carry a logprob of 0."""
    return Rollout(
        token_ids=[40, 41, 60, 61, 62, 42, 43],
        logprobs=[-1.0, -2.0, 0.0, 0.0, 0.0, -0.5, -0.25],
        reward=final,
        loss_mask=[1, 1, 0, 0, 0, 1, 1],
        turns=[Turn(0, "model", turn_reward), Turn(2, "environment"), Turn(5, "model")],
    )


def tool_turn() -> Rollout:
    """A second sample: model, tool result (rewarded 0.0, which is not 'no reward'), model; final 0.25."""
    return Rollout(
        token_ids=[44, 45, 63, 64, 46],
        logprobs=[-0.75, -1.5, 0.0, 0.0, -3.0],
        reward=0.25,
        loss_mask=[1, 1, 0, 0, 1],
        turns=[Turn(0, "model"), Turn(2, "tool", 0.0), Turn(4, "model")],
    )


def compact(x: Tensor) -> Tensor:
    """The model-token columns of a (1, 7) tensor: (1, 4)."""
    return x[:, MODEL_COLUMNS]


# -- samples and batches ---------------------------------------------------------------------------------


def test_rewards_land_on_the_last_policy_token_of_their_turn() -> None:
    rollout = two_turn()
    assert rollout.num_turns == 3
    assert rollout.last_model_token() == 6
    assert rollout.reward_positions() == [(1, 0.5)]
    # a reward on an environment or tool turn credits the action before it
    assert tool_turn().reward_positions() == [(1, 0.0)]
    assert Rollout([1, 2], [-1.0, -1.0], 1.0).num_turns == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"loss_mask": [1, 1, 0]}, "loss mask"),
        ({"loss_mask": [1, 1, 0, 0, 2, 1, 1]}, "loss mask"),
        ({"turns": [Turn(1, "model")]}, "begin at 0"),
        ({"turns": [Turn(0, "model"), Turn(0, "environment")]}, "begin at 0"),
        ({"turns": [Turn(0, "model"), Turn(7, "environment")]}, "past the completion"),
        ({"loss_mask": [0, 0, 0, 0, 0, 1, 1]}, "before any policy token"),
    ],
)
def test_malformed_multiturn_samples_are_refused(changes: dict[str, Any], message: str) -> None:
    rollout = two_turn()
    for name, value in changes.items():
        setattr(rollout, name, value)
    with pytest.raises(ValueError, match=message):
        GroupSamples(PROMPT, [rollout], "g")


def test_environment_tokens_are_in_the_input_but_off_every_mask() -> None:
    groups = [GroupSamples(PROMPT, [two_turn(), tool_turn()], "g")]
    mb = build_micro_batches(groups, micro_batch_size=2, pad_id=0)[0]
    assert mb.input_ids[0].tolist() == PROMPT + two_turn().token_ids
    # target position t holds token t+1: completion column j sits at P - 1 + j = 2 + j
    assert mb.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1, 0]
    assert mb.loss_mask[1].tolist() == [0, 0, 1, 1, 0, 0, 1, 0, 0, 0]
    assert mb.rollout_logprobs[0].tolist() == [0, 0, -1.0, -2.0, 0, 0, 0, -0.5, -0.25, 0]
    assert mb.num_tokens == 7
    assert mb.completion_lengths().tolist() == [7, 5]

    sb = StepBatch.from_groups(groups)
    assert sb.completion_mask.tolist() == [[1, 1, 0, 0, 0, 1, 1], [1, 1, 0, 0, 1, 0, 0]]
    assert sb.lengths.tolist() == [7, 5]
    assert sb.last_token.tolist() == [6, 4]
    assert sb.token_rewards(sb.rewards).tolist() == [
        [0, 0.5, 0, 0, 0, 0, 1.0],
        [0, 0.0, 0, 0, 0.25, 0, 0],
    ]
    # a per-token value read back from the target layout keeps the environment columns at 0
    values = mb.from_completion_layout(torch.arange(1.0, 15.0).view(2, 7), sb.completion_mask)
    back = mb.to_completion_layout(values * mb.loss_mask, 7)
    assert back.tolist() == [[1, 2, 0, 0, 0, 6, 7], [8, 9, 0, 0, 12, 0, 0]]


def test_a_final_reward_after_a_trailing_observation_goes_to_the_last_policy_token() -> None:
    rollout = Rollout([40, 41, 60], [-1.0, -1.0, 0.0], 2.0, loss_mask=[1, 1, 0])
    sb = StepBatch.from_groups([GroupSamples(PROMPT, [rollout])])
    assert sb.outcome_token_rewards(sb.rewards).tolist() == [[0, 2.0, 0]]


# -- losses on masked trajectories equal the losses on the model tokens only -----------------------------


def _loss_inputs(seed: int) -> dict[str, Tensor]:
    """(1, 7) log-probs of the two-turn trajectory, with garbage on the environment columns that would
    change every result if it were read (an advantage of 50, an engine log-prob of +40)."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(1, 7, generator=gen) * 2
    env = torch.tensor([[False, False, True, True, True, False, False]])
    return {
        "logp": logp,
        "old_logp": logp + 0.3 * torch.randn(1, 7, generator=gen),
        "rollout_logp": torch.where(env, 40.0, logp + 0.2 * torch.randn(1, 7, generator=gen)),
        "advantages": torch.where(env, 50.0, torch.tensor([[0.7, 0.7, 0, 0, 0, -1.2, -1.2]])),
        "mask": (~env).float(),
    }


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize(
    "loss_config",
    [
        {},
        {"rollout_correction": "truncate"},
        {"rollout_correction": "mask_token", "mask_low": 0.8},
        {"rollout_correction": "mask_sequence"},
        {"gspo": True, "dual_clip": 3.0},
    ],
)
def test_policy_loss_and_its_gradient_are_those_of_the_model_tokens_only(
    aggregation: str, loss_config: dict[str, Any]
) -> None:
    inputs = _loss_inputs(0)
    tis_cap = 1.5 if "rollout_correction" in loss_config else None
    config = PolicyLossConfig(aggregation=aggregation, max_tokens=8, tis_cap=tis_cap, **loss_config)
    results = []
    for pick in (lambda x: x, compact):
        logp = pick(inputs["logp"]).clone().requires_grad_(True)
        args = (pick(inputs["old_logp"]), pick(inputs["advantages"]), pick(inputs["mask"]))
        loss, stats = policy_loss(logp, *args, config, pick(inputs["rollout_logp"]))
        loss.backward()
        assert logp.grad is not None
        results.append((loss.detach(), stats, logp.grad))
    (full_loss, full_stats, full_grad), (loss, stats, grad) = results
    torch.testing.assert_close(full_loss, loss)
    for name, value in stats.items():
        torch.testing.assert_close(full_stats[name], value, msg=name)
    torch.testing.assert_close(compact(full_grad), grad)
    assert full_grad[0, 2:5].tolist() == [0.0, 0.0, 0.0]


def test_tis_weights_and_the_mismatch_ignore_environment_tokens() -> None:
    """By hand: model-token log-ratios old - rollout are (0, 0, log 3, -log 2) → weights 1, 1, 2 (capped),
    0.5; the environment columns' +40 engine log-probs would cap at 2 and dominate the mean."""
    old = torch.tensor([[-1.0, -2.0, -5.0, -5.0, -5.0, -0.5, -1.0]])
    rollout = old - torch.tensor([[0.0, 0.0, -40.0, -40.0, -40.0, math.log(3), -math.log(2)]])
    mask = torch.tensor([[1.0, 1, 0, 0, 0, 1, 1]])
    advantages = torch.ones_like(old)
    config = PolicyLossConfig(tis_cap=2.0)
    _, stats = policy_loss(old.clone(), old, advantages, mask, config, rollout)
    assert stats["tis_weight_mean"].item() == pytest.approx((1 + 1 + 2 + 0.5) / 4)
    assert stats["tis_capped_fraction"].item() == pytest.approx(1 / 4)
    mismatch = rollout_mismatch(old, rollout, mask)
    log_w = [0.0, 0.0, math.log(3), -math.log(2)]
    assert mismatch["rollout_logprob_abs_diff"].item() == pytest.approx(sum(map(abs, log_w)) / 4)
    k3 = sum(math.exp(w) - 1 - w for w in log_w) / 4
    assert mismatch["rollout_mismatch_kl"].item() == pytest.approx(k3)


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_kl_and_entropy_average_over_model_tokens_only(aggregation: str) -> None:
    inputs = _loss_inputs(1)
    ref = inputs["logp"] - torch.tensor([[0.1, -0.2, 9.0, 9.0, 9.0, 0.3, 0.05]])
    entropy = torch.tensor([[1.0, 2.0, 100.0, 100.0, 100.0, 3.0, 4.0]])
    mask = inputs["mask"]
    for estimator in KL_ESTIMATORS.values():
        full = aggregate(estimator(inputs["logp"], ref), mask, aggregation, max_tokens=8)
        alone = aggregate(estimator(compact(inputs["logp"]), compact(ref)), compact(mask), aggregation, 8)
        torch.testing.assert_close(full, alone)
    bonus = entropy_bonus(entropy, mask, 0.1, aggregation, max_tokens=8)
    torch.testing.assert_close(bonus, entropy_bonus(compact(entropy), compact(mask), 0.1, aggregation, 8))
    if aggregation == "token_mean":
        assert bonus.item() == pytest.approx(-0.1 * (1 + 2 + 3 + 4) / 4)
    # KL in the reward: only model tokens are charged
    penalised = apply_kl_penalty(torch.zeros(1, 7), torch.ones(1, 7), mask, coef=0.5)
    assert penalised.tolist() == [[-0.5, -0.5, 0, 0, 0, -0.5, -0.5]]


# -- per-turn rewards ----------------------------------------------------------------------------------


def test_gae_with_turn_rewards_matches_a_hand_computation() -> None:
    sb = StepBatch.from_groups([GroupSamples(PROMPT, [two_turn()])])
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 9.0, 0.3, 0.4]])  # the critic's values on env tokens: unused
    gamma, lam = 0.9, 0.8
    advantages, returns = gae(sb.token_rewards(sb.rewards), values, sb.completion_mask, gamma, lam)
    # backwards over the model tokens 6, 5, 1, 0; "next" skips the environment tokens 2..4
    a6 = 1.0 - 0.4
    a5 = (gamma * 0.4 - 0.3) + gamma * lam * a6
    a1 = (0.5 + gamma * 0.3 - 0.2) + gamma * lam * a5
    a0 = (gamma * 0.2 - 0.1) + gamma * lam * a1
    expected = [a0, a1, 0, 0, 0, a5, a6]
    assert advantages[0].tolist() == pytest.approx(expected, abs=1e-6)
    v = [0.1, 0.2, 0, 0, 0, 0.3, 0.4]
    assert returns[0].tolist() == pytest.approx([a + b for a, b in zip(expected, v, strict=True)], abs=1e-6)


def test_reinforce_pp_gives_each_turn_the_rewards_from_it_on() -> None:
    """Returns-to-go with gamma 0.9 over the model tokens: the first turn also gets its own 0.5."""
    sb = StepBatch.from_groups([GroupSamples(PROMPT, [two_turn(), tool_turn()])])
    _, returns = ADVANTAGE_ESTIMATORS["reinforce_pp"](
        sb.token_rewards(sb.rewards), sb.completion_mask, group_size=2, gamma=0.9
    )
    g1 = 0.5 + 0.9**2 * 1.0
    assert returns[0].tolist() == pytest.approx([0.9 * g1, g1, 0, 0, 0, 0.9, 1.0], abs=1e-6)
    assert returns[1].tolist() == pytest.approx([0.9 * 0.9 * 0.25, 0.9 * 0.25, 0, 0, 0.25, 0, 0], abs=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_score_the_trajectory_reward(name: str) -> None:
    """Trajectory reward = final + turn rewards: 1.0 + 0.5 = 1.5 and 0.25 + 0.0 = 0.25."""
    sb = StepBatch.from_groups([GroupSamples(PROMPT, [two_turn(), tool_turn()])])
    advantages, _ = ADVANTAGE_ESTIMATORS[name](sb.token_rewards(sb.rewards), sb.completion_mask, group_size=2)
    centred = 1.5 - 0.875
    expected = {"grpo": centred / (1.25 / math.sqrt(2) + 1e-6), "dr_grpo": centred, "rloo": 2 * centred}[name]
    assert advantages[0].tolist() == pytest.approx([expected] * 2 + [0] * 3 + [expected] * 2, abs=1e-6)
    assert advantages[1].tolist() == pytest.approx([-expected] * 2 + [0] * 2 + [-expected, 0, 0], abs=1e-6)


# -- the wire ------------------------------------------------------------------------------------------


def _scored_group(samples: list[queue_pb2.ScoredSample]) -> queue_pb2.ScoredGroup:
    return queue_pb2.ScoredGroup(group_id="g", prompt_token_ids=PROMPT, samples=samples)


def _sample(index: int, rollout: Rollout) -> queue_pb2.ScoredSample:
    return queue_pb2.ScoredSample(
        sample_index=index,
        token_ids=rollout.token_ids,
        logprobs=rollout.logprobs,
        finish_reason=common_pb2.FINISH_REASON_STOP,
        reward=common_pb2.Reward(value=rollout.reward, status=common_pb2.REWARD_STATUS_OK),
    )


def test_the_multiturn_fields_round_trip_through_the_wire() -> None:
    rollouts = [two_turn(), tool_turn(), two_turn(turn_reward=None)]
    samples = [wire.with_turns(_sample(i, r), r.loss_mask, r.turns) for i, r in enumerate(rollouts)]
    data = _scored_group(samples).SerializeToString(deterministic=True)
    back = wire.group_samples_from_proto(wire.decode_group(data))
    assert back.rollouts == rollouts
    # unset stays unset, 0 stays 0
    assert [t.reward for t in back.rollouts[1].turns] == [None, 0.0, None]
    assert not wire.decode_group(data).samples[2].turns[0].HasField("reward")
    assert wire.decode_group(data).samples[0].loss_mask == bytes([1, 1, 0, 0, 0, 1, 1])


def test_turn_role_map_and_its_inverse_are_total() -> None:
    values = {v for k, v in common_pb2.TurnRole.items() if not k.endswith("_UNSPECIFIED")}
    assert set(wire.TURN_ROLE.values()) == values == set(wire.TURN_ROLE_NAMES)
    for name, value in wire.TURN_ROLE.items():
        assert wire.turn_role_from_proto(value) == name


def test_a_group_without_the_new_fields_reads_as_single_turn() -> None:
    rollout = Rollout([40, 41, 42], [-1.0, -2.0, -3.0], 1.0)
    back = wire.group_samples_from_proto(_scored_group([_sample(0, rollout)])).rollouts[0]
    assert back == rollout
    assert back.loss_mask is None and back.turns == []
    assert back.model_mask() == [1, 1, 1]


# -- the trainer -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> World:
    return init_distributed(CPU)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlfabric.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("reference"), seed=1)


def make_spec(model_dir: Path, **overrides: Any) -> RunSpec:
    raw: dict[str, Any] = {
        "model": {"path": str(model_dir)},
        "dataset": {"path": "unused.jsonl"},
        "rollout": {"sampling": {"n": 2, "max_tokens": 16}},
        "train": {"micro_batch_size": 1},
    }
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return RunSpec.model_validate(raw)


def _grads(trainer: Trainer) -> dict[str, Tensor]:
    return {name: p.grad.full_tensor().clone() for name, p in trainer.model.named_parameters()}


def _own_model_logprobs(model_dir: Path, rollout: Rollout) -> Rollout:
    """`rollout` with the model's own log-probs on its policy tokens (a TIS weight of 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([PROMPT + rollout.token_ids])).logits[0], -1)
    own = [float(logp[len(PROMPT) - 1 + j, tok]) for j, tok in enumerate(rollout.token_ids)]
    logprobs = [lp if m else 0.0 for lp, m in zip(own, rollout.model_mask(), strict=True)]
    return Rollout(
        rollout.token_ids, logprobs, rollout.reward, loss_mask=rollout.loss_mask, turns=rollout.turns
    )


def _hand_loss(model_dir: Path, reference_dir: Path, rollouts: list[Rollout], advantages: list[float]) -> Any:
    """The step's loss written out on the model tokens only (token_mean; ratio 1, TIS weight 1): returns
    the plain model, with its gradient, and the (kl, entropy) means."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(reference_dir), dtype=torch.float32)
    terms, kls, entropies = [], [], []
    for rollout, advantage in zip(rollouts, advantages, strict=True):
        ids = torch.tensor([PROMPT + rollout.token_ids])
        logits = model(input_ids=ids).logits[0].float()
        with torch.no_grad():
            ref_logp = torch.log_softmax(reference(input_ids=ids).logits[0], -1)
        logp = torch.log_softmax(logits, -1)
        entropy = entropy_from_logits(logits)
        for j, tok in enumerate(rollout.token_ids):
            if not rollout.model_mask()[j]:
                continue
            t = len(PROMPT) - 1 + j
            kl = KL_ESTIMATORS["k3"](logp[t, tok], ref_logp[t, tok])
            terms.append(
                -advantage * torch.exp(logp[t, tok] - logp[t, tok].detach()) + 0.1 * kl - 0.01 * entropy[t]
            )
            kls.append(float(kl.detach()))
            entropies.append(float(entropy[t].detach()))
    torch.stack(terms).mean().backward()
    return model, sum(kls) / len(kls), sum(entropies) / len(entropies)


def test_the_trainer_gradient_is_the_loss_on_the_model_tokens_only(
    tiny_model_dir: Path, reference_dir: Path, world: World
) -> None:
    rollouts = [_own_model_logprobs(tiny_model_dir, r) for r in (two_turn(), tool_turn())]
    algorithm = {"entropy_coef": 0.01, "kl": {"coef": 0.1, "mode": "loss"}}
    model = {"path": str(tiny_model_dir), "reference_path": str(reference_dir)}
    trainer = Trainer(make_spec(tiny_model_dir, model=model, algorithm=algorithm), tiny_model_dir, device=CPU,
                      world=world)  # fmt: skip
    metrics = trainer.accumulate_gradients([GroupSamples(PROMPT, rollouts, "g")])
    advantage = 0.625 / (1.25 / math.sqrt(2) + 1e-6)  # GRPO over the trajectory rewards 1.5 and 0.25
    hand, kl, entropy = _hand_loss(tiny_model_dir, reference_dir, rollouts, [advantage, -advantage])
    assert metrics["tokens"] == 7
    assert metrics["kl"] == pytest.approx(kl, abs=1e-5)
    assert metrics["entropy"] == pytest.approx(entropy, abs=1e-5)
    assert metrics["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    got = _grads(trainer)
    for name, param in hand.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(got[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("advantage", ["grpo", "reinforce_pp"])
def test_a_single_turn_group_trains_exactly_as_before(
    tiny_model_dir: Path, world: World, advantage: str
) -> None:
    """A sample without the multi-turn fields and the same sample declared as one model turn with an
    all-ones mask give bit-identical gradients and metrics."""
    plain = [Rollout([40, 41, 42, 43], [-1.0, -2.0, -1.5, -0.5], 1.0), Rollout([44, 45], [-1.0, -0.5], 0.0)]
    declared = [
        Rollout(r.token_ids, r.logprobs, r.reward, loss_mask=[1] * len(r.token_ids), turns=[Turn(0, "model")])
        for r in plain
    ]
    runs = []
    for rollouts in (plain, declared):
        spec = make_spec(tiny_model_dir, algorithm={"advantage": advantage, "entropy_coef": 0.01})
        trainer = Trainer(spec, tiny_model_dir, device=CPU, world=world)
        runs.append((trainer.accumulate_gradients([GroupSamples(PROMPT, rollouts, "g")]), _grads(trainer)))
    (metrics, grads), (metrics2, grads2) = runs
    assert metrics == metrics2
    for name, grad in grads.items():
        assert torch.equal(grad, grads2[name]), name
