"""The coordinator's /docs and /redoc load everything from the coordinator itself: no CDN, no other host."""

from __future__ import annotations

from collections.abc import AsyncIterator
from html.parser import HTMLParser

import httpx
import pytest

from rlfabric.coordinator.api import create_app
from rlfabric.coordinator.config import CoordinatorServiceConfig

KINDS = {".js": "javascript", ".css": "text/css", ".png": "image/png"}
"""The content type each asset's extension must be served with."""


class AssetLinks(HTMLParser):
    """The URLs a page loads: every <script src> and <link href>."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = {"script": "src", "link": "href"}.get(tag)
        self.urls += [value for name, value in attrs if name == wanted and value]


def asset_urls(page: str) -> list[str]:
    parser = AssetLinks()
    parser.feed(page)
    return parser.urls


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The real app with a token set (no Redis is contacted by these routes)."""
    config = CoordinatorServiceConfig.model_validate({"api": {"token": "s3cret"}})
    app = create_app(config)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
        yield c


@pytest.mark.parametrize(("page", "expected"), [("/docs", 3), ("/redoc", 2)])
async def test_docs_pages_load_only_local_assets(client: httpx.AsyncClient, page: str, expected: int) -> None:
    answer = await client.get(page)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
    assert "http" not in answer.text.lower() and "cdn" not in answer.text.lower()
    urls = asset_urls(answer.text)
    assert len(urls) == expected, urls
    for url in urls:
        assert url.startswith("/docs/assets/") and "//" not in url, url
        asset = await client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 1000, url
        assert KINDS[url[url.rindex(".") :]] in asset.headers["content-type"], url


async def test_docs_pages_point_at_the_document(client: httpx.AsyncClient) -> None:
    for page in ("/docs", "/redoc"):
        assert "/openapi.json" in (await client.get(page)).text
    document = await client.get("/openapi.json")
    assert document.status_code == 200 and document.json()["openapi"].startswith("3.1")
    assert "/docs" not in document.json()["paths"] and "/redoc" not in document.json()["paths"]


async def test_docs_need_no_token_while_the_api_does(client: httpx.AsyncClient) -> None:
    for url in ("/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui-bundle.js"):
        assert (await client.get(url)).status_code == 200, url
    assert (await client.get("/v1/runs")).status_code == 401


async def test_docs_pages_follow_the_root_path() -> None:
    app = create_app(CoordinatorServiceConfig.model_validate({}))
    transport = httpx.ASGITransport(app=app, root_path="/coordinator")
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
        page = (await c.get("/coordinator/docs")).text
    assert all(url.startswith("/coordinator/docs/assets/") for url in asset_urls(page))
    assert "'/coordinator/openapi.json'" in page


async def test_unknown_assets_are_404(client: httpx.AsyncClient) -> None:
    assert (await client.get("/docs/assets/nope.js")).status_code == 404
