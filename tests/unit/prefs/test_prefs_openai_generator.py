"""The OpenAI-compatible generator against httpx.MockTransport: the request it sends, n completions per
prompt (asked again when a server returns fewer), retries of transport errors, 429 and 5xx, and which
failures are per prompt and which make the generator unusable. Also the generator specs' validation."""

import json

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError

from rlfabric.prefs.generation import (
    GenerationError,
    GeneratorSpec,
    GeneratorUnusable,
    OpenAIGenerator,
    OpenAIGeneratorSpec,
    RolloutGeneratorSpec,
    make_generator,
    redact_url,
)

SPECS = TypeAdapter(GeneratorSpec)


class Endpoint:
    """A scripted chat completions endpoint: `script` maps a prompt's text to the answers to give it in
    turn (an int is an HTTP status, an exception is raised as a transport error, a list is the texts of
    the choices); unscripted prompts get n choices "<prompt>/<i>"."""

    def __init__(self, script=None):
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.requests = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append({"url": str(request.url), "auth": request.headers.get("authorization"), **body})
        text = body["messages"][-1]["content"]
        step = self.script[text].pop(0) if self.script.get(text) else None
        if isinstance(step, Exception):
            raise step
        if isinstance(step, int):
            return httpx.Response(step, json={"error": "scripted"})
        texts = step if step is not None else [f"{text}/{i}" for i in range(body["n"])]
        choices = [{"index": i, "message": {"role": "assistant", "content": t}} for i, t in enumerate(texts)]
        choices.reverse()  # the index, not the position, orders choices
        return httpx.Response(200, json={"model": "served-1", "system_fingerprint": "fp", "choices": choices})

    def attempts(self, text):
        return sum(r["messages"][-1]["content"] == text for r in self.requests)


def generator(endpoint, **overrides):
    spec = {"base_url": "http://judge.test/v1/", "model": "m", "backoff_s": 0.0, **overrides}
    return OpenAIGenerator(OpenAIGeneratorSpec(**spec), transport=httpx.MockTransport(endpoint))


async def test_request_shape_and_n_completions_per_prompt(monkeypatch):
    monkeypatch.setenv("RLF_TEST_GEN_KEY", "sk-secret")
    endpoint = Endpoint()
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "chat"}]
    async with generator(endpoint, api_key_env="RLF_TEST_GEN_KEY", extra_body={"top_p": 0.5}) as gen:
        out = await gen.generate(["plain", chat], n=3, max_tokens=7, temperature=0.3, seed=10)
    assert out == [["plain/0", "plain/1", "plain/2"], ["chat/0", "chat/1", "chat/2"]]
    first, second = endpoint.requests
    assert first["url"] == "http://judge.test/v1/chat/completions" and first["auth"] == "Bearer sk-secret"
    assert first["messages"] == [{"role": "user", "content": "plain"}] and second["messages"] == chat
    assert {k: first[k] for k in ("model", "n", "max_tokens", "temperature", "top_p")} == {
        "model": "m",
        "n": 3,
        "max_tokens": 7,
        "temperature": 0.3,
        "top_p": 0.5,
    }
    assert [first["seed"], second["seed"]] == [10, 13]  # prompt i from seed + i * n


async def test_max_completion_tokens_and_no_seed():
    endpoint = Endpoint()
    async with generator(endpoint, max_tokens_field="max_completion_tokens") as gen:
        await gen.generate(["x"], max_tokens=5)
    [request] = endpoint.requests
    assert request["max_completion_tokens"] == 5 and "max_tokens" not in request and "seed" not in request
    assert request["auth"] is None


async def test_a_server_returning_fewer_choices_is_asked_for_the_rest():
    endpoint = Endpoint({"x": [["one"], ["two", "three"]]})
    async with generator(endpoint) as gen:
        assert await gen.generate(["x"], n=3, seed=0) == [["one", "two", "three"]]
    assert [(r["n"], r["seed"]) for r in endpoint.requests] == [(3, 0), (2, 1)]


async def test_transport_errors_429_and_5xx_are_retried():
    endpoint = Endpoint({"a": [500, 429], "b": [httpx.ConnectError("refused")], "c": [503]})
    async with generator(endpoint, max_retries=2) as gen:
        out = await gen.generate(["a", "b", "c"])
    assert out == [["a/0"], ["b/0"], ["c/0"]]
    assert [endpoint.attempts(t) for t in "abc"] == [3, 2, 2]


