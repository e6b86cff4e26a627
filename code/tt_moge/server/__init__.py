"""The HTTP server (needs the `server` extra: fastapi, uvicorn, pydantic, isal, python-multipart).

`create_app(model, settings)` builds the FastAPI app; `python -m tt_moge.server` / `tt-moge serve` run it.
"""

from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str):  # the app module imports fastapi: only when asked for
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
