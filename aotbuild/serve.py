"""Serving on Ray Serve (the optional extra `aotbuild[ray]`): an `Ingress` replica takes HTTP and
routes each request to an `ImageServer` replica, which loads the artifact once, in its
constructor, and makes images (videos).

    POST /                        {"prompt": "...", "steps": 4, "seed": 0, "lora": "ink", ...}
                                  -> image/png (video/mp4), or JSON with base64 ones
    POST /v1/images/generations   OpenAI's images request ({"prompt", "n", "size": "WxH"}) -> b64_json
    POST /v1/images/edits         OpenAI's edits request (an image, and a mask) -> b64_json
    GET  /health                  200 once a replica's compiled models are loaded (what it serves,
                                  its process and counts only when started with health_details)

A bad request (unknown field, wrong type, a size no compiled variant covers, more steps than
allowed, a LoRA the server was not started with) gets a 4xx with a readable message, and the
replica goes on serving. Requests naming a LoRA go to a replica that holds it (Serve's model
multiplexing); requests of one call shape arriving together run as one batch, each with its own
seed. `aotbuild serve` runs it; `app()` gives the Serve application to run yourself.
`bench_replicas` measures replica cold start, deploy to first response, for aot against eager and
torch.compile replicas.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import logging
import math
import os
import re
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import AotbuildError
from .media import mp4_bytes, png_bytes, video_fps

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
    "image": "img2img: the picture to start from (base64 PNG/JPEG/WebP, or a multipart file), resized to the size",
    "mask": "inpainting, with image: where to repaint (white) and keep (black), as image is given",
    "strength": "img2img, inpainting: how much of the image to repaint, above 0 and at most 1",
    "lora": "a LoRA the server was started with (--lora NAME=...), by its name",
    "lora_scale": "the LoRA's weight (default: its --lora weight, else 1)",
    "weights": "another checkpoint the server was started with (--weights NAME=...), by its name",
}
OPENAI_ROUTE = "/v1/images/generations"
OPENAI_EDITS_ROUTE = "/v1/images/edits"
HEALTH_ROUTE = "/health"
# Every route the server answers, below its prefix, with its method; any other path is a 404.
ROUTES = {"": "POST", OPENAI_ROUTE: "POST", OPENAI_EDITS_ROUTE: "POST", HEALTH_ROUTE: "GET"}
OPENAI_ONLY = ("n", "size", "response_format", "model", "user")  # OpenAI's fields; the rest are this server's
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,63}")
LORA_SLOTS = 4  # adapters a replica keeps loaded (each is its LoRA matrices: megabytes)
WEIGHTS_SLOTS = 1  # other checkpoints a replica keeps loaded (each is a model's weights: gigabytes)
MAX_BATCH = 4  # requests made together at most
BATCH_WAIT_S = 0.01  # how long a request waits for others to batch with (an image takes far longer)
# What requests share to run as one batch (each asking one image; prompts and seeds may differ).
BATCHED_BY = ("height", "width", "steps", "guidance_scale", "negative_prompt", "frames", "weights", "lora",
              "lora_scale")
UNSET = ("", 0.0)  # an adapter state no request asks for: the pipeline's is unknown
MAX_STEPS = 50
MAX_IMAGES = 4
MAX_BODY_BYTES = 16 * 2**20  # a prompt and a few numbers, or an image and its mask in base64
# Form fields of a multipart request that are numbers (the others are text, and files are pictures).
NUMBER_FIELDS = ("steps", "guidance_scale", "height", "width", "seed", "images", "frames", "strength", "lora_scale",
                 "n")
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
                  max_images: int = MAX_IMAGES, adapters: dict[str, float] | None = None,
                  checkpoints: tuple[str, ...] = (), names: dict[str, str] | None = None) -> dict[str, Any]:
    """A request's JSON body checked and completed from `defaults` (`backends.call_defaults`).
    `adapters`: the LoRAs a request may name, with their default weights; `checkpoints`: the other
    checkpoints it may name. `names`: what a field is called in the request as the client wrote
    it (an OpenAI request's `n` is `images`).

    Raises:
        RequestError: 400, naming the field and what it takes.
    """
    adapters, names = adapters or {}, names or {}
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
        shown = names.get(name, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(400, f"field {shown!r} must be an integer, got {json.dumps(value)}")
        if value < low or (high is not None and value > high):
            limit = f"{low} to {high}" if high is not None else f"at least {low}"
            shared = list(names.values()).count(shown) > 1  # `size` gives height and width
            told = f"{name} {value}" if shared else str(value)
            raise RequestError(400, f"field {shown!r} is {told}; this server takes {limit}")
        return value

    lora, scale = body.get("lora"), body.get("lora_scale")
    if lora is not None and (not isinstance(lora, str) or lora not in adapters):
        served = (f"this server serves: {', '.join(sorted(adapters))}" if adapters else
                  "this server serves no LoRAs (start it with --lora NAME=PATH)")
        raise RequestError(400, f"field 'lora' is {json.dumps(lora)}; {served}")
    weights = body.get("weights")
    if weights is not None and (not isinstance(weights, str) or weights not in checkpoints):
        served = (f"this server serves: {', '.join(sorted(checkpoints))}" if checkpoints else
                  "this server serves its artifact's own weights only (start it with --weights NAME=FOLDER)")
        raise RequestError(400, f"field 'weights' is {json.dumps(weights)}; {served}")
    if scale is not None:
        if lora is None:
            raise RequestError(400, "field 'lora_scale' goes with field 'lora'")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise RequestError(400, f"field 'lora_scale' must be a finite number, got {json.dumps(scale)}")

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
    image, mask = (_picture(body, name, mode) for name, mode in (("image", "RGB"), ("mask", "L")))
    if mask is not None and image is None:
        raise RequestError(400, "field 'mask' goes with field 'image': the picture to inpaint")
    strength = body.get("strength")
    if strength is not None:
        if image is None:
            raise RequestError(400, "field 'strength' goes with field 'image'")
        if isinstance(strength, bool) or not isinstance(strength, int | float) or not 0 < strength <= 1:
            raise RequestError(400, f"field 'strength' must be a number above 0 and at most 1, got "
                                    f"{json.dumps(strength)}")
    if image is not None and video:
        raise RequestError(400, "field 'image': this server makes videos from text only")
    request = {"prompt": prompt, "negative_prompt": negative, "steps": integer("steps", 1, max_steps),
               "guidance_scale": float(guidance), "height": integer("height", 1), "width": integer("width", 1),
               "seed": integer("seed", 0, 2**63 - 1), "images": integer("images", 1, max_images),
               "frames": integer("frames", 1) if video else None, "output": output, "lora": lora,
               "lora_scale": None if lora is None else float(adapters[lora] if scale is None else scale),
               "image": image, "mask": mask, "strength": None if strength is None else float(strength),
               "weights": weights}
    if output == single and request["images"] > 1:
        made = "video" if video else "image"
        raise RequestError(400, f'"output": "{single}" returns one {made}; ask "output": "json" for '
                                f'{request["images"]}')
    return request


def _picture(body: dict[str, Any], name: str, mode: str) -> Any:
    """Field `name` as a PIL image (None when absent): base64 text (a `data:` URL too) or, from a
    multipart request, the file's bytes.

    Raises:
        RequestError: 400, naming the field.
    """
    from .media import read_picture

    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = base64.b64decode(value.partition(",")[2] if value.startswith("data:") else value, validate=True)
        except ValueError:
            raise RequestError(400, f"field {name!r} must be a picture in base64 (PNG, JPEG or WebP)") from None
    if not isinstance(value, bytes):
        raise RequestError(400, f"field {name!r} must be a picture in base64 (PNG, JPEG or WebP)")
    try:
        return read_picture(value, f"field {name!r}", mode)
    except AotbuildError as exc:
        raise RequestError(400, exc.message) from None


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
    from .runtime.component import CompiledComponent
    from .runtime.coverage import variant_coverage, variant_covers

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
    """`text` without machine paths (a client learns nothing of the server's file system); the
    server's own routes stay."""
    return _MACHINE_PATH.sub(lambda found: found[0] if found[0].rstrip("/") in ROUTES else "<path>", text)


class AdapterSlots:
    """The LoRAs a replica may serve (`--lora NAME=SOURCE[:WEIGHT]`) and the ones loaded into its
    pipeline: at most `slots`, the least recently used unloaded first. The caller holds the
    pipeline's lock: loads and switches change what the next call computes. `counts`, the
    replica's, gets the adapter loads, unloads and switches."""

    def __init__(self, pipe: Any, allowed: dict[str, tuple[str, float]], slots: int,
                 counts: dict[str, int]) -> None:
        self.pipe, self.allowed, self.slots, self.counts = pipe, allowed, slots, counts
        self.loaded: OrderedDict[str, None] = OrderedDict()
        self.active: tuple[str, float] | None = None  # what the pipeline's adapters are set to; None: off

    def activate(self, name: str | None, scale: float | None) -> None:
        """Set the pipeline to this adapter at this weight (None: no adapter), loading it first
        when it is not loaded: the fast path, a rebind of the merged weights."""
        from .runtime.load import quiet_libraries

        wanted = None if name is None else (name, scale)
        if wanted == self.active:
            if name is not None:
                self.loaded.move_to_end(name)
            return
        self.active = UNSET  # until the pipeline is set: a failure half-way leaves it unknown
        if name is None:
            if self.loaded:
                self.pipe.disable_lora()
        else:
            if name not in self.loaded:
                if len(self.loaded) >= self.slots:
                    evicted, _ = self.loaded.popitem(last=False)
                    self.pipe.delete_adapters(evicted)
                    self.counts["adapter_unloads"] += 1
                source, _ = self.allowed[name]
                try:
                    # diffusers' and peft's notes on every load (no text encoder keys; several adapters in
                    # one model, which is what slots are) are noise here.
                    with quiet_libraries(), warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                        self.pipe.load_lora_weights(source, adapter_name=name)
                except (OSError, ValueError) as exc:  # diffusers' words for a missing or malformed LoRA
                    raise AotbuildError(f"LoRA {name!r} could not be loaded: {exc}") from None
                self.loaded[name] = None
                self.counts["adapter_loads"] += 1
            self.loaded.move_to_end(name)
            self.pipe.enable_lora()
            self.pipe.set_adapters([name], adapter_weights=[scale])
        self.active = wanted
        self.counts["adapter_switches"] += 1


def parse_adapters(texts: list[str] | tuple[str, ...]) -> dict[str, tuple[str, float]]:
    """`--lora NAME=SOURCE[:WEIGHT]` options as {name: (source, default weight)}: SOURCE a LoRA
    file or folder on this machine (it must be there) or a Hub repo `org/name`.

    Raises:
        AotbuildError: a malformed option, a name given twice, a local LoRA that is not there.
    """
    from .backends import parse_lora

    return _named_options(texts, "--lora", "PATH-OR-HUB-ID[:WEIGHT]", "lora", parse_lora)


def parse_checkpoints(texts: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`--weights NAME=SOURCE` options as {name: source}: SOURCE another checkpoint of the
    artifact's architecture, a diffusers folder on this machine (it must be one) or a Hub id
    `org/name[@revision]`.

    Raises:
        AotbuildError: a malformed option, a name given twice, a local folder that is not a checkpoint.
    """
    from .sources import hub_id_form

    def checkpoint(source: str) -> str:
        local = Path(source).expanduser()
        if local.exists() or not hub_id_form(source):
            if not (local / "model_index.json").is_file():
                raise AotbuildError(f"--weights {source}: not a diffusers checkpoint (no model_index.json there)")
            return str(local.resolve())  # replicas may start in another folder
        return source

    return _named_options(texts, "--weights", "FOLDER-OR-HUB-ID[@REVISION]", "weights", checkpoint)


def _named_options(texts: list[str] | tuple[str, ...], option: str, form: str, field: str,
                   parse: Callable[[str], Any]) -> dict[str, Any]:
    """NAME=SOURCE options as {name: parse(SOURCE)}: the names requests send as `field`."""
    named: dict[str, Any] = {}
    for text in texts:
        name, sep, source = text.partition("=")
        if not sep or not ADAPTER_NAME.fullmatch(name) or not source:
            raise AotbuildError(f"{option} {text!r}: give NAME={form}, NAME of letters, digits, '.', '_' or '-' "
                                f"(what requests send as \"{field}\")")
        if name in named:
            raise AotbuildError(f"{option}: the name {name!r} is given twice")
        named[name] = parse(source)
    return named


def openai_request(body: Any, *, edits: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """An OpenAI images request (`prompt`, `n`, `size` as "WxH", `response_format` "b64_json";
    `model` and `user` accepted and unused: the server serves one artifact) as this server's own
    request, with what each of its fields is called in the OpenAI request (for messages).
    aotbuild's own fields (`seed`, `steps`, `lora`, ...) pass as they are. `edits`: OpenAI's
    edits request, whose `image` (and `mask`) it takes; a generation takes none.

    Raises:
        RequestError: 400, naming the OpenAI field.
    """
    if not isinstance(body, dict):
        raise RequestError(400, 'the body must be a JSON object, e.g. {"prompt": "a red fox", "size": "1024x1024"}')
    if edits and body.get("image") is None:
        raise RequestError(400, f"field 'image' is required at {OPENAI_EDITS_ROUTE}: the picture to edit")
    if not edits and (given := sorted(set(body) & {"image", "mask"})):
        raise RequestError(400, f"field {given[0]!r}: {OPENAI_ROUTE} makes images from text; "
                                f"{OPENAI_EDITS_ROUTE} takes an image and a mask")
    if given := sorted(set(body) & {"images", "height", "width", "output"}):
        raise RequestError(400, f"field {given[0]!r}: this endpoint takes OpenAI's n and size (\"WIDTHxHEIGHT\"); "
                                f"POST / takes images, height, width and output")
    if (fmt := body.get("response_format", "b64_json")) != "b64_json":
        raise RequestError(400, f'field \'response_format\' is {json.dumps(fmt)}; this server returns images in the '
                                f'response only ("b64_json")')
    for name in ("model", "user"):
        if name in body and not isinstance(body[name], str):
            raise RequestError(400, f"field {name!r} must be a string")
    request = {k: v for k, v in body.items() if k not in OPENAI_ONLY}
    if "n" in body:
        request["images"] = body["n"]
    if "size" in body:
        size = body["size"]
        match = re.fullmatch(r"([1-9]\d{0,5})x([1-9]\d{0,5})", size) if isinstance(size, str) else None
        if match is None:
            raise RequestError(400, f'field \'size\' is {json.dumps(size)}; give "WIDTHxHEIGHT", e.g. "1024x1024"')
        request["width"], request["height"] = int(match[1]), int(match[2])
    if edits:
        _openai_mask(request)
    request["output"] = "json"
    return request, {"images": "n", "height": "size", "width": "size"}


def _openai_mask(request: dict[str, Any]) -> None:
    """OpenAI's edit repaints where its mask (else the image itself) is transparent; this
    server's `mask` repaints where it is white: the alpha channel, inverted, becomes the mask. A
    mask without transparency is refused; an image without it, and no mask, is img2img of the whole."""
    from .media import png_bytes

    if request.get("mask") is None:  # null: no mask, as OpenAI's clients send an absent one
        request.pop("mask", None)
    given = "mask" in request
    picture = _picture(request, "mask" if given else "image", "RGBA")
    alpha = picture.getchannel("A")
    if alpha.getextrema()[0] == 255:  # nothing transparent
        if given:
            raise RequestError(400, "field 'mask' has no transparent pixels: OpenAI's edits repaint where the mask "
                                    "is transparent (alpha 0)")
        return
    request["mask"] = png_bytes(alpha.point(lambda a: 255 - a))
    if not given:
        request["image"] = png_bytes(picture.convert("RGB"))


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

        from .backends import call_defaults, prepare, prepare_artifact
        from .sources import random_init_seconds

        start = time.perf_counter()
        if artifact is not None:
            self.pipe, recorded = prepare_artifact(artifact, trust_remote_code=trust_remote_code, variant=variant,
                                                   dtype=dtype)
        else:
            from .targets import load_target

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
        from .bench import rss_mib

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
            if reason := covered(self.pipe, self.recorded, call):
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
        from no image, are made as one pipeline call, each with its prompt and seed."""
        groups: dict[Any, list[int]] = {}
        for i, call in enumerate(calls):
            batched = call["images"] == 1 and call["image"] is None
            key = tuple(call[k] for k in BATCHED_BY) if batched else ("alone", i)
            groups.setdefault(key, []).append(i)
        for key, members in list(groups.items()):  # a batch no compiled variant covers runs one by one
            if len(members) > 1 and covered(self.pipe, self.recorded, {**calls[members[0]], "images": len(members)}):
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
        from .backends import generate

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
                              mask=first["mask"], strength=first["strength"])
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
        from .backends import prepare_artifact

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


def _route(request: Any) -> str:
    """The request's path below the application's route prefix (Ray Serve mounts it at
    `root_path`), without a trailing slash: "" for POST /, "/health"."""
    path, root = request.url.path, request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path.rstrip("/")


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

    from .cluster import forwarded_env, ray_log_level, require_ray
    from .openmp import spin_env

    require_ray()
    if artifact is not None and artifact.startswith("hf://"):
        from .hub import check_trusted, pinned

        check_trusted(artifact, trust_remote_code)
        artifact = pinned(artifact)
    if min(lora_slots, weights_slots, max_batch) < 1 or batch_wait_s < 0:
        raise AotbuildError(f"lora_slots ({lora_slots}), weights_slots ({weights_slots}) and max_batch ({max_batch}) "
                            f"are at least 1, batch_wait_s ({batch_wait_s}) at least 0")
    if checkpoints and artifact is None:
        raise AotbuildError("--weights serves other checkpoints through an artifact (the aot backend)")
    if checkpoints and not artifact.startswith("hf://"):
        _check_checkpoints(Path(artifact), checkpoints, dtype)
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
    front = serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=1000, logging_config=options["logging_config"])
    return front.bind(model, tuple(loras or ()), tuple(checkpoints or ()))


def _check_checkpoints(artifact: Path, checkpoints: dict[str, str], dtype: str | None) -> None:
    """Each local checkpoint a server may load fits the artifact's compiled code, by its configs
    and stored dtype (`runtime.load.check_checkpoint`), before any replica starts; a Hub one is
    checked when a request first asks for it."""
    from .manifest import read_manifest
    from .runtime.load import check_checkpoint

    manifest = read_manifest(artifact)
    for name, source in checkpoints.items():
        if Path(source).is_dir():
            try:
                check_checkpoint(manifest, Path(source), source, dtype)
            except AotbuildError as exc:
                raise AotbuildError(f"--weights {name}: {exc.message}", hint=exc.hint) from None


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

    from .cluster import ray_log_level, ray_session

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
    from .private_apis import serve_http_port

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

    from .backends import BACKENDS, call_defaults
    from .bench import drop_page_cache, report, write_document
    from .cluster import ray_session
    from .manifest import environment
    from .runtime.artifacts import built_artifact
    from .targets import load_target

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
