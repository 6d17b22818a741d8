"""SFT rows into ids and masks: hand-computed on the character tokenizer (one id per character, ChatML),
and on the trained BPE tokenizer with its Qwen2.5-style tool template the ids equal the incremental
rendering of a multi-turn tool conversation (what the rollout's trajectory driver produces), with the
system, user and tool tokens masked out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlfabric.learner.sft_data import (
    ChatRow,
    SFTRowError,
    SFTTokenizer,
    TextRow,
    fit,
    load_sft_data,
    parse_row,
    without_nulls,
)
from rlfabric.rollout.chat_template import SELF_TEST_CONVERSATION, SELF_TEST_TOOLS, self_test
from rlfabric.runspec import RunSpec
from rlfabric.tools.bpe_tokenizer import build_bpe_tokenizer
from rlfabric.tools.tiny_model import build_tokenizer

START, END, EOS = 4, 5, 2
"""`<|im_start|>`, `<|im_end|>` and `<|endoftext|>` of the character tokenizer."""


def chars(text: str) -> list[int]:
    """The character tokenizer's ids: newline 6, tab 7, then printable ASCII from 8 (space) on."""
    return [6 if c == "\n" else ord(c) - 24 for c in text]


def turn(role: str, content: str) -> list[int]:
    """`<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` in the character tokenizer's ids."""
    return [START, *chars(f"{role}\n{content}"), END, *chars("\n")]


GENERATION_PROMPT = [START, *chars("assistant\n")]


def make_spec(data: str = "unused.jsonl", **overrides: Any) -> RunSpec:
    raw: dict[str, Any] = {
        "mode": "sft",
        "model": {"path": "unused", "max_model_len": 64},
        "dataset": {"path": data},
    }
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return RunSpec.model_validate(raw)


@pytest.fixture(scope="module")
def char_tok() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def bpe_tok() -> Any:
    return build_bpe_tokenizer()


def encode(tokenizer: Any, row: dict[str, Any], spec: RunSpec | None = None) -> tuple[list[int], list[int]]:
    spec = spec or make_spec()
    return SFTTokenizer(tokenizer, spec).encode(parse_row(row, spec, 0), 0)


def test_a_conversation_masks_the_assistant_turn_and_its_end_token(char_tok: Any) -> None:
    ids, mask = encode(
        char_tok, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    prompt = turn("user", "hi") + GENERATION_PROMPT
    assert ids == prompt + chars("yo") + [END]
    assert mask == [0] * len(prompt) + [1, 1, 1]


def test_multi_turn_masks_by_hand(char_tok: Any) -> None:
    """user, assistant, tool, assistant, then a user message with nothing after it (dropped)."""
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "thanks"},
    ]
    ids, mask = encode(char_tok, {"messages": messages})
    first = turn("system", "s") + turn("user", "q") + GENERATION_PROMPT
    between = [*chars("\n"), START, *chars("tool\nr"), END, *chars("\n"), *GENERATION_PROMPT]
    assert ids == first + chars("a") + [END] + between + chars("b") + [END]
    assert mask == [0] * len(first) + [1, 1] + [0] * len(between) + [1, 1]


def test_two_assistant_messages_are_joined_by_the_generation_prompt(char_tok: Any) -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ids, mask = encode(char_tok, {"messages": [*messages, {"role": "assistant", "content": "b"}]})
    joint = chars("\n") + GENERATION_PROMPT
    head = turn("user", "q") + GENERATION_PROMPT
    assert ids == head + chars("a") + [END] + joint + chars("b") + [END]
    assert mask == [0] * len(head) + [1, 1] + [0] * len(joint) + [1, 1]


def test_prompt_completion_rows(char_tok: Any) -> None:
    """Strings with the chat template are a user and an assistant message (the system prompt first);
    message lists are taken as they are; without the template, plain text ending with EOS."""
    spec = make_spec(dataset={"system_prompt": "s"})
    as_text = encode(char_tok, {"prompt": "hi", "completion": "yo"}, spec)
    as_messages = encode(
        char_tok,
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "completion": [{"role": "assistant", "content": "yo"}],
        },
        spec,
    )
    assert as_text == as_messages
    assert as_text[0] == turn("system", "s") + turn("user", "hi") + GENERATION_PROMPT + chars("yo") + [END]
    plain = encode(
        char_tok, {"prompt": "2+2=", "completion": "4"}, make_spec(dataset={"chat_template": False})
    )
    assert plain == (chars("2+2=") + chars("4") + [EOS], [0, 0, 0, 0, 1, 1])


