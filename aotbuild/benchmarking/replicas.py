"""`aotbuild bench --serve`: replica cold start per backend, deploy to ready and to the first image,
for aot against eager and torch.compile replicas."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import AotbuildError
from ..serving.application import app, deploy
from ..serving.client import request

SERVE_BENCH_NAME = "serve-bench.json"

SERVE_BENCH_FIGURES = {
    "ready_s": "deploy to replica ready (its constructor done: process, imports, load)",
    "first_response_s": "deploy to the first image received",
    "steady_response_s": "later requests, median",
    "load_s": "the replica's pipeline load",
    "random_init_s": "creating random weights (random: sources), kept out of the timed figures",
}

SERVE_BENCH_RATIOS = ("ready_s", "first_response_s", "steady_response_s")  # the table's ratios to aot


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

    from ..builder.targets import load_target
    from ..fleet.cluster import ray_session
    from ..generation.backends import BACKENDS, call_defaults
    from ..runtime.artifacts import built_artifact
    from ..spec.manifest import environment
    from .harness import drop_page_cache
    from .report import report, write_document

    if unknown := [c for c in cases if c not in BACKENDS]:
        raise AotbuildError(f"unknown serve bench case {unknown[0]!r}; known: {', '.join(BACKENDS)}")
    target = load_target(target_path)
    target_path = str(target.base_dir / f"{target.name}.toml")
    artifacts_dir = Path(artifacts_dir).resolve()
    folder = built_artifact(target.name, artifacts_dir)
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
                                  artifacts_dir=artifacts_dir, cpus=cpus, env=caches, health_details=True)
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
