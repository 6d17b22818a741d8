"""The whole RLHF loop on a laptop, in one command: gold -> preference data -> reward models -> RL against
them, held-out evaluation by the gold preference, and the over-optimization figure.

    python examples/rlhf/run.py                 # ~20-25 min on two CPU cores; writes runs/rlhf/
    python examples/rlhf/run.py --quick         # fewer steps, one RL run: a smoke test of every stage

Stages (each a real `rlfabric` command; their logs are under OUT/logs):
1. policy     `rlfabric make-tiny-model`: the random tiny model every stage starts from
2. data       `rlfabric prefs build examples/rlhf/prefs.toml`: k completions per prompt sampled from the
              policy on a replica the build starts, labelled by the gold preference (gold.py) asked in
              both orders, decontaminated against the evaluation prompts, written as a verified version
3. rewards    `rlfabric up` with `mode = "reward_model"`, once per seed: Bradley-Terry reward models on
              that version (held-out pairwise accuracy in their metrics)
4. RL         `rlfabric up` GRPO runs against the reward model(s), evaluated every 2 steps on the
              held-out prompts by the gold preference (`dataset.eval.reward`):
                kl-low       KL coefficient 0.001, one reward model: the over-optimization curve
                kl-high      KL coefficient 0.05: the KL leash moves the gold peak
                ensemble     three reward models (seeds), mean - 1 std (uncertainty-penalised ensemble)
                ensemble-disjoint  the same, members trained on disjoint thirds of the data
                guarded      kl-low with `health.auto_stop = ["overoptimization"]`: stops past the gold
                             peak and reports the last checkpoint at or before it
5. DPO        `rlfabric up` with `mode = "offline_preference"` on the same version from the same policy;
              its final model's held-out gold reward, sampled and scored like the RL evaluations
6. figure     OUT/overoptimization.png (proxy and gold reward against KL, one panel per run) and
              OUT/results.json (per run: gold peak, KL there, final gold and proxy, the guard's stop)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RM_SEEDS = (0, 1, 2)


@dataclass
class Variant:
    """One RL run against the reward model(s)."""

    name: str
    kl_coef: float
    ensemble: bool = False
    disjoint: bool = False
    """The ensemble's members trained on disjoint thirds of the data (else: the whole of it, other seeds)."""
    guarded: bool = False
    notes: list[str] = field(default_factory=list)


VARIANTS = [
    Variant("kl-low", 0.001),
    Variant("kl-high", 0.05),
    Variant("ensemble", 0.001, ensemble=True),
    Variant("ensemble-disjoint", 0.001, ensemble=True, disjoint=True),
    Variant("guarded", 0.001, guarded=True),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/rlhf"), help="where everything goes (runs/rlhf)")
    p.add_argument("--rl-steps", type=int, default=40, help="steps of each RL run (default 40)")
    p.add_argument("--rm-steps", type=int, default=150, help="steps of each reward model (default 150)")
    p.add_argument("--quick", action="store_true", help="6 RL steps, one RL run, one reward model")
    p.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], help="RL runs to do")
    p.add_argument(
        "--learner-threads",
        type=int,
        help="torch threads of every learner (`rlfabric up --learner-threads`; default: up's own choice, "
        "every core for the reward models and DPO, which run alone)",
    )
    return p.parse_args()


def sh(out: Path, name: str, *argv: str) -> str:
    """Runs one stage's command, its output to OUT/logs/NAME.log; returns the output; exits on failure."""
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"[{name}] {' '.join(argv[:4])} ...", flush=True)
    result = subprocess.run(argv, capture_output=True, text=True)
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        sys.exit(f"[{name}] failed (exit {result.returncode}); see {log}")
    print(f"[{name}] done in {time.monotonic() - start:.0f} s", flush=True)
    return result.stdout


def rlfabric(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlfabric.cli", *args]


def up(run_file: Path | str, run_dir: Path, threads: int | None) -> list[str]:
    """`rlfabric up RUN_FILE` into `run_dir`, one line per step, `--learner-threads` when given."""
    argv = rlfabric("up", str(run_file), "--run-dir", str(run_dir), "--no-progress")
    return [*argv, "--learner-threads", str(threads)] if threads else argv


def write_run(out: Path, name: str, spec: dict[str, Any]) -> Path:
    path = out / "files" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=2))
    return path


