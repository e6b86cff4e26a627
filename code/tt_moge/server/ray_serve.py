"""The server on Ray Serve: replicas of the same app (routes, limits, API key, answers) on as many devices and
machines as a Ray cluster has, started from Python or from `tt-moge serve --ray`.

    from ray import serve
    from tt_moge.server.ray_serve import ray_app
    serve.run(ray_app("Ruicheng/moge-2-vitl-normal", replicas=2, device="cpu"))   # or a Serve config file:
    #   applications: [{name: moge, import_path: tt_moge.server.ray_serve:app_from_config, args: {replicas: 2}}]

Two deployments:

* `MoGeReplica`, `replicas` of them (or "auto": 1 to `max_replicas`, scaled on ongoing requests): each an actor
  that loads its own `MoGeModel` (synchronously: Serve sends it requests only once the model is loaded and warm)
  and answers each request through `create_app`'s app, run in process, so its routes, `Serving` limits (queue,
  memory budget, API key) and arrays are those of `tt-moge serve` on that device. A replica asks Ray for its
  device as a resource: `num_gpus=1` for CUDA (Ray sets CUDA_VISIBLE_DEVICES; it opens "cuda"), `TTNPU: 1` for a
  Tenstorrent chip (Ray sets TT_VISIBLE_DEVICES; it opens "tt:0"), `num_cpus=threads` for the CPU (its torch
  threads).
* `MoGeIngress`, the HTTP entry: it receives a request's body within the server's limits (`read_body`: size,
  read timeout, rate floor, a memory budget of its own for bodies in transit) and hands the request to a replica
  through a DeploymentHandle (Serve's router: the less busy of two replicas). A replica that dies with the
  request (its process killed, its node lost) does not lose it: the request is sent once more, to another
  replica, and when that fails too it is answered 503 `device_failed` with Retry-After. Every route of ours is a
  pure function of its request, so running one twice is safe. (Without this hop Serve's proxy answers 500 for the
  requests in flight on a dead replica: 5 of 40 in the first test.)

What Serve's own HTTP proxy does instead of ours: connection limits, idle and send timeouts and the JSON answers
of `server/protocol.py` are the proxy's (Serve's defaults); answers are not streamed from the replica (each is
at most what the replica's memory budget admits). No web page: its results live in one replica's store, which
another replica would not find. No `@serve.batch`: a replica's `Serving` runs its requests' host stages (decode,
solve, finish) on host threads around its device's one-canvas forward, which is the overlap `predict_many` gives
a batch; a batch would add its wait to each request's latency and nothing to the device's rate.
"""

import logging  # no `from __future__ import annotations`: FastAPI reads the route's annotations as objects
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..batch.session import chip_request
from .settings import ServerSettings

__all__ = ["ray_app", "app_from_config", "replica_resources", "replica_device", "forward_request"]

log = logging.getLogger("tt_moge.server")

_METHODS = ["GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS"]
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}  # set again by each hop


def replica_resources(device: str, threads: int) -> dict:
    """The Ray actor options of one replica on `device` ("cpu", "cuda", "tt"): what it asks the cluster for."""
    kind = device.split(":")[0]
    if kind == "cuda":
        return {"num_gpus": 1, "num_cpus": 1}
    if kind == "tt":
        return {**chip_request(device)[1], "num_cpus": 1}
    if kind == "cpu":
        return {"num_cpus": threads}
    raise ValueError(f"device must be 'cpu', 'cuda' or 'tt' for a Ray Serve replica, got {device!r}")


def replica_device(device: str) -> str:
    """What a replica opens: the one GPU or chip Ray made visible to it, or the CPU."""
    kind = device.split(":")[0]
    return "cuda" if kind == "cuda" else chip_request(device)[0] if kind == "tt" else "cpu"


async def forward_request(app: Any, request: dict) -> dict:
    """Run one request (`method`, `path`, `query`, `headers`, `body`, `client`) through the ASGI `app` in this
    process -> {"status", "headers", "body"}."""
    import httpx

    transport = httpx.ASGITransport(app=app, client=tuple(request["client"]))
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        response = await client.request(
            request["method"],
            request["path"],
            params=request["query"],
            headers=request["headers"],
            content=request["body"],
        )
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _HOP_HEADERS]
    return {"status": response.status_code, "headers": headers, "body": response.content}


