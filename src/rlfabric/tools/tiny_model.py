"""Tiny randomly initialised language models, built locally for tests, demos and benchmarks.

A tiny model is a Qwen2-architecture causal LM (the architecture vLLM and transformers both load natively)
with random weights and a character-level tokenizer (or, with `tokenizer="bpe"`, the byte-level BPE with a
tool chat template of `bpe_tokenizer`, trained locally), so nothing is ever downloaded. The saved folder loads
with `AutoTokenizer`/`AutoModelForCausalLM.from_pretrained` and with `vllm.LLM(model=path)`.

The tokenizer is a `Qwen2Tokenizer` (byte-level BPE) with no merges. transformers rebuilds every tokenizer
of a `qwen2` model as a `Qwen2Tokenizer` whatever the folder declares (and vLLM loads tokenizers through
`AutoTokenizer`), so a custom pipeline would not survive a reload; with no merges the byte-level BPE *is*
character-level for ASCII: each character is one token, its byte's symbol in GPT-2's byte alphabet.

Vocabulary and ids of the character tokenizer (the tokenizer's size equals the model's `vocab_size`):
- ids 0..5: the special tokens of `SPECIAL_TOKENS`, in that order;
- then one token per distinct character of `vocab_chars` (ASCII), in order of first appearance;
- with `byte_fallback`, then the remaining byte symbols, so any UTF-8 text round-trips (a non-ASCII
  character is several tokens). Without it, characters outside the vocabulary are dropped when encoding
  (the Qwen2 BPE has no unknown token): `<|unk|>` is reserved but never produced.

Shapes are constrained by vLLM: its Qwen2 implementation uses `head_dim = hidden / heads`, and the CPU
attention backend supports only the head sizes in `VLLM_CPU_HEAD_SIZES` (so hidden 64 needs 2 heads).

torch and transformers are imported inside the functions that need them: importing this module is cheap,
so the CLI can register `rlfabric make-tiny-model` without loading torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

DEFAULT_CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
"""Printable ASCII (space through `~`) plus newline and tab: 97 characters."""

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|endoftext|>", "<|unk|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START, IM_END)
"""Special tokens, holding ids 0..5 in this order."""

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention backend supports (vllm 0.32 `CPUAttentionBackend`)."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML: `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`."""

Dtype = Literal["float32", "bfloat16", "float16"]
TokenizerKind = Literal["char", "bpe"]


@dataclass(frozen=True)
class TinyModelSpec:
    """The shape and vocabulary of a tiny model. `None` fields take derived defaults (see the properties)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); `None` means as many as `heads`."""
    intermediate: int | None = None
    """MLP width; `None` means 3 x `hidden`."""
    vocab_chars: str = DEFAULT_CHARS
    """ASCII characters that are one token each."""
    byte_fallback: bool = False
    """Add every other byte as a token, so any text round-trips instead of losing unknown characters."""
    max_position: int = 2048
    seed: int = 0
    dtype: Dtype = "float32"
    tokenizer: TokenizerKind = "char"
    """`char`: one token per character, ChatML template. `bpe`: the trained byte-level BPE of
    `bpe_tokenizer` (`BPE_VOCAB_SIZE` tokens, every byte covered) with a Qwen2.5-style tool template."""
    turn_length: int | None = None
    """Rig the random weights so the model ends its turn (`<|im_end|>`) after about this many tokens on
    average, whatever the input (`end_turns_after`): multi-turn tests and benchmarks need turns that end.
    None leaves the weights random (a turn then runs to max_tokens nearly always)."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.num_kv_heads:
            raise ValueError(
                f"hidden {self.hidden}, heads {self.heads}, kv_heads {self.kv_heads} don't divide"
            )
        if self.head_dim not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(f"head size hidden/heads = {self.head_dim} not in {VLLM_CPU_HEAD_SIZES} (vLLM)")
        if not self.vocab_chars.isascii():
            raise ValueError("vocab_chars must be ASCII (use byte_fallback for other text)")
        if self.tokenizer == "bpe" and (self.byte_fallback or self.vocab_chars != DEFAULT_CHARS):
            raise ValueError(
                "vocab_chars and byte_fallback are for the char tokenizer (bpe covers all bytes)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def intermediate_size(self) -> int:
        return self.intermediate or 3 * self.hidden

    @property
    def vocab_size(self) -> int:
        if self.tokenizer == "bpe":
            from rlfabric.tools.bpe_tokenizer import BPE_VOCAB_SIZE

            return BPE_VOCAB_SIZE
        return len(vocabulary(self.vocab_chars, self.byte_fallback))

    def num_parameters(self) -> int:
        """Parameter count of the model this spec builds (tied embeddings counted once)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + q + 2 * (h * kv + kv) + q * h
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return self.vocab_size * h + self.layers * layer + h


