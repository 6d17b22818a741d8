"""Scored groups as the learner receives them, and the padded tensors it trains on.

Two layouts, and the alignment between them:
- the *completion layout* `(N, Tc)` of a whole step (`StepBatch`): row i holds sample i's completion
  tokens from column 0; N counts every sample of the step, groups as consecutive rows (rows
  `g*n .. g*n+n-1` are group g), as the advantage estimators expect;
- the *target layout* `(B, T)` of a micro-batch (`MicroBatch`): row b is prompt + completion, right-padded
  to the micro-batch's longest sequence. Every per-token tensor is aligned with the *targets*: position t
  holds the quantity of token `input_ids[b, t+1]`, which the logits at position t predict. The last
  position has no target and is always masked out.
Completion token j of a sample with prompt length P sits at input position P + j, so its per-token values
sit at target position P - 1 + j (`MicroBatch.completion_start` = P - 1).

Multi-turn samples (`Rollout.loss_mask`): every completion token is in `input_ids` (environment and tool
tokens are context the policy conditions on), but the masks, `StepBatch.completion_mask` and
`MicroBatch.loss_mask`, are 1 on the policy's tokens only. Everything trained or averaged goes through
them (policy loss, rollout correction, KL in the loss and in the reward, entropy, the value loss, the
aggregations' normalisers, the advantage estimators), so an environment token is never in a loss. A
single-turn sample's masks are its completion, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from rlfabric.learner.packing import PackedInputs, pack
from rlfabric.learner.samples import GroupSamples as GroupSamples
from rlfabric.learner.samples import Rollout as Rollout

TRUNCATED = "length"
"""The finish reason of a completion cut at max_tokens."""


@dataclass
class StepBatch:
    """The completion layout of a step's samples, for advantages. N samples, groups as consecutive rows."""

    rewards: Tensor
    """(N,) float32 sequence rewards."""
    completion_mask: Tensor
    """(N, Tc) float32: 1 on the completions' policy tokens (every completion token when single-turn), 0 on
    environment tokens and padding; Tc is the longest completion."""
    lengths: Tensor
    """(N,) int64 completion lengths."""
    truncated: Tensor
    """(N,) bool: the engine stopped at max_tokens."""
    group_size: int
    """Samples per group (uniform over the step)."""
    last_token: Tensor
    """(N,) int64: column of each completion's last policy token (where the final reward goes); -1 when it
    has none."""
    turn_rewards: Tensor
    """(N, Tc) float32: the turns' rewards on their policy tokens (`Rollout.reward_positions`), 0 elsewhere;
    all 0 for single-turn samples."""

    @classmethod
    def from_groups(cls, groups: Sequence[GroupSamples]) -> StepBatch:
        """Stack `groups` (each with the same number of samples) in order."""
        sizes = {len(g.rollouts) for g in groups}
        if len(sizes) > 1:
            raise ValueError(f"groups of different sizes in one step: {sorted(sizes)}")
        samples = [r for g in groups for r in g.rollouts]
        lengths = torch.tensor([len(r.token_ids) for r in samples], dtype=torch.int64)
        width = int(lengths.max()) if len(samples) else 0
        return cls(
            rewards=torch.tensor([r.reward for r in samples], dtype=torch.float32),
            completion_mask=_padded([r.model_mask() for r in samples], width),
            lengths=lengths,
            truncated=torch.tensor([r.finish_reason == TRUNCATED for r in samples], dtype=torch.bool),
            group_size=sizes.pop() if sizes else 1,
            last_token=torch.tensor([r.last_model_token() for r in samples], dtype=torch.int64),
            turn_rewards=_turn_rewards(samples, width),
        )

    def outcome_token_rewards(self, rewards: Tensor) -> Tensor:
        """Put each sequence reward (N,) on its completion's last policy token: (N, Tc), 0 elsewhere."""
        token_rewards = torch.zeros_like(self.completion_mask)
        rows = torch.nonzero(self.last_token >= 0).squeeze(-1)
        token_rewards[rows, self.last_token[rows]] = rewards[rows].to(token_rewards.dtype)
        return token_rewards

    def token_rewards(self, rewards: Tensor) -> Tensor:
        """The final rewards (N,) on the last policy tokens plus the turns' rewards: (N, Tc)."""
        return self.outcome_token_rewards(rewards) + self.turn_rewards


