"""The reference engine: plain transformers `generate` in a worker thread.

Small and simple on purpose: it needs no vLLM, starts in seconds, and defines the behaviour the vLLM
engine must match. A prompt's `n` samples are generated as one batch (`num_return_sequences=n`), so they
finish together; by default prompts run one after another. With `batch_prompts > 1` the prompts of
concurrent requests that sample alike (and unseeded: a seeded request's samples depend on its seed alone,
so it runs by itself) are left-padded into one `generate` call, up to that many prompts: a static batch,
which `rlfabric up` uses for the stand-in replica that serves while vLLM compiles. The model lock keeps a
batch and a weight load from interleaving (every sample is generated entirely by one set of weights).

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


BATCH_WAIT_S = 0.02
"""How long the batcher lets concurrent requests join before it starts a batch (requests sent together
arrive over a few milliseconds; a batch generates for seconds)."""
SCORES_BUDGET_BYTES = 1 << 30
"""Most memory a batch's per-step scores may take (rows x max_tokens x vocabulary float32 values): a batch
holds fewer prompts when the vocabulary is large, never fewer than one."""


@dataclass
class _Request:
    """A request in flight: its abort flag (read by the generating thread) and per-prompt first-token
    times (seconds since submission, set by the thread)."""

    submitted: float
    aborted: threading.Event = field(default_factory=threading.Event)
    first_token_s: float | None = None


_Row = tuple[list[int], list[float]]
"""One generated row: its tokens and their logprobs."""


@dataclass(eq=False)
class _Pending:
    """One prompt waiting for a batch: its request, index in the request, tokens, sampling and the future
    its samples are set on."""

    request: _Request
    index: int
    prompt: list[int]
    sampling: SamplingSettings
    future: asyncio.Future[list[EngineSample]]


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
        batch_prompts: int = 1,
    ) -> None:
        if batch_prompts < 1:
            raise ValueError(f"batch_prompts: must be >= 1, got {batch_prompts}")
        self.model_path = model_path
        self.vocab_size = model_vocab_size(model_path)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        self.device = device
        self.batch_prompts = batch_prompts
        self._queue: list[_Pending] = []
        """Prompts waiting for a batch (batch_prompts > 1), oldest first."""
        self._batcher: asyncio.Task[None] | None = None
        self.batches = 0
        """`generate` calls run for batched prompts (each holds one or more prompts)."""
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
        """Generate prompt after prompt in a thread (or, batching, queue every prompt for the batcher and
        yield prompt by prompt as their batches finish); after an abort the remaining samples are yielded
        empty with finish_reason "abort". Leaving the loop early aborts the prompts in progress. No LoRA
        adapters (`AdaptersUnsupported`)."""
        if adapter is not None:
            raise AdaptersUnsupported("adapter: the transformers engine serves no LoRA adapters")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        request = self._requests[request_id] = _Request(submitted=time.perf_counter())
        try:
            if self.batch_prompts > 1 and sampling.seed is None:
                futures = [self._enqueue(request, p, prompt, sampling) for p, prompt in enumerate(prompts)]
                for future in futures:
                    for sample in await future:
                        yield sample
                return
            for p, prompt in enumerate(prompts):
                for sample in await asyncio.to_thread(self._generate_prompt, request, p, prompt, sampling):
                    yield sample
        finally:
            request.aborted.set()  # stops a thread still running if the consumer left early
            del self._requests[request_id]

    def _enqueue(
        self, request: _Request, p: int, prompt: list[int], sampling: SamplingSettings
    ) -> asyncio.Future[list[EngineSample]]:
        """Queue one prompt for the next batch (starting the batcher if idle); the future gets its samples."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(request, p, prompt, sampling, future))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._run_batches())
        return future

    async def _run_batches(self) -> None:
        """Generate queued prompts batch after batch until the queue is empty. Prompts that arrive while
        a batch generates wait for the next one; a failed batch fails its prompts' futures only."""
        while self._queue:
            await asyncio.sleep(BATCH_WAIT_S)
            batch = self._take_batch()
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(self._generate_batch, batch)
            except Exception as exc:
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            for item, samples in zip(batch, results, strict=True):
                if not item.future.done():
                    item.future.set_result(samples)

    def _take_batch(self) -> list[_Pending]:
        """The oldest queued prompt and the queued prompts that sample like it, up to `batch_prompts` and
        the scores budget; prompts of aborted requests are answered as aborted and leave the queue."""
        for item in [i for i in self._queue if i.request.aborted.is_set()]:
            self._queue.remove(item)
            if not item.future.done():
                r, p = item.request, item.index
                item.future.set_result([self._aborted(r, p, s, item.prompt) for s in range(item.sampling.n)])
        if not self._queue:
            return []
        sampling = self._queue[0].sampling
        row_bytes = sampling.max_tokens * self.vocab_size * 4
        limit = max(1, min(self.batch_prompts, SCORES_BUDGET_BYTES // max(row_bytes * sampling.n, 1)))
        batch = [item for item in self._queue if item.sampling == sampling][:limit]
        self._queue = [item for item in self._queue if item not in batch]
        return batch

    def _generate_prompt(
        self, request: _Request, prompt_index: int, prompt: list[int], sampling: SamplingSettings
    ) -> list[EngineSample]:
        """The n samples of one prompt (blocking; runs in a worker thread)."""
        if request.aborted.is_set():
            return [self._aborted(request, prompt_index, s, prompt) for s in range(sampling.n)]
        with self._lock:
            self._running += sampling.n
            try:
                seed = sampling.sample_seed(prompt_index, 0)
                rows = self._run_generate([prompt], sampling, [request] * sampling.n, seed)
            finally:
                self._running -= sampling.n
        return self._samples(request, prompt_index, prompt, sampling, rows)

    def _generate_batch(self, batch: list[_Pending]) -> list[list[EngineSample]]:
        """One `generate` for the prompts of `batch` (alike sampling, blocking; runs in a worker thread):
        each prompt's samples."""
        sampling = batch[0].sampling
        n = sampling.n
        owners = [item.request for item in batch for _ in range(n)]
        with self._lock:
            self._running += len(owners)
            try:
                for item in batch:
                    item.request.first_token_s = None
                rows = self._run_generate([item.prompt for item in batch], sampling, owners, None)
                self.batches += 1
            finally:
                self._running -= len(owners)
        return [
            self._samples(item.request, item.index, item.prompt, sampling, rows[b * n : (b + 1) * n])
            for b, item in enumerate(batch)
        ]

    def _run_generate(
        self, prompts: list[list[int]], sampling: SamplingSettings, owners: list[_Request], seed: int | None
    ) -> list[_Row]:
        """transformers `generate` for `prompts` (left-padded to one length), n samples each: every output
        row's generated tokens and their logprobs under `logprobs_mode`, a row of an aborted request cut
        where it stopped. `owners[i]` is row i's request."""
        import torch

        if seed is not None:  # unseeded requests continue the engine's stream (seeded once at start)
            torch.manual_seed(seed)
        width = max(len(prompt) for prompt in prompts)
        pad = self._pad_id()
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        processed = self.logprobs_mode == "processed"
        watch = _Watch(self, owners, width)
        with torch.no_grad():
            output = self._model.generate(
                input_ids,
                attention_mask=mask,
                **self._generation_kwargs(sampling),
                pad_token_id=pad,
                stopping_criteria=[watch],
                tokenizer=self._tokenizer.hf if sampling.stop else None,
                return_dict_in_generate=True,
                output_scores=processed,
                output_logits=not processed,
            )
        steps = output.scores if processed else output.logits
        logprobs = torch.stack(steps, dim=1).float().log_softmax(dim=-1)  # (rows, T, vocab)
        generated = output.sequences[:, width:]  # (rows, T)
        chosen = logprobs.gather(-1, generated.unsqueeze(-1)).squeeze(-1)  # (rows, T)
        return [
            (generated[i, :end].tolist(), chosen[i, :end].tolist())
            for i, end in enumerate(watch.ends(generated.shape[1]))
        ]

    def _pad_id(self) -> int:
        """The token left-padding fills with (masked out): the model's pad token, else its first end token."""
        pad = self._model.generation_config.pad_token_id
        if pad is None:
            pad = getattr(self._model.config, "pad_token_id", None)
        if isinstance(pad, list):
            pad = pad[0] if pad else None
        return int(pad) if pad is not None else (self._eos_ids() or [0])[0]

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
        self, request: _Request, p: int, prompt: list[int], sampling: SamplingSettings, rows: list[_Row]
    ) -> list[EngineSample]:
        """Cut each of the prompt's returned rows (tokens, logprobs) at its first end-of-sequence token
        (kept) and pair tokens with logprobs."""
        total_s = time.perf_counter() - request.submitted
        samples = []
        for s, (generated, logprobs) in enumerate(rows):
            tokens, reason = self._cut(generated, sampling, request)
            samples.append(
                EngineSample(
                    prompt_index=p,
                    sample_index=s,
                    prompt_token_ids=prompt,
                    token_ids=tokens,
                    logprobs=logprobs[: len(tokens)],
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
    """A transformers stopping criterion that records each request's first token time, counts generated
    tokens and stops the rows of aborted requests (`rows[i]`: row i's request). Called once per decoding
    step."""

    def __init__(self, engine: HfEngine, rows: list[_Request], prompt_width: int) -> None:
        self.engine = engine
        self.rows = rows
        self.requests = list({id(r): r for r in rows}.values())
        self.prompt_width = prompt_width
        self.stopped: dict[int, int] = {}
        """Row -> tokens it had generated when its request's abort stopped it."""

    def ends(self, generated: int) -> list[int]:
        """Each row's generated length, `generated` for a row that was not stopped by an abort."""
        return [self.stopped.get(i, generated) for i in range(len(self.rows))]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        import torch

        for request in self.requests:
            if request.first_token_s is None:
                request.first_token_s = time.perf_counter() - request.submitted
        self.engine._tokens_generated += input_ids.shape[0]
        stop = [request.aborted.is_set() for request in self.rows]
        for i, stopped in enumerate(stop):
            if stopped:
                self.stopped.setdefault(i, input_ids.shape[1] - self.prompt_width)
        return torch.tensor(stop, dtype=torch.bool, device=input_ids.device)
