#!/usr/bin/env bash
# Runs the test suite (unit, integration with real gRPC servers / redis-server / vLLM on CPU, e2e).
#   scripts/test.sh                 # everything
#   scripts/test.sh tests/unit -x   # any pytest arguments
#   RLFABRIC_TEST_WORKERS=0 scripts/test.sh ...   # in this process, one test after another
#
# Test files run in parallel worker processes (pytest-xdist, `--dist loadfile`): all of a file's tests on
# one worker, so a module's fixture (a whole `rlfabric up` run, a vLLM replica) starts once. Most of the
# suite waits on processes starting, restarting and answering; one test at a time left two cores ~45 %
# idle. Workers: RLFABRIC_TEST_WORKERS, default the CPU count kept within 2..4. Files are handed out in
# collection order (`--no-loadscope-reorder`; xdist would start with the files of most tests), so the
# e2e runs, the longest, start first instead of ending the suite one beside the other. The 30 slowest
# tests (a module's fixture counts as its first test's setup) are listed at the end.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
workers="${RLFABRIC_TEST_WORKERS:-}"
if [ -z "$workers" ]; then
  cpus="$(nproc)"
  workers=$((cpus < 2 ? 2 : (cpus > 4 ? 4 : cpus)))
fi
# pytest exits 5 when it collects nothing: that fails this script, as it should.
exec python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder --durations=30 "${@:-tests}" -ra