def _padded(rows: Sequence[Sequence[int]], width: int) -> Tensor:
    """0/1 rows right-padded with 0 to `width`: (N, width) float32."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def _turn_rewards(samples: Sequence[Rollout], width: int) -> Tensor:
    """Each sample's turn rewards on their policy tokens (`Rollout.reward_positions`): (N, width)."""
    out = torch.zeros((len(samples), width), dtype=torch.float32)
    for i, rollout in enumerate(samples):
        for position, reward in rollout.reward_positions():
            out[i, position] += reward
    return out


@dataclass
class MicroBatch:
    """One forward/backward's sequences in the target layout (see the module docstring)."""

    input_ids: Tensor
    """(B, T) int64 prompt + completion, right-padded with the pad id."""
    attention_mask: Tensor
    """(B, T) int64: 1 on real tokens."""
    loss_mask: Tensor
    """(B, T) float32: 1 at position t when token t+1 is a completion token the policy sampled (not an
    environment token)."""
    rollout_logprobs: Tensor
    """(B, T) float32: the engine's log-prob of token t+1 at position t; 0 off the loss mask."""
    rewards: Tensor
    """(B,) float32 sequence rewards."""
    group_index: Tensor
    """(B,) int64: index of the row's group among the step's groups."""
    sample_index: Tensor
    """(B,) int64: the row's index in the step (its row in `StepBatch`)."""
    completion_start: Tensor
    """(B,) int64: target position of the first completion token (prompt length - 1)."""
    # Attached by the trainer's phases (None until then; `attached` reads them), all (B, T) float32 in
    # the target layout, on the micro-batch's device:
    train_mask: Tensor | None = None
    """The loss mask without the completions the run masks out (truncated ones); phase 1."""
    ref_logp: Tensor | None = None
    """The frozen reference's log-prob of each target (only with a reference); phase 2."""
    old_logp: Tensor | None = None
    """The pre-update policy's log-prob of each target (only when needed); phase 2."""
    old_values: Tensor | None = None
    """The critic's pre-update values (only with a critic); phase 2."""
    advantages: Tensor | None = None
    """Per-token advantages, 0 off the completions; phase 3."""
    returns: Tensor | None = None
    """The critic's targets (with a critic, or zeros when the step has no samples); phase 3."""
    packed: PackedInputs | None = None
    """The same tokens packed into one row, each group's prompt once (`rlfabric.learner.packing`), when
    the micro-batch was built with `packed`; the policy's forward then runs on it."""

    @property
    def num_tokens(self) -> int:
        """Policy tokens in the loss mask."""
        return int(self.loss_mask.sum())

    def targets(self, pad_id: int) -> Tensor:
        """The token each position predicts: `input_ids` shifted left by one, pad at the end. (B, T)."""
        shifted = torch.full_like(self.input_ids, pad_id)
        shifted[:, :-1] = self.input_ids[:, 1:]
        return shifted

    def to(self, device: torch.device) -> MicroBatch:
        """A copy with every tensor on `device`."""
        moved: dict[str, Any] = {f.name: _moved(getattr(self, f.name), device) for f in fields(self)}
        return replace(self, **moved)

    def completion_positions(self, width: int) -> Tensor:
        """Target position of completion column j for each row, clamped into the row: (B, width)."""
        positions = self.completion_start.unsqueeze(-1) + torch.arange(width, device=self.input_ids.device)
        return positions.clamp(max=self.input_ids.shape[1] - 1)

    def from_completion_layout(self, values: Tensor, completion_mask: Tensor) -> Tensor:
        """Scatter this micro-batch's rows of a step tensor (N, Tc) into the target layout (B, T).

        `completion_mask` (N, Tc) zeroes the padding columns, so clamped positions receive only zeros.
        """
        rows = self.sample_index.to(values.device)
        masked = (values[rows] * completion_mask[rows]).to(torch.float32)
        out = torch.zeros(self.input_ids.shape, dtype=torch.float32, device=values.device)
        return out.scatter_add_(1, self.completion_positions(values.shape[1]).to(values.device), masked)

    def to_completion_layout(self, values: Tensor, width: int) -> Tensor:
        """Read a target-layout tensor (B, T) back into completion columns (B, width); padding is 0."""
        gathered = values.gather(1, self.completion_positions(width).to(values.device))
        lengths = self.completion_lengths().unsqueeze(-1)
        return gathered * (torch.arange(width, device=values.device) < lengths).to(gathered.dtype)

    def completion_lengths(self) -> Tensor:
        """Each row's completion length, environment tokens included: (B,) int64."""
        return self.attention_mask.sum(-1) - self.completion_start - 1


def _moved(value: Any, device: torch.device) -> Any:
    return None if value is None else value.to(device)