def _deployments(serve: Any) -> tuple:
    """The two deployment classes (defined here so that importing this module needs no Ray)."""

    @serve.deployment(name="MoGeReplica")
    class MoGeReplica:
        """One model on one device, answering requests through the server's app."""

        def __init__(self, args: tuple, load: dict, settings: dict, threads: int):
            import torch

            from ..model import MoGeModel
            from .app import create_app

            if load.get("device", "cpu") == "cpu":
                torch.set_num_threads(threads)
            self.model = MoGeModel.from_pretrained(*args, **load)
            self.app = create_app(self.model, ServerSettings(**settings))

        async def __call__(self, request: dict) -> dict:
            return await forward_request(self.app, request)

        def __del__(self) -> None:
            model = getattr(self, "model", None)
            if model is not None:
                self.app.serving.close()
                model.close()

    ingress_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @serve.deployment(name="MoGeIngress")
    @serve.ingress(ingress_app)
    class MoGeIngress:
        """The HTTP entry: receive within the limits, hand to a replica, once more to another if it died."""

        def __init__(self, replica: Any, settings: dict):
            from .admission import MemoryBudget

            self.replica = replica
            self.settings = ServerSettings(**settings)
            self.budget = MemoryBudget(self.settings.memory_budget_bytes)

        @ingress_app.api_route("/{path:path}", methods=_METHODS)
        async def handle(self, path: str, request: Request) -> Response:
            import ray.exceptions

            from .errors import ApiError
            from .upload import read_body

            reservation = self.budget.reservation()

            def reserve(nbytes: int) -> None:
                if not reservation.grow(nbytes):
                    raise ApiError(503, "memory_full", "bodies in transit fill the memory budget; retry later")

            try:
                try:
                    body = await read_body(request, self.settings, reserve) if request.method != "GET" else b""
                except ApiError as exc:
                    return JSONResponse({"code": exc.code, "detail": exc.detail}, exc.status, exc.headers)
                forwarded = {
                    "method": request.method,
                    "path": "/" + path,
                    "query": list(request.query_params.multi_items()),
                    "headers": [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS],
                    "body": body,
                    "client": (request.client.host, request.client.port) if request.client else ("0.0.0.0", 0),
                }
                lost = None
                for _ in range(2):  # a replica that died with the request: once more, on another one
                    try:
                        answer = await self.replica.remote(forwarded)
                        return Response(answer["body"], answer["status"], dict(answer["headers"]))
                    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                        lost = exc
                        log.warning("a replica was lost with a request (%s); sending it again", type(exc).__name__)
                retry = {"Retry-After": str(self.settings.retry_after_s)}
                detail = f"the replicas that took this request were lost ({type(lost).__name__}); retry"
                return JSONResponse({"code": "device_failed", "detail": detail}, 503, retry)
            finally:
                reservation.release()

    return MoGeReplica, MoGeIngress


def ray_app(
    *args: Any,
    replicas: Union[int, str] = 1,
    max_replicas: Optional[int] = None,
    settings: Optional[ServerSettings] = None,
    threads: int = 1,
    runtime_env: Optional[dict] = None,
    **load_options: Any,
) -> Any:
    """A Ray Serve application: `replicas` (a count, or "auto": 1 to `max_replicas`, scaled on ongoing requests)
    replicas of the model, each on its own device (`device` in `load_options`: "cpu", "cuda" or "tt"; default
    "cpu"; the other options are `MoGeModel.from_pretrained`'s), behind one HTTP entry (see the module
    docstring). `threads`: torch threads (and Ray CPUs) of a CPU replica. `settings`: each replica's
    ServerSettings (its queue, memory budget, API key...), also the entry's body limits. `runtime_env`: the Ray
    runtime environment of both deployments' actors. For `serve.run(...)`."""
    from ray import serve

    settings = settings or ServerSettings()
    device = str(load_options.pop("device", None) or "cpu").lower()
    resources = replica_resources(device, threads)
    extra = {"runtime_env": runtime_env} if runtime_env else {}
    load = {**load_options, "device": replica_device(device)}
    fields = {name: getattr(settings, name) for name in settings.__dataclass_fields__}
    replica_class, ingress_class = _deployments(serve)
    if replicas == "auto":
        top = max_replicas or 2
        scaling = {"min_replicas": 1, "max_replicas": top, "target_ongoing_requests": max(1, settings.queue_size // 2)}
        replica_class = replica_class.options(autoscaling_config=scaling)
    elif isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 1:
        replica_class = replica_class.options(num_replicas=replicas)
    else:
        raise ValueError(f"replicas must be a count >= 1 or 'auto', got {replicas!r}")
    replica = replica_class.options(
        ray_actor_options={**resources, **extra},
        max_ongoing_requests=settings.queue_size,  # the replica's own queue refuses beyond it (503 queue_full)
        health_check_period_s=2,
    ).bind(tuple(args), load, fields, threads)
    return ingress_class.options(num_replicas=1, ray_actor_options={"num_cpus": 0, **extra}).bind(replica, fields)


def app_from_config(args: dict) -> Any:
    """The entry of a Serve config file (`import_path: tt_moge.server.ray_serve:app_from_config`): `args` are
    ray_app's keywords, `weights` the first argument, `settings` a dict of ServerSettings fields."""
    args = dict(args)
    settings = ServerSettings(**args.pop("settings", {}))
    weights = args.pop("weights", None)
    return ray_app(*(() if weights is None else (weights,)), settings=settings, **args)
