"""A real Prometheus server for the integration tests: loopback only, its data in a test folder, scraping
and evaluating rules every second, its targets from a file_sd file the test rewrites as services start.

`prometheus` comes from the Debian package `prometheus` (scripts/bootstrap.sh installs it for promtool):
without it the tests that use it fail rather than skip.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlfabric.local.ports import free_port
from rlfabric.local.procs import ServiceProcess

READY = r"Server is ready to receive web requests"


@dataclass(frozen=True)
class Prometheus:
    """A running server: its base URL and the folder of its file_sd targets."""

    url: str
    targets: Path

    def publish(self, found: dict[str, str]) -> None:
        """Scrape these targets (job name -> host:port) from now on. The file is written, then renamed:
        Prometheus never reads half of one."""
        groups = [{"targets": [address], "labels": {"job": name}} for name, address in sorted(found.items())]
        tmp = self.targets / "targets.json.tmp"
        tmp.write_text(json.dumps(groups))
        tmp.rename(self.targets / "targets.json")


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    assert path is not None, "prometheus is missing: apt-get install prometheus (scripts/bootstrap.sh does)"
    return path


def write_config(folder: Path, rules: Path) -> Path:
    """prometheus.yml: `rules` as its rule file, targets from `targets/*.json`."""
    (folder / "targets").mkdir(parents=True)
    discovery = {"files": [str(folder / "targets" / "*.json")], "refresh_interval": "1s"}
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "rlfabric", "file_sd_configs": [discovery]}],
    }
    path = folder / "prometheus.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@contextmanager
def prometheus_server(folder: Path, rules: Path) -> Iterator[Prometheus]:
    """A Prometheus on a free loopback port with its storage in `folder`, stopped by PID on exit."""
    config = write_config(folder, rules)
    port = free_port()
    argv = [
        prometheus_binary(),
        f"--config.file={config}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    proc = ServiceProcess("prometheus", argv, log_path=folder / "prometheus.log")
    proc.start(READY, timeout_s=60)
    try:
        yield Prometheus(f"http://127.0.0.1:{port}", folder / "targets")
    finally:
        proc.stop()
