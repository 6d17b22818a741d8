"""A rollout replica the preference build starts itself (`kind = "local"`): sampling on a laptop with no
fleet running.

The build launches `rlfabric serve rollout --model MODEL` on loopback under the process guard (nothing it
started outlives it, even under SIGKILL), with random learner and client tokens so the replica is not
insecure, waits for it to serve, and then samples through it exactly as `kind = "rollout"` does
(`RolloutGenerator`, presenting the client token).
`close()` stops it. The manifest records the model folder and the policy version it served.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlfabric.local.procs import ServiceProcess
from rlfabric.local.stack import ANY_METRICS_PORT, cli, vllm_env
from rlfabric.prefs.generation import Generator, GeneratorUnusable, Outcome, RolloutGenerator
from rlfabric.prefs.generator_specs import LocalGeneratorSpec, RolloutGeneratorSpec
from rlfabric.prefs.types import Prompt

LISTENING = r"listening on (\S+)"
SERVING = r"serving version (\d+)"


class LocalGenerator(Generator):
    """Starts the replica on first use; generates through it (`RolloutGenerator`)."""

    def __init__(self, spec: LocalGeneratorSpec) -> None:
        self.spec = spec
        self._proc: ServiceProcess | None = None
        self._inner: RolloutGenerator | None = None
        self._described: dict[str, Any] = {}
        self._logs = Path(tempfile.mkdtemp(prefix="rlfabric-prefs-replica-"))
        self._client_token = secrets.token_urlsafe(32)
        """What the replica requires on Generate and GetInfo; only this generator holds it."""

    async def generate_each(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[Outcome]:
        inner = await self._started()
        return await inner.generate_each(
            prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed
        )

    async def _started(self) -> RolloutGenerator:
        if self._inner is None:
            address = await asyncio.to_thread(self._launch)
            rollout = RolloutGeneratorSpec(
                address=address, batch_size=self.spec.batch_size, concurrency=self.spec.concurrency
            )
            self._inner = RolloutGenerator(rollout, token=self._client_token)
        return self._inner

    def _launch(self) -> str:
        """Starts the replica and waits until it serves; its address."""
        spec = self.spec
        argv = cli("serve", "rollout", "--model", spec.model, "--port", "0", *ANY_METRICS_PORT)
        settings = [
            f"engine.max_model_len={spec.max_model_len}",
            f"max_tokens={spec.max_tokens}",
            f"engine.kv_cache_bytes={spec.kv_cache_bytes}",
            f"engine.enforce_eager={str(not spec.compile).lower()}",
            "log.format=text",
        ]
        for setting in settings:
            argv += ["--set", setting]
        env = {
            **vllm_env(compile_=spec.compile),
            "RLFABRIC_ROLLOUT__LEARNER_TOKEN": secrets.token_urlsafe(32),  # nothing updates its weights
            "RLFABRIC_ROLLOUT__CLIENT_TOKEN": self._client_token,
        }
        log = self._logs / "rollout.log"
        proc = ServiceProcess("prefs-rollout", argv, log_path=log, env=env, guarded=True)
        self._proc = proc
        print(f"prefs: starting a replica of {spec.model} (log: {log})", file=sys.stderr, flush=True)
        proc.launch()
        try:
            address = proc.wait_for(LISTENING, timeout_s=spec.startup_timeout_s).group(1)
            proc.wait_for(SERVING, timeout_s=spec.startup_timeout_s)
        except Exception as exc:
            proc.stop(grace_s=10)
            raise GeneratorUnusable(
                f"generator.model: the replica for {spec.model!r} did not start ({exc}); log: {proc.log_path}"
            ) from exc
        return address

    def describe(self) -> dict[str, Any]:
        inner = self._inner.describe() if self._inner is not None else self._described
        inner = {k: v for k, v in inner.items() if k not in ("address", "replica_id")}  # this process's
        return {**inner, "kind": "local", "model_path": self.spec.model}

    async def close(self) -> None:
        if self._inner is not None:
            self._described = self.describe()
            await self._inner.close()
        if self._proc is not None:
            await asyncio.to_thread(self._proc.stop, 30)
            self._proc = None
            self._inner = None
