"""Serving on Ray Serve (the optional extra `aotbuild[ray]`): each replica loads the artifact once,
in its constructor, and serves text-to-image (text-to-video) over HTTP.

    POST /        {"prompt": "...", "steps": 4, "seed": 0, ...}  -> image/png (video/mp4), or JSON with base64 ones
    GET  /health  200 with what the replica serves, once its compiled models are loaded

A bad request (unknown field, wrong type, a size no compiled variant covers, more steps than
allowed) gets a 4xx with a readable message, and the replica goes on serving. `aotbuild serve`
runs it; `app()` gives the Serve application to run yourself. `bench_replicas` measures replica
cold start, deploy to first response, for aot against eager and torch.compile replicas.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import re
import statistics
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from .errors import AotbuildError
from .media import mp4_bytes, png_bytes, video_fps
from .private_apis import serve_http_port

APP_NAME = "aotbuild"
# Each request field and what it means; `images` is num_images_per_prompt.
REQUEST_FIELDS = {
    "prompt": "the text to draw (required)",
    "negative_prompt": "what to steer away from (needs guidance)",
    "steps": "denoising steps",
    "guidance_scale": "classifier-free guidance; 1 turns it off",
    "height": "pixels",
    "width": "pixels",
    "seed": "the generator's seed",
    "images": "images (videos) for the prompt",
    "frames": "a video's frame count (an artifact that makes videos)",
    "output": '"png" (one image, the body is the PNG), "mp4" (one video, the body is the MP4) or "json" (base64 '
              'PNGs or MP4s)',
}
MAX_STEPS = 50
MAX_IMAGES = 4
MAX_BODY_BYTES = 64 * 1024  # a request is a prompt and a few numbers
MAX_PROMPT_CHARS = 4096  # tokenizers read the first 77 to 512 tokens of a prompt
UPSCALE_DELAY_S = 5
SERVE_BENCH_NAME = "serve-bench.json"
SERVE_BENCH_FIGURES = {
    "ready_s": "deploy to replica ready (its constructor done: process, imports, load)",
    "first_response_s": "deploy to the first image received",
    "steady_response_s": "later requests, median",
    "load_s": "the replica's pipeline load",
    "random_init_s": "creating random weights (random: sources), kept out of the timed figures",
}
SERVE_BENCH_RATIOS = ("ready_s", "first_response_s", "steady_response_s")  # the table's ratios to aot
_log = logging.getLogger("aotbuild.serve")


class RequestError(AotbuildError):
    """A request the server refuses; `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_request(body: Any, defaults: dict[str, Any], *, max_steps: int = MAX_STEPS,
                  max_images: int = MAX_IMAGES) -> dict[str, Any]:
    """A request's JSON body checked and completed from `defaults` (`backends.call_defaults`).

    Raises:
        RequestError: 400, naming the field and what it takes.
    """
    if not isinstance(body, dict):
        raise RequestError(400, 'the body must be a JSON object, e.g. {"prompt": "a red fox"}')
    if unknown := sorted(set(body) - set(REQUEST_FIELDS)):
        raise RequestError(400, f"unknown field {unknown[0]!r}; the fields are: {', '.join(REQUEST_FIELDS)}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError(400, "field 'prompt' is required: a non-empty string")
    negative = body.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise RequestError(400, "field 'negative_prompt' must be a string")
    for name, text in (("prompt", prompt), ("negative_prompt", negative or "")):
        if len(text) > MAX_PROMPT_CHARS:
            raise RequestError(400, f"field {name!r} has {len(text)} characters; this server takes {MAX_PROMPT_CHARS} "
                                    f"at most")

    def integer(name: str, low: int, high: int | None = None) -> int:
        value = body.get(name, defaults[name] if name != "images" else 1)  # one image unless asked
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(400, f"field {name!r} must be an integer, got {json.dumps(value)}")
        if value < low or (high is not None and value > high):
            limit = f"{low} to {high}" if high is not None else f"at least {low}"
            raise RequestError(400, f"field {name!r} is {value}; this server takes {limit}")
        return value

    guidance = body.get("guidance_scale", defaults["guidance_scale"])
    if isinstance(guidance, bool) or not isinstance(guidance, int | float) or not 0 <= guidance < math.inf:
        raise RequestError(400, f"field 'guidance_scale' must be a finite number >= 0, got {json.dumps(guidance)}")
    video = defaults.get("frames") is not None
    if "frames" in body and not video:
        raise RequestError(400, "field 'frames': this artifact makes images, not videos")
    single = "mp4" if video else "png"
    output = body.get("output", single)
    if output not in (single, "json"):
        raise RequestError(400, f'field \'output\' is "{single}" or "json", got {json.dumps(output)}')
    request = {"prompt": prompt, "negative_prompt": negative, "steps": integer("steps", 1, max_steps),
               "guidance_scale": float(guidance), "height": integer("height", 1), "width": integer("width", 1),
               "seed": integer("seed", 0, 2**63 - 1), "images": integer("images", 1, max_images),
               "frames": integer("frames", 1) if video else None, "output": output}
    if output == single and request["images"] > 1:
        made = "video" if video else "image"
        raise RequestError(400, f'"output": "{single}" returns one {made}; ask "output": "json" for '
                                f'{request["images"]}')
    return request


def read_json(raw: bytes) -> Any:
    """A request body parsed as JSON; NaN and Infinity, which Python's parser takes, are refused.

    Raises:
        RequestError: 400, saying what is wrong with the body.
    """
    def refuse(constant: str) -> None:
        raise RequestError(400, f"the body holds {constant}: numbers must be finite")

    try:
        return json.loads(raw, parse_constant=refuse)
    except ValueError as exc:
        raise RequestError(400, f"the body is not JSON: {exc}") from None


def covered(pipe: Any, recorded: dict[str, Any], call: dict[str, Any]) -> str | None:
    """Why the pipeline cannot make this call at its size, images and guidance, or None: checked
    before anything is allocated (a 65536 x 65536 request would allocate its latents before the
    compiled model refused it). An artifact's denoiser says what its variants cover; the eager and
    compile backends are held to the largest call the target covers."""
    from .runtime.component import CompiledComponent, variant_coverage, variant_covers

    images, height, width, frames = call["images"], call["height"], call["width"], call.get("frames")
    guided = call["guidance_scale"] > 1
    made = f"{images} image(s)" if frames is None else f"{images} video(s) of {frames} frames"
    denoiser = next((m for m in pipe.components.values() if isinstance(m, CompiledComponent) and m.denoiser), None)
    if denoiser is not None:
        entries = [v.entry for v in denoiser.variants]
        if any(variant_covers(entry, images, height, width, guided, frames=frames) for entry in entries):
            return None
        return (f"no compiled variant makes {made} at {height}x{width} px "
                f"{'with' if guided else 'without'} guidance; this artifact covers: "
                + "; ".join(variant_coverage(entry) for entry in entries))
    # A video's frames count too: pixels over every frame of every video.
    sizes = [(s["height"], s["width"], s["batch"], s.get("frames") or 1) for s in recorded["shapes"]]
    if dynamic := recorded.get("dynamic"):
        sizes.append((*(dynamic[axis][1] for axis in ("height", "width", "batch")), dynamic.get("frames", [1, 1])[1]))
    largest = max(h * w * b * f for h, w, b, f in sizes)
    if height * width * images * (frames or 1) > largest:
        return f"{made} at {height}x{width} px is more than this server makes at once ({largest} pixels)"
    return None


_MACHINE_PATH = re.compile(r"(?<![\w.~-])(?:/[\w.@+-]+){2,}/?")


def scrubbed(text: str) -> str:
    """`text` without machine paths (a client learns nothing of the server's file system)."""
    return _MACHINE_PATH.sub("<path>", text)


class ImageServer:
    """One replica: the pipeline loaded once, in the constructor; requests one at a time.

    Args:
        artifact: an artifact folder or `hf://org/name[@revision]` (the aot backend).
        target: instead, a target file run the `backend` way ("eager" or "compile", for comparison).
    """

    def __init__(self, artifact: str | None = None, *, target: str | None = None, backend: str = "aot",
                 artifacts_dir: str = "artifacts", max_steps: int = MAX_STEPS, max_images: int = MAX_IMAGES,
                 trust_remote_code: bool = False, variant: str | None = None) -> None:
        from .backends import call_defaults, prepare, prepare_artifact
        from .sources import random_init_seconds

        start = time.perf_counter()
        if artifact is not None:
            self.pipe, recorded = prepare_artifact(artifact, trust_remote_code=trust_remote_code, variant=variant)
        else:
            from .targets import load_target

            loaded = load_target(target)
            self.pipe, recorded = prepare(loaded, backend, Path(artifacts_dir)), loaded.to_dict()
        self.random_init_s = random_init_seconds()
        self.load_s = time.perf_counter() - start - self.random_init_s
        self.recorded = recorded
        self.defaults = call_defaults(recorded)
        self.limits = {"max_steps": max_steps, "max_images": max_images}
        import torch

        # The thread count is part of the result: reductions split by threads round differently.
        # The artifact by its Hub name or its folder's name: no machine path in a response.
        shown = artifact if artifact is None or artifact.startswith("hf://") else Path(artifact).name
        self.about = {"artifact": shown, "target": recorded["name"], "backend": backend,
                      "pipeline": type(self.pipe).__name__, "defaults": self.defaults, **self.limits,
                      "threads": torch.get_num_threads()}
        self._lock = asyncio.Lock()  # a pipeline runs one call at a time; /health does not wait for it

    def check_health(self) -> None:
        """Ray Serve's health check, and GET /health's: a small computation on the pipeline's
        device, so a replica whose device failed is seen as failed."""
        import torch

        device = self.pipe.device
        if torch.ones(16, device=device).sum().item() != 16:
            raise RuntimeError(f"the replica's {device} computes wrong results")

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response

        replica, request_id = _replica_id(), uuid.uuid4().hex[:16]
        ids = {"x-aotbuild-replica": replica, "x-aotbuild-request": request_id}

        def answer(status: int, error: str) -> Any:
            return JSONResponse({"error": scrubbed(error), "replica": replica, "request": request_id},
                                status_code=status, headers=ids)

        path = request.url.path.rstrip("/")
        if request.method == "GET" and path.endswith("/health"):
            try:
                self.check_health()
            except Exception:
                _log.exception("request %s: health check failed", request_id)
                return answer(503, "the replica failed its health check")
            return JSONResponse({"status": "ready", "replica": replica, "load_s": self.load_s,
                                 "random_init_s": self.random_init_s, **self.about}, headers=ids)
        if request.method != "POST":
            return answer(405, f"{request.method} {request.url.path}: POST a JSON request to / or GET /health")
        try:
            call = parse_request(read_json(await _limited_body(request)), self.defaults, **self.limits)
            if reason := covered(self.pipe, self.recorded, call):
                raise RequestError(422, reason)
            async with self._lock:
                images, seconds = await asyncio.to_thread(self._generate, call)
        except RequestError as exc:
            return answer(exc.status, exc.message)
        except (AotbuildError, ValueError) as exc:  # diffusers' and aotbuild's words for a call they cannot make
            hint = f" ({exc.hint})" if getattr(exc, "hint", None) else ""
            return answer(422, f"{getattr(exc, 'message', exc)}{hint}")
        except Exception:  # the replica keeps serving; the client gets the request id, the log the rest
            _log.exception("request %s failed", request_id)
            return answer(500, f"the server failed to make this image; request {request_id}")
        headers = {**ids, "x-aotbuild-seconds": f"{seconds:.4f}"}
        encoded = await asyncio.to_thread(self._encoded, call, images)
        if call["output"] != "json":
            return Response(encoded[0], media_type="image/png" if call["output"] == "png" else "video/mp4",
                            headers=headers)
        return JSONResponse({"videos" if call["frames"] else "images": [base64.b64encode(e).decode() for e in encoded],
                             "replica": replica, "request": request_id, "seconds": seconds}, headers=headers)

    def _encoded(self, call: dict[str, Any], made: list[Any]) -> list[bytes]:
        """PNGs of the images, or MP4s of the videos (lists of frames)."""
        if call["frames"] is None:
            return [png_bytes(image) for image in made]
        return [mp4_bytes(frames, video_fps(type(self.pipe))) for frames in made]

    def _generate(self, call: dict[str, Any]) -> tuple[list[Any], float]:
        from .backends import generate

        result = generate(self.pipe, call["prompt"], steps=call["steps"], seed=call["seed"], height=call["height"],
                          width=call["width"], batch=call["images"], guidance_scale=call["guidance_scale"],
                          negative_prompt=call["negative_prompt"], frames=call["frames"], text=self.defaults["text"])
        return result.images, result.total_s


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


def _replica_id() -> str:
    """The Serve replica's id ("local" when the server is called outside a replica, as tests do)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # ray missing, or Serve's own error for no replica context
        return "local"