PRESETS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "bench": TinyModelSpec(layers=8, hidden=512, heads=8, intermediate=1280),
}
"""`tiny`: 2 layers, hidden 128, 4 heads, MLP 384, vocab 103: 440,576 parameters (tests).
`bench`: 8 layers, hidden 512, 8 heads, MLP 1280, vocab 103: 24,190,976 parameters (benchmarks)."""


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte 0..255."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def vocabulary(vocab_chars: str = DEFAULT_CHARS, byte_fallback: bool = False) -> dict[str, int]:
    """Token -> id: the special tokens, one byte symbol per distinct character, then (optionally) the
    symbols of all other bytes."""
    symbols = byte_symbols()
    tokens = [*SPECIAL_TOKENS, *(symbols[ord(c)] for c in dict.fromkeys(vocab_chars))]
    if byte_fallback:
        tokens += [s for s in symbols if s not in tokens]
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer(
    vocab_chars: str = DEFAULT_CHARS, max_length: int = 2048, byte_fallback: bool = False
) -> Qwen2Tokenizer:
    """The character-level tokenizer over `vocabulary(vocab_chars, byte_fallback)`, with a ChatML template."""
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer(
        vocab=vocabulary(vocab_chars, byte_fallback),
        merges=[],
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def spec_tokenizer(spec: TinyModelSpec) -> Qwen2Tokenizer:
    """The tokenizer `spec` asks for: character-level or the trained BPE."""
    if spec.tokenizer == "bpe":
        from rlfabric.tools.bpe_tokenizer import build_bpe_tokenizer

        return build_bpe_tokenizer(spec.max_position)
    return build_tokenizer(spec.vocab_chars, spec.max_position, spec.byte_fallback)


def special_ids() -> dict[str, int]:
    """Id of each special token (the same for every vocabulary)."""
    return {token: i for i, token in enumerate(SPECIAL_TOKENS)}


def model_config(spec: TinyModelSpec) -> Qwen2Config:
    """The transformers config for `spec`, with tied input and output embeddings."""
    from transformers import Qwen2Config

    ids = special_ids()
    return Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position,
        tie_word_embeddings=True,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        dtype=spec.dtype,
    )


def generation_config() -> GenerationConfig:
    """Generation defaults: stop at `<|endoftext|>` or `<|im_end|>`, pad with `<|pad|>`."""
    from transformers import GenerationConfig

    ids = special_ids()
    return GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[PAD]
    )


