"""The HTTP server: POST /predict (npz) and /predict/summary (JSON) over one MoGeModel, the same for clips
(/predict/video, /predict/video/summary: `server/video.py`), plus health endpoints.

    app = create_app(MoGeModel.from_pretrained(...))            # a loaded model: ready at once
    app = create_app(lambda: MoGeModel.from_pretrained(...))    # loaded in the background: /ready says when

The routes are thin: the app's `Serving` (`serving.py`) receives and admits each request, runs the model's
PredictionService on a host thread and streams the answer; see there for the path of a request, the limits
and what each one holds. The query parameters of the predictions are the call options (`host.CallOptions`,
generated), the summary record is `MoGeOutput.summary` (`output.SUMMARY_FIELDS`, generated). The arrays are
those of `model(<same bytes>, <same options>)`.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager
from typing import Any, Callable, Literal, Optional, Union

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from .. import __version__
from ..host import CallOptions
from ..model import MoGeModel
from ..npzio import DEFLATE_BACKEND, npz_parts
from ..output import SUMMARY_FIELDS
from ..pool import ModelPool
from .docs import install_docs
from .errors import ERROR_RESPONSES, ApiError, ErrorBody, install_error_handlers
from .panorama import add_panorama_routes
from .protocol import log_accept_errors
from .sending import ABORT_KEY, connection_aborter
from .serving import (
    CALL_OPTION_NAMES,
    COMPRESS_QUERY,
    NPZ_MEDIA_TYPE,
    TIMING_HEADER,
    TIMING_STAGES,
    Serving,
    Timing,
    call_options_query,
    check_query,
    client_is_loopback,
    deflate_query,
    npz_response,
    summary_model,
    timing_headers,
)
from .settings import ServerSettings
from .upload import EXIF_QUERY, IMAGE_MEDIA_TYPES, MULTIPART_FIELD, exif_query
from .video import VIDEO_MEDIA_TYPES, add_video_routes

__all__ = [
    "create_app",
    "MoGeApp",
    "Summary",
    "Timing",
    "NPZ_MEDIA_TYPE",
    "TIMING_HEADER",
    "TIMING_STAGES",
    "client_is_loopback",
]

# ------------------------------------------------------------------------------------------ response models
Summary = summary_model(SUMMARY_FIELDS)


class Health(BaseModel):
    status: Literal["ok", "loading", "failed", "stopping"]
    ready: bool
    in_flight: int  # admitted and not yet answered (an answer still being sent counts)
    queue_size: int
    memory_reserved_bytes: int  # of the memory budget: bodies being received, admitted requests, unsent answers
    memory_budget_bytes: int
    responses: dict[str, int]  # counts by status class since start: 2xx, 4xx, 503, 5xx (503 excluded)


class Ready(BaseModel):
    ready: bool


class _CountResponses:
    """ASGI middleware: counts responses by status class for /health (a plain ASGI wrapper, no buffering)."""

    def __init__(self, app: Any, serving: Serving):
        self.app, self.serving = app, serving

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.serving.count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:  # answered as 500 by the outermost error middleware
            self.serving.count(500)
            raise


class MoGeApp(FastAPI):
    """The app of `create_app`: FastAPI with its `serving` (the one `Serving` its routes and the web page call).
    It also notes, for each request, how to abort its connection: only the server's own `send` (seen here,
    before any middleware wraps it) leads to the connection (see sending.connection_aborter)."""

    serving: Serving

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            abort = connection_aborter(send)
            if abort is not None:
                scope[ABORT_KEY] = abort
        await super().__call__(scope, receive, send)


# ------------------------------------------------------------------------------------------------ the app
_IMAGE_BODY = {"schema": {"type": "string", "format": "binary"}}
_PREDICT_BODY = {
    "requestBody": {
        "required": True,
        "description": f"The image: the raw PNG/JPEG bytes with their Content-Type, or the file field "
        f"`{MULTIPART_FIELD}` of a multipart/form-data body. Not a path: the server never opens files a client names.",
        "content": {
            **{kind: _IMAGE_BODY for kind in ("image/png", "image/jpeg")},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": [MULTIPART_FIELD],
                    "properties": {MULTIPART_FIELD: {"type": "string", "format": "binary"}},
                }
            },
        },
    }
}
_TIMING_HEADERS = {
    "Server-Timing": {"description": "Stage durations (ms): " + ", ".join(TIMING_STAGES), "schema": {"type": "string"}},
    TIMING_HEADER: {"description": "timing_ms: the same stages as a JSON object", "schema": {"type": "string"}},
}


def create_app(
    model: Union[MoGeModel, ModelPool, Callable[[], Union[MoGeModel, ModelPool]]],
    settings: Optional[ServerSettings] = None,
    *,
    on_load_error: Optional[Callable[[BaseException], None]] = None,
) -> MoGeApp:
    """A FastAPI app serving one MoGeModel, or a ModelPool of replicas (one per device: `tt-moge serve --devices`).

    model: a loaded MoGeModel or ModelPool (the caller keeps ownership and closes it), or a zero-argument callable that
      loads one; it runs in a background thread at start-up (the app then owns and closes the model), and
      /ready answers 503 until it returns. `on_load_error(exc)` is called if it raises (the CLI stops then).
    """
    settings = settings or ServerSettings()
    serving = Serving(settings)
    loader = None
    if isinstance(model, (MoGeModel, ModelPool)):
        serving.model = model
    elif callable(model):
        loader = model
    else:
        raise TypeError(
            f"model must be a MoGeModel, a ModelPool or a callable that loads one, got {type(model).__name__}"
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log_accept_errors(asyncio.get_running_loop())  # once per interval, never per attempt
        if loader is not None:
            threading.Thread(
                target=serving.load, args=(loader, on_load_error), name="tt_moge-load", daemon=True
            ).start()
        try:
            yield
        finally:
            serving.close()

    app = MoGeApp(
        title="tt_moge",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,  # /docs: install_docs
        description="MoGe-2 over HTTP: one RGB image in; metric depth, camera-space points, normals, validity mask "
        "and intrinsics out, at the image's own resolution. Errors are JSON {code, detail}.",
    )
    app.serving = serving
    install_error_handlers(app)
    install_docs(app)
    app.add_middleware(_CountResponses, serving=serving)
    responses = dict(ERROR_RESPONSES)
    call_query = call_options_query

    @app.post(
        "/predict",
        dependencies=[Depends(serving.authorize)],
        openapi_extra=_PREDICT_BODY,
        response_class=Response,
        summary="Predict: image in, npz of MoGeOutput out",
        responses={
            200: npz_response(
                "The npz layout of MoGeOutput (normal float16, mask uint8); timing in the headers",
                headers=_TIMING_HEADERS,
            ),
            **responses,
        },
    )
    async def predict(
        request: Request,
        options: CallOptions = Depends(call_query),
        deflate: bool = Depends(deflate_query),
        exif: bool = Depends(exif_query),
    ) -> Response:
        check_query(request, (*CALL_OPTION_NAMES, COMPRESS_QUERY, EXIF_QUERY))
        done = await serving.predict(
            request, options, lambda out, _: npz_parts(out.npz_arrays(), compress=deflate), exif
        )
        return serving.answer(done.payload, NPZ_MEDIA_TYPE, timing_headers(done.timing), done.ticket)

    @app.post(
        "/predict/summary",
        dependencies=[Depends(serving.authorize)],
        openapi_extra=_PREDICT_BODY,
        response_model=Summary,
        summary="Predict: image in, a small JSON summary out (no maps)",
        responses={200: {"headers": _TIMING_HEADERS}, **responses},
    )
    async def predict_summary(
        request: Request, options: CallOptions = Depends(call_query), exif: bool = Depends(exif_query)
    ) -> Response:
        check_query(request, (*CALL_OPTION_NAMES, EXIF_QUERY))
        done = await serving.predict(request, options, lambda out, _: out.summary(), exif)
        try:
            record = Summary(**done.payload, timing_ms=done.timing).model_dump()
        except BaseException:
            done.ticket.done("answer")
            raise
        return serving.answer_json(record, done.timing, done.ticket)

    add_video_routes(app, serving, responses)
    add_panorama_routes(app, serving, responses, _PREDICT_BODY)

    @app.get("/health", response_model=Health, summary="Liveness: the process answers (200 even while loading)")
    async def health() -> dict:
        return {
            "status": serving.status(),
            "ready": serving.serves(),
            "in_flight": serving.in_flight,
            "queue_size": settings.queue_size,
            "memory_reserved_bytes": serving.budget.used,
            "memory_budget_bytes": serving.budget.limit,
            "responses": dict(serving.responses),
        }

    @app.get(
        "/ready",
        response_model=Ready,
        summary="Readiness: 200 once the model is loaded and warm, else 503",
        responses={503: {"model": ErrorBody, "description": "Still loading, or loading failed"}},
    )
    async def ready() -> dict:
        if not serving.serves():
            raise ApiError(503, "not_ready", serving.not_serving(), {"Retry-After": str(settings.retry_after_s)})
        return {"ready": True}

    @app.get(
        "/info",
        dependencies=[Depends(serving.authorize)],
        summary="The loaded model and the server limits",
        responses={401: ERROR_RESPONSES[401], 503: ERROR_RESPONSES[503]},
    )
    async def info() -> dict:
        if serving.model is None:
            raise ApiError(
                503,
                "not_ready",
                "the model is not loaded yet; see GET /ready",
                {"Retry-After": str(settings.retry_after_s)},
            )
        limits = settings.limits()  # every setting (generated from ServerSettings), not the key itself
        return {
            **serving.model.info(),
            "server": {
                "limits": limits,
                "npz_deflate": DEFLATE_BACKEND,
                "image_types": sorted(IMAGE_MEDIA_TYPES) + ["multipart/form-data"],
                "video_types": list(VIDEO_MEDIA_TYPES),
            },
        }

    return app
