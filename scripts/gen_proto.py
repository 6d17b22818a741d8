"""Regenerate the Python stubs of proto/rlfabric/v1 into src/rlfabric/v1 (the package rlfabric.v1).

    python scripts/gen_proto.py           # write the stubs
    python scripts/gen_proto.py --check   # exit 1 if the committed stubs differ from a fresh generation

The proto files live at proto/rlfabric/v1/*.proto, so the generated modules import each other as
`rlfabric.v1.<name>_pb2`, which is where `src/rlfabric/v1/` is: no import rewriting is needed.
Stubs depend on the grpcio-tools version (pinned in pyproject's dev extra).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "rlfabric" / "v1"
OUT_DIR = ROOT / "src" / "rlfabric" / "v1"
INIT = '"""Generated from proto/rlfabric/v1 by scripts/gen_proto.py. Do not edit."""\n'


def generate(dest: Path) -> None:
    """Runs protoc over every .proto file and leaves the package's files flat in `dest`."""
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_DIR.glob("*.proto"))
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        dest.mkdir(parents=True, exist_ok=True)
        for f in sorted((Path(tmp) / "rlfabric" / "v1").iterdir()):
            shutil.copy2(f, dest / f.name)
    (dest / "__init__.py").write_text(INIT)


def differences(fresh: Path, committed: Path) -> list[str]:
    names = {p.name for p in fresh.iterdir()} | {
        p.name for p in committed.glob("*") if p.suffix in {".py", ".pyi"}
    }
    return sorted(
        n
        for n in names
        if not (fresh / n).exists()
        or not (committed / n).exists()
        or not filecmp.cmp(fresh / n, committed / n, shallow=False)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    opts = parser.parse_args()
    if not opts.check:
        generate(OUT_DIR)
        print(f"stubs written to {OUT_DIR.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = differences(Path(tmp), OUT_DIR)
    if stale:
        print("generated stubs are stale; run `python scripts/gen_proto.py`:", *stale, sep="\n  ")
        return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
