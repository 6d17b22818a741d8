"""The CLI answers --help without importing the heavy stack, and documents every config key."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "vllm", "transformers", "grpc", "redis", "fastapi")

PROBE = f"""
import sys
from rlfabric import cli
try:
    cli.main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))
print('HEAVY=' + ','.join(heavy), file=sys.stderr)
"""


def run_help(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60, check=True
    )


@pytest.mark.parametrize(
    "args",
    [("--help",), *(("serve", s, "--help") for s in ("coordinator", "rollout", "reward", "learner"))],
)
def test_help_imports_nothing_heavy(args: tuple[str, ...]) -> None:
    result = run_help(*args)
    assert "usage: rlfabric" in result.stdout
    assert "HEAVY=\n" in result.stderr + "\n", result.stderr


def test_serve_help_lists_config_keys_with_defaults() -> None:
    out = run_help("serve", "reward", "--help").stdout
    assert "server.max_concurrent_rpcs" in out
    assert "RLFABRIC_REWARD__KEY__SUBKEY" in out
    assert "--host" in out and "--port" in out
