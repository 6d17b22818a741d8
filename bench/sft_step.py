"""SFT training throughput: the learner's packed micro-batches (each micro-batch's shared untrained prefix
computed once) against its padded ones and a plain torch loop, on tool-calling demonstrations.

All sides train the same model (a fresh copy of the same random checkpoint each) on the same examples, in
this one process, interleaved step by step:
- the learner packed: `SFTTrainer.train_step(examples)` (FSDP2 over gloo with one rank, the token-mean
  loss on the assistant's tokens, gradient clipping, AdamW), `train.packing` on (the default): the
  examples sorted by their ids, each micro-batch one packed row whose shared untrained prefix (the
  system turn with the tool schemas) is computed once and whose LM head runs on the examples' own tokens;
- the learner padded: the same with `train.packing` off (each row the whole example, padded);
- the baseline: a plain torch loop over the same padded micro-batches (`AutoModelForCausalLM`, a
  log-softmax gather of the targets, the summed negative log-prob of the assistant's tokens over the
  step's count, backward per micro-batch, gradient clipping, one AdamW step).

Data: the agentic example's 1,024 demonstrations (`examples/agentic/sft.jsonl`: a tool schema, a
question, a tool call, the tool's answer, the final answer) rendered by the chat template of the example's
model (the tiny BPE model, made here), 16 examples a step in one micro-batch, as the example's warm start
trains. `--load no-tools`: the same conversations without the tool schemas (little left to share).
Throughput is trained (assistant) tokens per second of wall time; the first step of each side is a
warm-up. The loss of each side's steps is recorded: packing must not change it (the report gives the
largest difference).

Usage: python bench/sft_step.py [--quick] [--load tools|no-tools] [--repeats K (default 20)]
                                [--output-dir DIR]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
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

NAME = "sft_step"
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "agentic" / "sft.jsonl"
SIDES = ("packed", "padded", "plain")
LABELS = {"packed": "SFTTrainer (packed)", "padded": "SFTTrainer (padded)", "plain": "plain torch"}
EXAMPLES_PER_STEP = 16
LR = 2e-3


def make_model(out_dir: Path) -> Path:
    from rlfabric.tools.tiny_model import TinyModelSpec, save_tiny_model

    return save_tiny_model(TinyModelSpec(tokenizer="bpe"), out_dir)


def run_spec(model_dir: Path, data: Path, packing: bool) -> Any:
    from rlfabric.runspec import RunSpec

    return RunSpec.model_validate({
        "mode": "sft",
        "model": {"path": str(model_dir), "dtype": "float32", "max_model_len": 512},
        "dataset": {"path": str(data)},
        "optim": {"lr": LR, "warmup_steps": 0},
        "train": {"micro_batch_size": EXAMPLES_PER_STEP, "steps": 1000, "packing": packing},
    })  # fmt: skip


def write_data(load: str, out: Path) -> Path:
    """The demonstrations as the load asks: as they are, or without their tool schemas."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    if load == "no-tools":
        rows = [{"messages": row["messages"]} for row in rows]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


