"""Where a replica's weights come from: the base model folder (version 0), the run's object store, or a
broadcast from the learner.

`prepare` does everything that can fail without touching the engine — verifying a manifest and every
file's sha256, copying a remote version to local disk — so that a bad version is refused while the old
one keeps serving. It returns a loader that the replica runs once admission is closed and drained.
`restore_loader` reloads the serving version after a failed load: the folder it came from is kept
until the next version commits. A broadcast version has no folder to restore from; the engine receives
every tensor before it loads any, so a failed transfer never touches the serving weights.

LoRA adapters are staged as a PEFT folder per (name, version) in local scratch, before the replica drains
anything: `prepare_adapter` verifies an object-store adapter version, or joins the learner's broadcast of
the adapter's tensors (received here, in the replica's process, not in the engine's worker: the engine
keeps generating meanwhile). The serving version's folder is kept (vLLM re-reads it should it ever reload
the adapter); `discard_adapter` deletes replaced and refused ones.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rlfabric.contracts import wire
from rlfabric.rollout.engine import Engine
from rlfabric.rollout.replica import Loader
from rlfabric.runtime.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from rlfabric.v1 import rollout_pb2
from rlfabric.weights import versions as store


def adapter_config_from_json(text: str) -> dict[str, Any]:
    """`BroadcastSource.adapter_config_json` as an object (INVALID_ARGUMENT when missing or not one)."""
    try:
        config = json.loads(text) if text else None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"broadcast.adapter_config_json: not JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise InvalidArgument("broadcast.adapter_config_json: required for an adapter, as a JSON object")
    return config


class WeightsSource:
    def __init__(self, engine: Engine, *, base_model_dir: str, root_url: str | None) -> None:
        self.engine = engine
        self.base_model_dir = base_model_dir
        self.root_url = root_url
        self.serving_dir: str | None = base_model_dir
        self._staged: dict[int, str] = {}
        self._scratch = Path(tempfile.mkdtemp(prefix="rlfabric-weights-"))

    def close(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)

    async def latest(self) -> int | None:
        """The newest committed version in the run's object store, if the replica follows a run."""
        if not self.root_url:
            return None
        return await asyncio.to_thread(store.latest_committed, self.root_url)

    async def prepare(self, request: rollout_pb2.UpdateWeightsRequest) -> tuple[Loader, float]:
        """A loader for the requested version, and the seconds spent verifying and fetching it."""
        start = time.monotonic()
        kind = request.WhichOneof("source")
        if kind == "object_store":
            root = request.object_store.root_url or self.root_url
            if not root:
                raise InvalidArgument("object_store.root_url: required (this replica has no default root)")
            path = await self.stage(root, request.version)
            return self._dir_loader(path), time.monotonic() - start
        if kind == "broadcast":
            plan = wire.broadcast_from_proto(request.broadcast)
            return (lambda: self.engine.receive_broadcast(plan)), 0.0
        raise InvalidArgument("source: set object_store or broadcast")

    async def holds_adapter(self, version: int) -> bool:
        """Whether version `version` of the replica's weights root is a LoRA adapter (its manifest's kind)."""
        from rlfabric.weights.adapters import is_adapter_version

        manifest = await asyncio.to_thread(store.read_manifest, self.root_url or "", version)
        return is_adapter_version(manifest)

    async def prepare_adapter(self, request: rollout_pb2.UpdateWeightsRequest, timeout_s: float) -> str:
        """The local PEFT folder of the adapter version `request` names, from its source."""
        kind = request.WhichOneof("source")
        if kind == "object_store":
            return await self.stage_adapter(request.adapter, request.object_store.root_url, request.version)
        if kind == "broadcast":
            return await self.receive_adapter(request.adapter, request.version, request.broadcast, timeout_s)
        raise InvalidArgument("source: set object_store or broadcast")

    async def receive_adapter(
        self, name: str, version: int, source: rollout_pb2.BroadcastSource, timeout_s: float
    ) -> str:
        """Receives an adapter's tensors from the learner's broadcast and writes its PEFT folder. Tensors
        that are not LoRA tensors are refused at the handshake (the sender fails with the reason):
        FAILED_PRECONDITION; a transfer past `timeout_s`: DEADLINE_EXCEEDED; another failure of the
        transfer: UNAVAILABLE."""
        from rlfabric.weights import broadcast
        from rlfabric.weights.adapters import adapter_names_problem, write_adapter_folder

        config = adapter_config_from_json(source.adapter_config_json)
        plan = wire.broadcast_from_proto(source)
        refusal = adapter_names_problem(m.name for m in plan.metas)
        try:
            tensors, _ = await asyncio.to_thread(
                broadcast.receive_state_dict, plan.metas, host=plan.host, port=plan.port, rank=plan.rank,
                world_size=plan.world_size, backend=plan.backend, bucket_bytes=plan.bucket_bytes,
                timeout_s=timeout_s, device="cpu", refusal=refusal,
            )  # fmt: skip
        except broadcast.BroadcastTimeout as exc:
            raise DeadlineExceeded(f"adapter {name!r}: the broadcast did not finish: {exc}") from exc
        except broadcast.BroadcastError as exc:
            if refusal:
                raise FailedPrecondition(f"adapter {name!r}: broadcast refused: {refusal}") from exc
            raise Unavailable(f"adapter {name!r}: the broadcast failed: {exc}") from exc
        dest = self._adapter_dir(name, version)
        return str(await asyncio.to_thread(write_adapter_folder, tensors, config, dest))

    async def stage_adapter(self, name: str, root: str | None, version: int) -> str:
        """Verifies adapter version `version` under `root` (or the replica's default root) and returns its
        local PEFT folder: FAILED_PRECONDITION for a version that does not verify or is not an adapter,
        NOT_FOUND when it is not committed."""
        from rlfabric.weights.adapters import materialize_adapter

        root = root or self.root_url
        if not root:
            raise InvalidArgument("object_store.root_url: required (this replica has no default root)")
        dest = self._adapter_dir(name, version)
        return str(await asyncio.to_thread(materialize_adapter, root, version, dest))

    def _adapter_dir(self, name: str, version: int) -> Path:
        """A new, empty folder for one staging of adapter `name`'s version (two updates racing for the same
        version never write one folder; its path is also what vLLM keys the adapter's prefix cache on)."""
        parent = self._scratch / "adapters" / name
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"v{version:06d}-", dir=parent))

    def discard_adapter(self, path: str | None) -> None:
        """Delete an adapter folder no version serves from (replaced, unloaded, or refused)."""
        if path and path.startswith(str(self._scratch)):
            shutil.rmtree(path, ignore_errors=True)

    async def stage(self, root: str, version: int) -> str:
        """Verifies the version (FAILED_PRECONDITION naming the file that does not match, NOT_FOUND when
        it is not committed) and returns a local folder of its safetensors files."""
        await asyncio.to_thread(store.verify_version, root, version)
        path = store.version_dir(root, version)
        if "://" in path:
            path = await asyncio.to_thread(self._download, root, version)
        self._staged[version] = path
        return path

    def _download(self, root: str, version: int) -> str:
        """Copies a remote version to local disk (verifying every file's hash again on the way)."""
        from safetensors.torch import save_file

        target = self._scratch / f"v{version:06d}"
        target.mkdir(parents=True, exist_ok=True)
        save_file(store.load_version(root, version, verify=True), str(target / "model.safetensors"))
        return str(target)

    def _dir_loader(self, path: str) -> Loader:
        return lambda: self.engine.load_weights_dir(path)

    def restore_loader(self) -> Loader:
        serving = self.serving_dir

        async def restore() -> None:
            if serving is None:
                raise RuntimeError("the serving version came by broadcast: nothing on disk to restore from")
            await self.engine.load_weights_dir(serving)

        return restore

    def commit(self, request: rollout_pb2.UpdateWeightsRequest) -> None:
        """The requested version is serving: remember its folder (for restores), drop older downloads."""
        new_dir = self._staged.pop(request.version, None)
        old = self.serving_dir
        self.serving_dir = new_dir
        if old and old.startswith(str(self._scratch)) and old != new_dir:
            shutil.rmtree(old, ignore_errors=True)
