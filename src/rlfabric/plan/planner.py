"""The plan of a run: what each role holds on each device of its declared placement, whether it fits, what
to change when it does not, and the tokens/s each role can be expected to make.

    1. models      the policy's config.json (a folder, or a hub id found in the local Hugging Face cache:
                   nothing is downloaded), and the reference's, the critic's and a reward model's when the
                   run uses them
    2. devices     per device, the roles on it (`rlfabric.plan.memory`'s formulas): colocated, every role
                   on the learner's devices; disaggregated, each role on its own. Identical devices are
                   listed once with their count
    3. verdict     fits when every device's total is within its memory; headroom or shortfall per device
    4. suggestions when it does not fit: each change alone, re-planned, so the user sees what it buys
    5. throughput  completion tokens/s per role, from measured costs (bench/results) where the model is
                   the measured one, else FLOP- and bandwidth-based with a stated utilisation; and the
                   rollout : learner device ratio that balances them (`rlfabric.plan.throughput`)

torch-free: the plan of a 72B run answers in well under a second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfabric.plan import memory
from rlfabric.plan.arch import ModelArch
from rlfabric.plan.memory import RoleMemory
from rlfabric.plan.resources import DeviceGroup, DeviceKind, ResourcesSpec, format_bytes
from rlfabric.plan.throughput import BENCH_RESULTS, Throughput, Workload, estimate
from rlfabric.runspec import RunSpec

REWARD_MODEL_SCORER = "reward_model"
"""The scorer that loads reward models (`rlfabric.reward.scorers.reward_model`)."""
REFERENCE_PREFERENCE_LOSSES = ("dpo", "ipo", "kto")
"""Offline preference losses that load the frozen reference."""
WEIGHTS_LINE, KV_LINE = "weights", "kv cache"
"""Names of a rollout replica's lines (`memory.rollout_memory`) the throughput estimate reads."""


class PlanError(ValueError):
    """The plan cannot be made (a model config not found or not modelled); one line for the user."""


@dataclass(frozen=True)
class Models:
    """The architectures a run loads: the policy, and the others when the run uses them."""

    policy: ModelArch
    policy_source: str
    """Where the policy's config.json was read."""
    reference: ModelArch | None = None
    critic: ModelArch | None = None
    reward: tuple[tuple[str, ModelArch], ...] = ()
    """(path, arch) of each reward model the run's scorers load."""
    reward_batch: int = 8
    reward_seq_len: int = 2048


@dataclass(frozen=True)
class DeviceLoad:
    """`count` identical devices and what each holds at its peak."""

    name: str
    """e.g. "learner 0-3", "rollout 0-1", "colocated 0"."""
    kind: str
    count: int
    capacity: int
    """Memory of each device in bytes."""
    roles: tuple[RoleMemory, ...]

    @property
    def total(self) -> int:
        """Predicted peak of each device: the sum of its roles."""
        return sum(role.total for role in self.roles)

    @property
    def headroom(self) -> int:
        """capacity - total: negative is the shortfall."""
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0


@dataclass(frozen=True)
class Suggestion:
    """One change and the plan's worst device with it."""

    change: str
    worst_total: int
    worst_capacity: int
    fits: bool


