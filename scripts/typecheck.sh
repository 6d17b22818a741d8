#!/usr/bin/env bash
# Type-checks the rlfabric package (the services/ folder) with mypy. mypy cannot follow setuptools'
# package-dir mapping, so it is shown the folder under its import name through a symlink.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
shim="$(mktemp -d)"
trap 'rm -rf "$shim"' EXIT
ln -s "$ROOT/services" "$shim/rlfabric"
cd "$ROOT"
MYPYPATH="$shim" python -m mypy --config-file "$ROOT/pyproject.toml" -p rlfabric "$@"
