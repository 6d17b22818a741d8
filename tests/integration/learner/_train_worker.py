"""Training worker for test_fsdp_torchrun.py: run under `torchrun --nproc_per_node N` (N = 1 or 2).

Trains a tiny model for 2 steps, checkpoints, trains 2 more (run A); then a fresh trainer resumes from the
checkpoint and trains the same 2 steps (run B). Rank 0 writes the full state dicts of A and B
(`a.pt`, `b.pt`), and both runs' metrics (`metrics.json`) into the output folder.

Each step has 3 groups, so with 2 ranks the shards are uneven (2 groups vs 1): the rank with fewer
micro-batches pads with empty ones.

With ADVANTAGE "gae" the run is PPO with a critic (KL in the reward), whose model and optimizer the
checkpoint must carry too; rank 0 then also writes the critics' full state dicts (`critic_a.pt`,
`critic_b.pt`).

Usage: _train_worker.py MODEL_DIR OUT_DIR [ADVANTAGE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rlfabric.learner.batch import GroupSamples, Rollout
from rlfabric.learner.dist import destroy_distributed, exit_rank, init_distributed, leave_together
from rlfabric.learner.trainer import Trainer
from rlfabric.runspec import RunSpec

CPU = torch.device("cpu")


def make_spec(model_dir: str, advantage: str = "grpo") -> RunSpec:
    """GRPO with a KL term in the loss and an entropy bonus, small micro-batches; or PPO (gae) with the KL
    in the reward; or ("lora") GRPO training LoRA adapters, the reference being the adapters disabled."""
    kl = {"coef": 0.05, "mode": "reward" if advantage == "gae" else "loss"}
    lora = {"rank": 4, "alpha": 8} if advantage == "lora" else None
    advantage = "grpo" if advantage == "lora" else advantage
    return RunSpec.model_validate(
        {
            "model": {"path": model_dir, "lora": lora},
            "dataset": {"path": "unused.jsonl"},
            "rollout": {"sampling": {"n": 4, "max_tokens": 16}},
            "algorithm": {"advantage": advantage, "kl": kl, "entropy_coef": 0.01},
            "optim": {"lr": 2e-3, "warmup_steps": 1},
            "train": {"micro_batch_size": 3, "steps": 4},
        }
    )


def make_groups(seed: int, n_groups: int = 3, n: int = 4) -> list[GroupSamples]:
    """Deterministic groups with varied lengths, rewards and rollout log-probs."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int, size: int = 1) -> list[int]:
        return torch.randint(low, high, (size,), generator=gen).tolist()

    groups = []
    for g in range(n_groups):
        rollouts = []
        for _ in range(n):
            length = randint(1, 9)[0]
            logprobs = (-torch.rand(length, generator=gen) * 3).tolist()
            rollouts.append(Rollout(randint(6, 100, length), logprobs, float(randint(0, 2)[0])))
        groups.append(GroupSamples(randint(6, 100, randint(2, 7)[0]), rollouts, group_id=f"{seed}-{g}"))
    return groups


def critic_state_dict(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The critic's unsharded weights on CPU, on rank 0 (empty elsewhere); none without a critic."""
    if trainer.critic is None:
        return {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(trainer.critic.model, options=options)


def main(model_dir: str, out_dir: str, advantage: str = "grpo") -> None:
    out = Path(out_dir)
    world = init_distributed(CPU)
    spec = make_spec(model_dir, advantage)
    batches = [make_groups(seed) for seed in range(4)]

    a = Trainer(spec, model_dir, device=CPU, world=world)
    metrics_a = [a.train_step(groups) for groups in batches[:2]]
    checkpoint = a.save_checkpoint(out / "checkpoints", extra={"applied": "0-0,0-1"})
    metrics_a += [a.train_step(groups) for groups in batches[2:]]
    state_a, critic_a = a.full_state_dict(), critic_state_dict(a)

    b = Trainer(spec, model_dir, device=CPU, world=world)
    extra = b.load_checkpoint(checkpoint)
    metrics_b = [b.train_step(groups) for groups in batches[2:]]
    state_b, critic_b = b.full_state_dict(), critic_state_dict(b)

    if world.is_main:
        torch.save(state_a, out / "a.pt")
        torch.save(state_b, out / "b.pt")
        if critic_a:
            torch.save(critic_a, out / "critic_a.pt")
            torch.save(critic_b, out / "critic_b.pt")
        report = {"world_size": world.size, "a": metrics_a, "b": metrics_b, "extra": extra}
        (out / "metrics.json").write_text(json.dumps(report))
    leave_together()  # rank 0 writes the files after the last collective: the others wait for it
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    exit_rank(0)  # as the learner's ranks end (no interpreter teardown)
