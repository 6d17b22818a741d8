"""The production engine: vLLM's `AsyncLLM`, running in the caller's event loop.

Shape of a request: each (prompt, sample) pair is its own vLLM request, id `"{request_id}/{p}/{s}"`, with
`n=1` and `output_kind=FINAL_ONLY`. That gives per-sample streaming (a sample is yielded when its request
finishes), per-sample seeds and per-sample abort, while prefix caching still shares a prompt's KV blocks
between its samples. Without stop strings a request is not detokenized by vLLM (`detokenize=False`: its
front end, in this process, would otherwise decode every sample incrementally and the token of every
logprob entry, every engine step); the text is decoded once from the final token ids instead, which made
generation of the bench model ~10 % faster on two CPU cores.

`AsyncLLM` always runs its engine core in a spawned process (so a script that builds an engine needs
`if __name__ == "__main__":`); on CPU the model worker is one more process unless
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which keeps it inside the engine core (much faster start; fine with
`VLLM_CPU_OMP_THREADS_BIND=nobind`, since vLLM can then no longer pin the worker's OpenMP threads). With
a worker process, `worker_wait="block"` makes the engine core and the worker sleep on their queues
instead of spinning (`rlfabric.rollout.vllm_executor`).

Weights are reloaded in the worker by `RlfabricWorkerExtension.rlfabric_load_weights_dir` (vLLM's own
`reload_weights`, fed from a folder read fully into memory). vLLM's reload is not transactional: a
tensor with the wrong shape raises halfway with some layers already replaced (the current one left on
the meta device), and a missing tensor only logs a warning and keeps that layer's old values (a silently
mixed model). Hence `load_weights_dir` checks names and shapes against the base checkpoint first and
refuses any mismatch before the worker is called. Samples in flight during a reload finish on the new
weights (vLLM applies the reload between two steps); drain or abort first when that matters.

LoRA (`max_adapters > 0`: vLLM's `enable_lora`, `max_loras = max_adapters`, its CPU backend included,
where vLLM then runs the model uncompiled): each adapter name keeps one `lora_int_id` for the engine's
life, and each version is its own PEFT folder. `load_adapter` is `AsyncLLM.add_lora` with
`load_inplace=True`: vLLM reads and checks the new folder before it drops the old version, so a refused
adapter leaves the old one serving, and the base is never reloaded. Every request on an adapter carries a
`LoRARequest` of the current version's folder; vLLM keys its prefix cache on that folder too, so cached
prompt blocks of an older version are never reused for a newer one (no cache reset needed). vLLM's CPU
cache of adapters (`max_cpu_loras`) is sized to `max_adapters` as well: the replica never asks for more
names, so vLLM never evicts one.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from rlfabric.rollout.engine import (
    AdapterRef,
    ChatTokenizer,
    Engine,
    EngineSample,
    EngineStats,
    LogprobsMode,
    SamplingSettings,
    WeightsRejected,
    check_weights_dir,
    checkpoint_shapes,
    model_vocab_size,
    resolve_model_dir,
)

if TYPE_CHECKING:
    from rlfabric.weights.broadcast import BroadcastPlan

WORKER_EXTENSION = "rlfabric.rollout.worker_ext.RlfabricWorkerExtension"
BLOCKING_EXECUTOR = "rlfabric.rollout.vllm_executor.BlockingWaitExecutor"
"""vLLM's multiprocess executor without busy waits on its queues (`worker_wait="block"`)."""
VLLM_LOGPROBS_MODE: dict[LogprobsMode, Literal["processed_logprobs", "raw_logprobs"]] = {
    "processed": "processed_logprobs",
    "raw": "raw_logprobs",
}
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


