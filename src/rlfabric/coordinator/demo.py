"""The built-in demo run of `rlfabric up`: a tiny model made locally and a task it visibly learns.

The task is verifiable and deliberately small enough for two CPU cores: every prompt asks, in different
words, for a reply made of the letter x; the reward is the fraction of the reply's characters that are
"x" (0 for an empty reply). A randomly initialised 0.4 M-parameter model starts near 0.01 (one character
in ~100) and climbs within a few minutes; held-out prompts use wordings never trained on, so their reward
rising shows the policy learned the behaviour and not the prompts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlfabric.runspec import RunSpec

TARGET = "x"
WORDINGS = [
    "Reply with the letter x.",
    "Say x.",
    "Write x several times.",
    "Answer using only x.",
    "Type x.",
    "Only x, please.",
    "Give me some x.",
    "Print x.",
    "Output x repeatedly.",
    "Respond with x.",
    "x please.",
    "Fill the line with x.",
]
SUFFIXES = ["", " Go.", " Now.", " Thanks.", " Quickly.", " Again."]


def letter_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """TRL-style reward function: the fraction of non-space characters that are the target letter."""
    rewards = []
    for completion in completions:
        chars = [c for c in completion if not c.isspace()]
        rewards.append(sum(c == TARGET for c in chars) / len(chars) if chars else 0.0)
    return rewards


def write_dataset(path: Path) -> None:
    rows = [
        {"id": f"w{i}s{j}", "prompt": wording + suffix}
        for i, wording in enumerate(WORDINGS)
        for j, suffix in enumerate(SUFFIXES)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def demo_spec(run_dir: Path, *, steps: int) -> RunSpec:
    """Builds the tiny model and the dataset under `run_dir` and returns the run spec."""
    from rlfabric.tools.tiny_model import make_tiny_model

    model = make_tiny_model(run_dir / "model", seed=0)
    data = run_dir / "demo-prompts.jsonl"
    write_dataset(data)
    return RunSpec.model_validate(
        {
            "name": "demo",
            "output_dir": str(run_dir),
            "model": {"path": str(model), "max_model_len": 256},
            "dataset": {
                "path": str(data),
                "reference_field": None,
                "held_out_fraction": 0.2,
                "eval_every_steps": 5,
                "epochs": 1000,
            },
            "rollout": {"sampling": {"n": 8, "max_tokens": 12, "temperature": 1.0}, "max_staleness": 1},
            "reward": {"scorer": "python_function", "params": {"function": f"{__name__}:letter_reward"}},
            "algorithm": {"kl": {"coef": 0.001, "estimator": "k3"}},
            "optim": {"lr": 0.003},
            "train": {"steps": steps, "groups_per_step": 8, "micro_batch_size": 32, "checkpoint_every": 10},
        }
    )
