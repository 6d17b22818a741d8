"""Memory planner checked against reality: predicted vs measured peak memory of real learner steps.

Each configuration runs in fresh processes (so their peaks are separate): a model is built locally (the
`tiny` and `bench` presets of `rlfabric.tools.tiny_model`, and a ~100M-parameter random model of the same
family), the real learner (`Trainer.train_step`, FSDP2 over gloo, as `bench/learner_step.py` drives it)
trains it for a few steps on synthetic scored groups, and the process reports its peak resident set
(VmHWM: its own image's, not `ru_maxrss`, which carries a parent's peak across fork and exec). The
prediction is `rlfabric.plan.learner_memory` for the same run spec and world: the sum over the rank's
roles. World 2 runs two ranks under torch.distributed (gloo), as the learner does under torchrun, and
compares each rank's peak.

On a machine with CUDA (not run so far: the figures in bench/results come from CPU machines) the
children train on the GPU and the measurement is `torch.cuda.max_memory_allocated` against the prediction
without its framework-overhead line (goal 10 %); on CPU it is the RSS (goal 15 %). A framework probe (the
tiny model trained on one 32-token sequence per micro-batch) measures what the constant
`rlfabric.plan.memory.CPU_FRAMEWORK_BYTES` stands for.

Usage: python bench/plan.py [--quick] [--output-dir DIR]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
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
    report_results,
)

NAME = "plan"
CPU_GOAL = 0.15
GPU_GOAL = 0.10
STEPS = 2
MiB = 1 << 20

MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "bench": {"layers": 8, "hidden": 512, "heads": 8, "intermediate": 1280},
    "100m": {"layers": 12, "hidden": 768, "heads": 12, "intermediate": 2560},
}
"""TinyModelSpec fields of each model (tiny and bench are the presets; 100m: ~99M parameters)."""


@dataclass(frozen=True)
class Config:
    """One measured configuration: model, algorithm and the step's shape."""

    name: str
    model: str
    micro_batch: int
    samples: int
    """Samples per step: `samples // n` groups of `n`."""
    prompt: int
    completion: int
    advantage: str = "grpo"
    checkpointing: bool = False
    kl_coef: float = 0.0
    world: int = 1
    n: int = 4
    lora_rank: int = 0
    """> 0: LoRA adapters of this rank (alpha 2 x rank) are trained instead."""
    lora_targets: str = ""
    """Comma-separated projections the adapters go on; empty: every attention and MLP projection."""

    @property
    def seq_len(self) -> int:
        return self.prompt + self.completion


BENCH_SHAPE = {"samples": 16, "prompt": 64, "completion": 448}


def on_bench(name: str, micro_batch: int, **options: Any) -> Config:
    """A configuration of the bench model on 16 samples of 64 + 448 tokens."""
    return Config(name, "bench", micro_batch=micro_batch, **BENCH_SHAPE, **options)


FULL = [
    Config("tiny GRPO", "tiny", micro_batch=4, samples=16, prompt=32, completion=224),
    on_bench("bench GRPO mb 4", 4),
    on_bench("bench GRPO mb 16", 16),
    on_bench("bench GRPO mb 16 ckpt", 16, checkpointing=True),
    on_bench("bench PPO critic mb 8", 8, advantage="gae"),
    on_bench("bench GRPO KL ref mb 8", 8, kl_coef=0.05),
    Config("100M GRPO mb 4", "100m", micro_batch=4, samples=8, prompt=64, completion=192),
    on_bench("bench GRPO mb 4 world 2", 4, world=2),
    on_bench("bench LoRA r16 KL mb 8", 8, kl_coef=0.05, lora_rank=16),
    on_bench("bench LoRA r8 q,v mb 16", 16, lora_rank=8, lora_targets="q_proj,v_proj"),
]
QUICK_SHAPE = {"samples": 8, "prompt": 16, "completion": 48}
FRAMEWORK_PROBE = Config("framework probe", "tiny", micro_batch=1, samples=4, prompt=8, completion=24)
"""The tiny model on one 32-token sequence per micro-batch: the process's RSS is then the framework's
(imports, process group, lazily loaded kernels) plus ~12 MiB of model state."""


