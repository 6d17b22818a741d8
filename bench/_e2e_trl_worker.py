"""One TRL `GRPOTrainer` run for `bench/e2e_trl.py`, in its own process (as `rlfabric up` runs its own).

    python bench/_e2e_trl_worker.py CONFIG.json OUT.json

CONFIG holds the shared task (model folder, prompts file, steps, group size, prompts per step, max
completion tokens, lr, KL coefficient, micro-batch size, compute dtype, seed, torch threads). OUT receives
one row per optimizer step (wall time at its end, mean reward, mean completion length) and where
the time went:

- `generate_s`: `GRPOTrainer._generate` (transformers `generate` of the step's completions);
- `prepare_s`: the rest of `_generate_and_score_completions` (the reward function, the reference
  model's log-probabilities for the KL term, advantages);
- `train_s`: `training_step` minus the two above (forward, backward, optimizer), summed over the
  step's gradient-accumulation micro-batches.

The timers wrap the trainer's own methods, so nothing about its schedule changes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Timers:
    """Seconds spent inside wrapped methods, per name, accumulated until `take`."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        taken, self.total = self.total, {}
        return taken


def build_trainer(cfg: dict[str, Any], out_dir: Path) -> Any:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlfabric.coordinator.demo import letter_reward

    torch.set_num_threads(cfg["threads"])
    prompts = [json.loads(line)["prompt"] for line in Path(cfg["prompts"]).read_text().splitlines()]
    micro = cfg["micro_batch_size"]
    samples = cfg["prompts_per_step"] * cfg["group_size"]
    args = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=not torch.cuda.is_available(),
        seed=cfg["seed"],
        max_steps=cfg["steps"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro,  # one optimizer step per generation batch
        num_generations=cfg["group_size"],
        max_completion_length=cfg["max_tokens"],
        temperature=1.0,
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant",
        beta=cfg["kl_coef"],
        loss_type="dapo",  # token mean over the batch: rlfabric's `token_mean`
        scale_rewards="group",  # (r - mean) / std per group: rlfabric's `grpo` advantage
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=cfg.get("dtype") == "bfloat16",
    )
    dtype = torch.bfloat16 if cfg.get("dtype") == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    tokenizer.padding_side = "left"
    return GRPOTrainer(
        model=model,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=tokenizer,
    )


def instrument(trainer: Any, rows: list[dict[str, Any]]) -> None:
    """Wraps the trainer's generation and training methods with timers and records a row per step
    (printed as it ends: the log shows the progress of a slow run)."""
    from transformers import TrainerCallback

    timers = Timers()
    trainer._generate = timers.wrap("generate", trainer._generate)
    trainer._generate_and_score_completions = timers.wrap(
        "generate_and_score", trainer._generate_and_score_completions
    )
    trainer.training_step = timers.wrap("training_step", trainer.training_step)

    class StepRows(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            t = timers.take()
            gen, score = t.get("generate", 0.0), t.get("generate_and_score", 0.0)
            rows.append(
                {
                    "step": state.global_step,
                    "time": time.time(),  # epoch, as rlfabric's rows
                    "generate_s": gen,
                    "prepare_s": score - gen,
                    "train_s": t.get("training_step", 0.0) - score,
                }
            )

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if rows and logs and "reward" in logs:
                rows[-1]["reward"] = float(logs["reward"])
                rows[-1]["reward_std"] = float(logs.get("reward_std", float("nan")))
                rows[-1]["completion_length"] = float(logs.get("completions/mean_length", float("nan")))
                print(f"e2e step {json.dumps(rows[-1])}", flush=True)

    trainer.add_callback(StepRows())


def main(config_path: str, out_path: str) -> int:
    started = time.perf_counter()
    cfg = json.loads(Path(config_path).read_text())
    out = Path(out_path)
    trainer = build_trainer(cfg, out.parent / "trl-output")
    ready_s = time.perf_counter() - started
    rows: list[dict[str, Any]] = []
    instrument(trainer, rows)
    trainer.train()
    out.write_text(json.dumps({"ready_s": ready_s, "wall_s": time.perf_counter() - started, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
