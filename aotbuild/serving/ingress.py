"""The HTTP front (`Ingress`): exact routes, the body read within its limit (JSON or multipart),
a request routed to a replica holding its checkpoint and LoRA (Serve's model multiplexing), and
the answer in this server's or OpenAI's shape.

No `from __future__ import annotations` here: FastAPI reads the routes' annotations (`Request`)
as objects."""

import asyncio
import base64
import copy
import functools
import json
import logging
import time
import uuid
from typing import Any

from ..errors import ReplicaLostError, RequestError
from .openai_api import openai_request
from .replica import route_id
from .schema import (
    HEALTH_ROUTE,
    MAX_BODY_BYTES,
    NUMBER_FIELDS,
    OPENAI_EDITS_ROUTE,
    OPENAI_ROUTE,
    ROUTES,
    read_json,
    scrubbed,
)

_log = logging.getLogger(__name__)


def _below_prefix(scope: dict[str, Any]) -> str:
    """A request's path below the application's route prefix (Ray Serve mounts it at `root_path`)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _route(request: Any) -> str:
    """The request's route, its key in ROUTES: "" for POST /, "/health"."""
    return _below_prefix(request.scope).rstrip("/")


class Ingress:
    """The HTTP front: reads and checks the body, routes a request naming a LoRA to a replica that
    holds it, and answers. Its replica computes nothing; the `ImageServer` replicas do. Deployed as
    `serve.ingress()(Ingress)`: Ray Serve asks each replica for its FastAPI app
    (`__serve_build_asgi_app__`), `http_api(self)`:

        POST /                        this server's JSON request -> PNG (MP4) or JSON
        POST /v1/images/generations   OpenAI's images request -> {"created", "data": [{"b64_json"}]}
        POST /v1/images/edits         OpenAI's edits request -> {"created", "data": [{"b64_json"}]}
        GET  /health                  200 when a replica is ready (details: `health_details`), 503 when it fails
        GET  /docs                    the OpenAPI page: every route, its request's fields, tried from a browser
    Any other path is a 404, another method a 405.
    """

    def __init__(self, model: Any, loras: tuple[str, ...] = (), checkpoints: tuple[str, ...] = ()) -> None:
        self.model, self.served = model, (frozenset(checkpoints), frozenset(loras))
        self._seconds = _request_metric()
        self.api = http_api(self)

    def __serve_build_asgi_app__(self) -> Any:
        return self.api

    def refused(self, status: int, error: str, request_id: str, openai: bool, replica: str = "-") -> Any:
        """A refusal or failure as JSON: OpenAI's error shape on its routes (its clients read it),
        this server's elsewhere; never a machine path."""
        from starlette.responses import JSONResponse

        ids = {"x-aotbuild-replica": replica, "x-aotbuild-request": request_id}
        if openai:
            kind = "invalid_request_error" if status < 500 else "server_error"
            body = {"error": {"message": scrubbed(error), "type": kind, "param": None, "code": None}}
        else:
            body = {"error": scrubbed(error), "replica": replica, "request": request_id}
        return JSONResponse(body, status_code=status, headers=ids)

    async def health(self) -> Any:
        from starlette.responses import JSONResponse

        request_id = uuid.uuid4().hex[:16]
        try:
            health = await self._remote("health")
        except Exception:
            _log.exception("request %s: health check failed", request_id)
            return self.refused(503, "the replica failed its health check", request_id, False)
        return JSONResponse(health, headers={"x-aotbuild-replica": health["replica"], "x-aotbuild-request": request_id})

    async def make(self, request: Any, route: str) -> Any:
        """A request to make images at `route` ("" or one of OpenAI's), answered."""
        from starlette.responses import JSONResponse, Response

        request_id = uuid.uuid4().hex[:16]
        openai = route in (OPENAI_ROUTE, OPENAI_EDITS_ROUTE)
        start = time.perf_counter()
        try:
            raw = await _limited_body(request)
            multipart = request.headers.get("content-type", "").startswith("multipart/form-data")
            body = await _form(request, raw) if multipart else read_json(raw)
            if openai:  # an edit's mask is decoded: in a worker thread, off the event loop
                body, names = await asyncio.to_thread(openai_request, body, edits=route == OPENAI_EDITS_ROUTE)
            else:
                names = {}
            # A checkpoint or adapter the server was not started with is refused by the replica, unrouted.
            named = [body.get(field) if isinstance(body, dict) else None for field in ("weights", "lora")]
            known = all(n is None or isinstance(n, str) and n in served for n, served in zip(named, self.served,
                                                                                              strict=True))
            made = await self._remote("generate", body, request_id, names,
                                      route=(route_id(*named) if known else None) or "")
        except RequestError as exc:
            return self.refused(exc.status, exc.message, request_id, openai)
        except ReplicaLostError as exc:
            return self.refused(503, f"{exc.message}; request {request_id}", request_id, openai)
        except Exception:
            _log.exception("request %s failed", request_id)
            return self.refused(500, f"the server failed to make this image; request {request_id}", request_id,
                                openai)
        if "error" in made:
            return self.refused(made["status"], made["error"], request_id, openai, made["replica"])
        self._seconds.observe(time.perf_counter() - start)
        headers = {"x-aotbuild-replica": made["replica"], "x-aotbuild-request": request_id,
                   "x-aotbuild-seconds": f"{made['seconds']:.4f}", "x-aotbuild-batch": str(made["batch"])}
        encoded = [base64.b64encode(m).decode() for m in made["media"]] if made["kind"] == "json" else None
        if openai:
            return JSONResponse({"created": int(time.time()), "data": [{"b64_json": e} for e in encoded]},
                                headers=headers)
        if encoded is None:
            return Response(made["media"][0], media_type=f"{'video' if made['videos'] else 'image'}/{made['kind']}",
                            headers=headers)
        return JSONResponse({"videos" if made["videos"] else "images": encoded, "replica": made["replica"],
                             "request": request_id, "seconds": made["seconds"]}, headers=headers)

    async def _remote(self, method: str, *args: Any, route: str = "") -> Any:
        """The model deployment's `method`, routed to a replica holding `route` (`route_id`); a
        replica lost mid-request (stopped, crashed, killed) is retried once on another, then reported."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import ReplicaUnavailableError

        handle = self.model.options(multiplexed_model_id=route) if route else self.model
        for attempt in range(2):
            try:
                return await getattr(handle, method).remote(*args)
            except (RayActorError, ReplicaUnavailableError) as exc:
                _log.warning("a replica was lost during a request (%s); %s", type(exc).__name__,
                             "retrying" if not attempt else "giving up")
        raise ReplicaLostError("the replica making this request stopped before it answered, and so did the one it was "
                          "retried on")


def http_api(front: Ingress) -> Any:
    """The FastAPI app of an `Ingress`: exact routes, each documented (GET /docs, /openapi.json)
    with its request's model; a path or method the server does not answer, said with what it
    does. Bodies are read here, not by FastAPI: within MAX_BODY_BYTES, as JSON without NaN or
    Infinity, or as a multipart form."""
    from fastapi import FastAPI
    from starlette.exceptions import HTTPException

    from ..spec.manifest import aotbuild_version

    api = FastAPI(title="aotbuild", version=aotbuild_version(), redoc_url=None,
                  description="Images (videos) from an ahead-of-time compiled diffusers pipeline.")
    api.state.front = front  # the routes find it here: FastAPI caches what it learns of each endpoint, for good
    for path, method, endpoint, options in _routes():
        api.add_api_route(path, endpoint, methods=[method], **options)
    api.add_middleware(_TrailingSlash)
    api.add_exception_handler(HTTPException, _unrouted)
    return api


@functools.cache
def _routes() -> list[tuple[str, str, Any, dict[str, Any]]]:
    """Every route's (path, method, endpoint, FastAPI options); the endpoints are made once per
    process and reach their `Ingress` through the app (`request.app.state.front`)."""
    from fastapi import Request

    from .models import ImageRequest, OpenAIImageRequest

    async def generate(request: Request) -> Any:
        return await request.app.state.front.make(request, "")

    async def openai_generations(request: Request) -> Any:
        return await request.app.state.front.make(request, OPENAI_ROUTE)

    async def openai_edits(request: Request) -> Any:
        return await request.app.state.front.make(request, OPENAI_EDITS_ROUTE)

    async def health(request: Request) -> Any:
        return await request.app.state.front.health()

    made = {200: {"description": "the image (PNG), the video (MP4), or JSON with base64 ones",
                  "content": {"image/png": {}, "video/mp4": {}, "application/json": {}}}}
    return [("/", "POST", generate, {"summary": "Make images (videos)", "responses": made,
                                     "openapi_extra": _body(ImageRequest, files=True)}),
            (OPENAI_ROUTE, "POST", openai_generations, {"summary": "OpenAI's images request",
                                                        "openapi_extra": _body(OpenAIImageRequest)}),
            (OPENAI_EDITS_ROUTE, "POST", openai_edits, {"summary": "OpenAI's edits request (an image, and a mask)",
                                                        "openapi_extra": _body(OpenAIImageRequest, files=True)}),
            (HEALTH_ROUTE, "GET", health,
             {"summary": "200 once a replica's compiled models are loaded; 503 when it fails"})]


async def _unrouted(request: Any, exc: Any) -> Any:
    """FastAPI's router's 404 and 405, in this server's words."""
    front, path, request_id = request.app.state.front, _route(request), uuid.uuid4().hex[:16]
    if exc.status_code == 405:
        return front.refused(405, f"{request.method} {path or '/'}: this route takes {ROUTES[path]}", request_id,
                             path in (OPENAI_ROUTE, OPENAI_EDITS_ROUTE))
    routes = ", ".join(f"{method} {route or '/'}" for route, method in ROUTES.items())
    return front.refused(exc.status_code, f"no such route: {request.method} {path or '/'}; this server answers "
                                          f"{routes}, GET /docs", request_id, False)


