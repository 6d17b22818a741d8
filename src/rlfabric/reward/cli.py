"""`rlfabric reward score` and `rlfabric reward list`: the reward service as a standalone tool.

Input rows (JSONL) use the columns `id`, `prompt` (text or chat messages), `completion`, `reference`;
every other column is passed to the scorer as metadata. Output rows are the input rows plus `reward`
(null unless the status is ok), `status`, `message`, `components` and `scorer_version`, in input order.
A completion is a string or TRL's conversational form (one assistant message); `completion_ids` (the
completion's token ids) are passed to user functions that need them. Scoring runs in-process (a worker pool
of this machine's cores) or, with `--server`, on a running service, presenting its bearer token (`--token`,
default $RLFABRIC_REWARD_TOKEN).

Problems are one line on stderr, found before any scoring where they can be: an unknown scorer or bad
parameters, a missing input file, an output that cannot be written, a malformed row (`file:line: ...`):
exit status 2. A call the service refuses or fails (UNAUTHENTICATED, UNAVAILABLE, ...) names its status:
exit status 1. When any item's scorer failed (status scorer_error or timeout) the output is still written
and the exit status is 1, unless `--allow-failures`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

TOKEN_ENV = "RLFABRIC_REWARD_TOKEN"
SPEC_HELP = (
    "a registered scorer name (see `rlfabric reward list`), or a JSON/YAML/TOML file in the run file's "
    '[reward] form, e.g. {"scorer": "composite", "parts": [{"scorer": "math_verify", "weight": 1.0}]}'
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    score = verbs.add_parser(
        "score",
        help="score a JSONL file",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    score.add_argument("--input", required=True, type=Path, help="JSONL file of items")
    score.add_argument("--output", required=True, type=Path, help="JSONL file to write (input rows + scores)")
    score.add_argument("--scorer", required=True, metavar="SPEC", help=SPEC_HELP)
    score.add_argument("--params", default="{}", help="JSON parameters for a scorer given by name")
    score.add_argument("--server", metavar="HOST:PORT", help="use a running reward service instead")
    add_token_argument(score)
    score.add_argument("--batch-size", type=int, default=64, help="items per batch (default 64)")
    score.add_argument(
        "--workers", type=int, default=None, help="in-process worker processes (default: cores)"
    )
    score.add_argument("--item-timeout", type=float, default=10.0, help="seconds per item (default 10)")
    score.add_argument("--timeout", type=float, default=300.0, help="seconds per batch (default 300)")
    score.add_argument("--no-progress", action="store_true", help="no progress bar")
    score.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit status 0 even when some items failed to score (their rows carry the status)",
    )
    score.add_argument(
        "--allow-function",
        action="append",
        default=[],
        metavar="ENTRY",
        help="in-process scoring: where python_function may load user code from (a module prefix, "
        "'pkg.mod:attr' or a directory; repeatable), as the service's allowed_functions; default none",
    )
    listing = verbs.add_parser("list", help="list the scorers and their parameters")
    listing.add_argument("--server", metavar="HOST:PORT", help="ask a running reward service")
    add_token_argument(listing)
    listing.add_argument("--json", action="store_true", help="print JSON")


def add_token_argument(parser: argparse.ArgumentParser) -> None:
    """`--token`: the service's bearer token, by default from $RLFABRIC_REWARD_TOKEN (read at run time,
    so `--help` never shows it)."""
    parser.add_argument(
        "--token",
        default=None,
        help=f"the service's bearer token, with --server (default ${TOKEN_ENV})",
    )


def server_token(args: argparse.Namespace) -> str | None:
    """The token to present: --token, else $RLFABRIC_REWARD_TOKEN, else none."""
    return args.token or os.environ.get(TOKEN_ENV) or None


def run(args: argparse.Namespace) -> int:
    from rlfabric.reward.client import RewardServiceError

    try:
        return run_list(args) if args.verb == "list" else run_score(args)
    except RewardServiceError as err:
        print(f"rlfabric reward: {args.server} answered {err}", file=sys.stderr)
        return 1


def load_spec(text: str, params_json: str) -> Any:
    """A ScorerSpec from a name (+ --params) or a spec file."""
    from rlfabric.reward.client import to_spec
    from rlfabric.runtime.config import read_file

    path = Path(text)
    if path.suffix.lower() in (".json", ".yaml", ".yml", ".toml"):
        return to_spec(read_file(path))
    return to_spec(text, json.loads(params_json))


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file, each checked as an item; ValueError "file:line: problem"."""
    if not path.is_file():
        raise ValueError(f"--input: no such file: {path}")
    rows: list[dict[str, Any]] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                rows.append(parse_row(line, f"{path}:{number}", len(rows)))
    return rows


def parse_row(line: str, where: str, index: int) -> dict[str, Any]:
    """One JSONL row, checked as an item (its completion, prompt, token ids)."""
    from rlfabric.reward.client import BadItem, item_from_row

    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each row must be an object with a `completion`")
    try:
        item_from_row(row, index)
    except BadItem as exc:
        raise ValueError(f"{where}: {exc}") from None
    return row


def check_writable(path: Path) -> None:
    """ValueError unless `path` can be written (checked before scoring, so no work is lost)."""
    target = path if path.exists() else path.parent
    if path.is_dir():
        raise ValueError(f"--output: {path} is a directory")
    if not target.is_dir() and not path.exists():
        raise ValueError(f"--output: no such directory: {path.parent}")
    if not os.access(target, os.W_OK):
        raise ValueError(f"--output: cannot write {path}: permission denied")