@dataclass(frozen=True)
class Plan:
    """Everything `rlfabric plan` prints (`rlfabric.plan.report`)."""

    run: str
    model: str
    params: int
    placement: str
    prompt_tokens: int
    seq_len: int
    devices: tuple[DeviceLoad, ...]
    suggestions: tuple[Suggestion, ...] = ()
    throughput: tuple[Throughput, ...] = ()
    balance: float | None = None
    """Rollout devices per learner device that make rollout supply what the learner consumes."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fits(self) -> bool:
        return all(device.fits for device in self.devices)

    @property
    def worst(self) -> DeviceLoad:
        """The device with the least headroom relative to its memory."""
        return min(self.devices, key=lambda d: d.headroom / d.capacity)


# -- 1. models ------------------------------------------------------------------------------------------


def config_source(path: str, base_dir: Path | None = None) -> Path:
    """The folder or file holding `path`'s config.json: a local path (as given, else relative to
    `base_dir`, the run file's folder), or a hub id's snapshot in the local Hugging Face cache."""
    for candidate in (Path(path), (base_dir / path) if base_dir else None):
        if candidate is not None and candidate.exists():
            return candidate
    from rlfabric.runtime.paths import is_hub_id

    if not is_hub_id(path):
        raise PlanError(f"{path}: no such model folder")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json")
    if not isinstance(cached, str):
        raise PlanError(
            f"{path}: not in the local Hugging Face cache (nothing is downloaded); give a folder holding its "
            "config.json, e.g. one of examples/models/"
        )
    return Path(cached)


def load_arch(path: str, base_dir: Path | None = None) -> ModelArch:
    """The architecture of the model at `path` (`config_source`); PlanError in one line."""
    source = config_source(path, base_dir)
    try:
        return ModelArch.from_config(source)
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path}: {exc}") from exc


def reward_model_paths(spec: RunSpec) -> list[tuple[dict[str, Any], str]]:
    """(params, path) of every reward model the run's scorer loads (a composite's parts included)."""
    parts = [(spec.reward.scorer, spec.reward.params)]
    parts += [(part.scorer, part.params) for part in spec.reward.parts]
    found = []
    for scorer, params in parts:
        if scorer != REWARD_MODEL_SCORER:
            continue
        paths = params.get("paths") or ([params["path"]] if params.get("path") else [])
        found += [(params, str(path)) for path in paths]
    return found


def uses_reference(spec: RunSpec) -> bool:
    """The learner loads the frozen reference: KL > 0 online, or a preference loss that needs it."""
    if spec.mode == "offline_preference":
        return spec.preference.loss in REFERENCE_PREFERENCE_LOSSES
    return spec.mode == "online" and spec.algorithm.kl.coef > 0


def load_models(spec: RunSpec, base_dir: Path | None = None) -> Models:
    """Step 1 of the module docstring."""
    path = spec.model.path
    policy = load_arch(path, base_dir)
    reference = load_arch(spec.model.reference_path, base_dir) if spec.model.reference_path else None
    critic = load_arch(spec.model.critic_path, base_dir) if spec.model.critic_path else None
    rewards = reward_model_paths(spec) if spec.mode == "online" else []
    first = rewards[0][0] if rewards else {}
    return Models(
        policy=policy,
        policy_source=str(config_source(path, base_dir)),
        reference=reference if uses_reference(spec) else None,
        critic=critic,
        reward=tuple((p, load_arch(p, base_dir)) for _, p in rewards),
        reward_batch=int(first.get("batch_size", 8)),
        reward_seq_len=int(first.get("max_length", 2048)),
    )


# -- 2. devices -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """What one plan is made of; suggestions re-plan with one of them changed."""

    spec: RunSpec
    resources: ResourcesSpec
    models: Models
    prompt_tokens: int


def concurrency(inputs: Inputs) -> int:
    """Sequences per rollout replica: the declared figure, else max in-flight groups x samples."""
    declared = inputs.resources.rollout_group().concurrency
    rollout = inputs.spec.rollout
    return declared or rollout.max_in_flight_per_replica * rollout.sampling.n


def learner_roles(inputs: Inputs, kind: DeviceKind) -> list[RoleMemory]:
    """One learner rank's roles."""
    spec, models = inputs.spec, inputs.models
    world = inputs.resources.learner.devices
    shape = memory.learner_shape(spec, world, prompt_tokens=inputs.prompt_tokens, device=kind)
    if uses_reference(spec) != shape.reference:  # offline preference losses load one too
        shape = dataclasses.replace(shape, reference=uses_reference(spec))
    return memory.learner_memory(
        shape,
        models.policy,
        critic=models.critic,
        reference=models.reference,
        device=kind,
    )


def rollout_role(inputs: Inputs, kind: DeviceKind) -> RoleMemory:
    """One rollout replica."""
    return memory.rollout_memory(
        inputs.spec,
        inputs.models.policy,
        concurrency=concurrency(inputs),
        device=kind,
        prompt_tokens=inputs.prompt_tokens,
    )


def reward_roles(inputs: Inputs, kind: DeviceKind) -> list[RoleMemory]:
    """Every reward model, on one device."""
    m = inputs.models
    return [
        memory.reward_model_memory(arch, batch=m.reward_batch, seq_len=m.reward_seq_len, device=kind)
        for _, arch in m.reward
    ]


