"""`rlfabric up` after start-up: the REST calls with the run's token, the watch loop that supervises the
services while it shows progress, `--resume`'s look at the run's record, and the summary.

The watch loop tolerates a coordinator that does not answer (it is being restarted): it says so once,
keeps supervising, and goes on when the coordinator is back. Ctrl-C (or SIGTERM) asks the coordinator to
stop the run and keeps watching until the run is final; a second one leaves at once. Several runs
(`watch_runs`) are watched alike, each step of each run printed on its own line; Ctrl-C stops them all;
their replicas are scaled by the fleet's signal (`FleetSignal`), summed over the runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from rlfabric.local.scaler import LocalScaler
from rlfabric.local.supervisor import Supervisor

INTERRUPTED = "interrupted"
"""The watch's own end state after a second Ctrl-C (never a run's)."""
ResumeAction = Literal["done", "submit", "resume"]
"""What `--resume` does with the run: nothing (it completed), submit it (it never was), or let the
restarted coordinator pick it up."""
DESIRED_REPLICAS = "desired_replicas"
"""The field of a scaling signal (a run's `scaling` in its status, a fleet's `keys.fleet_scaling` hash)
that the local scaler follows."""


class Api:
    """The coordinator's REST API as `up` uses it, every call with the run's bearer token."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 10.0) -> None:
        import httpx

        self.url, self.token = url, token
        headers = {"Authorization": f"Bearer {token}"}
        self.client = httpx.Client(base_url=url, headers=headers, timeout=timeout_s)

    def submit(self, spec: Any) -> str:
        """Submits the run; returns its id (httpx.HTTPStatusError on a refusal)."""
        response = self.client.post("/v1/runs", json=json.loads(spec.model_dump_json()), timeout=30)
        response.raise_for_status()
        return str(response.json()["run_id"])

    def status(self, run_id: str) -> dict[str, Any]:
        """GET /v1/runs/{id} (httpx.HTTPError when the coordinator does not answer well)."""
        response = self.client.get(f"/v1/runs/{run_id}")
        response.raise_for_status()
        return dict(response.json())

    def stop(self, run_id: str) -> None:
        """Asks the coordinator to stop the run; a run already final (409) counts as stopped."""
        response = self.client.post(f"/v1/runs/{run_id}/stop")
        if response.status_code != 409:
            response.raise_for_status()


class Watch:
    """One `up`'s watch loop state (see `watch`)."""

    def __init__(self, api: Api, run_id: str, supervisor: Supervisor, scaler: LocalScaler | None) -> None:
        self.api, self.run_id, self.supervisor, self.scaler = api, run_id, supervisor, scaler
        self.status: dict[str, Any] = {}
        self.stop_wanted = False
        """Ctrl-C was pressed; the stop request is sent (again) until the coordinator took it."""
        self.unreachable_since: float | None = None

    def tick(self) -> None:
        """One look: supervise, send a pending stop, read the run's status (httpx.HTTPError when the
        coordinator does not answer)."""
        self.supervisor.poll()
        if self.supervisor.gave_up:
            self.give_up(self.supervisor.gave_up)
            return
        if self.stop_wanted:
            self.api.stop(self.run_id)
            self.stop_wanted = False
        self.status = self.api.status(self.run_id)
        if self.unreachable_since is not None:
            print(f"coordinator answers again (after {time.monotonic() - self.unreachable_since:.0f} s)")
            self.unreachable_since = None

    def unreachable(self, error: Exception) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
            print(f"coordinator does not answer ({type(error).__name__}); waiting for it", flush=True)

    def give_up(self, reason: str) -> None:
        """Supervision failed: stop the run if the coordinator still answers, and end as failed."""
        import httpx

        from rlfabric.coordinator.runs import RunState

        with contextlib.suppress(httpx.HTTPError):  # the run fails here whatever the coordinator records
            self.api.stop(self.run_id)
        self.status = {**self.status, "state": RunState.FAILED, "error": f"supervision gave up: {reason}"}

    def interrupted(self) -> None:
        """Ctrl-C: the first asks for a stop; the second leaves at once (KeyboardInterrupt)."""
        if self.stop_wanted or self.status.get("stop_requested"):
            self.status = {**self.status, "state": INTERRUPTED}
            raise KeyboardInterrupt
        print("\nstopping the run ...", flush=True)
        self.stop_wanted = True


def watch(
    api: Api,
    run_id: str,
    steps: int,
    *,
    progress: bool,
    supervisor: Supervisor,
    scaler: LocalScaler | None = None,
) -> dict[str, Any]:
    """Polls the run every second until it ends, supervising the services and scaling the replicas by
    the run's signal (when there is a scaler); returns the last status ("interrupted" after a second
    Ctrl-C, "failed" when supervision gave up)."""
    import httpx
    from tqdm import tqdm

    from rlfabric.coordinator.runs import FINISHED

    bar = tqdm(total=steps, unit="step", disable=not progress, dynamic_ncols=True)
    bar.last_step = 0
    state = Watch(api, run_id, supervisor, scaler)
    while state.status.get("state") not in (*FINISHED, INTERRUPTED):
        try:
            time.sleep(1.0)
            state.tick()
        except KeyboardInterrupt:
            try:
                state.interrupted()
            except KeyboardInterrupt:
                break
            continue
        except httpx.HTTPError as exc:
            state.unreachable(exc)
            continue
        show_progress(bar, state.status, progress=progress)
        if scaler is not None:
            follow_signal(scaler, state.status, bar)
    bar.close()
    return state.status


