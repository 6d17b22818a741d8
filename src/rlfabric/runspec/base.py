"""What every section of the run spec shares: strict types and the upper bounds of its numbers."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict

from rlfabric.runtime.config import StrictModel

MAX_TOKENS = 1 << 20
"""Upper bound of every length in tokens (context, completion, buffers, top-k): about a million."""
MAX_STEPS = 10_000_000
"""Upper bound of every count of steps or samples (steps, warm-up, intervals, epochs, horizons)."""
MAX_BATCH = 100_000
"""Upper bound of every per-step or per-call count (groups, sequences, items in flight or per call)."""
MAX_KEEP = 1000
"""Upper bound of small counts: samples per prompt, kept checkpoints and versions, windows, epochs of PPO."""
MAX_SEED = 2**32 - 1
"""Seeds are unsigned 32-bit."""

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Run names (and so run ids): a letter or digit, then up to 63 letters, digits, `_`, `.` or `-`."""

PathKind = Literal["data", "model"]
"""What a path in a spec names: a dataset (confined to data roots) or a model (to model roots)."""


class SpecModel(StrictModel):
    """Base of every run-spec section. Besides unknown keys being errors, types are strict: no bool -> int,
    str -> int or str -> float coercion (an int is accepted where a float is expected), floats must be
    finite, and every integer field has an upper bound, so a spec cannot ask for absurd sizes."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)
