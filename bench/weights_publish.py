"""Benchmark: publishing one weights version against the least any publish must do, in the same run.

    python bench/weights_publish.py [--quick] [--repeats 5] [--output-dir bench/results] [--work-dir DIR]

The state dicts are random tensors shaped like the Qwen2 models of `rlfabric.tools.tiny_model`: `bench`
(8 layers, hidden 512: 24.2 M parameters, ~97 MB in float32) and `tiny` (0.44 M parameters, ~1.8 MB).
Per repeat, in rotating order, each into a fresh directory under --work-dir (deleted afterwards):

- `baseline`: `safetensors.torch.save_file` of the state dict, then one sha256 pass over the file's bytes;
  the least a publish must do (serialize, write, hash), with no durability at all;
- `baseline+fsync`: the same plus one fsync of the file: the least a *durable* publish must do;
- `publish`: `rlfabric.weights.versions.publish_version` (default 1 GiB shards: one file here);
- `publish-4-shards`: the same with shards of a quarter of the state dict, written concurrently.

The figure of merit is median(publish) / median(baseline) in wall time (goal <= 1.5). `publish` also
fsyncs every file and directory and writes a manifest and a commit marker, which the plain baseline does
not: against `baseline+fsync` the comparison is like for like. CPU seconds (this process, all threads)
are reported too: on a machine busy with other work they say more about the work done than wall time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import (
    Stats,
    base_parser,
    effective_repeats,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    ratio,
    write_results,
)
from safetensors.torch import save_file

from rlfabric.tools.tiny_model import PRESETS, TinyModelSpec
from rlfabric.weights.versions import publish_version

NAME = "weights_publish"
GOAL_RATIO = 1.5
QUICK_SPEC = TinyModelSpec(layers=1, hidden=64, heads=2, intermediate=128)
METHODS = ("baseline", "baseline+fsync", "publish", "publish-4-shards")


def qwen2_state_dict(spec: TinyModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors named and shaped like `Qwen2ForCausalLM.state_dict()` for `spec`, with the
    tied `lm_head.weight` sharing the embedding's storage (as HF's tied models do)."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv, mlp = (
        spec.hidden,
        spec.heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (mlp, h), p + "mlp.up_proj.weight": (mlp, h),
            p + "mlp.down_proj.weight": (h, mlp),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    shapes["model.norm.weight"] = (h,)
    state = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def baseline(state: dict[str, torch.Tensor], directory: Path, fsync: bool) -> None:
    """save_file, one sha256 pass over the bytes written, and optionally one fsync of the file.

    save_file refuses tensors that share storage, so the tied head is cloned beforehand (outside the
    timed region: `measure` receives a state dict already prepared by `untied`)."""
    path = directory / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    with open(path, "rb") as f:
        hashlib.file_digest(f, "sha256").hexdigest()
        if fsync:
            os.fsync(f.fileno())


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() if name == "lm_head.weight" else tensor for name, tensor in state.items()}


@dataclass
class Case:
    """One state dict and the callables that write it into a fresh directory."""

    label: str
    state: dict[str, torch.Tensor]

    def methods(self) -> dict[str, Callable[[Path], Any]]:
        plain = untied(self.state)
        quarter = max(1, nbytes(self.state) // 4)
        return {
            "baseline": lambda d: baseline(plain, d, fsync=False),
            "baseline+fsync": lambda d: baseline(plain, d, fsync=True),
            "publish": lambda d: publish_version(d, 1, self.state),
            "publish-4-shards": lambda d: publish_version(d, 1, self.state, shard_bytes=quarter),
        }


def time_once(fn: Callable[[Path], Any], work_dir: Path) -> tuple[float, float, Any]:
    """Wall and CPU seconds (this process, all threads) `fn` takes to write into a fresh directory
    (removed afterwards), and what it returned. CPU time is the work done, which a busy machine inflates
    less than wall time.

    `os.sync()` first, untimed: the previous run's dirty pages must not be written back during this one
    (the baselines without fsync would otherwise bill their write-back to whatever runs next)."""
    directory = Path(tempfile.mkdtemp(prefix="weights-bench-", dir=work_dir))
    try:
        os.sync()
        started, cpu_started = time.perf_counter(), time.process_time()
        result = fn(directory)
        return time.perf_counter() - started, time.process_time() - cpu_started, result
    finally:
        shutil.rmtree(directory)


def measure(case: Case, repeats: int, work_dir: Path) -> dict[str, Any]:
    """Every method once per repeat, the order rotating so that no method always runs first."""
    methods = case.methods()
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    phases: list[dict[str, float]] = []
    for fn in methods.values():  # warm-up: imports, thread pools, page cache for the tensors
        time_once(fn, work_dir)
    for r in range(repeats):
        names = list(methods)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            elapsed, cpu_s, result = time_once(methods[name], work_dir)
            seconds[name].append(elapsed)
            cpu[name].append(cpu_s)
            if name == "publish":
                phases.append(vars(result.timings))
    return summarize(case, seconds, cpu, phases)


def summarize(
    case: Case, seconds: dict[str, list[float]], cpu: dict[str, list[float]], phases: list[dict[str, float]]
) -> dict[str, Any]:
    stats = {name: Stats.of(values, "s") for name, values in seconds.items()}
    cpu_stats = {name: Stats.of(values, "s") for name, values in cpu.items()}
    base = stats["baseline"].median
    return {
        "label": case.label,
        "bytes": nbytes(case.state),
        "tensors": len(case.state),
        "seconds": {name: s.to_dict() for name, s in stats.items()},
        "ratio_vs_baseline": {name: ratio(s.median, base) for name, s in stats.items()},
        "ratio_vs_durable_baseline": ratio(stats["publish"].median, stats["baseline+fsync"].median),
        "cpu_seconds": {name: s.to_dict() for name, s in cpu_stats.items()},
        "cpu_ratio_vs_baseline": ratio(cpu_stats["publish"].median, cpu_stats["baseline"].median),
        "publish_phases_median_s": {key: Stats.of([p[key] for p in phases], "s").median for key in phases[0]},
        "goal_ratio": GOAL_RATIO,
        "meets_goal": ratio(stats["publish"].median, base) <= GOAL_RATIO,
    }


def render_markdown(result: dict[str, Any]) -> str:
    rows = []
    for case in result["cases"]:
        row = [case["label"], f"{case['bytes'] / 1e6:.1f}"]
        row += [f"{case['seconds'][m]['median'] * 1e3:.1f}" for m in METHODS]
        row += [fmt(case["ratio_vs_baseline"]["publish"]), fmt(case["ratio_vs_baseline"]["publish-4-shards"])]
        row += [fmt(case["ratio_vs_durable_baseline"]), fmt(case["cpu_ratio_vs_baseline"])]
        row += ["yes" if case["meets_goal"] else "no"]
        rows.append(row)
    headers = ["state dict", "MB", *(f"{m} ms" for m in METHODS), "publish / baseline",
               "4 shards / baseline", "publish / baseline+fsync", "CPU s publish / baseline",
               f"<= {GOAL_RATIO}"]  # fmt: skip
    phases = markdown_table(
        ["state dict", *result["cases"][0]["publish_phases_median_s"]],
        [
            [c["label"], *(f"{v * 1e3:.1f} ms" for v in c["publish_phases_median_s"].values())]
            for c in result["cases"]
        ],
    )
    return (
        f"# Weights publish vs save_file + sha256\n\n{machine_line(result['machine'])}\n\n"
        f"Median of {result['repeats']} repeats (wall seconds, fresh directory each, under "
        f"`{result['work_dir']}`).\n\n{markdown_table(headers, rows)}\n\n"
        "`publish` phases (medians; write and hash overlap, summed over threads):\n\n"
        f"{phases}\n\nCommand: `{result['command']}`\n"
    )


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("quick (1 layer, hidden 64)", qwen2_state_dict(QUICK_SPEC))]
    return [
        Case("Qwen2 8 layers hidden 512 (fp32)", qwen2_state_dict(PRESETS["bench"])),
        Case("Qwen2 2 layers hidden 128 (fp32)", qwen2_state_dict(PRESETS["tiny"])),
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the versions are written (the disk being measured)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    repeats = effective_repeats(args)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "name": NAME,
        "machine": machine_info(),
        "quick": args.quick,
        "repeats": repeats,
        "work_dir": str(args.work_dir),
        "command": "python bench/weights_publish.py" + (" --quick" if args.quick else ""),
        "cases": [measure(case, repeats, args.work_dir) for case in cases(args.quick)],
    }
    markdown = render_markdown(result)
    paths = write_results(args.output_dir, NAME, result, markdown)
    print(markdown)
    print(f"\nwrote {paths['json']}, {paths['md']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
