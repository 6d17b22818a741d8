"""The reward-model run (`run.mode = "reward_model"`): the offline run's loop (`offline.OfflineRun`) over
preference pairs, a Bradley-Terry reward model (`reward_model.RewardModelTrainer`), and the final model
the reward service serves.

    load      every rank reads and tokenises the dataset itself (`reward_model_data.load_reward_data`:
              deterministic, nothing to broadcast) and lays out the training order: `dataset.epochs`
              passes, pass e shuffled with `dataset.shuffle_seed + e` (file order when the seed is None)
    resume    as the offline preference run: the newest complete checkpoint, its data cursor and the
              consumed pair ids (a changed dataset or order is refused)
    repeat until `train.steps` steps are done or the order is exhausted (the LR schedule spans exactly
    those steps):
      1. draw     the next `train.groups_per_step` pairs
      2. train    `RewardModelTrainer.train_step`: the mean Bradley-Terry loss of the step's pairs
      3. evaluate every `dataset.eval_every_steps` steps and at the last one, when there are held-out
                  pairs: `eval_accuracy` (held-out pairs ranked right), `eval_loss`, `eval_reward_margin`,
                  `eval_rewards_chosen`, `eval_rewards_rejected`, `eval_pairs`, `eval_tokens`
      4. persist  every `train.checkpoint_every` steps and at the end, as the offline preference run
      5. report   a metrics.jsonl row with `loss`, `accuracy`, `reward_margin`, `rewards_chosen`,
                  `rewards_rejected`, `pairs`, `tokens`, `lr`, `grad_norm`, `step_seconds`, the
                  evaluation's values, `rm_dropped` (pairs left out as too long), `pairs_consumed` and
                  `pair_ids`
    finish    the final model, `<run dir>/model` (`export_reward_model`), unless a committed one is there

No weights version is published: a reward model is no policy (no replica loads it) and its result is the
final model. The final model is a Hugging Face sequence-classification folder that
`AutoModelForSequenceClassification.from_pretrained` loads, and so the reward service's `reward_model`
scorer with `path` set to it:

    <run dir>/model/config.json                      the base model's, as a classifier: `architectures`
                                                     its *ForSequenceClassification class, `num_labels` 1,
                                                     `pad_token_id` the id that pads rows in training
                    tokenizer files                  the base model's tokenizer, its pad token set
                    model-0000i-of-0000n.safetensors the trained weights (float32, as trained)
                    model.safetensors.index.json     which file holds each tensor
                    COMMITTED                        written last (`export.commit`)
"""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.dist import World, init_distributed
from rlfabric.learner.export import MODEL_DIR, commit, final_model_dir, is_committed, write_weights
from rlfabric.learner.offline import OfflineRun, run_until_stopped, training_order
from rlfabric.learner.reward_model import RewardModelTrainer
from rlfabric.learner.reward_model_data import RewardModelData, RewardPair, load_reward_data


class RewardModelRun(OfflineRun[RewardPair]):
    """One rank's reward-model run: the offline loop, plus held-out accuracy and the final model."""

    def __init__(
        self,
        config: LearnerServiceConfig,
        world: World,
        trainer: RewardModelTrainer,
        data: RewardModelData,
        last: int,
    ) -> None:
        super().__init__(config, world, trainer)
        self.rm, self.data, self.last = trainer, data, last

    def extra_metrics(self) -> dict[str, float]:
        """The pairs left out, and the held-out statistics when they are due (collective)."""
        metrics = {"rm_dropped": float(self.data.dropped)}
        every, step = self.spec.dataset.eval_every_steps, self.trainer.step
        if self.data.evaluation and (step >= self.last or (every and step % every == 0)):
            metrics.update(self.rm.evaluate(self.data.evaluation))
        return metrics

    def publish(self) -> float:
        """Nothing: a reward model publishes no weights version (module docstring)."""
        return 0.0

    def finish(self) -> None:
        """Rank 0 writes the final model from the gathered weights (collective), unless it is there."""
        final = final_model_dir(self.paths.run_dir)
        if self.trainer.step == 0 or is_committed(final):
            return
        state_dict = self.trainer.full_state_dict()
        if self.world.is_main:
            export_reward_model(
                state_dict, self.trainer.model.config, self.spec.model.path, self.paths.run_dir
            )
            print(f"rlfabric offline learner final model in {final}", flush=True)


def export_reward_model(
    state_dict: Mapping[str, torch.Tensor], config: Any, base_model: str, run_dir: str | Path
) -> Path:
    """Write the trained classifier (`state_dict`, its `config`) with `base_model`'s tokenizer as the
    run's final model (module docstring); returns its folder."""
    from transformers import AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    final = final_model_dir(run_dir)
    partial = final.with_name(f"{MODEL_DIR}.partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    write_weights(state_dict, partial)
    saved = copy.deepcopy(config)
    saved.architectures = [MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[saved.model_type]]
    saved.use_cache = True
    saved.save_pretrained(partial)
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(partial)
    commit(partial, final)
    return final


def steps_of(spec_steps: int, pairs: int, per_step: int) -> int:
    """The run's last step: `train.steps`, or fewer when the training order runs out first."""
    return min(spec_steps, math.ceil(pairs / per_step))


def run_reward_model(config: LearnerServiceConfig, device: torch.device | None = None) -> int:
    """The whole reward-model run on this rank (joins the process group if needed); returns the final
    step. `device` defaults to this rank's GPU when there is one, else the CPU."""
    spec = config.run
    if spec.mode != "reward_model":
        raise ValueError(f"run.mode is {spec.mode!r}, not 'reward_model'")
    world = init_distributed(device)
    data = load_reward_data(spec)
    order = training_order(data.train, spec.dataset.epochs, spec.dataset.shuffle_seed)
    last = steps_of(spec.train.steps, len(order), spec.train.groups_per_step)
    trainer = RewardModelTrainer(spec, spec.model.path, device=world.device, world=world, total_steps=last)
    return run_until_stopped(RewardModelRun(config, world, trainer, data, last), order)
