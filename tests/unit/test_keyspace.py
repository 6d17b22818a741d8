"""The Redis keyspace has one owner (`rlfabric.contracts.keys`): no key literal elsewhere in the package,
stored keys that never change, and a documented table that matches the code."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from rlfabric.contracts import keys
from rlfabric.contracts.keys import Counter, DropReason

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "rlfabric"
OWNER = PACKAGE / "contracts"
KEY_LITERAL = re.compile(r"^rlfabric:(?!\s)")
"""Starts like a key (`rlfabric:runs`, `rlfabric:{...`), not like a message (`rlfabric: ...`)."""


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the nodes that are docstrings (a string statement: module, class, function, attribute)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def key_literals(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every string constant or f-string in `path` that starts like a Redis key."""
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree)
    inside_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if id(node) in skip or id(node) in inside_fstrings:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and KEY_LITERAL.match(node.value):
            yield node.lineno, node.value
        if isinstance(node, ast.JoinedStr) and KEY_LITERAL.match(ast.unparse(node)[2:]):
            yield node.lineno, ast.unparse(node)


def test_no_redis_key_literal_outside_the_contracts() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if OWNER not in path.parents
        for line, text in key_literals(path)
    ]
    assert not found, "Redis keys belong in rlfabric.contracts.keys:\n" + "\n".join(found)


def test_the_check_sees_constants_and_fstrings(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        '"""rlfabric:{run}:doc is fine."""\n'
        'A = "rlfabric:runs"\n'
        'B = f"rlfabric:{run_id}:groups"\n'
        'C = f"rlfabric: {error}"\n'
        'D = "rlfabric: a message"\n'
    )
    assert [line for line, _ in key_literals(source)] == [2, 3]


def test_stored_keys_never_change() -> None:
    """Invariant 1 of `keys`: a stored run stays readable (these bytes are a migration to change)."""
    assert {k.name: k.pattern for k in keys.KEYSPACE} == {
        "runs_index": "rlfabric:runs",
        "run": "rlfabric:{run}:run",
        "counters": "rlfabric:{run}:counters",
        "metrics": "rlfabric:{run}:metrics",
        "scaling": "rlfabric:{run}:scaling",
        "stop_requested": "rlfabric:{run}:stop_requested",
        "cursor": "rlfabric:{run}:cursor",
        "inflight": "rlfabric:{run}:inflight",
        "enqueued": "rlfabric:{run}:enqueued",
        "dropped": "rlfabric:{run}:dropped",
        "dropped_ids": "rlfabric:{run}:dropped_ids",
        "eval_results": "rlfabric:{run}:eval",
        "final_eval": "rlfabric:{run}:final_eval",
        "groups": "rlfabric:{run}:groups",
        "dead_letters": "rlfabric:{run}:groups:dead",
        "dead_letter_ids": "rlfabric:{run}:groups:dead_ids",
        "stale_ids": "rlfabric:{run}:groups:stale_ids",
        "trimmed": "rlfabric:{run}:groups:trimmed",
        "step": "rlfabric:{run}:step",
        "learner_done": "rlfabric:{run}:learner_done",
        "version": "rlfabric:{run}:version",
        "versions": "rlfabric:{run}:versions",
        "lineage": "rlfabric:{run}:lineage",
        "rolled_back": "rlfabric:{run}:rolled_back",
        "redispatch": "rlfabric:{run}:redispatch",
        "replica": "rlfabric:{run}:replicas:{replica}",
        "fleet_members": "rlfabric:fleet={fleet}:members",
        "fleet_scaling": "rlfabric:fleet={fleet}:scaling",
    }
    assert keys.replica(None, "r0") == "rlfabric:_:replicas:r0"
    assert keys.groups("demo") == "rlfabric:demo:groups"


def test_every_key_is_documented_with_its_processes() -> None:
    for key in keys.KEYSPACE:
        assert key.meaning and key.writers and key.readers, key


def test_drop_reasons_name_their_counters() -> None:
    assert {r.counter for r in DropReason} <= set(Counter)
    assert DropReason.INVALID_PROMPT.counter == "dropped_invalid_prompt"


def test_the_architecture_doc_shows_the_current_table() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    _, _, rest = doc.partition("<!-- keyspace:begin -->\n")
    table, end, _ = rest.partition("<!-- keyspace:end -->")
    assert end, "docs/architecture.md lacks the keyspace markers"
    assert table == keys.keyspace_table(), "stale keyspace table: run `python scripts/gen_keyspace.py`"