def batches(rows: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


def run_score(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rlfabric.reward.scorers import InvalidScorerSpec

    try:
        spec = load_spec(args.scorer, args.params)
        check_writable(args.output)
        rows = read_rows(args.input)
    except (ValueError, InvalidScorerSpec) as exc:
        print(f"rlfabric reward score: {one_line(exc)}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with tqdm(total=len(rows), unit="item", disable=args.no_progress, file=sys.stderr) as bar:
        if args.server:
            results = score_remote(args, spec, rows, bar)
        else:
            try:
                results = asyncio.run(score_local(args, spec, rows, bar))
            except InvalidScorerSpec as exc:
                hint = " (see --allow-function)" if "allowed_functions" in str(exc) else ""
                print(f"rlfabric reward score: {exc}{hint}", file=sys.stderr)
                return 2
    write_rows(args.output, rows, results)
    print_summary(results, time.perf_counter() - start)
    return exit_status(results, args.allow_failures)


def exit_status(results: list[Any], allow_failures: bool) -> int:
    """1 when an item failed to score (scorer_error, timeout) and failures are not allowed, else 0."""
    failed = sum(r.status in ("scorer_error", "timeout") for r in results)
    if failed and not allow_failures:
        print(
            f"rlfabric reward score: {failed} of {len(results)} items failed to score "
            "(see `status` and `message` in the output; --allow-failures accepts them)",
            file=sys.stderr,
        )
        return 1
    return 0


def one_line(exc: Exception) -> str:
    """An error as one line (a pydantic error's lines joined)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def score_remote(args: argparse.Namespace, spec: Any, rows: list[dict[str, Any]], bar: Any) -> list[Any]:
    from rlfabric.reward.client import RewardClient

    results = []
    with RewardClient(args.server, timeout_s=args.timeout, token=server_token(args)) as client:
        for batch in batches(rows, args.batch_size):
            results.extend(client.score(batch, spec, item_timeout_s=args.item_timeout))
            bar.update(len(batch))
    return results


async def score_local(args: argparse.Namespace, spec: Any, rows: list[dict[str, Any]], bar: Any) -> list[Any]:
    from rlfabric.reward.client import to_input
    from rlfabric.reward.config import RewardServiceConfig
    from rlfabric.reward.scorers.policy import ScorerPolicy
    from rlfabric.reward.service import RewardEngine

    config = RewardServiceConfig(allowed_functions=args.allow_function)
    engine = RewardEngine(
        workers=args.workers or os.cpu_count() or 1,
        item_timeout_s=args.item_timeout,
        inline=config.inline_scorers,
        policy=ScorerPolicy.from_config(config),
    )
    await engine.start()
    try:
        engine.resolve(spec)
        items = [to_input(row, i) for i, row in enumerate(rows)]
        gate = asyncio.Semaphore(engine.pool.size)

        async def one(batch: Sequence[Any]) -> list[Any]:
            async with gate:
                scored = await engine.score(spec, batch, timeout_s=args.timeout)
            bar.update(len(batch))
            return [local_result(item.id, r, scored) for item, r in zip(batch, scored.results, strict=True)]

        parts = await asyncio.gather(*(one(b) for b in batches(items, args.batch_size)))
    finally:
        await engine.close()
    return [r for part in parts for r in part]


def local_result(item_id: str, r: Any, scored: Any) -> Any:
    """The `ItemResult` of one item's `ScoreResult` `r` from the `ScoredBatch` `scored`."""
    from rlfabric.reward.spec import ItemResult

    return ItemResult(
        item_id,
        r.reward,
        r.status,
        r.message,
        r.components,
        scored.scorer_name,
        scored.scorer_version,
        scored.latency_s,
    )


def write_rows(path: Path, rows: list[dict[str, Any]], results: list[Any]) -> None:
    with path.open("w") as f:
        for row, result in zip(rows, results, strict=True):
            out = dict(row)
            out["reward"] = result.reward if math.isfinite(result.reward) else None
            out["status"] = result.status
            out["message"] = result.message
            out["components"] = result.components
            out["scorer_version"] = result.scorer_version
            f.write(json.dumps(out) + "\n")


def print_summary(results: list[Any], seconds: float) -> None:
    statuses = Counter(r.status for r in results)
    rewards = [r.reward for r in results if r.status == "ok"]
    mean = f"{statistics.fmean(rewards):.4f}" if rewards else "n/a"
    print(
        f"scored {len(results)} items in {seconds:.2f}s ({len(results) / max(seconds, 1e-9):.0f} items/s): "
        f"mean reward {mean} over {len(rewards)} ok, "
        f"{statuses['scorer_error']} scorer errors, {statuses['timeout']} timeouts, "
        f"{statuses['not_applicable']} not applicable"
    )


def run_list(args: argparse.Namespace) -> int:
    if args.server:
        from rlfabric.reward.client import RewardClient

        with RewardClient(args.server, token=server_token(args)) as client:
            scorers = client.list_scorers()
    else:
        from dataclasses import asdict

        from rlfabric.reward.scorers import describe_scorers

        scorers = [asdict(info) for info in describe_scorers()]
    if args.json:
        print(json.dumps(scorers, indent=2))
        return 0
    for s in scorers:
        print(f"{s['name']} (v{s['version']}): {s['description']}")
        for p in s.get("params", []):
            default = (
                "required" if p.get("required") else f"default {p.get('default') or p.get('default_json')}"
            )
            print(f"    {p['name']}: {p['type']}, {default}. {p['description']}")
    return 0
