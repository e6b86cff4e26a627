"""The HTTP server: POST /predict (npz) and /predict/summary (JSON) over one MoGeModel, plus health endpoints.

    app = create_app(MoGeModel.from_pretrained(...))            # a loaded model: ready at once
    app = create_app(lambda: MoGeModel.from_pretrained(...))    # loaded in the background: /ready says when

A request goes: receive + check the upload (event loop, no queue slot; its bytes counted against the memory
budget as they arrive) -> admission (at most `queue_size` requests at once and within the memory budget, each
counted by its pixels, else 503 + Retry-After) -> a host thread runs `model.predict(<the uploaded bytes>)`
(decode, canvas, device forward under the model's lock, solve, finish) and encodes the answer -> the answer is
streamed to the client (`sending.StreamedAnswer`). The request keeps its queue slot and its memory until the
answer has been sent, or the client is gone or cut for not reading (`send_timeout_s`). While one request is on
the device, other threads decode and post-process theirs. The arrays are those of `model(<same bytes>)`.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Callable, Literal, Optional, Union

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from .. import __version__
from ..host import InputError
from ..model import MoGeModel
from ..npzio import DEFLATE_BACKEND, npz_parts
from ..output import MoGeOutput
from .docs import install_docs
from .admission import MemoryBudget, Reservation, Ticket
from .errors import ERROR_RESPONSES, ApiError, ErrorBody, install_error_handlers
from .sending import ABORT_KEY, StreamedAnswer, connection_aborter
from .settings import ServerSettings
from .upload import IMAGE_MEDIA_TYPES, MULTIPART_FIELD, ImageUpload, receive_image

__all__ = ["create_app", "NPZ_MEDIA_TYPE", "TIMING_HEADER", "TIMING_STAGES"]

log = logging.getLogger("tt_moge.server")

NPZ_MEDIA_TYPE = "application/x-npz"
TIMING_HEADER = "X-Timing-Ms"  # the timing_ms record of an npz response, as a JSON object
# Stages of timing_ms, in ms, in the order a request passes them. `device` is the forward only.
TIMING_STAGES = ("read", "queue", "decode", "canvas", "device_wait", "device", "solve", "finish", "post", "encode", "total")
OPTION_NAMES = {"fit", "fov_x", "apply_mask", "force_projection"}


# ------------------------------------------------------------------------------------------ response models
class Timing(BaseModel):
    """Stage times of one request in milliseconds (`post` = solve + finish; `total` = the whole request)."""

    read: float  # receiving and checking the upload
    queue: float  # admitted, waiting for a host thread
    decode: float  # PNG/JPEG -> RGB
    canvas: float  # fit onto the model's canvas
    device_wait: float  # waiting while the device ran other requests
    device: float  # the device forward only
    solve: float  # focal / shift recovery
    finish: float  # crop, resize, re-projection, mask
    post: float
    encode: float  # npz or JSON
    total: float


class Summary(BaseModel):
    """A small JSON view of one result (no maps). Non-finite values are null."""

    width: int
    height: int
    valid_fraction: float  # share of pixels with mask == 1
    median_depth_m: Optional[float]  # over valid pixels; null when none is valid
    fov_x_deg: Optional[float]
    fov_y_deg: Optional[float]
    metric_scale: Optional[float]
    intrinsics: list[list[Optional[float]]]  # normalised: fx, cx by width; fy, cy by height
    intrinsics_pixels: list[list[Optional[float]]]
    has_normal: bool
    timing_ms: Timing


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


def client_is_loopback(request: Request) -> bool:
    """The client runs on this machine: bytes cost almost nothing to move, so deflating only adds time."""
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False



def timing_headers(timing_ms: dict) -> dict:
    """Server-Timing (shown by browser dev tools) and X-Timing-Ms (the timing_ms record as JSON)."""
    stages = [stage for stage in TIMING_STAGES if stage in timing_ms]
    return {"Server-Timing": ", ".join(f"{stage};dur={timing_ms[stage]:.2f}" for stage in stages),
            TIMING_HEADER: json.dumps({stage: round(timing_ms[stage], 3) for stage in stages})}


# ------------------------------------------------------------------------------------------- serving state
class _Serving:
    """The model, its host threads, the admission counter and the memory budget of one app."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.model: Optional[MoGeModel] = None
        self.owns_model = False
        self.load_error: Optional[str] = None
        self.executor = ThreadPoolExecutor(settings.host_threads, thread_name_prefix="tt_moge-serve")
        self._lock = threading.Lock()
        self.in_flight = 0
        self.budget = MemoryBudget(settings.memory_budget_bytes)
        self.draining = False
        self.responses = {"2xx": 0, "4xx": 0, "503": 0, "5xx": 0}

    def load(self, loader: Callable[[], MoGeModel], on_error: Optional[Callable[[BaseException], None]]) -> None:
        t = time.perf_counter()
        try:
            model = loader()
            if not isinstance(model, MoGeModel):
                raise TypeError(f"the model loader returned {type(model).__name__}, expected a MoGeModel")
        except BaseException as exc:  # reported on /ready and /health; the CLI exits
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("loading the model failed: %s", self.load_error)
            if on_error is not None:
                on_error(exc)
            return
        self.model, self.owns_model = model, True
        log.info("model ready in %.1f s: %s", time.perf_counter() - t, model)

    def status(self) -> str:
        if self.draining:
            return "stopping"
        return "ok" if self.model is not None else ("failed" if self.load_error else "loading")

    def drain(self) -> None:
        """Stop admitting (503 shutting_down): the server is stopping; what is admitted finishes."""
        self.draining = True

    def _refuse(self, code: str, detail: str, close: bool = False) -> ApiError:
        headers = {"Retry-After": str(self.settings.retry_after_s)}
        if close:
            headers["Connection"] = "close"
        return ApiError(503, code, detail, headers)

    def reserver(self, reservation: Reservation) -> Callable[[int], None]:
        """reserve(n) for receive_image: n more body bytes from the budget, or 503 memory_full."""

        def reserve(nbytes: int) -> None:
            if not reservation.grow(nbytes):
                raise self._refuse("memory_full", self._budget_detail("the body", reservation.nbytes + nbytes))

        return reserve

    def _budget_detail(self, what: str, needed: int) -> str:
        mb = 1024 * 1024
        return (f"{what} needs {needed / mb:.1f} MiB of the server's memory budget; requests in progress hold "
                f"{self.budget.used / mb:.1f} of {self.budget.limit / mb:.0f} MiB (--memory-budget-mb); "
                f"retry after {self.settings.retry_after_s} s")

    def admit(self, reservation: Reservation, cost: int) -> Ticket:
        """Take a queue slot and `cost` bytes of the memory budget (the reservation grows to it), or raise 503.
        The ticket frees both once the work has ended and the answer has been sent or abandoned."""
        if self.draining:
            raise self._refuse("shutting_down", "the server is stopping and admits no more requests; retry on "
                                                "another instance or after it restarts", close=True)
        if self.model is None:
            reason = f"the model failed to load ({self.load_error})" if self.load_error else "the model is still loading"
            raise self._refuse("not_ready", f"{reason}; see GET /ready")
        with self._lock:
            if self.in_flight >= self.settings.queue_size:
                raise self._refuse("queue_full", f"{self.in_flight} requests are in progress (--queue-size "
                                                 f"{self.settings.queue_size}); retry after {self.settings.retry_after_s} s")
            if not reservation.resize(cost):
                raise self._refuse("memory_full", self._budget_detail("this image", cost))
            self.in_flight += 1

        def free() -> None:
            reservation.release()
            with self._lock:
                self.in_flight -= 1

        return Ticket(reservation, free)

    def count(self, status: int) -> None:
        key = "503" if status == 503 else f"{status // 100}xx"
        if key in self.responses:
            with self._lock:
                self.responses[key] += 1

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        if self.owns_model and self.model is not None:
            self.model.close()


