"""Incremental rendering of a chat template, and the self-test proving it keeps the engine's tokens.

A multi-turn trajectory is token-in/token-out: the ids the engine sampled, plus the environment's turns
appended as ids. It is never a rendered conversation re-tokenized, because re-tokenizing gives other ids
when a BPE merge joins two turns (`assistant\\n` + `\\nHello` becomes `ĊĊ`), when the engine sampled a
non-canonical split (`}` then `\\n` where the tokenizer would write `}Ċ`), or when the template rewrites
earlier turns (drops earlier reasoning): the learner would train on tokens the policy never produced.

Incremental rendering, precisely. Write R(m, g) for the template rendered to text (with the tools, and
`add_generation_prompt=g`; R of no messages is ""), T for encoding without added special tokens and D for
decoding that keeps special tokens. A conversation's state is (ids, messages), with D(ids) a prefix of
R(messages, False): the text up to and including the last assistant turn's end token. To append an
environment turn (the prompt, a user reply, or *all* the tool results of one step, since the template
joins consecutive tool messages into one turn), `IncrementalRenderer.append_turn` takes

    prev = R(messages, False)
    next = R(messages + new_messages, True)
    1. next starts with prev            (else: the template rewrites earlier turns; refused)
    2. prev starts with D(ids)          (else: the template renders a turn unlike the ids sampled; refused)
    3. return T(next[len(D(ids)):])     (the new ids; `ids` themselves are never touched)

so the new ids start with the text the template puts after the assistant's end token (`\\n` for ChatML)
and end with the generation prompt. An assistant turn is whatever the engine sampled, up to and
including the end-of-turn token. Both checks refuse by default with `TemplateMismatch`, which names the
turn (the index of the message in the conversation) and the reason: a template that rewrites history
cannot be trained on token-in/token-out without the trajectory disagreeing with what the template would
render at inference, and we don't paper over that silently.

`self_test` renders a multi-turn tool conversation whole (`apply_chat_template(..., tokenize=True)`) and
incrementally (each assistant turn as an engine sampling the canonical tokens would produce it: T of the
assistant's text through its end token) and compares the ids. `check_model_template` runs it on a model
folder (for `rlfabric config check-template` and for the multi-turn driver at start). transformers is
imported only inside `check_model_template`.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
"""A chat message as `apply_chat_template` takes it: role, content, and optionally `tool_calls`."""

SELF_TEST_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def _call(expression: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


SELF_TEST_CONVERSATION: list[Message] = [
    {"role": "system", "content": "You are a helpful assistant. Use the tools."},
    {"role": "user", "content": "What is (12 + 30) * 2, and 7 * 6?"},
    {
        "role": "assistant",
        "content": "<think>\nTwo products; call the calculator twice.\n</think>\n\nLet me compute.",
        "tool_calls": [_call("(12 + 30) * 2"), _call("7 * 6")],
    },
    {"role": "tool", "content": '{"result": 84}'},
    {"role": "tool", "content": '{"result": 42}'},
    {"role": "assistant", "content": "<think>\nBoth done.\n</think>\n\n84 and 42."},
]
"""System, user, an assistant turn with reasoning and two tool calls, both tool results, the final answer."""


class TemplateMismatch(ValueError):
    """The chat template cannot be rendered incrementally: which turn (message index) and why."""

    def __init__(self, turn: int, role: str, reason: str) -> None:
        super().__init__(f"turn {turn} ({role}): {reason}")
        self.turn = turn
        self.role = role
        self.reason = reason


class IncrementalRenderer:
    """Appends environment turns to a trajectory's ids by incremental rendering (module docstring)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tools: Sequence[dict[str, Any]] | None = None,
        end_token: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools: list[Any] | None = list(tools) if tools else None
        self.template_kwargs = dict(template_kwargs or {})
        """Extra variables of the template (the run's `chat_template_kwargs`, e.g. `enable_thinking`)."""
        self.end_token = end_token or default_end_token(tokenizer)
        """The text ending an assistant turn: where the engine stops and the environment's ids begin."""

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """R(messages, add_generation_prompt); "" for no messages."""
        if not messages:
            return ""
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        """T(text): the ids of `text`, no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """D(ids): the exact text of `ids`, special tokens kept."""
        return str(
            self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def append_turn(
        self, ids_so_far: Sequence[int], messages_so_far: Sequence[Message], new_messages: Sequence[Message]
    ) -> list[int]:
        """The ids of the environment turn `new_messages`, to append to `ids_so_far` (which stay as they
        are), ending with the generation prompt. Raises `TemplateMismatch` naming the turn when the
        template rewrites an earlier turn or renders one unlike `ids_so_far`."""
        prev = self.render(messages_so_far)
        following = self.render([*messages_so_far, *new_messages], add_generation_prompt=True)
        if not following.startswith(prev):
            raise self._mismatch(
                messages_so_far, ids_so_far, prev, following, "the template rewrites earlier"
            )
        text_so_far = self.decode(ids_so_far)
        if not prev.startswith(text_so_far):
            raise self._mismatch(messages_so_far, ids_so_far, text_so_far, prev, "the ids so far differ from")
        return self.encode(following[len(text_so_far) :])

    def sampled_ids(self, messages_so_far: Sequence[Message], message: Message) -> list[int]:
        """The ids an engine sampling the canonical tokens would produce for the assistant `message`: T of
        its rendered text from after the generation prompt through the end token. For the self-test."""
        prompt = self.render(messages_so_far, add_generation_prompt=True)
        text = self.render([*messages_so_far, message])
        turn = len(messages_so_far)
        if not text.startswith(prompt):
            reason = "the rendered assistant turn does not start with the generation prompt"
            raise TemplateMismatch(turn, "assistant", reason)
        body = text[len(prompt) :]
        end = body.find(self.end_token)
        if end < 0:
            raise TemplateMismatch(
                turn, "assistant", f"the rendered turn has no end token {self.end_token!r}"
            )
        return self.encode(body[: end + len(self.end_token)])

    def _mismatch(
        self, messages: Sequence[Message], ids: Sequence[int], old: str, new: str, what: str
    ) -> TemplateMismatch:
        """A `TemplateMismatch` at the first character where `new` stops extending `old`."""
        offset = common_prefix_length(old, new)
        turn = self._turn_at(messages, offset)
        token = self._token_at(ids, offset)
        reason = (
            f"{what} turns: the rendered prefix differs at char {offset} (token {token} of the ids so far), "
            "so the trajectory would not be what the template renders; refused"
        )
        return TemplateMismatch(turn, str(messages[turn]["role"]) if messages else "?", reason)

    def _turn_at(self, messages: Sequence[Message], offset: int) -> int:
        """Index of the message whose rendering holds character `offset` of R(messages)."""
        for end in range(1, len(messages) + 1):
            if len(self.render(messages[:end])) > offset:
                return end - 1
        return max(len(messages) - 1, 0)

    def _token_at(self, ids: Sequence[int], offset: int) -> int:
        """Index of the token of `ids` holding character `offset` of D(ids) (len(ids) past the end)."""
        lengths = _LazyPrefixLengths(self, ids)
        return bisect.bisect_right(lengths, offset, 0, len(ids))


class _LazyPrefixLengths(Sequence[int]):
    """len(D(ids[: i + 1])) for each i, computed on access (for a binary search)."""

    def __init__(self, renderer: IncrementalRenderer, ids: Sequence[int]) -> None:
        self.renderer = renderer
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: Any) -> Any:
        return len(self.renderer.decode(self.ids[: i + 1]))


def common_prefix_length(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def default_end_token(tokenizer: PreTrainedTokenizerBase) -> str:
    """`<|im_end|>` where the vocabulary has it as one token (ChatML), else the tokenizer's EOS."""
    im_end = "<|im_end|>"
    ids = tokenizer.encode(im_end, add_special_tokens=False)
    if len(ids) == 1:
        return im_end
    return str(tokenizer.eos_token)


