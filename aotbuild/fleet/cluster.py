"""What the build matrix (`fleet.matrix`) and serving (`serving`) share about Ray: joining or starting
a cluster, the resources a GPU kind is asked for by, and the settings a worker needs from the
driver's environment. Ray is the optional extra `aotbuild[ray]`; nothing here imports it at load."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from ..errors import AotbuildError
from ..spec.private_apis import ray_started_head

# What a worker on another node needs from the driver's environment to reach the same Hub.
FORWARDED_ENV = ("HF_ENDPOINT", "HF_TOKEN", "HF_HUB_DISABLE_XET", "HF_HUB_OFFLINE")


def require_ray() -> Any:
    """The `ray` module, or an error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise AotbuildError("this needs Ray, which is not installed", hint="pip install 'ray[serve]>=2.40'") from None
    return ray


# Ray's notice at each start that token authentication is on (its default, nothing to act on).
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def ray_log_level() -> str:
    """The level of Ray's own lines in aotbuild's commands: WARNING, or Ray's RAY_LOGGER_LEVEL where
    set (`--debug` sets it to INFO). Ray's INFO lines (its start-up, Serve's controller and proxy,
    a line per replica and per request) say nothing a user acts on."""
    return os.environ.get("RAY_LOGGER_LEVEL", "warning").upper()


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[bool]:
    """Use the Ray this process already joined, else join `address` (RAY_ADDRESS, or the cluster
    last started on this machine), else start a local Ray; yields whether this call started a new
    cluster (which it stops at the end; one it joined it only leaves)."""
    ray = require_ray()
    if ray.is_initialized():
        yield False
        return
    level = ray_log_level()
    if level not in ("INFO", "DEBUG"):
        logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
        logging.getLogger("ray.serve").setLevel(level)  # the driver's own Serve lines
    try:  # a cluster joined keeps its own dashboard
        ray.init(address=address, include_dashboard=False, logging_level=level)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        where = address or os.environ.get("RAY_ADDRESS") or "a local Ray"
        raise AotbuildError(f"cannot start or join {where}: {str(exc).strip().splitlines()[0]}",
                            hint="give --address HOST:PORT of a running cluster (ray start --head prints it)") from None
    # ray.init starts a head node here only when it found no cluster to join.
    started = ray_started_head()
    try:
        yield started
    finally:
        ray.shutdown()


def forwarded_env() -> dict[str, str]:
    """The driver's Hub settings, for a Ray runtime_env (workers elsewhere do not share its environment)."""
    return {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}


def accelerator_resource(gpu_name: str) -> str:
    """The resource Ray gives each node with GPUs of this kind (detected on NVIDIA nodes, or
    declared with `ray start --resources`)."""
    return f"accelerator_type:{gpu_name}"


def missing_resources(needs: dict[str, float]) -> str | None:
    """What the cluster lacks for one task needing `needs` (Ray resource name -> amount) on a
    single node, in words; None when some node has it all now."""
    ray = require_ray()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if any(all(node.get(k, 0) >= v for k, v in needs.items()) for node in nodes):
        return None
    gpu_kind = next((k.partition(":")[2] for k in needs if k.startswith("accelerator_type:")), None)
    if gpu_kind and not any(accelerator_resource(gpu_kind) in node for node in nodes):
        kinds = sorted({k.partition(":")[2] for node in nodes for k in node if k.startswith("accelerator_type:")})
        return (f"no node of this Ray cluster has a GPU of kind {gpu_kind} "
                f"(resource {accelerator_resource(gpu_kind)}); GPU kinds here: {', '.join(kinds) or 'none'}")
    asked = ", ".join(f"{v:g} {k}" for k, v in needs.items())
    return f"no single node of this Ray cluster has {asked}"
