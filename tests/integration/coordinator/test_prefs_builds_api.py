"""`POST /v1/prefs/builds` on a real coordinator app over Redis: the example pipeline
(examples/prefs/pipeline.toml) builds in a child process into the coordinator's store and verifies; the
operator's limits refuse, naming the field, every path outside the roots, a credential variable it does not
list, a local generator it did not enable, user code outside its allowed code and a store of the request's
choosing; user code it allows runs, without the coordinator's secrets in its environment."""

from __future__ import annotations

import asyncio
import json
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.prefs.store import read_manifest, verify

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "prefs-builds-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLE: dict[str, Any] = tomllib.loads((ROOT / "examples" / "prefs" / "pipeline.toml").read_text())
REPLICA = {"kind": "rollout", "address": "127.0.0.1:1"}
LEAK_CHECK = '''
import os


def score(completions, **kwargs):
    """The length of each completion; refuses to score when the coordinator's secrets reached it."""
    leaked = [k for k in os.environ if k.startswith("RLFABRIC_COORDINATOR__")]
    if leaked:
        raise RuntimeError(f"the build sees {leaked}")
    return [float(len(c)) for c in completions]
'''


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    names = ("store", "work", "code", "models", "elsewhere")
    made = {name: tmp_path / name for name in names}
    for folder in made.values():
        folder.mkdir()
    (made["code"] / "judge.py").write_text(LEAK_CHECK)
    (made["elsewhere"] / "judge.py").write_text(LEAK_CHECK)
    return made


