"""The hermes tool-call parser and the calculator: good calls, several per message, malformed ones
named (never raised), and arithmetic only."""

from __future__ import annotations

import pytest

from rlfabric.environment.calculator import CalculatorError, calculate
from rlfabric.environment.parsers import MalformedCall, ToolCall, get_parser, parse_hermes


def test_one_call_and_the_text_around_it() -> None:
    call = '{"name": "calculator", "arguments": {"expression": "6*7"}}'
    text = f"Let me compute.\n<tool_call>\n{call}\n</tool_call>"
    parsed = parse_hermes(text)
    assert parsed.content == "Let me compute."
    assert parsed.calls == [ToolCall("calculator", {"expression": "6*7"}, parsed.calls[0].raw)]


def test_several_calls_in_order_with_string_arguments_and_none() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    calls = parse_hermes(text).calls
    assert [(c.name, c.arguments) for c in calls if isinstance(c, ToolCall)] == [
        ("a", {"x": 1}),
        ("b", {"y": 2}),
        ("c", {}),
    ]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("{not json}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "f", "arguments": [1]}', "must be a JSON object"),
    ],
)
def test_malformed_calls_are_named_not_raised(body: str, problem: str) -> None:
    (call,) = parse_hermes(f"<tool_call>{body}</tool_call>").calls
    assert isinstance(call, MalformedCall)
    assert problem in call.problem


def test_an_unclosed_call_is_malformed_and_text_without_calls_has_none() -> None:
    parsed = parse_hermes('ok <tool_call>{"name": "f"')
    assert parsed.content == "ok"
    assert isinstance(parsed.calls[0], MalformedCall) and "not closed" in parsed.calls[0].problem
    assert parse_hermes("The answer is 42.").calls == []


def test_parsers_are_found_by_name() -> None:
    assert get_parser("hermes") is parse_hermes
    with pytest.raises(KeyError, match="hermes"):
        get_parser("nope")


@pytest.mark.parametrize(
    ("expression", "value"),
    [("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("7 / 2", 3.5), ("7 // 2", 3), ("-2 ** 2", -4), ("2 ** 10", 1024)],
)
def test_calculator_does_arithmetic(expression: str, value: float) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os').system('id')", "call syntax"),
        ("x + 1", "a name ('x')"),
        ("'a' * 3", "the constant 'a'"),
        ("1 < 2", "compare"),
        ("1 / 0", "division by zero"),
        ("2 ** 100000", "exponent"),
        ("(2 ** 1000) ** 1000", "bits"),
        ("9 ** 999 * 9 ** 999 * 9 ** 999", "bits"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 2000, "longer than"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression: str, problem: str) -> None:
    with pytest.raises(CalculatorError) as caught:
        calculate(expression)
    assert problem in str(caught.value)
