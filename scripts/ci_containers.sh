#!/usr/bin/env bash
# CI's container stage, the offline recipe of docs/deploy.md end to end: installs and starts a Docker
# daemon, makes the local base image (debootstrap), fills the wheelhouse on this host, builds the light
# and the CPU images from them with no registry and no network inside the builds, checks that a broken
# install fails the build, then runs tests/containers (the compose stack from those images runs the demo
# to a learning curve, checked through the REST API and the ledger) and tears everything down.
#   scripts/ci_containers.sh            # needs root on Debian/Ubuntu (apt, dockerd, debootstrap)
# The daemon's data (layers, the base, the images) is kept in RLFABRIC_DOCKER_CACHE (default
# ~/.cache/rlfabric/docker) so a second run on the same machine reuses it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/bootstrap.sh
start=$SECONDS
say() { printf -- '--- %s (%ss)\n' "$1" "$((SECONDS - start))"; }

if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null \
  || ! command -v debootstrap >/dev/null || ! command -v iptables >/dev/null; then
  say "installing docker.io, docker-compose, debootstrap (Debian packages)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    docker.io containerd runc iptables docker-compose debootstrap >/dev/null
fi

cache="${RLFABRIC_DOCKER_CACHE:-$HOME/.cache/rlfabric/docker}"
run="$(mktemp -d)"  # the daemon's socket and run state: short paths, removed afterwards
mkdir -p "$cache"
say "starting dockerd (data in $cache)"
# dockerd itself is this shell's child (as root) or sudo's, so $! is a process that ends with it.
daemon=(dockerd --storage-driver=overlay2 --data-root "$cache/root" --exec-root "$run/exec"
  --pidfile "$run/dockerd.pid" -H "unix://$run/docker.sock")
if [ "$(id -u)" = 0 ]; then "${daemon[@]}" >"$run/dockerd.log" 2>&1 & else sudo "${daemon[@]}" >"$run/dockerd.log" 2>&1 & fi
dockerd_pid=$!
stop_dockerd() {
  # SIGTERM to dockerd by the PID it wrote (it stops its containers and its containerd), then wait.
  if [ -s "$run/dockerd.pid" ]; then as_root kill "$(cat "$run/dockerd.pid")"; fi
  wait "$dockerd_pid" || echo "dockerd exited with status $?" >&2
  rm -rf "$run"
}
trap stop_dockerd EXIT
export DOCKER_HOST="unix://$run/docker.sock"
# The legacy builder: it needs no buildx plugin and fetches no frontend image.
export DOCKER_BUILDKIT=0
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
docker info >/dev/null || { cat "$run/dockerd.log" >&2; exit 1; }

base=rlfabric/base:bookworm
say "base image $base"
bash deploy/docker/make-base.sh "$base"
say "wheelhouse"
PYTHON="$(command -v python)" bash deploy/docker/wheelhouse.sh deploy/docker/wheels

build() {  # build FLAVOUR TAG [docker build args...]
  local flavour="$1" tag="$2"
  shift 2
  docker build -q --build-arg BASE_IMAGE="$base" -f "deploy/docker/Dockerfile.$flavour" -t "$tag" "$@" . \
    >"$run/build-$flavour.log" 2>&1
}
image() {  # image FLAVOUR: its dependencies' stage tagged (so the prune below keeps it and the next build
  # reuses it: only a changed pyproject.toml or wheelhouse reinstalls them), then the image
  local flavour="$1"
  build "$flavour" "rlfabric/rlfabric:ci-$flavour-deps" --target deps \
    && build "$flavour" "rlfabric/rlfabric:ci-$flavour" \
    || { tail -n 40 "$run/build-$flavour.log" >&2; exit 1; }
}
say "light image"
image light
say "a broken install must fail the build"
if build light rlfabric/rlfabric:ci-broken --build-arg EXTRA_PACKAGES=rlfabric-no-such-package; then
  echo "the build with a missing package succeeded" >&2
  exit 1
fi
grep -q "No matching distribution found for rlfabric-no-such-package" "$run/build-light.log" \
  || { tail -n 20 "$run/build-light.log" >&2; exit 1; }
say "CPU image"
image cpu
docker image ls rlfabric/rlfabric --format '{{.Repository}}:{{.Tag}} {{.Size}}'
# Dangling layers of earlier builds: drop them so the cache does not grow run after run.
docker image prune -f >/dev/null

say "tests/containers"
RLFABRIC_IMAGE=rlfabric/rlfabric:ci-cpu RLFABRIC_LIGHT_IMAGE=rlfabric/rlfabric:ci-light \
  RLFABRIC_REDIS_IMAGE="$base" python -m pytest tests/containers -m containers -ra
say "done"
