"""The PPO critic: the policy's transformer backbone with a scalar value head, trained on GAE returns.

Values live in the target layout of `batch.MicroBatch`: the value at position t is the critic's estimate
of the return from the state "input tokens 0..t", i.e. just before token t+1 is sampled, the same
position that holds token t+1's log-prob and advantage. So the critic's output per input position is
already aligned with the targets; no shift is needed.

The critic has its own AdamW, backward and gradient clipping: its loss shares no parameter with the
policy's, so stepping both separately is the same as one joint step, and neither gradient norm clips the
other. Its value loss is aggregated and re-weighted exactly like the policy loss (same aggregation, same
global normaliser), so gradient accumulation over micro-batches and ranks is exact for it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlfabric.learner.algorithms import masked_sum, value_loss
from rlfabric.learner.batch import MicroBatch, attached
from rlfabric.learner.checkpoint import TrainObjects
from rlfabric.learner.dist import shard_model
from rlfabric.learner.parts import compile_elementwise_blocks


class ValueModel(nn.Module):
    """A transformer backbone (no LM head) and a linear value head: token ids (B, T) → values (B, T)."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # Small initial values (OpenRLHF's init): the first advantages are then close to the plain returns.
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)
        # Decoder-layer class names, which `dist.shard_model` shards one by one (as on a transformers model).
        self._no_split_modules = list(getattr(backbone, "_no_split_modules", None) or ())

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Values (B, T) in float32 for `input_ids`, `attention_mask` (B, T)."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        # Summing away the size-1 dim gives a fresh tensor: FSDP warns on a view as a root output.
        return self.value_head(out.last_hidden_state).float().sum(-1)


def load_value_model(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    checkpointing: bool,
    compile_blocks: bool = False,
) -> ValueModel:
    """The backbone of the causal LM at `path` plus a fresh value head, fp32 master weights on `device`,
    sharded with FSDP2 like the policy (and, with `compile_blocks`, its element-wise blocks compiled)."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(str(path), dtype=torch.float32)
    backbone.config.use_cache = False
    if checkpointing:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = ValueModel(backbone, int(backbone.config.hidden_size))
    model.train(True)
    model.to(device)
    shard_model(model, dtype)
    if compile_blocks:
        compile_elementwise_blocks(model)
    return model


@dataclass(frozen=True)
class ValueLossConfig:
    """The knobs of the critic's loss."""

    coef: float
    """Weight of the value loss (scales the critic's gradient before clipping)."""
    clip_eps: float | None
    """Value clipping range around the old values; None disables it."""
    aggregation: str
    """Reduction of per-token losses (the policy loss's)."""
    max_tokens: int | None
    """Normaliser of the `constant` aggregation."""


class Critic:
    """The value model, its optimiser and schedule. Micro-batches carry `old_values` and `returns` (B, T),
    attached by the trainer's frozen pass and advantage phase."""

    def __init__(
        self, model: ValueModel, optimizer: Optimizer, scheduler: LRScheduler, config: ValueLossConfig
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.config = model, optimizer, scheduler, config

    @torch.no_grad()
    def values(self, mb: MicroBatch) -> Tensor:
        """The critic's values for `mb`, without gradient: (B, T)."""
        return self.model(mb.input_ids, mb.attention_mask)

    def backward(self, mb: MicroBatch, mask: Tensor, weight: float, world_size: int) -> dict[str, Tensor]:
        """Value loss of one micro-batch over `mask` (B, T), weighted into the step's aggregate (`weight`
        is `local_count / global_count`), backpropagated. Returns this micro-batch's summed statistics.

        Every rank runs as many of these as its peers (FSDP collectives), empty micro-batches included
        (weight 0)."""
        cfg = self.config
        values = self.model(mb.input_ids, mb.attention_mask)
        returns = attached(mb.returns)
        loss, stats = value_loss(
            values, attached(mb.old_values), returns, mask, cfg.clip_eps, cfg.aggregation, cfg.max_tokens
        )
        (loss * (cfg.coef * weight * world_size)).backward()
        values, tokens = values.detach(), mask.sum()
        return {
            "value_loss": loss.detach() * weight,
            "value_clip_fraction": stats["value_clip_fraction"] * tokens,
            "value_sum": masked_sum(values, mask),
            "return_sum": masked_sum(returns, mask),
            "return_sq": masked_sum(returns**2, mask),
            "value_error_sum": masked_sum(returns - values, mask),
            "value_error_sq": masked_sum((returns - values) ** 2, mask),
        }

    def train_objects(self) -> TrainObjects:
        """What a checkpoint saves of the critic."""
        return TrainObjects(self.model, self.optimizer, self.scheduler)


def critic_metrics(total: dict[str, float]) -> dict[str, float]:
    """Step metrics of the critic from the globally summed statistics of `Critic.backward` (and
    `tokens`, the loss-mask count). Explained variance is `1 - Var(R - V) / Var(R)` over the tokens:
    1 is a perfect critic, 0 one no better than a constant."""
    tokens = max(total["tokens"], 1.0)
    return_mean = total["return_sum"] / tokens
    return_var = total["return_sq"] / tokens - return_mean**2
    error_var = total["value_error_sq"] / tokens - (total["value_error_sum"] / tokens) ** 2
    return {
        "value_loss": total["value_loss"],
        "value_clip_fraction": total["value_clip_fraction"] / tokens,
        "value_mean": total["value_sum"] / tokens,
        "return_mean": return_mean,
        "explained_variance": 1.0 - error_var / return_var if return_var > 1e-12 else 0.0,
    }
