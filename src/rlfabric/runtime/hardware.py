"""What this machine computes natively, for `dtype = "auto"` (the learner's and the rollout engine's).

bfloat16 pays only where the hardware multiplies it natively, and the CPU flags alone do not say where.
Measured with torch 2.13 (matmuls of 512..8192 x 256..2048 by up to 2048 columns, 1 and 2 threads):
- an Intel Xeon with AVX-512 BF16 but no AMX ran bfloat16 at 0.55-0.65x its float32 GFLOP/s;
- a 2-core AMD EPYC with AVX-512 BF16 (no AMX) ran it at 2.0-3.1x, and the LoRA demo's learner step
  1.6x faster (0.79 s against 1.31 s) at the same reward;
- a 2-core AMD EPYC with AVX2 only took over 5 minutes for the e2e bench's bfloat16 learner step that an
  AMX machine ran in 8.6 s.
So on a CPU: AMX (`amx_bf16`) is native; without AVX-512 BF16 it is not; with AVX-512 BF16 and no AMX a
probe decides (`bfloat16_speedup`: one bfloat16 and one float32 matmul timed here, bfloat16 native when
it is at least `PROBE_MIN_SPEEDUP` times faster). On a GPU, `torch.cuda.is_bf16_supported()` (Ampere and
later).

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
import time
from pathlib import Path
from typing import Literal

AUTO_DTYPE_ENV = "RLFABRIC_AUTO_DTYPE"
AutoDtype = Literal["float32", "bfloat16"]
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
"""The CPU flags that decide bfloat16 speed, recorded with every benchmark."""
PROBE_MIN_SPEEDUP = 1.3
"""bfloat16 counts as native on a CPU with AVX-512 BF16 and no AMX when the probe's bfloat16 matmul is at
least this many times faster than float32 (measured 0.55-0.65x where it is converted, 2.0-3.1x where it
is computed natively: far from the line on both sides, so every process of a machine decides alike)."""
PROBE_SIZE = 384
"""The probe's matmul: PROBE_SIZE square, ~4 ms in float32 on one core, a few repeats of each dtype."""


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
    """The CPU's model, its bfloat16-relevant flags, whether bfloat16 counts as native and, where the probe
    decided it, the probe's speed-up: as benchmarks record them."""
    flags = cpu_flags()
    described: dict[str, object] = {
        "model": cpu_model(),
        "features": [f for f in CPU_FEATURES if f in flags],
        "native_bfloat16": native_bfloat16("cpu"),
    }
    if probe_decides():
        described["bfloat16_speedup"] = round(bfloat16_speedup(), 2)
    return described


def probe_decides() -> bool:
    """Whether this CPU's flags leave bfloat16 to the probe: AVX-512 BF16 without AMX."""
    flags = cpu_flags()
    return "avx512_bf16" in flags and "amx_bf16" not in flags


def native_bfloat16(device_type: str) -> bool:
    """Whether `device_type` ("cpu" or "cuda") multiplies bfloat16 natively (see the module docstring)."""
    if device_type == "cuda":
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if probe_decides():
        return bfloat16_speedup() >= PROBE_MIN_SPEEDUP
    return "amx_bf16" in cpu_flags()


@functools.cache
def bfloat16_speedup(repeats: int = 5) -> float:
    """float32 matmul time over bfloat16 matmul time on this CPU (best of `repeats` each, interleaved, at
    torch's thread count): above 1 where bfloat16 is faster. Measured once per process (~10 ms)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a32 = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator)
    b32 = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator)
    operands = {torch.float32: (a32, b32), torch.bfloat16: (a32.bfloat16(), b32.bfloat16())}
    best = dict.fromkeys(operands, float("inf"))
    for _ in range(repeats + 1):  # the first round warms up the kernels
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            torch.mm(a, b)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


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
    flags = cpu_flags()
    features = ", ".join(f for f in CPU_FEATURES if f in flags) or "none of " + ", ".join(CPU_FEATURES)
    if "avx512_bf16" in flags:
        cost = f"its bfloat16 matmul measured {bfloat16_speedup():.2f}x float32's speed here"
    else:
        cost = "without AVX-512 BF16 a learner step an AMX CPU ran in 8.6 s took over 5 minutes"
    return (
        f"bfloat16 on this CPU ({cpu_model()}; {features}) is not native, it is emulated or converted: "
        f"{cost}; dtype 'auto' picks float32 here"
    )
