"""One TRL `GRPOTrainer(environment_factory=SecretWords)` run for `bench/multiturn_e2e.py`, in its own
process (as `rlfabric up` runs its own).

    python bench/_multiturn_trl_worker.py CONFIG.json OUT.json

CONFIG: the model folder, the tasks file (JSONL: prompt, answer), steps, group size, prompts per
step, the completion budget of a whole trajectory (`max_total_tokens`: TRL's `max_completion_length`),
model turns (TRL's `max_tool_calling_iterations` = turns - 1), lr, KL coefficient, micro-batch size,
compute dtype, seed, torch threads. OUT receives one row per optimizer step, as `_e2e_trl_worker.py`
writes them (its timers wrap TRL's own `_generate`, which holds the whole tool loop, and
`training_step`), plus TRL's tool-call frequency.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _e2e_trl_worker import instrument
from _multiturn_env import SecretWords, words_reward


def build_trainer(cfg: dict[str, Any], out_dir: Path) -> Any:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    torch.set_num_threads(cfg["threads"])
    rows = [json.loads(line) for line in Path(cfg["tasks"]).read_text().splitlines()]
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
        max_completion_length=cfg["max_total_tokens"],
        max_tool_calling_iterations=cfg["turns"] - 1,
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
    dataset = Dataset.from_list([{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    return GRPOTrainer(
        model=model,
        reward_funcs=words_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=SecretWords,
    )


def record_tool_calls(trainer: Any, rows: list[dict[str, Any]]) -> None:
    """Adds TRL's tool-call frequency (calls per sample) of each step to its row."""
    from transformers import TrainerCallback

    class ToolCalls(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if rows and logs and "tools/call_frequency" in logs:
                rows[-1]["tool_calls"] = float(logs["tools/call_frequency"])

    trainer.add_callback(ToolCalls())


def main(config_path: str, out_path: str) -> int:
    started = time.perf_counter()
    cfg = json.loads(Path(config_path).read_text())
    out = Path(out_path)
    trainer = build_trainer(cfg, out.parent / "trl-output")
    ready_s = time.perf_counter() - started
    rows: list[dict[str, Any]] = []
    instrument(trainer, rows)
    record_tool_calls(trainer, rows)
    trainer.train()
    out.write_text(json.dumps({"ready_s": ready_s, "wall_s": time.perf_counter() - started, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
