"""The coordinator reaches the reward service through its contract only: importing the coordinator loads
`reward.spec`, `reward.client` and `contracts.wire`, never a scorer, the scorer pool, the reward service's
domain or its Prometheus families (`reward.service`)."""

from __future__ import annotations

import json
import subprocess
import sys

SERVICE_ONLY = (
    "rlfabric.reward.scorers",
    "rlfabric.reward.pool",
    "rlfabric.reward.worker",
    "rlfabric.reward.service",
    "rlfabric.reward.server",
)
"""Modules (and their submodules) that belong to the reward service process."""


def test_importing_the_coordinator_loads_no_reward_service_code() -> None:
    code = (
        "import json, sys\n"
        "import rlfabric.coordinator, rlfabric.coordinator.main, rlfabric.coordinator.api\n"
        "import rlfabric.coordinator.pipeline, rlfabric.coordinator.manager\n"
        f"bad = {SERVICE_ONLY!r}\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(bad))\n"
        "print(json.dumps([loaded, 'rlfabric.reward.client' in sys.modules]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded, client_loaded = json.loads(result.stdout)
    assert loaded == []
    assert client_loaded  # the check is not vacuous: the pipeline's reward client was imported
