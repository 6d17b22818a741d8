"""The coordinator's API documentation pages without a CDN: Swagger UI at /docs, ReDoc at /redoc.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so they are blank where the coordinator has no
internet access. These pages are FastAPI's HTML pointed at the files the `fastapi-offline` package
installs (Swagger UI 5, which renders the OpenAPI 3.1 document FastAPI writes, and ReDoc's standalone
bundle), served by the app at `ASSETS_URL`. Nothing on the pages names another host: no Google fonts, no
online validator, a local favicon. Like /openapi.json, the pages and their files need no token.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
ASSETS_URL = "/docs/assets"
"""Where the Swagger UI and ReDoc files are served (the package's `static` folder)."""
ASSETS_PACKAGE = ("fastapi_offline", "static")


def add_docs(app: FastAPI) -> None:
    """Serves /docs, /redoc and their files on `app` (made with `docs_url=None, redoc_url=None`)."""
    app.mount(ASSETS_URL, StaticFiles(packages=[ASSETS_PACKAGE]), name="docs_assets")
    title = app.title

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )


def _root(request: Request) -> str:
    """The prefix the app is served under behind a proxy (`--root-path`), as FastAPI's pages use it."""
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")
