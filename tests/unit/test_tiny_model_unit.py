"""The tiny model's vocabulary, tokenizer, spec validation and CLI flags (no model weights, no vLLM)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from tokenizers import pre_tokenizers

from rlfabric.tools.tiny_model import (
    DEFAULT_CHARS,
    IM_END,
    IM_START,
    PRESETS,
    SPECIAL_TOKENS,
    TinyModelSpec,
    add_arguments,
    build_tokenizer,
    byte_symbols,
    run,
    spec_from_args,
    special_ids,
    vocabulary,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_vocabulary_layout() -> None:
    vocab = vocabulary()
    assert list(vocab)[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert len(vocab) == len(SPECIAL_TOKENS) + len(DEFAULT_CHARS) == PRESETS["tiny"].vocab_size == 103
    assert len(vocabulary("abca")) == len(SPECIAL_TOKENS) + 3


def test_byte_symbols_are_the_byte_level_alphabet() -> None:
    symbols = byte_symbols()
    assert len(set(symbols)) == 256
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    assert symbols[ord("a")] == "a"
    assert symbols[ord(" ")] == "Ġ"
    assert symbols[ord("\n")] == "Ċ"


def test_special_ids_distinct_and_single_tokens(tokenizer) -> None:
    ids = special_ids()
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    specials = [
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    ]
    assert specials == [0, 1, 2, 3]
    assert tokenizer(IM_START + "x" + IM_END)["input_ids"] == [ids[IM_START], vocabulary()["x"], ids[IM_END]]


def test_every_char_is_one_token(tokenizer) -> None:
    vocab = vocabulary()
    ids = tokenizer(DEFAULT_CHARS)["input_ids"]
    assert ids == [vocab[byte_symbols()[ord(c)]] for c in DEFAULT_CHARS]
    assert len(tokenizer) == len(vocab)


@pytest.mark.parametrize("text", ["Hello, world!", "  two  spaces\n\nnew\tlines  \n", " ", "\n", "a" * 300])
def test_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_unknown_chars_are_dropped(tokenizer) -> None:
    # The Qwen2 byte-level BPE has no unknown token: bytes outside the vocabulary vanish.
    assert tokenizer("a\u00e9b\r\n")["input_ids"] == tokenizer("ab\n")["input_ids"]


def test_byte_fallback_round_trips_any_text() -> None:
    spec = TinyModelSpec(byte_fallback=True)
    tokenizer = build_tokenizer(spec.vocab_chars, byte_fallback=True)
    text = "naïve café — 日本\r\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer) == spec.vocab_size == len(SPECIAL_TOKENS) + 256
    assert tokenizer("a")["input_ids"] == build_tokenizer()("a")["input_ids"]


def test_custom_vocab_chars() -> None:
    tokenizer = build_tokenizer("0123456789+= \n")
    assert len(tokenizer) == len(SPECIAL_TOKENS) + 14
    assert tokenizer.decode(tokenizer("12+3= 15\n")["input_ids"]) == "12+3= 15\n"


def test_chat_template(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden": 64, "heads": 4}, "head size"),
        ({"hidden": 100, "heads": 3}, "divide"),
        ({"heads": 4, "kv_heads": 3}, "divide"),
        ({"vocab_chars": "abcé"}, "ASCII"),
    ],
)
def test_spec_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyModelSpec(**kwargs)


def test_preset_sizes() -> None:
    assert PRESETS["tiny"].num_parameters() == 440_576
    assert PRESETS["bench"].num_parameters() == 24_190_976
    assert TinyModelSpec(kv_heads=2).num_parameters() < PRESETS["tiny"].num_parameters()


def test_cli_flags_override_preset(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_from_args(
        parser.parse_args([str(tmp_path), "--preset", "bench", "--layers", "2", "--seed", "7"])
    )
    assert (spec.layers, spec.hidden, spec.heads, spec.seed) == (2, 512, 8, 7)
    assert spec_from_args(parser.parse_args([str(tmp_path)])) == PRESETS["tiny"]
    assert spec_from_args(parser.parse_args([str(tmp_path), "--byte-fallback"])).byte_fallback


def test_import_is_cheap() -> None:
    heavy = "'torch' in sys.modules or 'transformers' in sys.modules"
    code = f"import sys, rlfabric.tools.tiny_model; sys.exit({heavy})"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_cli_rejects_bad_shape(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(tmp_path / "m"), "--hidden", "64"])) == 2
    assert "head size" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_bpe_tokenizer_vocabulary_and_merges() -> None:
    from rlfabric.tools.bpe_tokenizer import BPE_VOCAB_SIZE, TOOL_TOKENS, build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer()
    assert len(tokenizer) == BPE_VOCAB_SIZE == TinyModelSpec(tokenizer="bpe").vocab_size
    assert tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, *TOOL_TOKENS]) == list(range(10))
    assert [tokenizer.eos_token_id, tokenizer.pad_token_id] == [
        special_ids()[t] for t in ("<|endoftext|>", "<|pad|>")
    ]
    for token in TOOL_TOKENS:  # added but not special: one token, kept by skip_special_tokens
        assert len(tokenizer(token)["input_ids"]) == 1
        assert tokenizer.decode(tokenizer(token)["input_ids"], skip_special_tokens=True) == token
    # Merges that join turns when a conversation is re-tokenized:
    assert tokenizer.convert_ids_to_tokens(tokenizer("\n\n")["input_ids"]) == ["ĊĊ"]
    assert tokenizer.convert_ids_to_tokens(tokenizer("}\n</tool_call>")["input_ids"]) == [
        "}Ċ",
        "</tool_call>",
    ]


@pytest.mark.parametrize("text", ["naïve café — 日本\r\n", "  two  spaces\n\n\tx", '{"a": [1, 2]}\n'])
def test_bpe_tokenizer_round_trips_any_text(text: str) -> None:
    from rlfabric.tools.bpe_tokenizer import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer()
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_bpe_spec_and_flag(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_from_args(parser.parse_args([str(tmp_path), "--tokenizer", "bpe"]))
    assert spec.tokenizer == "bpe" and spec.num_parameters() > PRESETS["tiny"].num_parameters()
    with pytest.raises(ValueError, match="char tokenizer"):
        TinyModelSpec(tokenizer="bpe", byte_fallback=True)
