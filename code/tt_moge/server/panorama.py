"""POST /predict/panorama and /predict/panorama/summary: an equirectangular photo in; the whole sphere's
distance, points and mask (npz) or its summary (JSON) out.

    curl --data-binary @pano.jpg -H 'Content-Type: image/jpeg' http://127.0.0.1:8000/predict/panorama -o pano.npz

The body, its checks and limits are those of POST /predict (PNG or JPEG, raw or multipart; --max-body-mb,
--max-pixels; `exif`). An image that is not twice as wide as high gets 422 `not_a_panorama` before it is
admitted, and one that could never fit the memory budget 413 `panorama_too_large`. The work is
`tt_moge.panorama.predict_panorama` on the server's model with the query's `apply_mask`, the same as
`model.predict_panorama(<the same bytes>, apply_mask=...)`: 12 perspective views of 512x512 through the model
(`--resolution 512x512` fits them best, docs/panorama.md), merged into one distance map. A panorama takes one
queue slot and is counted in the memory budget for its own pixels and its views'
(`ServerSettings.panorama_cost`). The npz holds `panorama.predict.PANORAMA_NPZ_LAYOUT`; the summary is
`PanoramaOutput.summary()` plus timing_ms.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import Response

from ..host import InputError
from ..host.decode import decode_bytes
from ..npzio import npz_parts
from ..panorama.geometry import check_panorama_size
from ..panorama.predict import PANORAMA_NPZ_LAYOUT, predict_panorama
from .errors import ApiError
from .serving import (
    COMPRESS_QUERY,
    NPZ_MEDIA_TYPE,
    Prediction,
    Serving,
    check_query,
    deflate_query,
    json_response,
    npz_response,
    timing_headers,
)
from .upload import EXIF_QUERY, exif_query, receive_image

__all__ = ["PANORAMA_QUERY", "apply_mask_query", "predict_pano", "add_panorama_routes"]

PANORAMA_QUERY = ("apply_mask", EXIF_QUERY)  # the query parameters of both routes (the npz one adds compress)


def apply_mask_query(
    apply_mask: bool = Query(
        True, description="set the distance and points of invalid pixels to inf (false: the fitted values everywhere)"
    ),
) -> bool:
    """A FastAPI dependency: the `apply_mask` query parameter of the panorama routes (the page's too)."""
    return apply_mask


async def predict_pano(
    serving: Serving, request: Request, apply_mask: bool, exif: bool, encode: Callable[..., Any]
) -> Prediction:
    """Receive, check and admit a panorama, run `predict_panorama` on a host thread and `encode(output, upload,
    rgb)` there (rgb: the decoded image)."""
    settings, model = serving.settings, serving.model

    def cost(upload: Any) -> int:
        width, height = upload.size
        try:
            check_panorama_size(width, height, "image")
        except InputError as exc:
            raise ApiError(422, "not_a_panorama", str(exc)) from None
        need = settings.panorama_cost(width * height, len(upload.data))
        if need > settings.memory_budget_bytes:  # it could never be admitted: not a 503 to retry
            raise ApiError(
                413,
                "panorama_too_large",
                f"the panorama ({width}x{height} and its views) needs {need / 2**20:.0f} MiB; the server's memory "
                f"budget is {settings.memory_budget_bytes / 2**20:.0f} MiB (--memory-budget-mb): send a smaller one",
            )
        return need

    def job(upload: Any, timing: dict, _: Any) -> Any:
        t = time.perf_counter()
        try:
            rgb = decode_bytes(upload.data, exif=upload.exif)
        except Exception as exc:  # untrusted bytes the decoder choked on: the image is bad, not the server
            raise ApiError(400, "bad_image", f"could not decode the {upload.format} data ({exc})") from None
        timing["decode"] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        try:
            out = predict_panorama(model, rgb, apply_mask=apply_mask)
        except InputError as exc:  # turned by its EXIF orientation, it is no longer 2:1
            raise ApiError(422, "not_a_panorama", str(exc)) from None
        except RuntimeError as exc:
            if "no view of the panorama" not in str(exc):
                raise
            raise ApiError(422, "no_valid_view", str(exc)) from None
        timing["panorama"] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        payload = encode(out, upload, rgb)
        timing["encode"] = (time.perf_counter() - t) * 1e3
        return payload

    return await serving.serve(lambda reserve: receive_image(request, settings, reserve, exif), cost, job)


def add_panorama_routes(app: FastAPI, serving: Serving, responses: dict, body: dict) -> None:
    """POST /predict/panorama (npz) and /predict/panorama/summary (JSON) on `app` (see the module docstring);
    `body` is POST /predict's request body for the OpenAPI schema."""
    layout = ", ".join(f"{k} {dt} {shape}" for k, (dt, shape) in PANORAMA_NPZ_LAYOUT.items())

    @app.post(
        "/predict/panorama",
        dependencies=[Depends(serving.authorize)],
        openapi_extra=body,
        response_class=Response,
        summary="Predict a panorama: an equirectangular image in, npz of the whole sphere's distance, points, mask out",
        responses={
            200: npz_response(f"The panorama's npz: {layout} (distance in metres from the viewpoint)"),
            **responses,
        },
    )
    async def predict_panorama_npz(
        request: Request,
        apply_mask: bool = Depends(apply_mask_query),
        deflate: bool = Depends(deflate_query),
        exif: bool = Depends(exif_query),
    ) -> Response:
        check_query(request, (*PANORAMA_QUERY, COMPRESS_QUERY))
        done = await predict_pano(
            serving, request, apply_mask, exif, lambda out, *_: npz_parts(out.npz_arrays(), compress=deflate)
        )
        return serving.answer(done.payload, NPZ_MEDIA_TYPE, timing_headers(done.timing), done.ticket)

    @app.post(
        "/predict/panorama/summary",
        dependencies=[Depends(serving.authorize)],
        openapi_extra=body,
        response_class=Response,
        summary="Predict a panorama: an equirectangular image in, its summary out (no maps)",
        responses={
            200: json_response(
                "PanoramaOutput.summary(): size, valid fraction, median distance, the views that failed, the "
                "merge's solve, seconds, timing_ms"
            ),
            **responses,
        },
    )
    async def predict_panorama_summary(
        request: Request, apply_mask: bool = Depends(apply_mask_query), exif: bool = Depends(exif_query)
    ) -> Response:
        check_query(request, PANORAMA_QUERY)
        done = await predict_pano(serving, request, apply_mask, exif, lambda out, *_: out.summary())
        return serving.answer_json({**done.payload, "timing_ms": done.timing}, done.timing, done.ticket)
