"""Where a learner run writes on disk, and the per-step exports besides Redis.

Both the online loop and the offline preference run write here, from rank 0 only:

    <output_dir>/<run_id>/checkpoints/     resumable checkpoints (`checkpoint.py`)
    <output_dir>/<run_id>/metrics.jsonl    one JSON row per step (and restart markers)
    <output_dir>/<run_id>/tensorboard/     TensorBoard event files (online loop)
    weights.url or <run dir>/weights       the published weights (`rlfabric.weights.versions`)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.gauges import export_row


@dataclass
class RunPaths:
    """Where a run's learner writes: checkpoints, published weights, metrics."""

    run_dir: Path
    weights_root: str

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @classmethod
    def of(cls, config: LearnerServiceConfig) -> RunPaths:
        run_dir = Path(config.run.output_dir) / config.run_id
        return cls(run_dir, config.run.weights_root(config.run_id))


def write_metrics(path: Path, row: dict[str, Any]) -> None:
    """Append one row to metrics.jsonl."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


class StepExport:
    """Rank 0's per-step exports besides metrics.jsonl: TensorBoard event files under the run directory
    (every number of the row) and the Prometheus gauges (`rlfabric.learner.gauges`)."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.run_id = run_id

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for name, value in row.items():
            if isinstance(value, int | float) and name not in ("step", "time"):
                self.writer.add_scalar(name, value, step)
        export_row(self.run_id, row)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
