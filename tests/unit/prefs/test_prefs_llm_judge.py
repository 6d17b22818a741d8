"""The LLM pairwise judge: the verdict parser, template filling, and judgements from a scripted model
(the first/second mapping, both orders of one pair, errors that are never a preference)."""

import json

import pytest
from pydantic import ValidationError

from rlfabric.prefs.generation import GenerationError, Generator, GeneratorUnusable
from rlfabric.prefs.llm_judge import (
    DEFAULT_TEMPLATE,
    LlmJudgeSpec,
    LlmPairwiseJudge,
    judge_prompt,
    parse_verdict,
)
from rlfabric.prefs.types import Comparison

GENERATOR = {"kind": "openai", "base_url": "http://judge.test/v1", "model": "judge"}


@pytest.mark.parametrize(
    ("text", "verdict"),
    [
        ("[[A]]", "first"),
        ("[[B]]", "second"),
        ("[[tie]]", "tie"),
        ("[[C]]", "tie"),  # MT-bench's tie
        ("[[ b ]]", "second"),
        ("Both are fine, but A cites a source. [[A]]", "first"),
        ("Verdict: A", "first"),
        ("verdict: B.", "second"),
        ("**Final verdict:** [[tie]]", "tie"),
        ("**Verdict**: **Answer B**", "second"),
        ("Final Verdict = Response A", "first"),
        ("The winner is the first one.", "first"),
        ("Better answer: second", "second"),
        ("Judgement: a tie", "tie"),
        ("Verdict: draw", "tie"),
        ("A", "first"),
        ("  **B**.", "second"),
        ("Tie", "tie"),
        ("(A)", "first"),
        # the last verdict wins: judges reason first, and may change their mind
        ("At first [[A]] looked better... Verdict: B", "second"),
        ("Verdict: B\n...on reflection [[A]]", "first"),
        ("[[A]] [[B]] [[tie]]", "tie"),
        # no verdict
        ("", None),
        ("I cannot decide.", None),
        ("I think A is better", None),  # a letter in prose is not a verdict
        ("Verdict: As said before, both fail", None),
        ("verdict: a", None),  # the letters are capitals: "a" is an article
        ("[[D]]", None),
        ("AB", None),
        ('{"score": 3}', None),
    ],
)
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) == verdict


def spec(**overrides):
    return LlmJudgeSpec.model_validate({"generator": GENERATOR, **overrides})


def test_template_fills_only_the_placeholders():
    template = 'Q {prompt} | {first} | {second} | ref {reference} | keep {other} {"json": 1} {{x}}'
    compared = Comparison("why {first}?", "one {second}", "two", reference="r")
    assert judge_prompt(spec(template=template), compared) == (
        'Q why {first}? | one {second} | two | ref r | keep {other} {"json": 1} {{x}}'
    )


def test_chat_prompts_are_shown_as_text_and_the_system_prompt_goes_first():
    chat = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi?"}]
    asked = judge_prompt(
        spec(template="{prompt}\n{first}/{second}", system_prompt="Judge."), Comparison(chat, "x", "y")
    )
    assert asked == [
        {"role": "system", "content": "Judge."},
        {"role": "user", "content": "system: Be kind.\nuser: Hi?\nx/y"},
    ]


def test_the_default_template_asks_for_a_verdict_the_parser_reads():
    assert all(p in DEFAULT_TEMPLATE for p in ("{prompt}", "{first}", "{second}", "{reference}"))
    assert parse_verdict(DEFAULT_TEMPLATE.split("end with")[1].split("if A")[0]) == "first"


def test_spec_defaults_and_errors():
    judge_spec = spec()
    assert (judge_spec.name, judge_spec.temperature, judge_spec.template) == ("llm", 0.0, DEFAULT_TEMPLATE)
    with pytest.raises(ValidationError, match=r"\{second\}"):
        spec(template="{prompt} {first}")
    with pytest.raises(ValidationError, match="generator"):
        LlmJudgeSpec.model_validate({"template": DEFAULT_TEMPLATE})
    with pytest.raises(ValidationError, match="temprature"):
        spec(temprature=0.5)