class _TrailingSlash:
    """A route with or without its trailing slash is the route (`POST /prefix` is the prefix's `/`;
    `GET /health/` is `/health`): a client POSTing to the URL it was given is answered, never
    redirected (urllib does not follow a POST's redirect)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path, route = scope["path"], _below_prefix(scope)
            exact = "/" + route.strip("/")
            if exact != route:
                scope = {**scope, "path": path[:len(path) - len(route)] + exact}
                scope.pop("raw_path", None)  # the path as sent: no longer this one
        await self.app(scope, receive, send)


def _body(model: Any, files: bool = False) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its own: `model` as JSON, and with `files`
    also as a multipart form whose pictures are files."""
    from .models import PICTURE

    schema = model.model_json_schema()
    content = {"application/json": {"schema": schema}}
    if files:
        fields = copy.deepcopy(schema)
        for name in ("image", "mask", "ip_adapter_image"):
            fields["properties"][name] = {"type": "string", "format": "binary", "description": PICTURE}
        content["multipart/form-data"] = {"schema": fields}
    return {"requestBody": {"required": True, "content": content}}


def _request_metric() -> Any:
    from ray.serve import metrics

    return metrics.Histogram("aotbuild_request_seconds", "an HTTP request that made images, received to answered",
                             boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300])


