"""A load bench for a running `aotbuild serve` (or any server taking its requests): K clients
each sending M requests, one at a time, over loopback, with optional faults injected mid-load.
It reports what an operator checks before a rollout: latency percentiles, throughput, lost
requests (no answer within the timeout), 5xx answers, and each replica's memory before and after.
"""

from __future__ import annotations

import functools
import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..errors import AotbuildError
from .stats import percentile

LOAD_FIGURES = {
    "p50_s": "request latency, median", "p95_s": "95th percentile", "p99_s": "99th percentile",
    "throughput_rps": "answered requests per second, first sent to last answered",
    "lost": "requests with no answer within the timeout (or a broken connection)",
    "server_errors": "5xx answers", "statuses": "answers by HTTP status",
}


def run_load(url: str, bodies: list[dict[str, Any]], *, clients: int, requests: int, timeout: float = 300,
             during: Callable[[int], None] | None = None,
             check: Callable[[dict[str, Any], int, dict[str, str], bytes], None] | None = None) -> dict[str, Any]:
    """`clients` threads each POST `requests` bodies (taken round-robin from `bodies`) to `url`, one
    after another. `during(answered)` is called after each answer (a fault injected mid-load:
    kill a replica once N have been answered; it may be called from several clients at once, and
    what it raises is reported in `fault_errors`); `check(body, status, headers, content)` may
    raise for a wrong answer (it is counted in `wrong`). Returns the figures of `LOAD_FIGURES`,
    each answer's (status, replica) and the latencies.

    Raises:
        AotbuildError: bad arguments.
    """
    from ..serving.client import request

    if clients < 1 or requests < 1 or not bodies:
        raise AotbuildError("a load needs at least 1 client, 1 request each and 1 body")
    lock = threading.Lock()
    answers: list[dict[str, Any]] = []
    wrong: list[str] = []
    faults: list[str] = []

    def client(index: int) -> None:
        for n in range(requests):
            body = bodies[(index * requests + n) % len(bodies)]
            start = time.perf_counter()
            try:
                status, headers, content = request(url, body, timeout=timeout)
            except OSError as exc:  # no answer: a timeout or a broken connection
                status, headers, content = None, {}, str(exc).encode()
            seconds = time.perf_counter() - start
            problem = None
            if status == 200 and check is not None:
                try:
                    check(body, status, headers, content)
                except AssertionError as exc:
                    problem = str(exc) or "wrong answer"
            with lock:
                answers.append({"status": status, "seconds": seconds, "end": time.perf_counter(),
                                "replica": headers.get("x-aotbuild-replica"),
                                "batch": int(headers.get("x-aotbuild-batch", 0) or 0),
                                "error": None if status == 200 else _error_text(content)})
                if problem:
                    wrong.append(problem)
                answered = len(answers)
            if during is not None:
                try:
                    during(answered)
                except Exception as exc:  # a fault that could not be injected is reported, the load goes on
                    with lock:
                        faults.append(f"{type(exc).__name__}: {exc}")

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ok = [a for a in answers if a["status"] == 200]
    latencies = [a["seconds"] for a in ok]
    last = max((a["end"] for a in ok), default=began)
    statuses = Counter(str(a["status"]) for a in answers)
    return {"clients": clients, "requests": clients * requests, "answered_ok": len(ok),
            "p50_s": statistics.median(latencies) if latencies else None,
            "p95_s": percentile(latencies, 95) if latencies else None,
            "p99_s": percentile(latencies, 99) if latencies else None,
            "throughput_rps": len(ok) / (last - began) if ok else 0.0,
            "lost": statuses.get("None", 0), "server_errors": sum(1 for a in answers if (a["status"] or 0) >= 500),
            "statuses": dict(statuses), "wrong": wrong, "largest_batch": max((a["batch"] for a in ok), default=0),
            "replicas": sorted({a["replica"] for a in ok if a["replica"]}),
            "errors": sorted({a["error"] for a in answers if a["error"]}), "fault_errors": faults}


def _error_text(content: bytes) -> str:
    """An error answer's message (this server's or OpenAI's JSON shape), else its start."""
    try:
        error = json.loads(content)["error"]
        return error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return content[:200].decode(errors="replace")


SERVE_LOAD_NAME = "serve-load.json"