def cpu_compile_cache_defaults(environ: MutableMapping[str, str], *, cpu: bool) -> None:
    """On CPU, vLLM 0.32's AOT-compiled model (its default with torch >= 2.10) is saved to the compile
    cache but fails to load from it ("'function' object has no attribute 'finalize_loading'"), so every
    compiled start compiled again: ~40-70 s of a replica's start on two cores. Its older compile cache
    loads: ~10 s with a warm cache. Hence `VLLM_USE_AOT_COMPILE=0` on CPU unless the caller set it."""
    if cpu:
        environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def chunked_prefill(*, cpu: bool) -> bool | None:
    """vLLM's `enable_chunked_prefill`: off on CPU, vLLM's choice (on) elsewhere.

    With chunked prefill vLLM may schedule part of a prompt in a step (a prompt longer than the step's
    token budget, `max_num_batched_tokens`, or one that meets a budget already mostly spent by other
    requests: any busy replica). The token sampled after such a partial prefill is discarded, and for a
    seeded request vLLM then rewinds the request's generator by its Philox offset
    (`GPUModelRunner._bookkeeping_sync`, `gen.set_offset(gen.get_offset() - 4)`, which the CPU runner
    inherits). A CPU `torch.Generator` has no offset: it raises "CPU Generator does not use offset", the
    worker dies and every request fails with `EngineDeadError` (vllm-cpu 0.32). Without chunked prefill
    a prompt is always prefilled in one step (vLLM then raises `max_num_batched_tokens` to at least
    `max_model_len`), nothing is discarded and seeded sampling is safe. On two CPU cores the throughput
    is unchanged (see the rollout docs); a GPU keeps vLLM's default."""
    return False if cpu else None


def lora_args(max_adapters: int, max_rank: int) -> dict[str, Any]:
    """vLLM engine arguments for `max_adapters` LoRA slots of rank up to `max_rank` (none when 0)."""
    if max_adapters <= 0:
        return {}
    return {
        "enable_lora": True,
        "max_loras": max_adapters,
        "max_cpu_loras": max_adapters,
        "max_lora_rank": max_rank,
    }


