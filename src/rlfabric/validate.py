"""Checks a run spec against the world before anything runs; shared by `rlfabric config check`,
`POST /v1/runs` and `rlfabric up`.

The schema (`RunSpec`) says whether a run file is well formed; this module says whether it can run:

    scorer    the scorer exists and its parameters validate (`scorer_issues` maps the reward service's or
              the registry's `ScorerProblem`s onto the run file's fields)
    paths     each model path exists, or is a well-formed hub id; the dataset path and the evaluation
              set's path (`dataset.eval.path`) exist, or are hub ids
    models    each local model's config.json and the policy's tokenizer load (no weights), where
              transformers is installed; otherwise the check is skipped and the report says why
    dataset   the training split (and a separate evaluation split) of a local dataset reads, through
              `rlfabric.data` as the run reads it; the columns the run reads exist in its first rows;
              the first training prompts fit the context. Hub datasets are not downloaded here
    pairs     (`mode = "offline_preference"`) the prompt and the loss's columns (`preference_data`: KTO's
              first row decides between pairs and labelled rows) exist in the first rows; KTO's labels
              there are bools; a reference-free loss with `model.reference_path` is a note
    sft       (`mode = "sft"`, and an online run's `warm_start`, whose issues name `warm_start.*`) the
              first rows parse as conversations or prompt-completion rows and, with the tokenizer,
              render incrementally as the run renders them (`rlfabric.learner.sft_data`); rows longer
              than the context are a note (they are truncated)
    reward    (`mode = "reward_model"`) the chosen and rejected columns (and `margin_field`) exist in the
    model     first rows of the training and evaluation splits; with the tokenizer each row encodes as
              the run encodes it (`rlfabric.learner.reward_model_data`: messages, margins, a chat
              template where one is needed); pairs longer than the length limit are a note (left out)

The dataset checks (dataset, pairs, sft, reward model) are in `rlfabric.validate_data`.
Every issue names the run-spec field it is about (`SpecIssue.field`, dotted, e.g. `reward.params.pattern`).
Light by design: no torch, grpc or scorer import; transformers only inside `check_models`.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfabric.reward.check import check_scorer_locally
from rlfabric.reward.spec import ScorerProblem
from rlfabric.runspec import RunSpec
from rlfabric.runtime.hf import HF_LOCK
from rlfabric.runtime.paths import is_hub_id

_PART = re.compile(r"^params\.parts\[(\d+)\]\.(.+)$")
GOLD_SECTION = "dataset.eval.reward"
"""The run file's section of the evaluation's gold reward."""


@dataclass(frozen=True)
class SpecIssue:
    """Why a run cannot run: the field (dotted path), what is wrong, and a machine-readable kind."""

    field: str
    message: str
    kind: str

    @property
    def loc(self) -> list[str | int]:
        """The field as a location list: `reward.parts[1].params.x` is
        ["reward", "parts", 1, "params", "x"]."""
        parts: list[str | int] = []
        for name in self.field.split("."):
            base, *indexes = name.replace("]", "").split("[")
            parts.append(base)
            parts.extend(int(i) for i in indexes)
        return parts

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass
class CheckReport:
    """The outcome of the checks: issues refuse the run; skipped checks and notes only inform."""

    issues: list[SpecIssue] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Checks not made here, each with the reason."""
    notes: list[str] = field(default_factory=list)
    """Things worth knowing that do not stop the run (prompts that will be filtered as too long)."""
    plan: dict[str, Any] | None = None
    """The memory plan (`rlfabric.plan.report.to_json`) of a run that declares `[resources]`."""

    @property
    def ok(self) -> bool:
        return not self.issues

    def extend(self, other: CheckReport) -> None:
        self.issues += other.issues
        self.skipped += other.skipped
        self.notes += other.notes
        self.plan = other.plan or self.plan


# -- scorer ---------------------------------------------------------------------------------------------


def reward_field(problem_field: str, section: str = "reward") -> str:
    """A scorer spec's field (`name`, `params.x`, `params.parts[1].params.x`) as the run file's field in
    `section` (`reward`, or the evaluation's gold reward `dataset.eval.reward`)."""
    match = _PART.match(problem_field)
    if match:
        rest = "scorer" if match[2] == "name" else match[2]
        return f"{section}.parts[{match[1]}].{rest}"
    return f"{section}.scorer" if problem_field == "name" else f"{section}.{problem_field}"


def scorer_issues(problems: Iterable[ScorerProblem], section: str = "reward") -> list[SpecIssue]:
    """The scorer check's problems as issues of the run file's `section` (a reward section)."""
    return [SpecIssue(reward_field(p.field, section), p.reason, "invalid_scorer") for p in problems]


