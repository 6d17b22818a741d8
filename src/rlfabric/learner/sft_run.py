"""The supervised fine-tuning run (`run.mode = "sft"`): the offline run's loop (`offline.OfflineRun`) over
SFT examples, and the final model.

    load      every rank reads and tokenises the dataset itself (`sft_data.load_sft_data`: deterministic,
              nothing to broadcast) and lays out the training order: `dataset.epochs` passes, pass e
              shuffled with `dataset.shuffle_seed + e` (file order when the seed is None)
    resume    as the offline preference run: the newest complete checkpoint, its data cursor and the
              consumed example ids (a changed dataset or order is refused)
    repeat until `train.steps` steps are done or the order is exhausted (steps or epochs, whichever ends
    first; the LR schedule spans exactly those steps):
      1. draw     the next `train.groups_per_step` examples (rows per step in this mode)
      2. train    `SFTTrainer.train_step`: the mean cross-entropy of the step's assistant tokens
      3. evaluate every `dataset.eval_every_steps` steps and at the last one, when there are held-out
                  examples: `eval_loss`, `eval_token_accuracy`, `eval_tokens`, `eval_sequences`
      4. persist, publish and report as the offline preference run: a metrics.jsonl row with `loss`,
                  `token_accuracy`, `tokens`, `sequences`, `lr`, `grad_norm`, `step_seconds`, the
                  evaluation's values, `sft_truncated` and `sft_dropped` (`sft_data`), `examples_consumed`
                  and `example_ids`
    finish    the final model as a Hugging Face folder, `<run dir>/model` (`export.export_final_model`),
              unless a committed one is there already
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.offline import OfflineRun, run_until_stopped, training_order
from rlfabric.learner.sft import SFTTrainer
from rlfabric.learner.sft_data import SFTData, SFTExample, load_sft_data


class SFTRun(OfflineRun[SFTExample]):
    """One rank's SFT run: the offline loop, plus held-out evaluation and the final model."""

    CONSUMED_KEY = "examples_consumed"
    IDS_KEY = "example_ids"

    def __init__(
        self, config: LearnerServiceConfig, world: World, trainer: SFTTrainer, data: SFTData, last: int
    ) -> None:
        super().__init__(config, world, trainer)
        self.sft, self.data, self.last = trainer, data, last

    def item_id(self, item: Any) -> str:
        return str(item.example_id)

    def extra_metrics(self) -> dict[str, float]:
        """The data's truncation counts, and the held-out loss when it is due (collective)."""
        metrics = {"sft_truncated": float(self.data.truncated), "sft_dropped": float(self.data.dropped)}
        every, step = self.spec.dataset.eval_every_steps, self.trainer.step
        if self.data.evaluation and (step >= self.last or (every and step % every == 0)):
            metrics.update(self.sft.evaluate(self.data.evaluation))
        return metrics


def steps_of(spec_steps: int, examples: int, per_step: int) -> int:
    """The run's last step: `train.steps`, or fewer when the training order runs out first."""
    return min(spec_steps, math.ceil(examples / per_step))


def run_sft(config: LearnerServiceConfig, device: torch.device | None = None) -> int:
    """The whole SFT run on this rank (joins the process group if needed); returns the final step.

    `device` defaults to this rank's GPU when there is one, else the CPU."""
    spec = config.run
    if spec.mode != "sft":
        raise ValueError(f"run.mode is {spec.mode!r}, not 'sft'")
    world = init_distributed(device)
    data = load_sft_data(spec)
    order = training_order(data.train, spec.dataset.epochs, spec.dataset.shuffle_seed)
    last = steps_of(spec.train.steps, len(order), spec.train.groups_per_step)
    trainer = SFTTrainer(spec, spec.model.path, device=world.device, world=world, total_steps=last)
    return run_until_stopped(SFTRun(config, world, trainer, data, last), order)