async def test_failures_are_per_prompt_after_the_retries():
    endpoint = Endpoint({"down": [500] * 5, "bad": [400, 400], "empty": [[]], "ok": []})
    async with generator(endpoint, max_retries=2) as gen:
        down, bad, empty, ok = await gen.generate_each(["down", "bad", "empty", "ok"], n=2)
        assert ok == ["ok/0", "ok/1"]
        assert isinstance(down, GenerationError) and "after 3 attempt(s)" in str(down)
        assert isinstance(bad, GenerationError) and "HTTP 400" in str(bad)
        assert isinstance(empty, GenerationError) and "no choices" in str(empty)
        assert [endpoint.attempts(t) for t in ("down", "bad")] == [3, 1]
        with pytest.raises(GenerationError, match=r"prompts\[1\]: endpoint answered HTTP 400"):
            await gen.generate(["ok", "bad"])


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_a_refused_credential_or_unknown_model_makes_the_generator_unusable(status):
    async with generator(Endpoint({"x": [status]})) as gen:
        with pytest.raises(GeneratorUnusable, match=f"HTTP {status}"):
            await gen.generate_each(["x", "y"])


async def test_malformed_answers_are_errors():
    def endpoint(request):
        return httpx.Response(200, text="not json")

    async with OpenAIGenerator(
        OpenAIGeneratorSpec(base_url="http://x/v1", model="m"), transport=httpx.MockTransport(endpoint)
    ) as gen:
        [outcome] = await gen.generate_each(["x"])
    assert isinstance(outcome, GenerationError) and "not JSON" in str(outcome)


async def test_describe_names_the_model_and_never_a_credential(monkeypatch):
    monkeypatch.setenv("RLF_TEST_GEN_KEY", "sk-secret")
    url = "https://user:pw@judge.test:8443/v1?key=sk-secret"
    gen = generator(Endpoint(), base_url=url, api_key_env="RLF_TEST_GEN_KEY")
    await gen.generate(["x"])
    described = gen.describe()
    await gen.close()
    assert described["base_url"] == "https://judge.test:8443/v1"
    assert described["model"] == "m" and described["served_models"] == ["served-1"]
    assert described["system_fingerprints"] == ["fp"]
    assert "sk-secret" not in json.dumps(described) and "pw" not in json.dumps(described)


async def test_bad_sampling_arguments_are_refused():
    with pytest.raises(ValueError, match="n >= 1"):
        await generator(Endpoint()).generate_each(["x"], n=0)


def test_specs_are_a_union_on_kind():
    rollout = SPECS.validate_python({"kind": "rollout", "address": "127.0.0.1:50051", "model_version": 3})
    openai = SPECS.validate_python({"kind": "openai", "base_url": "http://h/v1", "model": "m"})
    assert isinstance(rollout, RolloutGeneratorSpec) and rollout.model_version == 3
    assert isinstance(openai, OpenAIGeneratorSpec)
    with pytest.raises(ValidationError, match="kind"):
        SPECS.validate_python({"kind": "hub", "model": "m"})


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"kind": "rollout", "address": "localhost"}, "address", "host:port"),
        ({"kind": "rollout", "address": "h:99999"}, "address", "host:port"),
        ({"kind": "rollout", "address": "h:1", "token_env": "s3cr3t-token"}, "token_env", "NAME"),
        ({"kind": "openai", "base_url": "ftp://h", "model": "m"}, "base_url", "http"),
        (
            {"kind": "openai", "base_url": "http://h", "model": "m", "api_key_env": "sk-1"},
            "api_key_env",
            "NAME",
        ),
        (
            {"kind": "openai", "base_url": "http://h", "model": "m", "extra_body": {"n": 2}},
            "extra_body",
            "'n'",
        ),
        ({"kind": "openai", "base_url": "http://h", "model": "m", "surprise": 1}, "surprise", "Extra"),
    ],
)
def test_spec_errors_name_the_field(spec, field, message):
    with pytest.raises(ValidationError) as err:
        SPECS.validate_python(spec)
    assert field in str(err.value) and message in str(err.value)


def test_a_credential_variable_that_is_not_set_is_refused_at_start(monkeypatch):
    monkeypatch.delenv("RLF_TEST_UNSET", raising=False)
    with pytest.raises(GeneratorUnusable, match="api_key_env: environment variable 'RLF_TEST_UNSET'"):
        make_generator(
            SPECS.validate_python(
                {"kind": "openai", "base_url": "http://h", "model": "m", "api_key_env": "RLF_TEST_UNSET"}
            )
        )
    with pytest.raises(GeneratorUnusable, match="token_env"):
        make_generator(RolloutGeneratorSpec(address="h:1", token_env="RLF_TEST_UNSET"))


def test_redact_url():
    assert redact_url("http://a:b@[::1]:80/v1?x=1#f") == "http://[::1]:80/v1"
    assert redact_url("https://api.example/v1") == "https://api.example/v1"
