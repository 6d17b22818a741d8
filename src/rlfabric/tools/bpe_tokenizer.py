"""A small byte-level BPE tokenizer with a Qwen2.5-style tool chat template, trained locally for tests.

The character tokenizer of `tiny_model` never merges anything, so it cannot show the bug class multi-turn
RL suffers from: re-tokenizing a rendered conversation gives other ids than the engine sampled. This
tokenizer is a real BPE, trained in ~0.1 s with Hugging Face `tokenizers` on `corpus()` (prose, rendered
chat turns and tool calls), so it has the merges that break naive re-tokenization: `ĊĊ` (two newlines,
which join across an `assistant\\n` | `\\ncontent` boundary), `}Ċ` (the `}\\n` before `</tool_call>`),
`"}}Ċ`, ...

It is saved as a `Qwen2Tokenizer` (the class transformers and vLLM rebuild for every `qwen2` model), and
trained with that class's normalizer (NFC) and pre-tokenizer (its split regex, then byte-level), so the
merges mean the same after a reload. Vocabulary:
- ids 0..9: `SPECIAL_TOKENS` of `tiny_model` (pad, bos, `<|endoftext|>`, unk, `<|im_start|>`,
  `<|im_end|>`) then `TOOL_TOKENS`; the tool tokens are added tokens but not special (as in Qwen2.5), so
  they are never split and `skip_special_tokens` keeps them;
- the 256 byte symbols, then merges up to `BPE_VOCAB_SIZE` tokens in all.

Imports of `tokenizers`/`transformers` happen inside the functions (the CLI imports this module cheaply).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, cast

from rlfabric.tools.tiny_model import BOS, EOS, IM_END, IM_START, PAD, SPECIAL_TOKENS, UNK

if TYPE_CHECKING:
    from transformers import Qwen2Tokenizer

BPE_VOCAB_SIZE = 512
"""Tokens of the trained vocabulary (special and tool tokens, 256 bytes, merges): the model's vocab_size."""

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
TOOL_TOKENS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
"""Added (not special) tokens of the tool format, ids 6..9."""

TOOL_CHAT_TEMPLATE = """\
{%- macro turn_start(role) -%}{{ '<|im_start|>' + role + '\\n' }}{%- endmacro -%}
{%- set rest = messages -%}
{%- if tools -%}
  {{- turn_start('system') -}}
  {%- if messages and messages[0]['role'] == 'system' -%}
    {{- messages[0]['content'] -}}{%- set rest = messages[1:] -%}
  {%- else -%}
    {{- 'You are a helpful assistant.' -}}
  {%- endif -%}
  {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
  {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' -}}
  {{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- endif -%}
{%- for message in rest -%}
  {%- if message['role'] == 'tool' -%}
    {%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}
    {{- '<|im_start|>assistant' -}}
    {%- if message['content'] -%}{{- '\\n' + message['content'] -}}{%- endif -%}
    {%- for call in message['tool_calls'] -%}
      {%- set call = call['function'] if call.get('function') else call -%}
      {%- set arguments = call['arguments'] if call['arguments'] is string else call['arguments'] | tojson -%}
      {{- '\\n<tool_call>\\n{"name": "' + call['name'] + '", "arguments": ' -}}
      {{- arguments + '}\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- else -%}
    {{- turn_start(message['role']) + (message['content'] or '') + '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- turn_start('assistant') -}}{%- endif -%}
"""
"""Qwen2.5's tool format, written for this project:
- with `tools`, a system turn: the system message (or a default) then `# Tools` and one JSON line per tool
  inside `<tools></tools>`, and how to call them;
- each message `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`; an assistant message's `tool_calls` follow its
  content as `\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` each;
- a run of consecutive `tool` messages is one `user` turn of `\\n<tool_response>\\nRESULT\\n</tool_response>`
  blocks (so an environment turn must append all its tool results at once);
- `add_generation_prompt` appends `<|im_start|>assistant\\n`."""

_PROSE = """\
A tool is a function the assistant may call. The assistant writes a call, the environment runs it and
returns the result, and the assistant reads the result before it answers the user. Tokens are the
pieces of text a language model reads and writes; the tokenizer splits the text into tokens and
merges frequent pairs of bytes into longer tokens. When the conversation is rendered again from the
beginning, the text is the same but the tokens may be different, because a merge can join the end of
one turn with the start of the next. The weather in Paris is sunny today, the temperature is 21
degrees, and the wind is light. What is the capital of France? The capital of France is Paris.
Please search the documents for the answer, then compute the total and report it in one sentence.
"""

_TOOLS = (
    ("calculator", "expression", "Evaluate an arithmetic expression."),
    ("get_weather", "city", "Get the current weather in a city."),
    ("search", "query", "Search the documents for a query."),
    ("python", "code", "Run Python code and return what it prints."),
)
_CITIES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Lima")


def _tools_block() -> str:
    lines = [
        f'{{"type": "function", "function": {{"name": "{name}", "description": "{about}", '
        f'"parameters": {{"type": "object", "properties": {{"{arg}": {{"type": "string"}}}}, '
        f'"required": ["{arg}"]}}}}}}'
        for name, arg, about in _TOOLS
    ]
    return "<tools>\n" + "\n".join(lines) + "\n</tools>"


def _conversation(i: int) -> str:
    """One rendered tool conversation in the template's format, varied by `i`."""
    name, arg, _ = _TOOLS[i % len(_TOOLS)]
    city, a, b = _CITIES[i % len(_CITIES)], 3 * i + 1, 7 * i + 2
    value = f"{a} + {b}" if arg == "expression" else city
    call = f'{{"name": "{name}", "arguments": {{"{arg}": "{value}"}}}}'
    return (
        f"<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n{_tools_block()}<|im_end|>\n"
        f"<|im_start|>user\nWhat is {a} plus {b} in {city}?<|im_end|>\n"
        f"<|im_start|>assistant\nLet me check.\n\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
        f'<|im_start|>user\n<tool_response>\n{{"result": "{a + b}", "city": "{city}"}}\n</tool_response>'
        f"<|im_end|>\n<|im_start|>assistant\n\nThe answer is {a + b}.\n\nDone.<|im_end|>\n"
    )


def corpus() -> list[str]:
    """The built-in training text: prose, and tool conversations whose turns meet at `<|im_end|>\\n
    <|im_start|>`, `}\\n</tool_call>` and blank lines."""
    return [_PROSE] * 4 + [_conversation(i) for i in range(64)]


@cache
def _trained_model() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of the BPE trained on `corpus()` (deterministic; trained once a process)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    blank = _qwen2_tokenizer({}, [])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = blank.backend_tokenizer.normalizer
    tokenizer.pre_tokenizer = blank.backend_tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=[*SPECIAL_TOKENS, *TOOL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], [(left, right) for left, right in model["merges"]]


def _qwen2_tokenizer(
    vocab: dict[str, int], merges: list[tuple[str, str]], max_length: int = 2048
) -> Qwen2Tokenizer:
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=cast("list[str]", merges),  # (left, right) pairs, which the BPE model takes too
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=TOOL_CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    return tokenizer


def build_bpe_tokenizer(max_length: int = 2048) -> Qwen2Tokenizer:
    """The trained byte-level BPE (`BPE_VOCAB_SIZE` tokens) with `TOOL_CHAT_TEMPLATE`."""
    vocab, merges = _trained_model()
    if len(vocab) != BPE_VOCAB_SIZE:
        raise RuntimeError(f"the BPE trained to {len(vocab)} tokens, not {BPE_VOCAB_SIZE}: corpus too small")
    return _qwen2_tokenizer(vocab, merges, max_length)
