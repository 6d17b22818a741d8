#!/usr/bin/env bash
# Fills a wheelhouse for an image build that needs no network: every wheel the CPU image installs (torch's
# CPU build, vLLM for the CPU, rlfabric's dependencies, s3fs, the build backend), built or downloaded on
# this host with pip. The Dockerfiles install from it with `pip install --no-index` when it holds any
# wheel (docs/deploy.md, "Offline and air-gapped builds").
#
#   deploy/docker/wheelhouse.sh [DIR]      # default deploy/docker/wheels (inside the build context)
#
# Versions: pinned to the Python environment that runs this script when rlfabric is installed in it (its
# `pip freeze`, so the image gets the versions that were tested there), else pip resolves afresh.
# Environment: PYTHON (default python3; must be CPython 3.11 like the base image), and pip's own settings
# (PIP_INDEX_URL, PIP_FIND_LINKS: torch's CPU build must be reachable, e.g. from
# https://download.pytorch.org/whl/cpu or a local file).
set -euo pipefail
cd "$(dirname "$0")/../.."

dir="${1:-deploy/docker/wheels}"
py="${PYTHON:-python3}"
version="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$version" = 3.11 ] || { echo "wheelhouse: $py is Python $version; the base image has 3.11" >&2; exit 1; }

mkdir -p "$dir"
constraints=()
if "$py" -m pip show rlfabric >/dev/null 2>&1; then
  pins="$(mktemp)"
  trap 'rm -f "$pins"' EXIT
  "$py" -m pip freeze --exclude-editable | grep -v -E '^(rlfabric|-e )' >"$pins"
  constraints=(-c "$pins")
  echo "wheelhouse: pinned to $("$py" -c 'import sys; print(sys.prefix)')'s $(wc -l <"$pins") packages"
fi
# Requirements whose environment markers differ between this Python and the base image's are added by
# hand: Debian bookworm's Python is 3.11.2, and redis needs async-timeout below 3.11.3.
"$py" -m pip wheel -q --wheel-dir "$dir" "${constraints[@]}" \
  "setuptools>=70" "torch==2.13.0" ".[cpu,s3]" "async-timeout>=4.0.3"
# rlfabric itself is installed from the source the build copies, not from this wheelhouse.
rm -f "$dir"/rlfabric-*.whl
echo "wheelhouse: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
