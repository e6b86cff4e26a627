"""GET /docs: the Swagger UI page of the OpenAPI schema, with its script, style sheet and icon served by this
server from the `swagger-ui-bundle-v2` package (the `server` extra), so that the page works on a machine
without internet access. FastAPI's own /docs loads them from a CDN; /redoc, which would too, is not offered.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

__all__ = ["DOCS_URL", "DOCS_ASSETS_URL", "install_docs"]

DOCS_URL = "/docs"
DOCS_ASSETS_URL = "/docs/assets"
_MISSING = """<!doctype html><title>tt_moge API</title>
<p>The Swagger UI files are not installed: <code>pip install swagger-ui-bundle-v2</code> (part of the server extra,
<code>pip install -e "code/[server]"</code>). The OpenAPI schema is at <a href="{schema}">{schema}</a>.</p>"""


def install_docs(app: FastAPI) -> None:
    """Add GET /docs and its assets to an app made with `docs_url=None, redoc_url=None`."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        swagger_ui_path = None
    if swagger_ui_path is not None:
        from fastapi.staticfiles import StaticFiles

        app.mount(DOCS_ASSETS_URL, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    @app.get(DOCS_URL, include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")  # behind a proxy that strips a path prefix
        schema = root + (app.openapi_url or "/openapi.json")
        if swagger_ui_path is None:
            return HTMLResponse(_MISSING.format(schema=schema))
        assets = root + DOCS_ASSETS_URL
        return get_swagger_ui_html(
            openapi_url=schema,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None},
        )  # no badge from validator.swagger.io
