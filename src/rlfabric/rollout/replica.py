"""A rollout replica's state machine: admission, the serving version, and in-place weight updates.

No gRPC here (`server.py` adapts it). Invariants:
- A replica serves only while it holds a published version (`version is not None`); before that,
  Generate is refused (UNAVAILABLE) and health says NOT_SERVING.
- Every sample carries the version the replica held when its request was admitted: an update first
  closes admission, then waits for admitted requests to finish (or aborts them), then loads.
- Versions only increase. An update that fails or times out leaves the old version serving; if the
  engine may have been touched before the failure, the old weights are reloaded before serving resumes,
  and if even that fails the replica stops serving rather than serve a half-loaded model.
- One update at a time.
- Draining (scale-in) is one way: once `start_draining` is called nothing new is admitted (UNAVAILABLE),
  and what was admitted runs to the end (`wait_idle`).
- LoRA adapters (`rollout.adapter_slots`) are versioned per name, beside the base: a request on an
  adapter is admitted by the replica (its limits, a full update's pause) and by the adapter's slot, and
  carries the adapter's version. Loading an adapter version drains (or aborts) that adapter's requests
  only; unloading one aborts them. Adapter loads and unloads are updates too: one update at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rlfabric.contracts import wire
from rlfabric.rollout.adapter_slots import AdapterSlot, AdapterSlots
from rlfabric.rollout.engine import AdapterRef, Engine, EngineSample, SamplingSettings
from rlfabric.rollout.trajectory import Trajectory, TrajectoryDriver
from rlfabric.runtime import failpoints
from rlfabric.runtime.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from rlfabric.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlayTask:
    """One task of a multi-turn request: the dataset row and the chat template's extra variables."""

    task: dict[str, Any]
    template_kwargs: dict[str, Any] | None = None


# A loader puts a version's weights into the engine; the replica decides when it may run.
Loader = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Limits:
    """What one Generate request may ask for."""

    max_in_flight: int
    max_n: int
    max_tokens: int
    max_prompts: int
    min_version_wait_s: float = 30.0
    """How long a request that needs a newer version than the serving one waits for it."""


@dataclass(frozen=True)
class UpdateTimings:
    version: int
    drain_s: float
    load_s: float


