"""The offline preference run (`run.mode = "offline_preference"`): DPO, IPO, SimPO, ORPO or KTO on a fixed
dataset of preference pairs (KTO: of rows labelled desirable or undesirable).

No rollout or reward service is involved; checkpoints and published weights are the online learner's, so
replicas and evaluation read the result the same way. Redis only with `report_to_redis` (a run submitted
to a coordinator, as `rlfabric up` does): rank 0 then also reports each step there (`RedisReports`), stops
when the coordinator asks, and says when the data ran out.

    load     every rank reads and tokenises the dataset itself (deterministic: nothing to broadcast),
             and lays out the training order: `dataset.epochs` passes, pass e shuffled with
             `dataset.shuffle_seed + e` (file order when the seed is None)
    resume   restore the newest complete checkpoint; its `extra` holds the data cursor (pairs consumed)
             and the consumed pair ids; the next version is above both the checkpoint's and the newest
             published one
    repeat until `train.steps` steps are done or the order is exhausted:
      1. draw     the next `train.groups_per_step` pairs of the order (pairs per step in this mode; KTO:
                  rows)
      2. train    PreferenceTrainer.train_step (KTO: KTOTrainer) on every rank (FSDP2)
      3. persist  every `train.checkpoint_every` steps and at the end: checkpoint with the cursor
      4. publish  gather the full weights, write version v to the object store (always the object store:
                  there are no replicas to broadcast to)
      5. report   a row in <output_dir>/<run_id>/metrics.jsonl with the step's pair ids, mirrored to the
                  experiment trackers (`tracking.py`; curves.png too after a checkpoint and at the end)

A crash after step s resumes from the last checkpoint c <= s and retrains steps c+1..s on the same pairs
from the same model: each pair is applied exactly once in the surviving lineage (metrics.jsonl keeps the
rows of the abandoned steps; the last row of each step is the one that counts).

Dataset rows are read by `rlfabric.data`, as the coordinator reads prompts: a JSONL, JSON, Parquet or CSV
file, a `save_to_disk` folder, a folder of data files or a hub id, with `dataset.split` (and `name`,
`revision`). `dataset.prompt_field` holds a string or a list of {role, content} messages;
`preference.chosen_field` and `preference.rejected_field` hold strings; KTO reads those pairs (each two
rows) or unpaired rows of `preference.completion_field` (a string) and `label_field` (a bool), as
`preference_data` says. With `dataset.chat_template` the prompt is rendered with the model's chat
template (a string becomes one user message) and each completion ends with the tokenizer's EOS token.
`dataset.held_out_fraction` and `eval_every_steps` are not used here.

`OfflineRun` is also the loop of supervised fine-tuning (`mode = "sft"`, `sft_run.SFTRun`): the same
draw, persist, publish and report, with examples for pairs, held-out evaluation and a final model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NoReturn

import torch

from rlfabric.contracts import keys
from rlfabric.contracts.metrics import append_row
from rlfabric.data import DatasetError, dataset_version, read_records, training_source
from rlfabric.learner.checkpoint import latest_complete, prune
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.dist import (
    World,
    all_reduce_max,
    destroy_distributed,
    exit_rank,
    init_distributed,
    leave_together,
)
from rlfabric.learner.export import drop_tied_head, export_final_model, final_model_dir, is_committed
from rlfabric.learner.kto import KTOExample, KTOTrainer
from rlfabric.learner.outputs import RunPaths, write_metrics
from rlfabric.learner.preference import PreferencePair, PreferenceTrainer
from rlfabric.learner.preference_data import PreferenceRowError, kto_label, kto_reads_pairs
from rlfabric.learner.tracking import Trackers
from rlfabric.learner.trainer_base import ItemT, TrainerBase
from rlfabric.runspec import RunSpec
from rlfabric.runtime.logs import setup_logging
from rlfabric.weights import versions as store

log = logging.getLogger(__name__)

CURSOR_KEY = "cursor"
"""Checkpoint `extra` key: pairs of the training order consumed so far (a decimal string)."""
CONSUMED_KEY = "consumed"
"""Checkpoint `extra` key: JSON list of the consumed pair ids, in order (for audits)."""
DATASET_VERSION_KEY = "dataset_version"
"""Checkpoint `extra` and metrics-row key: the id of the preference dataset version `dataset.path` names
(`rlfabric prefs build`); absent for other datasets."""
KEEP_CHECKPOINTS = 2
READY_LINE = "rlfabric offline learner started"
"""Printed when `serve_offline` starts (the offline learner's ready line)."""

# -- dataset --------------------------------------------------------------------------------------------


def read_pairs(spec: RunSpec) -> list[dict[str, Any]]:
    """The rows of the training split (`rlfabric.data`); `DatasetError` for a missing, unreadable or
    empty one."""
    source = training_source(spec.dataset)
    rows = read_records(source)
    if not rows:
        raise DatasetError(f"dataset.path {source.path}: the split {source.split!r} is empty")
    return rows


class PairTokenizer:
    """The model's tokenizer turning a dataset row's texts into token ids."""

    def __init__(self, model_path: str, chat_template: bool, max_len: int) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(model_path)
        self.chat_template, self.max_len = chat_template, max_len

    def prompt(self, value: str | list[dict[str, str]]) -> list[int]:
        """A prompt string or chat messages → ids (chat-rendered with the generation prompt if enabled)."""
        if self.chat_template:
            messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
            value = str(self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        if not isinstance(value, str):
            raise ValueError("chat-message prompts need dataset.chat_template = true")
        return list(self.hf.encode(value, add_special_tokens=False))

    def completion(self, text: str, prompt_len: int) -> list[int]:
        """A completion's ids, ending with EOS, cut to fit `max_len` after a prompt of `prompt_len`."""
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if self.hf.eos_token_id is not None:
            ids.append(int(self.hf.eos_token_id))
        return ids[: max(self.max_len - prompt_len, 0)]


def load_pairs(spec: RunSpec) -> list[PreferencePair]:
    """Every row of the dataset's split as a tokenised pair; the pair id is the row's index in the split."""
    pref = spec.preference
    tok = PairTokenizer(spec.model.path, spec.dataset.chat_template, spec.model.max_model_len)
    pairs = []
    for index, row in enumerate(read_pairs(spec)):
        prompt = row_prompt(spec, tok, row, index)
        chosen = tok.completion(row[pref.chosen_field], len(prompt))
        rejected = tok.completion(row[pref.rejected_field], len(prompt))
        pairs.append(PreferencePair(prompt, chosen, rejected, pair_id=str(index)))
    return pairs


def row_prompt(spec: RunSpec, tok: PairTokenizer, row: dict[str, Any], index: int) -> list[int]:
    """Row `index`'s prompt ids; a `ValueError` when the prompt alone fills `model.max_model_len`."""
    prompt = tok.prompt(row[spec.dataset.prompt_field])
    if len(prompt) >= spec.model.max_model_len:
        raise ValueError(f"row {index}: the prompt alone fills model.max_model_len")
    return prompt


def load_kto_examples(spec: RunSpec) -> list[KTOExample]:
    """Every row of the split as KTO rows (`preference_data`): an unpaired row is one, its id the row's
    index; a pair two, the chosen completion desirable ("<index>/chosen"), then the rejected one
    undesirable ("<index>/rejected")."""
    pref = spec.preference
    tok = PairTokenizer(spec.model.path, spec.dataset.chat_template, spec.model.max_model_len)
    records = read_pairs(spec)
    paired = kto_reads_pairs(pref, records[0])
    examples = []
    for index, row in enumerate(records):
        prompt = row_prompt(spec, tok, row, index)
        if paired:
            for field_name, good in ((pref.chosen_field, True), (pref.rejected_field, False)):
                completion = tok.completion(row[field_name], len(prompt))
                name = f"{index}/{'chosen' if good else 'rejected'}"
                examples.append(KTOExample(prompt, completion, good, pair_id=name))
            continue
        if pref.completion_field not in row:
            message = f"row {index + 1} has no column {pref.completion_field!r}"
            raise PreferenceRowError("preference.completion_field", message)
        label = kto_label(pref, row, index)
        completion = tok.completion(row[pref.completion_field], len(prompt))
        examples.append(KTOExample(prompt, completion, label, pair_id=str(index)))
    return examples


def training_order(pairs: Sequence[ItemT], epochs: int, seed: int | None) -> list[ItemT]:
    """`epochs` passes over `pairs`, pass e shuffled with `seed + e` (file order when `seed` is None)."""
    order: list[ItemT] = []
    for epoch in range(epochs):
        one_pass = list(pairs)
        if seed is not None:
            random.Random(seed + epoch).shuffle(one_pass)
        order += one_pass
    return order


# -- the run --------------------------------------------------------------------------------------------


@dataclass
class OfflineState:
    """Where the run stands in its data; saved in every checkpoint."""

    cursor: int = 0
    """Pairs of the training order consumed."""
    consumed: list[str] = field(default_factory=list)
    """Their ids, in order."""

    def to_extra(self) -> dict[str, bytes | str]:
        return {CURSOR_KEY: str(self.cursor), CONSUMED_KEY: json.dumps(self.consumed)}

    @classmethod
    def from_extra(cls, extra: dict[str, bytes | str]) -> OfflineState:
        return cls(int(extra[CURSOR_KEY]), json.loads(extra[CONSUMED_KEY]))


class RedisReports:
    """Rank 0's reports of an offline run to the coordinator, through the run's Redis keys as the online
    learner writes them (`contracts.metrics.append_row`, `keys.step`, `keys.version`), on an event loop
    of its own (the offline run is synchronous)."""

    def __init__(self, config: LearnerServiceConfig) -> None:
        self.run_id = config.run_id
        self.loop = asyncio.new_event_loop()
        self.redis = config.redis.connect()

    def step(self, row: dict[str, Any]) -> None:
        """The step's metrics row, then the step and version it reached."""

        async def write() -> None:
            await append_row(self.redis, self.run_id, row)
            await self.redis.set(keys.version(self.run_id), row["policy_version"])
            await self.redis.set(keys.step(self.run_id), row["step"])

        self.loop.run_until_complete(write())

    def stop_requested(self) -> bool:
        """Whether the coordinator ended the run (stopped, failed or completed it)."""
        return self.loop.run_until_complete(self.redis.exists(keys.stop_requested(self.run_id))) > 0

    def done(self, step: int) -> None:
        """The run ended on the learner's side (its data or step budget ran out) at `step`."""
        self.loop.run_until_complete(self.redis.set(keys.learner_done(self.run_id), step))

    def close(self) -> None:
        self.loop.run_until_complete(self.redis.aclose())
        self.loop.close()


class OfflineRun(Generic[ItemT]):
    """One rank's offline run: draw, train, persist, publish, report. The items are preference pairs
    here; a subclass trains on other items (`sft_run.SFTRun`) by naming them (`item_id`, the row keys)
    and adding to a step's metrics (`extra_metrics`) and to the end of the run (`finish`)."""

    CONSUMED_KEY = "pairs_consumed"
    """Metrics-row and weights-metadata key: items of the training order consumed so far."""
    IDS_KEY = "pair_ids"
    """Metrics-row key: the ids of the step's items."""

    def __init__(self, config: LearnerServiceConfig, world: World, trainer: TrainerBase[ItemT]) -> None:
        self.config, self.spec, self.world, self.trainer = config, config.run, world, trainer
        self.paths = RunPaths.of(config)
        self.state = OfflineState()
        self.stopping = False
        self.checkpoint_step = -1
        self.reports = RedisReports(config) if config.report_to_redis and world.is_main else None
        self.dataset_version = dataset_version(self.spec.dataset.path)
        """The dataset version trained on (verified when the rows were read), recorded in every metrics
        row and checkpoint; None when `dataset.path` is not a preference dataset version."""
        self.trackers = (
            Trackers.start(self.spec, config.run_id, self.paths.run_dir, self.dataset_version)
            if world.is_main
            else Trackers([], self.paths.run_dir)
        )

    def run(self, order: Sequence[ItemT]) -> int:
        """Train until the step budget or the data runs out (or SIGTERM); returns the final step."""
        self.resume(order)
        per_step = self.spec.train.groups_per_step
        last = min(self.spec.train.steps, math.ceil(len(order) / per_step))
        while self.trainer.step < last and not self.stop_requested():
            self.step(order[self.state.cursor : self.state.cursor + per_step], last)
        if self.trainer.step > 0 and self.checkpoint_step != self.trainer.step:
            self.persist()
        self.finish()
        self.trackers.close(self.trainer.step)
        if self.world.is_main:
            step, version = self.trainer.step, self.trainer.policy_version
            print(f"rlfabric offline learner done at step {step}, version {version}", flush=True)
        if self.reports is not None:
            if not self.stopping:
                self.reports.done(self.trainer.step)
            self.reports.close()
        return self.trainer.step

    def resume(self, order: Sequence[ItemT]) -> None:
        """Restore the newest complete checkpoint (if any) and pick the next weights version (above the
        checkpoint's and every published one; rank 0's view of the store, shared by all ranks): the trainer
        holds the current weights under the version below it, and each step advances it by one."""
        latest = latest_complete(self.paths.checkpoints)
        if latest is not None:
            extra = self.trainer.load_checkpoint(latest)
            self.state = OfflineState.from_extra(extra)
            self.check_dataset_version(latest, extra.get(DATASET_VERSION_KEY))
            self.checkpoint_step = self.trainer.step
            if [self.item_id(p) for p in order[: self.state.cursor]] != self.state.consumed:
                raise ValueError(f"{latest} consumed other rows: the dataset or its order changed")
            log.info("resumed", extra={"checkpoint": str(latest), "step": self.trainer.step})
        published = (store.latest_committed(self.paths.weights_root) or 0) if self.world.is_main else 0
        self.trainer.renumber(all_reduce_max(max(self.trainer.policy_version, published), self.world))

    def check_dataset_version(self, checkpoint: Any, trained: bytes | str | None) -> None:
        """A resumed run continues on the dataset version it started on (when either is a version)."""
        if isinstance(trained, bytes):
            trained = trained.decode()
        if trained != self.dataset_version:
            raise DatasetError(
                f"dataset.path {self.spec.dataset.path}: is dataset version {self.dataset_version}, but "
                f"{checkpoint} was trained on version {trained}; resume on the same version"
            )

    def stop_requested(self) -> bool:
        """Whether any rank was asked to stop, by SIGTERM or (rank 0) by the coordinator (collective:
        every rank agrees)."""
        if self.reports is not None and self.reports.stop_requested():
            self.stopping = True
        return all_reduce_max(int(self.stopping), self.world) > 0

    def item_id(self, item: Any) -> str:
        """The ledger id of one item: a pair's `pair_id`."""
        return str(item.pair_id)

    def extra_metrics(self) -> dict[str, float]:
        """What a subclass adds to the metrics of the step just trained (collective): nothing here."""
        return {}

    def finish(self) -> None:
        """Once the run's last checkpoint is written, rank 0 writes the final model from the gathered
        weights (collective), unless it is there: a Hugging Face folder with the tokenizer, which
        transformers, vLLM and a later run's `model.path` load as is (`export.final_model_dir`)."""
        final = final_model_dir(self.paths.run_dir)
        if self.trainer.step == 0 or is_committed(final):
            return
        state_dict = drop_tied_head(self.trainer.model.config, self.trainer.full_state_dict())
        if self.world.is_main:
            export_final_model(state_dict, self.spec.model.path, self.paths.run_dir)
            print(f"rlfabric offline learner final model in {final}", flush=True)

    def step(self, pairs: Sequence[ItemT], last: int) -> None:
        """Phases 2-5 of the module docstring on the step's pairs (or other items)."""
        start = time.perf_counter()
        metrics = self.trainer.train_step(pairs)
        metrics["step_seconds"] = time.perf_counter() - start
        metrics.update(self.extra_metrics())
        self.state.cursor += len(pairs)
        self.state.consumed.extend(self.item_id(p) for p in pairs)
        if self.trainer.step % self.spec.train.checkpoint_every == 0 or self.trainer.step >= last:
            metrics["checkpoint_seconds"] = self.persist()
        metrics["publish_seconds"] = self.publish()
        self.report(metrics, pairs)

    def persist(self) -> float:
        """Checkpoint the model with the data cursor (collective); returns the seconds it took."""
        start = time.perf_counter()
        extra = self.state.to_extra()
        if self.dataset_version is not None:
            extra[DATASET_VERSION_KEY] = self.dataset_version
        self.trainer.save_checkpoint(self.paths.checkpoints, extra=extra)
        if self.world.is_main:
            prune(self.paths.checkpoints, keep=KEEP_CHECKPOINTS)
        self.checkpoint_step = self.trainer.step
        return time.perf_counter() - start

    def publish(self) -> float:
        """Gather the full weights (collective) and publish them as the trainer's version from rank 0."""
        start = time.perf_counter()
        state_dict = drop_tied_head(self.trainer.model.config, self.trainer.full_state_dict())
        if self.world.is_main:
            metadata = {"step": self.trainer.step, self.CONSUMED_KEY: self.state.cursor}
            version = self.trainer.policy_version
            store.publish_version(self.paths.weights_root, version, state_dict, metadata=metadata)
            store.prune(self.paths.weights_root, keep=self.spec.weights.keep_versions)
        return time.perf_counter() - start

    def report(self, metrics: dict[str, float], pairs: Sequence[ItemT]) -> None:
        """Rank 0: one metrics.jsonl row for the step, mirrored to the trackers (and the curves after a
        checkpoint)."""
        if not self.world.is_main:
            return
        row: dict[str, Any] = {
            "step": self.trainer.step,
            "policy_version": self.trainer.policy_version,
            "time": time.time(),
        }
        row.update(metrics)
        row.update({self.CONSUMED_KEY: self.state.cursor, self.IDS_KEY: [self.item_id(p) for p in pairs]})
        if self.dataset_version is not None:
            row[DATASET_VERSION_KEY] = self.dataset_version
        write_metrics(self.paths.metrics, row)
        self.trackers.step(row)
        if "checkpoint_seconds" in metrics:
            self.trackers.curves(self.trainer.step)
        if self.reports is not None:
            self.reports.step(row)

    def request_stop(self, *_: Any) -> None:
        self.stopping = True


def run_offline(config: LearnerServiceConfig, device: torch.device | None = None) -> int:
    """The whole offline run on this rank (joins the process group if needed); returns the final step.

    `device` defaults to this rank's GPU when there is one, else the CPU."""
    if config.run.mode != "offline_preference":
        raise ValueError(f"run.mode is {config.run.mode!r}, not 'offline_preference'")
    world = init_distributed(device)
    spec = config.run
    if spec.preference.loss == "kto":
        rows = training_order(load_kto_examples(spec), spec.dataset.epochs, spec.dataset.shuffle_seed)
        kto = KTOTrainer(spec, spec.model.path, device=world.device, world=world)
        return run_until_stopped(OfflineRun(config, world, kto), rows)
    trainer = PreferenceTrainer(spec, spec.model.path, device=world.device, world=world)
    order = training_order(load_pairs(spec), spec.dataset.epochs, spec.dataset.shuffle_seed)
    return run_until_stopped(OfflineRun(config, world, trainer), order)


def run_until_stopped(offline: OfflineRun[ItemT], order: Sequence[ItemT]) -> int:
    """`offline.run(order)`, SIGTERM asking it to stop (when this is the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return offline.run(order)
    previous = signal.signal(signal.SIGTERM, offline.request_stop)
    try:
        return offline.run(order)
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve_offline(config: LearnerServiceConfig) -> NoReturn:
    """`rlfabric serve learner` when `run.mode` is "offline_preference", "sft" (`sft_run.run_sft`) or
    "reward_model" (`reward_model_run.run_reward_model`): ends the process, with 0 once the run is done
    (`exit_rank`); a failure raises. Prints `READY_LINE` first (`rlfabric up` waits for it: this learner
    serves no status API)."""
    setup_logging("learner", config.log.level, config.log.format)
    print(f"{READY_LINE} for run {config.run_id}", flush=True)
    try:
        if config.run.mode == "sft":
            from rlfabric.learner.sft_run import run_sft

            run_sft(config)
        elif config.run.mode == "reward_model":
            from rlfabric.learner.reward_model_run import run_reward_model

            run_reward_model(config)
        else:
            run_offline(config)
        leave_together()
    finally:
        destroy_distributed()
    log.info("offline learner exited", extra={"pid": os.getpid()})
    exit_rank(0)
