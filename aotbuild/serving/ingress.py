"""The HTTP front (`Ingress`): exact routes, the body read within its limit (JSON or multipart),
a request routed to a replica holding its checkpoint and LoRA (Serve's model multiplexing), and
the answer in this server's or OpenAI's shape."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from typing import Any

from ..errors import AotbuildError
from .openai_api import openai_request
from .replica import route_id
from .schema import (
    HEALTH_ROUTE,
    MAX_BODY_BYTES,
    NUMBER_FIELDS,
    OPENAI_EDITS_ROUTE,
    OPENAI_ROUTE,
    ROUTES,
    RequestError,
    read_json,
    scrubbed,
)

_log = logging.getLogger(__name__)


def _route(request: Any) -> str:
    """The request's path below the application's route prefix (Ray Serve mounts it at
    `root_path`), without a trailing slash: "" for POST /, "/health"."""
    path, root = request.url.path, request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path.rstrip("/")


class Ingress:
    """The HTTP front: reads and checks the body, routes a request naming a LoRA to a replica that
    holds it, and answers. Its replica computes nothing; the `ImageServer` replicas do.

        POST /                        this server's JSON request -> PNG (MP4) or JSON
        POST /v1/images/generations   OpenAI's images request -> {"created", "data": [{"b64_json"}]}
        POST /v1/images/edits         OpenAI's edits request -> {"created", "data": [{"b64_json"}]}
        GET  /health                  200 when a replica is ready (details: `health_details`), 503 when it fails
    Any other path is a 404, another method a 405.
    """

    def __init__(self, model: Any, loras: tuple[str, ...] = (), checkpoints: tuple[str, ...] = ()) -> None:
        self.model, self.served = model, (frozenset(checkpoints), frozenset(loras))
        self._seconds = _request_metric()

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response

        request_id = uuid.uuid4().hex[:16]
        path = _route(request)
        openai = path in (OPENAI_ROUTE, OPENAI_EDITS_ROUTE)
        start = time.perf_counter()

        def answer(status: int, error: str, replica: str = "-") -> Any:
            ids = {"x-aotbuild-replica": replica, "x-aotbuild-request": request_id}
            if openai:  # OpenAI's error shape, which its clients read
                kind = "invalid_request_error" if status < 500 else "server_error"
                body = {"error": {"message": scrubbed(error), "type": kind, "param": None, "code": None}}
            else:
                body = {"error": scrubbed(error), "replica": replica, "request": request_id}
            return JSONResponse(body, status_code=status, headers=ids)

        if path not in ROUTES:
            routes = ", ".join(f"{method} {route or '/'}" for route, method in ROUTES.items())
            return answer(404, f"no such route: {request.method} {path or '/'}; this server answers {routes}")
        if request.method != ROUTES[path]:
            return answer(405, f"{request.method} {path or '/'}: this route takes {ROUTES[path]}")
        if path == HEALTH_ROUTE:
            try:
                health = await self._remote("health")
            except Exception:
                _log.exception("request %s: health check failed", request_id)
                return answer(503, "the replica failed its health check")
            return JSONResponse(health, headers={"x-aotbuild-replica": health["replica"],
                                                 "x-aotbuild-request": request_id})
        try:
            raw = await _limited_body(request)
            multipart = request.headers.get("content-type", "").startswith("multipart/form-data")
            body = await _form(request.headers, raw) if multipart else read_json(raw)
            if openai:  # an edit's mask is decoded: in a worker thread, off the event loop
                body, names = await asyncio.to_thread(openai_request, body, edits=path == OPENAI_EDITS_ROUTE)
            else:
                names = {}
            # A checkpoint or adapter the server was not started with is refused by the replica, unrouted.
            named = [body.get(field) if isinstance(body, dict) else None for field in ("weights", "lora")]
            known = all(n is None or isinstance(n, str) and n in served for n, served in zip(named, self.served,
                                                                                              strict=True))
            made = await self._remote("generate", body, request_id, names,
                                      route=(route_id(*named) if known else None) or "")
        except RequestError as exc:
            return answer(exc.status, exc.message)
        except ReplicaLost as exc:
            return answer(503, f"{exc.message}; request {request_id}")
        except Exception:
            _log.exception("request %s failed", request_id)
            return answer(500, f"the server failed to make this image; request {request_id}")
        if "error" in made:
            return answer(made["status"], made["error"], made["replica"])
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
        raise ReplicaLost("the replica making this request stopped before it answered, and so did the one it was "
                          "retried on")


class ReplicaLost(AotbuildError):
    """A request's replica stopped before it answered, twice."""


def _request_metric() -> Any:
    from ray.serve import metrics

    return metrics.Histogram("aotbuild_request_seconds", "an HTTP request that made images, received to answered",
                             boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300])


async def _form(headers: Any, raw: bytes) -> dict[str, Any]:
    """A multipart/form-data body as a request: files as their bytes (pictures), the fields in
    NUMBER_FIELDS as numbers, the others as text.

    Raises:
        RequestError: 400, saying what is wrong with the form.
    """
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def chunks() -> Any:
        yield raw

    try:
        form = await MultiPartParser(headers, chunks(), max_files=2, max_fields=32,
                                     max_part_size=MAX_BODY_BYTES).parse()
    except (MultiPartException, AssertionError) as exc:  # the parser's words for a malformed form
        raise RequestError(400, f"the multipart body cannot be read: {exc}") from None
    except ImportError:
        raise RequestError(415, "this server takes JSON bodies (multipart needs python-multipart installed)") from None
    body: dict[str, Any] = {}
    for name, value in form.multi_items():
        if name in body:
            raise RequestError(400, f"field {name!r} is given twice")
        if not isinstance(value, str):  # an uploaded file
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