@dataclass
class SelfTestReport:
    """The outcome of `self_test`: `whole_ids` and `incremental_ids` (plus the text after the last turn)
    agree, or `mismatch` says where not. `turn_starts[i]` is the index in `incremental_ids` where the turn
    starting at message `turn_messages[i]` begins."""

    whole_ids: list[int]
    incremental_ids: list[int]
    turn_starts: list[int] = field(default_factory=list)
    turn_messages: list[int] = field(default_factory=list)
    mismatch: TemplateMismatch | None = None

    @property
    def ok(self) -> bool:
        return self.mismatch is None


def turns_of(messages: Sequence[Message]) -> list[list[int]]:
    """Message indexes grouped into turns: each assistant message alone, each run of others together."""
    turns: list[list[int]] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" or not turns or messages[turns[-1][0]]["role"] == "assistant":
            turns.append([i])
        else:
            turns[-1].append(i)
    return turns


def self_test(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message] = SELF_TEST_CONVERSATION,
    tools: Sequence[dict[str, Any]] | None = SELF_TEST_TOOLS,
    end_token: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> SelfTestReport:
    """Render `messages` whole and incrementally and compare the ids (module docstring)."""
    renderer = IncrementalRenderer(tokenizer, tools, end_token, template_kwargs)
    report = SelfTestReport(whole_ids=_whole_ids(renderer, messages), incremental_ids=[])
    try:
        _render_incrementally(renderer, messages, report)
    except TemplateMismatch as e:
        report.mismatch = e
        return report
    tail = renderer.render(messages)[len(renderer.decode(report.incremental_ids)) :]
    expected = report.incremental_ids + renderer.encode(tail)
    report.mismatch = _compare(renderer, report, expected, messages)
    return report


