"""Learner training throughput: the FSDP2 `Trainer` at world size 1 against a plain torch loop.

Both train the same model (a fresh copy of the same random checkpoint each) on the same steps, in this
one process, interleaved step by step:
- the learner: `Trainer.train_step(groups)` (FSDP2 over gloo with one rank, GRPO advantages, the
  run's policy loss, gradient clipping, AdamW and its schedule);
- the baseline: the same padded micro-batches (`build_micro_batches`), `AutoModelForCausalLM`, a
  log-softmax gather of the targets, a simple policy-gradient loss (group-centred reward times log-prob,
  summed over completion tokens and divided by the step's token count), backward per micro-batch, then
  gradient clipping and one AdamW step.

Throughput is completion tokens trained per second of wall time; the first step of each is a warm-up
and is not counted. The goal is learner tokens/s >= 0.9 x the baseline's.

Usage: python bench/learner_step.py [--quick] [--repeats K (default 3)] [--output-dir DIR]
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import (
    Bar,
    Stats,
    bar_plot,
    base_parser,
    effective_repeats,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    ratio,
    report_results,
)

NAME = "learner_step"
GOAL = 0.9


@dataclass(frozen=True)
class Load:
    """One training step's shape: `groups` prompts x `n` samples, each `completion` tokens long after a
    prompt of `prompt_min`..`prompt_max` tokens; `micro_batch` sequences per forward/backward."""

    preset: str
    groups: int
    n: int
    prompt_min: int
    prompt_max: int
    completion: int
    micro_batch: int

    @property
    def completion_tokens(self) -> int:
        return self.groups * self.n * self.completion


FULL = Load("bench", groups=8, n=8, prompt_min=16, prompt_max=64, completion=128, micro_batch=8)
QUICK = Load("tiny", groups=2, n=4, prompt_min=4, prompt_max=12, completion=16, micro_batch=4)
LR = 1e-5


def make_model(preset: str, out_dir: Path) -> Path:
    from rlfabric.tools.tiny_model import PRESETS, save_tiny_model

    return save_tiny_model(PRESETS[preset], out_dir)


def make_steps(load: Load, count: int, vocab_size: int) -> list[list[Any]]:
    """`count` steps of random groups (token ids among the ordinary characters, rewards 0/1)."""
    import torch

    from rlfabric.learner.batch import GroupSamples, Rollout

    gen = torch.Generator().manual_seed(0)

    def ids(length: int) -> list[int]:
        return torch.randint(8, vocab_size, (length,), generator=gen).tolist()

    def group(step: int, g: int) -> GroupSamples:
        prompt_len = int(torch.randint(load.prompt_min, load.prompt_max + 1, (), generator=gen))
        rollouts = [
            Rollout(
                ids(load.completion), [-1.0] * load.completion, float(torch.rand((), generator=gen) < 0.5)
            )
            for _ in range(load.n)
        ]
        return GroupSamples(ids(prompt_len), rollouts, group_id=f"{step}-{g}")

    return [[group(s, g) for g in range(load.groups)] for s in range(count)]


def run_spec(model_dir: Path, load: Load) -> Any:
    from rlfabric.runspec import RunSpec

    return RunSpec.model_validate({
        "model": {"path": str(model_dir), "dtype": "float32"},
        "dataset": {"path": "unused.jsonl"},
        "rollout": {"sampling": {"n": load.n, "max_tokens": load.completion}},
        "optim": {"lr": LR, "warmup_steps": 0},
        "train": {"micro_batch_size": load.micro_batch, "steps": 1000},
    })  # fmt: skip


class PlainLoop:
    """The baseline: a single-process torch training loop with no framework around it."""

    def __init__(self, model_dir: Path, load: Load, device: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
        self.model.config.use_cache = False
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.micro_batch = load.micro_batch

    def train_step(self, groups: Sequence[Any]) -> float:
        """One optimizer step over `groups`; returns the loss."""
        import torch

        from rlfabric.learner.batch import build_micro_batches

        micro_batches = [
            mb.to(self.device) for mb in build_micro_batches(groups, self.micro_batch, self.pad_id)
        ]
        advantages = group_centred_rewards(groups).to(self.device)
        count = sum(float(mb.loss_mask.sum()) for mb in micro_batches)
        total = 0.0
        for mb in micro_batches:
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # (B, T, V)
            logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.targets(self.pad_id)[..., None])[
                ..., 0
            ]
            adv = advantages[mb.sample_index][:, None]  # (B, 1)
            loss = -(adv * logp * mb.loss_mask).sum() / count
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def group_centred_rewards(groups: Sequence[Any]) -> Any:
    """Each sample's reward minus its group's mean: (N,) in step order."""
    import torch

    rewards = torch.tensor([[r.reward for r in g.rollouts] for g in groups])  # (G, n)
    return (rewards - rewards.mean(dim=1, keepdim=True)).reshape(-1)


def timed(step: Any, groups: Sequence[Any]) -> float:
    import torch

    start = time.perf_counter()
    step(groups)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the step's last kernels (the optimizer's) may still be queued
    return time.perf_counter() - start


def measure(load: Load, repeats: int, workdir: Path) -> dict[str, Any]:
    """Warm-up then `repeats` interleaved steps of each side (alternating which goes first)."""
    import torch

    from rlfabric.learner.dist import destroy_distributed, init_distributed
    from rlfabric.learner.trainer import Trainer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = make_model(load.preset, workdir / "model")
    plain = PlainLoop(model_dir, load, device)
    world = init_distributed(device)
    trainer = Trainer(run_spec(model_dir, load), model_dir, device=device, world=world)
    steps = make_steps(load, repeats + 1, plain.model.config.vocab_size)
    sides = {"learner": trainer.train_step, "plain": plain.train_step}
    seconds: dict[str, list[float]] = {"learner": [], "plain": []}
    for i, groups in enumerate(steps):
        order = ["learner", "plain"] if i % 2 == 0 else ["plain", "learner"]
        for side in order:
            elapsed = timed(sides[side], groups)
            print(f"step {i} {side}: {elapsed:.1f} s", file=sys.stderr, flush=True)
            if i > 0:
                seconds[side].append(elapsed)
    destroy_distributed()
    tokens = load.completion_tokens
    throughput = {
        side: Stats.of([tokens / s for s in values], "tokens/s") for side, values in seconds.items()
    }
    step_ratios = [p / learner for learner, p in zip(seconds["learner"], seconds["plain"], strict=True)]
    return {
        "load": asdict(load),
        "completion_tokens_per_step": tokens,
        "torch_threads": torch.get_num_threads(),
        "device": device.type,
        "tokens_per_s": {side: stats.to_dict() for side, stats in throughput.items()},
        "ratio": ratio(throughput["learner"].median, throughput["plain"].median),
        "ratio_per_step": Stats.of(step_ratios, "x").to_dict(),
    }


def render_markdown(payload: dict[str, Any]) -> str:
    r, load = payload["result"], payload["result"]["load"]
    tps = {side: Stats(**s) for side, s in r["tokens_per_s"].items()}
    rows = [
        [side, fmt(s.median), s.spread()]
        for side, s in (("FSDP2 Trainer", tps["learner"]), ("plain torch", tps["plain"]))
    ]
    per_step = Stats(**r["ratio_per_step"])
    verdict = "met" if r["ratio"] >= GOAL else "**not met**"
    return "\n\n".join([
        f"## learner_step: FSDP2 learner vs a plain torch loop (world size 1, {r['device'].upper()})",
        machine_line(payload["machine"]),
        f"Model preset `{load['preset']}`; a step is {load['groups']} groups x {load['n']} samples x "
        f"{load['completion']} completion tokens (prompts {load['prompt_min']}-{load['prompt_max']} tokens), "
        f"micro-batches of {load['micro_batch']}, float32, {r['torch_threads']} torch threads. Median of "
        f"{payload['repeats']} interleaved steps after one warm-up step each (min..max).",
        markdown_table(["", "completion tokens/s", "spread"], rows),
        f"Ratio learner / plain: **{fmt(r['ratio'])}** (per-step ratios {fmt(per_step.median)}, "
        f"{per_step.spread()}). Goal >= {GOAL}: {verdict}.",
    ])  # fmt: skip


def plot(payload: dict[str, Any], path: Path) -> None:
    tps = {side: Stats(**s) for side, s in payload["result"]["tokens_per_s"].items()}
    bars = [Bar("FSDP2 Trainer", tps["learner"]), Bar("plain torch", tps["plain"])]
    bar_plot(path, [("training throughput", "completion tokens/s", bars)], "learner_step")


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(repeats=3)
    args = parser.parse_args(argv)
    repeats = effective_repeats(args)
    load = QUICK if args.quick else FULL
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as workdir:
        result = measure(load, repeats, Path(workdir))
    payload = {"machine": machine, "quick": args.quick, "repeats": repeats, "goal": GOAL, "result": result}
    payload["goal_met"] = result["ratio"] >= GOAL
    markdown = render_markdown(payload)
    report_results(args.output_dir, NAME, payload, markdown, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
