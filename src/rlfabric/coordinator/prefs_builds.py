"""Preference-data builds as coordinator jobs: `rlfabric prefs build` in a child process per build.

A submitted pipeline (already checked against the operator's limits, `prefs_limits`) is written into the
build's own folder under `prefs.work_dir`, with the scorer policy the operator allows, and built by

    python -m rlfabric.cli prefs build <folder>/pipeline.json --store <prefs.store>
        --scorer-policy <folder>/policy.json --result <folder>/result.json --no-progress

under the process guard (`local.procs.ServiceProcess(guarded=True)`: nothing it starts outlives it or the
coordinator), in the coordinator's working directory (where the pipeline's relative paths were checked).
At most `prefs.max_concurrent` run at once; the API only records and reads. The child gets the
coordinator's environment without its own secrets (`RLFABRIC_COORDINATOR__*`).

State lives in memory and in one JSON file per build (`<folder>/build.json`), not in Redis: a build is
this process's child and dies with it, so its state means nothing beyond this coordinator, and its
folder already holds its pipeline, log and result. On start the records are read back; a build that was
queued or running is marked failed (the coordinator restarted under it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import subprocess
import sys
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from rlfabric.coordinator.config import PrefsBuildsConfig
from rlfabric.local.procs import ServiceProcess
from rlfabric.runtime.user_code import FunctionAllowlist

log = logging.getLogger(__name__)

BUILD_ID_PATTERN = r"^[0-9a-f]{16}$"
"""A build id: 16 lowercase hex digits (random)."""
RECORD, PIPELINE, POLICY = "build.json", "pipeline.json", "policy.json"
RESULT, LOG = "result.json", "build.log"
SECRET_PREFIX = "RLFABRIC_COORDINATOR__"
"""The coordinator's own settings (its tokens among them): never passed to a build."""
ERROR_LINES = 20
"""Lines of the build's output kept as its error."""


class BuildState(StrEnum):
    """queued -> running -> succeeded | failed."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class BuildNotFound(LookupError):
    """No build has this id."""


class TooManyBuilds(RuntimeError):
    """`prefs.max_queued` builds are queued or running."""


class BuildRecord(BaseModel):
    """A build: `GET /v1/prefs/builds/{id}`."""

    build_id: str
    """The build's id."""
    name: str
    """The pipeline's `name`."""
    state: BuildState
    """queued, running, succeeded or failed."""
    created_at: datetime
    """When it was submitted (UTC)."""
    updated_at: datetime
    """When its state last changed."""
    version_id: str | None = None
    """The dataset version's id, once succeeded."""
    version_path: str | None = None
    """The version's folder in the coordinator's store, once succeeded (a run's `dataset.path`)."""
    existed: bool | None = None
    """Whether an identical version was already in the store."""
    verified: bool | None = None
    """Whether the version verified against its manifest after the build."""
    summary: dict[str, Any] | None = None
    """Once succeeded: rows, the stage counts, what hygiene dropped by rule, and per judge its votes,
    ties, disagreements and errors with what judging dropped by rule."""
    error: str | None = None
    """Why it failed: the build's last lines of output."""


