"""Learner training throughput: the FSDP2 `Trainer` at world size 1 against a plain torch loop.

All sides train the same model (a fresh copy of the same random checkpoint each) on the same steps, in
this one process, interleaved step by step:
- the learner: `Trainer.train_step(groups)` (FSDP2 over gloo with one rank, GRPO advantages, the
  run's policy loss, gradient clipping, AdamW and its schedule), its micro-batches packed (each group's
  prompt once, no padding: `train.packing`, the default);
- the learner padded: the same with `train.packing` off (each row its prompt, padded to the longest);
- the baseline: the same padded micro-batches (`build_micro_batches`), `AutoModelForCausalLM`, a
  log-softmax gather of the targets, a simple policy-gradient loss (group-centred reward times log-prob,
  summed over completion tokens and divided by the step's token count), backward per micro-batch, then
  gradient clipping and one AdamW step.

Throughput is completion tokens trained per second of wall time; the first step of each is a warm-up
and is not counted. The goal is learner tokens/s >= 0.9 x the baseline's; the report gives packed /
padded too. Loads: `bench` (every completion 128 tokens after a 16-64-token prompt: little to share or
pad) and `rl` (`--load rl`: a 64-192-token prompt per group, completions of 8-128 tokens, as RL samples
vary; results named `learner_step_rl`).

Usage: python bench/learner_step.py [--quick] [--load bench|rl] [--repeats K (default 3)] [--output-dir DIR]
"""

from __future__ import annotations

import statistics
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
    """One training step's shape: `groups` prompts x `n` samples, each `completion_min`..`completion`
    tokens long after its group's prompt of `prompt_min`..`prompt_max` tokens; `micro_batch` sequences
    per forward/backward."""

    preset: str
    groups: int
    n: int
    prompt_min: int
    prompt_max: int
    completion: int
    micro_batch: int
    completion_min: int | None = None
    """None: every completion is `completion` tokens."""


FULL = Load("bench", groups=8, n=8, prompt_min=16, prompt_max=64, completion=128, micro_batch=8)
RL = Load(
    "bench", groups=8, n=8, prompt_min=64, prompt_max=192, completion=128, micro_batch=8, completion_min=8
)
QUICK = Load(
    "tiny", groups=2, n=4, prompt_min=4, prompt_max=12, completion=16, micro_batch=4, completion_min=4
)
SIDES = ("learner", "learner_padded", "plain")
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

    def between(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=gen))

    def rollout() -> Rollout:
        length = between(load.completion_min or load.completion, load.completion)
        return Rollout(ids(length), [-1.0] * length, float(torch.rand((), generator=gen) < 0.5))

    def group(step: int, g: int) -> GroupSamples:
        prompt = ids(between(load.prompt_min, load.prompt_max))
        return GroupSamples(prompt, [rollout() for _ in range(load.n)], group_id=f"{step}-{g}")

    return [[group(s, g) for g in range(load.groups)] for s in range(count)]