def build_model(spec: TinyModelSpec) -> Qwen2ForCausalLM:
    """A randomly initialised model for `spec`, deterministic in `spec.seed`, in eval mode."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(model_config(spec))
    model.generation_config = generation_config()
    if spec.turn_length is not None:
        end_turns_after(model, spec.turn_length, spec.vocab_size)
    return model.to(getattr(torch, spec.dtype)).eval()


def end_turns_after(model: Qwen2ForCausalLM, mean_tokens: int, vocab_size: int) -> float:
    """Rigs `model` (float32, tied embeddings) so that `<|im_end|>` has probability ~1/mean_tokens at
    every step: the last layer's attention adds a constant to hidden dimension 0 (a value bias that its
    output projection maps there alone), every token's embedding but `<|im_end|>`'s ignores dimension 0,
    and `<|im_end|>`'s is `alpha` there, with `alpha` found by bisection on random inputs. The other
    tokens keep their random logits. Returns the probability measured on those inputs."""
    import torch

    im_end = special_ids()[IM_END]
    attention = model.model.layers[-1].self_attn
    embedding = model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(0)
    probe = torch.randint(len(SPECIAL_TOKENS), vocab_size, (8, 48), generator=generator)
    with torch.no_grad():
        attention.v_proj.bias.zero_()
        attention.v_proj.bias[0] = 8.0
        attention.o_proj.weight[:, 0] = 0.0
        attention.o_proj.weight[0, 0] = 1.0
        embedding[:, 0] = 0.0
        embedding[im_end] = 0.0
        low, high, p = 0.0, 1.0, 0.0
        for _ in range(30):
            embedding[im_end, 0] = (low + high) / 2
            p = float(model(probe).logits.softmax(-1)[..., im_end].mean())
            low, high = (
                (low, embedding[im_end, 0].item())
                if p > 1 / mean_tokens
                else (embedding[im_end, 0].item(), high)
            )
    return p


def save_tiny_model(spec: TinyModelSpec, out_dir: str | Path) -> Path:
    """Build the model and tokenizer for `spec` and save both (safetensors) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_model(spec).save_pretrained(out)
    spec_tokenizer(spec).save_pretrained(out)
    return out


def make_tiny_model(
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab_chars: str = DEFAULT_CHARS,
    byte_fallback: bool = False,
    max_position: int = 2048,
    seed: int = 0,
    dtype: Dtype = "float32",
    tokenizer: TokenizerKind = "char",
    turn_length: int | None = None,
) -> Path:
    """Build a random Qwen2 model and its tokenizer (`char` or `bpe`) into `out_dir`; return its path."""
    spec = TinyModelSpec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab_chars=vocab_chars,
        byte_fallback=byte_fallback,
        max_position=max_position,
        seed=seed,
        dtype=dtype,
        tokenizer=tokenizer,
        turn_length=turn_length,
    )
    return save_tiny_model(spec, out_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `rlfabric make-tiny-model`; unset shape flags come from `--preset`."""
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="folder to write the model into")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="base shape (default tiny)")
    parser.add_argument("--layers", type=int, help="decoder layers")
    parser.add_argument("--hidden", type=int, help="hidden size; hidden/heads must be a vLLM head size")
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (default: as many as --heads)")
    parser.add_argument("--intermediate", type=int, help="MLP width (default 3 x hidden)")
    parser.add_argument("--vocab-chars", help="ASCII characters of the vocabulary (default printable ASCII)")
    parser.add_argument(
        "--byte-fallback", action="store_true", default=None, help="add all bytes: any text round-trips"
    )
    parser.add_argument("--max-position", type=int, help="maximum sequence length")
    parser.add_argument("--seed", type=int, help="random seed of the weights")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weight dtype")
    parser.add_argument(
        "--tokenizer",
        choices=["char", "bpe"],
        help="char (default): one token per character; bpe: a byte-level BPE trained locally, with a "
        "Qwen2.5-style tool chat template",
    )
    parser.add_argument(
        "--turn-length",
        type=int,
        help="rig the random weights so the model ends its turn (<|im_end|>) after about this many tokens "
        "on average (multi-turn tests and benchmarks)",
    )


def spec_from_args(args: argparse.Namespace) -> TinyModelSpec:
    """The preset's spec with every flag that was given replacing its field."""
    fields = [f.name for f in dataclasses.fields(TinyModelSpec)]
    overrides = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    return dataclasses.replace(PRESETS[args.preset], **overrides)


def run(args: argparse.Namespace) -> int:
    """Entry point of `rlfabric make-tiny-model`: build, save, print the path and parameter count."""
    try:
        spec = spec_from_args(args)
    except ValueError as e:
        print(f"rlfabric make-tiny-model: {e}", file=sys.stderr)
        return 2
    path = save_tiny_model(spec, args.out_dir)
    shape = f"{spec.layers} layers x hidden {spec.hidden}, {spec.tokenizer} vocab {spec.vocab_size}"
    print(f"{path}: Qwen2 {shape}, {spec.num_parameters():,} parameters")
    return 0
