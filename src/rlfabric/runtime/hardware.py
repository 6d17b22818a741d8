"""What this machine computes natively, for `dtype = "auto"` (the learner's and the rollout engine's).

bfloat16 pays only where the hardware multiplies it natively. Measured with torch 2.13 on 2 cores
(2048 x N by N x N matmuls, N = 512..2048): an Intel Xeon with AVX-512 BF16 but no AMX ran bfloat16 at
0.55-0.65x its float32 GFLOP/s (bf16 is converted, not tiled); a 2-core AMD EPYC with AVX2 only took over
5 minutes for the e2e bench's bfloat16 learner step that an AMX machine ran in 8.6 s. So on a CPU only
AMX (`amx_bf16`) counts as native; on a GPU, `torch.cuda.is_bf16_supported()` (Ampere and later).

`auto` resolves to bfloat16 where it is native and float32 elsewhere. The environment variable
`RLFABRIC_AUTO_DTYPE` (`float32` or `bfloat16`) overrides the detection for every process of a machine:
for an operator whose hardware is misdetected, and for the test suite, whose numeric checks expect the
same dtype on every kind of machine. An explicit bfloat16 where it is not native is allowed, with a
warning (`bfloat16_warning`).
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Literal

AUTO_DTYPE_ENV = "RLFABRIC_AUTO_DTYPE"
AutoDtype = Literal["float32", "bfloat16"]
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
"""The CPU flags that decide bfloat16 speed, recorded with every benchmark."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_description() -> dict[str, object]:
    """The CPU's model and its bfloat16-relevant flags, as benchmarks record them."""
    flags = cpu_flags()
    return {
        "model": cpu_model(),
        "features": [f for f in CPU_FEATURES if f in flags],
        "native_bfloat16": "amx_bf16" in flags,
    }


def native_bfloat16(device_type: str) -> bool:
    """Whether `device_type` ("cpu" or "cuda") multiplies bfloat16 natively (see the module docstring)."""
    if device_type == "cuda":
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return "amx_bf16" in cpu_flags()


def auto_dtype(device_type: str) -> AutoDtype:
    """What `dtype = "auto"` means on `device_type` here: `RLFABRIC_AUTO_DTYPE` if set, else bfloat16 where
    it is native, float32 elsewhere. Raises ValueError naming the variable for any other value."""
    override = os.environ.get(AUTO_DTYPE_ENV, "").strip()
    if override:
        if override not in ("float32", "bfloat16"):
            raise ValueError(f"{AUTO_DTYPE_ENV}: must be float32 or bfloat16, got {override!r}")
        return override  # type: ignore[return-value]
    return "bfloat16" if native_bfloat16(device_type) else "float32"


def bfloat16_warning(dtype: str, device_type: str) -> str | None:
    """The warning for computing in `dtype` on `device_type` where bfloat16 is not native; None otherwise."""
    if dtype != "bfloat16" or device_type != "cpu" or native_bfloat16("cpu"):
        return None
    features = ", ".join(f for f in CPU_FEATURES if f in cpu_flags()) or "none of " + ", ".join(CPU_FEATURES)
    return (
        f"bfloat16 on a CPU without AMX ({cpu_model()}; {features}) is emulated or converted: measured "
        "0.55-0.65x float32's matmul speed with AVX-512 BF16, and over 5 minutes with AVX2 only for a "
        "learner step an AMX CPU ran in 8.6 s; dtype 'auto' picks float32 here"
    )
