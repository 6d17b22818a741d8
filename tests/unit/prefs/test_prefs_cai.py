"""Constitutional AI critique-revise chains with a scripted generator (the exact prompts of each step, the
answer carried from principle to principle, one batch per step), and loading principles files."""

import json
from pathlib import Path

import pytest

from rlfabric.prefs.cai import Principle, critique_revise, load_principles
from rlfabric.runtime.config import ConfigError

EXAMPLE = Path(__file__).parents[3] / "examples" / "rlhf" / "principles.toml"


class ScriptedGenerator:
    """A `TextGenerator` that critiques with "C<k>(<answer>)" and revises with "R<k>(<answer>)", k counting
    its calls; records each call."""

    def __init__(self):
        self.calls = []

    async def generate(self, prompts, *, n=1, max_tokens=256, temperature=1.0, seed=None):
        self.calls.append(
            {"prompts": prompts, "n": n, "max_tokens": max_tokens, "temperature": temperature, "seed": seed}
        )
        kind = "C" if len(self.calls) % 2 else "R"
        return [
            [f"{kind}{len(self.calls)}({p[-4]['content'] if kind == 'R' else p[-2]['content']})"]
            for p in prompts
        ]

    def describe(self):
        return {"kind": "scripted"}

    async def close(self):
        pass


PRINCIPLES = [
    Principle(name="honest", critique="Is {answer} honest? {keep}", revision="Fix it given: {critique}"),
    Principle(name="brief", critique="Too long?", revision="Shorten {answer} for {prompt}."),
]


async def test_each_principle_critiques_then_revises_the_current_answer():
    gen = ScriptedGenerator()
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "q2"}]
    chains = await critique_revise(
        gen, ["q1", chat], ["a1", "a2"], PRINCIPLES, max_tokens=32, temperature=0.5, seed=7
    )
    assert len(gen.calls) == 4  # one batch per step, two per principle
    assert [len(c["prompts"]) for c in gen.calls] == [2, 2, 2, 2]
    assert [c["seed"] for c in gen.calls] == [7, 9, 11, 13]  # no two steps share seeds
    assert {(c["n"], c["max_tokens"], c["temperature"]) for c in gen.calls} == {(1, 32, 0.5)}

    first, second = chains
    assert (first.prompt, first.original, second.prompt, second.original) == ("q1", "a1", chat, "a2")
    honest, brief = first.steps
    assert honest.principle == "honest" and brief.principle == "brief"
    assert honest.critique_prompt == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "Is a1 honest? {keep}"},
    ]
    assert honest.critique == "C1(a1)"
    assert honest.revision_prompt == [
        *honest.critique_prompt,
        {"role": "assistant", "content": "C1(a1)"},
        {"role": "user", "content": "Fix it given: C1(a1)"},
    ]
    assert honest.revision == "R2(a1)"
    # the next principle starts from the revision
    assert brief.critique_prompt[-2:] == [
        {"role": "assistant", "content": "R2(a1)"},
        {"role": "user", "content": "Too long?"},
    ]
    assert brief.revision_prompt[-1] == {"role": "user", "content": "Shorten R2(a1) for q1."}
    assert first.revised == brief.revision == "R4(R2(a1))"
    # a chat prompt keeps its messages, and {prompt} shows them as text
    assert second.steps[0].critique_prompt[:2] == chat
    assert second.steps[1].revision_prompt[-1]["content"] == "Shorten R2(a2) for system: S\nuser: q2."


async def test_no_principles_or_no_rows():
    gen = ScriptedGenerator()
    [chain] = await critique_revise(gen, ["q"], ["a"], [])
    assert chain.steps == () and chain.revised == "a" and gen.calls == []
    assert await critique_revise(gen, [], [], PRINCIPLES) == []
    with pytest.raises(ValueError, match="2 prompts but 1 answers"):
        await critique_revise(gen, ["q", "r"], ["a"], PRINCIPLES)


async def test_a_generation_failure_propagates():
    class Failing(ScriptedGenerator):
        async def generate(self, prompts, **kwargs):
            raise RuntimeError("endpoint down")

    with pytest.raises(RuntimeError, match="endpoint down"):
        await critique_revise(Failing(), ["q"], ["a"], PRINCIPLES)


def test_the_example_principles_load():
    principles = load_principles(EXAMPLE)
    assert [p.name for p in principles] == ["helpful", "honest", "harmless", "concise"]
    assert all(p.critique and p.revision for p in principles)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_yaml_and_json_as_a_list_or_under_principles(tmp_path, suffix):
    items = [{"name": "x", "critique": "c", "revision": "r"}]
    for data in (items, {"principles": items}):
        path = tmp_path / f"p{suffix}"
        path.write_text(json.dumps(data))  # JSON is YAML too
        assert load_principles(path) == [Principle(name="x", critique="c", revision="r")]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "p.toml",
            '[[principles]]\nname = "x"\ncritique = "c"\n',
            r"principles\[0\]\.revision: Field required",
        ),
        (
            "p.toml",
            '[[principles]]\nname = "x"\ncritique = "c"\nrevision = "r"\n'
            '[[principles]]\nname = "y"\ncritique = ""\nrevision = "r"\n',
            r"principles\[1\]\.critique: String should have at least 1 character",
        ),
        (
            "p.yaml",
            "- {name: x, critique: 'c {critique}', revision: r}",
            r"principles\[0\]\.critique: .*only known",
        ),
        ("p.yaml", "- {name: x, critique: c, revision: r, weight: 2}", r"principles\[0\]\.weight: Extra"),
        (
            "p.yaml",
            "- {name: x, critique: c, revision: r}\n- {name: x, critique: c, revision: r}",
            r"principles\[1\]\.name: 'x' repeats principles\[0\]",
        ),
        ("p.yaml", "principles: []", "principles: expected a non-empty list"),
        ("p.yaml", "rules: []", "rules: unknown key"),
        ("p.json", '"just text"', "principles: expected a non-empty list"),
        ("p.toml", "principles = [", "not valid toml"),
        ("p.txt", "x", "unsupported format '.txt'"),
    ],
)
def test_principles_errors_name_the_file_and_field(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_principles(path)
    assert str(path) in str(err.value)


def test_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="principles file not found"):
        load_principles(tmp_path / "nope.toml")
