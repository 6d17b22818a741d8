#!/usr/bin/env bash
# Type-checks the rlfabric package (src/rlfabric) with mypy; the configuration is pyproject's [tool.mypy].
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
python -m mypy --config-file "$ROOT/pyproject.toml" -p rlfabric "$@"