def gold_function(out: Path) -> str:
    """The gold function, copied beside the generated files: user code loads only from the folder of the
    file that names it (the pipeline's, the run's)."""
    copy = out / "files" / "gold.py"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text((HERE / "gold.py").read_text())
    return f"{copy}:gold_reward"


# -- stages ---------------------------------------------------------------------------------------------


def policy(out: Path) -> Path:
    model = out / "policy"
    if not (model / "config.json").exists():
        sh(out, "policy", *rlfabric("make-tiny-model", str(model), "--seed", "0"))
    return model


def data(out: Path, model: Path) -> Path:
    """The prefs version folder: prefs.toml with this run's model, store and absolute paths."""
    pipeline = tomllib.loads((HERE / "prefs.toml").read_text())
    pipeline["store"] = str(out / "prefs")
    pipeline["source"]["prompts"] = str(HERE / "label_prompts.jsonl")
    pipeline["source"]["generator"]["model"] = str(model)
    pipeline["judges"][0]["params"]["function"] = gold_function(out)
    pipeline["hygiene"]["decontaminate"][0]["path"] = str(HERE / "eval.jsonl")
    text = sh(out, "prefs", *rlfabric("prefs", "build", str(write_run(out, "prefs", pipeline))))
    print("\n".join("    " + line for line in text.splitlines()[-6:]), flush=True)
    path = next(line.split()[-1] for line in text.splitlines() if line.strip().startswith("path"))
    return Path(path)


def reward_model(
    out: Path, model: Path, version: Path, seed: int, steps: int, threads: int | None, part: int | None = None
) -> Path:
    """Reward model `seed` on the whole version, or (with `part`) on its third `part` only."""
    name = f"rm-{seed}" if part is None else f"rm-part{part}"
    spec: dict[str, Any] = {
        "name": name,
        "mode": "reward_model",
        "model": {"path": str(model), "max_model_len": 256},
        "dataset": {
            "path": str(version),
            "epochs": 4,
            "held_out_fraction": 0.1,
            "eval_every_steps": 20,
            "shuffle_seed": seed,
        },
        "optim": {"lr": 1e-3},
        "train": {"steps": steps, "groups_per_step": 16, "micro_batch_size": 32, "seed": seed},
    }
    if part is not None:
        spec["dataset"]["split"] = f"train[{33 * part}%:{100 if part == 2 else 33 * (part + 1)}%]"
        spec["dataset"]["epochs"] = 12
    run_dir = out / name
    if not (run_dir / name / "model" / "config.json").exists():
        sh(out, name, *up(write_run(out, name, spec), run_dir, threads))
    rows = read_rows(run_dir / name / "metrics.jsonl")
    accuracy = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    print(f"    {name}: held-out pairwise accuracy {accuracy[0]:.2f} -> {accuracy[-1]:.2f}", flush=True)
    return run_dir / name / "model"


def rl_spec(out: Path, variant: Variant, model: Path, rms: list[Path], steps: int) -> dict[str, Any]:
    gold = {"scorer": "python_function", "params": {"function": gold_function(out)}}
    rm_params: dict[str, Any] = {"normalization": "none"}
    if variant.ensemble:
        rm_params.update(paths=[str(p) for p in rms], ensemble="mean_minus_std", ensemble_k=1.0)
    else:
        rm_params["path"] = str(rms[0])
    spec: dict[str, Any] = {
        "name": variant.name,
        "model": {"path": str(model), "max_model_len": 256},
        "dataset": {
            "path": str(HERE / "prompts.jsonl"),
            "reference_field": None,
            "epochs": 1000,
            "eval_every_steps": 2,
            "eval": {"path": str(HERE / "eval.jsonl"), "reward": gold},
        },
        "rollout": {"sampling": {"n": 8, "max_tokens": 12, "temperature": 1.0}, "max_staleness": 1},
        "reward": {"scorer": "reward_model", "params": rm_params},
        "algorithm": {"kl": {"coef": variant.kl_coef, "estimator": "k3"}},
        "optim": {"lr": 0.003},
        "train": {"steps": steps, "groups_per_step": 8, "micro_batch_size": 32, "checkpoint_every": 2,
                  "keep_checkpoints": 20},
    }  # fmt: skip
    if variant.guarded:
        spec["health"] = {"auto_stop": ["overoptimization"]}
    return spec