def app(artifact: str | None = None, *, target: str | None = None, backend: str = "aot",
        artifacts_dir: str | os.PathLike = "artifacts", replicas: int = 1, autoscale: tuple[int, int] | None = None,
        cpus: float = 1, gpus: float = 0, gpu_type: str | None = None, max_steps: int = MAX_STEPS,
        max_images: int = MAX_IMAGES, env: dict[str, str] | None = None, trust_remote_code: bool = False,
        variant: str | None = None) -> Any:
    """The Serve application of `ImageServer`: `replicas` of them, or `autoscale` (min, max)
    scaled by ongoing requests; each reserving `cpus`, `gpus` (of kind `gpu_type`, Ray's
    accelerator type). `env`: more environment for the replicas (the driver's Hub settings are
    passed on). An `hf://` artifact needs `trust_remote_code` (its native code runs in every
    replica), and its revision is resolved here, once: every replica, the ones autoscaling adds
    later too, loads that commit; `variant` names the target in a repo holding several. Run it
    with `ray.serve.run(app(...))`."""
    from ray import serve

    from .cluster import forwarded_env, require_ray
    from .openmp import spin_env

    require_ray()
    if artifact is not None and artifact.startswith("hf://"):
        from .hub import check_trusted, pinned

        check_trusted(artifact, trust_remote_code)
        artifact = pinned(artifact)
    env_vars = {**spin_env(), **forwarded_env(), **(env or {})}
    actor = {"num_cpus": cpus, "num_gpus": gpus, "runtime_env": {"env_vars": env_vars}}
    if gpu_type:
        actor["accelerator_type"] = gpu_type
    options: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": 8}
    if autoscale:
        # An image takes seconds: one request in flight per replica is the load to scale by, and a
        # queue that lasts UPSCALE_DELAY_S is worth a replica (Serve's default waits 30 s).
        options["autoscaling_config"] = {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                         "target_ongoing_requests": 1, "upscale_delay_s": UPSCALE_DELAY_S,
                                         "metrics_interval_s": 1, "look_back_period_s": 5}
    else:
        options["num_replicas"] = replicas
    deployment = serve.deployment(ImageServer, name="ImageServer", **options)
    return deployment.bind(artifact, target=target, backend=backend, artifacts_dir=os.fspath(artifacts_dir),
                           max_steps=max_steps, max_images=max_images, trust_remote_code=trust_remote_code,
                           variant=variant)


