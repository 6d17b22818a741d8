"""Function and module sizes of the rlfabric package (the generated stubs in v1/ excluded).

    python scripts/code_sizes.py [ROOT]     # default src/rlfabric

Prints module count, lines, median and largest module, modules over 400 / 500 lines; function count,
median and 90th-percentile length, the largest function, functions over 30 / 50 lines (lines counted
from `def` to the function's last line, decorators excluded). STYLE treats a module over ~500 lines or a
function over ~80 as a smell.
"""

from __future__ import annotations

import ast
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "rlfabric"


def sizes(root: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, path) of each module and (lines, path:name) of each function under `root`."""
    modules, functions = [], []
    for path in sorted(root.rglob("*.py")):
        if "v1" in path.relative_to(root).parts:
            continue
        text = path.read_text()
        modules.append((len(text.splitlines()), str(path.relative_to(root))))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                functions.append((length, f"{path.relative_to(root)}:{node.name}"))
    return modules, functions


def main() -> None:
    modules, functions = sizes(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    m, f = sorted(n for n, _ in modules), sorted(n for n, _ in functions)
    print(
        f"modules {len(m)}, {sum(m)} lines, median {statistics.median(m)}, largest {max(modules)}, "
        f"over 400: {sum(n > 400 for n in m)}, over 500: {sum(n > 500 for n in m)}"
    )
    print(
        f"functions {len(f)}, median {statistics.median(f)}, p90 {f[int(0.9 * len(f))]}, "
        f"largest {max(functions)}, over 30: {sum(n > 30 for n in f)}, over 50: {sum(n > 50 for n in f)}"
    )


if __name__ == "__main__":
    main()
