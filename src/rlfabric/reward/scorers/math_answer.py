"""`math_verify`: the completion's final answer is mathematically equal to the reference (math-verify).

math-verify parses LaTeX (`\\boxed{}`, `$...$`, `\\frac`) and plain expressions into SymPy and compares
them symbolically and numerically, so "\\boxed{1/2}", "0.5" and "\\frac{1}{2}" agree.

Threads: math-verify guards parsing and comparison with `signal.alarm`, which only works on the main
thread (elsewhere it raises). This scorer passes those timeouts only when it runs on the main thread;
on worker threads it disables them and `run_scorer` enforces the time limit (`per_item = True`, so a
SymPy expression that never simplifies times out alone). The library is imported lazily: importing
the registry stays cheap and works without math-verify installed.

Outcomes: a reference that does not parse is a `scorer_error` (bad data, not the policy's fault); a
completion with no parseable answer scores 0; an answer SymPy cannot compare with the reference counts
as unequal (math-verify's own semantics).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from rlfabric.reward.scorers.base import ItemError, ScoreInput, Scorer, ScoreResult, ScorerParams
from rlfabric.reward.scorers.registry import register


class MathVerifyParams(ScorerParams):
    float_rounding: int = 6
    """Decimal places floats are rounded to before comparing."""
    numeric_precision: int = 15
    """Significant digits used for numeric evaluation."""
    strict: bool = True
    """math-verify strict mode: variables matter and sets are not comparable with tuples."""
    wrap_reference: bool = True
    """If the reference does not parse as it is, retry it as inline LaTeX (`$...$`), so that a plain
    `x^2+1` parses."""
    signal_timeout_s: int = 5
    """math-verify's own (signal-based) parse/verify timeout, used only on the main thread."""


@register
class MathVerify(Scorer):
    name = "math_verify"
    version = "1"
    description = "Final answer is mathematically equivalent to the reference (math-verify)."
    Params = MathVerifyParams
    params: MathVerifyParams
    per_item = True
    item_threads = 1  # pure-Python SymPy work: concurrent threads would only contend for the GIL

    def __init__(self, params: MathVerifyParams) -> None:
        super().__init__(params)
        import math_verify

        # Off the main thread we pass no timeout and enforce our own (runner.py); math-verify would warn
        # about that on every worker, so its logger only reports errors.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        self._mv = math_verify

    def _score_one(self, item: ScoreInput) -> ScoreResult:
        timeout = self._signal_timeout()
        gold = self._parse(item.reference, timeout)
        if not gold and self.params.wrap_reference:
            gold = self._parse(f"${item.reference}$", timeout)
        if not gold:
            raise ItemError(f"reference {item.reference[:200]!r} could not be parsed as a math answer")
        prediction = self._parse(item.completion, timeout)
        if not prediction:
            return ScoreResult.ok(0.0, {"parsed": 0.0})
        equal = self._mv.verify(
            gold,
            prediction,
            float_rounding=self.params.float_rounding,
            numeric_precision=self.params.numeric_precision,
            strict=self.params.strict,
            timeout_seconds=timeout,
        )
        return ScoreResult.ok(1.0 if equal else 0.0, {"parsed": 1.0})

    def _parse(self, text: str, timeout: int | None) -> list[Any]:
        return list(self._mv.parse(text, parsing_timeout=timeout, raise_on_error=False))

    def _signal_timeout(self) -> int | None:
        """math-verify's signal timeout where signals work (main thread); None (ours applies) elsewhere."""
        on_main = threading.current_thread() is threading.main_thread()
        return self.params.signal_timeout_s if on_main else None