def parse_autoscale(text: str) -> tuple[int, int]:
    """`MIN:MAX` replicas."""
    low, sep, high = text.partition(":")
    try:
        bounds = int(low), int(high)
    except ValueError:
        bounds = (-1, -1)
    if not sep or not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
        raise AotbuildError(f"--autoscale {text!r}: give MIN:MAX replicas, 0 <= MIN <= MAX, MAX >= 1")
    return bounds


def deploy(application: Any, name: str, route_prefix: str) -> None:
    """`serve.run`, which returns once every replica is ready; a replica that cannot start
    (its constructor raised) is an AotbuildError with the replica's message."""
    from ray import serve

    try:
        serve.run(application, name=name, route_prefix=route_prefix)
    except RuntimeError as exc:
        detail = next((line.strip() for line in reversed(str(exc).splitlines()) if "Error" in line), str(exc))
        raise AotbuildError(f"the {name} replicas could not start: {detail}") from None


def run_server(artifact: str, *, host: str, port: int, address: str | None, echo: Any, **options: Any) -> None:
    """Deploy on Ray (joined, or started here), print the URL, serve until Ctrl-C or SIGTERM, then
    remove the application (and stop what was started here)."""
    import signal

    from ray import serve

    from .cluster import ray_session

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # Ctrl-C and SIGTERM stop the server, also where SIGINT came ignored (a background job's).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    with ray_session(address) as started_here:
        serve.start(http_options={"host": host, "port": port})
        try:
            deploy(app(artifact, **options), APP_NAME, "/")
            listening = _serve_port(port)
            if listening != port:
                echo(f"note: Serve on this cluster already listens on port {listening}; --port applies to the "
                     f"first Serve started on a cluster")
            url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{listening}/"
            echo(f"serving {artifact} at {url} (POST a JSON request; GET {url}health); Ctrl-C stops")
            while True:
                signal.pause()
        except KeyboardInterrupt:
            echo("stopping")
        finally:
            serve.delete(APP_NAME)
            if started_here:
                serve.shutdown()
    echo("stopped")