class Replica:
    def __init__(self, engine: Engine, limits: Limits) -> None:
        self.engine = engine
        self.limits = limits
        self.version: int | None = None
        self.in_flight = 0  # admitted prompts whose samples are not all finished
        self.watchdog = Watchdog(float("inf"), "the replica's engine")  # `main.start_watchdogs` arms it
        self.tokens_generated = 0
        self.last_load_s = 0.0
        self.busy_s = 0.0
        self._busy_since: float | None = None
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._update_lock = asyncio.Lock()
        self._requests: set[str] = set()
        self._turns: set[str] = set()  # engine request ids of multi-turn model turns now generating
        self._restore: Loader | None = None
        self._new_version = asyncio.Event()  # set (and replaced) whenever the serving version changes
        self.draining = False
        self.started_at = time.monotonic()
        self.adapters = AdapterSlots(engine.max_adapters)
        self.awaited_adapters: frozenset[str] = frozenset()
        """The adapters this replica is to load: the one of the run it follows (named after the run), or
        those of its fleet's current members. A request for one waits up to `min_version_wait_s` for its
        first version, as for a version the learner announced but the replica has not loaded yet. Any
        other adapter the replica does not hold is NOT_FOUND at once."""

    @property
    def awaited_adapter(self) -> str:
        """The single awaited adapter of a replica bound to a run ("" when none, or several)."""
        return next(iter(self.awaited_adapters)) if len(self.awaited_adapters) == 1 else ""

    @awaited_adapter.setter
    def awaited_adapter(self, name: str) -> None:
        self.awaited_adapters = frozenset({name} if name else ())

    @property
    def serving(self) -> bool:
        return self.version is not None

    def busy_fraction(self) -> float:
        """Fraction of wall time since start with at least one request in the engine."""
        busy = self.busy_s + (time.monotonic() - self._busy_since if self._busy_since else 0.0)
        return busy / max(time.monotonic() - self.started_at, 1e-9)

    # --- generation -------------------------------------------------------------------------------

    def check_request(self, prompts: list[list[int]], sampling: SamplingSettings) -> None:
        """Raises InvalidArgument naming the field for a request this replica cannot run."""
        if not prompts:
            raise InvalidArgument("prompts: at least one prompt is required")
        if len(prompts) > self.limits.max_prompts:
            raise InvalidArgument(
                f"prompts: {len(prompts)} prompts exceed the limit of {self.limits.max_prompts}"
            )
        check_sampling(sampling, self.limits)
        for i, ids in enumerate(prompts):
            if not ids:
                raise InvalidArgument(f"prompts[{i}]: the prompt is empty")
            if len(ids) + sampling.max_tokens > self.engine.max_model_len:
                raise InvalidArgument(
                    wire.prompt_too_long_details(i, len(ids), sampling.max_tokens, self.engine.max_model_len)
                )

    async def generate(
        self,
        request_id: str,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        min_version: int = 0,
        adapter: str = "",
    ) -> AsyncGenerator[tuple[EngineSample, int], None]:
        """Streams (sample, version at admission). Waits while an update holds admission closed, and
        until the replica serves at least `min_version` (FailedPrecondition past `min_version_wait_s`).
        With `adapter`, generates with that LoRA adapter and the versions are the adapter's."""
        self.check_request(prompts, sampling)
        slot = await self._admit_on(adapter, request_id, len(prompts), min_version)
        ref = slot.ref() if slot is not None else None
        version = ref.version if ref is not None else self.version
        assert version is not None
        try:
            async for sample in self.engine.generate(request_id, prompts, sampling, ref):
                failpoints.hit("rollout.mid_generate")  # the fault tests' death (or hang) holding a request
                self.tokens_generated += len(sample.token_ids)
                self.watchdog.tick("a sample")
                yield sample, version
        finally:
            self._release(request_id, len(prompts))
            if slot is not None:
                slot.release(request_id, len(prompts))

    async def _admit_on(
        self, adapter: str, request_id: str, count: int, min_version: int
    ) -> AdapterSlot | None:
        """Admits a request on the base (returns None) or on `adapter`'s slot (returned)."""
        if not adapter:
            await self._version_at_least(min_version)
            await self._admit(request_id, count)
            return None
        slot = await self._serving_slot(adapter)
        await slot.version_at_least(min_version, self.limits.min_version_wait_s)
        while True:  # both the replica and the slot must admit; an adapter update may close the slot
            await slot.admitting.wait()
            if not self.adapters.holds(slot):
                raise NotFound(f"adapter: {adapter!r} was unloaded")
            await self._admit(request_id, count)
            if slot.admitting.is_set() and self.adapters.holds(slot):
                slot.admit(request_id, count)
                return slot
            self._release(request_id, count)

    async def play(
        self,
        request_id: str,
        tasks: list[PlayTask],
        sampling: SamplingSettings,
        driver: TrajectoryDriver,
        min_version: int = 0,
        adapter: str = "",
    ) -> AsyncGenerator[tuple[int, int, Trajectory, int], None]:
        """Plays `sampling.n` trajectories of each task at once; streams (task index, sample index,
        trajectory, version at admission) as each ends. Admission as for `generate`: the whole trajectory
        is one admitted prompt, so every turn is generated by the admitted version (with `adapter`, the
        adapter's: `driver`, built for this request, then generates its turns with it)."""
        if not tasks:
            raise InvalidArgument("prompts: at least one prompt is required")
        check_sampling(sampling, self.limits)
        slot = await self._admit_on(adapter, request_id, len(tasks), min_version)
        version = slot.version if slot is not None else self.version
        assert version is not None
        if slot is not None:
            driver.generate_turn = functools.partial(self.engine_turn, adapter=slot.ref())
        keys = [(p, s) for p in range(len(tasks)) for s in range(sampling.n)]
        plays = {
            asyncio.ensure_future(
                self._play_one(driver, f"{request_id}/{p}/{s}", tasks[p], sampling, p, s)
            ): (
                p,
                s,
            )
            for p, s in keys
        }
        try:
            for done in asyncio.as_completed(plays):
                p, s, trajectory = await done
                yield p, s, trajectory, version
        finally:
            for task in plays:
                task.cancel()
            await asyncio.gather(*plays, return_exceptions=True)
            self._release(request_id, len(tasks))
            if slot is not None:
                slot.release(request_id, len(tasks))

    async def _play_one(
        self,
        driver: TrajectoryDriver,
        play_id: str,
        task: PlayTask,
        sampling: SamplingSettings,
        p: int,
        s: int,
    ) -> tuple[int, int, Trajectory]:
        seed = sampling.sample_seed(p, s)
        trajectory = await driver.play(play_id, task.task, sampling, task.template_kwargs, seed)
        return p, s, trajectory

    async def engine_turn(
        self, turn_id: str, prompt: list[int], sampling: SamplingSettings, adapter: AdapterRef | None = None
    ) -> EngineSample:
        """One model turn of a trajectory (the driver's `TurnGenerator`), on `adapter` when given; an update
        that aborts in-flight work (of the replica, or of that adapter) aborts it too."""
        if len(prompt) + sampling.max_tokens > self.engine.max_model_len:
            raise InvalidArgument(
                wire.prompt_too_long_details(0, len(prompt), sampling.max_tokens, self.engine.max_model_len)
            )
        slot = self.adapters.get(adapter.name) if adapter is not None else None
        turns = [self._turns] + ([slot.requests] if slot is not None else [])  # where aborts look
        for ids in turns:
            ids.add(turn_id)
        try:
            async for sample in self.engine.generate(turn_id, [prompt], sampling, adapter):
                self.tokens_generated += len(sample.token_ids)
                self.watchdog.tick("a turn")
                return sample
        finally:
            for ids in turns:
                ids.discard(turn_id)
        raise RuntimeError(f"{turn_id}: the engine yielded no sample")

    async def _version_at_least(self, min_version: int) -> None:
        deadline = time.monotonic() + self.limits.min_version_wait_s
        while self.version is not None and self.version < min_version:
            changed = self._new_version
            try:
                await asyncio.wait_for(changed.wait(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                raise FailedPrecondition(
                    f"min_policy_version: this replica serves version {self.version} and version "
                    f"{min_version} did not arrive within {self.limits.min_version_wait_s:g} s"
                ) from None

    async def _serving_slot(self, name: str) -> AdapterSlot:
        """The slot of adapter `name` (NotFound when not held); an awaited adapter (`awaited_adapters`, read
        again at each change) is waited for."""
        deadline = time.monotonic() + self.limits.min_version_wait_s
        while True:
            changed = self.adapters.changed
            try:
                return self.adapters.serving(name)
            except NotFound:
                if name not in self.awaited_adapters or time.monotonic() >= deadline:
                    raise
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(deadline - time.monotonic(), 0))

    def _set_version(self, version: int | None) -> None:
        self.version = version
        self._new_version.set()
        self._new_version = asyncio.Event()

    async def _admit(self, request_id: str, count: int) -> int:
        await self._admitting.wait()
        if self.draining:
            raise Unavailable("this replica is draining (shutting down): send the request to another one")
        if self.version is None:
            raise Unavailable("this replica holds no published weights yet")
        if request_id in self._requests:
            raise InvalidArgument(f"request_id: {request_id!r} is already in flight on this replica")
        if self.in_flight + count > self.limits.max_in_flight:
            raise ResourceExhausted(
                f"replica at capacity: {self.in_flight} prompts in flight, limit {self.limits.max_in_flight}"
            )
        self.in_flight += count
        self._requests.add(request_id)
        self._idle.clear()
        if self._busy_since is None:
            self._busy_since = time.monotonic()
        return self.version

    def _release(self, request_id: str, count: int) -> None:
        self.in_flight -= count
        self._requests.discard(request_id)
        if self.in_flight == 0:
            self._idle.set()
            if self._busy_since is not None:
                self.busy_s += time.monotonic() - self._busy_since
                self._busy_since = None

    # --- draining ---------------------------------------------------------------------------------

    def start_draining(self) -> None:
        """Admits nothing from now on; requests already admitted continue."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no admitted request is left; False if some still run after `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # --- weights ----------------------------------------------------------------------------------

    def start_serving(self, version: int, restore: Loader) -> None:
        """Marks the engine's current weights as `version`; `restore` reloads them after a failed update."""
        self._set_version(version)
        self._restore = restore

    async def update(
        self, version: int, load: Loader, *, restore: Loader, abort_in_flight: bool, timeout_s: float
    ) -> UpdateTimings | None:
        """Loads `version` in place; returns None when it is already serving (a no-op)."""
        if self.version is not None and version == self.version:
            return None
        if self.version is not None and version < self.version:
            raise FailedPrecondition(f"version: {version} is older than the serving version {self.version}")
        async with self._update_lock:
            return await self._update_locked(version, load, restore, abort_in_flight, timeout_s)

    async def _update_locked(
        self, version: int, load: Loader, restore: Loader, abort_in_flight: bool, timeout_s: float
    ) -> UpdateTimings:
        deadline = time.monotonic() + timeout_s
        self._admitting.clear()
        try:
            drain_s = await self._drain(abort_in_flight, deadline)
            load_s = await self._load(load, deadline)
        finally:
            self._admitting.set()
        self._restore, self.last_load_s = restore, load_s
        self._set_version(version)
        return UpdateTimings(version, drain_s, load_s)

    async def _drain(self, abort_in_flight: bool, deadline: float) -> float:
        start = time.monotonic()
        if abort_in_flight:
            for request_id in [*self._requests, *self._turns]:
                await self.engine.abort(request_id)
        try:
            await asyncio.wait_for(self._idle.wait(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            raise DeadlineExceeded(
                f"{self.in_flight} prompts still in flight at the update deadline; "
                "the old version keeps serving"
            ) from None
        return time.monotonic() - start

    async def _load(self, load: Loader, deadline: float) -> float:
        start = time.monotonic()
        try:
            await asyncio.wait_for(load(), max(deadline - time.monotonic(), 0.001))
            await self.engine.reset_prefix_cache()
        except TimeoutError as exc:
            await self._recover(exc)
            raise DeadlineExceeded("loading the weights did not finish before the update deadline") from exc
        except ValueError as exc:  # the engine refused the tensors (names, shapes) before touching weights
            await self._recover(exc)
            raise FailedPrecondition(f"weights refused by the engine: {exc}") from exc
        except BaseException as exc:
            await self._recover(exc)
            raise
        return time.monotonic() - start

    # --- adapters ---------------------------------------------------------------------------------

    async def update_adapter(
        self, name: str, version: int, path: str, *, abort_in_flight: bool, timeout_s: float
    ) -> UpdateTimings | None:
        """Loads version `version` of adapter `name` from the PEFT folder `path` (a new name takes a free
        slot: ResourceExhausted when none is left). None when that version already serves."""
        async with self._update_lock:
            slot = self.adapters.reserve(name)
            try:
                if slot.version is not None and version <= slot.version:
                    self.check_not_older(version, slot.version, f"adapter {name!r}")
                    return None
                return await self._update_adapter_locked(slot, version, path, abort_in_flight, timeout_s)
            finally:
                self.adapters.drop_if_unloaded(slot)

    @staticmethod
    def check_not_older(version: int, serving: int, what: str) -> None:
        """FailedPrecondition when `version` is older than the `serving` one of `what`."""
        if version < serving:
            raise FailedPrecondition(f"version: {version} is older than {what}'s serving version {serving}")

    async def _update_adapter_locked(
        self, slot: AdapterSlot, version: int, path: str, abort_in_flight: bool, timeout_s: float
    ) -> UpdateTimings:
        """Close the slot, drain it, load (the engine's load is all-or-nothing and is not cut short by
        the deadline once started: the old version serves on if it fails), set the version, reopen."""
        deadline = time.monotonic() + timeout_s
        slot.admitting.clear()
        try:
            drain_s = await self._drain_slot(slot, abort_in_flight, deadline)
            start = time.monotonic()
            try:
                await self.engine.load_adapter(AdapterRef(slot.name, version, path))
            except ValueError as exc:  # refused before the old version was dropped
                raise FailedPrecondition(f"adapter {slot.name!r} refused by the engine: {exc}") from exc
            load_s = time.monotonic() - start
        finally:
            slot.admitting.set()
        slot.set_version(version, path)
        self.adapters.notify()
        self.last_load_s = load_s
        return UpdateTimings(version, drain_s, load_s)

    async def _drain_slot(self, slot: AdapterSlot, abort_in_flight: bool, deadline: float) -> float:
        start = time.monotonic()
        if abort_in_flight:
            for request_id in list(slot.requests):
                await self.engine.abort(request_id)
        try:
            await asyncio.wait_for(slot.idle.wait(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            raise DeadlineExceeded(
                f"{slot.in_flight} prompts still in flight on adapter {slot.name!r} at the update deadline; "
                "its old version keeps serving"
            ) from None
        return time.monotonic() - start

    async def unload_adapter(self, name: str, timeout_s: float) -> tuple[int, int]:
        """Aborts the adapter's requests, frees its slot in the engine and here; returns (the version it
        held, prompts aborted)."""
        async with self._update_lock:
            slot = self.adapters.serving(name)
            slot.admitting.clear()
            aborted = slot.in_flight
            try:
                await self._drain_slot(slot, True, time.monotonic() + timeout_s)
                await self.engine.unload_adapter(name)
            except BaseException:
                slot.admitting.set()
                raise
            self.adapters.remove(slot)
            return slot.version or 0, aborted

    async def _recover(self, exc: BaseException) -> None:
        """After a failed load the engine may hold a mix of weights: reload the serving version's."""
        log.error("weight update failed; restoring the serving version", exc_info=exc)
        try:
            if self._restore is not None:
                await self._restore()
                await self.engine.reset_prefix_cache()
        except Exception:
            log.exception("could not restore the serving version; this replica stops serving")
            self._set_version(None)


def check_sampling(s: SamplingSettings, limits: Limits) -> None:
    """Raises InvalidArgument naming the field for sampling beyond this replica's limits (the values
    themselves were checked when `s` was built, `rlfabric.rollout.types.sampling_problem`)."""
    if s.n > limits.max_n:
        raise InvalidArgument(f"sampling.n: must be in [1, {limits.max_n}], got {s.n}")
    if s.max_tokens > limits.max_tokens:
        raise InvalidArgument(f"sampling.max_tokens: must be in [1, {limits.max_tokens}], got {s.max_tokens}")
