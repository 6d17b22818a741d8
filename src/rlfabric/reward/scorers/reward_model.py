"""`reward_model`: a sequence-classification reward model, or an ensemble of them, from local checkpoints.

Each model is loaded on first use (torch and transformers are imported then, never when the registry is
imported) from a local directory only; the hub is never contacted. Each item becomes one text per model:
the chat template applied to the prompt messages plus the completion as the assistant turn when that
model's tokenizer has a template (`input_format="auto"`), else prompt text followed by the completion.
A model's score is the logit at `label_index`, computed in batches of `batch_size`.

One model (`path`): the reward is its (normalised) score; components: `raw`, the raw score.

An ensemble (`paths`, Coste et al. 2023, "Reward Model Ensembles Help Mitigate Overoptimization"): every
member scores every item, each member's score is normalised on its own (so that members trained apart,
whose Bradley-Terry offsets are arbitrary, are compared on one scale), then `ensemble` combines the
normalised scores s_1..s_M of an item:

- "mean": mean(s);
- "min": min(s) (worst-case optimisation);
- "mean_minus_std": mean(s) - ensemble_k * std(s), std over the members with divisor M (the
  uncertainty-penalised ensemble; Coste et al.'s UWO subtracts lambda * variance, this is its form in
  the reward's own units).

Components of an ensemble: `member0`..`member{M-1}` (each member's raw score), `mean` and `std` (of the
normalised member scores: what the ensemble combined).

Normalisation, per member:

- "none": the raw score;
- "running": Welford running moments over every raw score this scorer instance has seen (the current batch
  included, added before normalising it); (raw - mean) / std, with std taken as 1 until two scores have
  been seen. The moments live in the scorer instance, i.e. per reward-service worker process: with
  `workers > 1` each worker keeps its own (each sees a share of the same stream, so they converge to the
  same statistics); every Score call with this spec counts, a run's held-out evaluation included;
- "batch": (raw - mean) / std over the items of the current Score call (a run scores one group per
  call, so this standardises within the group), std with divisor n - 1. Small batches: a call of one item
  scores 0, and a call whose scores are all equal scores 0 everywhere (std is taken as 1 when it is not
  defined or is 0). The service scores such a spec's call in one piece (`whole_batch`), never split across
  worker processes. Absolute values mean nothing afterwards (a curve of the mean reward is flat at 0).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any, Literal

from pydantic import Field

from rlfabric.reward.scorers.base import InvalidScorerSpec, ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.registry import register

Ensemble = Literal["mean", "min", "mean_minus_std"]
Normalization = Literal["none", "running", "batch"]


class RewardModelParams(ScorerParams):
    path: str | None = None
    """Local directory holding the model and tokenizer (`save_pretrained` output); set it or `paths`."""
    paths: list[str] | None = Field(default=None, min_length=1)
    """Local directories of the ensemble's members (each a `save_pretrained` output); set it or `path`."""
    ensemble: Ensemble = "mean"
    """How an ensemble combines its members' normalised scores: mean, min, or mean - ensemble_k * std."""
    ensemble_k: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    """k of "mean_minus_std": how much the members' disagreement (their std) is subtracted."""
    device: str = "cpu"
    """torch device: "cpu", "cuda", "cuda:1"."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype."""
    batch_size: int = Field(default=8, gt=0)
    """Items per forward pass."""
    max_length: int = Field(default=2048, gt=0)
    """Token limit per item; longer inputs are truncated on the tokenizer's truncation side."""
    input_format: Literal["auto", "chat_template", "concat"] = "auto"
    """How prompt and completion become one text (see the module docstring)."""
    label_index: int = Field(default=0, ge=0)
    """Which output logit is the reward (0 for the usual single-label reward head)."""
    normalization: Normalization = "none"
    """Per model: "running" standardises with running mean/std over all scores seen (Welford); "batch"
    over the current Score call (a call of one item scores 0)."""


@dataclass
class RunningMoments:
    """Welford's online mean and variance."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    @property
    def std(self) -> float:
        """Sample standard deviation; 1.0 until it is defined and non-zero."""
        if self.count < 2 or self.m2 <= 0:
            return 1.0
        return math.sqrt(self.m2 / (self.count - 1))

    def standardize(self, value: float) -> float:
        return (value - self.mean) / self.std


def standardize_batch(values: Sequence[float]) -> list[float]:
    """(v - mean) / std over `values`, std with divisor n - 1, taken as 1 when undefined (n < 2) or 0."""
    if not values:
        return []
    mean = fmean(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    std = math.sqrt(var) if var > 0 else 1.0
    return [(v - mean) / std for v in values]


def member_std(values: Sequence[float]) -> float:
    """The spread of an item's member scores: standard deviation with divisor M (0 for one member)."""
    mean = fmean(values)
    return math.sqrt(fmean((v - mean) ** 2 for v in values))