def uses_reward(spec: RunSpec) -> bool:
    """Whether the run scores anything (offline preference runs do not)."""
    return spec.mode == "online"


# -- paths ----------------------------------------------------------------------------------------------


def model_fields(spec: RunSpec) -> dict[str, str]:
    """Every model path the spec names, by field."""
    named = {"path": spec.model.path, "reference_path": spec.model.reference_path}
    named["critic_path"] = spec.model.critic_path
    return {f"model.{name}": path for name, path in named.items() if path is not None}


def check_paths(spec: RunSpec) -> CheckReport:
    """Model paths exist as folders or are hub ids; the dataset paths exist (or are hub ids)."""
    report = CheckReport()
    for name, path in model_fields(spec).items():
        local = Path(path)
        if local.exists() and not local.is_dir():
            report.issues.append(SpecIssue(name, f"{path!r} is a file, not a model folder", "not_a_folder"))
        elif not local.exists() and name == "model.path" and spec.model.tiny is not None:
            report.notes.append(f"{name} {path!r} does not exist yet: `rlfabric up` makes it (model.tiny)")
        elif not local.exists() and not is_hub_id(path):
            message = f"no folder {path!r}, and it is not a hub id (org/name)"
            report.issues.append(SpecIssue(name, message, "not_found"))
    for name, data in data_fields(spec).items():
        if Path(data).exists():
            continue
        if is_hub_id(data):
            report.skipped.append(f"{name} {data!r} is a hub id: its columns are not checked here")
        else:
            report.issues.append(SpecIssue(name, f"no such file or folder {data!r}", "not_found"))
    return report


def data_fields(spec: RunSpec) -> dict[str, str]:
    """Every dataset path the spec names, by field (a warm start's too)."""
    return {name: path for name, (kind, path) in spec.local_paths().items() if kind == "data"}


# -- models ---------------------------------------------------------------------------------------------


def transformers_missing() -> str | None:
    """Why model files cannot be loaded in this process, or None when they can."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed here: model configs and tokenizers were not loaded"
    return None


@dataclass
class Loaded:
    """What loading one model's files found: the tokenizer (when asked for and it loaded), the reason
    they do not load, or that a hub id is not in the local cache."""

    tokenizer: Any = None
    problem: str | None = None
    cached: bool = True


def check_models(spec: RunSpec, *, offline: bool = False) -> tuple[CheckReport, Any]:
    """Loads each local model's config and the policy's tokenizer (never weights); returns the report
    and the tokenizer (None when it did not load). Hub ids load only from the local cache; one not
    cached is skipped, or with `offline` (this machine's processes may not download: HF_HUB_OFFLINE) an
    issue: the replica could only fail at its start."""
    report = CheckReport()
    missing = transformers_missing()
    if missing is not None:
        report.skipped.append(missing)
        return report, None
    tokenizer = None
    for name, path in model_fields(spec).items():
        to_make = name == "model.path" and spec.model.tiny is not None
        if not Path(path).is_dir() and (to_make or not is_hub_id(path)):
            continue  # check_paths reported it (or noted that `up` makes it)
        loaded = load_model_files(path, tokenizer=name == "model.path")
        if loaded.problem is not None:
            report.issues.append(SpecIssue(name, loaded.problem, "model_unloadable"))
        elif not loaded.cached and offline:
            message = (
                f"no folder {path!r} here, and as a hub id it is not in the local hub cache while "
                f"HF_HUB_OFFLINE is set, so nothing here can download it: download it first "
                f"(`hf download {path}`) or unset HF_HUB_OFFLINE"
            )
            report.issues.append(SpecIssue(name, message, "model_not_cached"))
        elif not loaded.cached:
            report.skipped.append(f"{name} {path!r} is not in the local hub cache: not loaded here")
        elif name == "model.path":
            tokenizer = loaded.tokenizer
    return report, tokenizer


def hub_offline() -> bool:
    """Whether this process may not download from the hub (`HF_HUB_OFFLINE`, read as huggingface_hub
    reads it)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def load_model_files(path: str, *, tokenizer: bool) -> Loaded:
    """Loads the config (and the tokenizer) of a local folder, or of a hub id from the local cache."""
    from transformers import AutoConfig, AutoTokenizer

    hub = not Path(path).is_dir()
    try:
        AutoConfig.from_pretrained(path, local_files_only=hub)
        return Loaded(AutoTokenizer.from_pretrained(path, local_files_only=hub) if tokenizer else None)
    except Exception as exc:  # deliberately broad: any failure to load is the finding
        if hub:
            return Loaded(cached=False)
        return Loaded(problem=f"the model does not load: {type(exc).__name__}: {first_line(exc)}")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), for a one-line issue."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


