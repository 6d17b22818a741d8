"""Packed micro-batches with each group's prompt computed once (`train.packing`).

The samples of a group share their prompt, and in RL post-training the prompt is often most of a sample's
tokens (a system prompt, a question, a few-shot preamble; the completions are short). The padded layout
(`MicroBatch.input_ids`, B x T) computes every row's prompt again and pads every row to the longest. The
packed layout puts a micro-batch's tokens in one row instead, each token once:

    [prefix of group g] [segment of sample 1] [segment of sample 2] ... [prefix of group h] [segment ...]

A group's *prefix* is its prompt without the last token; a sample's *segment* is that last prompt token and
the sample's completion (so the segment's first position predicts the first completion token, and a row
whose prompt is one token has an empty prefix). Positions restart for each segment where its prefix ends,
so rotary embeddings see exactly the positions of the padded layout, and `packed_attention` lets each
segment attend to its group's prefix and causally to itself, and a prefix causally to itself: the same
attention as the padded layout's rows, with no padding and no prompt repeated. The LM head runs on the
segments only (transformers' `logits_to_keep` with the segments' indices).

It is one forward call per micro-batch (FSDP's collectives and activation checkpointing's recomputation
see an ordinary forward), the attention function reading the layout from a keyword argument that
transformers passes down to every attention layer. Models with sliding-window or bidirectional layers
are not packed (`packing_supported`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

PACKED_ATTENTION = "rlfabric_packed"
"""The attention implementation the learner's packed models are loaded with (`register_packed_attention`)."""

LAYOUT_KWARG = "packed_layout"
"""The forward keyword that carries a `PackedLayout` down to `packed_attention`."""


@dataclass(frozen=True)
class Piece:
    """A run of packed positions `[start, start + length)` that attends causally to itself and fully to
    the prefix `[prefix_start, prefix_start + prefix_length)` (`prefix_length` 0: to nothing else)."""

    start: int
    length: int
    prefix_start: int = 0
    prefix_length: int = 0


@dataclass
class PackedLayout:
    """Where each piece of a packed row lies; passed to every attention layer of one forward. The pieces
    tile the row in order."""

    pieces: tuple[Piece, ...]
    _masks: dict[tuple[int, int, torch.dtype, torch.device], Tensor] = field(default_factory=dict, repr=False)
    _index: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def lengths(self) -> list[int]:
        return [piece.length for piece in self.pieces]

    def index_of(self, start: int) -> int:
        """Index of the piece that starts at packed position `start`."""
        if not self._index:
            self._index.update({piece.start: i for i, piece in enumerate(self.pieces)})
        return self._index[start]

    def mask(self, piece: Piece, dtype: torch.dtype, device: torch.device) -> Tensor:
        """(1, 1, length, prefix_length + length) additive mask in `dtype`: 0 on the prefix and causally
        within the piece, -inf elsewhere (built once per shape, dtype and device, shared by the layers;
        a boolean mask would be converted on every call)."""
        key = (piece.length, piece.prefix_length, dtype, device)
        if key not in self._masks:
            n, p = piece.length, piece.prefix_length
            allowed = torch.ones(n, p + n, dtype=torch.bool, device=device).tril(diagonal=p)
            blocked = torch.full(allowed.shape, float("-inf"), dtype=dtype, device=device)
            self._masks[key] = torch.where(allowed, 0.0, blocked)[None, None]
        return self._masks[key]


@dataclass
class PackedInputs:
    """A micro-batch's tokens packed into one row, and how its log-probs map back to the target layout."""

    input_ids: Tensor
    """(1, L) int64: each group's prefix once, then its samples' segments."""
    position_ids: Tensor
    """(1, L) int64: each token's position in its own sample (as in the padded layout)."""
    keep: Tensor
    """(S,) int64: packed indices of the segments' tokens, the positions whose logits are computed."""
    targets: Tensor
    """(1, S) int64: the token each kept position predicts (pad after a segment's last token)."""
    destination: Tensor
    """(S,) int64: flat index `b * T + t` in the micro-batch's target layout (B, T) of each kept position."""
    layout: PackedLayout

    @property
    def num_tokens(self) -> int:
        """Tokens one forward computes."""
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> PackedInputs:
        return PackedInputs(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            keep=self.keep.to(device),
            targets=self.targets.to(device),
            destination=self.destination.to(device),
            layout=self.layout,
        )

    def to_target_layout(self, values: Tensor, shape: torch.Size) -> Tensor:
        """Kept positions' values (1, S) into the target layout `shape` (B, T); 0 elsewhere (prefixes and
        padding, never in a loss mask). Differentiable."""
        flat = values.new_zeros(shape.numel()).index_copy(0, self.destination, values.reshape(-1))
        return flat.view(shape)


