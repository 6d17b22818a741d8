#!/usr/bin/env bash
# The demo: everything installed on first use, then real services as real processes on loopback.
#
# Today it runs the reward service end to end: starts `rlfabric serve reward` as its own process, scores examples/math-completions.jsonl through it with a
# composite reward (math correctness + format), prints the summary and stops the service by PID.
# `rlfabric up` (the whole generate -> score -> train loop) replaces it when the coordinator lands.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"

out="${RLFABRIC_DEMO_DIR:-$ROOT/runs/demo}"
mkdir -p "$out"

echo "== starting the reward service"
rlfabric serve reward --port 0 --set log.format=text > "$out/reward.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  address=$(sed -n 's/.*listening on \([0-9.:]*\).*/\1/p' "$out/reward.log" | head -n1)
  [ -n "$address" ] && break
  kill -0 "$pid" 2>/dev/null || { cat "$out/reward.log"; exit 1; }
  sleep 0.1
done
[ -n "$address" ] || { echo "the reward service did not start; see $out/reward.log"; exit 1; }
echo "   listening on $address (pid $pid)"

echo "== scoring examples/math-completions.jsonl through the service"
rlfabric reward score --server "$address" \
  --input examples/math-completions.jsonl --output "$out/scored.jsonl" \
  --scorer examples/reward-composite.toml
echo "   per-item results: $out/scored.jsonl"
