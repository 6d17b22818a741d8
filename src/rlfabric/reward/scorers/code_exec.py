"""`code_exec`: run the completion's Python code against test cases in the sandbox; reward = pass rate.

Test cases come from `metadata[tests_key]` in one of three shapes:
- `[{"input": "<stdin>", "output": "<expected stdout>"}, ...]`: the program runs with that stdin and
  passes when its stdout matches (`output_match`);
- `{"inputs": [...], "outputs": [...]}` (APPS/TACO layout): the same, column-wise;
- `["assert f(1) == 2", ...]`: each statement runs after the solution, which is executed as a module
  named `solution` (so an `if __name__ == "__main__":` block does not run); the test passes when the
  statement completes and the harness then prints a per-run random token, so a solution that exits
  early with status 0 does not pass.

Each test is a separate sandboxed process (see `sandbox.py`), so a crash or an infinite loop fails only
its own test; `total_wall_s` caps the time one item may take, and tests not started by then fail.
The code is the last fenced ```python block of the completion, or the whole completion if it has none.
Missing or malformed tests are a `scorer_error` (bad data), and so is a host without isolation unless
`allow_unisolated` is set. Components: `passed`, `total`, `timed_out`; the message names each test that
hit a limit ("test 2: cpu time limit (5 s) exceeded").

The limits are the server's (`RewardServiceConfig.sandbox`): a request's params may only lower them, and
may ask for `allow_unisolated` only where the server allows it (`policy.tighten`).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal, Self

from pydantic import Field

from rlfabric.reward.scorers.base import ItemError, ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.policy import ScorerPolicy, tighten
from rlfabric.reward.scorers.registry import register
from rlfabric.reward.scorers.text import extract_code
from rlfabric.runtime.sandbox import (
    SandboxLimits,
    SandboxRun,
    limit_exceeded,
    probe_isolation,
    run_python,
)
from rlfabric.runtime.schema import SandboxConfig

OutputMatch = Literal["exact", "trailing_whitespace", "tokens"]
_ASSERT_HARNESS = """\
namespace = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
exec(compile(open("test_case.py").read(), "test_case.py", "exec"), namespace)
print("\\n%s", flush=True)
"""


class CodeExecParams(ScorerParams):
    tests_key: str = "tests"
    """The metadata key holding the test cases."""
    extract_code: bool = True
    """Take the last fenced python block of the completion (else the completion is the code)."""
    output_match: OutputMatch = "trailing_whitespace"
    """stdout comparison: "exact"; "trailing_whitespace" ignores trailing spaces per line and trailing
    blank lines; "tokens" compares whitespace-separated tokens."""
    cpu_s: int | None = Field(default=None, gt=0)
    """CPU-time limit per test process (RLIMIT_CPU), seconds; None: the server's `sandbox.cpu_s`, which
    it may only lower (as every limit below)."""
    wall_s: float | None = Field(default=None, gt=0)
    """Wall-clock limit per test process, seconds; the process group is killed past it."""
    total_wall_s: float | None = Field(default=None, gt=0)
    """Wall-clock budget for all of one item's tests; tests not started within it fail."""
    memory_mb: int | None = Field(default=None, gt=0)
    """Address-space limit per test process (RLIMIT_AS), MiB."""
    max_processes: int | None = Field(default=None, gt=0)
    """Process/thread limit (RLIMIT_NPROC) for the sandbox uid."""
    file_size_mb: int | None = Field(default=None, gt=0)
    """Largest file the program may write, stdout included (RLIMIT_FSIZE), MiB."""
    max_open_files: int | None = Field(default=None, gt=0)
    """Open file descriptor limit (RLIMIT_NOFILE)."""
    tmpfs_mb: int | None = Field(default=None, gt=0)
    """Size of the program's private /tmp (its working directory lives there), MiB."""
    allow_unisolated: bool | None = None
    """Run even where network/pid/mount namespaces are unavailable (rlimits only): unsafe for untrusted
    code. Only where the server's `sandbox.allow_unisolated` allows it; None: the server's setting."""

    def requested_limits(self) -> dict[str, Any]:
        """The sandbox fields this request sets or leaves to the server (None)."""
        return {name: getattr(self, name) for name in SandboxConfig.model_fields}


