"""`rlfabric up`'s flags that shape the processes it starts (no process is started here)."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlfabric import up


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_replica_cores_bind_each_replica_to_its_entry_in_turn(tmp_path: Path) -> None:
    args = parse("--replica-cores", "0|1-3", "--engine", "vllm")
    assert args.replica_cores == ["0", "1-3"]
    stack = up.Stack(tmp_path)
    spec = SimpleNamespace(
        name="r", output_dir=str(tmp_path), model=SimpleNamespace(path="m", max_model_len=64, dtype="auto")
    )
    binds = [
        up.replica_process(stack, args, spec, "redis://x", i).env["VLLM_CPU_OMP_THREADS_BIND"]
        for i in range(3)
    ]
    assert binds == ["0", "1-3", "0"]


def test_without_replica_cores_the_environment_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2-3")
    args = parse("--engine", "vllm")
    spec = SimpleNamespace(
        name="r", output_dir=str(tmp_path), model=SimpleNamespace(path="m", max_model_len=64, dtype="auto")
    )
    proc = up.replica_process(up.Stack(tmp_path), args, spec, "redis://x", 0)
    assert proc.env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"


@pytest.mark.parametrize("text", ["", "0||1", "a", "0-x", "1;2"])
def test_malformed_replica_cores_are_refused(text: str) -> None:
    with pytest.raises(SystemExit):
        parse("--replica-cores", text)
