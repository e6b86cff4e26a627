"""Every error the server answers is JSON `{"code": ..., "detail": ...}` with a 4xx/5xx status."""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..service import DeviceError

__all__ = ["ApiError", "ErrorBody", "install_error_handlers", "ERROR_RESPONSES"]

log = logging.getLogger("tt_moge.server")


class ErrorBody(BaseModel):
    """The body of every error response."""

    code: str  # machine-readable: bad_image, body_too_large, queue_full, ...
    detail: str  # what was wrong and what is expected, for people


class ApiError(Exception):
    def __init__(self, status: int, code: str, detail: str, headers: Optional[dict] = None):
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers = status, code, detail, headers


def error_response(status: int, code: str, detail: str, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(ErrorBody(code=code, detail=detail).model_dump(), status_code=status, headers=headers)


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "body"))
        parts.append(
            f"{where or 'request'}: {err.get('msg', 'invalid')}"
            + (f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else "")
        )
    return "; ".join(parts) or "invalid request"


_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid_option",
    503: "unavailable",
}

ERROR_RESPONSES = {
    400: {"model": ErrorBody, "description": "Empty body, corrupt or truncated image, missing multipart field"},
    401: {"model": ErrorBody, "description": "Missing or wrong API key (only when one is configured)"},
    408: {"model": ErrorBody, "description": "The body did not arrive in time"},
    413: {"model": ErrorBody, "description": "Body larger than the limit, or more decoded pixels than the limit"},
    415: {"model": ErrorBody, "description": "Content-Type or data that is not PNG or JPEG (or multipart)"},
    422: {"model": ErrorBody, "description": "Bad option value, unknown option, or an image below 8x8"},
    503: {
        "model": ErrorBody,
        "description": "Queue full, memory budget spent, model not loaded yet, the server is stopping, or no "
        "device of the pool could run it: retry after Retry-After seconds",
    },
}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_option", _describe_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            exc.status_code, _STATUS_CODES.get(exc.status_code, "error"), str(exc.detail), getattr(exc, "headers", None)
        )

    @app.exception_handler(DeviceError)
    async def _device_failed(request: Request, exc: DeviceError) -> JSONResponse:  # the device, not the request
        log.error("the device failed %s %s: %s", request.method, request.url.path, exc)
        settings = getattr(getattr(request.app, "serving", None), "settings", None)
        headers = {"Retry-After": str(settings.retry_after_s)} if settings is not None else None
        return error_response(503, "device_failed", f"no device of the server could run this request: {exc}", headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:  # a bug: logged, answered as JSON
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(
            500, "internal_error", f"internal server error ({type(exc).__name__}); see the server log"
        )
