"""A run refused by the submit check (422): the issues name their fields, and a run refused for its
`resources` carries its memory plan into the body (`plan`, `rlfabric plan --json`'s schema), so the
client sees what each device would hold and what to change."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError

from rlfabric.plan.check import FIELD
from rlfabric.validate import CheckReport

PLAN_KEY = "plan"
"""Key of the plan in the 422 body."""


class RunRefusal(RequestValidationError):
    """The check's issues as a 422, with the report that found them."""

    def __init__(self, errors: Sequence[Any], report: CheckReport) -> None:
        super().__init__(errors)
        self.report = report


def refusal_extras(exc: Exception) -> dict[str, Any]:
    """The 422 body's keys beyond `detail` and `message`: the plan of a run refused for its resources."""
    if not isinstance(exc, RunRefusal) or exc.report.plan is None:
        return {}
    if not any(issue.field == FIELD for issue in exc.report.issues):
        return {}
    return {PLAN_KEY: exc.report.plan}
