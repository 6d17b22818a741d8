"""The generation engine behind a rollout replica: its interface, data types and shared helpers.

Two implementations share this interface: `VllmEngine` (production, `vllm_engine.py`) and `HfEngine` (a
small reference on plain transformers, `hf_engine.py`). The gRPC servicer only ever sees `Engine`.

Invariants every engine keeps:
- `generate` yields each `(prompt_index, sample_index)` of a request exactly once, as soon as that sample
  finishes; `abort(request_id)` ends the unfinished ones early, yielded with `finish_reason="abort"`;
  closing or cancelling the iterator instead aborts them without yielding them.
- `EngineSample.logprobs[i]` is the log-probability of `token_ids[i]` under the serving weights, in the
  engine's `logprobs_mode`: `"processed"` (default) is the distribution actually sampled from (after
  temperature, top-k and top-p; the right one for importance ratios), `"raw"` is the model's own softmax
  (temperature 1, no truncation). The two agree when temperature is 1 and top-k/top-p are off.
- `load_weights_dir` is all-or-nothing: the folder's tensor names and shapes are checked against the base
  checkpoint before the model is touched, so a refused folder leaves the old weights serving.
- LoRA adapters (engines with `max_adapters > 0`): `load_adapter` loads or replaces one named adapter
  without touching the base or the other adapters, all-or-nothing (a refused adapter leaves its old
  version serving); `generate(..., adapter=ref)` samples with it. The caller (the replica) never holds
  more than `max_adapters` names and drains an adapter's requests before replacing or unloading it.
"""

from __future__ import annotations

import abc
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlfabric.rollout.types import EngineSample as EngineSample
from rlfabric.rollout.types import FinishReason as FinishReason
from rlfabric.rollout.types import SamplingSettings as SamplingSettings
from rlfabric.runtime.errors import FailedPrecondition

if TYPE_CHECKING:
    import torch

    from rlfabric.weights.broadcast import BroadcastPlan

