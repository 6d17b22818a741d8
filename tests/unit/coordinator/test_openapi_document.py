"""The coordinator's OpenAPI document, walked: every answer of every route has a body schema that resolves,
and each route declares exactly the errors `ROUTE_ERRORS` gives it, each with its error body model.
What the app really answers is compared with the document in tests/integration/coordinator/test_api.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from jsonschema import Draft202012Validator

from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.api_errors import ERROR_RESPONSES, ROUTE_ERRORS
from rlfabric.coordinator.config import CoordinatorServiceConfig


@pytest.fixture
def app(tmp_path: Path) -> FastAPI:
    """The real app with every optional route (prefs builds); no Redis is contacted."""
    prefs = {"work_dir": str(tmp_path / "builds"), "store": str(tmp_path / "store")}
    return create_app(CoordinatorServiceConfig.model_validate({"api": {"token": "t"}, "prefs": prefs}))


def operations(app: FastAPI) -> Iterator[tuple[APIRoute, str, dict[str, Any]]]:
    """Each documented route, one of its methods, and that operation in the document."""
    document = app.openapi()
    for route in app.routes:
        if isinstance(route, APIRoute) and route.include_in_schema:
            for method in route.methods:
                yield route, method, document["paths"][route.path][method.lower()]


def refs(schema: Any) -> Iterator[str]:
    """Every `$ref` inside a schema."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            yield schema["$ref"]
        for value in schema.values():
            yield from refs(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from refs(value)


def test_every_answer_has_a_schema_that_resolves(app: FastAPI) -> None:
    components = app.openapi()["components"]["schemas"]
    for route, method, operation in operations(app):
        for code, answer in operation["responses"].items():
            where = (method, route.path, code)
            assert answer.get("description") and answer.get("content"), where
            for media in answer["content"].values():
                assert media.get("schema"), where
                for ref in refs(media["schema"]):
                    assert ref.rsplit("/", 1)[1] in components, (where, ref)


def test_each_route_declares_its_errors_with_their_models(app: FastAPI) -> None:
    named = set()
    for route, method, operation in operations(app):
        named.add(route.name)
        errors = {int(code) for code in operation["responses"] if code.startswith("4")}
        assert errors == set(ROUTE_ERRORS[route.name]), (method, route.path)
        for code in errors:
            schema = operation["responses"][str(code)]["content"]["application/json"]["schema"]
            model = ERROR_RESPONSES[code]["model"]
            assert schema == {"$ref": f"#/components/schemas/{model.__name__}"}, (route.path, code)
    assert named == set(ROUTE_ERRORS)  # no stale entry for a route that is gone


def test_v1_routes_declare_the_bearer_token(app: FastAPI) -> None:
    schemes = app.openapi()["components"]["securitySchemes"]
    for route, method, operation in operations(app):
        secured = bool(operation.get("security"))
        assert secured == route.path.startswith("/v1/"), (method, route.path)
    assert {s["scheme"] for s in schemes.values()} == {"bearer"}


def test_component_schemas_are_valid_json_schemas(app: FastAPI) -> None:
    for schema in app.openapi()["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