# -- all together ---------------------------------------------------------------------------------------


def check_spec(
    spec: RunSpec,
    scorer_problems: Sequence[ScorerProblem] | None = None,
    gold_problems: Sequence[ScorerProblem] = (),
) -> CheckReport:
    """Every check but the scorers', whose problems the caller got (in-process or from the reward
    service; None: not checked, the caller says why in `skipped`): the run's reward's, and the
    evaluation's gold reward's (`dataset.eval.reward`)."""
    report = CheckReport(issues=scorer_issues(scorer_problems or []))
    report.issues += scorer_issues(gold_problems, GOLD_SECTION)
    report.extend(check_paths(spec))
    from rlfabric.validate_data import check_dataset, check_warm_start

    with HF_LOCK:  # the tokenizer and the data load beside the coordinator's other threads
        models, tokenizer = check_models(spec, offline=hub_offline())
        report.extend(models)
        report.extend(check_dataset(spec, tokenizer))
        report.extend(check_warm_start(spec, tokenizer))
        report.extend(check_template(spec, tokenizer))
    from rlfabric.plan.check import check_resources

    report.extend(check_resources(spec))
    report.extend(check_sampling(spec))
    return report


def check_sampling(spec: RunSpec) -> CheckReport:
    """A note for an RL run that truncates its sampling (top-p, top-k): the replicas sample from the
    truncated distribution, the learner trains the whole one (at the sampling temperature)."""
    report = CheckReport()
    sampling = spec.rollout.sampling
    if not uses_reward(spec) or sampling.temperature == 0:
        return report
    cuts = []
    if sampling.top_p < 1:
        cuts.append(f"top_p = {sampling.top_p:g}")
    if sampling.top_k > 0:
        cuts.append(f"top_k = {sampling.top_k}")
    if cuts:
        report.notes.append(
            f"rollout.sampling.{' and '.join(cuts)}: the replicas sample from the truncated distribution "
            "and the learner trains the whole one (as TRL and verl do); the gap shows in "
            "rollout_mismatch_kl, and top_p = 1 with top_k = -1 leaves none"
        )
    return report


def check_template(spec: RunSpec, tokenizer: Any) -> CheckReport:
    """A multi-turn run's chat-template self-test (`rollout.chat_template`): the template must extend a
    tool conversation token for token (and render the tools, for an environment with tools)."""
    report = CheckReport()
    if spec.environment is None or tokenizer is None:
        return report
    from rlfabric.rollout.chat_template import multi_turn_self_test

    with_tools = spec.environment.service.kind != "python"
    mismatch = multi_turn_self_test(
        tokenizer, with_tools=with_tools, template_kwargs=spec.dataset.chat_template_kwargs
    )
    if mismatch is not None:
        message = f"the chat template cannot run multi-turn trajectories token for token: {mismatch}"
        report.issues.append(SpecIssue("model.path", message, "chat_template_mismatch"))
    return report


def check_local(spec: RunSpec, run_file: str | None = None) -> CheckReport:
    """Every check in this process, the scorer built from the registry (`rlfabric config check`,
    `rlfabric up`): user functions from the run file's folder, as `rlfabric up` allows them."""
    problems = check_scorer_locally(spec.reward, run_file) if uses_reward(spec) else []
    gold = spec.dataset.eval.reward
    gold_problems = check_scorer_locally(gold, run_file) if gold is not None and uses_reward(spec) else []
    report = check_spec(spec, problems, gold_problems)
    report.extend(check_environment_locally(spec, run_file))
    return report


def check_environment_locally(spec: RunSpec, run_file: str | None) -> CheckReport:
    """A multi-turn run's environment built as `rlfabric up` serves it (its code loaded under the same
    allow-list); the problem names the field."""
    report = CheckReport()
    env = spec.environment
    if env is None or env.address is not None:
        return report
    from rlfabric.environment.loading import InvalidEnvironment, environment_factory
    from rlfabric.runtime.schema import SandboxConfig
    from rlfabric.runtime.user_code import FunctionAllowlist

    try:
        environment_factory(
            env.service, FunctionAllowlist.parse(env.allowed_functions(run_file)), SandboxConfig()
        )
    except InvalidEnvironment as exc:
        report.issues.append(SpecIssue("environment.service", str(exc), "invalid_environment"))
    return report
