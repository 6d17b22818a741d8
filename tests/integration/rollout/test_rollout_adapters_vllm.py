"""LoRA adapters on a real vLLM replica (CPU), as a real `rlfabric serve rollout` process over real gRPC.

One replica with `engine.max_adapters=3`, bound to run `RUN`, whose weights root holds an adapter
version before the replica starts: the replica loads it as the adapter named `RUN` at start, and follows
the learner's next announced adapter version. Adapters are random, non-zero PEFT LoRA adapters of the tiny
model (`init_lora_weights=False`), published with `rlfabric.weights.adapters.publish_adapter` under one
weights root per adapter name. The replica's sample logprobs on an adapter match transformers + PEFT on
the same tokens, before and after the adapter's update, and differ from the base's; base requests keep
matching the plain model; slots, unloading, errors and authorization follow the contract; an adapter
also arrives by broadcast. The time to
load an adapter version and a full-weight version of the same model is printed (not asserted).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file

from rlfabric.contracts import keys
from rlfabric.local.procs import ServiceProcess
from rlfabric.tools.tiny_model import make_tiny_model
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from rlfabric.weights import versions as store
from rlfabric.weights.adapters import publish_adapter

pytestmark = pytest.mark.vllm
TOKEN = "learner-secret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
CLIENT_TOKEN = "client-secret"
CLIENT_AUTH = (("authorization", f"Bearer {CLIENT_TOKEN}"),)
RUN = "run-lora"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """`<roots>/RUN` is the run's weights root (the replica's), holding adapter version 1 before the
    replica starts; `<roots>/base` full-weight versions; `<roots>/<name>` each other adapter's."""
    roots = tmp_path_factory.mktemp("weights")
    publish(roots / RUN, 1, peft_model(tiny_model_dir, seed=7))
    return roots


@pytest.fixture(scope="module")
def replica(
    tiny_model_dir: Path,
    roots: Path,
    vllm_env: dict[str, str],
    redis_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    proc = ServiceProcess(
        "rollout",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "rollout",
            "--model", str(tiny_model_dir), "--port", "0",
            "--set", "engine.enforce_eager=true", "--set", "engine.kv_cache_bytes=268435456",
            "--set", "engine.max_model_len=256", "--set", "engine.dtype=float32",
            "--set", "engine.max_adapters=3", "--set", "engine.max_adapter_rank=8",
            "--set", f"weights_root={roots / RUN}", "--set", f"run_id={RUN}",
            "--set", f"redis.url={redis_server}", "--set", "log.format=text", "--set", "max_tokens=64",
        ],
        log_path=tmp_path_factory.mktemp("rollout-logs") / "rollout.log",
        env={
            **vllm_env,
            "RLFABRIC_ROLLOUT__LEARNER_TOKEN": TOKEN,
            "RLFABRIC_ROLLOUT__CLIENT_TOKEN": CLIENT_TOKEN,
        },
    )  # fmt: skip
    address = proc.start(r"listening on (\S+)", timeout_s=300).group(1)
    proc.wait_for(rf"serving version 0 with adapter {RUN} version 1", timeout_s=300)
    yield address
    assert proc.stop(grace_s=30) == 0


@pytest.fixture(scope="module")
def stub(replica: str) -> Iterator[rollout_pb2_grpc.RolloutServiceStub]:
    with grpc.insecure_channel(replica) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


