"""`Serving`: the model's PredictionService behind HTTP, one per app: the host threads, admission (queue slots
and the memory budget), the API key, and the streamed answers. The API's routes (`app.py`) and the web page
(`ui.py`) call the same object, so a page request gets the same limits, errors and arrays as POST /predict.

A prediction goes: receive + check the upload (event loop, no queue slot; its bytes counted against the memory
budget as they arrive) -> admission (at most `queue_size` requests at once and within the memory budget, each
counted by its pixels, else 503 + Retry-After) -> a host thread runs the PredictionService (decode, canvas,
device forward under its lock, solve, finish) and encodes the answer -> the answer is streamed to the client
(`sending.StreamedAnswer`). The request keeps its queue slot and its memory until the answer has been sent, or
the client is gone or cut for not reading (`send_timeout_s`).

Also here: the query parameters of the call options (`call_options_query`, one per field of `host.CallOptions`,
written out; their descriptions and limits from the definitions, `option_query`; tests/test_one_definition.py
checks them against the fields), and, generated from the definitions, the response records `Timing` (the
stages, `service.STAGES` inside) and `Summary` (the fields of `MoGeOutput.summary`, `output.SUMMARY_FIELDS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, Awaitable, Callable, Literal, Optional, Union
from urllib.parse import unquote_to_bytes

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ConfigDict, Field, create_model

from ..fields import OptionInfo, options_of
from ..host import CallOptions, InputError
from ..model import MoGeModel
from ..pool import ModelPool
from ..service import STAGES, PredictionService
from .admission import MemoryBudget, Reservation, Ticket
from .errors import ApiError
from .sending import StreamedAnswer
from .settings import ServerSettings
from .upload import ImageUpload, receive_image

__all__ = [
    "Serving",
    "Prediction",
    "call_options_query",
    "option_query",
    "query_type",
    "options_of_query",
    "check_query",
    "summary_model",
    "CALL_OPTION_NAMES",
    "Timing",
    "TIMING_STAGES",
    "TIMING_HEADER",
    "NPZ_MEDIA_TYPE",
    "timing_headers",
    "client_is_loopback",
    "COMPRESS_QUERY",
    "deflate_query",
    "npz_response",
    "json_response",
]

log = logging.getLogger("tt_moge.server")

NPZ_MEDIA_TYPE = "application/x-npz"
TIMING_HEADER = "X-Timing-Ms"  # the timing_ms record of an npz response, as a JSON object
# Stages of timing_ms, in ms, in the order a request passes them: {stage: what it times}. `device` is the
# forward only; the PredictionService's own stages are in the middle.
TIMING_STAGES = {
    "read": "receiving and checking the upload",
    "queue": "admitted, waiting for a host thread",
    **STAGES,
    "post": "solve + finish",
    "encode": "npz or JSON",
    "total": "the whole request",
}
CALL_OPTION_NAMES = tuple(info.argument for info in options_of(CallOptions))

Timing = create_model(
    "Timing",
    __doc__="Stage times of one request in milliseconds.",
    **{stage: (float, Field(description=what)) for stage, what in TIMING_STAGES.items()},
)
_BINARY = {"type": "string", "format": "binary"}
_BEARER = HTTPBearer(auto_error=False, description="Needed only when the server runs with an API key")


def client_is_loopback(request: Request) -> bool:
    """The client runs on this machine: bytes cost almost nothing to move, so deflating only adds time."""
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


COMPRESS_QUERY = "compress"  # the npz routes' query parameter (deflate_query)


def deflate_query(
    request: Request,
    compress: Literal["auto", "true", "false"] = Query(
        "auto",
        description=(
            "Deflate the maps inside the npz with ISA-L: smaller, and slower to make (docs/performance.md, "
            "Server). auto: deflate unless the client is on this machine (loopback)"
        ),
    ),
) -> bool:
    """A FastAPI dependency: the `compress` query parameter of the npz routes -> whether to deflate the npz."""
    return compress == "true" or (compress == "auto" and not client_is_loopback(request))


def npz_response(description: str, **extra: Any) -> dict:
    """The OpenAPI 200 response of a route that answers an npz file."""
    return {"description": description, "content": {NPZ_MEDIA_TYPE: {"schema": _BINARY}}, **extra}


def json_response(description: str) -> dict:
    """The OpenAPI 200 response of a route that answers a free-form JSON record."""
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


def timing_headers(timing_ms: dict) -> dict:
    """Server-Timing (shown by browser dev tools) and X-Timing-Ms (the timing_ms record as JSON)."""
    stages = [stage for stage in TIMING_STAGES if stage in timing_ms]
    return {
        "Server-Timing": ", ".join(f"{stage};dur={timing_ms[stage]:.2f}" for stage in stages),
        TIMING_HEADER: json.dumps({stage: round(timing_ms[stage], 3) for stage in stages}),
    }


# ------------------------------------------------------------------------------------ the call options
def query_type(info: OptionInfo) -> Any:
    """The type of an option's query parameter: its choices as a Literal, else its own type where a query string
    says it, else Optional[str] (a structured value, e.g. intrinsics, is sent as its command-line text)."""
    annotation = info.type
    if annotation not in (bool, int, float, str, Optional[int], Optional[float], Optional[str]):
        annotation = Optional[str]
    if info.spec.choices is not None:
        values = tuple(c for c in info.spec.choices if c is not None)
        annotation = Literal[values] if None not in info.spec.choices else Optional[Literal[values]]
    return annotation


def option_query(record: type, name: str) -> Any:
    """The FastAPI `Query` of the option `name` of `record` (the `Annotated` part of its written query parameter):
    its description and limits, from its definition."""
    info = next(i for i in options_of(record) if i.argument == name)
    bounds = info.spec.bounds
    limits = {} if bounds is None else dict(gt=bounds[0], lt=bounds[1], allow_inf_nan=False)
    return Query(description=info.describe(), **limits)


def options_of_query(record: type, given: dict) -> Any:
    """The `record` (CallOptions, video.VideoOptions) of a query dependency's `locals()`; 422 for a bad value."""
    try:
        return record.of_arguments(given)
    except InputError as exc:
        raise ApiError(422, "invalid_option", str(exc)) from None