LogprobsMode = Literal["processed", "raw"]

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""safetensors dtype codes a weights folder may use (the engine casts them to its own dtype)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine: sequences scheduled and queued, KV cache fill (0..1), and tokens
    generated since start (aborted work included)."""

    running: int
    waiting: int
    kv_cache_usage: float
    tokens_generated: int


class WeightsRejected(ValueError):
    """A weights folder that does not match the model; nothing was loaded."""


class AdaptersUnsupported(FailedPrecondition):
    """An adapter was asked of an engine started without LoRA (`max_adapters` 0)."""


@dataclass(frozen=True)
class AdapterRef:
    """One version of a named LoRA adapter: its PEFT folder (`adapter_config.json` +
    `adapter_model.safetensors`, `rlfabric.weights.adapters.materialize_adapter`)."""

    name: str
    version: int
    path: str


class Engine(abc.ABC):
    """A generation engine owned by one event loop. See the module docstring for the invariants."""

    kind: str
    max_model_len: int
    vocab_size: int
    """Size of the model's vocabulary: valid token ids are 0 .. vocab_size - 1."""
    _tokenizer: ChatTokenizer
    """Set by `start`."""
    max_adapters: int = 0
    """LoRA adapters the engine can hold at once beside the base; 0: started without LoRA."""

    def hf_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer, as loaded by `start` (the multi-turn driver renders the
        chat template incrementally with it)."""
        return self._tokenizer.hf

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; the engine serves once this returns."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Abort all work and release the engine (idempotent)."""

    @abc.abstractmethod
    def tokenize_text(self, text: str) -> list[int]:
        """Token ids of raw text, without special tokens or a template."""

    @abc.abstractmethod
    def tokenize_chat(
        self, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """Token ids of a conversation in the model's chat template (given the template's extra
        variables `template_kwargs`, e.g. {"enable_thinking": False}), ending with the generation prompt."""

    @abc.abstractmethod
    def generate(
        self,
        request_id: str,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        adapter: AdapterRef | None = None,
    ) -> AsyncIterator[EngineSample]:
        """Sample `sampling.n` completions of each prompt (with `adapter` on the base when given, which
        must be the version last loaded under its name); yield each as soon as it finishes."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """End a request's unfinished samples now (they are yielded with finish_reason "abort")."""

    @abc.abstractmethod
    async def load_weights_dir(self, path: str) -> None:
        """Replace the weights in place from a folder of safetensors files in the base checkpoint's
        naming, then reset the prefix cache. Raises `WeightsRejected` (old weights keep serving)."""

    @abc.abstractmethod
    async def receive_broadcast(self, plan: BroadcastPlan) -> None:
        """Join the learner's torch.distributed broadcast described by `plan` (converted from the request's
        `BroadcastSource` by `contracts.wire`), receive every tensor, then load them in place and
        reset the prefix cache. Names and shapes are checked before anything is received; a transfer that
        fails or times out raises before the model is touched."""

    async def load_adapter(self, adapter: AdapterRef) -> None:
        """Load `adapter` under its name, replacing the version held (if any) in place, without touching
        the base or other adapters. Raises `WeightsRejected` (the old version keeps serving)."""
        raise AdaptersUnsupported(f"adapter: the {self.kind} engine serves no LoRA adapters")

    async def unload_adapter(self, name: str) -> None:
        """Free the slot of adapter `name` (its requests have finished)."""
        raise AdaptersUnsupported(f"adapter: the {self.kind} engine serves no LoRA adapters")

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Drop cached prompt prefixes (they were computed with older weights)."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """The current snapshot; cheap, never blocks."""


class ChatTokenizer:
    """The model's own tokenizer, used identically by every engine so their token ids agree."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(model_path)

    def text(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def chat(
        self, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """The conversation rendered with the chat template (`template_kwargs` are the template's extra
        variables) and the generation prompt, then tokenised as text."""
        rendered = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
        return self.text(str(rendered))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=True))


def model_vocab_size(model: str) -> int:
    """`vocab_size` from the model folder's config.json (no weights loaded)."""
    return int(json.loads((resolve_model_dir(model) / "config.json").read_text())["vocab_size"])


def resolve_model_dir(model: str) -> Path:
    """The local folder holding `model`: the path itself, or its snapshot in the hub cache (offline)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file (name -> {dtype, shape, data_offsets}), read without
    loading any tensor data; checks that the data the header describes fits in the file."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    data_bytes = path.stat().st_size - 8 - size
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if end > data_bytes:
        raise WeightsRejected(f"{path.name}: truncated ({data_bytes} data bytes, header needs {end})")
    return header


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over all `*.safetensors` files in `folder`; dtypes must be floating point."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightsRejected(f"{folder}: no .safetensors files")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for name, entry in safetensors_header(file).items():
            if entry["dtype"] not in FLOAT_DTYPES:
                raise WeightsRejected(f"{file.name}: {name} has dtype {entry['dtype']}, not floating point")
            if name in shapes:
                raise WeightsRejected(f"{name} appears in more than one file")
            shapes[name] = tuple(entry["shape"])
    return shapes


def check_weights_dir(folder: str | Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Raise `WeightsRejected` unless `folder` holds exactly the tensors of `expected`, shape for shape."""
    found = checkpoint_shapes(folder)
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    wrong = sorted(n for n in expected.keys() & found.keys() if expected[n] != found[n])
    problems = [
        f"missing {missing[:5]}" if missing else "",
        f"unexpected {unexpected[:5]}" if unexpected else "",
        ", ".join(f"{n}: {found[n]} != {expected[n]}" for n in wrong[:5]),
    ]
    if any(problems):
        raise WeightsRejected(f"{folder}: " + "; ".join(p for p in problems if p))


def read_weights_dir(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` file in `folder`, in host memory (name -> tensor)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