class PlainLoop:
    """The baseline: a single-process torch loop over padded micro-batches, no framework around it."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.config.use_cache = False
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.pad_id = int(self.model.config.pad_token_id or 0)

    def train_step(self, examples: Sequence[Any]) -> float:
        """One optimizer step over `examples`; returns the loss."""
        import torch

        from rlfabric.learner.batch import build_micro_batches
        from rlfabric.learner.sft import examples_as_groups

        groups = examples_as_groups(examples)
        micro_batches = build_micro_batches(groups, EXAMPLES_PER_STEP, self.pad_id, by_length=True)
        count = sum(float(mb.loss_mask.sum()) for mb in micro_batches)
        total = 0.0
        for mb in micro_batches:
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.targets(self.pad_id)[..., None])
            loss = -(logp[..., 0] * mb.loss_mask).sum() / count
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def measure(load: str, repeats: int, workdir: Path) -> dict[str, Any]:
    """Warm-up then `repeats` interleaved steps of each side (each side first in turn)."""
    import torch

    from rlfabric.learner.dist import destroy_distributed, init_distributed
    from rlfabric.learner.sft import SFTTrainer
    from rlfabric.learner.sft_data import load_sft_data

    model_dir = make_model(workdir / "model")
    data = write_data(load, workdir / "sft.jsonl")
    world = init_distributed(torch.device("cpu"))
    trainers = {
        side: SFTTrainer(run_spec(model_dir, data, side == "packed"), model_dir, device=torch.device("cpu"),
                         world=world, total_steps=1000)
        for side in ("packed", "padded")
    }  # fmt: skip
    plain = PlainLoop(model_dir)
    examples = load_sft_data(run_spec(model_dir, data, True)).train
    steps = [examples[i * EXAMPLES_PER_STEP : (i + 1) * EXAMPLES_PER_STEP] for i in range(repeats + 1)]
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    losses: dict[str, list[float]] = {side: [] for side in SIDES}
    for i, batch in enumerate(steps):
        for side in SIDES[i % 3 :] + SIDES[: i % 3]:
            start = time.perf_counter()
            loss = plain.train_step(batch) if side == "plain" else trainers[side].train_step(batch)["loss"]
            elapsed = time.perf_counter() - start
            print(f"step {i} {side}: {elapsed:.2f} s, loss {loss:.4f}", file=sys.stderr, flush=True)
            losses[side].append(loss)
            if i > 0:
                seconds[side].append(elapsed)
    destroy_distributed()
    trained = [sum(sum(e.loss_mask[1:]) for e in batch) for batch in steps[1:]]
    lengths = [len(e.token_ids) for batch in steps for e in batch]
    throughput = {
        side: Stats.of([n / s for n, s in zip(trained, values, strict=True)], "tokens/s")
        for side, values in seconds.items()
    }

    def per_step(side: str, baseline: str) -> dict[str, Any]:
        return Stats.of([b / s for s, b in zip(seconds[side], seconds[baseline], strict=True)], "x").to_dict()

    return {
        "load": load,
        "examples_per_step": EXAMPLES_PER_STEP,
        "example_tokens_median": statistics.median(lengths),
        "trained_tokens_per_step": statistics.median(trained),
        "torch_threads": torch.get_num_threads(),
        "tokens_per_s": {side: stats.to_dict() for side, stats in throughput.items()},
        "packing_ratio": ratio(throughput["packed"].median, throughput["padded"].median),
        "packing_ratio_per_step": per_step("packed", "padded"),
        "plain_ratio": ratio(throughput["packed"].median, throughput["plain"].median),
        "plain_ratio_per_step": per_step("packed", "plain"),
        "losses": losses,
        "max_loss_difference": max(
            abs(a - b) for a, b in zip(losses["packed"], losses["padded"], strict=True)
        ),
    }


def render_markdown(payload: dict[str, Any]) -> str:
    r = payload["result"]
    tps = {side: Stats(**s) for side, s in r["tokens_per_s"].items()}
    rows = [[LABELS[side], fmt(s.median), s.spread()] for side, s in tps.items()]
    packing, plain = Stats(**r["packing_ratio_per_step"]), Stats(**r["plain_ratio_per_step"])
    what = "with their tool schemas" if r["load"] == "tools" else "without their tool schemas"
    return "\n\n".join([
        f"## sft_step: SFT with shared prefixes packed vs padded ({r['load']})",
        machine_line(payload["machine"]),
        f"The agentic example's demonstrations {what} (median {fmt(r['example_tokens_median'])} tokens, "
        f"{fmt(r['trained_tokens_per_step'])} trained tokens a step of {r['examples_per_step']} examples), "
        f"the tiny BPE model, float32, torch threads: {r['torch_threads']}. Median of {payload['repeats']} "
        "interleaved steps after one warm-up step each (min..max).",
        markdown_table(["", "trained tokens/s", "spread"], rows),
        f"Packed / padded: **{fmt(r['packing_ratio'])}x** (per step {fmt(packing.median)}, "
        f"{packing.spread()}); packed / plain torch: **{fmt(r['plain_ratio'])}x** (per step "
        f"{fmt(plain.median)}, {plain.spread()}). Largest difference between the packed and padded "
        f"losses of a step: {r['max_loss_difference']:.1e}.",
        f"Command: `{payload['command']}`",
    ])  # fmt: skip


def plot(payload: dict[str, Any], path: Path) -> None:
    tps = {side: Stats(**s) for side, s in payload["result"]["tokens_per_s"].items()}
    bars = [Bar(LABELS[side], stats) for side, stats in tps.items()]
    bar_plot(path, [("SFT throughput", "trained tokens/s", bars)], NAME)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(repeats=20)
    parser.add_argument(
        "--load",
        choices=("tools", "no-tools"),
        default="tools",
        help="tools: the demonstrations as they are, a tool schema opening each (default); no-tools: "
        "without the schemas (results sft_step_no-tools)",
    )
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else effective_repeats(args)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as workdir:
        result = measure(args.load, repeats, Path(workdir))
    command = " ".join(["python bench/sft_step.py", *(argv if argv is not None else sys.argv[1:])])
    payload = {"machine": machine, "quick": args.quick, "repeats": repeats, "command": command}
    payload["result"] = result
    name = NAME if args.quick or args.load == "tools" else f"{NAME}_{args.load}"
    report_results(args.output_dir, name, payload, render_markdown(payload), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
