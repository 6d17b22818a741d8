"""`rlfabric up RUN_FILE` with `[resources]` that cannot hold the run refuses it before any process
starts: a non-zero exit, the plan's verdict on stderr naming `resources`, no process log in the run
directory (every process `up` starts writes one) and no call of the `redis-server` it would start first
(a stand-in on PATH that records being run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RUN_FILE = """
name = "too-big"

[model]
path = "{model}"

[dataset]
path = "{data}"

[resources]
placement = "colocated"
learner = {{ kind = "cpu", devices = 1, memory = "64MiB" }}
"""


def test_up_refuses_a_run_that_cannot_fit_before_any_process_starts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    run_file = tmp_path / "run.toml"
    run_file.write_text(RUN_FILE.format(model=tiny_model_dir, data=data))
    bin_dir, marker = tmp_path / "bin", tmp_path / "redis-server-ran"
    bin_dir.mkdir()
    stand_in = bin_dir / "redis-server"
    stand_in.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "rlfabric.cli", "up", str(run_file), "--run-dir", str(run_dir)]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "resources: does not fit" in result.stderr
    assert "64.0 MiB" in result.stderr
    assert not marker.exists()
    assert not (run_dir / "logs").exists()
    assert not (run_dir / "up.json").exists()
