"""Predicted tokens/s of the learner and of a rollout replica, and the rollout : learner device ratio that
balances them (step 5 of `rlfabric.plan.planner`).

Both rates count completion tokens: those a replica generates, and those the learner trains on (its
step also reads the prompts, which costs it FLOPs but yields no completion token). Where the model is
the one bench/ measured (the `bench` preset of `rlfabric make-tiny-model`) on the same device kind, the
rate per device is the measured median; otherwise it is estimated and the source says how: the learner
from FLOPs per token at `COMPUTE_UTILISATION` of an assumed peak, a replica from memory bandwidth at
`BANDWIDTH_UTILISATION` (each decode step reads the weights and half the KV cache on average).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfabric.plan.arch import ModelArch
from rlfabric.plan.resources import DeviceKind

PEAKS: dict[str, tuple[float, float, str]] = {
    "cuda": (989e12, 3.35e12, "an H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s"),
    "cpu": (2e12, 0.2e12, "a server CPU: 2 TFLOP/s, 200 GB/s (nominal)"),
}
"""(peak FLOP/s, memory bandwidth in bytes/s, what they are) assumed per device kind."""
COMPUTE_UTILISATION = 0.4
"""Fraction of peak FLOP/s the learner is assumed to reach (model FLOPs utilisation)."""
BANDWIDTH_UTILISATION = 0.6
"""Fraction of memory bandwidth a decoding replica is assumed to reach."""
BENCH_RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"
"""The repository's measured benchmark results (absent from an installed wheel: estimates then)."""
BENCH_SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "intermediate_size": 1280,
}
"""The `bench` preset of `rlfabric make-tiny-model`, the model bench/results measured."""
MEASURED = {
    ("learner", "cpu"): ("learner_step.json", ("result", "tokens_per_s", "learner", "median")),
    ("learner", "cuda"): ("gpu/learner_step.json", ("result", "tokens_per_s", "learner", "median")),
    ("rollout", "cpu"): (
        "rollout_service.json",
        ("result", "throughput", "service", "tokens_per_s", "median"),
    ),
}
"""(role, device kind): the benchmark file and the key path of its measured completion tokens/s."""


@dataclass(frozen=True)
class Throughput:
    """Predicted completion tokens/s of one role over all its devices, and where the figure comes from."""

    role: str
    devices: int
    tokens_per_s: float
    source: str


@dataclass(frozen=True)
class Workload:
    """What the estimates need of a plan."""

    policy: ModelArch
    learner_flops_per_token: float
    """Training FLOPs per sequence token (`planner.learner_flops_per_token`)."""
    prompt_tokens: int
    completion_tokens: int
    concurrency: int
    """Sequences a replica decodes at once."""
    replica_weights: int
    """Bytes of one replica's weights."""
    replica_kv: int
    """Bytes of one replica's full KV cache."""


def measured(role: str, kind: str, arch: ModelArch, results: Path) -> tuple[float, str] | None:
    """Completion tokens/s per device measured for this role on this kind, when the model is the measured
    one; None otherwise."""
    entry = MEASURED.get((role, kind))
    if entry is None or any(getattr(arch, k) != v for k, v in BENCH_SHAPE.items()):
        return None
    file = results / entry[0]
    if not file.exists():
        return None
    value: Any = json.loads(file.read_text())
    for key in entry[1]:
        value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, int | float):
        return None
    return float(value), f"measured: bench/results/{entry[0]} (median, the bench model on {kind})"


def learner_rate(work: Workload, kind: DeviceKind) -> tuple[float, str]:
    """Estimated completion tokens/s of one learner device from FLOPs."""
    peak, _, what = PEAKS[kind]
    sequence = work.prompt_tokens + work.completion_tokens
    rate = COMPUTE_UTILISATION * peak / work.learner_flops_per_token * work.completion_tokens / sequence
    flops = f"{work.learner_flops_per_token:.3g} FLOP per sequence token"
    return rate, f"FLOP-based: {COMPUTE_UTILISATION:.0%} of {what}, {flops}"


def decode_rate(work: Workload, kind: DeviceKind) -> tuple[float, str]:
    """Estimated tokens/s of one replica: a decode step reads the weights and the KV cache (half full on
    average) and yields one token per sequence; bounded by compute (2 P FLOPs per token)."""
    flops, bandwidth, what = PEAKS[kind]
    step_s = (work.replica_weights + work.replica_kv / 2) / (BANDWIDTH_UTILISATION * bandwidth)
    rate = min(work.concurrency / step_s, COMPUTE_UTILISATION * flops / (2 * work.policy.params()))
    batch = f"{work.concurrency} sequences per decode step"
    return rate, f"bandwidth-based: {batch}, {BANDWIDTH_UTILISATION:.0%} of {what}"


def estimate(
    work: Workload,
    learner: tuple[DeviceKind, int],
    rollout: tuple[DeviceKind, int],
    results: Path = BENCH_RESULTS,
) -> tuple[tuple[Throughput, ...], float | None]:
    """(learner, rollout) rates over their (kind, devices), and the rollout devices per learner device
    that make the replicas generate completions as fast as the learner trains on them."""
    per_l = measured("learner", learner[0], work.policy, results) or learner_rate(work, learner[0])
    per_r = measured("rollout", rollout[0], work.policy, results) or decode_rate(work, rollout[0])
    rows = (
        Throughput("learner", learner[1], per_l[0] * learner[1], per_l[1]),
        Throughput("rollout", rollout[1], per_r[0] * rollout[1], per_r[1]),
    )
    return rows, (per_l[0] / per_r[0] if per_r[0] > 0 else None)