async def _form(request: Any, raw: bytes) -> dict[str, Any]:
    """A multipart/form-data body (`raw`, read within its limit) as a request: files (UploadFile)
    as their bytes, pictures; the fields in NUMBER_FIELDS as numbers, the others as text.

    Raises:
        RequestError: 400, saying what is wrong with the form.
    """
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException
    from starlette.requests import Request

    async def replay() -> dict[str, Any]:  # the body again, as read
        return {"type": "http.request", "body": raw, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=3, max_fields=32, max_part_size=MAX_BODY_BYTES)
    except (MultiPartException, AssertionError) as exc:  # the parser's words for a malformed form
        raise RequestError(400, f"the multipart body cannot be read: {exc}") from None
    except ImportError:
        raise RequestError(415, "this server takes JSON bodies (multipart needs python-multipart installed)") from None
    body: dict[str, Any] = {}
    for name, value in form.multi_items():
        if name in body:
            raise RequestError(400, f"field {name!r} is given twice")
        if isinstance(value, UploadFile):
            body[name] = await value.read()
        elif name in NUMBER_FIELDS:
            try:
                body[name] = json.loads(value)
            except ValueError:
                raise RequestError(400, f"field {name!r} must be a number, got {value!r}") from None
        else:
            body[name] = value
    return body


async def _limited_body(request: Any) -> bytes:
    """The request's body, refused (413) past MAX_BODY_BYTES before more of it is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(413, f"the body has {declared} bytes; this server takes {MAX_BODY_BYTES} at most")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(413, f"the body has more than {MAX_BODY_BYTES} bytes; this server takes "
                                    f"{MAX_BODY_BYTES} at most")
    return bytes(body)
