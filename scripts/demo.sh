#!/usr/bin/env bash
# The demo: `rlfabric up` on the built-in task, everything installed on first use.
#   bash scripts/demo.sh                 # 40 steps (a few minutes on two CPU cores)
#   bash scripts/demo.sh --steps 10      # any `rlfabric up` flags
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec rlfabric up "$@"
