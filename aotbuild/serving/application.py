"""The Serve application (`app`: an `Ingress` in front of `ImageServer` replicas, fixed or
autoscaled) and `aotbuild serve` (`run_server`: deploy on a Ray cluster joined or started here,
serve until Ctrl-C or SIGTERM; a port another program holds refused before Ray starts)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import AotbuildError
from .client import request
from .ingress import Ingress
from .replica import BATCH_WAIT_S, MAX_BATCH, ImageServer
from .schema import MAX_IMAGES, MAX_STEPS, OPENAI_ROUTE
from .slots import LORA_SLOTS, WEIGHTS_SLOTS, check_checkpoints

APP_NAME = "aotbuild"

UPSCALE_DELAY_S = 5


def app(artifact: str | None = None, *, target: str | None = None, backend: str = "aot",
        artifacts_dir: str | os.PathLike = "artifacts", replicas: int = 1, autoscale: tuple[int, int] | None = None,
        cpus: float = 1, gpus: float = 0, gpu_type: str | None = None, max_steps: int = MAX_STEPS,
        max_images: int = MAX_IMAGES, env: dict[str, str] | None = None, trust_remote_code: bool = False,
        variant: str | None = None, loras: dict[str, tuple[str, float]] | None = None, lora_slots: int = LORA_SLOTS,
        checkpoints: dict[str, str] | None = None, weights_slots: int = WEIGHTS_SLOTS, max_batch: int = MAX_BATCH,
        batch_wait_s: float = BATCH_WAIT_S, dtype: str | None = None, health_details: bool = False) -> Any:
    """The Serve application: an `Ingress` in front of `replicas` `ImageServer`s, or `autoscale`
    (min, max) of them scaled by ongoing requests; each reserving `cpus`, `gpus` (of kind
    `gpu_type`, Ray's accelerator type). `env`: more environment for the replicas (the driver's
    Hub settings are passed on). An `hf://` artifact needs `trust_remote_code` (its native code
    runs in every replica), and its revision is resolved here, once: every replica, the ones
    autoscaling adds later too, loads that commit; `variant` names the target in a repo holding
    several. `loras` ({name: (source, weight)}, `parse_adapters`): the LoRAs requests may name,
    `lora_slots` loaded per replica; `checkpoints` ({name: source}, `parse_checkpoints`): other
    checkpoints of the architecture, `weights_slots` loaded per replica beside the artifact's own.
    `max_batch`, `batch_wait_s`: requests made together. `dtype`: the dtype the artifact computes,
    named (`load_pipeline`'s): checkpoints stored in another are refused without it.
    `health_details`: GET /health also says what each replica serves, its process, memory and
    counts (off: status and replica id only).
    Run it with `ray.serve.run(app(...))`."""
    from ray import serve

    from ..fleet.cluster import forwarded_env, ray_log_level, require_ray
    from ..runtime.openmp import spin_env

    require_ray()
    if artifact is not None and artifact.startswith("hf://"):
        from ..runtime.hub import check_trusted, pinned

        check_trusted(artifact, trust_remote_code)
        artifact = pinned(artifact)
    if min(lora_slots, weights_slots, max_batch) < 1 or batch_wait_s < 0:
        raise AotbuildError(f"lora_slots ({lora_slots}), weights_slots ({weights_slots}) and max_batch ({max_batch}) "
                            f"are at least 1, batch_wait_s ({batch_wait_s}) at least 0")
    if checkpoints and artifact is None:
        raise AotbuildError("--weights serves other checkpoints through an artifact (the aot backend)")
    if checkpoints and not artifact.startswith("hf://"):
        check_checkpoints(Path(artifact), checkpoints, dtype)
    env_vars = {**spin_env(), **forwarded_env(), **(env or {})}
    actor = {"num_cpus": cpus, "num_gpus": gpus, "runtime_env": {"env_vars": env_vars}}
    if gpu_type:
        actor["accelerator_type"] = gpu_type
    # A replica holds the requests it may batch, and a few more queued behind them.
    options: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": max(8, 2 * max_batch),
                               "logging_config": {"log_level": ray_log_level()}}
    if autoscale:
        # An image takes seconds: one request in flight per replica is the load to scale by, and a
        # queue that lasts UPSCALE_DELAY_S is worth a replica (Serve's default waits 30 s).
        options["autoscaling_config"] = {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                         "target_ongoing_requests": 1, "upscale_delay_s": UPSCALE_DELAY_S,
                                         "metrics_interval_s": 1, "look_back_period_s": 5}
    else:
        options["num_replicas"] = replicas
    model = serve.deployment(ImageServer, name="ImageServer", **options).bind(
        artifact, target=target, backend=backend, artifacts_dir=os.fspath(artifacts_dir), max_steps=max_steps,
        max_images=max_images, trust_remote_code=trust_remote_code, variant=variant, loras=loras,
        lora_slots=lora_slots, checkpoints=checkpoints, weights_slots=weights_slots, max_batch=max_batch,
        batch_wait_s=batch_wait_s, dtype=dtype, health_details=health_details)
    # The front computes nothing: it reserves no CPU and takes every request the replicas may queue.
    # Its FastAPI app is built in each replica, over the handle it is given (`Ingress.api`).
    front = serve.deployment(serve.ingress()(Ingress), name="Ingress", ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=1000, logging_config=options["logging_config"])
    return front.bind(model, tuple(loras or ()), tuple(checkpoints or ()))


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

    from ..fleet.cluster import ray_log_level, ray_session

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    with ray_session(address) as started_here:
        # Ctrl-C and SIGTERM stop the server, also where SIGINT came ignored (a background job's); set
        # after Ray starts, whose own SIGTERM handler would print a stack dump and end the process.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, interrupt)
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": ray_log_level()})
        try:
            deploy(app(artifact, **options), APP_NAME, "/")
            listening = _serve_port(port)
            if listening != port:
                echo(f"note: Serve on this cluster already listens on port {listening}; --port applies to the "
                     f"first Serve started on a cluster")
            url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{listening}/"
            echo(f"serving {artifact} at {url} (POST a JSON request, or OpenAI's to {url}{OPENAI_ROUTE[1:]}; "
                 f"GET {url}health); Ctrl-C stops")
            while True:
                signal.pause()
        except KeyboardInterrupt:
            echo("stopping")
        finally:
            # A cluster started here stops with the session (its replicas with it), asking nothing
            # of its processes, which a SIGTERM to the process group (a container stop) also ends.
            if not started_here:
                serve.delete(APP_NAME)
    echo("stopped")


def check_port(host: str, port: int) -> None:
    """Refuse a port another program listens on before Ray starts (seconds of start-up, then a
    traceback from its proxy); Ray Serve's own, on a cluster this command joins, is taken as is."""
    import errno

    if _bind_error(host, port) != errno.EADDRINUSE:
        return  # free, or an address this machine lacks, say: Serve's proxy says so in its own words
    try:
        status, headers, _ = request(f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/-/routes",
                                     timeout=0.5)  # Serve's proxy answers in milliseconds
        if status in (200, 503) and "x-request-id" in headers:
            return  # Serve's proxy (503: no application yet): a cluster serving here, which the deployment joins
    except (OSError, ValueError):
        pass
    free = next((p for p in range(port + 1, min(port + 100, 65536)) if _bind_error(host, p) is None), None)
    raise AotbuildError(f"port {port} on {host} is in use by another program",
                        hint=(f"give --port {free} (free now), or " if free else "give another --port, or ")
                        + f"stop what listens on {port}")


def _bind_error(host: str, port: int) -> int | None:
    """The errno of binding (host, port) as a server would (SO_REUSEADDR, as uvicorn sets it), or None
    where it binds."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno
    return None


def _serve_port(asked: int) -> int:
    """The port Serve listens on: the first `serve.start` on a cluster fixes it for all."""
    from ..spec.private_apis import serve_http_port

    try:
        return serve_http_port()
    except (ImportError, AttributeError, TypeError, ValueError):
        return asked
