"""The reference engine: plain transformers `generate`, one prompt at a time in a worker thread.

Small and slow on purpose: it needs no vLLM, starts in about a second, and defines the behaviour the
vLLM engine must match. A prompt's `n` samples are generated as one batch (`num_return_sequences=n`), so
they finish together; prompts run one after another, and the model lock keeps a prompt's samples and a
weight load from interleaving (every sample is generated entirely by one set of weights).

Logprobs follow `logprobs_mode` like vLLM's: "processed" takes log_softmax of transformers' processed
scores (after temperature, top-k and top-p), "raw" of the raw logits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfabric.rollout.engine import (
    AdapterRef,
    AdaptersUnsupported,
    ChatTokenizer,
    Engine,
    EngineSample,
    EngineStats,
    FinishReason,
    LogprobsMode,
    SamplingSettings,
    WeightsRejected,
    check_weights_dir,
    checkpoint_shapes,
    model_vocab_size,
    read_weights_dir,
    resolve_model_dir,
)

if TYPE_CHECKING:
    import torch

    from rlfabric.weights.broadcast import BroadcastPlan


@dataclass
class _Request:
    """A request in flight: its abort flag (read by the generating thread) and per-prompt first-token
    times (seconds since submission, set by the thread)."""

    submitted: float
    aborted: threading.Event = field(default_factory=threading.Event)
    first_token_s: float | None = None


class HfEngine(Engine):
    """transformers `generate` behind the `Engine` interface (CPU or one device)."""

    kind = "transformers"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        seed: int = 0,
        logprobs_mode: LogprobsMode = "processed",
        device: str = "cpu",
    ) -> None:
        self.model_path = model_path
        self.vocab_size = model_vocab_size(model_path)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        self.device = device
        self._lock = threading.Lock()
        """Held while the model generates or loads weights."""
        self._requests: dict[str, _Request] = {}
        self._running = 0
        self._tokens_generated = 0

    async def start(self) -> None:
        import torch

        torch.manual_seed(self.seed)
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._tokenizer = ChatTokenizer(self.model_path)
        self._expected_weights = checkpoint_shapes(resolve_model_dir(self.model_path))
        dtype = torch.float32 if self.dtype == "auto" else getattr(torch, self.dtype)
        model: Any = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        self._model = model.to(self.device).eval()

    async def close(self) -> None:
        for request in self._requests.values():
            request.aborted.set()

    def tokenize_text(self, text: str) -> list[int]:
        return self._tokenizer.text(text)

    def tokenize_chat(
        self, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        return self._tokenizer.chat(messages, template_kwargs)

    async def generate(
        self,
        request_id: str,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        adapter: AdapterRef | None = None,
    ) -> AsyncIterator[EngineSample]:
        """Generate prompt after prompt in a thread; after an abort the remaining samples are yielded
        empty with finish_reason "abort". Leaving the loop early aborts the prompt in progress. No LoRA
        adapters (`AdaptersUnsupported`)."""
        if adapter is not None:
            raise AdaptersUnsupported("adapter: the transformers engine serves no LoRA adapters")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        request = self._requests[request_id] = _Request(submitted=time.perf_counter())
        try:
            for p, prompt in enumerate(prompts):
                for sample in await asyncio.to_thread(self._generate_prompt, request, p, prompt, sampling):
                    yield sample
        finally:
            request.aborted.set()  # stops a thread still running if the consumer left early
            del self._requests[request_id]

    def _generate_prompt(
        self, request: _Request, prompt_index: int, prompt: list[int], sampling: SamplingSettings
    ) -> list[EngineSample]:
        """The n samples of one prompt (blocking; runs in a worker thread)."""
        if request.aborted.is_set():
            return [self._aborted(request, prompt_index, s, prompt) for s in range(sampling.n)]
        with self._lock:
            self._running += sampling.n
            try:
                output = self._run_generate(request, prompt, sampling, prompt_index)
            finally:
                self._running -= sampling.n
        return self._samples(request, prompt_index, prompt, sampling, output)

    def _run_generate(self, request: _Request, prompt: list[int], sampling: SamplingSettings, p: int) -> Any:
        """transformers `generate` for one prompt's n samples, with scores and raw logits kept."""
        import torch

        seed = sampling.sample_seed(p, 0)
        if seed is not None:  # unseeded requests continue the engine's stream (seeded once at start)
            torch.manual_seed(seed)
        request.first_token_s = None
        input_ids = torch.tensor([prompt], device=self.device)
        with torch.no_grad():
            return self._model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                **self._generation_kwargs(sampling),
                stopping_criteria=[_Watch(self, request)],
                tokenizer=self._tokenizer.hf if sampling.stop else None,
                return_dict_in_generate=True,
                output_scores=True,
                output_logits=True,
            )

    def _generation_kwargs(self, sampling: SamplingSettings) -> dict[str, Any]:
        """Sampling settings in transformers' terms; every filter set explicitly (the model's generation
        config may carry its own defaults, e.g. top_k=50)."""
        greedy = sampling.temperature == 0
        kwargs: dict[str, Any] = {
            "do_sample": not greedy,
            "num_return_sequences": sampling.n,
            "max_new_tokens": sampling.max_tokens,
            "stop_strings": list(sampling.stop) or None,
            "top_k": None if greedy else max(sampling.top_k, 0),
            "top_p": None if greedy else sampling.top_p,
            "temperature": None if greedy else sampling.temperature,
        }
        if sampling.ignore_eos:
            kwargs["eos_token_id"] = None
        return kwargs

    def _samples(
        self, request: _Request, p: int, prompt: list[int], sampling: SamplingSettings, output: Any
    ) -> list[EngineSample]:
        """Cut each returned sequence at its first end-of-sequence token (kept) and pair tokens with
        logprobs."""
        import torch

        total_s = time.perf_counter() - request.submitted
        steps = output.scores if self.logprobs_mode == "processed" else output.logits
        logprobs = torch.stack(steps, dim=1).float().log_softmax(dim=-1)  # (n, T, vocab)
        generated = output.sequences[:, len(prompt) :]  # (n, T)
        chosen = logprobs.gather(-1, generated.unsqueeze(-1)).squeeze(-1)  # (n, T)
        samples = []
        for s in range(sampling.n):
            tokens, reason = self._cut(generated[s].tolist(), sampling, request)
            samples.append(
                EngineSample(
                    prompt_index=p,
                    sample_index=s,
                    prompt_token_ids=prompt,
                    token_ids=tokens,
                    logprobs=chosen[s, : len(tokens)].tolist(),
                    text=self._text(tokens, sampling.stop),
                    finish_reason=reason,
                    first_token_s=request.first_token_s or total_s,
                    total_s=total_s,
                )
            )
        return samples

    def _cut(
        self, tokens: list[int], sampling: SamplingSettings, request: _Request
    ) -> tuple[list[int], FinishReason]:
        """A returned row up to its end (padding after it dropped) and why it ended: an end-of-sequence
        token (kept) or the token completing a stop string (kept) is "stop"."""
        eos = set() if sampling.ignore_eos else set(self._eos_ids())
        for i, token in enumerate(tokens):
            if token in eos or self._ends_in_stop(tokens[: i + 1], sampling.stop):
                return tokens[: i + 1], "stop"
        reason: FinishReason = "abort" if request.aborted.is_set() else "length"
        return tokens, reason

    def _ends_in_stop(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        """Whether `tokens`' text contains a stop string (checked token by token, as vLLM does)."""
        return bool(stop) and any(s in self._tokenizer.decode(tokens) for s in stop)

    def _text(self, tokens: list[int], stop: tuple[str, ...]) -> str:
        """The decoded text, cut before the first stop string (vLLM leaves stop strings out too)."""
        text = self._tokenizer.decode(tokens)
        return text[: min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))]

    def _eos_ids(self) -> list[int]:
        eos = self._model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def _aborted(self, request: _Request, p: int, s: int, prompt: list[int]) -> EngineSample:
        """A sample that never started because its request was aborted."""
        elapsed = time.perf_counter() - request.submitted
        return EngineSample(p, s, prompt, [], [], "", "abort", 0.0, elapsed)

    async def abort(self, request_id: str) -> None:
        if request := self._requests.get(request_id):
            request.aborted.set()

    async def load_weights_dir(self, path: str) -> None:
        """Validate against the base checkpoint, read the folder, then copy into the model under the
        model lock (copying validated tensors cannot fail halfway)."""
        check_weights_dir(path, self._expected_weights)
        tensors = await asyncio.to_thread(read_weights_dir, path)
        await asyncio.to_thread(self._copy_weights, tensors)

    async def receive_broadcast(self, plan: BroadcastPlan) -> None:
        """Receive the whole state dict (refusing a mismatched one up front), then copy it in."""
        from rlfabric.weights import broadcast

        problems = broadcast.mismatches(plan.metas, self._expected_weights)
        try:
            received, _ = await asyncio.to_thread(
                broadcast.receive_state_dict,
                plan.metas,
                host=plan.host,
                port=plan.port,
                rank=plan.rank,
                world_size=plan.world_size,
                backend=plan.backend,
                bucket_bytes=plan.bucket_bytes,
                refusal="; ".join(problems[:5]) or None,
            )
        except broadcast.BroadcastError as exc:
            if problems:
                raise WeightsRejected("; ".join(problems[:5])) from exc
            raise
        await asyncio.to_thread(self._copy_weights, received)

    def _copy_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            missing, unexpected = self._model.load_state_dict(tensors, strict=False)
        tied = {k for k in missing if k in self._tied_names()}
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"state dict mismatch after validation: {missing=} {unexpected=}")

    def _tied_names(self) -> set[str]:
        """Parameter names that share storage with another (absent from checkpoints)."""
        seen: dict[int, str] = {}
        tied = set()
        for name, tensor in self._model.state_dict(keep_vars=True).items():
            if tensor.data_ptr() in seen:
                tied.add(name)
            seen.setdefault(tensor.data_ptr(), name)
        return tied

    async def reset_prefix_cache(self) -> None:
        """No prefix cache: nothing to reset."""

    def stats(self) -> EngineStats:
        return EngineStats(self._running, 0, 0.0, self._tokens_generated)


class _Watch:
    """A transformers stopping criterion that records the first token's time, counts generated tokens
    and stops every row once the request is aborted. Called once per decoding step."""

    def __init__(self, engine: HfEngine, request: _Request) -> None:
        self.engine = engine
        self.request = request

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        import torch

        if self.request.first_token_s is None:
            self.request.first_token_s = time.perf_counter() - self.request.submitted
        self.engine._tokens_generated += input_ids.shape[0]
        stop = self.request.aborted.is_set()
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)
