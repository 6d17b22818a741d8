"""Write the Redis keyspace table (`rlfabric.contracts.keys.keyspace_table`) into docs/architecture.md.

    python scripts/gen_keyspace.py           # rewrite the table between the markers
    python scripts/gen_keyspace.py --check   # exit 1 if the doc's table differs from keys.py

The table lives between `<!-- keyspace:begin -->` and `<!-- keyspace:end -->`; tests/unit/test_keyspace.py
fails when it is stale.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfabric.contracts.keys import keyspace_table

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- keyspace:begin -->"
END = "<!-- keyspace:end -->"


def render(doc: str) -> str:
    """`doc` with the text between the markers replaced by the table; ValueError without the markers."""
    head, begin, rest = doc.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{DOC.name} lacks the markers {BEGIN} ... {END}")
    return f"{head}{BEGIN}\n{keyspace_table()}{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    opts = parser.parse_args()
    doc = DOC.read_text()
    fresh = render(doc)
    if not opts.check:
        DOC.write_text(fresh)
        print(f"keyspace table written to {DOC.relative_to(ROOT)}")
        return 0
    if fresh != doc:
        print(f"the keyspace table in {DOC.relative_to(ROOT)} is stale; run `python scripts/gen_keyspace.py`")
        return 1
    print("the keyspace table is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