def follow_signal(scaler: LocalScaler, status: dict[str, Any], bar: Any) -> None:
    """One reading of the run's desired replica count for the local scaler."""
    desired = (status.get("scaling") or {}).get(DESIRED_REPLICAS)
    scale(scaler, None if desired is None else int(desired), bar.write)


def scale(scaler: LocalScaler, desired: int | None, say: Callable[[str], None]) -> None:
    """One reading of a desired replica count for the local scaler; `say` tells a change."""
    event = scaler.observe(desired, time.monotonic())
    if event is not None:
        verb = "adding" if event.action == "out" else "removing"
        wanted = f"{event.running_before} running, {event.desired} wanted"
        say(f"autoscale: {verb} {event.replica} ({wanted})")


class FleetSignal:
    """The fleet's desired replica count, summed over its runs by the coordinator's fleet scheduler
    (`keys.fleet_scaling`), read from Redis."""

    def __init__(self, redis_url: str, fleet: str) -> None:
        import redis

        from rlfabric.contracts import keys

        self.client = redis.Redis.from_url(redis_url)
        self.key = keys.fleet_scaling(fleet)

    def desired(self) -> int | None:
        """The latest count; None before the scheduler wrote one (or after the last run left)."""
        value = self.client.hget(self.key, DESIRED_REPLICAS)
        return None if value is None else int(float(value))

    def close(self) -> None:
        self.client.close()


SHOWN_METRICS = ("reward_mean", "eval_reward_mean", "eval_gold_reward_mean", "kl", "tokens_per_s")
"""The latest metrics the watch shows for a run."""


def shown_metrics(status: dict[str, Any]) -> dict[str, str]:
    """The run's latest `SHOWN_METRICS` it has, formatted."""
    metrics = status.get("latest_metrics") or {}
    fields = {k: metrics.get(k) for k in SHOWN_METRICS}
    return {k: f"{v:.3g}" for k, v in fields.items() if isinstance(v, int | float)}


