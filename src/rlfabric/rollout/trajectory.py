"""The multi-turn trajectory driver: plays one task against an environment, turn by turn, on this replica.

Turns run next to the engine, so each model turn after the first is a prompt the engine has mostly
seen: vLLM's prefix cache keeps the conversation's KV blocks between turns, and only the environment's
new tokens are prefilled (`Trajectory.cached_prompt_tokens` counts the hits). One trajectory:

    1. reset     open an environment session on the task; render its first messages (and tools) with the
                 chat template and the generation prompt: the trajectory's prompt ids
    2. generate  one model turn: the engine samples from prompt + everything so far, up to the turn's
                 token budget, ending at the template's end-of-turn token; the sampled ids are kept as
                 they are (loss mask 1, the engine's log-probs)
    3. step      send the turn's text to the environment; its reply's messages are appended as ids by
                 incremental rendering (`IncrementalRenderer.append_turn`: loss mask 0, log-prob 0),
                 never by re-tokenizing the conversation; a step reward lands on the model turn
    4. repeat 2-3 until the environment says done, or a limit ends the trajectory (truncated): max_turns,
                 the total token budget, the context, a turn cut at max_tokens, the environment's own
                 step limit
    5. close     the session, whatever happened

An environment that fails or times out ends the trajectory with that status (never a reward of 0);
the chat template refusing to extend the conversation ends it `template_mismatch`, naming the turn. No
grpc here: the environment is anything with the `EnvironmentSessions` methods (the service's client).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from rlfabric.contracts.trajectory import TrajectoryStatus, Turn, TurnRole
from rlfabric.environment.types import EnvStatus, Message, ResetOutcome, StepOutcome
from rlfabric.rollout.chat_template import IncrementalRenderer, TemplateMismatch
from rlfabric.rollout.types import EngineSample, SamplingSettings

TurnGenerator = Callable[[str, list[int], SamplingSettings], Awaitable[EngineSample]]
"""Generates one model turn: (engine request id, prompt ids, sampling with n=1) -> the sample."""
TURN_SEED_STRIDE = 7919
"""A seeded trajectory's turn k samples with seed + k * this (distinct, reproducible seeds per turn)."""


class EnvironmentSessions(Protocol):
    """What the driver needs of an environment: the environment service's async client."""

    async def reset(self, task: dict[str, Any], *, seed: int | None = None) -> ResetOutcome: ...

    async def step(self, session_id: str, action: str) -> StepOutcome: ...

    async def close(self, session_id: str) -> None: ...


@dataclass(frozen=True)
class TrajectoryLimits:
    """What one trajectory may use (rollout.proto's `MultiTurn`, with the context filled in)."""

    max_turns: int
    """Model turns."""
    max_total_tokens: int
    """Completion tokens after the prompt, model and environment tokens together."""
    max_model_len: int
    """The engine's context: prompt + completion."""


@dataclass
class Trajectory:
    """One played task. `token_ids`, `logprobs` and `loss_mask` align; `turns` partition them."""

    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    status: TrajectoryStatus = "done"
    message: str = ""
    final_text: str = ""
    """The model's last turn as text (its final answer; what a scorer reads)."""
    tool_calls: int = 0
    tool_errors: int = 0
    prompt_tokens: int = 0
    """Prompt tokens given to the engine over all model turns."""
    cached_prompt_tokens: int = 0
    """Of those, the ones found in the engine's prefix cache."""
    first_token_s: float = 0.0

    @property
    def model_turns(self) -> int:
        return sum(t.role == "model" for t in self.turns)

    def end(self, status: TrajectoryStatus, message: str = "") -> Trajectory:
        self.status, self.message = status, message
        return self

    def add_model_turn(self, sample: EngineSample) -> None:
        self.turns.append(Turn(len(self.token_ids), "model"))
        self.token_ids += sample.token_ids
        self.logprobs += sample.logprobs
        self.loss_mask += [1] * len(sample.token_ids)
        self.prompt_tokens += len(sample.prompt_token_ids)
        self.cached_prompt_tokens += sample.cached_tokens

    def add_environment_turn(self, ids: Sequence[int], role: TurnRole) -> None:
        self.turns.append(Turn(len(self.token_ids), role))
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)

    def reward_last_model_turn(self, reward: float) -> None:
        """Credits a step's reward to the model turn that took the step (rewards of one turn add up)."""
        i = max(i for i, t in enumerate(self.turns) if t.role == "model")
        previous = self.turns[i].reward or 0.0
        self.turns[i] = replace(self.turns[i], reward=previous + reward)


ENV_STATUS_TO_TRAJECTORY: dict[EnvStatus, TrajectoryStatus] = {
    "env_error": "env_error",
    "timeout": "env_timeout",
}


