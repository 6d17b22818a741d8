"""`dtype = "auto"` by hardware: bfloat16 only where it is native (AMX on a CPU), an override for every
process of a machine, and a warning for bfloat16 where it is not native."""

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


def with_flags(monkeypatch: pytest.MonkeyPatch, *flags: str) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("avx2",), "float32"),  # AMD EPYC without AVX-512: bfloat16 emulated
        (("avx2", "avx512f", "avx512_bf16"), "float32"),  # AVX-512 BF16 without AMX: 0.6x float32
        (("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), "bfloat16"),
    ],
)
def test_auto_is_bfloat16_only_with_amx_on_cpu(cpu: pytest.MonkeyPatch, flags: tuple, expected: str) -> None:
    with_flags(cpu, *flags)
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
    warnings = [r.getMessage() for r in caplog.records if "without AMX" in r.getMessage()]
    assert len(warnings) == 2 and "model.dtype:" in warnings[0] and "avx2" in warnings[0]
    with_flags(cpu, "amx_bf16")
    assert hardware.bfloat16_warning("bfloat16", "cpu") is None
    assert hardware.bfloat16_warning("float32", "cpu") is None


def test_cpu_description_names_the_model_and_the_bfloat16_flags() -> None:
    described = hardware.cpu_description()
    assert described["model"]
    assert set(described["features"]) <= set(hardware.CPU_FEATURES)
    assert described["native_bfloat16"] == ("amx_bf16" in hardware.cpu_flags())