def call_options_query(
    *,
    fit: Annotated[Literal["pad", "stretch"], option_query(CallOptions, "fit")] = "pad",
    fov_x: Annotated[Optional[float], option_query(CallOptions, "fov_x")] = None,
    apply_mask: Annotated[bool, option_query(CallOptions, "apply_mask")] = True,
    force_projection: Annotated[bool, option_query(CallOptions, "force_projection")] = True,
    intrinsics: Annotated[Optional[str], option_query(CallOptions, "intrinsics")] = None,
) -> CallOptions:
    """A FastAPI dependency with one query parameter per field of `host.CallOptions` -> the CallOptions."""
    return options_of_query(CallOptions, locals())


def check_query(request: Request, allowed: tuple) -> None:
    """422 for a query parameter that is not one of `allowed`, or one given twice: a typo never silently falls
    back to a default."""
    names = list(request.query_params.keys())
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise ApiError(
            422, "invalid_option", f"unknown query parameter(s) {unknown}; expected some of {sorted(allowed)}"
        )
    repeated = sorted({n for n in names if len(request.query_params.getlist(n)) > 1})
    if repeated:
        raise ApiError(422, "invalid_option", f"query parameter(s) {repeated} given more than once")


# ---------------------------------------------------------------------------------------------- serving
@dataclass
class Prediction:
    """What `Serving.predict` gives a route: the encoded payload, its stage times, and the request's ticket
    (hand it to `Serving.answer`, which frees it once the answer is sent)."""

    payload: Any
    timing: dict
    ticket: Ticket


