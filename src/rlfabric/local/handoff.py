"""Eager first, compiled next: `rlfabric up --compile` serves from an eager stand-in replica (the
transformers engine with prompts batched, or eager vLLM: `replicas.stand_in_engine`) while a compiled vLLM
twin of it builds, then hands the work over.

A compiled vLLM replica generates faster on a CPU (1,819 against 1,425 tokens/s eager, measured on two
cores), but on a cold compile cache it spends 40-70 s compiling before it serves, and the first step of a
run waited for it (178 s to the first step of the e2e bench, against TRL's 38 s). An eager vLLM replica
serves after ~28 s on two cores, the transformers stand-in after ~7 s. So for each replica `up` starts
both, on the same cores:

    1. serve      the eager replica (`rollout-i`) takes the run's work as soon as it holds a version
    2. build      its compiled twin (`rollout-i-compiled`) starts once the run has trained its first
                  step (a fleet's: once the rest of the stack is up): its compiling would slow the
                  other services' start and the first generation on a small machine (first step of
                  the e2e bench 31-34 s with the twin started beside them, 26 s after); once ready it
                  loads the run's published version and registers, taking work beside the eager one
    3. hand over  the supervisor watches the twin instead, the local scaler counts it instead, and the
                  eager replica gets SIGTERM: it admits nothing new, finishes what it admitted and
                  deregisters (the scale-in drain), so nothing is lost or generated twice
    A twin that does not start is stopped and the eager replica keeps serving (said in the log).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlfabric.local.procs import ServiceProcess, ServiceStartError
from rlfabric.local.scaler import LocalScaler
from rlfabric.local.supervisor import Supervisor

AFTER_POLL_S = 0.5
"""How often `Handoff.begin` asks whether to launch the twin yet."""
TWIN_SUFFIX = "-compiled"
"""The compiled twin of replica `rollout-i` is `rollout-i-compiled` (its process and replica id)."""


@dataclass
class Handoff:
    """One eager replica (started with the stack) and its compiled twin (not yet started); `begin`
    launches the twin and hands over in the background once it is ready."""

    eager: ServiceProcess
    twin: ServiceProcess
    ready: str
    start_timeout_s: float = 600.0
    say: Callable[[str], None] = print
    outcome: str | None = None
    """What happened, for the summary: None while the twin builds."""
    _thread: threading.Thread | None = field(default=None, repr=False)

    def begin(
        self, supervisor: Supervisor, scaler: LocalScaler | None, after: Callable[[], bool] | None = None
    ) -> None:
        """In the background: launches the twin once `after()` is true (polled every `AFTER_POLL_S`; at
        once without it), then hands over when the twin is ready."""
        self._thread = threading.Thread(target=self._run, args=(supervisor, scaler, after), daemon=True)
        self._thread.start()

    def _run(
        self, supervisor: Supervisor, scaler: LocalScaler | None, after: Callable[[], bool] | None
    ) -> None:
        while after is not None and not supervisor.closed and not after():
            time.sleep(AFTER_POLL_S)
        if not supervisor.launch(self.twin):
            return
        self.say(f"  starting {self.twin.name} (compiled; {self.eager.name} serves meanwhile) ...")
        started = self.twin.launched_at
        try:
            self.twin.wait_for(
                self.ready, timeout_s=max(started + self.start_timeout_s - time.monotonic(), 1)
            )
        except ServiceStartError as exc:
            if not supervisor.closed:
                self.outcome = f"{self.twin.name} did not start ({str(exc).splitlines()[0]}); "
                self.outcome += f"{self.eager.name} keeps serving eagerly"
                self.say(f"handoff: {self.outcome}")
                self.twin.stop(grace_s=10)
            return
        if supervisor.closed:
            return
        self.hand_over(supervisor, scaler, time.monotonic() - started)

    def hand_over(self, supervisor: Supervisor, scaler: LocalScaler | None, took_s: float) -> None:
        """The twin is ready: it is supervised and counted in place of the eager replica, which drains."""
        supervisor.watch(self.twin, self.ready)
        supervisor.forget(self.eager)
        if scaler is not None:
            scaler.replace(self.eager, self.twin)
        self.outcome = f"{self.twin.name} ready after {took_s:.0f} s; {self.eager.name} drains and stops"
        self.say(f"handoff: {self.outcome}")
        self.eager.stop(grace_s=30)