@pytest.fixture
async def client(
    redis_url: str, folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[httpx.AsyncClient]:
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    monkeypatch.setenv("RLFABRIC_COORDINATOR__API__TOKEN", TOKEN)
    config = CoordinatorServiceConfig.model_validate(
        {
            "api": {"token": TOKEN},
            "redis": {"url": redis_url},
            "data_roots": [str(ROOT / "examples"), str(folders["store"])],
            "model_roots": [str(folders["models"])],
            "prefs": {
                "store": str(folders["store"]),
                "work_dir": str(folders["work"]),
                "allowed_functions": [str(folders["code"])],
                "credential_envs": {"JUDGE_KEY": "https://judge.internal/v1"},
            },
        }
    )
    redis = Redis.from_url(redis_url)
    app = create_app(config, redis)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
        yield c
    await app.state.prefs_builds.close()
    await redis.aclose()


async def submit(client: httpx.AsyncClient, pipeline: dict[str, Any]) -> httpx.Response:
    return await client.post("/v1/prefs/builds", json=pipeline, headers=AUTH)


async def finished(client: httpx.AsyncClient, build_id: str, timeout_s: float = 150.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = (await client.get(f"/v1/prefs/builds/{build_id}", headers=AUTH)).json()
        if record["state"] in ("succeeded", "failed"):
            return record
        await asyncio.sleep(0.5)
    raise AssertionError(f"build {build_id} did not finish in {timeout_s} s")


async def test_the_example_pipeline_builds_into_the_coordinators_store(
    client: httpx.AsyncClient, folders: dict[str, Path]
) -> None:
    response = await submit(client, EXAMPLE)
    assert response.status_code == 202, response.text
    queued = response.json()
    assert queued["state"] in ("queued", "running") and queued["name"] == "arithmetic-pairs"
    assert response.headers["Location"] == f"/v1/prefs/builds/{queued['build_id']}"
    record = await finished(client, queued["build_id"])
    assert record["state"] == "succeeded", record["error"]
    version = Path(record["version_path"])
    assert version.parent == folders["store"] and version.name == record["version_id"]
    assert record["verified"] and verify(version).ok
    summary = record["summary"]
    assert summary["hygiene"]["dropped"] == {
        "contaminated": 2, "exact_duplicate": 2, "identical": 1,
        "near_duplicate_across_prompts": 1, "near_duplicate_within_prompt": 1,
    }  # fmt: skip
    assert set(summary["judging"]["judges"]) == {"correct", "boxed"}
    assert summary["rows"] == read_manifest(version)["rows"] > 0
    listed = (await client.get("/v1/prefs/builds", headers=AUTH)).json()["builds"]
    assert [b["build_id"] for b in listed] == [queued["build_id"]]


async def test_allowed_user_code_judges_without_the_coordinators_secrets(
    client: httpx.AsyncClient, folders: dict[str, Path]
) -> None:
    judge = {"kind": "scorer", "name": "length", "scorer": "python_function"}
    judge["params"] = {"function": f"{folders['code'] / 'judge.py'}:score"}
    pipeline = {"name": "lengths", "source": EXAMPLE["source"], "judges": [judge]}
    response = await submit(client, pipeline)
    assert response.status_code == 202, response.text
    record = await finished(client, response.json()["build_id"])
    assert record["state"] == "succeeded", record["error"]
    stats = record["summary"]["judging"]["judges"]["length"]
    assert stats["errors"] == 0 and stats["votes"] > 0


def refused(response: httpx.Response) -> dict[str, str]:
    """The 422's refused fields (dotted, without "body") and their kinds."""
    assert response.status_code == 422, response.text
    return {".".join(map(str, e["loc"][1:])): e["type"] for e in response.json()["detail"]}


async def test_paths_outside_the_roots_are_refused(
    client: httpx.AsyncClient, folders: dict[str, Path]
) -> None:
    elsewhere = str(folders["elsewhere"])
    pipeline = {
        **EXAMPLE,
        "source": {**EXAMPLE["source"], "path": "/etc/passwd"},
        "parents": [f"{elsewhere}/version"],
        "hygiene": {"decontaminate": [{"name": "x", "path": "examples/../../etc/hosts"}]},
    }
    assert refused(await submit(client, pipeline)) == {
        "source.path": "path_not_allowed",
        "hygiene.decontaminate.0.path": "path_not_allowed",
        "parents.0": "path_not_allowed",
    }
    sample = {
        "name": "sampled",
        "source": {"kind": "sample", "prompts": "examples/prefs/pairs.jsonl",
                   "generator": REPLICA},
        "cai": {"principles": f"{elsewhere}/principles.toml", "generator": REPLICA},
        "judges": [{"kind": "scorer", "scorer": "reward_model", "params": {"path": elsewhere}}],
    }  # fmt: skip
    assert refused(await submit(client, sample)) == {
        "cai.principles": "path_not_allowed",
        "judges.0.params.path": "path_not_allowed",
    }
    assert refused(await submit(client, {**EXAMPLE, "store": elsewhere})) == {"store": "store_not_allowed"}


async def test_credentials_the_operator_does_not_list_are_refused(client: httpx.AsyncClient) -> None:
    def llm_judge(env: str, url: str) -> dict[str, Any]:
        generator = {"kind": "openai", "base_url": url, "model": "judge", "api_key_env": env}
        return {"kind": "llm", "name": f"llm-{len(url)}", "generator": generator}

    judges = [
        *EXAMPLE["judges"],
        llm_judge("HOME", "https://judge.internal/v1"),  # not listed
        llm_judge("JUDGE_KEY", "https://attacker.example/v1"),  # listed, for another endpoint
        llm_judge("JUDGE_KEY", "https://judge.internal/v1/"),  # listed, its endpoint: allowed
    ]
    generator = {**REPLICA, "token_env": "RLFABRIC_COORDINATOR__API__TOKEN"}
    source = {"kind": "sample", "prompts": "examples/prefs/pairs.jsonl", "generator": generator}
    response = await submit(client, {**EXAMPLE, "source": source, "judges": judges})
    assert refused(response) == {
        "source.generator.token_env": "credential_not_allowed",
        "judges.2.generator.api_key_env": "credential_not_allowed",
        "judges.3.generator.api_key_env": "credential_not_allowed",
    }
    assert "prefs.credential_envs" in response.json()["message"]


async def test_local_generators_are_refused_unless_enabled(
    client: httpx.AsyncClient, folders: dict[str, Path]
) -> None:
    generator = {"kind": "local", "model": str(folders["models"])}
    source = {"kind": "sample", "prompts": "examples/prefs/pairs.jsonl", "generator": generator}
    response = await submit(client, {**EXAMPLE, "source": source})
    assert refused(response) == {"source.generator.kind": "local_generator_not_enabled"}
    assert "prefs.allow_local_generators" in response.json()["message"]


async def test_user_code_outside_the_allowed_code_is_refused(
    client: httpx.AsyncClient, folders: dict[str, Path]
) -> None:
    def judge(function: Any) -> dict[str, Any]:
        return {"kind": "scorer", "scorer": "python_function", "params": {"function": function}}

    outside = f"{folders['elsewhere'] / 'judge.py'}:score"
    escaping = f"{folders['code']}/../elsewhere/judge.py:score"
    judges = [judge(outside), judge("os:system"), judge([f"{folders['code'] / 'judge.py'}:score", escaping])]
    judges = [{**j, "name": f"j{i}"} for i, j in enumerate(judges)]
    response = await submit(client, {**EXAMPLE, "judges": judges})
    assert refused(response) == {
        "judges.0.params.function": "function_not_allowed",
        "judges.1.params.function": "function_not_allowed",
        "judges.2.params.function.1": "function_not_allowed",
    }


async def test_bad_input_and_missing_token(client: httpx.AsyncClient) -> None:
    assert refused(await submit(client, {**EXAMPLE, "colour": "blue"})) == {"colour": "extra_forbidden"}
    unauthenticated = await client.post("/v1/prefs/builds", json=EXAMPLE)
    assert unauthenticated.status_code == 401
    assert (await client.get("/v1/prefs/builds")).status_code == 401
    missing = await client.get("/v1/prefs/builds/" + "0" * 16, headers=AUTH)
    assert missing.status_code == 404
    assert (await client.get("/v1/prefs/builds", headers=AUTH)).json() == {"builds": []}


def test_nothing_was_built_outside_the_store(folders: dict[str, Path]) -> None:
    assert json.dumps(sorted(p.name for p in folders["elsewhere"].iterdir())) == '["judge.py"]'
