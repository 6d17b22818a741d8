"""The `calculator` tool: arithmetic on numbers, evaluated by walking Python's AST (never `eval`).

Allowed: int and float literals, `+ - * / // % **`, unary `+ -` and parentheses. Anything else (names,
calls, attributes, strings, comparisons) is refused with `CalculatorError`, and so are results that would
grow without bound: an exponent above `MAX_EXPONENT`, an integer longer than `MAX_INT_BITS` bits, an
expression longer than `MAX_EXPRESSION_CHARS`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 1000
MAX_INT_BITS = 4096

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the model."""


def calculate(expression: str) -> Number:
    """The value of an arithmetic `expression`; `CalculatorError` saying why when there is none."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> Number:
    """The value of one node; only numbers and arithmetic operators are accepted."""
    if isinstance(node, ast.Constant) and _is_number(node.value):
        assert isinstance(node.value, int | float)
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        return _checked(_apply(node.op, left, right))
    raise CalculatorError(f"only numbers and + - * / // % ** are allowed, not {_describe(node)}")


def _apply(op: ast.operator, left: Number, right: Number) -> Number:
    """`left op right`, with the exponent bounded and arithmetic faults as `CalculatorError`."""
    if isinstance(op, ast.Pow) and abs(right) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
    try:
        return _BINARY[type(op)](left, right)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("the result is too large") from None


def _checked(value: Number | complex) -> Number:
    """`value` when it is a finite real number of bounded size."""
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"the result has more than {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not finite")
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _describe(node: ast.expr) -> str:
    """What a refused node is, for the message: `a name ('x')`, `a call`."""
    if isinstance(node, ast.Name):
        return f"a name ({node.id!r})"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return f"{type(node).__name__.lower()} syntax"