def packed_logits(model: nn.Module, packed: PackedInputs) -> Tensor:
    """`model`'s logits (1, S, V) at the kept positions of a packed row, through one forward of a model
    loaded for packing (`parts.load_model(packed=True)`)."""
    return model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        use_cache=False,
        logits_to_keep=packed.keep,
        **{LAYOUT_KWARG: packed.layout},
    ).logits


def pack(rows: Sequence[tuple[Sequence[int], Sequence[int], int]], width: int, pad_id: int) -> PackedInputs:
    """Pack rows of `(prompt, completion, group)` (consecutive rows of one group share its prompt) whose
    padded layout is `(len(rows), width)`. A row whose prompt differs from its group's first (never, for
    samples of one group) gets its own prefix."""
    ids: list[int] = []
    positions: list[int] = []
    keep: list[int] = []
    targets: list[int] = []
    destination: list[int] = []
    pieces: list[Piece] = []
    prefix: tuple[int, int, int, Sequence[int]] | None = None  # group, start, length, prompt
    for b, (prompt, completion, group) in enumerate(rows):
        if prefix is None or prefix[0] != group or list(prefix[3]) != list(prompt):
            start, length = len(ids), len(prompt) - 1
            if length > 0:
                pieces.append(Piece(start, length))
                ids.extend(prompt[:-1])
                positions.extend(range(length))
            prefix = (group, start, length, prompt)
        _, p_start, p_length, _ = prefix
        segment = [*prompt[-1:], *completion]
        start = len(ids)
        pieces.append(Piece(start, len(segment), p_start, p_length))
        ids.extend(segment)
        positions.extend(range(p_length, p_length + len(segment)))
        keep.extend(range(start, start + len(segment)))
        targets.extend([*segment[1:], pad_id])
        destination.extend(b * width + p_length + j for j in range(len(segment)))
    return PackedInputs(
        input_ids=torch.tensor([ids], dtype=torch.int64),
        position_ids=torch.tensor([positions], dtype=torch.int64),
        keep=torch.tensor(keep, dtype=torch.int64),
        targets=torch.tensor([targets], dtype=torch.int64),
        destination=torch.tensor(destination, dtype=torch.int64),
        layout=PackedLayout(tuple(pieces)),
    )


def packing_supported(config: Any) -> bool:
    """Whether a model config's attention is causal over the whole sequence in every layer (what
    `packed_attention` computes): no sliding windows, no bidirectional or chunked layers."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(kind != "full_attention" for kind in layer_types):
        return False
    return not (getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))


def register_packed_attention() -> None:
    """Registers `packed_attention` with transformers under PACKED_ATTENTION (idempotent). The name has no
    mask function, so transformers builds no (L, L) mask for it: the pieces are the mask."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def packed_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, None]:
    """Attention over a packed row (`PackedLayout` in `kwargs[LAYOUT_KWARG]`), or plain causal attention
    (right padding only) without one. Query (1, heads, L, head_dim), key and value (1, kv_heads, L,
    head_dim); returns (1, L, heads, head_dim) like transformers' attention functions.

    On CPU in a reduced dtype with gradients on, each piece is computed in float32 (as
    `parts.sdpa_in_float32`, and for the same reason: the bfloat16 flash-attention backward is the slow
    one there)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout: PackedLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if kwargs.get("sliding_window"):
        raise ValueError("packed attention computes full causal attention; this layer has a sliding window")
    dtype = query.dtype
    if query.device.type == "cpu" and dtype != torch.float32 and torch.is_grad_enabled():
        query, key, value = query.float(), key.float(), value.float()
    if layout is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out.to(dtype), None
    # One split per tensor, not a slice per piece: a slice's backward writes a zero tensor of the whole
    # row, so slicing cost (pieces x row) in the backward; a split's backward is one concatenation.
    queries, keys, values = (t.split(layout.lengths, dim=2) for t in (query, key, value))
    outputs = []
    for i, piece in enumerate(layout.pieces):
        if piece.prefix_length == 0:
            out, _ = sdpa_attention_forward(module, queries[i], keys[i], values[i], None, **kwargs)
        else:
            j = layout.index_of(piece.prefix_start)
            k = torch.cat([keys[j], keys[i]], dim=2)
            v = torch.cat([values[j], values[i]], dim=2)
            mask = layout.mask(piece, queries[i].dtype, query.device)
            out, _ = sdpa_attention_forward(module, queries[i], k, v, mask, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1).to(dtype), None