def adapter_rank(path: str) -> int:
    """The rank r in a PEFT folder's adapter_config.json (`WeightsRejected` when it has none)."""
    from rlfabric.weights.adapters import ADAPTER_CONFIG_FILE

    try:
        return int(json.loads((Path(path) / ADAPTER_CONFIG_FILE).read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsRejected(f"{path}: no readable LoRA rank in {ADAPTER_CONFIG_FILE} ({exc!r})") from exc


def executor_backend(worker_wait: Literal["spin", "block"]) -> str | None:
    """vLLM's `distributed_executor_backend` for `worker_wait`: "block" is the multiprocess executor with
    blocking waits, unless `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the worker inside the engine core
    (no queue to wait on); None leaves vLLM's choice."""
    multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"
    return BLOCKING_EXECUTOR if worker_wait == "block" and multiprocess else None


class _StatsRecorder(StatLoggerBase):
    """A vLLM stat logger that keeps the latest scheduler counts and a running total of generated tokens
    (vLLM calls `record` after every engine step that produced output)."""

    def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.tokens_generated = 0

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self.tokens_generated += iteration_stats.num_generation_tokens

    def log_engine_initialized(self) -> None:
        pass


class VllmEngine(Engine):
    """vLLM `AsyncLLM` behind the `Engine` interface. Construct, then `await start()` in the loop that
    will use it; every method must be called from that loop."""

    kind = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: Dtype = "auto",
        max_model_len: int = 2048,
        kv_cache_bytes: int = 1 << 30,
        block_size: int | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        max_num_seqs: int = 256,
        logprobs_mode: LogprobsMode = "processed",
        gpu_memory_utilization: float = 0.85,
        worker_wait: Literal["spin", "block"] = "spin",
        max_adapters: int = 0,
        max_adapter_rank: int = 16,
    ) -> None:
        self.model_path = model_path
        self.vocab_size = model_vocab_size(model_path)
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        self._args = AsyncEngineArgs(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_bytes,
            block_size=block_size,
            enforce_eager=enforce_eager,
            seed=seed,
            max_num_seqs=max_num_seqs,
            logprobs_mode=VLLM_LOGPROBS_MODE[logprobs_mode],
            gpu_memory_utilization=gpu_memory_utilization,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=False,
            distributed_executor_backend=executor_backend(worker_wait),
            enable_chunked_prefill=chunked_prefill(cpu=current_platform.is_cpu()),
            **lora_args(max_adapters, max_adapter_rank),
        )
        self.max_adapters = max_adapters
        self.max_adapter_rank = max_adapter_rank
        self._lora_ids: dict[str, int] = {}
        """Adapter name -> its vLLM `lora_int_id` (1, 2, ...), stable for the engine's life."""
        self._llm: AsyncLLM | None = None
        self._stats = _StatsRecorder()
        self._requests: dict[str, list[str]] = {}
        """Our request id -> its vLLM request ids, while the request is being generated."""

    async def start(self) -> None:
        self._tokenizer = ChatTokenizer(self.model_path)
        self._expected_weights = checkpoint_shapes(resolve_model_dir(self.model_path))
        recorder = self._stats
        cpu_compile_cache_defaults(os.environ, cpu=current_platform.is_cpu())  # before the engine spawns
        self._llm = AsyncLLM.from_engine_args(self._args, stat_loggers=[lambda config, index: recorder])

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("engine not started")
        return self._llm

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
        """Submit every sample as its own vLLM request; yield them in finishing order. Leaving the loop
        early cancels the unfinished ones, which makes vLLM abort them."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        keys = [(p, s) for p in range(len(prompts)) for s in range(sampling.n)]
        self._requests[request_id] = [f"{request_id}/{p}/{s}" for p, s in keys]
        finished: asyncio.Queue[EngineSample | Exception] = asyncio.Queue()
        submitted = time.perf_counter()
        lora = self._lora_request(adapter)
        tasks = [
            asyncio.create_task(
                self._run_sample(finished, request_id, p, s, prompts[p], sampling, submitted, lora)
            )
            for p, s in keys
        ]
        try:
            for _ in tasks:
                item = await finished.get()
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            del self._requests[request_id]

    async def _run_sample(
        self,
        finished: asyncio.Queue[EngineSample | Exception],
        request_id: str,
        prompt_index: int,
        sample_index: int,
        prompt: list[int],
        sampling: SamplingSettings,
        submitted: float,
        lora: LoRARequest | None = None,
    ) -> None:
        """Generate one sample to the end and put it (or the error that ended it) on `finished`."""
        params = self._sampling_params(sampling, sampling.sample_seed(prompt_index, sample_index))
        vllm_id = f"{request_id}/{prompt_index}/{sample_index}"
        try:
            prompt_in = TokensPrompt(prompt_token_ids=prompt)
            outputs = self.llm.generate(prompt_in, params, vllm_id, lora_request=lora)
            final = [out async for out in outputs][-1]  # FINAL_ONLY: a single output
            sample = self._sample(final, prompt_index, sample_index, prompt, submitted, params.detokenize)
            finished.put_nowait(sample)
        except Exception as e:  # handed to the consumer of `generate`, which re-raises it
            finished.put_nowait(e)

    def _sampling_params(self, sampling: SamplingSettings, seed: int | None) -> SamplingParams:
        """One sample's vLLM parameters: logprob of the sampled token only, output only at the end, text
        only where stop strings need it (`_sample` decodes the rest)."""
        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop),
            seed=seed,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=bool(sampling.stop),
        )

    def _sample(
        self,
        out: Any,
        prompt_index: int,
        sample_index: int,
        prompt: list[int],
        submitted: float,
        detokenized: bool,
    ) -> EngineSample:
        """Convert vLLM's final `RequestOutput` of one sample."""
        completion = out.outputs[0]
        token_ids = list(completion.token_ids)
        text = completion.text if detokenized else self._decode_completion(token_ids, completion)
        steps = completion.logprobs or []
        total_s = time.perf_counter() - submitted
        metrics = out.metrics
        first_token_s = metrics.first_token_latency if metrics and metrics.first_token_latency else total_s
        return EngineSample(
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_token_ids=prompt,
            token_ids=token_ids,
            logprobs=[step[token].logprob for step, token in zip(steps, token_ids, strict=True)],
            text=text,
            finish_reason=completion.finish_reason or "abort",
            first_token_s=first_token_s if token_ids else 0.0,
            total_s=total_s,
            cached_tokens=int(out.num_cached_tokens or 0),
        )

    def _decode_completion(self, token_ids: list[int], completion: Any) -> str:
        """The text vLLM's detokenizer would have produced: special tokens skipped, and the token that
        stopped the sample (end of sequence or a stop token id, `stop_reason` None or an int) left out
        even when the tokenizer does not mark it special."""
        stopped_on_token = completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str)
        return self._tokenizer.decode(token_ids[:-1] if stopped_on_token and token_ids else token_ids)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(self._requests.get(request_id, []))

    async def load_weights_dir(self, path: str) -> None:
        """Validate against the base checkpoint (raises `WeightsRejected`), load in the worker, then
        drop the prefix cache."""
        check_weights_dir(path, self._expected_weights)
        await self.llm.collective_rpc("rlfabric_load_weights_dir", args=(path,))
        await self.reset_prefix_cache()

    def _lora_request(self, adapter: AdapterRef | None, *, replace: bool = False) -> LoRARequest | None:
        """vLLM's request for `adapter`'s folder under its name's stable id; `replace` reloads it in
        place even though the id is loaded."""
        if adapter is None:
            return None
        lora_id = self._lora_ids.setdefault(adapter.name, len(self._lora_ids) + 1)
        return LoRARequest(adapter.name, lora_id, adapter.path, load_inplace=replace)

    async def load_adapter(self, adapter: AdapterRef) -> None:
        """Check the rank, then load the folder in place under the name's id (vLLM loads and checks the
        new version before it drops the old one). Raises `WeightsRejected`; the old version stays."""
        rank = adapter_rank(adapter.path)
        if rank > self.max_adapter_rank:
            limit = f"engine.max_adapter_rank {self.max_adapter_rank}"
            raise WeightsRejected(f"adapter {adapter.name!r}: rank {rank} exceeds {limit}")
        request = self._lora_request(adapter, replace=True)
        assert request is not None
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # vLLM refused the folder (modules, shapes) in its engine core
            raise WeightsRejected(f"adapter {adapter.name!r}: vLLM refused it: {exc}") from exc

    async def unload_adapter(self, name: str) -> None:
        """Remove the adapter from vLLM (its id stays reserved for the name)."""
        if name in self._lora_ids:
            await self.llm.remove_lora(self._lora_ids[name])

    async def receive_broadcast(self, plan: BroadcastPlan) -> None:
        """The worker joins the group and loads what it receives (see `RlfabricWorkerExtension`)."""
        from rlfabric.weights import broadcast

        kwargs = {
            "metas_json": broadcast.metas_to_json(plan.metas),
            "host": plan.host,
            "port": plan.port,
            "rank": plan.rank,
            "world_size": plan.world_size,
            "backend": plan.backend,
            "bucket_bytes": plan.bucket_bytes,
        }
        problems = broadcast.mismatches(plan.metas, self._expected_weights)
        try:
            await self.llm.collective_rpc("rlfabric_receive_broadcast", kwargs=kwargs)
        except Exception as exc:  # the worker refused (the sender was told why) or the transfer failed
            if problems:
                raise WeightsRejected("; ".join(problems[:5])) from exc
            raise
        await self.reset_prefix_cache()

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """vLLM's latest scheduler counts (updated after each step with output; zero while this engine has
        no request in flight, since it is vLLM's only client) and its generated-token total."""
        idle = not self._requests
        return EngineStats(
            running=0 if idle else self._stats.running,
            waiting=0 if idle else self._stats.waiting,
            kv_cache_usage=self._stats.kv_cache_usage,
            tokens_generated=self._stats.tokens_generated,
        )
