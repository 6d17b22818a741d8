"""Watching a running `rlfabric up` from an end-to-end test: its output, its run's API token and status."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def wait_for(
    what: str, proc: subprocess.Popen[str], out: Path, check: Callable[[], Any], timeout_s: float
) -> Any:
    """Polls `check` until it returns something truthy; fails when `up` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        assert proc.poll() is None, (
            f"`up` exited ({proc.returncode}) before {what}:\n{out.read_text()[-4000:]}"
        )
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {timeout_s:.0f} s:\n{out.read_text()[-4000:]}")


def bearer(run_dir: Path) -> dict[str, str]:
    """The Authorization header with the run's API token (`up` keeps it in credentials.json)."""
    return {"Authorization": f"Bearer {json.loads((run_dir / 'credentials.json').read_text())['api']}"}


def run_status(url: str, headers: dict[str, str], run: str) -> dict[str, Any]:
    """`GET /v1/runs/{run}`; {} while the coordinator does not answer."""
    try:
        return dict(httpx.get(f"{url}/v1/runs/{run}", headers=headers, timeout=10).json())
    except httpx.HTTPError:
        return {}