def _serve_port(asked: int) -> int:
    """The port Serve listens on: the first `serve.start` on a cluster fixes it for all."""
    try:
        return serve_http_port()
    except (ImportError, AttributeError, TypeError, ValueError):
        return asked


def request(url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of a GET (no body) or JSON POST; HTTP errors
    are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def bench_replicas(target_path: str, artifacts_dir: Path, *, cases: tuple[str, ...] = ("aot", "eager", "compile"),
                   repeats: int = 1, steps: int = 4, steady: int = 2, port: int = 8000, address: str | None = None,
                   cpus: float = 1, progress: Any = None) -> dict[str, Any]:
    """Replica cold start per backend, side by side: each repetition deploys each case afresh (a
    new replica process, an empty inductor cache, the artifact out of the page cache), times
    deploy to ready and to the first image, then `steady` more requests; each replica reserves
    `cpus`. Writes serve-bench.json into the artifact folder.

    Raises:
        AotbuildError: an unknown case, no artifact, or a request that failed.
    """
    from ray import serve

    from .backends import BACKENDS, built_artifact, call_defaults
    from .bench import drop_page_cache, report, write_document
    from .cluster import ray_session
    from .manifest import environment
    from .targets import load_target

    if unknown := [c for c in cases if c not in BACKENDS]:
        raise AotbuildError(f"unknown serve bench case {unknown[0]!r}; known: {', '.join(BACKENDS)}")
    target = load_target(target_path)
    target_path = str(target.base_dir / f"{target.name}.toml")
    artifacts_dir = Path(artifacts_dir).resolve()
    folder = built_artifact(target, artifacts_dir)
    defaults = call_defaults(target.to_dict())
    call = {"prompt": "a photo of a red fox in the snow", "steps": steps, "seed": 0, "height": defaults["height"],
            "width": defaults["width"], "images": defaults["batch"], "output": "json"}
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    with ray_session(address), tempfile.TemporaryDirectory(prefix="aotbuild-serve-bench-") as work:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for rep in range(repeats):
            for case in cases:
                if progress:
                    progress(f"repetition {rep + 1}/{repeats}: {case}")
                if case == "aot":
                    drop_page_cache([p for p in folder.rglob("*") if p.is_file()])
                caches = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-", dir=work)}
                application = app(str(folder) if case == "aot" else None, target=target_path, backend=case,
                                  artifacts_dir=artifacts_dir, cpus=cpus, env=caches)
                name, url = f"bench-{case}", f"http://127.0.0.1:{port}/bench-{case}"
                start = time.perf_counter()
                try:
                    deploy(application, name, f"/bench-{case}")
                    ready = time.perf_counter() - start
                    responses = [_timed_post(url, call) for _ in range(steady + 1)]
                    first = ready + responses[0]
                    health = json.loads(request(url + "/health")[2])
                finally:
                    serve.delete(name)
                random_init = health["random_init_s"]
                runs[case].append({"ready_s": ready - random_init, "first_response_s": first - random_init,
                                   "steady_response_s": statistics.median(responses[1:]) if steady else None,
                                   "load_s": health["load_s"], "random_init_s": random_init})
    meta = {"target": target.name, "steps": steps, "repeats": repeats, "call": call,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    document = report(runs, environment(target.device), meta, SERVE_BENCH_FIGURES)
    write_document(folder / SERVE_BENCH_NAME, document)
    return document


def _timed_post(url: str, call: dict[str, Any]) -> float:
    start = time.perf_counter()
    status, _, body = request(url, call)
    if status != 200:
        raise AotbuildError(f"serve bench: {url} answered {status}: {body[:300].decode(errors='replace')}")
    return time.perf_counter() - start
