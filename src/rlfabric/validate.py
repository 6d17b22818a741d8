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

from rlfabric.data import (
    DatasetError,
    DatasetVersionError,
    Source,
    eval_source,
    read_records,
    training_source,
)
from rlfabric.reward.check import check_scorer_locally
from rlfabric.reward.spec import ScorerProblem
from rlfabric.runspec import RunSpec
from rlfabric.runtime.hf import HF_LOCK
from rlfabric.runtime.paths import is_hub_id

FIRST_ROWS = 16
"""Rows of the dataset whose columns and prompt lengths are checked."""
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
        return Loaded(problem=f"the model does not load: {type(exc).__name__}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


# -- dataset --------------------------------------------------------------------------------------------


def column_fields(spec: RunSpec, first: Any = None) -> dict[str, str]:
    """The columns the run reads from each row, by the field that names them; `first` is the dataset's
    first row (it decides a KTO run's format: `rlfabric.learner.preference_data`)."""
    data = spec.dataset
    if spec.mode == "sft":
        return {}  # a row holds messages, or a prompt and a completion: `check_sft_rows`
    if spec.mode == "reward_model":  # the prompt column is optional (TRL's implicit-prompt form)
        rm = spec.reward_model
        columns = {
            "reward_model.chosen_field": rm.chosen_field,
            "reward_model.rejected_field": rm.rejected_field,
        }
        if rm.margin_field is not None:
            columns["reward_model.margin_field"] = rm.margin_field
        return columns
    columns = {"dataset.prompt_field": data.prompt_field}
    if spec.mode == "offline_preference":
        from rlfabric.learner.preference_data import preference_columns

        columns.update(preference_columns(spec.preference, first))
        return columns
    if data.reference_field is not None:
        columns["dataset.reference_field"] = data.reference_field
    columns.update({f"dataset.metadata_fields[{i}]": c for i, c in enumerate(data.metadata_fields)})
    return columns


def check_dataset(spec: RunSpec, tokenizer: Any = None, rows: int = FIRST_ROWS) -> CheckReport:
    """The first `rows` rows of the training split (and of a separate evaluation split) hold every column
    the run reads; with a tokenizer, the training prompts fit. Sources not on this machine (hub ids)
    are left out: `check_paths` reported or skipped them."""
    records, report = first_records(training_source(spec.dataset), rows)
    if records is None:
        return report
    report.issues += missing_columns(spec, records)
    if spec.dataset.eval.separate and (uses_reward(spec) or spec.mode == "reward_model"):
        evaluated, eval_report = first_records(eval_source(spec.dataset), rows)
        report.extend(eval_report)
        if evaluated is not None:
            report.issues += missing_columns(spec, evaluated, within="the evaluation set")
    if spec.mode == "offline_preference" and not report.issues:
        report.extend(check_preference_rows(spec, records))
    if spec.mode == "sft" and not report.issues:
        report.extend(check_sft_rows(spec, records, tokenizer))
    elif spec.mode == "reward_model":
        if tokenizer is not None and not report.issues:
            report.extend(check_reward_rows(spec, records, tokenizer))
    elif tokenizer is not None and not report.issues:
        report.extend(check_prompt_lengths(spec, records, tokenizer))
    return report


def first_records(source: Source, rows: int) -> tuple[list[Any] | None, CheckReport]:
    """The first `rows` rows of a local source's split, or None with the issue that keeps them from being
    read (no issue for a source that is not local). A preference dataset version that does not verify
    against its manifest is an issue of kind "unverified"."""
    if not Path(source.path).exists():
        return None, CheckReport()
    try:
        records = read_records(source)[:rows]
    except DatasetError as exc:
        kind = "unverified" if isinstance(exc, DatasetVersionError) else "unreadable"
        return None, CheckReport(issues=[SpecIssue(f"{source.field}.path", str(exc), kind)])
    if not records:
        message = f"{source.path}: the split {source.split!r} is empty"
        return None, CheckReport(issues=[SpecIssue(f"{source.field}.path", message, "empty")])
    return records, CheckReport()


def missing_columns(spec: RunSpec, records: Sequence[Any], within: str = "the dataset") -> list[SpecIssue]:
    """One issue per column the run reads that a row lacks (the first such row named); `within` names
    the set in the message."""
    issues = []
    for name, column in column_fields(spec, records[0] if records else None).items():
        lacking = [i for i, r in enumerate(records, 1) if not isinstance(r, dict) or column not in r]
        if lacking:
            message = f"column {column!r} is missing from row {lacking[0]} of {within}"
            issues.append(SpecIssue(name, message, "missing_column"))
    return issues


def prompt_budget(spec: RunSpec) -> tuple[str, int]:
    """The field that bounds a prompt's length and the longest prompt it allows, in tokens."""
    if spec.mode == "offline_preference":
        return "model.max_model_len", spec.model.max_model_len - 1
    return "rollout.sampling.max_tokens", spec.model.max_model_len - spec.rollout.sampling.max_tokens


def check_prompt_lengths(spec: RunSpec, records: Sequence[dict[str, Any]], tokenizer: Any) -> CheckReport:
    """An issue when no room is left for a prompt or none of the first prompts fits; a note when some
    do not (those are filtered when the run loads its prompts)."""
    bound, budget = prompt_budget(spec)
    if budget <= 0:
        message = f"leaves no room for a prompt within model.max_model_len {spec.model.max_model_len}"
        return CheckReport(issues=[SpecIssue(bound, message, "no_room")])
    lengths = [prompt_tokens(spec, r[spec.dataset.prompt_field], tokenizer) for r in records]
    long = [n for n in lengths if n > budget]
    if not long:
        return CheckReport()
    summary = f"{len(long)} of the first {len(lengths)} prompts exceed {budget} tokens (longest {max(long)})"
    if len(long) == len(lengths):
        return CheckReport(issues=[SpecIssue("dataset.prompt_field", f"{summary}: none fits", "too_long")])
    return CheckReport(notes=[f"dataset.prompt_field: {summary}; those are filtered out"])


def prompt_tokens(spec: RunSpec, prompt: Any, tokenizer: Any) -> int:
    """The prompt's length in tokens as the run renders it (chat template when asked and available)."""
    if spec.dataset.chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        prompt = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    elif not isinstance(prompt, str):
        prompt = "\n".join(str(m.get("content", "")) for m in prompt)
    return len(tokenizer.encode(prompt, add_special_tokens=False))


# -- offline preference ---------------------------------------------------------------------------------


def check_preference_rows(spec: RunSpec, records: Sequence[Any]) -> CheckReport:
    """KTO's unpaired rows: the first label that is not a bool is an issue naming `preference.label_field`.
    A reference-free loss (orpo, simpo) with `model.reference_path` set is a note: it is not loaded."""
    from rlfabric.learner.preference_data import (
        REFERENCE_FREE_LOSSES,
        PreferenceRowError,
        kto_label,
        kto_reads_pairs,
    )

    pref, report = spec.preference, CheckReport()
    if pref.loss in REFERENCE_FREE_LOSSES and spec.model.reference_path is not None:
        report.notes.append(f"model.reference_path: loss {pref.loss!r} uses no reference; it is not loaded")
    if pref.loss != "kto" or kto_reads_pairs(pref, records[0]):
        return report
    try:
        for index, record in enumerate(records):
            kto_label(pref, record, index)
    except PreferenceRowError as exc:
        report.issues.append(SpecIssue(exc.field, exc.detail, "bad_row"))
    return report


# -- sft ------------------------------------------------------------------------------------------------


def check_sft_rows(spec: RunSpec, records: Sequence[Any], tokenizer: Any) -> CheckReport:
    """The first rows as the SFT run reads them: the first row that does not parse is one issue naming
    its field; with a tokenizer each row renders as the run renders it (a template that cannot be
    rendered incrementally is an issue of `model.path`) and rows longer than the context are a note."""
    from rlfabric.learner.sft_data import SFTRowError, SFTTokenizer, parse_row

    encoder = SFTTokenizer(tokenizer, spec) if tokenizer is not None else None
    lengths = []
    for index, record in enumerate(records):
        try:
            parsed = parse_row(record if isinstance(record, dict) else {}, spec, index)
            if encoder is not None:
                lengths.append(len(encoder.encode(parsed, index)[0]))
        except SFTRowError as exc:
            return CheckReport(issues=[SpecIssue(exc.field, exc.detail, "bad_row")])
        except ValueError as exc:  # the template's refusal (`TemplateMismatch`) or its absence
            message = f"row {index + 1} does not render with the chat template: {_first_line(exc)}"
            return CheckReport(issues=[SpecIssue("model.path", message, "chat_template_mismatch")])
    long = [n for n in lengths if n > spec.model.max_model_len]
    if not long:
        return CheckReport()
    summary = f"{len(long)} of the first {len(lengths)} rows exceed model.max_model_len (longest {max(long)})"
    return CheckReport(notes=[f"model.max_model_len: {summary}; they are truncated"])


# -- reward model ---------------------------------------------------------------------------------------


def check_reward_rows(spec: RunSpec, records: Sequence[Any], tokenizer: Any) -> CheckReport:
    """The first rows as the reward-model run encodes them: the first row that does not is one issue
    naming its field; pairs with a side longer than the length limit are a note (they are left out)."""
    from rlfabric.learner.reward_model_data import PairEncoder
    from rlfabric.learner.sft_data import SFTRowError

    encoder = PairEncoder(tokenizer, spec)
    too_long = 0
    for index, record in enumerate(records):
        try:
            too_long += encoder.encode(record, str(index), index) is None
        except SFTRowError as exc:
            return CheckReport(issues=[SpecIssue(exc.field, exc.detail, "bad_row")])
        except ValueError as exc:  # the template's refusal to render the messages
            message = f"row {index + 1} does not render with the chat template: {_first_line(exc)}"
            return CheckReport(issues=[SpecIssue("model.path", message, "chat_template_mismatch")])
    if not too_long:
        return CheckReport()
    limit = "reward_model.max_length" if spec.reward_model.max_length else "model.max_model_len"
    summary = f"{too_long} of the first {len(records)} pairs have a side longer than {limit}"
    if too_long == len(records):
        return CheckReport(issues=[SpecIssue(limit, f"{summary}: none fits", "too_long")])
    return CheckReport(notes=[f"{limit}: {summary}; they are left out"])


WARM_START_SECTIONS = ("dataset", "sft", "optim", "train")
"""The sections of a warm start: its issues about them are named `warm_start.<field>`."""


def check_warm_start(spec: RunSpec, tokenizer: Any) -> CheckReport:
    """The warm start's data as its SFT run reads it (`check_dataset` of `RunSpec.warm_start_spec`)."""
    if spec.warm_start is None:
        return CheckReport()
    report = check_dataset(spec.warm_start_spec(), tokenizer)
    report.issues = [warm_start_issue(issue) for issue in report.issues]
    report.notes = [f"warm_start: {note}" for note in report.notes]
    return report


def warm_start_issue(issue: SpecIssue) -> SpecIssue:
    """An issue of the warm start's SFT spec named as the online run file names its field."""
    if not issue.field.startswith(WARM_START_SECTIONS):
        return issue
    return SpecIssue(f"warm_start.{issue.field}", issue.message, issue.kind)


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
