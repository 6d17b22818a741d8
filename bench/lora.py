"""Benchmark: syncing a LoRA policy to a replica as its adapter alone against as merged full weights.

    python bench/lora.py [--quick] [--repeats 5] [--output-dir bench/results] [--sizes bench 100m]

Issue 26's first goal, part one ("sync"): the time from the learner holding a new version of a LoRA policy
until a replica serves it, for the two ways a learner publishes it (`model.lora.publish`):

- `full` ("merged"): the learner's gather of the full state dict (`get_model_state_dict`, full and on
  CPU, as `Trainer.full_state_dict`), `learner.lora.merged_state_dict` and `drop_tied_head` (as the
  learner's `publish_weights`), `weights.versions.publish_version`, then `UpdateWeights` (object store)
  on the replica until it returns (the replica then serves the new version);
- `adapter`: the gather of the trainable parameters alone (`ignore_frozen_params`, as
  `Trainer.adapter_state_dict`), `learner.lora.adapter_state_dict` (PEFT's saved names),
  `weights.adapters.publish_adapter`, then `UpdateWeights(adapter=...)` until it returns.

The model is the `bench` preset of `rlfabric.tools.tiny_model` (24.2 M parameters, float32; built
locally), wrapped by PEFT in a rank-16 LoRA adapter (alpha 32) on every attention and MLP projection,
initialised non-zero (`init_lora_weights=False`); each version perturbs the adapter's weights (untimed).
One real replica (`rlfabric serve rollout`: vLLM on CPU, eager, `engine.max_adapters=1`,
`engine.max_adapter_rank=16`, a loopback gRPC port) serves both paths for the whole run; after one
warm-up of each path, every repeat syncs once by each path, the order alternating repeat by repeat.
After each load one greedy `Generate` (the adapter's request naming the adapter) checks that the replica
serves the new version; it is not timed. Both paths load into the same replica, so after a full update
the adapter sits on the last merged weights rather than the base: the probe checks the version served,
not the samples' values (which do not change what a load costs).

Reported per path: bytes published (the manifest's total), seconds to gather, to publish and for the
`UpdateWeights` round trip (with the replica's own drain / transfer / load split), and their sum, the
"time to serving". `sync_time_ratio` = median(full total) / median(adapter total), goal >= 10;
`bytes_ratio` the same for bytes. `--sizes bench 100m` adds a ~99 M-parameter model of the same family
(14 layers, hidden 768) on a second replica.

Part two of the goal ("fleet": four LoRA runs sharing one replica against the same four one after
another, goal >= 1.5x samples/s at the same reward each) is `bench/lora_fleet.py`; its figures are copied
into this benchmark's results (`fleet_ratio`, read from `lora_fleet.json` in the output directory when
there is one, else null).

`--quick` (CI): the `tiny` preset, one repeat, to run every code path (replica logs: LOG_DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
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
from rollout_service import AUTH, CLIENT_AUTH, CLIENT_TOKEN, LEARNER_TOKEN, vllm_env

from rlfabric.tools.tiny_model import PRESETS, TinyModelSpec

NAME = "lora"
SYNC_GOAL = 10.0
"""Issue 26: an adapter sync takes at least 10x less time to serving than a full-weight sync."""
FLEET_GOAL = 1.5
FLEET_NOTE = "not measured yet: run bench/lora_fleet.py (four LoRA runs on one replica vs one after another)"
ADAPTER_NAME = "policy"
"""The name the replica holds the adapter under (`UpdateWeights.adapter`, `GenerateRequest.adapter`)."""
PATHS = ("full", "adapter")
LOG_DIR = Path(tempfile.gettempdir()) / f"rlfabric-bench-lora-logs-{os.getuid()}"
SIZES: dict[str, TinyModelSpec] = {
    "bench": PRESETS["bench"],
    "100m": TinyModelSpec(layers=14, hidden=768, heads=12, intermediate=2048),
    "tiny": PRESETS["tiny"],
}
"""The model shapes `--sizes` picks from (`tiny` is the quick mode's)."""


@dataclass(frozen=True)
class Setup:
    """The adapter and the replica of one run of the benchmark."""

    rank: int
    """LoRA rank r of the adapter (and the replica's `engine.max_adapter_rank`)."""
    alpha: int
    """LoRA alpha: each adapted weight gets (alpha / r) B A."""
    kv_cache_bytes: int
    """The replica's KV cache (`engine.kv_cache_bytes`)."""
    max_model_len: int
    """The replica's longest sequence (`engine.max_model_len`)."""
    probe_tokens: int
    """Tokens of the greedy Generate after each load."""


FULL_SETUP = Setup(rank=16, alpha=32, kv_cache_bytes=256 << 20, max_model_len=256, probe_tokens=8)
QUICK_SETUP = Setup(rank=16, alpha=32, kv_cache_bytes=128 << 20, max_model_len=128, probe_tokens=4)


# --- the policy (what a LoRA learner holds) --------------------------------------------------------------


def lora_spec(setup: Setup) -> Any:
    from rlfabric.runspec import LoraSpec

    return LoraSpec(rank=setup.rank, alpha=setup.alpha)


def lora_policy(model_dir: Path, setup: Setup) -> Any:
    """The saved model wrapped in a random, non-zero LoRA adapter on every projection, as the learner's
    `add_adapters` wraps it (same targets, rank, alpha) but with PEFT's `init_lora_weights=False`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlfabric.learner.lora import ADAPTER

    torch.manual_seed(0)
    spec = lora_spec(setup)
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=spec.target_modules, bias="none",
        task_type="CAUSAL_LM", init_lora_weights=False,
    )  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(base, config, adapter_name=ADAPTER).eval()


def next_version(policy: Any, version: int) -> None:
    """Perturbs every adapter weight in place: the policy after another (pretend) optimizer step."""
    import torch

    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_" in name:
                param.add_(1e-3 * torch.randn(param.shape, generator=gen))


def gather_full(policy: Any, setup: Setup) -> dict[str, Any]:
    """What the learner publishes with `publish = "merged"`: the full state dict, adapters merged, the
    tied head dropped."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rlfabric.learner.export import drop_tied_head
    from rlfabric.learner.lora import merged_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(policy, options=options)
    return drop_tied_head(policy.config, merged_state_dict(state, lora_spec(setup)))


def gather_adapter(policy: Any) -> dict[str, Any]:
    """What the learner publishes with `publish = "adapter"`: the trainable parameters, PEFT's names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rlfabric.learner.lora import adapter_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return adapter_state_dict(get_model_state_dict(policy, options=options))


# --- the replica -----------------------------------------------------------------------------------------


def start_replica(model_dir: Path, weights_root: Path, setup: Setup, scratch: Path) -> tuple[Any, str]:
    """`rlfabric serve rollout` with one adapter slot, on an ephemeral port; returns (process, address)."""
    from rlfabric.local.procs import ServiceProcess

    argv = [
        sys.executable, "-m", "rlfabric.cli", "serve", "rollout", "--model", str(model_dir), "--port", "0",
        "--set", "server.metrics_port=0",
        "--set", "engine.enforce_eager=true", "--set", "engine.dtype=float32",
        "--set", f"engine.kv_cache_bytes={setup.kv_cache_bytes}",
        "--set", f"engine.max_model_len={setup.max_model_len}",
        "--set", "engine.max_adapters=1", "--set", f"engine.max_adapter_rank={setup.rank}",
        "--set", f"weights_root={weights_root}", "--set", "log.format=text",
    ]  # fmt: skip
    env = {
        **os.environ,
        **vllm_env(scratch, eager=True),
        "RLFABRIC_ROLLOUT__LEARNER_TOKEN": LEARNER_TOKEN,
        "RLFABRIC_ROLLOUT__CLIENT_TOKEN": CLIENT_TOKEN,
    }
    log_path = LOG_DIR / f"{model_dir.name}.log"
    proc = ServiceProcess(f"rollout-{model_dir.name}", argv, log_path=log_path, env=env)
    address = proc.start(r"listening on (\S+)", timeout_s=600).group(1)
    proc.wait_for(r"serving version", timeout_s=600)
    return proc, address


def update(stub: Any, root: Path, version: int, adapter: str = "") -> Any:
    """`UpdateWeights` from the object store (of the base, or of `adapter`); returns the reply."""
    from rlfabric.v1 import rollout_pb2

    source = rollout_pb2.ObjectStoreSource(root_url=str(root))
    request = rollout_pb2.UpdateWeightsRequest(version=version, adapter=adapter, object_store=source)
    return stub.UpdateWeights(request, timeout=300, metadata=AUTH)


def probe(stub: Any, version: int, adapter: str, tokens: int) -> int:
    """One greedy Generate (on `adapter` when set); raises unless the replica served `version` and
    generated tokens. Returns the tokens generated."""
    from rlfabric.v1 import common_pb2, rollout_pb2

    request = rollout_pb2.GenerateRequest(
        request_id=f"probe-{adapter or 'base'}-{version}",
        prompts=[rollout_pb2.GeneratePrompt(prompt_id="p", prompt=common_pb2.Prompt(text="hello world"))],
        sampling=rollout_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=tokens),
        adapter=adapter,
    )
    samples = list(stub.Generate(request, timeout=120, metadata=CLIENT_AUTH))
    served = {s.policy_version for s in samples}
    if served != {version} or not all(s.token_ids for s in samples):
        raise RuntimeError(f"{adapter or 'base'}: expected version {version}, replica served {served}")
    return sum(len(s.token_ids) for s in samples)


# --- one sync by each path -------------------------------------------------------------------------------


@dataclass
class Syncer:
    """Syncs the policy's current version to the replica by one path and times each phase."""

    policy: Any
    stub: Any
    roots: dict[str, Path]
    setup: Setup

    def full(self, version: int) -> dict[str, float]:
        from rlfabric.weights.versions import publish_version

        root = self.roots["full"]
        return self.timed(
            version,
            gather=lambda: gather_full(self.policy, self.setup),
            publish=lambda state: publish_version(root, version, state),
            load=lambda: update(self.stub, root, version),
            adapter="",
        )

    def adapter(self, version: int) -> dict[str, float]:
        from rlfabric.learner.lora import adapter_config
        from rlfabric.weights.adapters import publish_adapter

        root, config = self.roots["adapter"], adapter_config(self.policy)
        return self.timed(
            version,
            gather=lambda: gather_adapter(self.policy),
            publish=lambda state: publish_adapter(root, version, state, config),
            load=lambda: update(self.stub, root, version, ADAPTER_NAME),
            adapter=ADAPTER_NAME,
        )

    def timed(
        self,
        version: int,
        *,
        gather: Callable[[], dict[str, Any]],
        publish: Callable[[dict[str, Any]], Any],
        load: Callable[[], Any],
        adapter: str,
    ) -> dict[str, float]:
        """Gather, publish, UpdateWeights, each timed (after an untimed `os.sync`), then the probe."""
        os.sync()
        t0 = time.perf_counter()
        state = gather()
        t1 = time.perf_counter()
        published = publish(state)
        t2 = time.perf_counter()
        reply = load()
        t3 = time.perf_counter()
        if reply.version != version:
            raise RuntimeError(f"UpdateWeights answered version {reply.version}, not {version}")
        return {
            "bytes": float(published.total_bytes),
            "tensors": float(len(state)),
            "gather_s": t1 - t0,
            "publish_s": t2 - t1,
            "load_s": t3 - t2,
            "replica_drain_s": reply.drain_seconds,
            "replica_transfer_s": reply.transfer_seconds,
            "replica_load_s": reply.load_seconds,
            "total_s": t3 - t0,
            "probe_tokens": float(probe(self.stub, version, adapter, self.setup.probe_tokens)),
        }


def measure(size: str, setup: Setup, repeats: int, workdir: Path) -> dict[str, Any]:
    """One replica for `size`; one warm-up sync by each path, then `repeats` by each, alternating."""
    import grpc

    from rlfabric.tools.tiny_model import save_tiny_model
    from rlfabric.v1 import rollout_pb2_grpc

    model_dir = save_tiny_model(SIZES[size], workdir / f"model-{size}")
    roots = {path: workdir / f"weights-{size}-{path}" for path in PATHS}
    policy = lora_policy(model_dir, setup)
    proc, address = start_replica(model_dir, roots["full"], setup, workdir)
    runs: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
    try:
        with grpc.insecure_channel(address) as channel:
            syncer = Syncer(policy, rollout_pb2_grpc.RolloutServiceStub(channel), roots, setup)
            paths: dict[str, Callable[[int], dict[str, float]]] = {
                "full": syncer.full,
                "adapter": syncer.adapter,
            }
            for version in range(1, repeats + 2):
                next_version(policy, version)
                order = list(PATHS) if version % 2 else list(reversed(PATHS))
                for path in order:
                    result = paths[path](version)
                    if version > 1:  # version 1 is the warm-up
                        runs[path].append(result)
    finally:
        proc.stop(grace_s=60)
    return summarise(size, policy, runs)


def seconds_stats(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Stats of every timed phase (the keys ending in `_s`) over the repeats of one path."""
    return {key: Stats.of([r[key] for r in runs], "s").to_dict() for key in runs[0] if key.endswith("_s")}


def summarise(size: str, policy: Any, runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    from rlfabric.learner.lora import trainable_parameters

    trainable, total = trainable_parameters(policy)
    per_path = {path: seconds_stats(values) for path, values in runs.items()}
    nbytes = {path: int(values[0]["bytes"]) for path, values in runs.items()}
    tensors = {path: int(values[0]["tensors"]) for path, values in runs.items()}
    sync_ratio = ratio(per_path["full"]["total_s"]["median"], per_path["adapter"]["total_s"]["median"])
    return {
        "size": size,
        "spec": {k: v for k, v in asdict(SIZES[size]).items() if k != "vocab_chars"},
        "parameters": total - trainable,
        "adapter_parameters": trainable,
        "bytes": nbytes,
        "tensors": tensors,
        "bytes_ratio": ratio(nbytes["full"], nbytes["adapter"]),
        "seconds": per_path,
        "sync_time_ratio": sync_ratio,
        "sync_time_ratio_per_repeat": [
            ratio(f["total_s"], a["total_s"]) for f, a in zip(runs["full"], runs["adapter"], strict=True)
        ],
        "probe_tokens": {path: [r["probe_tokens"] for r in values] for path, values in runs.items()},
        "goal_met": sync_ratio >= SYNC_GOAL,
    }


# --- report ----------------------------------------------------------------------------------------------


def cell(stats: dict[str, Any], scale: float = 1.0) -> str:
    s = Stats(**stats)
    return f"{fmt(s.median * scale)} ({fmt(s.min * scale)}..{fmt(s.max * scale)})"


PHASES = ("total_s", "gather_s", "publish_s", "load_s", "replica_transfer_s", "replica_load_s")
PHASES_NOTE = (
    "Total (time to serving) = gather (the learner's state dict: merged, tied head dropped, or the adapter "
    "alone) + publish (object store: manifest, sha256, fsync) + load (`UpdateWeights` round trip, until the "
    "replica serves the version); replica transfer (verify, materialize) and replica load are the replica's "
    "own split of that round trip. A greedy Generate after each load checked the version served (not timed)."
)
HEADERS = ("model", "path", "MB published", "total", "gather", "publish", "load (RPC)", "replica transfer",
           "replica load")  # fmt: skip


def render_markdown(payload: dict[str, Any]) -> str:
    setup = payload["setup"]
    rows = []
    for case in payload["sizes"]:
        for path in PATHS:
            seconds = case["seconds"][path]
            model = f"{case['size']} ({case['parameters'] / 1e6:.1f} M)"
            megabytes = f"{case['bytes'][path] / 1e6:.2f}"
            rows.append([model, path, megabytes, *(cell(seconds[phase], 1e3) for phase in PHASES)])
    headline = payload["sizes"][0]
    verdict = "met" if headline["goal_met"] else "**not met**"
    ratios = markdown_table(
        ["model", "sync_time_ratio (full / adapter)", "per repeat", "bytes_ratio", f">= {SYNC_GOAL:g}"],
        [
            [c["size"], f"**{fmt(c['sync_time_ratio'])}**",
             cell(Stats.of(c["sync_time_ratio_per_repeat"], "x").to_dict()), fmt(c["bytes_ratio"]),
             "yes" if c["goal_met"] else "no"]
            for c in payload["sizes"]
        ],
    )  # fmt: skip
    return "\n\n".join(
        [
            "## lora: a LoRA policy synced to a replica as its adapter vs as merged full weights",
            machine_line(payload["machine"]),
            f"Rank-{setup['rank']} LoRA (alpha {setup['alpha']}, non-zero) on every projection of a float32 "
            "model made locally; one vLLM replica on CPU (eager, `max_adapters=1`) serves both paths. "
            f"Milliseconds, median (min..max) of {payload['repeats']} repeats after one warm-up, the two "
            f"paths alternating. {PHASES_NOTE}",
            markdown_table(HEADERS, rows),
            ratios,
            f"Sync goal (issue 26): full / adapter time to serving >= {SYNC_GOAL:g} on `{headline['size']}`: "
            f"{verdict}.",
            f"Fleet (four LoRA runs on one replica vs one after another, goal >= {FLEET_GOAL:g}x samples/s): "
            f"{fleet_line(payload)}.",
            f"Command: `{payload['command']}`",
        ]
    )


def fleet_line(payload: dict[str, Any]) -> str:
    ratio = payload.get("fleet_ratio")
    if ratio is None:
        return str(payload["fleet_note"])
    met = "met" if payload.get("fleet_goal_met") else "**not met**"
    return f"**{fmt(ratio)}x** ({met}; {payload['fleet_note']})"


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    panels = []
    for case in payload["sizes"]:
        bars = [Bar(p, Stats(**case["seconds"][p]["total_s"])) for p in PATHS]
        panels.append((f"time to serving, {case['size']}", "seconds", bars))
    return bar_plot(path, panels, "lora: adapter vs merged full-weight sync")


# --- main ------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["bench"],
                        help="models to measure, a replica each (default: bench; quick: tiny)")  # fmt: skip
    return parser.parse_args(argv)


def fleet_figures(output_dir: Path) -> dict[str, Any]:
    """The fleet part's figures from `bench/lora_fleet.py`'s results in `output_dir`, when it ran there."""
    path = output_dir / "lora_fleet.json"
    if not path.exists():
        return {"fleet_ratio": None, "fleet_note": FLEET_NOTE}
    fleet = json.loads(path.read_text())
    return {
        "fleet_ratio": fleet["fleet_ratio"],
        "fleet_goal_met": fleet["goal_met"],
        "fleet_same_reward": fleet["same_reward"],
        "fleet_note": f"measured by `{fleet['command']}` (bench/results/lora_fleet.json)",
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    repeats = effective_repeats(args)
    setup = QUICK_SETUP if args.quick else FULL_SETUP
    sizes = ["tiny"] if args.quick else args.sizes
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as workdir:
        cases = [measure(size, setup, repeats, Path(workdir)) for size in sizes]
    command = " ".join(["python bench/lora.py", *(argv if argv is not None else sys.argv[1:])])
    payload = {
        "name": NAME,
        "machine": machine,
        "quick": args.quick,
        "repeats": repeats,
        "command": command,
        "setup": asdict(setup),
        "sync_goal": SYNC_GOAL,
        "sync_time_ratio": cases[0]["sync_time_ratio"],
        "bytes_ratio": cases[0]["bytes_ratio"],
        "goal_met": cases[0]["goal_met"],
        "fleet_goal": FLEET_GOAL,
        **fleet_figures(args.output_dir),
        "sizes": cases,
    }
    report_results(args.output_dir, NAME, payload, render_markdown(payload), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