def rl(
    out: Path, variant: Variant, model: Path, rms: list[Path], steps: int, threads: int | None
) -> dict[str, Any]:
    run_dir = out / variant.name
    path = write_run(out, variant.name, rl_spec(out, variant, model, rms, steps))
    if not (run_dir / variant.name / "metrics.jsonl").exists():
        # a guarded stop exits 1
        result = subprocess.run(up(path, run_dir, threads), capture_output=True, text=True)
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "logs" / f"{variant.name}.log").write_text(result.stdout + result.stderr)
        print(f"[{variant.name}] exit {result.returncode}", flush=True)
    log = (out / "logs" / f"{variant.name}.log").read_text()
    return summarize(variant, read_rows(run_dir / variant.name / "metrics.jsonl"), ending(log))


def ending(log: str) -> dict[str, str]:
    """What `up` printed of the run's end: state, stop reason, last good checkpoint."""
    found: dict[str, str] = {}
    for line in log.splitlines():
        if line.startswith("run ") and " at step " in line:
            found["state"] = line.split(": ", 1)[-1]
        for key in ("stop reason", "last good checkpoint"):
            if line.strip().startswith(f"{key}: "):
                found[key.replace(" ", "_")] = line.split(": ", 1)[1]
    return found


def dpo(out: Path, model: Path, version: Path, steps: int, threads: int | None) -> dict[str, Any]:
    """DPO on the same preference version, from the same policy: the no-reward-model alternative. Its final
    model is scored like the RL runs' evaluations: the held-out prompts, n = 8, by the gold preference."""
    spec = {
        "name": "dpo",
        "mode": "offline_preference",
        "model": {"path": str(model), "max_model_len": 256},
        "dataset": {"path": str(version), "epochs": 4},
        "preference": {"loss": "dpo", "beta": 0.1},
        "optim": {"lr": 1e-3},
        "train": {"steps": steps, "groups_per_step": 16, "micro_batch_size": 32, "checkpoint_every": 50},
    }
    run_dir = out / "dpo"
    final = run_dir / "dpo" / "model"
    if not (final / "config.json").exists():
        sh(out, "dpo", *up(write_run(out, "dpo", spec), run_dir, threads))
    before, after = asyncio.run(held_out_gold([model, final]))
    print(f"    dpo: held-out gold {before:.3f} (initial policy) -> {after:.3f}", flush=True)
    return {"variant": "dpo", "initial_gold": before, "gold": after, "steps": steps}


async def held_out_gold(models: list[Path]) -> list[float]:
    """Mean gold reward of each model's completions of the held-out prompts (n = 8, 12 tokens, T = 1)."""
    sys.path.insert(0, str(HERE))
    from gold import gold_score

    from rlfabric.prefs.generation import make_generator
    from rlfabric.prefs.generator_specs import LocalGeneratorSpec

    prompts = [json.loads(line)["prompt"] for line in (HERE / "eval.jsonl").read_text().splitlines()]
    means = []
    for model in models:
        generator = make_generator(LocalGeneratorSpec(model=str(model), max_model_len=256, max_tokens=64))
        async with generator:
            texts = await generator.generate(prompts, n=8, max_tokens=12, temperature=1.0, seed=0)
        scores = [gold_score(t) for row in texts for t in row]
        means.append(sum(scores) / len(scores))
    return means


# -- results --------------------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The last row of each step (a restarted step's earlier rows are superseded)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows[int(row["step"])] = row
    return [rows[s] for s in sorted(rows)]


