"""Supervised runs under `rlfabric up`: the warm start of an online run (`[warm_start]`), and run files of
`mode = "sft"`. Both run the learner alone (`rlfabric serve learner`, the offline SFT run of
`rlfabric.learner.sft_run`; under torchrun with `--learner-ranks`), guarded like every process of `up`;
no other service is needed.

A warm start, before the online run's services start:

    1. plan     the SFT run: `RunSpec.warm_start_spec()` (mode "sft": the run's model, the warm start's
                dataset, sft, optim and train), run id `warm_start`, writing into the run's output folder:
                <output_dir>/<name>/warm_start/ (checkpoints, weights, metrics.jsonl, model/)
    2. reuse    a committed final model (`learner.export.is_committed`) is the result and nothing runs:
                `up --resume` after the warm start finished
    3. run      otherwise the learner until it exits, its steps shown as they are written (a bar with the
                loss, or a line at every tenth: `LearnerProgress`); an interrupted or crashed warm start
                resumes from its last checkpoint on `up --resume`; one that fails raises `WarmStartFailed`
    4. hand on  the online spec starting from the final model: `model.path` is the final model, which the
                reference and the critic follow unless `model.reference_path` or `model.critic_path` is
                set; the `warm_start` section is dropped (the services never see it)

An SFT run file runs steps 2-3 of itself: its run id is its name, its output the run directory. A
reward-model run file (`mode = "reward_model"`, `rlfabric.learner.reward_model_run`) runs the same way;
its final model is what the reward service's `reward_model` scorer serves (`path` = that folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from rlfabric.learner.export import final_model_dir, is_committed
from rlfabric.local.services import learner_env
from rlfabric.local.stack import OFFLINE_LEARNER_READY, Stack, cli
from rlfabric.runspec import RunSpec

WARM_START_ID = "warm_start"
"""The run id (and folder in the run's output folder) of a warm start."""
START_TIMEOUT_S = 300.0
"""How long the learner may take to print its ready line."""
POLL_S = 1.0
"""How often `up` looks at the running learner and its new metrics rows."""


class WarmStartFailed(RuntimeError):
    """The supervised run did not finish (its learner failed); the message names its log."""


def warm_start_dir(spec: RunSpec) -> Path:
    """Where the warm start of `spec` (named) writes: <output_dir>/<name>/warm_start."""
    if spec.name is None:
        raise ValueError("a warm start needs the run's name")
    return Path(spec.output_dir) / spec.name / WARM_START_ID


def warm_start_run(spec: RunSpec) -> RunSpec:
    """Step 1: the warm start's SFT spec, writing under the run's output folder."""
    sft = spec.warm_start_spec()
    return sft.model_copy(update={"output_dir": str(warm_start_dir(spec).parent)})


def started_from(spec: RunSpec, model: Path) -> RunSpec:
    """Step 4: `spec` starting from `model`, without its warm start."""
    start = spec.model.model_copy(update={"path": str(model)})
    return spec.model_copy(update={"model": start, "warm_start": None})


def warm_started(stack: Stack, args: argparse.Namespace, spec: RunSpec) -> Any:
    """Steps 1-4: the `RunSpec` the online run runs (`spec` itself when it has no warm start); typed
    as `up` holds its spec, whose name `up` has set."""
    if spec.warm_start is None:
        return spec
    final = final_model_dir(warm_start_dir(spec))
    if is_committed(final):
        print(f"rlfabric up: warm start done before; the run starts from {final}", flush=True)
    else:
        print(f"rlfabric up: warm start (SFT) into {final.parent}", flush=True)
        run_learner(stack, args, warm_start_run(spec), WARM_START_ID)
    if not is_committed(final):
        raise WarmStartFailed(f"the warm start ended without a final model in {final}")
    return started_from(spec, final)


def run_sft_file(stack: Stack, args: argparse.Namespace, spec: RunSpec) -> int:
    """A `mode = "sft"` run file: its learner to the end; the exit code (0 once its model is written)."""
    assert spec.name is not None  # `up` names every run
    run_learner(stack, args, spec, spec.name)
    final = final_model_dir(Path(spec.output_dir) / spec.name)
    print(f"rlfabric up: run {spec.name} done; final model {final}", flush=True)
    return 0 if is_committed(final) else 1


def run_reward_model_file(stack: Stack, args: argparse.Namespace, spec: RunSpec) -> int:
    """A `mode = "reward_model"` run file: its learner to the end; the exit code (0 once its model is
    written). Prints where the model is and the `[reward]` section that serves it."""
    assert spec.name is not None  # `up` names every run
    run_learner(stack, args, spec, spec.name)
    final = final_model_dir(Path(spec.output_dir) / spec.name)
    print(f"rlfabric up: run {spec.name} done; reward model {final}", flush=True)
    if not is_committed(final):
        return 1
    print(f'serve it with: [reward] scorer = "reward_model", params = {{path = "{final}"}}', flush=True)
    return 0


def run_learner(stack: Stack, args: argparse.Namespace, spec: RunSpec, run_id: str) -> None:
    """Step 3: the offline learner of `spec` as `run_id`, from start to exit; `WarmStartFailed` unless
    it exits with 0."""
    config = {"run_id": run_id, "log": {"format": "text"}, "run": json.loads(spec.model_dump_json())}
    path = stack.run_dir / f"{run_id}.learner.yaml"
    path.write_text(yaml.safe_dump(config))
    env = learner_env(args, len(os.sched_getaffinity(0)) // args.learner_ranks)  # alone: every core
    proc = stack.process(f"learner-{run_id}", learner_argv(path, args.learner_ranks), env)
    stack.start(proc, OFFLINE_LEARNER_READY, timeout_s=START_TIMEOUT_S)
    assert proc.proc is not None
    metrics = Path(spec.output_dir) / run_id / "metrics.jsonl"  # `up`'s output folder is local
    shown = LearnerProgress(metrics, spec.train.steps, progress=not args.no_progress)
    try:
        while (code := proc.proc.poll()) is None:
            time.sleep(POLL_S)
            shown.poll()
    finally:
        shown.close()
    if code != 0:
        error = last_line(proc.tail)
        log = proc.log_path
        raise WarmStartFailed(f"the learner of {run_id} exited with code {code} ({error}); its log: {log}")


def last_line(lines: Iterable[str]) -> str:
    """What a failed process said last: the last exception line of its output (`OSError: ...`), else its
    last non-empty line, without torchrun's `[rankN]:` prefix."""
    found = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in lines]
    errors = [line for line in found if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    return next((line for line in reversed(errors or found) if line), "no output")


def learner_argv(config: Path, ranks: int) -> list[str]:
    """`rlfabric serve learner --config CONFIG`, under torchrun for more than one rank."""
    if ranks <= 1:
        return cli("serve", "learner", "--config", str(config))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    return [*argv, "-m", "rlfabric.cli", "serve", "learner", "--config", str(config)]


class LearnerProgress:
    """Follows an offline learner's metrics.jsonl while `up` waits for it: a bar of its steps with the
    latest loss (and accuracy), or without a bar a line at every tenth of `train.steps`, at least every
    `LINE_EVERY_S` (an SFT run that ends with its epochs may stop far short of `train.steps`), and at its
    last step. A resumed run's file already holds the rows before its checkpoint: the bar starts at the
    latest step."""

    SHOWN = ("loss", "token_accuracy", "accuracy")
    LINE_EVERY_S = 30.0

    def __init__(self, metrics: Path, steps: int, *, progress: bool) -> None:
        from tqdm import tqdm

        self.metrics, self.steps, self.progress = metrics, steps, progress
        self.offset, self.step, self.said = 0, 0, 0
        self.last_line, self.told = time.monotonic(), 0
        self.latest: dict[str, str] = {}
        self.bar = tqdm(total=steps, unit="step", disable=not progress, dynamic_ncols=True)

    def poll(self) -> None:
        """Reads the rows written since the last poll (a line still being written waits for the next)."""
        if not self.metrics.exists():
            return
        with self.metrics.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            self.show(json.loads(line))

    def show(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        shown = {k: f"{row[k]:.3g}" for k in self.SHOWN if isinstance(row.get(k), int | float)}
        if step <= self.step:
            return  # a row of a step already shown (a resumed run repeats the steps it rolled back)
        self.bar.update(step - self.step)
        self.step, self.latest = step, shown
        self.bar.set_postfix(shown, refresh=True)
        tenth = max(1, self.steps // 10)
        due = time.monotonic() - self.last_line >= self.LINE_EVERY_S
        if step // tenth > self.said or step == self.steps or due:
            self.said = step // tenth
            self.say()

    def say(self) -> None:
        """Without a bar: one line with the latest step and its metrics."""
        self.last_line, self.told = time.monotonic(), self.step
        if not self.progress:
            values = " ".join(f"{k}={v}" for k, v in self.latest.items())
            print(f"  step {self.step}/{self.steps}: {values}", flush=True)

    def close(self) -> None:
        """Reads the last rows and, without a bar, tells the last step if no line did."""
        self.poll()
        if self.step > self.told:
            self.say()
        self.bar.close()
