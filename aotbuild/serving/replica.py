"""One replica (`ImageServer`): the pipeline loaded once, in its constructor; requests checked,
batched by call shape, made one pipeline call at a time, and encoded; its health and metrics."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..errors import AotbuildError, RequestError
from ..generation.media import mp4_bytes, png_bytes, video_fps
from .schema import MAX_IMAGES, MAX_STEPS, covered, parse_request, scrubbed
from .slots import LORA_SLOTS, WEIGHTS_SLOTS, AdapterSlots

MAX_BATCH = 4  # requests made together at most

BATCH_WAIT_S = 0.01  # how long a request waits for others to batch with (an image takes far longer)

# What requests share to run as one batch (each asking one image; prompts and seeds may differ).
BATCHED_BY = ("height", "width", "steps", "guidance_scale", "negative_prompt", "frames", "weights", "lora",
              "lora_scale")

_log = logging.getLogger(__name__)


class ImageServer:
    """One replica: the pipeline loaded once, in the constructor; requests made one call at a time,
    those arriving together with the same call shape as one batch. Called through `Ingress`.

    Args:
        artifact: an artifact folder or `hf://org/name[@revision]` (the aot backend).
        target: instead, a target file run the `backend` way ("eager" or "compile", for comparison).
        loras: the adapters requests may name, {name: (source, weight)}; `lora_slots` of them
            loaded at once, per checkpoint.
        checkpoints: other checkpoints of the artifact's architecture requests may name, {name:
            source}; `weights_slots` of them loaded at once beside the artifact's own weights.
        max_batch: requests run together at most; `batch_wait_s`: how long the first waits for others.
    """

    def __init__(self, artifact: str | None = None, *, target: str | None = None, backend: str = "aot",
                 artifacts_dir: str = "artifacts", max_steps: int = MAX_STEPS, max_images: int = MAX_IMAGES,
                 trust_remote_code: bool = False, variant: str | None = None,
                 loras: dict[str, tuple[str, float]] | None = None, lora_slots: int = LORA_SLOTS,
                 checkpoints: dict[str, str] | None = None, weights_slots: int = WEIGHTS_SLOTS,
                 max_batch: int = MAX_BATCH, batch_wait_s: float = BATCH_WAIT_S, dtype: str | None = None,
                 health_details: bool = False) -> None:
        from ray import serve

        from ..generation.backends import call_defaults, prepare, prepare_artifact
        from ..runtime.sources import random_init_seconds

        start = time.perf_counter()
        if artifact is not None:
            self.pipe, recorded = prepare_artifact(artifact, trust_remote_code=trust_remote_code, variant=variant,
                                                   dtype=dtype)
        else:
            from ..builder.targets import load_target

            loaded = load_target(target)
            self.pipe, recorded = prepare(loaded, backend, Path(artifacts_dir)), loaded.to_dict()
        self.random_init_s = random_init_seconds()
        self.load_s = time.perf_counter() - start - self.random_init_s
        self.recorded = recorded
        self.defaults = call_defaults(recorded)
        self.limits = {"max_steps": max_steps, "max_images": max_images}
        if checkpoints and artifact is None:
            raise AotbuildError("--weights serves other checkpoints through the artifact (the aot backend)")
        self.counts = {"requests": 0, "images": 0, "batches": 0, "largest_batch": 0, "adapter_loads": 0,
                       "adapter_unloads": 0, "adapter_switches": 0, "checkpoint_loads": 0, "checkpoint_unloads": 0}
        self._loras, self._lora_slots = dict(loras or {}), lora_slots
        self.lora_weights = {name: weight for name, (_, weight) in self._loras.items()}
        # The pipelines by checkpoint (None: the artifact's own weights, always held), each with its
        # adapters; other checkpoints are loaded when asked, `weights_slots` at most, least recently
        # used unloaded first.
        self._checkpoints, self._weights_slots = dict(checkpoints or {}), weights_slots
        self._reload = {"artifact": artifact, "trust_remote_code": trust_remote_code, "variant": variant,
                        "dtype": dtype}
        self._pipes: OrderedDict[str | None, AdapterSlots] = OrderedDict(
            {None: AdapterSlots(self.pipe, self._loras, lora_slots, self.counts)})
        import torch

        # The thread count is part of the result: reductions split by threads round differently.
        # The artifact by its Hub name or its folder's name: no machine path in a response.
        shown = artifact if artifact is None or artifact.startswith("hf://") else Path(artifact).name
        self.about = {"artifact": shown, "target": recorded["name"], "backend": backend,
                      "pipeline": type(self.pipe).__name__, "defaults": self.defaults, **self.limits,
                      "threads": torch.get_num_threads(), "loras": sorted(self.lora_weights), "lora_slots": lora_slots,
                      "checkpoints": sorted(self._checkpoints), "weights_slots": weights_slots,
                      "max_batch": max_batch}
        self.health_details = health_details
        self.queued = 0
        self._lock = threading.Lock()  # the pipeline: one call or adapter change at a time
        self._metrics = _replica_metrics()
        # Ray Serve keeps the checkpoint and adapter pairs each replica was asked for and routes a
        # request naming one to a replica that has it; `_pipes` and `AdapterSlots` hold the weights.
        self._routed = serve.multiplexed(max_num_models_per_replica=(weights_slots + 1) * (lora_slots + 1))(_route_id)
        # Requests for one adapter arriving within batch_wait_s run together (Serve splits batches
        # by adapter); `_made` groups them further by call shape.
        self._batched = serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=batch_wait_s)(self._made)

    def check_health(self) -> None:
        """Ray Serve's health check, and GET /health's: a small computation on the pipeline's
        device, so a replica whose device failed is seen as failed."""
        import torch

        device = self.pipe.device
        if torch.ones(16, device=device).sum().item() != 16:
            raise RuntimeError(f"the replica's {device} computes wrong results")

    def health(self) -> dict[str, Any]:
        """What GET /health answers: that the replica is ready (and which replica answered); with
        `health_details`, also what it serves, its process, memory, load times and counts (for the
        operator's monitoring: not what any caller of a public port should learn). Raises when the
        health check fails."""
        from ..runtime.memory import rss_mib

        self.check_health()
        answer = {"status": "ready", "replica": _replica_id()}
        if not self.health_details:
            return answer
        return {**answer, "pid": os.getpid(), "load_s": self.load_s, "random_init_s": self.random_init_s,
                **self.about, "rss_mib": round(rss_mib(), 1),
                "served": {**self.counts, "queued": self.queued,
                           "adapters_loaded": list(self._pipes[None].loaded),
                           "checkpoints_loaded": {name: list(slots.loaded) for name, slots in self._pipes.items()
                                                  if name is not None}}}

    async def generate(self, body: Any, request_id: str, names: dict[str, str] | None = None) -> dict[str, Any]:
        """One request: checked, made (batched with others), encoded. Returns {"media": [bytes...],
        "kind", "seconds", "batch", "replica"}, or {"status", "error", "replica"} for a request
        refused or failed (a failure's details go to the log under `request_id`)."""
        replica = _replica_id()
        try:
            # In a worker thread: decoding a request's pictures would hold up the event loop.
            call = await asyncio.to_thread(parse_request, body, self.defaults, adapters=self.lora_weights,
                                           checkpoints=tuple(self._checkpoints), names=names or {}, **self.limits)
            if reason := covered(self.pipe, self.recorded, call, self.defaults["text"]):
                raise RequestError(422, reason)
            if (route := route_id(call.get("weights"), call["lora"])) is not None:
                await self._routed(route)
            self.queued += 1
            self._metrics["queued"].set(self.queued)
            made = await self._batched(call)
        except RequestError as exc:
            return {"status": exc.status, "error": exc.message, "replica": replica}
        if "error" in made:
            if made["status"] == 500:
                _log.error("request %s failed:\n%s", request_id, made.pop("traceback"))
                made["error"] = f"the server failed to make this image; request {request_id}"
            return {**made, "replica": replica}
        media = await asyncio.to_thread(self._encoded, call, made["images"])
        kind = ("mp4" if call["frames"] else "png") if call["output"] != "json" else "json"
        return {"media": media, "kind": kind, "videos": call["frames"] is not None, "seconds": made["seconds"],
                "batch": made["batch"], "replica": replica}

    async def _made(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A batch's calls made in a worker thread (the event loop goes on taking requests)."""
        self.queued -= len(calls)
        self._metrics["queued"].set(self.queued)
        return await asyncio.to_thread(self._generate, calls)

    def _generate(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each call's images, or its error; calls of one shape (`BATCHED_BY`) asking one image each,
        from no image (nor an image prompt), are made as one pipeline call, each with its prompt and seed."""
        groups: dict[Any, list[int]] = {}
        for i, call in enumerate(calls):
            batched = call["images"] == 1 and call["image"] is None and call["ip_adapter_image"] is None
            key = tuple(call[k] for k in BATCHED_BY) if batched else ("alone", i)
            groups.setdefault(key, []).append(i)
        for key, members in list(groups.items()):  # a batch no compiled variant covers runs one by one
            if len(members) > 1 and covered(self.pipe, self.recorded, {**calls[members[0]], "images": len(members)},
                                               self.defaults["text"]):
                del groups[key]
                groups.update({("alone", i): [i] for i in members})
        results: list[dict[str, Any]] = [{} for _ in calls]
        with self._lock:
            for members in groups.values():
                group = [calls[i] for i in members]
                made = self._generate_group(group)
                for n, i in enumerate(members):
                    results[i] = dict(made) if "error" in made else {
                        "images": made["images"][n * group[0]["images"]:(n + 1) * group[0]["images"]],
                        "seconds": made["seconds"], "batch": len(group)}
        return results

    def _generate_group(self, group: list[dict[str, Any]]) -> dict[str, Any]:
        from ..generation.backends import generate

        first = group[0]
        switches, loads = self.counts["adapter_switches"], self.counts["adapter_loads"]
        try:
            adapters = self._pipeline(first["weights"])
            adapters.activate(first["lora"], first["lora_scale"])
            several = len(group) > 1
            result = generate(adapters.pipe, [c["prompt"] for c in group] if several else first["prompt"],
                              steps=first["steps"], seed=[c["seed"] for c in group] if several else first["seed"],
                              height=first["height"], width=first["width"], batch=first["images"],
                              guidance_scale=first["guidance_scale"], negative_prompt=first["negative_prompt"],
                              frames=first["frames"], text=self.defaults["text"], image=first["image"],
                              mask=first["mask"], strength=first["strength"],
                              image_prompt=first["ip_adapter_image"], built_with=self.defaults.get("call"))
        except AotbuildError as exc:  # a call aotbuild or the pipeline's own checks refuse, in their words
            hint = f" ({exc.hint})" if exc.hint else ""
            return {"status": 422, "error": scrubbed(f"{exc.message}{hint}")}
        except Exception:  # a failure: the replica keeps serving, the client gets the request id, the log the rest
            import traceback

            return {"status": 500, "error": "failed", "traceback": traceback.format_exc()}
        finally:
            for metric, before, now in (("switches", switches, self.counts["adapter_switches"]),
                                        ("loads", loads, self.counts["adapter_loads"])):
                if now > before:  # a Ray counter takes increments > 0 only
                    self._metrics[metric].inc(now - before)
        self.counts["requests"] += len(group)
        self.counts["images"] += len(result.images)
        self.counts["batches"] += 1
        self.counts["largest_batch"] = max(self.counts["largest_batch"], len(group))
        self._metrics["batch"].observe(len(group))
        self._metrics["seconds"].observe(result.total_s)
        return {"images": result.images, "seconds": result.total_s}

    def _pipeline(self, name: str | None) -> AdapterSlots:
        """The pipeline running checkpoint `name` (None: the artifact's own weights), with its
        adapters; loaded now when it is not held, unloading the least recently used other one
        first. The caller holds the pipeline lock."""
        if name in self._pipes:
            self._pipes.move_to_end(name)
            return self._pipes[name]
        from ..generation.backends import prepare_artifact

        others = [held for held in self._pipes if held is not None]
        if len(others) >= self._weights_slots:
            del self._pipes[others[0]]  # its weights go with its last reference
            gc.collect()
            self.counts["checkpoint_unloads"] += 1
        try:
            pipe, _ = prepare_artifact(weights=self._checkpoints[name], **self._reload)
        except AotbuildError as exc:
            raise AotbuildError(f"checkpoint {name!r} could not be loaded: {exc.message}") from None
        self.counts["checkpoint_loads"] += 1
        self._pipes[name] = AdapterSlots(pipe, self._loras, self._lora_slots, self.counts)
        return self._pipes[name]

    def _encoded(self, call: dict[str, Any], made: list[Any]) -> list[bytes]:
        """PNGs of the images, or MP4s of the videos (lists of frames)."""
        if call["frames"] is None:
            return [png_bytes(image) for image in made]
        return [mp4_bytes(frames, video_fps(type(self.pipe))) for frames in made]


def route_id(weights: str | None, lora: str | None) -> str | None:
    """The id Ray Serve routes a request by (its multiplexed model id): the checkpoint and the
    adapter it names, None for the artifact's own weights alone."""
    return None if weights is None and lora is None else f"{weights or ''}+{lora or ''}"


async def _route_id(route: str) -> str:
    """What Ray Serve's routing holds per replica: the id (the weights are in `_pipes`)."""
    return route


def _replica_metrics() -> dict[str, Any]:
    """The replica's figures in Ray Serve's metrics (exported with Ray's, tagged by deployment and replica)."""
    from ray.serve import metrics

    return {"seconds": metrics.Histogram("aotbuild_generate_seconds", "a pipeline call, image(s) made",
                                         boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120]),
            "batch": metrics.Histogram("aotbuild_batch_requests", "requests made together in one pipeline call",
                                       boundaries=[1, 2, 3, 4, 6, 8, 12, 16]),
            "queued": metrics.Gauge("aotbuild_queued_requests", "requests waiting for the pipeline"),
            "loads": metrics.Counter("aotbuild_adapter_loads", "LoRAs loaded into a slot"),
            "switches": metrics.Counter("aotbuild_adapter_switches", "changes of the active LoRA or its weight")}


def _replica_id() -> str:
    """The Serve replica's id ("local" when the server is called outside a replica, as tests do)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # ray missing, or Serve's own error for no replica context
        return "local"
