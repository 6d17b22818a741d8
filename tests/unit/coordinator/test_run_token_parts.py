"""The pure parts of per-run API tokens: the token's form, its digest, and who a `Caller` may reach."""

from __future__ import annotations

import hashlib

import pytest
from fastapi import HTTPException

from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.api_auth import ANOTHER_RUN, OPERATOR, OPERATOR_ONLY, Caller
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.runs import new_run_token, token_digest, token_run_id


@pytest.mark.parametrize("run_id", ["A", "run-3f9a0c1d", "my.run_v2", "x" * 64])
def test_a_token_names_its_run(run_id: str) -> None:
    token = new_run_token(run_id)
    assert token_run_id(token) == run_id
    assert token.startswith(run_id + ".")


def test_tokens_are_fresh_and_long() -> None:
    tokens = {new_run_token("A") for _ in range(100)}
    assert len(tokens) == 100
    assert min(len(t) for t in tokens) >= len("A.") + 43  # 32 random bytes, URL-safe base64


NOT_TOKENS = ["", "nodot", "A.", ".secret", "bad id.secret", "-A.secret", "x" * 65 + ".s"]


@pytest.mark.parametrize("text", NOT_TOKENS)
def test_what_cannot_be_a_run_token_names_no_run(text: str) -> None:
    assert token_run_id(text) is None


def test_the_digest_is_sha256_hex() -> None:
    assert token_digest("A.s") == hashlib.sha256(b"A.s").hexdigest()
    assert token_digest("A.s") != token_digest("A.t")


def test_the_operator_reaches_every_run_and_route() -> None:
    OPERATOR.check_run("anything")
    OPERATOR.check_operator()


def test_a_run_token_reaches_its_run_only() -> None:
    caller = Caller("A")
    caller.check_run("A")
    with pytest.raises(HTTPException) as other:
        caller.check_run("B")
    assert (other.value.status_code, other.value.detail) == (403, ANOTHER_RUN)
    with pytest.raises(HTTPException) as operator_only:
        caller.check_operator()
    assert (operator_only.value.status_code, operator_only.value.detail) == (403, OPERATOR_ONLY)


def test_the_openapi_document_gives_submit_the_run_token_and_no_other_answer() -> None:
    config = CoordinatorServiceConfig.model_validate({"api": {"token": "t"}})
    document = create_app(config).openapi()
    created = document["paths"]["/v1/runs"]["post"]["responses"]["201"]["content"]["application/json"]
    assert created["schema"] == {"$ref": "#/components/schemas/SubmittedRun"}
    schemas = document["components"]["schemas"]
    assert "run_token" in schemas["SubmittedRun"]["required"]
    assert [name for name, s in schemas.items() if "run_token" in s.get("properties", {})] == ["SubmittedRun"]
