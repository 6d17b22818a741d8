"""The built-in demo run of `rlfabric up`: a tiny model made locally and a task it visibly learns.

The task is verifiable and deliberately small enough for two CPU cores: every prompt asks, in different
words, for a reply made of the letter x; the reward is the fraction of the reply's characters that are
"x" (0 for an empty reply). A randomly initialised 0.4 M-parameter model starts near 0.01 (one character
in ~100) and climbs within a few minutes; held-out prompts use wordings never trained on, so their reward
rising shows the policy learned the behaviour and not the prompts. Solved, the policy writes x up to
`max_tokens` every time (nothing rewards stopping earlier), so the run ends with the entropy-collapse and
length-limit health warnings: expected here, and a live example of both.
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


LORA_LR = 0.01
"""The demo's learning rate when it trains LoRA adapters: low-rank updates need a larger step than the
full weights' 0.003 to learn the task in the same number of steps. At 0.02 one run in ten (five two-run
fleets of 16 steps) hit a gradient spike (norm 69) and its rewards fell back near the start for a few
steps; at 0.01 eight of eight learned as fast, with none."""


def demo_spec(
    run_dir: Path, *, steps: int, lora_rank: int | None = None, name: str = "demo", seed: int = 0
) -> RunSpec:
    """Builds the tiny model and the dataset under `run_dir` and returns the run spec named `name`, its
    prompts shuffled with `seed`; with `lora_rank` it trains LoRA adapters of that rank (alpha 2 x rank)
    at `LORA_LR`. Every call builds the same model (several demo runs share one base model)."""
    from rlfabric.tools.tiny_model import make_tiny_model

    model = make_tiny_model(run_dir / "model", seed=0)
    data = run_dir / "demo-prompts.jsonl"
    write_dataset(data)
    lora = None if lora_rank is None else {"rank": lora_rank, "alpha": 2 * lora_rank}
    return RunSpec.model_validate(
        {
            "name": name,
            "output_dir": str(run_dir),
            "model": {"path": str(model), "max_model_len": 256, "lora": lora},
            "dataset": {
                "path": str(data),
                "reference_field": None,
                "held_out_fraction": 0.2,
                "eval_every_steps": 5,
                "epochs": 1000,
                "shuffle_seed": seed,
            },
            "rollout": {"sampling": {"n": 8, "max_tokens": 12, "temperature": 1.0}, "max_staleness": 1},
            "reward": {"scorer": "python_function", "params": {"function": f"{__name__}:letter_reward"}},
            "algorithm": {"kl": {"coef": 0.001, "estimator": "k3"}},
            "optim": {"lr": 0.003 if lora is None else LORA_LR},
            "train": {"steps": steps, "groups_per_step": 8, "micro_batch_size": 32, "checkpoint_every": 10},
        }
    )