class TrajectoryDriver:
    """Plays tasks against `env` with one engine (`generate_turn`) and one tokenizer's chat template."""

    def __init__(
        self,
        generate_turn: TurnGenerator,
        env: EnvironmentSessions,
        tokenizer: Any,
        limits: TrajectoryLimits,
    ) -> None:
        self.generate_turn, self.env, self.tokenizer, self.limits = generate_turn, env, tokenizer, limits

    async def play(
        self,
        request_id: str,
        task: dict[str, Any],
        sampling: SamplingSettings,
        template_kwargs: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> Trajectory:
        """One trajectory of `task` (module docstring); the session is closed whatever happens."""
        reset = await self.env.reset(task, seed=seed)
        if reset.status != "ok":
            status = ENV_STATUS_TO_TRAJECTORY.get(reset.status, "env_error")
            return Trajectory().end(status, f"reset: {reset.message}")
        try:
            tools = [t.as_openai() for t in reset.observation.tools]
            renderer = IncrementalRenderer(self.tokenizer, tools, template_kwargs=template_kwargs)
            session = _Session(self, Trajectory(messages=list(reset.observation.messages)), renderer)
            return await session.play(request_id, reset.session_id, sampling, seed)
        finally:
            with contextlib.suppress(Exception):  # an expired or already closed session is gone anyway
                await self.env.close(reset.session_id)


@dataclass
class _Session:
    """One trajectory in progress: its steps."""

    driver: TrajectoryDriver
    t: Trajectory
    renderer: IncrementalRenderer
    request_id: str = ""
    session_id: str = ""

    async def play(
        self, request_id: str, session_id: str, sampling: SamplingSettings, seed: int | None
    ) -> Trajectory:
        """Steps 1-4 of the module docstring, on an open session."""
        t, self.request_id, self.session_id = self.t, request_id, session_id
        try:
            t.prompt_ids = self.renderer.append_turn([], [], t.messages)
        except TemplateMismatch as exc:
            return t.end("template_mismatch", str(exc))
        for turn in range(self.driver.limits.max_turns):
            ended = await self.model_turn(turn, sampling, seed)
            if ended is None:
                ended = await self.environment_turn(turn)
            if ended is not None:
                return ended
        return t.end("truncated", f"max_turns {self.driver.limits.max_turns} reached")

    def budget(self, sampling: SamplingSettings) -> int:
        """Tokens the next model turn may sample: the turn's, the trajectory's and the context's limits."""
        limits, used = self.driver.limits, len(self.t.token_ids)
        context_left = limits.max_model_len - len(self.t.prompt_ids) - used
        return min(sampling.max_tokens, limits.max_total_tokens - used, context_left)

    async def model_turn(self, turn: int, sampling: SamplingSettings, seed: int | None) -> Trajectory | None:
        """Generates turn `turn`; the ended trajectory when it cannot go on, else None."""
        t, budget = self.t, self.budget(sampling)
        if budget < 1:
            return t.end("truncated", "the trajectory's token budget is spent")
        turn_seed = None if seed is None else seed + turn * TURN_SEED_STRIDE
        turn_sampling = replace(sampling, n=1, max_tokens=budget, seed=turn_seed)
        sample = await self.driver.generate_turn(
            f"{self.request_id}/t{turn}", t.prompt_ids + t.token_ids, turn_sampling
        )
        if turn == 0:
            t.first_token_s = sample.first_token_s
        t.add_model_turn(sample)
        ends_on_token = sample.finish_reason == "stop" and bool(sample.token_ids)
        text = self.renderer.decode(sample.token_ids[:-1] if ends_on_token else sample.token_ids)
        t.final_text = text
        t.messages.append({"role": "assistant", "content": text})
        if sample.finish_reason == "abort":
            return t.end("aborted", "the model turn was aborted")
        if sample.finish_reason == "length":
            return t.end("truncated", f"turn {turn} was cut at {budget} tokens")
        return None

    async def environment_turn(self, turn: int) -> Trajectory | None:
        """Sends the last model turn to the environment and appends its reply; None to go on."""
        t = self.t
        outcome = await self.driver.env.step(self.session_id, t.final_text)
        result = outcome.result
        if outcome.status in ENV_STATUS_TO_TRAJECTORY:
            return t.end(ENV_STATUS_TO_TRAJECTORY[outcome.status], f"step {turn}: {outcome.message}")
        t.tool_calls += len(result.tool_calls)
        t.tool_errors += sum(not call.ok for call in result.tool_calls)
        if result.reward is not None:
            t.reward_last_model_turn(result.reward)
        if result.done:
            return t.end("truncated", "the environment's step limit") if outcome.status == "truncated" else t
        return self.append_reply(result.messages, turn)

    def append_reply(self, reply: list[Message], turn: int) -> Trajectory | None:
        t = self.t
        if not reply:
            return t.end("env_error", f"step {turn}: the environment answered no message and is not done")
        try:
            ids = self.renderer.append_turn(t.prompt_ids + t.token_ids, t.messages, reply)
        except TemplateMismatch as exc:
            return t.end("template_mismatch", f"step {turn}: {exc}")
        role: TurnRole = "tool" if all(m["role"] == "tool" for m in reply) else "environment"
        t.add_environment_turn(ids, role)
        t.messages += reply
        return None