def quick_configs() -> list[Config]:
    """The same configurations on short sequences (micro-batches capped by the samples)."""
    out = []
    for c in FULL:
        shape = {**QUICK_SHAPE, "samples": max(QUICK_SHAPE["samples"], c.micro_batch * c.world)}
        out.append(replace(c, **shape))
    return out


# -- the child: one learner rank ------------------------------------------------------------------------


def lora_dict(config: Config) -> dict[str, Any] | None:
    """The run spec's `model.lora` of `config` (None without LoRA)."""
    if not config.lora_rank:
        return None
    targets = {"target_modules": config.lora_targets.split(",")} if config.lora_targets else {}
    return {"rank": config.lora_rank, "alpha": 2 * config.lora_rank, **targets}


def run_spec_dict(config: Config, model_dir: Path) -> dict[str, Any]:
    """The run spec of `config` (float32: the compute dtype of a CPU without native bfloat16)."""
    return {
        "model": {
            "path": str(model_dir),
            "dtype": "float32",
            "max_model_len": 4096,
            "lora": lora_dict(config),
        },
        "dataset": {"path": "unused.jsonl"},
        "rollout": {"sampling": {"n": config.n, "max_tokens": config.completion}},
        "algorithm": {"advantage": config.advantage, "kl": {"coef": config.kl_coef}},
        "optim": {"lr": 1e-5, "warmup_steps": 0},
        "train": {
            "micro_batch_size": config.micro_batch,
            "groups_per_step": config.samples // config.n,
            "activation_checkpointing": config.checkpointing,
            "steps": 1000,
        },
    }


def make_groups(config: Config, step: int, vocab_size: int) -> list[Any]:
    """One step's synthetic scored groups: every prompt and completion at its full length."""
    import torch

    from rlfabric.learner.batch import GroupSamples, Rollout

    gen = torch.Generator().manual_seed(step)

    def ids(length: int) -> list[int]:
        return torch.randint(8, vocab_size, (length,), generator=gen).tolist()

    def rollout() -> Rollout:
        reward = float(torch.rand((), generator=gen) < 0.5)
        return Rollout(ids(config.completion), [-1.0] * config.completion, reward)

    groups = config.samples // config.n
    return [
        GroupSamples(ids(config.prompt), [rollout() for _ in range(config.n)], group_id=f"{step}-{g}")
        for g in range(groups)
    ]


def peak_rss() -> int:
    """This process's peak resident set so far, bytes (`VmHWM`: not `ru_maxrss`, which would count the
    parent's peak, see `rlfabric.runtime.memory`)."""
    from rlfabric.runtime.memory import peak_rss_bytes

    return peak_rss_bytes()


def child_train(config: Config, model_dir: Path) -> dict[str, Any]:
    """Train `STEPS` steps as one learner rank; report peak RSS (and on CUDA the allocator's peak)."""
    import torch

    from rlfabric.learner.dist import destroy_distributed, init_distributed
    from rlfabric.learner.trainer import Trainer
    from rlfabric.runspec import RunSpec

    world = init_distributed()
    cuda = world.device.type == "cuda"
    spec = RunSpec.model_validate(run_spec_dict(config, model_dir))
    trainer = Trainer(spec, model_dir, device=world.device, world=world)
    loaded = peak_rss()
    vocab = int(trainer.model.config.vocab_size)
    seconds = []
    for step in range(STEPS):
        start = time.perf_counter()
        trainer.train_step(make_groups(config, step, vocab))
        seconds.append(time.perf_counter() - start)
    out = {"rank": world.rank, "peak_rss": peak_rss(), "peak_rss_after_load": loaded, "step_s": seconds}
    if cuda:
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(world.device)
    destroy_distributed()
    return out