def base_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def peft_model(model_dir: Path, seed: int) -> Any:
    """The tiny model with a random, non-zero rank-8 LoRA adapter on every projection."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(base_model(model_dir), config).eval()


def publish(root: Path, version: int, model: Any) -> None:
    from peft import get_peft_model_state_dict

    config = {
        k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config["default"].to_dict().items()
    }
    publish_adapter(root, version, get_peft_model_state_dict(model), config)


def load_adapter(stub: rollout_pb2_grpc.RolloutServiceStub, name: str, version: int, root: Path) -> Any:
    request = rollout_pb2.UpdateWeightsRequest(
        version=version, adapter=name, object_store=rollout_pb2.ObjectStoreSource(root_url=str(root))
    )
    return stub.UpdateWeights(request, metadata=AUTH, timeout=120)


def generate(
    stub: rollout_pb2_grpc.RolloutServiceStub, adapter: str = "", min_version: int = 0
) -> list[rollout_pb2.GeneratedSample]:
    request = rollout_pb2.GenerateRequest(
        request_id=f"r-{time.monotonic_ns()}",
        prompts=[rollout_pb2.GeneratePrompt(prompt_id="p", prompt=common_pb2.Prompt(text="hello world"))],
        sampling=rollout_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5),
        adapter=adapter,
        min_policy_version=min_version,
    )
    return list(stub.Generate(request, timeout=120, metadata=CLIENT_AUTH))


def reference(model: Any, sample: rollout_pb2.GeneratedSample) -> torch.Tensor:
    """log p(token_ids[i] | prompt + token_ids[:i]) under `model`, one forward pass."""
    prompt, out = list(sample.prompt_token_ids), list(sample.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


def assert_matches(model: Any, samples: list[rollout_pb2.GeneratedSample], *, other: Any = None) -> None:
    """The samples' logprobs are `model`'s (and, given `other`, not `other`'s)."""
    assert samples
    for s in samples:
        got = torch.tensor(list(s.logprobs))
        assert torch.allclose(got, reference(model, s), atol=1e-4), (got, reference(model, s))
        if other is not None:
            assert not torch.allclose(got, reference(other, s), atol=1e-2)


def code_of(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()  # type: ignore[attr-defined]


def test_the_runs_adapter_is_loaded_at_start_and_followed(
    stub: rollout_pb2_grpc.RolloutServiceStub, tiny_model_dir: Path, roots: Path, redis_server: str
) -> None:
    import redis

    samples = generate(stub, RUN)
    assert {s.policy_version for s in samples} == {1}
    assert_matches(peft_model(tiny_model_dir, seed=7), samples)

    v2 = peft_model(tiny_model_dir, seed=8)
    publish(roots / RUN, 2, v2)
    redis.Redis.from_url(redis_server).set(keys.version(RUN), 2)
    samples = generate(stub, RUN, min_version=2)  # as the coordinator asks: waits for the replica to load it
    assert {s.policy_version for s in samples} == {2}
    assert_matches(v2, samples)


def test_adapter_logprobs_match_peft_before_and_after_an_update(
    stub: rollout_pb2_grpc.RolloutServiceStub, tiny_model_dir: Path, roots: Path
) -> None:
    base = base_model(tiny_model_dir)
    v1 = peft_model(tiny_model_dir, seed=1)
    publish(roots / "a", 1, v1)
    assert load_adapter(stub, "a", 1, roots / "a").version == 1
    samples = generate(stub, "a")
    assert {s.policy_version for s in samples} == {1}
    assert_matches(v1, samples, other=base)

    v2 = peft_model(tiny_model_dir, seed=2)
    publish(roots / "a", 2, v2)
    load_adapter(stub, "a", 2, roots / "a")
    samples = generate(stub, "a")
    assert {s.policy_version for s in samples} == {2}
    assert_matches(v2, samples, other=v1)

    samples = generate(stub)  # the base, untouched by the adapter's loads
    assert {s.policy_version for s in samples} == {0}
    assert_matches(base, samples)


def test_slots_are_bounded_and_unloading_frees_one(
    stub: rollout_pb2_grpc.RolloutServiceStub, tiny_model_dir: Path, roots: Path
) -> None:
    publish(roots / "b", 1, peft_model(tiny_model_dir, seed=3))
    load_adapter(stub, "b", 1, roots / "b")
    c = peft_model(tiny_model_dir, seed=4)
    publish(roots / "c", 1, c)
    code, details = code_of(lambda: load_adapter(stub, "c", 1, roots / "c"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_adapters" in details

    info = stub.GetInfo(rollout_pb2.GetInfoRequest(), metadata=CLIENT_AUTH, timeout=30)
    assert info.max_adapters == 3
    held = [(a.name, a.version, a.in_flight) for a in info.adapters]
    assert held == [("a", 2, 0), ("b", 1, 0), (RUN, 2, 0)]

    unloaded = stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(adapter="a"), metadata=AUTH, timeout=60)
    assert (unloaded.version, unloaded.aborted) == (2, 0)
    code, details = code_of(lambda: generate(stub, "a"))
    assert code == grpc.StatusCode.NOT_FOUND and "'a'" in details
    load_adapter(stub, "c", 1, roots / "c")
    assert_matches(c, generate(stub, "c"))


def test_unknown_adapter_and_unauthorised_calls_are_refused(
    stub: rollout_pb2_grpc.RolloutServiceStub, roots: Path
) -> None:
    code, details = code_of(lambda: generate(stub, "nope"))
    assert code == grpc.StatusCode.NOT_FOUND and "adapter" in details and "'nope'" in details
    request = rollout_pb2.UpdateWeightsRequest(
        version=9, adapter="b", object_store=rollout_pb2.ObjectStoreSource(root_url=str(roots / "b"))
    )
    unload = rollout_pb2.UnloadAdapterRequest(adapter="b")
    for metadata in [(), CLIENT_AUTH]:
        code, _ = code_of(lambda m=metadata: stub.UpdateWeights(request, metadata=m, timeout=30))  # type: ignore[misc]
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = code_of(lambda m=metadata: stub.UnloadAdapter(unload, metadata=m, timeout=30))  # type: ignore[misc]
        assert code == grpc.StatusCode.UNAUTHENTICATED
    no_config = rollout_pb2.UpdateWeightsRequest(
        version=9, adapter="b", broadcast=rollout_pb2.BroadcastSource()
    )
    code, details = code_of(lambda: stub.UpdateWeights(no_config, metadata=AUTH, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config_json" in details


def test_full_update_beside_adapters_and_load_times(
    stub: rollout_pb2_grpc.RolloutServiceStub, tiny_model_dir: Path, roots: Path, tmp_path: Path
) -> None:
    """A full-weight update of the base still works with LoRA on (the base's samples match the new
    weights); prints the wall time of an adapter update and a full update of the same model."""
    from peft import get_peft_model_state_dict

    new_dir = make_tiny_model(tmp_path / "v1", seed=11)
    new_base = base_model(new_dir)
    store.publish_version(str(roots / "base"), 1, load_file(str(new_dir / "model.safetensors")))
    started = time.perf_counter()
    source = rollout_pb2.ObjectStoreSource(root_url=str(roots / "base"))
    full = stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(version=1, object_store=source),
        metadata=AUTH,
        timeout=120,
    )
    full_s = time.perf_counter() - started
    assert full.version == 1
    assert_matches(new_base, generate(stub))

    adapter = peft_model(tiny_model_dir, seed=5)
    publish(roots / "b", 2, adapter)
    started = time.perf_counter()
    loaded = load_adapter(stub, "b", 2, roots / "b")
    adapter_s = time.perf_counter() - started
    on_new_base = peft_model(new_dir, seed=0)  # the adapter's weights on the new base
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(on_new_base, get_peft_model_state_dict(adapter))
    assert_matches(on_new_base, generate(stub, "b"))
    print(
        f"\nadapter update (rank 8, {len(get_peft_model_state_dict(adapter))} tensors): {adapter_s:.3f} s "
        f"(verify+materialize {loaded.transfer_seconds:.3f} s, load {loaded.load_seconds:.3f} s); "
        f"full-weight update of the same model: {full_s:.3f} s "
        f"(verify {full.transfer_seconds:.3f} s, load {full.load_seconds:.3f} s)"
    )


def test_refused_adapter_versions_leave_the_old_one_serving(
    stub: rollout_pb2_grpc.RolloutServiceStub, tiny_model_dir: Path, roots: Path
) -> None:
    """A rank above `engine.max_adapter_rank` and a full-weights version are refused (FAILED_PRECONDITION);
    adapter c keeps serving its version 1."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(6)
    config = LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    publish(roots / "c", 2, get_peft_model(base_model(tiny_model_dir), config))
    code, details = code_of(lambda: load_adapter(stub, "c", 2, roots / "c"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "max_adapter_rank" in details
    store.publish_version(str(roots / "c"), 3, load_file(str(tiny_model_dir / "model.safetensors")))
    code, details = code_of(lambda: load_adapter(stub, "c", 3, roots / "c"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not a LoRA adapter" in details
    assert {s.policy_version for s in generate(stub, "c")} == {1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def broadcast_adapter(
    stub: rollout_pb2_grpc.RolloutServiceStub, name: str, version: int, tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """UpdateWeights of adapter `name` by a gloo broadcast from this process (rank 0); returns the reply
    (or the RpcError) and what the sender returned or raised."""
    from rlfabric.contracts import wire
    from rlfabric.weights import broadcast

    port = free_port()
    source = rollout_pb2.BroadcastSource(
        master_address="127.0.0.1", master_port=port, rank=1, world_size=2, backend="gloo",
        tensors=wire.metas_to_proto(broadcast.metas_from_state_dict(tensors)), bucket_bytes=1 << 20,
        adapter_config_json=json.dumps(config),
    )  # fmt: skip
    sent: dict[str, Any] = {}

    def send() -> None:
        try:
            sent["stats"] = broadcast.send_state_dict(
                tensors, host="127.0.0.1", port=port, world_size=2, bucket_bytes=1 << 20, timeout_s=60
            )
        except Exception as exc:  # the test reads it
            sent["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    request = rollout_pb2.UpdateWeightsRequest(version=version, adapter=name, broadcast=source)
    try:
        reply: Any = stub.UpdateWeights(request, metadata=AUTH, timeout=120)
    except grpc.RpcError as exc:
        reply = exc
    sender.join(120)
    return reply, sent


def test_an_adapter_by_broadcast(
    stub: rollout_pb2_grpc.RolloutServiceStub, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Adapter b's version 3 arrives by broadcast and serves (on the base loaded by the full update
    above); tensors that are not LoRA tensors are refused at the handshake, the sender told why."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    adapter = peft_model(tiny_model_dir, seed=9)
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(adapter).items()}
    config = adapter.peft_config["default"].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    reply, sent = broadcast_adapter(stub, "b", 3, tensors, config)
    assert not isinstance(reply, grpc.RpcError), reply
    assert reply.version == 3 and "stats" in sent
    on_base = peft_model(make_tiny_model(tmp_path / "v1", seed=11), seed=0)  # the base serving now
    set_peft_model_state_dict(on_base, tensors)
    samples = generate(stub, "b")
    assert {s.policy_version for s in samples} == {3}
    assert_matches(on_base, samples)

    reply, sent = broadcast_adapter(stub, "b", 4, {"model.norm.weight": torch.ones(128)}, config)
    assert isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not LoRA adapter tensors" in reply.details() and "error" in sent
    assert {s.policy_version for s in generate(stub, "b")} == {3}
