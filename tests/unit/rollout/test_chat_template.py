"""The chat-template self-test and the incremental renderer, on the tiny model's trained BPE tokenizer.

The BPE tokenizer has merges across turn boundaries (`ĊĊ`, `"}}Ċ`), so naive re-tokenization of a
rendered conversation really differs from the ids an engine sampled; the incremental renderer keeps them.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlfabric.rollout.chat_template import (
    SELF_TEST_CONVERSATION,
    SELF_TEST_TOOLS,
    IncrementalRenderer,
    TemplateMismatch,
    renders_tools,
    self_test,
    turns_of,
)
from rlfabric.tools.bpe_tokenizer import TOOL_CHAT_TEMPLATE, build_bpe_tokenizer
from rlfabric.tools.tiny_model import build_tokenizer

SHOWN_CONTENT = "{%- if message['content'] -%}{{- '\\n' + message['content'] -}}{%- endif -%}"
DROPS_EARLIER_REASONING = (
    "{%- if message['content'] -%}{{- '\\n' + (message['content'] if loop.last else "
    "message['content'].split('</think>')[-1].lstrip('\\n')) -}}{%- endif -%}"
)
"""An assistant tool-call turn that is no longer the last message loses its `<think>` block (as Qwen3's
template drops earlier reasoning)."""


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_bpe_tokenizer()


@pytest.fixture()
def rewriting_tokenizer() -> Any:
    tokenizer = build_bpe_tokenizer()
    assert TOOL_CHAT_TEMPLATE.count(SHOWN_CONTENT) == 1
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE.replace(SHOWN_CONTENT, DROPS_EARLIER_REASONING)
    return tokenizer


def conversation() -> list[dict[str, Any]]:
    return [dict(message) for message in SELF_TEST_CONVERSATION]


def test_turns_group_environment_messages() -> None:
    assert turns_of(SELF_TEST_CONVERSATION) == [[0, 1], [2], [3, 4], [5]]


def test_self_test_passes_for_the_bpe_template(tokenizer: Any) -> None:
    report = self_test(tokenizer)
    assert report.ok, report.mismatch
    assert report.turn_messages == [0, 2, 3, 5]
    assert report.whole_ids[: len(report.incremental_ids)] == report.incremental_ids
    assert renders_tools(tokenizer)


def test_history_rewriting_template_is_refused_naming_the_turn(rewriting_tokenizer: Any) -> None:
    report = self_test(rewriting_tokenizer)
    assert report.mismatch is not None
    assert (report.mismatch.turn, report.mismatch.role) == (2, "assistant")
    assert "rewrites earlier turns" in str(report.mismatch)
    assert str(report.mismatch).startswith("turn 2 (assistant): ")


def test_append_turn_refuses_a_rewriting_template(rewriting_tokenizer: Any) -> None:
    renderer = IncrementalRenderer(rewriting_tokenizer, SELF_TEST_TOOLS)
    messages = conversation()
    ids = renderer.append_turn([], [], messages[:2])
    ids += renderer.sampled_ids(messages[:2], messages[2])
    with pytest.raises(TemplateMismatch, match=r"turn 2 \(assistant\): the template rewrites earlier turns"):
        renderer.append_turn(ids, messages[:3], messages[3:5])


def test_boundary_merge_is_reported(tokenizer: Any) -> None:
    messages = conversation()
    messages[5]["content"] = "\n84 and 42."  # the model's first token is a newline after `assistant\n`
    report = self_test(tokenizer, messages)
    assert report.mismatch is not None
    assert report.mismatch.turn == 5
    assert "BPE merge across the turn boundary" in report.mismatch.reason


def engine_trajectory(renderer: IncrementalRenderer) -> tuple[list[int], list[list[int]]]:
    """A rollout as the driver builds it: environment turns by `append_turn`, assistant turns as an
    engine sampled them: the tool call with `"}}` and `\\n` as two tokens (the tokenizer would write
    `"}}Ċ`), the answer starting with a newline (which merges with the template's `\\n` when re-tokenized).
    Returns the trajectory and its segments."""
    messages = conversation()
    messages[5]["content"] = "\n84 and 42."
    segments = [renderer.append_turn([], [], messages[:2])]
    call = renderer.decode(renderer.sampled_ids(messages[:2], messages[2]))
    split = call.index("\n</tool_call>")
    segments.append(renderer.encode(call[:split]) + renderer.encode(call[split:]))
    so_far = [token for segment in segments for token in segment]
    segments.append(renderer.append_turn(so_far, messages[:3], messages[3:5]))
    segments.append(renderer.encode("\n84 and 42.<|im_end|>"))
    return [token for segment in segments for token in segment], segments


def test_naive_retokenization_drifts_but_incremental_ids_do_not(tokenizer: Any) -> None:
    renderer = IncrementalRenderer(tokenizer, SELF_TEST_TOOLS)
    trajectory, segments = engine_trajectory(renderer)
    messages = conversation()
    messages[5]["content"] = "\n84 and 42."
    rendered = renderer.render(messages)
    naive = renderer.encode(rendered)
    assert renderer.decode(trajectory) == rendered.removesuffix("\n")  # the same text ...
    assert naive[: len(trajectory)] != trajectory  # ... but other ids: the bug class is real here
    # Two merges (`"}}Ċ` inside the tool call, `ĊĊ` across the boundary), plus the template's final `\n`.
    assert len(naive) == len(trajectory) - 2 + 1
    start = 0
    for segment in segments:  # every sampled token stays exactly where the engine put it
        assert trajectory[start : start + len(segment)] == segment
        start += len(segment)


def test_append_turn_keeps_non_canonical_ids_and_renders_the_delta(tokenizer: Any) -> None:
    renderer = IncrementalRenderer(tokenizer, SELF_TEST_TOOLS)
    _, segments = engine_trajectory(renderer)
    delta = segments[2]
    assert renderer.decode(delta).startswith("\n<|im_start|>user\n<tool_response>\n")
    assert renderer.decode(delta).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert delta == renderer.encode(renderer.decode(delta))


def test_ids_that_do_not_match_the_rendering_are_refused(tokenizer: Any) -> None:
    renderer = IncrementalRenderer(tokenizer, SELF_TEST_TOOLS)
    messages = conversation()
    ids = renderer.append_turn([], [], messages[:2])
    ids += renderer.encode("Something else entirely.<|endoftext|>")  # not what messages[2] renders to
    with pytest.raises(TemplateMismatch, match=r"turn 2 \(assistant\): the ids so far differ"):
        renderer.append_turn(ids, messages[:3], messages[3:5])


def test_tool_results_appended_one_by_one_rewrite_the_turn(tokenizer: Any) -> None:
    # The template joins consecutive tool messages into one user turn: an environment turn must append
    # all its tool results at once, and appending them one by one is caught.
    renderer = IncrementalRenderer(tokenizer, SELF_TEST_TOOLS)
    messages = conversation()
    ids = renderer.append_turn([], [], messages[:2])
    ids += renderer.sampled_ids(messages[:2], messages[2])
    ids += renderer.append_turn(ids, messages[:3], messages[3:4])
    with pytest.raises(TemplateMismatch, match=r"turn 3 \(tool\): the template rewrites earlier turns"):
        renderer.append_turn(ids, messages[:4], messages[4:5])


def test_char_tokenizer_chatml_without_tools() -> None:
    tokenizer = build_tokenizer()
    assert not renders_tools(tokenizer)
    plain = [
        {"role": m["role"], "content": m["content"]} for m in SELF_TEST_CONVERSATION if m["role"] != "tool"
    ]
    plain.insert(3, {"role": "user", "content": "84 and 42"})
    assert self_test(tokenizer, plain, tools=None).ok


def test_template_kwargs_reach_the_renderer() -> None:
    tokenizer = build_bpe_tokenizer()
    tokenizer.chat_template = "{%- if flag is defined %}F{% endif -%}" + TOOL_CHAT_TEMPLATE
    renderer = IncrementalRenderer(tokenizer, SELF_TEST_TOOLS, template_kwargs={"flag": True})
    assert renderer.render(conversation()[:2]).startswith("F<|im_start|>system")
