"""Configuration of the coordinator process (`rlfabric serve coordinator`)."""

from __future__ import annotations

from pydantic import Field, field_validator

from rlfabric.runtime.config import StrictModel
from rlfabric.runtime.schema import LogConfig, RedisConfig
from rlfabric.runtime.user_code import allow_entry_kind


class ApiConfig(StrictModel):
    """The REST API."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port to bind; 0 picks a free port."""
    token: str | None = Field(default=None, min_length=1)
    """Bearer token required on every /v1 route; set it from RLFABRIC_COORDINATOR__API__TOKEN. The
    process refuses to start without it unless `insecure`."""
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    """Request bodies larger than this get 413."""


class ScalingConfig(StrictModel):
    """The coordinator's autoscaling rule (the bounds belong to whoever scales)."""

    target_busy_fraction: float = Field(default=0.85, gt=0.0, le=1.0)
    """Busy fraction per replica the rule aims for: desired = ceil(replicas * busy / target)."""
    tolerance: float = Field(default=0.1, ge=0.0, lt=1.0)
    """No change while busy / target is within 1 +- tolerance (as the HPA does), so noise never flaps."""
    window_s: float = Field(default=30.0, gt=0.0)
    """Seconds of history the busy fraction averages."""
    interval_s: float = Field(default=2.0, gt=0.0)
    """How often the signal is recomputed and exported."""


class ChecksConfig(StrictModel):
    """Checks of submitted runs (before they are accepted) and of running ones (while they wait)."""

    on_submit: bool = True
    """Refuse a run (422 naming the field) whose scorer, paths, model files or dataset columns are wrong
    (`rlfabric.validate`); the scorer is checked by the reward service."""
    interval_s: float = Field(default=5.0, gt=0.0)
    """How often each running run's liveness is looked at (no replica, no learner, no reward service, a
    model that does not load); a warning that appears is logged and shown in the run status."""
    learner_stall_s: float = Field(default=25.0, gt=0.0)
    """Seconds a running run may go without any learner reading its stream (or, for an offline run,
    without a learner step) before it warns that no learner consumes it."""
    reward_timeout_s: float = Field(default=5.0, gt=0.0)
    """Deadline of each call made to check the reward service (CheckScorer on submit, the liveness probe)."""


class PrefsBuildsConfig(StrictModel):
    """Preference-data builds run as jobs (`POST /v1/prefs/builds`: `rlfabric prefs build` in a child
    process). A submitted pipeline gets exactly the limits a run gets: its paths within `data_roots` /
    `model_roots`, and only the user code and credentials listed here."""

    enabled: bool = True
    """Serve the /v1/prefs/builds routes."""
    store: str = "prefs"
    """The store every build writes its version into (relative: from the working directory); a pipeline
    may leave its `store` at the default or name this folder, nothing else. Put it inside `data_roots` so
    runs may train on its versions."""
    work_dir: str = ".rlfabric/prefs-builds"
    """Where each build's folder goes: the pipeline file the coordinator writes, the policy it passes, the
    build's log and its record (build.json)."""
    max_concurrent: int = Field(default=1, ge=1, le=64)
    """Builds running at once; the others wait, queued."""
    max_queued: int = Field(default=16, ge=1, le=10_000)
    """Builds queued or running at once; a submission past it gets 429."""
    timeout_s: float = Field(default=6 * 3600.0, gt=0.0)
    """A build running longer is stopped and failed."""
    allowed_functions: list[str] = Field(default_factory=list)
    """Where a scorer judge's user code (`python_function`'s `function`) may come from, as the reward
    service's `allowed_functions`: module prefixes, "pkg.mod:attr" functions, directories. Empty (the
    default): none."""
    credential_envs: dict[str, str] = Field(default_factory=dict)
    """Environment variables a pipeline may name (`api_key_env` / `token_env` of a generator, `api_key_env`
    of an `llm_judge` scorer), each mapped to the endpoint its value may be sent to: an http(s) base URL
    (the request's `base_url` must be it or below it) or a rollout replica's host:port (exactly), as the
    reward service's `judge_api_keys`. Empty (the default): none, so a caller cannot send this process's
    environment to an endpoint of its choosing."""
    allow_local_generators: bool = False
    """Allow `kind = "local"` generators (the build starts a rollout replica on this machine)."""

    @field_validator("allowed_functions")
    @classmethod
    def _known_entry_kinds(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            allow_entry_kind(entry)
        return entries


class CoordinatorServiceConfig(StrictModel):
    """The coordinator: REST API, prompt source and the generate -> score -> enqueue pipeline."""

    api: ApiConfig = Field(default_factory=ApiConfig)
    """REST API."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    redis: RedisConfig = Field(default_factory=RedisConfig)
    """Run state, replica registry and the scored-group streams."""
    reward_address: str = "127.0.0.1:50052"
    """host:port of the reward service."""
    reward_token: str | None = Field(default=None, min_length=1)
    """Bearer token sent on every call to the reward service (its `token`); set it from
    RLFABRIC_COORDINATOR__REWARD_TOKEN. Required at start unless `insecure`."""
    rollout_token: str | None = Field(default=None, min_length=1)
    """Bearer token sent on every call to the run's rollout replicas (their `client_token`): generation,
    evaluation; set it from RLFABRIC_COORDINATOR__ROLLOUT_TOKEN. Required at start unless `insecure`."""
    learner_address: str | None = None
    """host:port of the learner's status API; None when the learner reports through Redis only."""
    learner_token: str | None = Field(default=None, min_length=1)
    """Bearer token sent to the learner's status API (its `token`); set it from
    RLFABRIC_COORDINATOR__LEARNER_TOKEN. Required at start when `learner_address` is set, unless
    `insecure`."""
    max_stream_length: int = Field(default=1024, ge=1)
    """Backpressure: stop enqueueing while the run's stream holds this many unconsumed groups."""
    data_roots: list[str] = Field(default_factory=lambda: ["."])
    """Folders a run's `dataset.path` must lie in, after resolving `..` and symlinks (relative ones are
    taken from the working directory); a spec naming a path elsewhere is refused with 422. `rlfabric up`
    allows its working directory, the run file's folder and the run directory."""
    model_roots: list[str] = Field(default_factory=lambda: ["."])
    """Folders a run's `model.path`, `model.reference_path` and `model.critic_path` must lie in, as for
    `data_roots`; hub ids (`org/name`) are allowed as well."""
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    """Checks of runs before they are accepted and while they run."""
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    """The autoscaling signal each run exports (rlfabric_coordinator_desired_replicas and friends)."""
    prefs: PrefsBuildsConfig = Field(default_factory=PrefsBuildsConfig)
    """Preference-data builds submitted as jobs."""
    stall_timeout_s: float | None = Field(default=300.0, ge=10)
    """A coordinator whose event loop does not turn for this long (a call that blocks it and never returns:
    the REST API and every run's pipeline wait behind it) writes every stack to its log and exits with
    code 75, so that whoever started it restarts it; the runs resume from Redis (`runtime.watchdog`). The
    loop turns many times a second when healthy, and slow work (loading a dataset, checks) runs off it;
    None: never."""
    insecure: bool = False
    """Serve without credentials (`rlfabric serve coordinator --insecure`): the tokens above are no longer
    required at start (those set are still used) and a WARNING is logged. For tests and loopback only."""