def bench_load(target_path: str, artifacts_dir: Any, *, clients: int = 4, requests: int = 4, steps: int = 2,
               max_batch: int = 4, port: int = 8000, cpus: float = 1,
               loras: dict[str, tuple[str, float]] | None = None, timeout: float = 600,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The target's artifact on one local Ray Serve replica under `clients` x `requests`, phase by
    phase, on loopback:

    - `unbatched`: every request made alone (max_batch 1);
    - `batched`: the same load, requests of one shape made together (up to `max_batch`);
    - `adapters` (with `loras`): requests cycling over no adapter and each LoRA with one slot
      fewer than LoRAs (at least 1), so adapters are unloaded and loaded again; each answer is
      checked against its adapter's image made alone, within 1 level of 255 (a batch runs
      another compiled variant);
    - `replica_killed`: the batched load with the replica killed (SIGKILL) after a third of the
      answers: each request is retried on the replica Serve starts instead, or answered 503.

    Each phase records `run_load`'s figures and the replica's memory before and after. Writes
    serve-load.json into the artifact folder.

    Raises:
        AotbuildError: no artifact, or a phase whose warm-up request failed.
    """
    import os
    import signal
    from pathlib import Path

    from ray import serve

    from ..builder.targets import load_target
    from ..fleet.cluster import ray_session
    from ..generation.backends import call_defaults
    from ..runtime.artifacts import built_artifact
    from ..serving.application import app, deploy
    from ..serving.client import request
    from ..spec.manifest import environment
    from .report import write_document

    say = progress or (lambda message: None)
    target = load_target(target_path)
    folder = built_artifact(target.name, Path(artifacts_dir).resolve())
    defaults = call_defaults(target.to_dict())
    body = {"prompt": "a photo of a red fox in the snow", "steps": steps, "height": defaults["height"],
            "width": defaults["width"], "images": 1}
    bodies = [{**body, "seed": seed, "prompt": f"{body['prompt']}, take {seed}"} for seed in range(max(clients, 1))]
    url = f"http://127.0.0.1:{port}/load"
    phases: dict[str, Any] = {}

    def health() -> dict[str, Any]:
        status, _, content = request(url + "/health")
        if status != 200:
            raise AotbuildError(f"serve load bench: /health answered {status}: {content[:300]!r}")
        return json.loads(content)

    def phase(name: str, sent: list[dict[str, Any]], **load: Any) -> None:
        say(f"{name}: {clients} clients x {requests} requests")
        before = health()
        figures = run_load(url, sent, clients=clients, requests=requests, timeout=timeout, **load)
        after = health()
        phases[name] = {**figures, "rss_before_mib": before["rss_mib"], "rss_after_mib": after["rss_mib"],
                        "served": after["served"]}

    killing = threading.Lock()  # clients answered together must not both kill (the second would find no replica)

    def kill_once(killed: list[int], after: int, answered: int) -> None:
        """The replica killed (SIGKILL: a crash, no shutdown) once `after` requests were answered."""
        with killing:
            if answered >= max(1, after) and not killed:
                killed.append(health()["pid"])
                os.kill(killed[0], signal.SIGKILL)

    with ray_session(None):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for batch in (1, max_batch):
            adapters = dict(loras or {}) if batch > 1 else {}
            slots = max(1, len(adapters) - 1)
            say(f"deploying with max_batch {batch}" + (f", {len(adapters)} LoRAs in {slots} slot(s)" if adapters
                                                        else ""))
            deploy(app(str(folder), cpus=cpus, max_batch=batch, loras=adapters or None, lora_slots=slots,
                       health_details=True),
                   "load", "/load")
            try:
                status, _, content = request(url, bodies[0], timeout=timeout)  # warm-up
                if status != 200:
                    raise AotbuildError(f"serve load bench: the warm-up request answered {status}: "
                                        f"{content[:300]!r}")
                phase("batched" if batch > 1 else "unbatched", bodies)
                if batch == 1:
                    continue
                if adapters:
                    churn = [{**body, "seed": 0, **({"lora": name} if name else {})} for name in (None, *adapters)]
                    reference = {b.get("lora"): request(url, {**b, "output": "json"}, timeout=timeout)[2]
                                 for b in churn}
                    phase("adapters", churn, check=_same_image_as(reference))
                killed: list[int] = []
                phase("replica_killed", bodies, during=functools.partial(kill_once, killed, clients * requests // 3))
                phases["replica_killed"]["killed_pid"] = killed[0] if killed else None
            finally:
                serve.delete("load")
    meta = {"target": target.name, "clients": clients, "requests_per_client": requests, "steps": steps,
            "max_batch": max_batch, "loras": sorted(loras or {}), "call": body,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    document = {"meta": meta, "environment": environment(target.device), "figures": LOAD_FIGURES, "phases": phases}
    write_document(folder / SERVE_LOAD_NAME, document)
    return document


def _same_image_as(reference: dict[str | None, bytes]) -> Callable[..., None]:
    """A `run_load` check: the answer's image within 1 level of 255 of its adapter's reference
    (a JSON answer's base64 PNG, or a PNG body)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    def pixels(content: bytes) -> Any:
        if content[:1] == b"{":
            content = base64.b64decode(json.loads(content)["images"][0])
        return np.asarray(Image.open(io.BytesIO(content)).convert("RGB"), dtype=np.int16)

    expected = {name: pixels(content) for name, content in reference.items()}

    def check(body: dict[str, Any], status: int, headers: dict[str, str], content: bytes) -> None:
        difference = int(np.abs(pixels(content) - expected[body.get("lora")]).max())
        assert difference <= 1, f"lora {body.get('lora')}: {difference} levels from its image made alone"

    return check


