"""`rlfabric up`'s flags that shape the processes it starts (no process is started here)."""

from __future__ import annotations

import argparse
import sys
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


def test_the_compile_cache_is_shared_by_runs_unless_the_caller_chooses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No per-run VLLM_CACHE_ROOT: a replica compiled once for a model starts from the cache next time."""
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    assert "VLLM_CACHE_ROOT" not in up.vllm_env(compile_=True)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert up.vllm_env(compile_=True)["VLLM_CACHE_ROOT"] == str(tmp_path)


def test_launched_processes_start_together(tmp_path: Path) -> None:
    """`Stack.launch` does not wait: the first process is ready only once the second, launched after it,
    has run (it waits for a file the second writes), so a stack that waited in between would time out."""
    flag = tmp_path / "flag"
    first = [sys.executable, "-c", WAIT_FOR_FLAG, str(flag)]
    touch = "import sys, pathlib; pathlib.Path(sys.argv[1]).touch(); print('up')"
    second = [sys.executable, "-c", touch, str(flag)]
    stack = up.Stack(tmp_path)
    try:
        waiting = stack.launch(stack.process("first", first), r"ready (\d+)", timeout_s=60)
        writing = stack.launch(stack.process("second", second), r"up", timeout_s=60)
        assert stack.wait(waiting) == "1"
        assert stack.wait(writing) == ""
    finally:
        stack.stop()


WAIT_FOR_FLAG = """
import pathlib, sys, time
while not pathlib.Path(sys.argv[1]).exists():
    time.sleep(0.05)
print("ready 1", flush=True)
time.sleep(60)
"""
