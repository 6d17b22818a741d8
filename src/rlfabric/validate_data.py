"""The dataset checks of `rlfabric.validate`: the first rows of a run's data read as the run reads them.

    dataset   the training split (and a separate evaluation split) of a local dataset reads, through
              `rlfabric.data`; the columns the run reads exist in its first rows; the first training
              prompts fit the context. Hub datasets are not downloaded here
    pairs     (`mode = "offline_preference"`) the prompt and the loss's columns exist in the first rows;
              KTO's labels there are bools
    sft       (`mode = "sft"`, and an online run's `warm_start`, whose issues name `warm_start.*`) the
              first rows parse and render as the SFT run renders them
    reward    (`mode = "reward_model"`) the chosen and rejected columns exist and encode as the run
    model     encodes them

`rlfabric.validate.check_spec` runs them with the policy's tokenizer; each issue names its run-spec field.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from rlfabric.runspec import RunSpec
from rlfabric.validate import CheckReport, SpecIssue, first_line, uses_reward

FIRST_ROWS = 16
"""Rows of the dataset whose columns and prompt lengths are checked."""


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
            message = f"row {index + 1} does not render with the chat template: {first_line(exc)}"
            return CheckReport(issues=[SpecIssue("model.path", message, "chat_template_mismatch")])
    long = [n for n in lengths if n > spec.model.max_model_len]
    if not long:
        return CheckReport()
    summary = f"{len(long)} of the first {len(lengths)} rows exceed model.max_model_len (longest {max(long)})"
    return CheckReport(notes=[f"model.max_model_len: {summary}; they are truncated"])


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
            message = f"row {index + 1} does not render with the chat template: {first_line(exc)}"
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