class ScriptedModel(Generator):
    """A judge model that answers each prompt by a rule; records what it was asked."""

    def __init__(self, answer):
        self.answer = answer
        self.calls = []

    async def generate_each(self, prompts, *, n=1, max_tokens=256, temperature=1.0, seed=None):
        self.calls.append(
            {"prompts": list(prompts), "n": n, "max_tokens": max_tokens, "temperature": temperature}
        )
        answers = [self.answer(p) for p in prompts]
        return [[a] if isinstance(a, str) else a for a in answers]

    def describe(self):
        return {"kind": "scripted", "model": "judge-1"}

    async def close(self):
        self.closed = True


def prefers_the_answer_saying(word):
    """A position-blind judge: it prefers whichever answer contains `word`."""

    def answer(prompt):
        a, b = prompt.split("A: ")[1].split("\nB: ")
        if (word in a) == (word in b):
            return "Same. [[tie]]"
        return "Reasoning... [[A]]" if word in a else "Reasoning... Verdict: B"

    return answer


async def test_judgements_map_a_to_first_and_b_to_second_in_either_order():
    model = ScriptedModel(prefers_the_answer_saying("good"))
    judge = LlmPairwiseJudge(spec(template="{prompt}\nA: {first}\nB: {second}", max_tokens=64), model)
    pairs = [Comparison("q", "good", "bad"), Comparison("q", "bad", "good"), Comparison("q", "good", "good")]
    judgements = await judge.judge(pairs)
    assert [j.preference for j in judgements] == ["first", "second", "tie"]
    assert judgements[0].detail == "Reasoning... [[A]]"
    [call] = model.calls  # one batch
    assert (len(call["prompts"]), call["n"], call["max_tokens"], call["temperature"]) == (3, 1, 64, 0.0)
    assert call["prompts"][1] == "q\nA: bad\nB: good"


async def test_a_position_biased_judge_answers_the_same_letter_in_both_orders():
    """What the pipeline's both-orders check catches: a judge that always says A prefers each answer once."""
    judge = LlmPairwiseJudge(spec(), ScriptedModel(lambda prompt: "[[A]]"))
    forward, backward = await judge.judge([Comparison("q", "x", "y"), Comparison("q", "y", "x")])
    assert (forward.preference, backward.preference) == ("first", "first")


async def test_unparseable_answers_and_failed_requests_are_errors_never_preferences():
    def answer(prompt):
        if "fail" in prompt:
            return GenerationError("HTTP 400: too long")
        return "Both answers have merits." if "prose" in prompt else "[[B]]"

    judge = LlmPairwiseJudge(spec(), ScriptedModel(answer))
    prose, failed, fine = await judge.judge(
        [Comparison("prose", "x", "y"), Comparison("fail", "x", "y"), Comparison("q", "x", "y")]
    )
    assert (prose.preference, prose.detail) == ("error", "Both answers have merits.")
    assert failed.preference == "error" and "HTTP 400: too long" in failed.detail
    assert fine.preference == "second"


async def test_an_unusable_generator_fails_the_judge():
    def answer(prompt):
        raise GeneratorUnusable("HTTP 401")

    with pytest.raises(GeneratorUnusable):
        await LlmPairwiseJudge(spec(), ScriptedModel(answer)).judge([Comparison("q", "x", "y")])


async def test_describe_and_close(monkeypatch):
    monkeypatch.setenv("RLF_TEST_JUDGE_KEY", "sk-judge")
    judge = LlmPairwiseJudge(
        spec(name="gpt", generator={**GENERATOR, "api_key_env": "RLF_TEST_JUDGE_KEY"}, seed=1)
    )
    described = judge.describe()
    assert judge.name == "gpt" and described["name"] == "gpt" and described["kind"] == "llm"
    assert described["generator"]["model"] == "judge" and described["seed"] == 1
    assert described["template"] == DEFAULT_TEMPLATE
    assert "sk-judge" not in json.dumps(described)
    await judge.close()