def per_device(inputs: Inputs) -> Iterator[tuple[str, int, DeviceGroup, tuple[RoleMemory, ...]]]:
    """(group, index, device, roles) of every device of the placement."""
    res = inputs.resources
    learner, rollout = res.learner, res.rollout_group()
    ranks = tuple(learner_roles(inputs, learner.kind))
    own = res.reward if res.placement == "disaggregated" else None
    on_learner = own is None
    rewards = tuple(reward_roles(inputs, learner.kind if own is None else own.kind))
    colocated, online = res.placement == "colocated", inputs.spec.mode == "online"
    replica = (rollout_role(inputs, learner.kind),) if colocated and online else ()
    for i in range(learner.devices):
        extra = (replica if i < rollout.devices else ()) + (rewards if on_learner and i == 0 else ())
        yield ("colocated" if colocated else "learner"), i, learner, ranks + extra
    if colocated or not online:
        return
    for i in range(rollout.devices):
        yield "rollout", i, rollout, (rollout_role(inputs, rollout.kind),)
    if own is not None and rewards:
        for i in range(own.devices):
            yield "reward", i, own, rewards


def device_loads(inputs: Inputs) -> tuple[DeviceLoad, ...]:
    """Step 2: consecutive devices of a group holding the same roles, listed once with their count."""
    loads: list[DeviceLoad] = []
    runs: list[tuple[str, int, int, DeviceGroup, tuple[RoleMemory, ...]]] = []
    for group, i, device, roles in per_device(inputs):
        if runs and runs[-1][0] == group and runs[-1][4] == roles:
            name, first, _, _, _ = runs[-1]
            runs[-1] = (name, first, i, device, roles)
        else:
            runs.append((group, i, i, device, roles))
    for group, first, last, device, roles in runs:
        label = f"{group} {first}" if first == last else f"{group} {first}-{last}"
        loads.append(DeviceLoad(label, device.kind, last - first + 1, device.memory, roles))
    return tuple(loads)


# -- 4. suggestions -------------------------------------------------------------------------------------


def _with_train(inputs: Inputs, **update: Any) -> Inputs:
    spec = inputs.spec
    return Inputs(spec.model_copy(update={"train": spec.train.model_copy(update=update)}), *_rest(inputs))


def _rest(inputs: Inputs) -> tuple[ResourcesSpec, Models, int]:
    return inputs.resources, inputs.models, inputs.prompt_tokens


def _with_resources(inputs: Inputs, resources: ResourcesSpec) -> Inputs:
    return Inputs(inputs.spec, resources, inputs.models, inputs.prompt_tokens)


def _checkpointing(inputs: Inputs) -> tuple[str, Inputs] | None:
    if inputs.spec.train.activation_checkpointing:
        return None
    return "train.activation_checkpointing = true", _with_train(inputs, activation_checkpointing=True)


