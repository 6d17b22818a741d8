"""The three multi-turn loops `bench/multiturn.py` compares, on one replica and one environment.

- `play_rlfabric`: `Replica.play` with a `TrajectoryDriver` on `Replica.engine_turn` (the replica's
  multi-turn path without the gRPC hops): every trajectory on its own;
- `play_lockstep`: the same driver, each turn held by `Lockstep` until every trajectory asked for it;
- `play_naive`: per turn, every running conversation re-rendered with the chat template and tokenized,
  all turns generated at once and awaited, every environment stepped.

Each returns one `Played` per trajectory: the figures the benchmark sums.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Load:
    """One run: `tasks` x `n` trajectories of `turns` model turns, turns of ~`turn_length` tokens (at
    most `max_tokens`); the engine's model preset and settings."""

    preset: str
    tasks: int
    n: int
    turns: int
    turn_length: int
    max_tokens: int
    kv_cache_bytes: int
    max_model_len: int
    eager: bool


# --- one trajectory, as each loop counts it --------------------------------------------------------------


@dataclass
class Played:
    """One trajectory's figures: model tokens and turns, prompt tokens given to the engine over its
    model turns and the prefix-cached ones, re-tokenization drift (naive loop only), reward, status."""

    status: str
    model_tokens: int
    model_turns: int
    prompt_tokens: int
    cached_tokens: int
    reward: float | None
    drifted_turns: int = 0


def played_from_trajectory(t: Any) -> Played:
    rewards = [turn.reward for turn in t.turns if turn.reward is not None]
    return Played(
        status=t.status,
        model_tokens=sum(t.loss_mask),
        model_turns=t.model_turns,
        prompt_tokens=t.prompt_tokens,
        cached_tokens=t.cached_prompt_tokens,
        reward=sum(rewards) if rewards else None,
    )


@dataclass
class Setup:
    """What every loop shares: the replica (on the one engine), the environment's sessions, the
    tokenizer, the tasks, the load."""

    replica: Any
    sessions: Any
    tokenizer: Any
    tasks: list[dict[str, Any]]
    load: Load

    def sampling(self, seed: int) -> Any:
        from rlfabric.rollout.types import SamplingSettings

        return SamplingSettings(
            n=self.load.n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=self.load.max_tokens, seed=seed
        )

    def driver(self, generate: Callable[..., Awaitable[Any]]) -> Any:
        from rlfabric.rollout.trajectory import TrajectoryDriver, TrajectoryLimits

        context = self.load.max_model_len
        limits = TrajectoryLimits(max_turns=self.load.turns, max_total_tokens=context, max_model_len=context)
        return TrajectoryDriver(generate, self.sessions, self.tokenizer, limits)


# --- the loops -------------------------------------------------------------------------------------------


async def play_rlfabric(setup: Setup, request_id: str, seed: int) -> list[Played]:
    """The replica's multi-turn path: every trajectory on its own (`Replica.play`)."""
    return await play_with_driver(setup, request_id, seed, setup.replica.engine_turn, on_end=None)


async def play_lockstep(setup: Setup, request_id: str, seed: int) -> list[Played]:
    """The driver's token-in trajectories, each turn held until all trajectories finished the last."""
    gate = Lockstep(len(setup.tasks) * setup.load.n)
    return await play_with_driver(setup, request_id, seed, gate.wrap(setup.replica.engine_turn), gate.ended)


async def play_with_driver(
    setup: Setup,
    request_id: str,
    seed: int,
    generate: Callable[..., Awaitable[Any]],
    on_end: Callable[[], None] | None,
) -> list[Played]:
    from rlfabric.rollout.replica import PlayTask

    tasks = [PlayTask(task) for task in setup.tasks]
    played = []
    async for _, _, trajectory, _ in setup.replica.play(
        request_id, tasks, setup.sampling(seed), setup.driver(generate)
    ):
        played.append(played_from_trajectory(trajectory))
        if on_end is not None:
            on_end()
    return played


