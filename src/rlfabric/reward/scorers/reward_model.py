"""`reward_model`: a sequence-classification reward model from a local checkpoint (transformers).

The model is loaded on first use (torch and transformers are imported then, never when the registry
is imported) from a local directory only; the hub is never contacted. Each item becomes one text: the
chat template applied to the prompt messages plus the completion as the assistant turn when the
tokenizer has a template (`input_format="auto"`), else prompt text followed by the completion. The
reward is the logit at `label_index`, scored in batches of `batch_size`.

Normalisation "running" keeps Welford running moments over every raw score this scorer has seen (the
current batch included, added before normalising it) and returns (raw - mean) / std; until two scores
have been seen std is taken as 1. Components always carry the raw score.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rlfabric.reward.scorers.base import InvalidScorerSpec, ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.registry import register


class RewardModelParams(ScorerParams):
    path: str
    """Local directory holding the model and tokenizer (`save_pretrained` output)."""
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
    normalization: Literal["none", "running"] = "none"
    """"running": standardise with running mean/std over all scores seen (Welford)."""


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


@register
class RewardModel(Scorer):
    name = "reward_model"
    version = "1"
    description = "Logit of a local transformers sequence-classification reward model."
    Params = RewardModelParams
    params: RewardModelParams

    def __init__(self, params: RewardModelParams) -> None:
        super().__init__(params)
        if not Path(params.path).is_dir():
            raise InvalidScorerSpec("path", f"not a local model directory: {params.path!r}")
        self._lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None
        self._use_template = False
        self.moments = RunningMoments()

    def score_batch(self, items: Sequence[ScoreInput]) -> list[ScoreResult]:
        with self._lock:
            self._ensure_loaded()
            texts = [self._text(item) for item in items]
            size = self.params.batch_size
            raw = [score for i in range(0, len(texts), size) for score in self._forward(texts[i : i + size])]
            return self._results(raw)

    def _results(self, raw: list[float]) -> list[ScoreResult]:
        if self.params.normalization == "none":
            return [ScoreResult.ok(r, {"raw": r}) for r in raw]
        for r in raw:
            self.moments.update(r)
        return [ScoreResult.ok(self.moments.standardize(r), {"raw": r}) for r in raw]

    def _ensure_loaded(self) -> None:
        if self._model is not None:
            return
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        p = self.params
        tokenizer = AutoTokenizer.from_pretrained(p.path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(
            p.path, local_files_only=True, dtype=getattr(torch, p.dtype)
        )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self._model, self._tokenizer = model.to(p.device).eval(), tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self._use_template = p.input_format == "chat_template" or (p.input_format == "auto" and has_template)

    def _text(self, item: ScoreInput) -> str:
        if not self._use_template:
            return item.prompt_text + item.completion
        messages = (
            item.prompt if isinstance(item.prompt, list) else [{"role": "user", "content": item.prompt}]
        )
        conversation = [*messages, {"role": "assistant", "content": item.completion}]
        return str(self._tokenizer.apply_chat_template(conversation, tokenize=False))

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        encoded = self._tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.params.max_length,
            add_special_tokens=not self._use_template,  # a chat template already adds them
            return_tensors="pt",
        ).to(self.params.device)
        with torch.inference_mode():
            logits = self._model(**encoded).logits  # (B, num_labels)
        return [float(x) for x in logits[:, self.params.label_index].float().cpu()]

    def close(self) -> None:
        with self._lock:
            device = self.params.device
            self._model = self._tokenizer = None
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
