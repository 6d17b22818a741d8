"""Where a replica's weights come from: the base model folder (version 0), the run's object store, or a
broadcast from the learner.

`prepare` does everything that can fail without touching the engine — verifying a manifest and every
file's sha256, copying a remote version to local disk — so that a bad version is refused while the old
one keeps serving. It returns a loader that the replica runs once admission is closed and drained.
`restore_loader` reloads the serving version after a failed load: the folder it came from is kept
until the next version commits. A broadcast version has no folder to restore from; the engine receives
every tensor before it loads any, so a failed transfer never touches the serving weights.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from rlfabric.contracts import wire
from rlfabric.rollout.engine import Engine
from rlfabric.rollout.replica import Loader
from rlfabric.runtime.errors import InvalidArgument
from rlfabric.v1 import rollout_pb2
from rlfabric.weights import versions as store


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
