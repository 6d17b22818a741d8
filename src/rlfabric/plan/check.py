"""The memory check of a run that declares `[resources]`: `POST /v1/runs` and `rlfabric up` refuse a run
whose plan does not fit (`rlfabric.validate.check_spec` calls `check_resources`). A run without
`[resources]` is not planned and never refused for memory."""

from __future__ import annotations

from rlfabric.runspec import RunSpec
from rlfabric.validate import CheckReport, SpecIssue

FIELD = "resources"
"""The run spec's field a refusal names."""
KIND = "resources_do_not_fit"
"""The machine-readable kind of the refusal (the 422's `type`)."""


def check_resources(spec: RunSpec) -> CheckReport:
    """An issue naming `resources` with the verdict and the first change that fits, and the plan as JSON
    (`CheckReport.plan`), when the declared resources cannot hold the run; skipped when the plan cannot
    be made (the model's config is not found: `check_models` reports that)."""
    report = CheckReport()
    if spec.resources is None:
        return report
    from rlfabric.plan import report as show
    from rlfabric.plan.planner import PlanError, make_plan, verdict

    try:
        plan = make_plan(spec)
    except PlanError as exc:
        report.skipped.append(f"{FIELD}: not planned: {exc}")
        return report
    report.plan = show.to_json(plan)
    if not plan.fits:
        fixes = [s.change for s in plan.suggestions if s.fits]
        hint = f"; it fits with {fixes[0]}" if fixes else ""
        report.issues.append(SpecIssue(FIELD, f"{verdict(plan)}{hint} (rlfabric plan)", KIND))
    return report
