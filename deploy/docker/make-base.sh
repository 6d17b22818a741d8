#!/usr/bin/env bash
# Makes the base image the rlfabric images build FROM, without any registry: a minimal Debian (bookworm)
# made with debootstrap from a Debian mirror, imported into the local Docker daemon. For offline and
# air-gapped builders, which cannot pull python:3.11-slim from Docker Hub (docs/deploy.md).
#
#   deploy/docker/make-base.sh [IMAGE]        # default rlfabric/base:bookworm; ~1.5 min
#
# The image holds Python 3.11 with venv, CA certificates, the libraries vLLM's CPU build loads (libgomp,
# libnuma) and redis-server, so the same local base also runs the compose stack's Redis. Environment:
#   DEBIAN_MIRROR   the mirror debootstrap reads (default https://deb.debian.org/debian)
#   REBUILD=1       make it again even when the daemon already has IMAGE
# Needs root (debootstrap), the debootstrap package and a running Docker daemon.
set -euo pipefail

image="${1:-rlfabric/base:bookworm}"
mirror="${DEBIAN_MIRROR:-https://deb.debian.org/debian}"
packages="ca-certificates,python3,python3-venv,libgomp1,libnuma1,redis-server"

if [ "${REBUILD:-0}" != 1 ] && docker image inspect "$image" >/dev/null 2>&1; then
  echo "make-base: $image already present (REBUILD=1 makes it again)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "make-base: debootstrap is not installed" >&2; exit 1; }

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
echo "make-base: debootstrap bookworm ($packages) from $mirror"
debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# Package lists and caches are not part of an image; /etc/machine-id is made per container.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
: > "$root/etc/machine-id"
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "make-base: $image ($(docker image inspect -f '{{.Size}}' "$image" | numfmt --to=iec))"