def child_main(payload: str) -> int:
    """Entry of a child process: run what `payload` says and print one JSON line."""
    job = json.loads(payload)
    result = child_train(Config(**job["config"]), Path(job["model_dir"]))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -- the parent: build, launch, predict, compare --------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(job: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Run `job` in `world` fresh child processes (ranks of one gloo group when world > 1)."""
    env_base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if world > 1:
        env_base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    procs = []
    for rank in range(world):
        env = {**env_base, **({"RANK": str(rank), "LOCAL_RANK": str(rank)} if world > 1 else {})}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"child failed ({proc.returncode}): {stdout[-2000:]}")
        line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    return results


def build_model(name: str, root: Path) -> Path:
    """Build model `name` of `MODELS` under `root` (once)."""
    from rlfabric.tools.tiny_model import TinyModelSpec, save_tiny_model

    out = root / name
    if not (out / "config.json").exists():
        save_tiny_model(TinyModelSpec(**MODELS[name]), out)
    return out


def predict(config: Config, model_dir: Path, device: str) -> dict[str, Any]:
    """The planner's per-rank prediction for `config`: total and every line."""
    from rlfabric.plan import ModelArch, learner_memory, learner_shape, rank_total
    from rlfabric.runspec import RunSpec

    spec = RunSpec.model_validate(run_spec_dict(config, model_dir))
    shape = learner_shape(spec, config.world, prompt_tokens=config.prompt, device=device)  # type: ignore[arg-type]
    arch = ModelArch.from_config(model_dir)
    roles = learner_memory(shape, arch, device=device)  # type: ignore[arg-type]
    lines = [
        {"role": r.role, "name": line.name, "bytes": line.bytes, "formula": line.formula}
        for r in roles
        for line in r.lines
    ]
    overhead = sum(x["bytes"] for x in lines if x["name"] == "framework overhead")
    return {
        "total": rank_total(roles),
        "without_overhead": rank_total(roles) - overhead,
        "lines": lines,
        "params": arch.params(),
    }


def measure_config(config: Config, model_dir: Path, cuda: bool, repeats: int) -> dict[str, Any]:
    """Run `config` `repeats` times (fresh processes each), predict it, compare the median of the runs'
    peaks (each run's worst rank when world > 1) with the prediction."""
    start = time.perf_counter()
    job = {"kind": "train", "config": asdict(config), "model_dir": str(model_dir)}
    runs = [launch(job, config.world) for _ in range(repeats)]
    prediction = predict(config, model_dir, "cuda" if cuda else "cpu")
    key, predicted = (
        ("cuda_max_allocated", prediction["without_overhead"]) if cuda else ("peak_rss", prediction["total"])
    )
    peaks = Stats.of([max(r[key] for r in ranks) for ranks in runs], "B")
    measured = int(peaks.median)
    rel = (predicted - measured) / measured
    print(
        f"{config.name}: predicted {predicted / MiB:,.0f} MiB, measured {measured / MiB:,.0f} MiB "
        f"({rel:+.1%}; runs {peaks.min / MiB:,.0f}..{peaks.max / MiB:,.0f}) in "
        f"{time.perf_counter() - start:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return {
        "name": config.name,
        "config": asdict(config),
        "params": prediction["params"],
        "measured_with": key,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "rel_error": rel,
        "measured_runs": peaks.to_dict(),
        "runs": runs,
        "lines": prediction["lines"],
    }


def run_all(configs: Sequence[Config], workdir: Path, repeats: int) -> dict[str, Any]:
    import torch  # only to learn whether the children will find CUDA

    cuda = torch.cuda.is_available()
    probe = {
        "kind": "train",
        "config": asdict(FRAMEWORK_PROBE),
        "model_dir": str(build_model("tiny", workdir)),
    }
    framework = launch(probe, 1)[0]
    print(f"framework probe: {framework['peak_rss'] / MiB:,.0f} MiB", file=sys.stderr, flush=True)
    gpus = torch.cuda.device_count() if cuda else 0
    runnable = [c for c in configs if not cuda or c.world <= gpus]  # a rank per GPU under CUDA
    results = [measure_config(c, build_model(c.model, workdir), cuda, repeats) for c in runnable]
    return {"device": "cuda" if cuda else "cpu", "framework_rss": framework["peak_rss"], "configs": results}


# -- report ---------------------------------------------------------------------------------------------


def render_markdown(payload: dict[str, Any]) -> str:
    from rlfabric.plan.memory import CPU_FRAMEWORK_BYTES

    r = payload["result"]
    goal = payload["goal"]
    rows = []
    for c in r["configs"]:
        cfg = c["config"]
        shape = f"{cfg['micro_batch']} x {cfg['prompt'] + cfg['completion']}"
        verdict = "met" if abs(c["rel_error"]) <= goal else "**not met**"
        rows.append(
            [
                c["name"],
                f"{c['params']:,}",
                shape,
                cfg["world"],
                fmt(c["predicted_bytes"] / MiB),
                fmt(c["measured_bytes"] / MiB),
                mib_stats(c, "measured_bytes").spread(),
                f"{c['rel_error']:+.1%}",
                verdict,
            ]
        )
    measured = "torch.cuda.max_memory_allocated" if r["device"] == "cuda" else "peak RSS (VmHWM)"
    return "\n\n".join(
        [
            f"## plan: predicted vs measured peak memory of a learner rank ({r['device'].upper()})",
            machine_line(payload["machine"]),
            f"Each configuration trains {STEPS} steps with the real learner (`Trainer.train_step`, FSDP2, "
            f"float32) in fresh processes, {payload['repeats']} times; measured is the median over the runs "
            f"of the {measured} of each rank (the largest when world 2; min..max of the runs under "
            f'"runs"), predicted is `rlfabric.plan.learner_memory` summed over the rank\'s roles. Goal: '
            f"|rel error| <= {goal:.0%} on each.",
            markdown_table(
                [
                    "configuration",
                    "params",
                    "B x T",
                    "world",
                    "predicted MiB",
                    "measured MiB",
                    "runs",
                    "rel error",
                    "goal",
                ],
                rows,
            ),
            f"Framework probe (the tiny model on one 32-token sequence): "
            f"{fmt(r['framework_rss'] / MiB)} MiB RSS; "
            f"the planner's constant is {fmt(CPU_FRAMEWORK_BYTES / MiB)} MiB.",
        ]
    )


def mib_stats(config: dict[str, Any], key: str) -> Stats:
    """A configuration's prediction (one value) or measured runs, in MiB."""
    if key == "measured_bytes":
        return Stats.of([v / MiB for v in config["measured_runs"]["values"]], "MiB")
    return Stats.of([config[key] / MiB], "MiB")


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    configs = payload["result"]["configs"]
    panels = []
    for side, key in (("predicted", "predicted_bytes"), ("measured", "measured_bytes")):
        bars = [Bar(c["name"], mib_stats(c, key)) for c in configs]
        panels.append((side, "MiB per rank", bars))
    return bar_plot(path, panels, "plan: predicted vs measured peak memory")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child_main(argv[1])
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(repeats=3)
    args = parser.parse_args(argv)
    configs = quick_configs() if args.quick else FULL
    repeats = effective_repeats(args)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as workdir:
        result = run_all(configs, Path(workdir), repeats)
    goal = GPU_GOAL if result["device"] == "cuda" else CPU_GOAL
    payload = {"machine": machine, "quick": args.quick, "repeats": repeats, "goal": goal, "result": result}
    payload["goal_met"] = all(abs(c["rel_error"]) <= goal for c in result["configs"])
    report_results(args.output_dir, NAME, payload, render_markdown(payload), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