def run_spec(model_dir: Path, load: Load, packing: bool) -> Any:
    from rlfabric.runspec import RunSpec

    return RunSpec.model_validate({
        "model": {"path": str(model_dir), "dtype": "float32"},
        "dataset": {"path": "unused.jsonl"},
        "rollout": {"sampling": {"n": load.n, "max_tokens": load.completion}},
        "optim": {"lr": LR, "warmup_steps": 0},
        "train": {"micro_batch_size": load.micro_batch, "steps": 1000, "packing": packing},
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
    packed = Trainer(run_spec(model_dir, load, packing=True), model_dir, device=device, world=world)
    padded = Trainer(run_spec(model_dir, load, packing=False), model_dir, device=device, world=world)
    steps = make_steps(load, repeats + 1, plain.model.config.vocab_size)
    sides = {"learner": packed.train_step, "learner_padded": padded.train_step, "plain": plain.train_step}
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    for i, groups in enumerate(steps):
        order = SIDES[i % 3 :] + SIDES[: i % 3]  # each side goes first in turn
        for side in order:
            elapsed = timed(sides[side], groups)
            print(f"step {i} {side}: {elapsed:.1f} s", file=sys.stderr, flush=True)
            if i > 0:
                seconds[side].append(elapsed)
    destroy_distributed()
    tokens = [sum(len(r.token_ids) for g in groups for r in g.rollouts) for groups in steps[1:]]
    throughput = {
        side: Stats.of([n / s for n, s in zip(tokens, values, strict=True)], "tokens/s")
        for side, values in seconds.items()
    }

    def per_step(side: str, baseline: str) -> dict[str, Any]:
        ratios = [b / s for s, b in zip(seconds[side], seconds[baseline], strict=True)]
        return Stats.of(ratios, "x").to_dict()

    return {
        "load": asdict(load),
        "completion_tokens_per_step": statistics.median(tokens),
        "torch_threads": torch.get_num_threads(),
        "device": device.type,
        "tokens_per_s": {side: stats.to_dict() for side, stats in throughput.items()},
        "ratio": ratio(throughput["learner"].median, throughput["plain"].median),
        "ratio_per_step": per_step("learner", "plain"),
        "packing_ratio": ratio(throughput["learner"].median, throughput["learner_padded"].median),
        "packing_ratio_per_step": per_step("learner", "learner_padded"),
    }


LABELS = {
    "learner": "FSDP2 Trainer (packed)",
    "learner_padded": "FSDP2 Trainer (padded)",
    "plain": "plain torch",
}


def render_markdown(payload: dict[str, Any]) -> str:
    r, load = payload["result"], payload["result"]["load"]
    tps = {side: Stats(**s) for side, s in r["tokens_per_s"].items()}
    rows = [[LABELS[side], fmt(s.median), s.spread()] for side, s in tps.items()]
    per_step = Stats(**r["ratio_per_step"])
    packing = Stats(**r["packing_ratio_per_step"])
    verdict = "met" if r["ratio"] >= GOAL else "**not met**"
    lengths = (
        f"{load['completion_min']}-{load['completion']}" if load["completion_min"] else load["completion"]
    )
    return "\n\n".join([
        f"## learner_step: FSDP2 learner vs a plain torch loop (world size 1, {r['device'].upper()})",
        machine_line(payload["machine"]),
        f"Model preset `{load['preset']}`; a step is {load['groups']} groups x {load['n']} samples x "
        f"{lengths} completion tokens (prompts {load['prompt_min']}-{load['prompt_max']} tokens, one per "
        f"group), micro-batches of {load['micro_batch']}, float32, {r['torch_threads']} torch threads. "
        f"Median of {payload['repeats']} interleaved steps after one warm-up step each (min..max).",
        markdown_table(["", "completion tokens/s", "spread"], rows),
        f"Ratio learner / plain: **{fmt(r['ratio'])}** (per-step ratios {fmt(per_step.median)}, "
        f"{per_step.spread()}). Goal >= {GOAL}: {verdict}. Packed / padded learner: "
        f"**{fmt(r['packing_ratio'])}** (per step {fmt(packing.median)}, {packing.spread()}).",
    ])  # fmt: skip


def plot(payload: dict[str, Any], path: Path) -> None:
    tps = {side: Stats(**s) for side, s in payload["result"]["tokens_per_s"].items()}
    bars = [Bar(LABELS[side], stats) for side, stats in tps.items()]
    bar_plot(path, [("training throughput", "completion tokens/s", bars)], "learner_step")


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(repeats=3)
    parser.add_argument(
        "--load",
        choices=("bench", "rl"),
        default="bench",
        help="bench: 128-token completions, short prompts (default); rl: long shared prompts, 8-128-token "
        "completions (results learner_step_rl)",
    )
    args = parser.parse_args(argv)
    repeats = effective_repeats(args)
    load = QUICK if args.quick else RL if args.load == "rl" else FULL
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as workdir:
        result = measure(load, repeats, Path(workdir))
    payload = {"machine": machine, "quick": args.quick, "repeats": repeats, "goal": GOAL, "result": result}
    payload["goal_met"] = result["ratio"] >= GOAL
    markdown = render_markdown(payload)
    name = NAME if args.quick or args.load == "bench" else f"{NAME}_{args.load}"
    report_results(args.output_dir, name, payload, markdown, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
