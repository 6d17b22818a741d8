"""The chat template's extra variables (`dataset.chat_template_kwargs`) reach the template the engines
render prompts with, with the tiny model's own tokenizer."""

from __future__ import annotations

from pathlib import Path

from rlfabric.rollout.engine import ChatTokenizer

THINKING_TEMPLATE = (
    "{%- for m in messages -%}{{ m['role'] + ': ' + m['content'] + '\n' }}{%- endfor -%}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ 'nothink\n' }}{%- endif -%}"
    "{{ 'assistant: ' }}"
)


def test_template_kwargs_reach_the_chat_template(tiny_model_dir: Path) -> None:
    tokenizer = ChatTokenizer(str(tiny_model_dir))
    tokenizer.hf.chat_template = THINKING_TEMPLATE
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plain = tokenizer.decode(tokenizer.chat(messages))
    assert plain == "system: be brief\nuser: hi\nassistant: "
    assert tokenizer.decode(tokenizer.chat(messages, {"enable_thinking": False})) == (
        "system: be brief\nuser: hi\nnothink\nassistant: "
    )