class Lockstep:
    """A barrier per turn: turn k of any trajectory starts once every trajectory has asked for turn k or
    ended (the driver names turn k's engine request `.../t{k}`)."""

    def __init__(self, trajectories: int) -> None:
        self.trajectories, self.ended_count = trajectories, 0
        self.arrived: Counter[int] = Counter()
        self.open: dict[int, asyncio.Event] = {}

    def wrap(self, generate: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def turn(turn_id: str, prompt: list[int], sampling: Any) -> Any:
            k = int(turn_id.rsplit("/t", 1)[1])
            self.arrived[k] += 1
            self.check(k)
            await self.event(k).wait()
            return await generate(turn_id, prompt, sampling)

        return turn

    def event(self, k: int) -> asyncio.Event:
        return self.open.setdefault(k, asyncio.Event())

    def ended(self) -> None:
        self.ended_count += 1
        for k in list(self.arrived):
            self.check(k)

    def check(self, k: int) -> None:
        if self.arrived[k] + self.ended_count >= self.trajectories:
            self.event(k).set()


@dataclass
class NaiveConversation:
    """One trajectory of the naive loop: its messages, session and figures so far."""

    key: int
    seed: int
    session_id: str
    messages: list[dict[str, str]]
    played: Played = field(default_factory=lambda: Played("", 0, 0, 0, 0, None))
    expected: list[int] = field(default_factory=list)
    """The last prompt + the ids sampled after it: what the next prompt should start with."""

    @property
    def running(self) -> bool:
        return not self.played.status


async def play_naive(setup: Setup, request_id: str, seed: int) -> list[Played]:
    """Per turn: re-render and tokenize every running conversation, generate all their turns at once,
    wait for the last, step every environment (module docstring)."""
    sampling = setup.sampling(seed)
    conversations = await naive_resets(setup, sampling)
    try:
        for turn in range(setup.load.turns):
            running = [c for c in conversations if c.running]
            if not running:
                break
            samples = await asyncio.gather(
                *(naive_model_turn(setup, request_id, c, turn, sampling) for c in running)
            )
            await asyncio.gather(*(naive_step(setup, c, s) for c, s in zip(running, samples, strict=True)))
        for c in conversations:
            if c.running:
                c.played.status = "truncated"  # max_turns reached
    finally:
        await asyncio.gather(*(setup.sessions.close(c.session_id) for c in conversations))
    return [c.played for c in conversations]


async def naive_resets(setup: Setup, sampling: Any) -> list[NaiveConversation]:
    keys = [(p, s) for p in range(len(setup.tasks)) for s in range(setup.load.n)]
    seeds = [sampling.sample_seed(p, s) for p, s in keys]
    resets = await asyncio.gather(
        *(setup.sessions.reset(setup.tasks[p], seed=seed) for (p, _), seed in zip(keys, seeds, strict=True))
    )
    return [
        NaiveConversation(k, seed, r.session_id, list(r.observation.messages))
        for k, (seed, r) in enumerate(zip(seeds, resets, strict=True))
    ]


async def naive_model_turn(
    setup: Setup, request_id: str, c: NaiveConversation, turn: int, sampling: Any
) -> Any:
    """Re-render the whole conversation, tokenize it, generate the turn (the trajectory's turn seed)."""
    from rlfabric.rollout.trajectory import TURN_SEED_STRIDE

    prompt = setup.replica.engine.tokenize_chat(c.messages)
    if c.expected and prompt[: len(c.expected)] != c.expected:
        c.played.drifted_turns += 1
    budget = min(sampling.max_tokens, setup.load.max_model_len - len(prompt))
    turn_sampling = replace(sampling, n=1, max_tokens=budget, seed=c.seed + turn * TURN_SEED_STRIDE)
    sample = await setup.replica.engine_turn(f"{request_id}/{c.key}/t{turn}", prompt, turn_sampling)
    c.expected = prompt + list(sample.token_ids)
    return sample


async def naive_step(setup: Setup, c: NaiveConversation, sample: Any) -> None:
    """Count the turn, append it as text (the end token dropped), step the environment."""
    played = c.played
    played.model_turns += 1
    played.model_tokens += len(sample.token_ids)
    played.prompt_tokens += len(sample.prompt_token_ids)
    played.cached_tokens += sample.cached_tokens
    if sample.finish_reason != "stop":
        played.status = "truncated" if sample.finish_reason == "length" else "aborted"
        return
    text = setup.tokenizer.decode(sample.token_ids[:-1], skip_special_tokens=True)
    c.messages.append({"role": "assistant", "content": text})
    outcome = await setup.sessions.step(c.session_id, text)
    if outcome.status in ("env_error", "timeout"):
        played.status = outcome.status
        return
    if outcome.result.reward is not None:
        played.reward = (played.reward or 0.0) + outcome.result.reward
    if outcome.result.done:
        played.status = "truncated" if outcome.status == "truncated" else "done"
    else:
        c.messages += outcome.result.messages


PLAYERS: dict[str, Callable[[Setup, str, int], Awaitable[list[Played]]]] = {
    "rlfabric": play_rlfabric,
    "lockstep": play_lockstep,
    "naive": play_naive,
}
