"""`dtype = "auto"` by hardware: bfloat16 only where it is native (AMX on a CPU, or AVX-512 BF16 where the
probe measures it faster than float32), an override for every process of a machine, and a warning for
bfloat16 where it is not native."""

from __future__ import annotations

import logging

import pytest
import torch

from rlfabric.learner.dist import compute_dtype
from rlfabric.rollout.main import resolve_dtype
from rlfabric.runtime import hardware


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Detection as on a real machine (the suite's conftest pins the override to float32)."""
    monkeypatch.delenv(hardware.AUTO_DTYPE_ENV, raising=False)
    return monkeypatch


def with_flags(monkeypatch: pytest.MonkeyPatch, *flags: str, speedup: float | None = None) -> None:
    """`flags` as the CPU's; `speedup` as the bfloat16 probe's result (None: the probe must not run)."""

    def probe() -> float:
        assert speedup is not None, "the probe ran where the flags decide"
        return speedup

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(hardware, "bfloat16_speedup", probe)


AVX512_BF16 = ("avx2", "avx512f", "avx512_bf16")


@pytest.mark.parametrize(
    ("flags", "speedup", "expected"),
    [
        (("avx2",), None, "float32"),  # AMD EPYC without AVX-512: bfloat16 emulated
        (AVX512_BF16, 0.6, "float32"),  # an Intel Xeon with AVX-512 BF16, no AMX: converted, 0.6x
        (AVX512_BF16, 2.2, "bfloat16"),  # an AMD EPYC with AVX-512 BF16, no AMX: 2.0-3.1x
        (AVX512_BF16, hardware.PROBE_MIN_SPEEDUP, "bfloat16"),
        ((*AVX512_BF16, "amx_tile", "amx_bf16"), None, "bfloat16"),
    ],
)
def test_auto_is_bfloat16_where_it_is_native_on_cpu(
    cpu: pytest.MonkeyPatch, flags: tuple, speedup: float | None, expected: str
) -> None:
    with_flags(cpu, *flags, speedup=speedup)
    assert hardware.auto_dtype("cpu") == expected
    assert resolve_dtype("auto") == expected
    assert compute_dtype("auto", torch.device("cpu")) == getattr(torch, expected)


def test_the_override_wins_and_is_checked(cpu: pytest.MonkeyPatch) -> None:
    with_flags(cpu, "amx_bf16")
    cpu.setenv(hardware.AUTO_DTYPE_ENV, "float32")
    assert hardware.auto_dtype("cpu") == "float32"
    cpu.setenv(hardware.AUTO_DTYPE_ENV, "float16")
    with pytest.raises(ValueError, match="RLFABRIC_AUTO_DTYPE: must be float32 or bfloat16"):
        hardware.auto_dtype("cpu")


def test_explicit_bfloat16_without_amx_warns(
    cpu: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with_flags(cpu, "avx2")
    with caplog.at_level(logging.WARNING):
        assert compute_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
        assert resolve_dtype("bfloat16") == "bfloat16"
    warnings = [r.getMessage() for r in caplog.records if "is not native" in r.getMessage()]
    assert len(warnings) == 2 and "model.dtype:" in warnings[0] and "avx2" in warnings[0]
    assert "over 5 minutes" in warnings[0]
    with_flags(cpu, *AVX512_BF16, speedup=0.6)
    assert "measured 0.60x float32's speed" in str(hardware.bfloat16_warning("bfloat16", "cpu"))
    with_flags(cpu, *AVX512_BF16, speedup=2.2)
    assert hardware.bfloat16_warning("bfloat16", "cpu") is None
    with_flags(cpu, "amx_bf16")
    assert hardware.bfloat16_warning("bfloat16", "cpu") is None
    assert hardware.bfloat16_warning("float32", "cpu") is None


def test_the_probe_times_real_matmuls() -> None:
    """The real probe on this machine: a finite positive ratio, the same decision when asked again."""
    speedup = hardware.bfloat16_speedup.__wrapped__(repeats=2)
    assert 0.0 < speedup < 100.0
    assert hardware.bfloat16_speedup() == hardware.bfloat16_speedup()  # measured once per process


def test_cpu_description_names_the_model_and_the_bfloat16_flags() -> None:
    described = hardware.cpu_description()
    assert described["model"]
    assert set(described["features"]) <= set(hardware.CPU_FEATURES)
    assert described["native_bfloat16"] == hardware.native_bfloat16("cpu")
    probed = "avx512_bf16" in hardware.cpu_flags() and "amx_bf16" not in hardware.cpu_flags()
    assert ("bfloat16_speedup" in described) == probed