class BuildList(BaseModel):
    """Body of `GET /v1/prefs/builds`, newest first."""

    builds: list[BuildRecord] = Field(default_factory=list)
    """The builds."""


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The build report's counts without the judges' descriptions."""
    judging = report.get("judging")
    if judging is not None:
        judges = {n: {k: v for k, v in s.items() if k != "describe"} for n, s in judging["judges"].items()}
        judging = {"dropped": judging["dropped"], "judges": judges}
    return {
        "rows": report["rows"],
        "stages": report["stages"],
        "hygiene": report["hygiene"],
        "judging": judging,
    }


def now() -> datetime:
    return datetime.now(UTC)


class PrefsBuilds:
    """The builds of this coordinator: submit, read, and the workers that run them."""

    def __init__(self, config: PrefsBuildsConfig) -> None:
        self.config = config
        self.work = Path(config.work_dir).resolve()
        self.store = Path(config.store).resolve()
        self.records: dict[str, BuildRecord] = {}
        self._slots = asyncio.Semaphore(config.max_concurrent)
        self._tasks: set[asyncio.Task[None]] = set()
        self._procs: dict[str, ServiceProcess] = {}
        self.load()

    # -- records ----------------------------------------------------------------------------------------

    def load(self) -> None:
        """Reads the records back; unfinished ones are failed (their process died with the coordinator)."""
        if not self.work.is_dir():
            return
        for path in sorted(self.work.glob(f"*/{RECORD}")):
            record = BuildRecord.model_validate_json(path.read_text(encoding="utf-8"))
            self.records[record.build_id] = record
            if record.state in (BuildState.QUEUED, BuildState.RUNNING):
                self.finish(record, BuildState.FAILED, error="the coordinator restarted during the build")

    def save(self, record: BuildRecord) -> None:
        """Writes the record atomically into its folder."""
        path = self.work / record.build_id / RECORD
        temporary = path.with_suffix(".tmp")
        temporary.write_text(record.model_dump_json(indent=2), encoding="utf-8")
        temporary.replace(path)

    def get(self, build_id: str) -> BuildRecord:
        try:
            return self.records[build_id]
        except KeyError:
            raise BuildNotFound(f"no build {build_id!r}") from None

    def newest(self, limit: int = 100) -> list[BuildRecord]:
        """The newest `limit` builds, newest first."""
        return sorted(self.records.values(), key=lambda r: r.created_at, reverse=True)[:limit]

    def finish(self, record: BuildRecord, state: BuildState, **fields: Any) -> None:
        for key, value in fields.items():
            setattr(record, key, value)
        record.state, record.updated_at = state, now()
        self.save(record)

    # -- submitting -------------------------------------------------------------------------------------

    def submit(self, name: str, pipeline: dict[str, Any]) -> BuildRecord:
        """Records a build of `pipeline` (the body as submitted, already checked) and queues it."""
        unfinished = [r for r in self.records.values() if r.state in (BuildState.QUEUED, BuildState.RUNNING)]
        if len(unfinished) >= self.config.max_queued:
            raise TooManyBuilds(f"{len(unfinished)} builds are queued or running (prefs.max_queued)")
        build_id = secrets.token_hex(8)
        folder = self.work / build_id
        folder.mkdir(parents=True, mode=0o700)
        (folder / PIPELINE).write_text(json.dumps(pipeline, indent=2, ensure_ascii=False), encoding="utf-8")
        (folder / POLICY).write_text(json.dumps(self.policy()), encoding="utf-8")
        created = now()
        record = BuildRecord(
            build_id=build_id, name=name, state=BuildState.QUEUED, created_at=created, updated_at=created
        )
        self.records[build_id] = record
        self.save(record)
        task = asyncio.get_running_loop().create_task(self.run(record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return record

    def policy(self) -> dict[str, Any]:
        """The scorer judges' policy (`ScorerPolicy.to_json`): the operator's user code and the credential
        variables that go to URLs; the sandbox's defaults."""
        from rlfabric.runtime.schema import SandboxConfig

        urls = {env: home for env, home in self.config.credential_envs.items() if "://" in home}
        functions = FunctionAllowlist.parse(self.config.allowed_functions).entries()
        return {
            "allowed_functions": functions,
            "sandbox": SandboxConfig().model_dump(),
            "judge_api_keys": urls,
        }

    # -- running ----------------------------------------------------------------------------------------

    async def run(self, record: BuildRecord) -> None:
        """Waits for a slot, then builds; the record says how it ended."""
        async with self._slots:
            self.finish(record, BuildState.RUNNING)
            try:
                await self.build(record)
            except asyncio.CancelledError:
                self.finish(record, BuildState.FAILED, error="the coordinator stopped during the build")
                raise
            except Exception as exc:  # recorded: a build's failure must not take the coordinator down
                log.exception("prefs build %s could not run", record.build_id)
                self.finish(record, BuildState.FAILED, error=f"could not run: {type(exc).__name__}: {exc}")

    async def build(self, record: BuildRecord) -> None:
        folder = self.work / record.build_id
        proc = ServiceProcess(
            f"prefs-build-{record.build_id}",
            self.argv(folder),
            log_path=folder / LOG,
            env=child_env(),
            cwd=os.getcwd(),
            guarded=True,
        )
        self._procs[record.build_id] = proc
        try:
            proc.launch()
            code = await asyncio.to_thread(wait, proc, self.config.timeout_s)
        finally:
            await asyncio.to_thread(proc.stop, 10)
            self._procs.pop(record.build_id, None)
        result_path = folder / RESULT
        if code == 0 or (code == 1 and result_path.exists()):
            self.succeeded(record, json.loads(result_path.read_text(encoding="utf-8")))
            return
        ending = "timed out (prefs.timeout_s)" if code is None else f"exited with code {code}"
        tail = "\n".join(list(proc.tail)[-ERROR_LINES:])
        self.finish(record, BuildState.FAILED, error=f"the build {ending}:\n{tail}".strip())

    def argv(self, folder: Path) -> list[str]:
        argv = [sys.executable, "-m", "rlfabric.cli", "prefs", "build", str(folder / PIPELINE)]
        argv += ["--store", str(self.store), "--scorer-policy", str(folder / POLICY)]
        return [*argv, "--result", str(folder / RESULT), "--no-progress"]

    def succeeded(self, record: BuildRecord, result: dict[str, Any]) -> None:
        """Records a written version; one that does not verify fails the build."""
        fields = {
            "version_id": result["id"],
            "version_path": result["path"],
            "existed": result["existed"],
            "verified": result["verified"],
            "summary": summarize(result["report"]),
        }
        if result["verified"]:
            self.finish(record, BuildState.SUCCEEDED, **fields)
        else:
            error = "the version does not verify: " + "; ".join(result["problems"])
            self.finish(record, BuildState.FAILED, error=error, **fields)

    async def close(self) -> None:
        """Stops every build (their records say so) and waits for the workers."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


def wait(proc: ServiceProcess, timeout_s: float) -> int | None:
    """The process's exit code, or None when it ran past `timeout_s`."""
    assert proc.proc is not None
    try:
        return proc.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def child_env() -> dict[str, str]:
    """The coordinator's environment without its own settings and tokens."""
    return {k: v for k, v in os.environ.items() if not k.startswith(SECRET_PREFIX)}