def show_progress(bar: Any, status: dict[str, Any], *, progress: bool) -> None:
    """Advances the bar to the run's step; without a bar, prints one line per new step."""
    step = int(status.get("step") or 0)
    shown = shown_metrics(status)
    if step > bar.last_step:
        bar.last_step = step
        bar.update(max(step - bar.n, 0))
        if not progress:
            print(f"step {step}: " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    bar.set_postfix(shown, refresh=True)


class RunsWatch:
    """The watch of several runs (see `watch_runs`): one `Watch` per run, one line per new step of each."""

    def __init__(
        self,
        api: Api,
        run_ids: list[str],
        supervisor: Supervisor,
        scaler: LocalScaler | None = None,
        signal: FleetSignal | None = None,
    ) -> None:
        self.watches = [Watch(api, run_id, supervisor, None) for run_id in run_ids]
        self.shown_step = dict.fromkeys(run_ids, 0)
        self.scaler, self.signal = scaler, signal

    def pending(self) -> list[Watch]:
        """The runs not final yet."""
        from rlfabric.coordinator.runs import FINISHED

        return [w for w in self.watches if w.status.get("state") not in (*FINISHED, INTERRUPTED)]

    def tick(self) -> None:
        """One look at every pending run (httpx.HTTPError, said by the run it concerns, when the
        coordinator does not answer)."""
        import httpx

        for watch in self.pending():
            try:
                watch.tick()
            except httpx.HTTPError as exc:
                watch.unreachable(exc)
                raise
            self.show(watch.run_id, watch.status)
        self.follow_fleet()

    def follow_fleet(self) -> None:
        """One reading of the fleet's signal for the scaler (none while Redis does not answer)."""
        import redis

        if self.scaler is None or self.signal is None:
            return
        try:
            desired = self.signal.desired()
        except redis.RedisError:  # tolerated: Redis is being restarted; the next reading decides
            return
        scale(self.scaler, desired, lambda line: print(line, flush=True))

    def show(self, run_id: str, status: dict[str, Any]) -> None:
        step = int(status.get("step") or 0)
        if step > self.shown_step[run_id]:
            self.shown_step[run_id] = step
            fields = " ".join(f"{k}={v}" for k, v in shown_metrics(status).items())
            print(f"{run_id} step {step}: {fields}", flush=True)

    def interrupted(self) -> bool:
        """Ctrl-C: the first asks every run to stop; the second (True) leaves at once."""
        pending = self.pending()
        if any(w.stop_wanted or w.status.get("stop_requested") for w in pending):
            for watch in pending:
                watch.status = {**watch.status, "state": INTERRUPTED}
            return True
        print("\nstopping the runs ...", flush=True)
        for watch in pending:
            watch.stop_wanted = True
        return False

    def statuses(self) -> dict[str, dict[str, Any]]:
        return {w.run_id: w.status for w in self.watches}


def watch_runs(
    api: Api,
    run_ids: list[str],
    *,
    supervisor: Supervisor,
    scaler: LocalScaler | None = None,
    signal: FleetSignal | None = None,
) -> dict[str, dict[str, Any]]:
    """Polls several runs every second until all end, supervising the services and scaling the fleet's
    replicas by its signal (when there is a scaler); returns each run's last status, by run id (as
    `watch` does for one)."""
    import httpx

    state = RunsWatch(api, run_ids, supervisor, scaler, signal)
    while state.pending():
        try:
            time.sleep(1.0)
            state.tick()
        except KeyboardInterrupt:
            if state.interrupted():
                break
        except httpx.HTTPError:
            continue  # said once by the run's watch; supervision goes on
    return state.statuses()


def prepare_resume(redis_url: str, run_id: str) -> ResumeAction:
    """Looks at the run's record in its Redis before the coordinator starts: a stopped or failed run is
    reopened (the restarted coordinator then resumes it, as it does a running one); a completed run is
    left alone; a run never submitted is submitted."""
    return asyncio.run(_prepare_resume(redis_url, run_id))


async def _prepare_resume(redis_url: str, run_id: str) -> ResumeAction:
    from redis.asyncio import Redis

    from rlfabric.coordinator.runs import RunNotFound, RunState, RunStore

    redis = Redis.from_url(redis_url)
    try:
        store = RunStore(redis)
        try:
            record = await store.get(run_id)
        except RunNotFound:
            print(f"run {run_id} was never submitted; submitting it", flush=True)
            return "submit"
        if record.state == RunState.COMPLETED:
            print(f"run {run_id} already completed at step {record.step}; nothing to resume", flush=True)
            return "done"
        if record.finished:
            await store.reopen(run_id)
        print(f"run {run_id} was {record.state} at step {record.step}; resuming it", flush=True)
        return "resume"
    finally:
        await redis.aclose()


def summarize(
    status: dict[str, Any],
    run_dir: Path,
    run_id: str,
    scaler: LocalScaler | None,
    supervisor: Supervisor | None = None,
) -> None:
    from rlfabric.learner.export import final_model_dir, is_committed
    from rlfabric.local.plot import plot

    run_path = run_dir / run_id
    png = plot(run_path / "metrics.jsonl", run_path / "curves.png")
    print(f"\nrun {run_id}: {status.get('state')} at step {status.get('step')}")
    for key in ("error", "stop_reason", "last_good_checkpoint"):
        if status.get(key) is not None:
            print(f"  {key.replace('_', ' ')}: {status[key]}")
    for warning in status.get("warnings") or []:
        print(f"  warning: {warning}")
    if supervisor is not None:
        restarts = supervisor.restarts
        listed = ", ".join(f"{name} {n}" for name, n in sorted(restarts.items())) or "none"
        hangs = supervisor.hangs
        hung = f"; {sum(hangs.values())} after a hang" if hangs else ""
        print(f"  restarts: {sum(restarts.values())} ({listed}{hung})")
    if scaler is not None:
        outs = sum(e.action == "out" for e in scaler.events)
        ins = len(scaler.events) - outs
        print(f"  autoscaling: {outs} added, {ins} removed, {scaler.failed_starts} failed to start")
    held_out = held_out_line(run_path / "metrics.jsonl")
    if held_out:
        print(f"  {held_out}")
    for name, value in sorted((status.get("counters") or {}).items()):
        print(f"  {name}: {value}")
    final = final_model_dir(run_path)
    if is_committed(final):
        print(f"  final model: {final} (a Hugging Face folder: transformers and vLLM load it)")
    print(f"  run directory: {run_path} (metrics.jsonl, checkpoints/, weights/, logs in {run_dir / 'logs'})")
    if png:
        print(f"  curves: {png}")


def held_out_line(metrics: Path) -> str:
    """The held-out reward of the run's first and last evaluations (`health.evaluations` of its metrics
    rows), e.g. "held-out reward: 0.007 at step 0 -> 0.880 at step 12"; "" without any."""
    from rlfabric.coordinator.health import evaluations

    if not metrics.is_file():
        return ""
    rows = []
    for line in metrics.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a row being written
            rows.append(json.loads(line))
    found = [e for e in evaluations([r for r in rows if isinstance(r, dict)]) if e.proxy is not None]
    parts = found[:1] + found[1:][-1:]  # the first and, when there are more, the last
    return (
        "held-out reward: " + " -> ".join(f"{e.proxy:.3f} at step {e.step}" for e in parts) if parts else ""
    )
