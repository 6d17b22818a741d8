#!/usr/bin/env bash
# Runs the test suite (unit, integration with real gRPC servers / redis-server / vLLM on CPU, e2e).
#   scripts/test.sh                 # everything
#   scripts/test.sh tests/unit -x   # any pytest arguments
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
# pytest exits 5 when it collects nothing: that fails this script, as it should.
exec python -m pytest "${@:-tests}" -ra
