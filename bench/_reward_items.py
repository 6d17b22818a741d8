"""Realistic, distinct items for the reward benchmarks (deterministic for a given seed).

math_verify items mix fractions, decimals, integers, square roots and polynomials, with the final answer
in `\\boxed{}` or `$...$` after a few reasoning steps; about a quarter are wrong and a few have no final
answer (about 70 % score 1). exact_match items are short answers, some differing from the reference only
in case or surrounding spaces, about a third wrong.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction

from rlfabric.reward.scorers import ScoreInput


def math_items(n: int, seed: int) -> list[ScoreInput]:
    """`n` distinct math items: fractions, decimals, integers, roots, polynomials, in \\boxed{} or $...$,
    with a reasoning preamble; about a quarter wrong and a few with no final answer."""
    rng = random.Random(seed)
    makers = [_fraction, _decimal, _integer, _root, _polynomial]
    return [_math_item(i, rng, makers[i % len(makers)]) for i in range(n)]


def _math_item(
    i: int, rng: random.Random, make: Callable[[int, random.Random], tuple[str, str, str]]
) -> ScoreInput:
    question, reference, answer = make(i, rng)
    roll = rng.random()
    if roll < 0.05:
        final = "I could not finish the computation."
    else:
        if roll < 0.3:
            answer = f"{answer} + {rng.randint(1, 9)}"
        final = rng.choice([f"The final answer is $\\boxed{{{answer}}}$.", f"So the answer is ${answer}$."])
    steps = " ".join(
        f"Step {k}: we simplify term {k} of the expression." for k in range(1, rng.randint(2, 6))
    )
    return ScoreInput(f"m{i}", question, f"Let's think step by step. {steps} {final}", reference)


def _fraction(i: int, rng: random.Random) -> tuple[str, str, str]:
    value = Fraction(rng.randint(1, 500) + i, rng.randint(2, 97))
    reference = f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    shown = f"{value.numerator * 2}/{value.denominator * 2}" if i % 2 else reference
    return f"Simplify {value.numerator * 3}/{value.denominator * 3}.", reference, shown


def _decimal(i: int, rng: random.Random) -> tuple[str, str, str]:
    value = Fraction(i + 1, rng.choice([2, 4, 5, 8, 10, 16, 20, 25]))
    decimal = f"{float(value):.6g}"
    return f"Write {value} as a decimal.", decimal, f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def _integer(i: int, rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    return f"Compute {a} * {b} + {i}.", str(a * b + i), str(a * b + i)


def _root(i: int, rng: random.Random) -> tuple[str, str, str]:
    """The reference is in $...$: a bare `3\\sqrt{2}` parses as 3 and would never match."""
    outer, inner = i % 40 + 2, rng.choice([2, 3, 5, 6, 7])
    return (
        f"Simplify sqrt({outer * outer * inner}).",
        f"${outer}\\sqrt{{{inner}}}$",
        f"\\sqrt{{{outer * outer * inner}}}",
    )


def _polynomial(i: int, rng: random.Random) -> tuple[str, str, str]:
    a = i % 50 + 1
    return f"Expand (x+{a})^2.", f"x^2+{2 * a}x+{a * a}", f"(x+{a})^2"


def exact_items(n: int, seed: int) -> list[ScoreInput]:
    """`n` distinct short-answer items; about a third wrong, some differing only in case or spaces."""
    rng = random.Random(seed)
    words = ["paris", "oxygen", "42", "mitochondria", "photosynthesis", "euler", "7/8", "blue whale"]
    items = []
    for i in range(n):
        reference = f"{rng.choice(words)} {i}"
        completion = reference.upper() if rng.random() < 0.2 else f"  {reference} "
        if rng.random() < 0.33:
            completion = f"{rng.choice(words)} {i + 1}"
        items.append(ScoreInput(f"e{i}", f"Question {i}: name the thing.", completion, reference))
    return items
