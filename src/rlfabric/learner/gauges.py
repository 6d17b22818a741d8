"""The learner's Prometheus gauges: one per quantity of a step's metrics row, each labelled `run_id`.

A row carries many numbers (metrics.jsonl and TensorBoard hold all of them); the gauges are the ones an
operator alerts on or graphs next to the other services, named by the Prometheus conventions (the unit in
the name, `_ratio` for a 0-1 share). A row key not in `GAUGES` is not exported, and a gauge whose key a
row lacks keeps its last value (e.g. `eval_reward_mean` between evaluations).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Gauge

_SPECS: dict[str, tuple[str, str]] = {
    # row key: (metric name, help)
    "step": ("rlfabric_learner_step", "Optimizer steps taken"),
    "policy_version": ("rlfabric_learner_policy_version", "Version of the policy the last step produced"),
    "loss": ("rlfabric_learner_loss", "Total loss of the last step"),
    "policy_loss": ("rlfabric_learner_policy_loss", "Policy-gradient loss of the last step"),
    "kl": ("rlfabric_learner_kl", "Mean per-token KL to the reference policy in the last step"),
    "entropy": ("rlfabric_learner_entropy", "Mean per-token policy entropy in the last step, nats"),
    "clip_fraction": ("rlfabric_learner_clip_ratio", "Share (0-1) of tokens whose ratio was clipped"),
    "reward_mean": ("rlfabric_learner_reward_mean", "Mean reward of the samples trained on in the last step"),
    "reward_std": ("rlfabric_learner_reward_std", "Standard deviation of those rewards"),
    "uniform_reward_groups_fraction": (
        "rlfabric_learner_uniform_reward_groups_ratio",
        "Share (0-1) of the last step's groups whose samples all got the same reward (no group signal)",
    ),
    "response_length_mean": (
        "rlfabric_learner_response_length_mean_tokens",
        "Mean completion length of the samples trained on in the last step, tokens",
    ),
    "tokens": ("rlfabric_learner_step_tokens", "Tokens trained on in the last step"),
    "samples": ("rlfabric_learner_step_samples", "Samples trained on in the last step"),
    "step_seconds": ("rlfabric_learner_step_duration_seconds", "Wall time of the last step"),
    "memory_peak_bytes": (
        "rlfabric_learner_memory_peak_bytes",
        "Peak memory of learner rank 0 so far: process RSS on CPU, allocated CUDA memory on a GPU",
    ),
    "tokens_per_s": ("rlfabric_learner_tokens_per_second", "Trained tokens per second in the last step"),
    "publish_seconds": (
        "rlfabric_learner_weight_publish_duration_seconds",
        "Wall time of the last weight publish (gather the full weights, write or broadcast them)",
    ),
    "staleness_mean": (
        "rlfabric_learner_staleness_mean_versions",
        "Mean policy lag of the groups trained on in the last step, versions",
    ),
    "groups_trained": ("rlfabric_learner_groups_trained", "Groups trained on in this lineage of the run"),
    "groups_dropped_stale": ("rlfabric_learner_groups_dropped_stale", "Groups dropped as too stale"),
    "eval_reward_mean": ("rlfabric_learner_eval_reward_mean", "Mean reward of the last held-out evaluation"),
}

GAUGES: dict[str, Gauge] = {key: Gauge(name, text, ["run_id"]) for key, (name, text) in _SPECS.items()}
"""Row key -> its gauge. Counts that a restart can roll back (`groups_trained`) are gauges, not counters."""


def export_row(run_id: str, row: Mapping[str, Any]) -> None:
    """Sets the gauge of each known quantity the row carries."""
    for key, gauge in GAUGES.items():
        value = row.get(key)
        if isinstance(value, int | float):
            gauge.labels(run_id).set(value)