def _half_micro_batch(inputs: Inputs) -> tuple[str, Inputs] | None:
    mb = inputs.spec.train.micro_batch_size
    if mb < 2:
        return None
    return f"train.micro_batch_size = {mb // 2} (from {mb})", _with_train(inputs, micro_batch_size=mb // 2)


MAX_DOUBLINGS = 6
"""More learner shards: the device count is doubled up to this many times (64 x) until the plan fits."""


def _more_shards(inputs: Inputs) -> tuple[str, Inputs] | None:
    learner = inputs.resources.learner
    for doubling in range(1, MAX_DOUBLINGS + 1):
        more = learner.model_copy(update={"devices": learner.devices << doubling})
        changed = _with_resources(inputs, inputs.resources.model_copy(update={"learner": more}))
        if all(d.fits for d in device_loads(changed) if group_of(d) in LEARNER_GROUPS):
            break
    return f"resources.learner.devices = {more.devices} (from {learner.devices}: more FSDP shards)", changed


def _own_devices(inputs: Inputs) -> tuple[str, Inputs] | None:
    """Disaggregate a colocated placement; else give a reward model that shares the learner's device one
    of its own."""
    res = inputs.resources
    if res.placement == "colocated":
        moved = res.model_copy(update={"placement": "disaggregated"})
        return 'resources.placement = "disaggregated" (rollout and reward on devices of their own)', (
            _with_resources(inputs, moved)
        )
    if res.reward is None and inputs.models.reward:
        reward = DeviceGroup(kind=res.learner.kind, devices=1, memory=res.learner.memory)
        return "[resources.reward] devices = 1 (the reward model off the learner's device)", _with_resources(
            inputs, res.model_copy(update={"reward": reward})
        )
    return None


def _half_concurrency(inputs: Inputs) -> tuple[str, Inputs] | None:
    now = concurrency(inputs)
    if now < 2:
        return None
    rollout = inputs.resources.rollout_group().model_copy(update={"concurrency": now // 2})
    resources = inputs.resources.model_copy(update={"rollout": rollout})
    return f"resources.rollout.concurrency = {now // 2} (from {now})", _with_resources(inputs, resources)


def _half_model_len(inputs: Inputs) -> tuple[str, Inputs] | None:
    spec = inputs.spec
    half = spec.model.max_model_len // 2
    if half < max(16, spec.rollout.sampling.max_tokens + 1):
        return None
    model = spec.model.model_copy(update={"max_model_len": half})
    changed = Inputs(spec.model_copy(update={"model": model}), *_rest(inputs))
    return f"model.max_model_len = {half} (from {spec.model.max_model_len})", changed


LEARNER_GROUPS = frozenset({"learner", "colocated"})
"""Device groups holding learner ranks."""
ROLLOUT_GROUPS = frozenset({"rollout", "colocated"})
"""Device groups holding rollout replicas."""
SUGGESTIONS: tuple[tuple[frozenset[str], Callable[[Inputs], tuple[str, Inputs] | None]], ...] = (
    (LEARNER_GROUPS, _checkpointing),
    (LEARNER_GROUPS, _half_micro_batch),
    (LEARNER_GROUPS, _more_shards),
    (LEARNER_GROUPS, _own_devices),
    (ROLLOUT_GROUPS, _half_concurrency),
    (LEARNER_GROUPS | ROLLOUT_GROUPS, _half_model_len),
)
"""The changes tried when a plan does not fit, in the order they are suggested, each with the device
groups it relieves: it is tried only when a device of one of them is short."""


def group_of(device: DeviceLoad) -> str:
    """The device's group: "learner", "rollout", "reward" or "colocated"."""
    return device.name.split()[0]


def makers(inputs: Inputs) -> list[Callable[[Inputs], tuple[str, Inputs] | None]]:
    """The changes that relieve a device that is short."""
    short = {group_of(d) for d in device_loads(inputs) if not d.fits}
    return [make for groups, make in SUGGESTIONS if groups & short]


def _suggestion(text: str, changed: Inputs) -> Suggestion:
    devices = device_loads(changed)
    worst = min(devices, key=lambda d: d.headroom / d.capacity)
    return Suggestion(text, worst.total, worst.capacity, all(d.fits for d in devices))


def suggestions(inputs: Inputs) -> tuple[Suggestion, ...]:
    """Step 4: each applicable change alone, re-planned; then, when none fits alone, the changes together
    in order up to the first combination that fits."""
    found, tried = [], makers(inputs)
    for make in tried:
        change = make(inputs)
        if change is not None:
            found.append(_suggestion(*change))
    if any(s.fits for s in found):
        return tuple(found)
    texts, combined = [], inputs
    for make in tried:
        change = make(combined)
        if change is None:
            continue
        texts.append(change[0])
        combined = change[1]
        together = _suggestion("together: " + "; ".join(texts), combined)
        if together.fits:
            break
    return (*found, together) if len(texts) > 1 else tuple(found)


# -- 5. throughput --------------------------------------------------------------------------------------


def learner_flops_per_token(inputs: Inputs) -> float:
    """Training FLOPs per sequence token: 6 P for the policy (8 P recomputing activations), 2 P for the
    trainer's old log-probs, 2 P for the reference's forward, 6 P (8 P) for a critic."""
    spec, m = inputs.spec, inputs.models
    p = m.policy.params()
    train = 8 if spec.train.activation_checkpointing else 6
    flops = train * p + 2 * p * (spec.algorithm.old_policy == "trainer")
    if uses_reference(spec):
        flops += 2 * (m.reference or m.policy).params()
    if spec.algorithm.advantage == "gae":
        flops += train * (m.critic or m.policy).params()
    return float(flops)


def throughput(inputs: Inputs, results: Path = BENCH_RESULTS) -> tuple[tuple[Throughput, ...], float | None]:
    """Step 5 (`rlfabric.plan.throughput`)."""
    learner, rollout = inputs.resources.learner, inputs.resources.rollout_group()
    replica = {line.name: line.bytes for line in rollout_role(inputs, rollout.kind).lines}
    work = Workload(
        policy=inputs.models.policy,
        learner_flops_per_token=learner_flops_per_token(inputs),
        prompt_tokens=inputs.prompt_tokens,
        completion_tokens=inputs.spec.rollout.sampling.max_tokens,
        concurrency=concurrency(inputs),
        replica_weights=replica[WEIGHTS_LINE],
        replica_kv=replica[KV_LINE],
    )
    return estimate(work, (learner.kind, learner.devices), (rollout.kind, rollout.devices), results)


# -- all together ---------------------------------------------------------------------------------------


def make_plan(
    spec: RunSpec,
    resources: ResourcesSpec | None = None,
    *,
    base_dir: Path | None = None,
    prompt_tokens: int = memory.DEFAULT_PROMPT_TOKENS,
    models: Models | None = None,
) -> Plan:
    """The plan of `spec` on `resources` (default: the spec's own); PlanError when it cannot be made."""
    resources = resources or spec.resources
    if resources is None:
        raise PlanError("the run declares no [resources] and no --devices was given")
    models = models or load_models(spec, base_dir)
    inputs = Inputs(spec, resources, models, prompt_tokens)
    devices = device_loads(inputs)
    fits = all(d.fits for d in devices)
    rates, balance = throughput(inputs)
    return Plan(
        run=spec.name or "(unnamed)",
        model=models.policy_source,
        params=models.policy.params(),
        placement=resources.placement,
        prompt_tokens=prompt_tokens,
        seq_len=memory.sequence_length(spec, prompt_tokens),
        devices=devices,
        suggestions=() if fits else suggestions(inputs),
        throughput=rates,
        balance=balance,
        notes=notes(inputs),
    )


def weights_alone_short(inputs: Inputs) -> str | None:
    """A note when a rollout replica's weights alone exceed its device (no change here helps)."""
    rollout = inputs.resources.rollout_group()
    replica = {line.name: line.bytes for line in rollout_role(inputs, rollout.kind).lines}
    if replica[WEIGHTS_LINE] <= rollout.memory:
        return None
    return (
        f"a rollout replica's weights alone ({format_bytes(replica[WEIGHTS_LINE])}) exceed its device's "
        f"{format_bytes(rollout.memory)}: replicas are planned on one device each (no tensor parallelism)"
    )


def notes(inputs: Inputs) -> tuple[str, ...]:
    """What the plan assumes that the user may want to know."""
    said = [
        f"prompts assumed {inputs.prompt_tokens} tokens (--prompt-tokens); sequences of prompt + "
        f"{inputs.spec.rollout.sampling.max_tokens} completion tokens, at most model.max_model_len"
    ]
    if inputs.resources.rollout is None:
        said.append(
            "no [resources.rollout]: "
            + (
                "one replica per learner device"
                if inputs.resources.placement == "colocated"
                else "one replica on a device like the learner's"
            )
        )
    too_big = weights_alone_short(inputs) if inputs.spec.mode == "online" else None
    return (*said, too_big) if too_big else tuple(said)


def verdict(plan: Plan) -> str:
    """One line: fits or not, and by how much on the tightest device."""
    worst = plan.worst
    pct = 100 * worst.headroom / worst.capacity
    if plan.fits:
        room = format_bytes(worst.headroom)
        return f"fits: {room} ({pct:.0f} %) headroom on the tightest device ({worst.name})"
    return (
        f"does not fit: {worst.name} needs {format_bytes(worst.total)} of {format_bytes(worst.capacity)}, "
        f"{format_bytes(-worst.headroom)} ({-pct:.0f} %) short"
    )