def evaluations(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """One point per evaluation: its step, the KL at that step, proxy and gold held-out reward."""
    kl_at = {int(r["step"]): float(r.get("kl", 0.0)) for r in rows}
    points: dict[int, dict[str, float]] = {}
    for r in rows:
        if "eval_gold_reward_mean" in r:
            step = int(r.get("eval_step", r["step"]))
            points[step] = {
                "step": step,
                "kl": kl_at.get(step, float(r.get("kl", 0.0))),
                "proxy": float(r["eval_reward_mean"]),
                "gold": float(r["eval_gold_reward_mean"]),
            }
    return [points[s] for s in sorted(points)]


def summarize(variant: Variant, rows: list[dict[str, Any]], end: dict[str, str]) -> dict[str, Any]:
    points = evaluations(rows)
    peak = max(points, key=lambda p: p["gold"]) if points else None
    return {
        "variant": variant.name,
        "kl_coef": variant.kl_coef,
        "ensemble": variant.ensemble,
        "guarded": variant.guarded,
        "steps": len(rows),
        "points": points,
        "gold_peak": peak,
        "final": points[-1] if points else None,
        "end": end,
    }


def plot(results: list[dict[str, Any]], dpo_gold: float, path: Path) -> None:
    """One column per RL run: proxy and gold held-out reward against KL (top) and against the step
    (bottom); the gold peak dotted, DPO's held-out gold on the same data dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    golds = [p["gold"] for r in results for p in r["points"]] + [dpo_gold]
    gold_lim = (min(golds) - 0.05, max(golds) + 0.05)
    fig, axes = plt.subplots(2, len(results), figsize=(3.9 * len(results), 6.2), squeeze=False)
    for col, res in enumerate(results):
        pts = res["points"]
        for row, x_name in enumerate(("kl", "step")):
            ax = axes[row][col]
            xs = [p[x_name] for p in pts]
            ax.plot(xs, [p["proxy"] for p in pts], "o-", color="tab:blue", ms=4, lw=1, label="proxy (RM)")
            ax.set_ylabel("proxy reward (held-out)", color="tab:blue")
            gold = ax.twinx()
            gold.plot(xs, [p["gold"] for p in pts], "s-", color="tab:red", ms=4, lw=1, label="gold")
            gold.axhline(dpo_gold, color="tab:green", ls="--", lw=1, label="DPO, same data")
            gold.set_ylim(*gold_lim)
            gold.set_ylabel("gold reward (held-out)", color="tab:red")
            if res["gold_peak"]:
                ax.axvline(res["gold_peak"][x_name], color="tab:red", ls=":", lw=1)
            ax.set_xlabel("KL to the reference (nats/token)" if x_name == "kl" else "learner step")
            if row == 0:
                stopped = " (stopped by the guard)" if res["end"].get("stop_reason") else ""
                ax.set_title(f"{res['variant']}: kl coef {res['kl_coef']}{stopped}", fontsize=9)
            if row == 0 and col == 0:
                lines = ax.get_lines()[:1] + gold.get_lines()[:2]
                ax.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    args = parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rl_steps, rm_seeds = (6, RM_SEEDS[:1]) if args.quick else (args.rl_steps, RM_SEEDS)
    names = args.variants or (["kl-low"] if args.quick else [v.name for v in VARIANTS])
    model = policy(out)
    version = data(out, model)
    threads = args.learner_threads
    rms = [reward_model(out, model, version, seed, args.rm_steps, threads) for seed in rm_seeds]
    chosen = [v for v in VARIANTS if v.name in names]
    if any(v.disjoint for v in chosen):
        parts = [reward_model(out, model, version, i, args.rm_steps, threads, part=i) for i in range(3)]
    results = [rl(out, v, model, parts if v.disjoint else rms, rl_steps, threads) for v in chosen]
    offline = dpo(out, model, version, 12 if args.quick else args.rm_steps, threads)
    summary = {"version": version.name, "runs": results, "dpo": offline}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    plot(results, offline["gold"], out / "overoptimization.png")
    for res in results:
        peak, last = res["gold_peak"], res["final"]
        if peak and last:
            head = f"{res['variant']:>9}: gold peak {peak['gold']:.3f} at KL {peak['kl']:.3f}"
            tail = f"final gold {last['gold']:.3f}, proxy {last['proxy']:.3f} at KL {last['kl']:.3f}"
            print(f"{head} (step {peak['step']}); {tail}; {res['end'].get('stop_reason', '')}")
    print(f"figure: {out / 'overoptimization.png'}; numbers: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
