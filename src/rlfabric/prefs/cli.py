"""`rlfabric prefs`: build preference dataset versions from a pipeline file, and read the store.

    rlfabric prefs build PIPELINE_FILE [--store DIR]   run the pipeline; print the version id, its
                                                       folder and what hygiene and the judges dropped
    rlfabric prefs list                                the versions in the store
    rlfabric prefs show VERSION                        a version's manifest summary and report
    rlfabric prefs diff A B                            rows added and removed, pipeline changes
    rlfabric prefs verify VERSION                      re-hash a version against its manifest

VERSION is a version folder, an id or a unique prefix of one (4 characters or more), or a pipeline name
(its newest version). The store is `--store`, else the pipeline file's `store`, else "prefs". A run
trains on a version by naming its folder as `dataset.path`; the run verifies it first.

Exit status: 0; 1 when `verify` finds a problem or a build fails while running (a judge or generator
that stops working); 2 for bad input (the pipeline file, a path, a version that cannot be found), with
one line on stderr. Light at import: the pipeline's modules load only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = __doc__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    build = verbs.add_parser(
        "build",
        help="run a pipeline file into a new dataset version",
        description="Run the pipeline file's stages (source, CAI, hygiene, judges) and write an immutable, "
        "content-addressed dataset version into the store; see docs/prefs.md for the file's reference.",
    )
    build.add_argument("pipeline", metavar="PIPELINE_FILE", help="TOML, YAML or JSON pipeline file")
    add_store(build, "the store folder (default: the pipeline file's `store`)")
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.add_argument(
        "--scorer-policy",
        metavar="FILE",
        help="JSON policy of the scorer judges (allowed_functions, sandbox, judge_api_keys) in place of "
        "the default (user code from the pipeline file's folder and the modules its judges name); the "
        "coordinator passes its operator's",
    )
    build.add_argument("--result", metavar="FILE", help="also write the --json answer into FILE")
    add_json(build)
    listing = verbs.add_parser("list", help="list the versions in the store")
    add_store(listing)
    listing.add_argument("--verify", action="store_true", help="verify each version too")
    add_json(listing)
    show = verbs.add_parser("show", help="a version's manifest summary and report")
    show.add_argument("version", metavar="VERSION", help="folder, id, id prefix or pipeline name")
    add_store(show)
    add_json(show)
    diff = verbs.add_parser("diff", help="what changed from version A to version B")
    diff.add_argument("a", metavar="A", help="the older version")
    diff.add_argument("b", metavar="B", help="the newer version")
    add_store(diff)
    add_json(diff)
    verify = verbs.add_parser("verify", help="re-hash a version's files against its manifest")
    verify.add_argument("version", metavar="VERSION", help="folder, id, id prefix or pipeline name")
    add_store(verify)
    add_json(verify)


def add_store(parser: argparse.ArgumentParser, text: str = 'the store folder (default "prefs")') -> None:
    parser.add_argument("--store", metavar="DIR", help=text)


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from rlfabric.data import DatasetError
    from rlfabric.prefs.pipeline import PipelineError
    from rlfabric.prefs.store import StoreError
    from rlfabric.runtime.config import ConfigError

    commands = {
        "build": cmd_build,
        "list": cmd_list,
        "show": cmd_show,
        "diff": cmd_diff,
        "verify": cmd_verify,
    }
    try:
        return commands[args.verb](args)
    except (ConfigError, DatasetError, PipelineError, StoreError) as exc:
        return fail(str(exc), 2)
    except ValueError as exc:  # a scorer spec the registry refuses (InvalidScorerSpec), a bad principle
        return fail(str(exc), 2)


def fail(message: str, code: int) -> int:
    first, *rest = message.strip().splitlines() or [""]
    print(f"rlfabric prefs: {first}", file=sys.stderr)
    for line in rest:
        print(f"  {line.strip()}", file=sys.stderr)
    return code


def store_dir(args: argparse.Namespace) -> Path:
    from rlfabric.prefs.store import DEFAULT_STORE

    return Path(args.store or DEFAULT_STORE)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


# -- build ----------------------------------------------------------------------------------------------


def cmd_build(args: argparse.Namespace) -> int:
    import asyncio

    from rlfabric.prefs.judging import JudgeError
    from rlfabric.prefs.pipeline import build
    from rlfabric.prefs.spec import load_pipeline
    from rlfabric.prefs.store import verify

    spec, text = load_pipeline(args.pipeline)
    policy = scorer_policy(args.scorer_policy) if args.scorer_policy else None
    try:
        result = asyncio.run(
            build(spec, text, args.pipeline, args.store, progress=not args.no_progress, policy=policy)
        )
    except JudgeError as exc:
        return fail(str(exc), 1)
    checked = verify(result.path)
    answer = {
        "id": result.id,
        "path": str(result.path),
        "existed": result.existed,
        "verified": checked.ok,
        "problems": checked.problems,
        "report": result.report,
    }
    if args.result:
        write_result(Path(args.result), answer)
    if args.json:
        print_json(answer)
    else:
        print_build(result, checked.ok)
    return 0 if checked.ok else 1


def write_result(path: Path, answer: dict[str, Any]) -> None:
    """`answer` as JSON into `path`, atomically (a reader never sees half of it)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(answer, indent=2, ensure_ascii=False), encoding="utf-8")
    temporary.replace(path)