@dataclass(frozen=True)
class CodeTest:
    """One test: stdin/expected stdout, or (when `statement` is set) an assert-style statement."""

    stdin: str = ""
    expected: str | None = None
    statement: str | None = None


def parse_tests(raw: Any) -> list[CodeTest]:
    """Test cases from metadata in any of the supported shapes; `ItemError` for anything else."""
    if isinstance(raw, dict) and {"inputs", "outputs"} <= raw.keys():
        if len(raw["inputs"]) != len(raw["outputs"]):
            raise ItemError("tests 'inputs' and 'outputs' differ in length")
        raw = [{"input": i, "output": o} for i, o in zip(raw["inputs"], raw["outputs"], strict=True)]
    if not isinstance(raw, list) or not raw:
        raise ItemError(f"tests must be a non-empty list, got {type(raw).__name__}")
    return [_parse_test(index, test) for index, test in enumerate(raw)]


def _parse_test(index: int, test: Any) -> CodeTest:
    if isinstance(test, str):
        return CodeTest(statement=test)
    if (
        isinstance(test, dict)
        and isinstance(test.get("output"), str)
        and isinstance(test.get("input", ""), str)
    ):
        return CodeTest(stdin=test.get("input", ""), expected=test["output"])
    raise ItemError(f"test {index} is neither an assert statement nor an {{input, output}} pair of strings")


def outputs_match(actual: str, expected: str, mode: OutputMatch) -> bool:
    if mode == "exact":
        return actual == expected
    if mode == "tokens":
        return actual.split() == expected.split()
    return _trim(actual) == _trim(expected)


def _trim(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@register
class CodeExec(Scorer):
    name = "code_exec"
    version = "1"
    description = "Fraction of test cases the completion's Python code passes in a sandbox."
    Params = CodeExecParams
    params: CodeExecParams
    per_item = True

    def __init__(self, params: CodeExecParams, limits: SandboxConfig) -> None:
        super().__init__(params)
        self.limits = limits
        self.isolation = probe_isolation()

    @classmethod
    def create(cls, params: ScorerParams, policy: ScorerPolicy) -> Self:
        """The request's limits within the server's: a looser one is `InvalidScorerSpec` naming it."""
        assert isinstance(params, CodeExecParams)
        return cls(params, tighten(policy.sandbox, params.requested_limits()))

    def _score_one(self, item: ScoreInput) -> ScoreResult:
        tests = parse_tests(item.metadata.get(self.params.tests_key))
        code = extract_code(item.completion) if self.params.extract_code else item.completion
        deadline = time.monotonic() + self.limits.total_wall_s
        passed = timed_out = 0
        hits: list[str] = []
        for index, test in enumerate(tests):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                hits.append(f"total wall time limit ({self.limits.total_wall_s:g} s) reached")
                break
            limits = self._limits(min(self.limits.wall_s, remaining))
            run_ok, run = self._run_test(code, test, limits)
            passed += run_ok
            timed_out += run.timed_out or run.cpu_exceeded
            hit = None if run_ok else limit_exceeded(run, limits)
            if hit is not None:
                hits.append(f"test {index}: {hit}")
        components = {"passed": float(passed), "total": float(len(tests)), "timed_out": float(timed_out)}
        return ScoreResult.ok(passed / len(tests), components, "; ".join(hits))

    def _run_test(self, code: str, test: CodeTest, limits: SandboxLimits) -> tuple[bool, SandboxRun]:
        allow = self.limits.allow_unisolated
        if test.statement is None:
            run = run_python(code, test.stdin, limits, allow_unisolated=allow)
            return run.ok and outputs_match(run.stdout, test.expected or "", self.params.output_match), run
        token = secrets.token_hex(16)
        files = {"solution.py": code, "test_case.py": test.statement}
        run = run_python(_ASSERT_HARNESS % token, "", limits, files=files, allow_unisolated=allow)
        lines = run.stdout.rstrip().splitlines()
        return run.ok and bool(lines) and lines[-1] == token, run

    def _limits(self, wall_s: float) -> SandboxLimits:
        return self.limits.to_limits(wall_s)