def test_sft_ids_are_the_incremental_rendering_of_a_tool_conversation(bpe_tok: Any) -> None:
    """The BPE tokenizer merges across turn boundaries, so re-tokenizing the whole conversation gives
    other ids; SFT trains exactly the ids the trajectory driver builds, the assistant turns masked in."""
    row = {"messages": [dict(m) for m in SELF_TEST_CONVERSATION], "tools": SELF_TEST_TOOLS}
    ids, mask = encode(bpe_tok, row)
    report = self_test(bpe_tok)
    assert report.ok and ids == report.incremental_ids
    starts = [*report.turn_starts, len(ids)]  # turns: system+user, assistant, tool+tool, assistant
    expected = [0] * starts[1] + [1] * (starts[2] - starts[1]) + [0] * (starts[3] - starts[2])
    assert mask == expected + [1] * (starts[4] - starts[3])
    trained = [bpe_tok.decode([i]) for i, m in zip(ids, mask, strict=True) if m]
    context = bpe_tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "<tool_call>" in trained and trained.count("<|im_end|>") == 2 and trained[-1] == "<|im_end|>"
    assert "<tool_response>" in context and "What is (12 + 30) * 2" in context and "# Tools" in context
    assert "<tool_response>" not in trained and "calculator" in bpe_tok.decode(ids[: starts[1]])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_rows_read_through_arrow_lose_its_filled_in_nulls(bpe_tok: Any, tmp_path: Path, suffix: str) -> None:
    """Rows whose messages and tool arguments have different keys (in Parquet, Arrow fills the missing
    ones with null: `tool_calls: None`, `arguments: {expression: None, city: "Paris"}`) tokenize as the
    rows written."""
    import datasets

    weather = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    other = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [weather]},
        {"role": "tool", "content": '{"sunny": true}'},
        {"role": "assistant", "content": "Sunny."},
    ]
    rows = [
        {"messages": [dict(m) for m in SELF_TEST_CONVERSATION], "tools": SELF_TEST_TOOLS},
        {"messages": other, "tools": None},
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "tools": None,
        },
    ]
    path = tmp_path / f"sft{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    spec = make_spec(str(path), model={"max_model_len": 2048}, sft={"tools": tools})
    data = load_sft_data(spec, bpe_tok)
    assert [e.example_id for e in data.train] == ["0", "1", "2"] and data.evaluation == []
    assert (data.train[0].token_ids, data.train[0].loss_mask) == encode(bpe_tok, rows[0])
    assert data.train[1].token_ids == encode(bpe_tok, {**rows[1], "tools": tools})[0]
    assert data.train[2].token_ids == encode(bpe_tok, {**rows[2], "tools": tools})[0]
    assert without_nulls({"a": None, "b": [{"c": None, "d": 1}]}) == {"b": [{"d": 1}]}


def test_fit_truncates_or_drops() -> None:
    ids, mask = list(range(10)), [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert fit(ids, mask, 20) == (ids, mask, False)
    assert fit(ids, mask, 5) == ([0, 1, 2, 3, 4], [0, 0, 0, 1, 1], True)
    assert fit(ids, mask, 3) is None  # no assistant token left to predict
    assert fit([7, 8], [1, 0], 2) is None  # the first id is predicted by nothing


def test_loading_counts_truncated_and_dropped_rows_and_holds_out_rows(char_tok: Any, tmp_path: Path) -> None:
    """max_model_len 24 fits the 21-id prompt of `user: hi` and three answer ids: a 2-character answer
    fits whole, a longer one is cut, and a longer prompt leaves no answer id at all."""
    rows = [{"prompt": "hi", "completion": "yo"}, {"prompt": "hi", "completion": "a long answer"}]
    rows += [{"prompt": "a much longer question", "completion": "yo"}]
    rows += [{"prompt": "hi", "completion": str(i)} for i in range(40)]
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = make_spec(str(path), model={"max_model_len": 24}, dataset={"held_out_fraction": 0.25})
    data = load_sft_data(spec, char_tok)
    assert data.dropped == 1 and data.truncated == 1
    assert len(data.train) + len(data.evaluation) == len(rows) - 1 and 3 < len(data.evaluation) < 20
    assert {e.example_id for e in data.train}.isdisjoint(e.example_id for e in data.evaluation)
    assert all(len(e.token_ids) <= 24 for e in data.train + data.evaluation)
    cut = next(e for e in data.train + data.evaluation if e.example_id == "1")
    assert cut.loss_mask == [0] * 21 + [1, 1, 1] and cut.token_ids[21:] == chars("a l")


@pytest.mark.parametrize(
    ("row", "field", "reason"),
    [
        ({"text": "hi"}, "sft.messages_field", "holds neither 'messages' nor both 'prompt' and 'completion'"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "sft.messages_field", "message 0 has no role"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "sft.messages_field", "not text"),
        ({"messages": [{"role": "user", "content": "x"}]}, "sft.messages_field", "no assistant message"),
        (
            {"messages": [{"role": "assistant", "content": "x"}]},
            "sft.messages_field",
            "starts with an assistant",
        ),
        ({"prompt": "p", "completion": 3}, "sft.completion_field", "not a non-empty list"),
        ({"prompt": "p", "completion": "c", "tools": "{oops"}, "sft.tools_field", "not JSON"),
        ({"prompt": "p", "completion": "c", "tools": [1]}, "sft.tools_field", "JSON-schema functions"),
    ],
)
def test_bad_rows_name_their_field(char_tok: Any, row: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(SFTRowError, match=f"^{field}: row 4 .*{reason}") as caught:
        SFTTokenizer(char_tok, make_spec()).encode(parse_row(row, make_spec(), 3), 3)
    assert caught.value.field == field and caught.value.row == 3


def test_messages_need_the_chat_template() -> None:
    spec = make_spec(dataset={"chat_template": False})
    with pytest.raises(SFTRowError, match=r"^dataset\.chat_template: row 1"):
        parse_row({"messages": [{"role": "user", "content": "x"}]}, spec, 0)
    assert parse_row({"prompt": "p", "completion": "c"}, spec, 0) == TextRow("p", "c")
    assert isinstance(parse_row({"prompt": "p", "completion": "c"}, make_spec(), 0), ChatRow)


def test_row_tools_override_the_specs() -> None:
    spec = make_spec(sft={"tools": SELF_TEST_TOOLS})
    assert parse_row({"prompt": "p", "completion": "c"}, spec, 0).tools == SELF_TEST_TOOLS  # type: ignore[union-attr]
    own = [{"type": "function", "function": {"name": "f"}}]
    assert parse_row({"prompt": "p", "completion": "c", "tools": json.dumps(own)}, spec, 0).tools == own  # type: ignore[union-attr]