class _CountResponses:
    """ASGI middleware: counts responses by status class for /health (a plain ASGI wrapper, no buffering)."""

    def __init__(self, app: Any, serving: _Serving):
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


class _App(FastAPI):
    """FastAPI that notes, for each request, how to abort its connection: only the server's own `send` (seen
    here, before any middleware wraps it) leads to the connection (see sending.connection_aborter)."""

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
            "multipart/form-data": {"schema": {"type": "object", "required": [MULTIPART_FIELD],
                                               "properties": {MULTIPART_FIELD: {"type": "string", "format": "binary"}}}},
        },
    }
}
_TIMING_HEADERS = {
    "Server-Timing": {"description": "Stage durations (ms): " + ", ".join(TIMING_STAGES), "schema": {"type": "string"}},
    TIMING_HEADER: {"description": "timing_ms: the same stages as a JSON object", "schema": {"type": "string"}},
}


def create_app(model: Union[MoGeModel, Callable[[], MoGeModel]], settings: Optional[ServerSettings] = None, *,
               on_load_error: Optional[Callable[[BaseException], None]] = None) -> FastAPI:
    """A FastAPI app serving one MoGeModel.

    model: a loaded MoGeModel (the caller keeps ownership and closes it), or a zero-argument callable that
      loads one; it runs in a background thread at start-up (the app then owns and closes the model), and
      /ready answers 503 until it returns. `on_load_error(exc)` is called if it raises (the CLI stops then).
    """
    settings = settings or ServerSettings()
    serving = _Serving(settings)
    loader = None
    if isinstance(model, MoGeModel):
        serving.model = model
    elif callable(model):
        loader = model
    else:
        raise TypeError(f"model must be a MoGeModel or a callable that loads one, got {type(model).__name__}")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if loader is not None:
            threading.Thread(target=serving.load, args=(loader, on_load_error), name="tt_moge-load", daemon=True).start()
        try:
            yield
        finally:
            serving.close()

    app = _App(
        title="tt_moge", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,  # /docs: install_docs
        description="MoGe-2 over HTTP: one RGB image in; metric depth, camera-space points, normals, validity mask "
                    "and intrinsics out, at the image's own resolution. Errors are JSON {code, detail}.",
    )
    app.state.serving = serving
    install_error_handlers(app)
    install_docs(app)
    app.add_middleware(_CountResponses, serving=serving)
    bearer = HTTPBearer(auto_error=False, description="Needed only when the server runs with an API key")

    def authorize(credentials: Optional[HTTPAuthorizationCredentials] = Depends(bearer)) -> None:
        if settings.api_key is None:
            return
        if credentials is None or credentials.scheme.lower() != "bearer" or not hmac.compare_digest(
                credentials.credentials.encode(), settings.api_key.encode()):
            raise ApiError(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           {"WWW-Authenticate": "Bearer"})

    def check_query(request: Request, allowed: set) -> None:
        names = list(request.query_params.keys())
        unknown = sorted(set(names) - allowed)
        if unknown:
            raise ApiError(422, "invalid_option", f"unknown query parameter(s) {unknown}; expected some of {sorted(allowed)}")
        repeated = sorted({n for n in names if len(request.query_params.getlist(n)) > 1})
        if repeated:
            raise ApiError(422, "invalid_option", f"query parameter(s) {repeated} given more than once")

    async def run_prediction(request: Request, options: dict, encode: Callable[[MoGeOutput, ImageUpload], Any]) -> tuple:
        """Receive, admit, predict and encode(output, upload) on a host thread -> (encoded payload, timing_ms, ticket).

        The caller passes the ticket on to the answer (`answer`), which frees it once sent; on any error here
        the ticket's answer part ends at once, and its slot frees when the work has ended too.
        """
        start = time.perf_counter()
        reservation = serving.budget.reservation()
        try:
            upload: ImageUpload = await receive_image(request, settings, serving.reserver(reservation))
            width, height = upload.size
            ticket = serving.admit(reservation, settings.request_cost(width * height, len(upload.data)))
        except BaseException:
            reservation.release()
            raise
        admitted = time.perf_counter()
        timing: dict = {"read": upload.read_ms}

        def job() -> Any:
            timing["queue"] = (time.perf_counter() - admitted) * 1e3
            try:
                out = serving.model.predict(upload.data, timing=timing, **options)
            except InputError as exc:
                raise ApiError(400, "bad_image", str(exc)) from None
            except Exception as exc:
                if "decode" not in timing:  # the decoder choked on untrusted bytes: the image is bad, not the server
                    raise ApiError(400, "bad_image", f"could not decode the {upload.format} data ({type(exc).__name__}: {exc})") from None
                raise
            timing["post"] = timing["solve"] + timing["finish"]
            t = time.perf_counter()
            payload = encode(out, upload)
            timing["encode"] = (time.perf_counter() - t) * 1e3
            return payload

        payload = await on_host(job, ticket)
        timing["total"] = (time.perf_counter() - start) * 1e3
        return payload, timing, ticket

    async def on_host(work: Callable[[], Any], ticket: Ticket) -> Any:
        """Run `work` on a host thread for an admitted request; its ticket's work part ends with it (even if the
        client left), and its answer part at once if there is nothing to answer."""
        try:
            future = serving.executor.submit(work)
        except BaseException:  # the executor is shut down (the server is stopping)
            ticket.done("work")
            ticket.done("answer")
            raise
        future.add_done_callback(lambda _: ticket.done("work"))  # even if the client left or the route was cancelled
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            ticket.done("answer")  # nothing to send
            raise

    async def run_admitted(work: Callable[[], Any], cost: int) -> tuple:
        """Admit a request that costs `cost` bytes of the memory budget and run `work` on a host thread ->
        (its result, ticket); the caller answers with `answer(..., ticket)` (the web page's downloads)."""
        reservation = serving.budget.reservation()
        try:
            ticket = serving.admit(reservation, cost)
        except BaseException:
            reservation.release()
            raise
        return await on_host(work, ticket), ticket

    def answer(parts: list, media_type: str, headers: dict, ticket: Ticket) -> StreamedAnswer:
        """The streamed 200 answer; from now on the request holds only the answer's bytes of the budget."""
        try:
            response = StreamedAnswer(parts, media_type, headers, settings.send_timeout_s,
                                      on_end=lambda: ticket.done("answer"))
            ticket.reservation.resize(min(response.nbytes, ticket.reservation.nbytes))
        except BaseException:
            ticket.done("answer")
            raise
        return response

    # The web page (server/ui.py) sends its requests through the same auth, limits, admission and answers.
    app.state.authorize, app.state.run_prediction, app.state.run_admitted = authorize, run_prediction, run_admitted
    app.state.answer = answer

    responses = dict(ERROR_RESPONSES)
    fit_q = Query("pad", description="pad: keep the aspect ratio, gray bars; stretch: resize to the canvas")
    fov_q = Query(None, gt=0, lt=180, allow_inf_nan=False, description="Known horizontal field of view in degrees")
    mask_q = Query(True, description="Set invalid pixels to inf (depth, points) and 0 (normal)")
    proj_q = Query(True, description="Compute the points from depth and intrinsics")

    @app.post(
        "/predict", dependencies=[Depends(authorize)], openapi_extra=_PREDICT_BODY, response_class=Response,
        summary="Predict: image in, npz of MoGeOutput out",
        responses={200: {"description": "The npz layout of MoGeOutput (normal float16, mask uint8); timing in the headers",
                         "content": {NPZ_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
                         "headers": _TIMING_HEADERS}, **responses},
    )
    async def predict(request: Request, fit: Literal["pad", "stretch"] = fit_q, fov_x: Optional[float] = fov_q,
                      apply_mask: bool = mask_q, force_projection: bool = proj_q,
                      compress: Literal["auto", "true", "false"] = Query("auto", description=(
                          "Deflate the maps inside the npz with ISA-L: about 37 % smaller, about 0.1 s more per "
                          "1920x1080 result. auto: deflate unless the client is on this machine (loopback)"))) -> Response:
        check_query(request, OPTION_NAMES | {"compress"})
        options = dict(fit=fit, fov_x=fov_x, apply_mask=apply_mask, force_projection=force_projection)
        deflate = compress == "true" or (compress == "auto" and not client_is_loopback(request))
        parts, timing, ticket = await run_prediction(request, options,
                                                     lambda out, _: npz_parts(out.npz_arrays(), compress=deflate))
        return answer(parts, NPZ_MEDIA_TYPE, timing_headers(timing), ticket)

    @app.post(
        "/predict/summary", dependencies=[Depends(authorize)], openapi_extra=_PREDICT_BODY, response_model=Summary,
        summary="Predict: image in, a small JSON summary out (no maps)",
        responses={200: {"headers": _TIMING_HEADERS}, **responses},
    )
    async def predict_summary(request: Request, fit: Literal["pad", "stretch"] = fit_q, fov_x: Optional[float] = fov_q,
                              apply_mask: bool = mask_q, force_projection: bool = proj_q) -> Response:
        check_query(request, OPTION_NAMES)
        options = dict(fit=fit, fov_x=fov_x, apply_mask=apply_mask, force_projection=force_projection)
        summary, timing, ticket = await run_prediction(request, options, lambda out, _: out.summary())
        try:
            body = JSONResponse(Summary(**summary, timing_ms=Timing(**timing)).model_dump()).body
        except BaseException:
            ticket.done("answer")
            raise
        return answer([body], "application/json", timing_headers(timing), ticket)

    @app.get("/health", response_model=Health, summary="Liveness: the process answers (200 even while loading)")
    async def health() -> dict:
        return {"status": serving.status(), "ready": serving.model is not None, "in_flight": serving.in_flight,
                "queue_size": settings.queue_size, "memory_reserved_bytes": serving.budget.used,
                "memory_budget_bytes": serving.budget.limit, "responses": dict(serving.responses)}

    @app.get("/ready", response_model=Ready, summary="Readiness: 200 once the model is loaded and warm, else 503",
             responses={503: {"model": ErrorBody, "description": "Still loading, or loading failed"}})
    async def ready() -> dict:
        if serving.model is None:
            detail = f"loading failed: {serving.load_error}" if serving.load_error else "the model is still loading"
            raise ApiError(503, "not_ready", detail, {"Retry-After": str(settings.retry_after_s)})
        return {"ready": True}

    @app.get("/info", dependencies=[Depends(authorize)], summary="The loaded model and the server limits",
             responses={401: ERROR_RESPONSES[401], 503: ERROR_RESPONSES[503]})
    async def info() -> dict:
        if serving.model is None:
            raise ApiError(503, "not_ready", "the model is not loaded yet; see GET /ready", {"Retry-After": str(settings.retry_after_s)})
        limits = {"max_body_bytes": settings.max_body_bytes, "max_pixels": settings.max_pixels,
                  "queue_size": settings.queue_size, "host_threads": settings.host_threads,
                  "max_connections": settings.max_connections, "read_timeout_s": settings.read_timeout_s,
                  "send_timeout_s": settings.send_timeout_s,
                  "memory_budget_bytes": settings.memory_budget_bytes, "shutdown_grace_s": settings.shutdown_grace_s,
                  "auth": settings.api_key is not None}
        return {**serving.model.info(), "server": {"limits": limits, "npz_deflate": DEFLATE_BACKEND,
                                                   "image_types": sorted(IMAGE_MEDIA_TYPES) + ["multipart/form-data"]}}

    return app