class Serving:
    """The model, its host threads, the admission counter and the memory budget of one app."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.model: Optional[Union[MoGeModel, ModelPool]] = None
        self.owns_model = False
        self.load_error: Optional[str] = None
        self.executor = ThreadPoolExecutor(settings.host_threads, thread_name_prefix="tt_moge-serve")
        self._lock = threading.Lock()
        self.in_flight = 0
        self.budget = MemoryBudget(settings.memory_budget_bytes)
        self.draining = False
        self.responses = {"2xx": 0, "4xx": 0, "503": 0, "5xx": 0}
        self._closing = contextlib.ExitStack()  # what closes after the host threads have ended (the page's store)

    @property
    def service(self) -> Optional[PredictionService]:
        return None if self.model is None else self.model.service

    # ---------------------------------------------------------------------------------------- life
    def load(self, loader: Callable[[], Any], on_error: Optional[Callable[[BaseException], None]]) -> None:
        t = time.perf_counter()
        try:
            model = loader()
            if not isinstance(model, (MoGeModel, ModelPool)):
                raise TypeError(f"the model loader returned {type(model).__name__}, expected a MoGeModel or ModelPool")
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
        if self.model is None:
            return "failed" if self.load_error else "loading"
        return "ok" if self.serves() else "failed"

    def serves(self) -> bool:
        """A model is loaded and can run a call: a pool with at least one replica in service."""
        if isinstance(self.model, ModelPool):
            return bool(self.model.in_service)
        return self.model is not None

    def not_serving(self) -> str:
        """Why `serves()` is False, for /ready and 503s."""
        if self.model is None:
            return f"the model failed to load ({self.load_error})" if self.load_error else "the model is still loading"
        failed = "; ".join(f"{r.device}: {r.out_of_service}" for r in self.model.replicas)
        return f"no replica of the pool is in service ({failed})"

    def drain(self) -> None:
        """Stop admitting (503 shutting_down): the server is stopping; what is admitted finishes."""
        self.draining = True

    def close_after_work(self, close: Callable[[], Any]) -> None:
        """Call `close()` when the app stops, after every host thread has ended (the last one first)."""
        self._closing.callback(close)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        try:
            if self.owns_model and self.model is not None:
                self.model.close()
        finally:
            self._closing.close()

    # ----------------------------------------------------------------------------------- admission
    def _refuse(self, code: str, detail: str, close: bool = False) -> ApiError:
        headers = {"Retry-After": str(self.settings.retry_after_s)}
        if close:
            headers["Connection"] = "close"
        return ApiError(503, code, detail, headers)

    def reserver(self, reservation: Reservation) -> Callable[[int], None]:
        """reserve(n) for receive_image: n more body bytes from the budget, or 503 memory_full."""

        def reserve(nbytes: int) -> None:
            if not reservation.grow(nbytes):
                raise self.memory_full("the body", reservation.nbytes + nbytes)

        return reserve

    def memory_full(self, what: str, needed: int) -> ApiError:
        """503 memory_full (with Retry-After): `what` needs `needed` bytes that the budget cannot give now."""
        mb = 1024 * 1024
        return self._refuse(
            "memory_full",
            f"{what} needs {needed / mb:.1f} MiB of the server's memory budget; requests in progress hold "
            f"{self.budget.used / mb:.1f} of {self.budget.limit / mb:.0f} MiB (--memory-budget-mb); "
            f"retry after {self.settings.retry_after_s} s",
        )

    def admit(self, reservation: Reservation, cost: int) -> Ticket:
        """Take a queue slot and `cost` bytes of the memory budget (the reservation grows to it), or raise 503.
        The ticket frees both once the work has ended and the answer has been sent or abandoned."""
        if self.draining:
            raise self._refuse(
                "shutting_down",
                "the server is stopping and admits no more requests; retry on another instance or after it restarts",
                close=True,
            )
        if not self.serves():
            raise self._refuse("not_ready", f"{self.not_serving()}; see GET /ready")
        with self._lock:
            if self.in_flight >= self.settings.queue_size:
                raise self._refuse(
                    "queue_full",
                    f"{self.in_flight} requests are in progress (--queue-size "
                    f"{self.settings.queue_size}); retry after {self.settings.retry_after_s} s",
                )
            if not reservation.resize(cost):
                raise self.memory_full("this image", cost)
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

    # --------------------------------------------------------------------------------------- auth
    def authorize(self, credentials: Optional[HTTPAuthorizationCredentials] = Depends(_BEARER)) -> None:
        """A route dependency: 401 unless the request carries the API key (when the server has one).

        Compared as bytes, in constant time, with the key's UTF-8 bytes: the header as it arrived (HTTP headers
        are bytes; Starlette hands them over decoded as latin-1, which `encode("latin-1")` undoes exactly), so a
        non-ASCII key sent as UTF-8 (what curl sends, and httpx given bytes) matches; or the header
        percent-decoded (`%C3%A9` -> UTF-8 bytes of "é"): a browser cannot send a header beyond Latin-1 (and
        sends Latin-1 as single bytes), so the web page sends `encodeURIComponent(key)`. Both forms need the key."""
        api_key = self.settings.api_key
        if api_key is None:
            return
        want = api_key.encode("utf-8")
        sent = b"" if credentials is None else credentials.credentials.encode("latin-1")
        as_sent = hmac.compare_digest(sent, want)
        percent_decoded = hmac.compare_digest(unquote_to_bytes(sent), want)
        if credentials is None or credentials.scheme.lower() != "bearer" or not (as_sent or percent_decoded):
            raise ApiError(
                401,
                "unauthorized",
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                {"WWW-Authenticate": "Bearer"},
            )

    # -------------------------------------------------------------------------------------- work
    async def serve(
        self,
        receive: Callable[[Callable[[int], None]], Awaitable[Any]],
        cost: Callable[[Any], int],
        job: Callable[[Any, dict, Reservation], Any],
        discard: Optional[Callable[[Any], None]] = None,
    ) -> Prediction:
        """The one path of every upload route: `receive(reserve)` the body within the memory budget, admit it at
        `cost(upload)` bytes (`cost` may refuse it by raising), then run `job(upload, timing, reservation)` on a
        host thread. The job may grow the reservation as it learns what it really holds (a clip's frames are
        counted as they are decoded, not taken from the file's header). The timing gets read, queue and total
        here; the job adds its own stages. On any error before the work starts the reservation is released;
        `discard(upload)` (an upload held on disk) runs once the work has ended or will never start, whatever
        happened."""
        start = time.perf_counter()
        reservation = self.budget.reservation()
        upload = None
        try:
            upload = await receive(self.reserver(reservation))
            ticket = self.admit(reservation, cost(upload))
        except BaseException:
            reservation.release()
            if upload is not None and discard is not None:
                discard(upload)
            raise
        admitted = time.perf_counter()
        timing: dict = {"read": upload.read_ms}

        def work() -> Any:
            timing["queue"] = (time.perf_counter() - admitted) * 1e3
            return job(upload, timing, reservation)

        after = None if discard is None else lambda: discard(upload)
        payload = await self.on_host(work, ticket, after)
        timing["total"] = (time.perf_counter() - start) * 1e3
        return Prediction(payload, timing, ticket)

    async def predict(
        self, request: Request, options: CallOptions, encode: Callable[[Any, ImageUpload], Any], exif: bool = False
    ) -> Prediction:
        """POST /predict's work: receive the image, admit it, run the PredictionService with `options` (the image
        turned by its EXIF orientation when `exif`) and `encode(output, upload)` on a host thread."""
        settings, service = self.settings, self.service

        def job(upload: ImageUpload, timing: dict, _: Reservation) -> Any:
            try:
                out = service.predict(upload.data, options, timing, exif=upload.exif)
            except InputError as exc:
                raise ApiError(400, "bad_image", str(exc)) from None
            except Exception as exc:
                if "decode" not in timing:  # the decoder choked on untrusted bytes: the image is bad, not the server
                    raise ApiError(
                        400, "bad_image", f"could not decode the {upload.format} data ({type(exc).__name__}: {exc})"
                    ) from None
                raise
            timing["post"] = timing["solve"] + timing["finish"]
            t = time.perf_counter()
            payload = encode(out, upload)
            timing["encode"] = (time.perf_counter() - t) * 1e3
            return payload

        return await self.serve(
            lambda reserve: receive_image(request, settings, reserve, exif),
            lambda upload: settings.request_cost(upload.size[0] * upload.size[1], len(upload.data)),
            job,
        )

    async def on_host(self, work: Callable[[], Any], ticket: Ticket, after: Optional[Callable[[], None]] = None) -> Any:
        """Run `work` on a host thread for an admitted request; its ticket's work part ends with it (even if the
        client left), and its answer part at once if there is nothing to answer. `after()` runs when the work
        has ended, failed or was cancelled before it started."""

        def ended(_: Any = None) -> None:
            try:
                if after is not None:
                    after()
            finally:
                ticket.done("work")

        try:
            future = self.executor.submit(work)
        except BaseException:  # the executor is shut down (the server is stopping)
            ended()
            ticket.done("answer")
            raise
        future.add_done_callback(ended)  # even if the client left or the route was cancelled
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            ticket.done("answer")  # nothing to send
            raise

    async def run_admitted(self, work: Callable[[], Any], cost: int) -> tuple:
        """Admit a request that costs `cost` bytes of the memory budget and run `work` on a host thread ->
        (its result, ticket); the caller answers with `answer(..., ticket)` (the web page's downloads)."""
        reservation = self.budget.reservation()
        try:
            ticket = self.admit(reservation, cost)
        except BaseException:
            reservation.release()
            raise
        return await self.on_host(work, ticket), ticket

    def answer(self, parts: list, media_type: str, headers: dict, ticket: Ticket) -> StreamedAnswer:
        """The streamed 200 answer; from now on the request holds only the answer's bytes of the budget."""
        try:
            response = StreamedAnswer(
                parts, media_type, headers, self.settings.send_timeout_s, on_end=lambda: ticket.done("answer")
            )
            ticket.reservation.resize(min(response.nbytes, ticket.reservation.nbytes))
        except BaseException:
            ticket.done("answer")
            raise
        return response

    def answer_json(self, record: dict, timing: dict, ticket: Ticket) -> StreamedAnswer:
        """A JSON body (encoded here: an encoding error frees the ticket) with the timing headers."""
        from fastapi.responses import JSONResponse

        try:
            body = JSONResponse(record).body
        except BaseException:
            ticket.done("answer")
            raise
        return self.answer([body], "application/json", timing_headers(timing), ticket)


def summary_model(fields: dict) -> type:
    """The pydantic record of /predict/summary from {key: (type, description)} (output.SUMMARY_FIELDS), plus
    timing_ms. Unknown keys are refused (a key the output adds must be declared with it, never dropped)."""
    return create_model(
        "Summary",
        __doc__="A small JSON view of one result (no maps). Non-finite values are null.",
        __config__=ConfigDict(extra="forbid"),
        **{key: (kind, Field(description=what)) for key, (kind, what) in fields.items()},
        timing_ms=(Timing, Field(description="stage times of this request")),
    )