def scorer_policy(path: str) -> Any:
    """The `ScorerPolicy` of a JSON file (`ScorerPolicy.to_json`); `ConfigError` naming the file."""
    from pydantic import ValidationError

    from rlfabric.reward.scorers.policy import ScorerPolicy
    from rlfabric.runtime.config import ConfigError

    try:
        return ScorerPolicy.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, ValidationError) as exc:
        raise ConfigError(f"--scorer-policy {path}: {type(exc).__name__}: {exc}") from None


def print_build(result: Any, verified: bool) -> None:
    report = result.report
    state = "already in the store (identical build)" if result.existed else "written"
    print(f"version {result.id} {state}")
    print(f"  path      {result.path}")
    print(f"  rows      {report['rows']} (of {report['stages']['hygiene']['in']} candidate pairs)")
    print(f"  hygiene   {dropped_line(report['hygiene']['dropped'])}")
    if report["judging"] is not None:
        print(f"  judging   {dropped_line(report['judging']['dropped'])}")
        for name, s in report["judging"]["judges"].items():
            print(
                f"  judge     {name}: {s['votes']} votes, {s['ties']} ties, {s['disagreements']} "
                f"disagreements, {s['errors']} errors, first-position rate {s['position_first_rate']}"
            )
    print(f"  verified  {'yes' if verified else 'NO'}")


def dropped_line(dropped: dict[str, int]) -> str:
    total = sum(dropped.values())
    if not total:
        return "dropped 0"
    return f"dropped {total}: " + ", ".join(f"{rule} {n}" for rule, n in dropped.items())


# -- reading the store ----------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    from rlfabric.prefs import store

    rows = []
    for folder in store.versions(store_dir(args)):
        row = store.summary(folder)
        if args.verify:
            row["verified"] = store.verify(folder).ok
        rows.append(row)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print(f"no versions in {store_dir(args)}")
        return 0
    for row in rows:
        verified = "" if "verified" not in row else ("  ok" if row["verified"] else "  FAILED")
        parents = f"  parents {','.join(p[:12] for p in row['parents'])}" if row["parents"] else ""
        print(
            f"{row['id'][:12]}  {row['created']}  {row['name']:<24} {row['rows']:>8} rows{parents}{verified}"
        )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from rlfabric.prefs import store

    folder = store.resolve(store_dir(args), args.version)
    manifest = store.read_manifest(folder)
    summary = store.summary(folder)
    if args.json:
        print_json({"summary": summary, "inputs": manifest.get("inputs"), "judges": manifest.get("judges"),
                    "generators": manifest.get("generators"), "report": manifest.get("report")})  # fmt: skip
        return 0
    print(f"version   {summary['id']}")
    print(f"name      {summary['name']}")
    print(f"path      {folder}")
    print(f"created   {summary['created']}")
    print(f"rows      {summary['rows']} in {summary['shards']} shard(s)")
    print(f"parents   {', '.join(summary['parents']) or '(none)'}")
    print(f"pipeline  sha256 {summary['pipeline_sha256']}")
    for entry in manifest.get("inputs", []):
        digest = entry.get("sha256") or entry.get("version") or f"revision {entry.get('revision')}"
        print(f"input     {entry['field']} = {entry['path']} ({digest})")
    print()
    print((folder / store.REPORT_MD).read_text(encoding="utf-8").rstrip())
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from rlfabric.prefs import store

    root = store_dir(args)
    result = store.diff(store.resolve(root, args.a), store.resolve(root, args.b))
    if args.json:
        print_json(result)
        return 0
    a, b, rows = result["a"], result["b"], result["rows"]
    print(f"a  {a['id'][:12]}  {a['name']}  {a['rows']} rows")
    print(f"b  {b['id'][:12]}  {b['name']}  {b['rows']} rows")
    print(f"rows: +{rows['added']} added, -{rows['removed']} removed, {rows['common']} in both")
    for side, key in (("+", "added_examples"), ("-", "removed_examples")):
        for row in result[key]:
            print(f"  {side} {json.dumps(row, ensure_ascii=False)[:160]}")
    for label, key in (("judges", "judges_changed"), ("generators", "generators_changed")):
        if result[key]:
            print(f"{label}: changed")
    if result["pipeline_changed"]:
        print("pipeline:")
        for line in result["pipeline_diff"]:
            print(f"  {line}")
    else:
        print("pipeline: unchanged")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from rlfabric.prefs import store

    folder = store.resolve(store_dir(args), args.version)
    checked = store.verify(folder)
    if args.json:
        print_json({"path": str(folder), "id": checked.id, "ok": checked.ok, "problems": checked.problems,
                    "notes": checked.notes})  # fmt: skip
        return 0 if checked.ok else 1
    for note in checked.notes:
        print(f"{folder}: note: {note}")
    if checked.ok:
        print(f"{folder}: version {checked.id} verifies")
        return 0
    for problem in checked.problems:
        print(f"{folder}: {problem}", file=sys.stderr)
    return 1