def _whole_ids(renderer: IncrementalRenderer, messages: Sequence[Message]) -> list[int]:
    """`apply_chat_template(messages, tokenize=True)`: the naive ids of the whole conversation."""
    rendered: Any = renderer.tokenizer.apply_chat_template(
        list(messages), tools=renderer.tools, tokenize=True, **renderer.template_kwargs
    )
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(i) for i in ids]


def _render_incrementally(
    renderer: IncrementalRenderer, messages: Sequence[Message], report: SelfTestReport
) -> None:
    """Fill `report.incremental_ids` turn by turn, as the trajectory driver would."""
    for turn in turns_of(messages):
        so_far, ids = messages[: turn[0]], report.incremental_ids
        report.turn_starts.append(len(ids))
        report.turn_messages.append(turn[0])
        if messages[turn[0]]["role"] == "assistant":
            ids += renderer.sampled_ids(so_far, messages[turn[0]])
        else:
            ids += renderer.append_turn(ids, so_far, [messages[i] for i in turn])


def _compare(
    renderer: IncrementalRenderer, report: SelfTestReport, expected: list[int], messages: Sequence[Message]
) -> TemplateMismatch | None:
    """None when the whole rendering's ids equal `expected`; otherwise the turn and reason."""
    whole = report.whole_ids
    if whole == expected:
        return None
    k = common_prefix_length_ids(whole, expected)
    at = f"at token {k} the whole rendering has {_tokens(renderer, whole[k : k + 2])}, the incremental ids "
    at += f"{_tokens(renderer, expected[k : k + 2])}"
    starts = report.turn_starts
    near = [i for i, start in enumerate(starts) if start in (k, k + 1) and start > 0]
    if near:
        turn = report.turn_messages[near[0]]
        reason = f"BPE merge across the turn boundary: {at}"
    else:
        turn = report.turn_messages[max(bisect.bisect_right(starts, k) - 1, 0)]
        reason = f"the turn tokenizes differently inside the whole conversation: {at}"
    return TemplateMismatch(turn, str(messages[turn]["role"]), reason)


def common_prefix_length_ids(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _tokens(renderer: IncrementalRenderer, ids: Sequence[int]) -> list[str]:
    return [renderer.decode([i]) for i in ids]


def renders_tools(
    tokenizer: PreTrainedTokenizerBase, tools: Sequence[dict[str, Any]] = SELF_TEST_TOOLS
) -> bool:
    """Whether the chat template puts the tools into the prompt (each tool's name appears in it)."""
    renderer = IncrementalRenderer(tokenizer, tools)
    text = renderer.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    return all(tool["function"]["name"] in text for tool in tools)


def check_model_template(
    model_dir: str | Path, template_kwargs: Mapping[str, Any] | None = None
) -> SelfTestReport:
    """Load the tokenizer of `model_dir` (no weights) and run `self_test` on its chat template. A template
    that ignores tools is reported as a mismatch at turn 0: it cannot run tool-using trajectories."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not renders_tools(tokenizer):
        report = SelfTestReport(whole_ids=[], incremental_ids=[])
        reason = "the chat template does not render tools (no tool name in the prompt)"
        report.mismatch = TemplateMismatch(0, "system", reason)
        return report
    return self_test(tokenizer, template_kwargs=template_kwargs)


def multi_turn_self_test(
    tokenizer: PreTrainedTokenizerBase,
    *,
    with_tools: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> TemplateMismatch | None:
    """The self-test a multi-turn run needs (None: it passes): with tools, the template must render
    them and keep a tool conversation token for token; without, the same conversation without tools."""
    if with_tools and not renders_tools(tokenizer):
        return TemplateMismatch(
            0, "system", "the chat template does not render tools (no tool name in the prompt)"
        )
    tools = SELF_TEST_TOOLS if with_tools else None
    return self_test(tokenizer, tools=tools, template_kwargs=template_kwargs).mismatch
