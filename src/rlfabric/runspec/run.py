"""`RunSpec`: a whole run file, its sections and the checks that span several of them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlfabric.environment.run_spec import RunEnvironmentSpec
from rlfabric.plan.resources import ResourcesSpec
from rlfabric.runspec.base import (
    RUN_NAME_PATTERN,
    PathKind,
    SpecModel,
)
from rlfabric.runspec.data import DatasetSpec
from rlfabric.runspec.generation import RewardSpec, RolloutSpec
from rlfabric.runspec.health import HealthSpec
from rlfabric.runspec.model import ModelSpec
from rlfabric.runspec.offline import (
    PreferenceSpec,
    RewardModelSpec,
    SFTSpec,
    WarmStartSpec,
)
from rlfabric.runspec.tracking import TrackingSpec
from rlfabric.runspec.training import (
    GROUP_ESTIMATORS,
    AlgorithmSpec,
    OptimSpec,
    TrainSpec,
    WeightsSpec,
)


class RunSpec(SpecModel):
    """A whole run: what to train, on what, with what reward and algorithm."""

    name: str | None = Field(default=None, pattern=RUN_NAME_PATTERN)
    """Run name; a unique id is generated when unset."""
    output_dir: str = "runs"
    """Folder (or fsspec URL) for checkpoints, weights, metrics.jsonl and TensorBoard events."""
    model: ModelSpec
    """The policy."""
    dataset: DatasetSpec
    """The prompts."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """Generation scheduling."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    """Scoring."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """Advantages and loss."""
    optim: OptimSpec = Field(default_factory=OptimSpec)
    """Optimiser."""
    train: TrainSpec = Field(default_factory=TrainSpec)
    """Learner schedule."""
    weights: WeightsSpec = Field(default_factory=WeightsSpec)
    """Weight publishing."""
    mode: Literal["online", "offline_preference", "sft", "reward_model"] = "online"
    """online: RL on scored groups from the rollout and reward services; offline_preference: DPO, IPO,
    KTO, ORPO or SimPO on a fixed dataset of preference pairs (KTO: also unpaired labelled rows); sft:
    supervised fine-tuning on conversations or prompt-completion rows; reward_model: a Bradley-Terry
    reward model on preference pairs. The offline modes need no rollout or reward service."""
    preference: PreferenceSpec = Field(default_factory=PreferenceSpec)
    """Offline preference loss and dataset columns (used when mode = "offline_preference")."""
    sft: SFTSpec = Field(default_factory=SFTSpec)
    """Supervised fine-tuning's dataset columns and tools (used when mode = "sft")."""
    reward_model: RewardModelSpec = Field(default_factory=RewardModelSpec)
    """Reward-model training's dataset columns and loss (used when mode = "reward_model")."""
    warm_start: WarmStartSpec | None = None
    """An SFT run `rlfabric up` runs before this online run, which then starts from its model."""
    health: HealthSpec = Field(default_factory=HealthSpec)
    """Run-health warning thresholds and automatic stops."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """Experiment trackers (Weights & Biases) the learner mirrors the run to."""
    environment: RunEnvironmentSpec | None = None
    """Multi-turn rollouts: each sample is a trajectory played against this environment (tools, a user
    environment class, or one written for TRL); None is single-turn (one prompt, one completion)."""
    resources: ResourcesSpec | None = None
    """The devices each role runs on (`rlfabric.plan.resources`); a run that declares them is refused by
    `POST /v1/runs` and `rlfabric up` when its memory plan does not fit (`rlfabric plan`). None: not
    planned, never refused for memory."""

    @model_validator(mode="after")
    def _groups_need_samples(self) -> RunSpec:
        n = self.rollout.sampling.n
        if self.algorithm.advantage in GROUP_ESTIMATORS and n < 2:
            raise ValueError(
                f"rollout.sampling.n must be >= 2 for the group estimator {self.algorithm.advantage!r}"
                f" (got {n})"
            )
        return self

    @model_validator(mode="after")
    def _lora_is_online(self) -> RunSpec:
        lora = self.model.lora
        if lora is not None and self.mode != "online":
            raise ValueError(f"model.lora: only an online run trains adapters (mode is {self.mode!r})")
        if self.model.published_adapter is not None and self.weights.transport == "broadcast":
            raise ValueError(
                "model.lora.publish: 'adapter' needs weights.transport = 'object_store' (adapters are not"
                " broadcast); use publish = 'merged' with broadcast"
            )
        return self

    @model_validator(mode="after")
    def _fleet_runs_publish_adapters(self) -> RunSpec:
        if self.rollout.fleet is not None and self.model.published_adapter is None:
            raise ValueError(
                "rollout.fleet: a run on a shared fleet must train a LoRA adapter and publish it alone"
                " (model.lora with publish = 'adapter'): full-weight versions would change the base every"
                " run on the fleet generates with"
            )
        return self

    @model_validator(mode="after")
    def _warm_start_is_online(self) -> RunSpec:
        if self.warm_start is not None and self.mode != "online":
            raise ValueError(f"warm_start: only an online run has a warm start (mode is {self.mode!r})")
        return self

    def warm_start_spec(self) -> RunSpec:
        """The SFT run of `warm_start`: this run's model, its dataset, sft, optim and train sections."""
        if self.warm_start is None:
            raise ValueError("the run has no warm_start")
        ws = self.warm_start
        sections = {"dataset": ws.dataset, "sft": ws.sft, "optim": ws.optim, "train": ws.train}
        return self.model_copy(update={**sections, "mode": "sft", "warm_start": None})

    def weights_root(self, run_id: str | None = None) -> str:
        """Where the run's learner publishes its versions and replicas load them: `weights.url`, else
        `<output_dir>/<run>/weights` (the run: `run_id`, else `name`)."""
        if self.weights.url:
            return self.weights.url
        return str(Path(self.output_dir) / (run_id or self.name or "") / "weights")

    def local_paths(self) -> dict[str, tuple[PathKind, str]]:
        """Every file or folder the spec names, by dotted field: the dataset ("data") and the models
        ("model"). A service that reads any of them from a spec it did not write confines them to its
        roots (`rlfabric.runtime.paths`)."""
        found: dict[str, tuple[PathKind, str]] = {"dataset.path": ("data", self.dataset.path)}
        if self.dataset.eval.path is not None:
            found["dataset.eval.path"] = ("data", self.dataset.eval.path)
        if self.warm_start is not None:
            warm = self.warm_start.dataset
            found["warm_start.dataset.path"] = ("data", warm.path)
            if warm.eval.path is not None:
                found["warm_start.dataset.eval.path"] = ("data", warm.eval.path)
        models = {"path": self.model.path, "reference_path": self.model.reference_path}
        models["critic_path"] = self.model.critic_path
        found.update({f"model.{name}": ("model", p) for name, p in models.items() if p is not None})
        return found