def attached(value: Tensor | None) -> Tensor:
    """A tensor a trainer phase attached to a micro-batch (`MicroBatch.train_mask`, ...); raises when the
    phase has not run, a bug in the caller's phase order."""
    if value is None:
        raise ValueError("a micro-batch tensor was read before the trainer phase that attaches it")
    return value


@dataclass
class _Row:
    """One sample, flattened out of its group."""

    prompt: list[int]
    rollout: Rollout
    group_index: int
    sample_index: int


def _flatten(groups: Sequence[GroupSamples]) -> list[_Row]:
    """Every sample of the step in order, with its group and step index."""
    rows = [(g_idx, g.prompt_token_ids, r) for g_idx, g in enumerate(groups) for r in g.rollouts]
    return [_Row(p, r, g_idx, i) for i, (g_idx, p, r) in enumerate(rows)]


def _collate(rows: Sequence[_Row], pad_id: int, packed: bool = False) -> MicroBatch:
    """Right-pad `rows` to their longest prompt + completion and align per-token values with targets;
    with `packed`, pack them too (`MicroBatch.packed`)."""
    width = max(len(r.prompt) + len(r.rollout.token_ids) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.int64)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    rollout_logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, row in enumerate(rows):
        p, c = len(row.prompt), len(row.rollout.token_ids)
        input_ids[b, : p + c] = torch.tensor(row.prompt + row.rollout.token_ids, dtype=torch.int64)
        attention_mask[b, : p + c] = 1
        model = torch.tensor(row.rollout.model_mask(), dtype=torch.float32)
        loss_mask[b, p - 1 : p - 1 + c] = model
        logprobs = torch.tensor(row.rollout.logprobs, dtype=torch.float32)
        rollout_logprobs[b, p - 1 : p - 1 + c] = torch.where(model > 0, logprobs, 0.0)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        rollout_logprobs=rollout_logprobs,
        rewards=torch.tensor([r.rollout.reward for r in rows], dtype=torch.float32),
        group_index=torch.tensor([r.group_index for r in rows], dtype=torch.int64),
        sample_index=torch.tensor([r.sample_index for r in rows], dtype=torch.int64),
        completion_start=torch.tensor([len(r.prompt) - 1 for r in rows], dtype=torch.int64),
        packed=pack([(r.prompt, r.rollout.token_ids, r.group_index) for r in rows], width, pad_id)
        if packed
        else None,
    )


def build_micro_batches(
    groups: Sequence[GroupSamples],
    micro_batch_size: int,
    pad_id: int,
    *,
    by_length: bool = False,
    packed: bool = False,
) -> list[MicroBatch]:
    """Cut the step's samples into micro-batches of `micro_batch_size` sequences: in step order, or with
    `by_length` shortest first (stable), so that each micro-batch holds sequences of similar length.
    With `packed` (in step order: a group's samples stay together, so its prompt is packed once per
    micro-batch) each micro-batch carries its packed row too (`MicroBatch.packed`).

    Each micro-batch is padded to its own longest sequence. Sampled completions vary widely in length
    (some stop after a few tokens, some run to max_tokens), so in step order most micro-batches pad every
    row to the step's longest and the forward and backward passes compute mostly padding; sorted, the
    padding all but vanishes. Rows carry their step index (`sample_index`), so nothing downstream
    depends on the order. Micro-batches may split a group: advantages are computed per group over the
    whole step (`StepBatch`) before this.
    """
    if micro_batch_size < 1:
        raise ValueError("micro_batch_size must be >= 1")
    rows = _flatten(groups)
    if by_length and not packed:
        rows.sort(key=lambda r: len(r.prompt) + len(r.rollout.token_ids))
    return [
        _collate(rows[i : i + micro_batch_size], pad_id, packed)
        for i in range(0, len(rows), micro_batch_size)
    ]


def empty_micro_batch(pad_id: int, packed: bool = False) -> MicroBatch:
    """A one-row micro-batch with nothing to learn from, for a rank with fewer micro-batches than its
    peers: FSDP needs every rank to run the same number of forward/backward passes."""
    row = _Row([pad_id], Rollout([], [], 0.0), group_index=-1, sample_index=-1)
    mb = _collate([row], pad_id, packed)
    mb.attention_mask[:] = 1
    return mb


def shard_groups(groups: Sequence[GroupSamples], rank: int, world_size: int) -> list[GroupSamples]:
    """This rank's groups of the step: round-robin by position, the same split on every rank."""
    return list(groups[rank::world_size])