def combine(values: Sequence[float], how: Ensemble, k: float) -> float:
    """An item's ensemble reward from its members' (normalised) scores."""
    if how == "min":
        return min(values)
    if how == "mean_minus_std":
        return fmean(values) - k * member_std(values)
    return fmean(values)


class Normalizer:
    """One member's normalisation: keeps its running moments across calls."""

    def __init__(self, kind: Normalization) -> None:
        self.kind = kind
        self.moments = RunningMoments()

    def __call__(self, raw: list[float]) -> list[float]:
        if self.kind == "batch":
            return standardize_batch(raw)
        if self.kind == "running":
            for r in raw:
                self.moments.update(r)
            return [self.moments.standardize(r) for r in raw]
        return list(raw)


def ensemble_results(
    raw: list[list[float]], normalizers: Sequence[Normalizer], how: Ensemble, k: float
) -> list[ScoreResult]:
    """The results of an ensemble: `raw[m][i]` is member m's raw score of item i."""
    normalized = [normalize(scores) for normalize, scores in zip(normalizers, raw, strict=True)]
    results = []
    for i in range(len(raw[0]) if raw else 0):
        members = [scores[i] for scores in normalized]
        components = {f"member{m}": scores[i] for m, scores in enumerate(raw)}
        components.update(mean=fmean(members), std=member_std(members))
        results.append(ScoreResult.ok(combine(members, how, k), components))
    return results


class Member:
    """One reward model: its directory, and once loaded its model and tokenizer."""

    def __init__(self, path: str, params: RewardModelParams) -> None:
        self.path, self.params = path, params
        self.model: Any = None
        self.tokenizer: Any = None
        self.use_template = False

    def load(self) -> None:
        if self.model is not None:
            return
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        p = self.params
        tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(
            self.path, local_files_only=True, dtype=getattr(torch, p.dtype)
        )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.model, self.tokenizer = model.to(p.device).eval(), tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_template = p.input_format == "chat_template" or (p.input_format == "auto" and has_template)

    def text(self, item: ScoreInput) -> str:
        if not self.use_template:
            return item.prompt_text + item.completion
        messages = (
            item.prompt if isinstance(item.prompt, list) else [{"role": "user", "content": item.prompt}]
        )
        conversation = [*messages, {"role": "assistant", "content": item.completion}]
        return str(self.tokenizer.apply_chat_template(conversation, tokenize=False))

    def scores(self, items: Sequence[ScoreInput]) -> list[float]:
        """The raw score of every item, in batches of `batch_size`."""
        self.load()
        texts = [self.text(item) for item in items]
        size = self.params.batch_size
        return [score for i in range(0, len(texts), size) for score in self.forward(texts[i : i + size])]

    def forward(self, texts: list[str]) -> list[float]:
        import torch

        encoded = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.params.max_length,
            add_special_tokens=not self.use_template,  # a chat template already adds them
            return_tensors="pt",
        ).to(self.params.device)
        with torch.inference_mode():
            logits = self.model(**encoded).logits  # (B, num_labels)
        return [float(x) for x in logits[:, self.params.label_index].float().cpu()]

    def unload(self) -> None:
        self.model = self.tokenizer = None


@register
class RewardModel(Scorer):
    name = "reward_model"
    version = "1"
    description = "Logit of a local sequence-classification reward model, or an ensemble of them."
    Params = RewardModelParams
    params: RewardModelParams

    def __init__(self, params: RewardModelParams) -> None:
        super().__init__(params)
        if (params.path is None) == (params.paths is None):
            raise InvalidScorerSpec("path", "set exactly one of path (one model) and paths (an ensemble)")
        paths = [params.path] if params.path is not None else list(params.paths or [])
        field = "path" if params.path is not None else "paths"
        for index, path in enumerate(paths):
            where = field if params.path is not None else f"{field}[{index}]"
            if not Path(path).is_dir():
                raise InvalidScorerSpec(where, f"not a local model directory: {path!r}")
        self._lock = threading.Lock()
        self.members = [Member(path, params) for path in paths]
        self.normalizers = [Normalizer(params.normalization) for _ in paths]

    @property
    def moments(self) -> RunningMoments:
        """The running moments of the (first) model."""
        return self.normalizers[0].moments

    @property
    def whole_batch(self) -> bool:
        return self.params.normalization == "batch"

    def score_batch(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        with self._lock:
            raw = [member.scores(items) for member in self.members]
            return self._results(raw)

    def _results(self, raw: list[list[float]]) -> list[ScoreResult]:
        """Results from each member's raw scores (`raw[m][i]`: member m, item i)."""
        p = self.params
        if p.paths is not None:
            return ensemble_results(raw, self.normalizers, p.ensemble, p.ensemble_k)
        rewards = self.normalizers[0](raw[0])
        return [ScoreResult.ok(reward, {"raw": r}) for reward, r in zip(rewards, raw[0], strict=True)]

    def close(self) -> None:
        with self._lock:
            for member in self.members:
                member.unload()
        if self.params.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
