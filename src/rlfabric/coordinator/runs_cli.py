"""`rlfabric runs submit|list|status|stop`: a client of the coordinator's REST API.

The API address comes from `--url` (default $RLFABRIC_API_URL, else http://127.0.0.1:8000) and the bearer
token from `--token` (default $RLFABRIC_API_TOKEN): the operator's `api.token`, or a run's own token,
which `submit` prints once (to stderr, beside the page) and which lists, shows and stops that run alone.
Exit status: 0 on success, 1 when the API answers with an error (its message is printed), 2 when it
cannot be reached or the run file cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

from rlfabric.runtime.overrides_arg import add_set_argument

DEFAULT_URL = "http://127.0.0.1:8000"
RUN_TOKEN_LINE = "run token (shown once; it reads and stops this run only): "
"""What `submit` prints before the run's own token."""


class ApiError(Exception):
    """The API answered with an error status."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the `runs` verbs and their options to `parser`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get("RLFABRIC_API_URL", DEFAULT_URL), help="API URL")
    common.add_argument(
        "--token",
        default=os.environ.get("RLFABRIC_API_TOKEN"),
        help="bearer token: the operator's, or a run's own ($RLFABRIC_API_TOKEN)",
    )
    common.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    submit = verbs.add_parser("submit", parents=[common], help="submit a run file (TOML, YAML or JSON)")
    submit.add_argument("run_file", metavar="RUN_FILE")
    submit.add_argument("--name", help="run name (overrides the file's)")
    add_set_argument(
        submit,
        "override one key of the run file (dotted path, value parsed as YAML), e.g. --set optim.lr=1e-3; "
        "repeatable; the coordinator validates the result",
    )
    listing = verbs.add_parser("list", parents=[common], help="list runs, newest first")
    listing.add_argument("--json", action="store_true", help="print JSON")
    state = verbs.add_parser("status", parents=[common], help="state, progress, counters and warnings")
    state.add_argument("run_id", metavar="RUN_ID")
    state.add_argument("--json", action="store_true", help="print JSON")
    stop = verbs.add_parser("stop", parents=[common], help="ask a run to stop")
    stop.add_argument("run_id", metavar="RUN_ID")


def run(args: argparse.Namespace) -> int:
    """Runs the verb in `args`; returns the exit status."""
    from rlfabric.runtime.config import ConfigError

    try:
        with _client(args) as client:
            return VERBS[args.verb](client, args)
    except ApiError as e:
        print(f"rlfabric runs: {e}", file=sys.stderr)
        return 1
    except (httpx.TransportError, ConfigError) as e:
        print(f"rlfabric runs: {e}", file=sys.stderr)
        return 2


def _client(args: argparse.Namespace) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout)


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    """The JSON body of a successful response; ApiError with the API's message otherwise."""
    response = client.request(method, path, **kwargs)
    if response.is_success:
        return response.json()
    raise ApiError(f"HTTP {response.status_code}: {_error_text(response)}")


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):
        return str(body.get("message") or body.get("detail") or body)
    return str(body)


def submit(client: httpx.Client, args: argparse.Namespace) -> int:
    """POST the run file; prints the run id (stdout), then the page URL and the run's own token (stderr:
    shown this once, the coordinator keeps only its digest)."""
    from rlfabric.runtime.config import parse_override, read_file, set_path

    spec = read_file(args.run_file)
    for item in args.overrides:
        set_path(spec, *parse_override(item))
    if args.name:
        spec["name"] = args.name
    record = _call(client, "POST", "/v1/runs", json=spec)
    print(record["run_id"])
    print(f"page: {client.base_url}/runs/{record['run_id']}", file=sys.stderr)
    if record.get("run_token"):
        print(RUN_TOKEN_LINE + record["run_token"], file=sys.stderr)
    return 0


def list_runs(client: httpx.Client, args: argparse.Namespace) -> int:
    """Prints a table of runs (or JSON)."""
    runs = _call(client, "GET", "/v1/runs")["runs"]
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    print(f"{'RUN':<28} {'STATE':<10} {'STEP':>6} {'VERSION':>7}  CREATED")
    for r in runs:
        print(
            f"{r['run_id']:<28} {r['state']:<10} {r['step']:>6} {r['policy_version']:>7}  {r['created_at']}"
        )
    return 0


def status(client: httpx.Client, args: argparse.Namespace) -> int:
    """Prints one run's state, progress, warnings, counters, scaling signal and latest metrics (or JSON)."""
    body = _call(client, "GET", f"/v1/runs/{args.run_id}")
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    print(
        f"run {body['run_id']}: {body['state']}, step {body['step']}, policy version {body['policy_version']}"
    )
    if body.get("error"):
        print(f"error: {body['error']}")
    for warning in body.get("warnings", []):
        print(f"warning: {warning}")
    counters = ", ".join(f"{k}={v}" for k, v in body.get("counters", {}).items())
    print(f"counters: {counters}")
    print(scaling_text(body.get("scaling")))
    if body.get("evaluation"):
        print(evaluation_text(body["evaluation"]))
    latest = {k: v for k, v in (body.get("latest_metrics") or {}).items() if not k.startswith("_")}
    if latest:
        print("latest metrics: " + json.dumps(latest))
    return 0


def scaling_text(scaling: dict[str, float] | None) -> str:
    """The autoscaling block of the status text: replicas, how busy they are, what waits, and how many
    replicas the run asks for."""
    if not scaling:
        return "scaling: no signal yet (the run has not dispatched to a replica)"
    ints = ("replicas", "in_flight_groups", "backlog_groups", "desired_replicas")
    parts = [f"{k}={int(scaling[k])}" for k in ints if k in scaling]
    parts += [f"{k}={scaling[k]:.2f}" for k in ("busy_fraction", "run_busy_fraction") if k in scaling]
    return "scaling: " + ", ".join(parts)


def evaluation_text(evaluation: dict[str, Any]) -> str:
    """The latest held-out evaluation: the run's (proxy) reward, and the gold reward with its peak when the
    run has one (`dataset.eval.reward`)."""
    parts = [f"step {evaluation['step']}"]
    if evaluation.get("reward") is not None:
        parts.append(f"reward {evaluation['reward']:.4g}")
    if evaluation.get("gold_reward") is not None:
        peak = f"peak {evaluation['gold_peak']:.4g} at step {evaluation['gold_peak_step']}"
        parts.append(f"gold reward {evaluation['gold_reward']:.4g} ({peak})")
    if evaluation.get("kl") is not None:
        parts.append(f"kl {evaluation['kl']:.4g}")
    return "evaluation: " + ", ".join(parts)


def stop(client: httpx.Client, args: argparse.Namespace) -> int:
    """Asks the run to stop."""
    body = _call(client, "POST", f"/v1/runs/{args.run_id}/stop")
    print(f"run {body['run_id']}: stop requested (state {body['state']})")
    return 0


VERBS = {"submit": submit, "list": list_runs, "status": status, "stop": stop}
