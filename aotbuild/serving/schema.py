"""What the server takes: its routes, its request's fields and limits, a JSON body parsed and checked
into a pipeline call, whether the artifact covers that call (asked before anything is allocated),
and error text without machine paths."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

from ..errors import AotbuildError, RequestError

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
    "ip_adapter_image": "the image prompt of an artifact built with an IP-Adapter (base64 PNG/JPEG/WebP, or a "
                        "multipart file): every call to one takes it, others take none",
    "lora": "a LoRA the server was started with (--lora NAME=...), by its name",
    "lora_scale": "the LoRA's weight (default: its --lora weight, else 1)",
    "weights": "another checkpoint the server was started with (--weights NAME=...), by its name",
}

OPENAI_ROUTE = "/v1/images/generations"

OPENAI_EDITS_ROUTE = "/v1/images/edits"

HEALTH_ROUTE = "/health"

# Every route the server answers, below its prefix, with its method; any other path is a 404.
ROUTES = {"": "POST", OPENAI_ROUTE: "POST", OPENAI_EDITS_ROUTE: "POST", HEALTH_ROUTE: "GET"}

MAX_STEPS = 50

MAX_IMAGES = 4

MAX_BODY_BYTES = 16 * 2**20  # a prompt and a few numbers, or an image and its mask in base64

# Form fields of a multipart request that are numbers (the others are text, and files are pictures).
NUMBER_FIELDS = ("steps", "guidance_scale", "height", "width", "seed", "images", "frames", "strength", "lora_scale",
                 "n")

MAX_PROMPT_CHARS = 4096  # tokenizers read the first 77 to 512 tokens of a prompt


# What a request's field must be, said when its value is not (integers say their range instead).
FIELD_RULES = {"guidance_scale": "a finite number >= 0", "strength": "a number above 0 and at most 1",
               "lora_scale": "a finite number", "negative_prompt": "a string", "lora": "a string",
               "weights": "a string", "image": "a picture in base64 (PNG, JPEG or WebP)",
               "mask": "a picture in base64 (PNG, JPEG or WebP)",
               "ip_adapter_image": "a picture in base64 (PNG, JPEG or WebP)", "model": "a string", "user": "a string"}


def parse_request(body: Any, defaults: dict[str, Any], *, max_steps: int = MAX_STEPS,
                  max_images: int = MAX_IMAGES, adapters: dict[str, float] | None = None,
                  checkpoints: tuple[str, ...] = (), names: dict[str, str] | None = None) -> dict[str, Any]:
    """A request's JSON body checked (`models.ImageRequest`, then this server's limits and what its
    artifact makes) and completed from `defaults` (`backends.call_defaults`). `adapters`: the LoRAs
    a request may name, with their default weights; `checkpoints`: the other checkpoints it may
    name. `names`: what a field is called in the request as the client wrote it (an OpenAI
    request's `n` is `images`).

    Raises:
        RequestError: 400, naming the field and what it takes.
    """
    from .models import ImageRequest

    adapters, names = adapters or {}, names or {}
    video = defaults.get("frames") is not None
    single = "mp4" if video else "png"
    ranges = {"steps": (1, max_steps), "images": (1, max_images), "height": (1, None), "width": (1, None),
              "seed": (0, 2**63 - 1), "frames": (1, None)}
    given = validated(ImageRequest, body, ranges, names, single)
    if not given.prompt.strip():
        raise RequestError(400, "field 'prompt' is required: a non-empty string")
    picked = {"images": 1, "frames": defaults.get("frames"), "output": single}  # one image unless asked
    call = {name: value if (value := getattr(given, name)) is not None else defaults.get(name, picked.get(name))
            for name in type(given).model_fields}
    for name, (_, high) in ranges.items():
        if high is not None and call[name] is not None and call[name] > high:
            raise RequestError(400, _out_of_range(name, call[name], ranges, names))
    if given.lora is not None and given.lora not in adapters:
        served = (f"this server serves: {', '.join(sorted(adapters))}" if adapters else
                  "this server serves no LoRAs (start it with --lora NAME=PATH)")
        raise RequestError(400, f"field 'lora' is {json.dumps(given.lora)}; {served}")
    if given.weights is not None and given.weights not in checkpoints:
        served = (f"this server serves: {', '.join(sorted(checkpoints))}" if checkpoints else
                  "this server serves its artifact's own weights only (start it with --weights NAME=FOLDER)")
        raise RequestError(400, f"field 'weights' is {json.dumps(given.weights)}; {served}")
    if given.lora_scale is not None and given.lora is None:
        raise RequestError(400, "field 'lora_scale' goes with field 'lora'")
    if given.frames is not None and not video:
        raise RequestError(400, "field 'frames': this artifact makes images, not videos")
    if call["output"] not in (single, "json"):
        raise RequestError(400, f'field \'output\' is "{single}" or "json", got {json.dumps(call["output"])}')
    if given.mask is not None and given.image is None:
        raise RequestError(400, "field 'mask' goes with field 'image': the picture to inpaint")
    if given.strength is not None and given.image is None:
        raise RequestError(400, "field 'strength' goes with field 'image'")
    if given.image is not None and video:
        raise RequestError(400, "field 'image': this server makes videos from text only")
    if defaults.get("image_prompt") and given.ip_adapter_image is None:
        raise RequestError(400, "field 'ip_adapter_image' is required: this artifact is built with an IP-Adapter, "
                                "whose image prompt every call takes")
    if given.ip_adapter_image is not None and not defaults.get("image_prompt"):
        raise RequestError(400, "field 'ip_adapter_image': this artifact is built without an IP-Adapter")
    call.update(guidance_scale=float(call["guidance_scale"]), frames=call["frames"] if video else None,
                lora_scale=None if given.lora is None else float(adapters[given.lora] if given.lora_scale is None
                                                                  else given.lora_scale),
                strength=None if given.strength is None else float(given.strength),
                image=picture_field(call, "image", "RGB"), mask=picture_field(call, "mask", "L"),
                ip_adapter_image=picture_field(call, "ip_adapter_image", "RGB"))
    if call["output"] == single and call["images"] > 1:
        made = "video" if video else "image"
        raise RequestError(400, f'"output": "{single}" returns one {made}; ask "output": "json" for '
                                f'{call["images"]}')
    return call


def validated(model: Any, body: Any, ranges: dict[str, tuple[int, int | None]], names: dict[str, str],
              single: str = "png") -> Any:
    """`body` as the pydantic `model`, its first error said in the request's terms (an unknown
    field before any other).

    Raises:
        RequestError: 400, naming the field as the client wrote it and what it takes.
    """
    from pydantic import ValidationError

    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
        raise RequestError(400, _said(errors[0], model, ranges, names, single)) from None


def _said(error: dict[str, Any], model: Any, ranges: dict[str, tuple[int, int | None]], names: dict[str, str],
          single: str) -> str:
    """One pydantic error as this server says it."""
    kind, value = error["type"], error.get("input")
    if kind == "model_type":
        return 'the body must be a JSON object, e.g. {"prompt": "a red fox"}'
    name = str(error["loc"][0])
    shown = names.get(name, name)
    if kind == "extra_forbidden":
        return f"unknown field {name!r}; the fields are: {', '.join(model.model_fields)}"
    if name == "prompt" and kind in ("missing", "string_type"):
        return "field 'prompt' is required: a non-empty string"
    if kind == "string_too_long":
        return f"field {shown!r} has {len(value)} characters; this server takes {MAX_PROMPT_CHARS} at most"
    if kind == "literal_error" and name == "output":
        return f'field \'output\' is "{single}" or "json", got {json.dumps(value)}'
    if kind == "literal_error" and name == "response_format":
        return (f"field 'response_format' is {json.dumps(value)}; this server returns images in the response only "
                f'("b64_json")')
    if kind == "string_pattern_mismatch" and name == "size":
        return f'field \'size\' is {json.dumps(value)}; give "WIDTHxHEIGHT", e.g. "1024x1024"'
    if name in ranges:
        if kind in ("greater_than_equal", "less_than_equal"):
            return _out_of_range(name, value, ranges, names)
        return f"field {shown!r} must be an integer, got {json.dumps(value, default=str)}"
    rule = FIELD_RULES.get(name, f"a {model.model_fields[name].annotation}")
    return f"field {shown!r} must be {rule}, got {json.dumps(value, default=lambda v: f'{len(v)} bytes')}"


def _out_of_range(name: str, value: int, ranges: dict[str, tuple[int, int | None]], names: dict[str, str]) -> str:
    low, high = ranges[name]
    shown = names.get(name, name)
    limit = f"{low} to {high}" if high is not None else f"at least {low}"
    shared = list(names.values()).count(shown) > 1  # `size` gives height and width
    return f"field {shown!r} is {f'{name} {value}' if shared else value}; this server takes {limit}"


def picture_field(body: dict[str, Any], name: str, mode: str) -> Any:
    """Field `name` as a PIL image (None when absent): base64 text (a `data:` URL too) or, from a
    multipart request, the file's bytes.

    Raises:
        RequestError: 400, naming the field.
    """
    from ..generation.media import read_picture

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


def covered(pipe: Any, recorded: dict[str, Any], call: dict[str, Any], text: int | None = None) -> str | None:
    """Why the pipeline cannot make this call at its size, images, guidance and text length (`text`,
    the server's: `backends.call_defaults`), or None: checked before anything is allocated (a 65536
    x 65536 request would allocate its latents before the compiled model refused it). An
    artifact's denoiser says what its variants cover (`runtime.coverage`, as the stand-in's refusal
    does); the eager and compile backends are held to the largest call the target covers."""
    from ..runtime.component import CompiledComponent
    from ..runtime.coverage import text_lengths, variant_coverage, variant_covers

    images, height, width, frames = call["images"], call["height"], call["width"], call.get("frames")
    guided = call["guidance_scale"] > 1
    made = f"{images} image(s)" if frames is None else f"{images} video(s) of {frames} frames"
    denoiser = next((m for m in pipe.components.values() if isinstance(m, CompiledComponent) and m.denoiser), None)
    if denoiser is not None:
        entries = [v.entry for v in denoiser.variants]
        if any(variant_covers(entry, images, height, width, guided, text, frames) for entry in entries):
            return None
        length = f" at text length {text}" if text and any(text_lengths(entry) for entry in entries) else ""
        return (f"no compiled variant makes {made} at {height}x{width} px "
                f"{'with' if guided else 'without'} guidance{length}; this artifact covers: "
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
