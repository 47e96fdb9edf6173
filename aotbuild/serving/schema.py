"""What the server takes: its routes, its request's fields and limits, a JSON body parsed and checked
into a pipeline call, whether the artifact covers that call (asked before anything is allocated),
and error text without machine paths."""

from __future__ import annotations

import base64
import json
import math
import re
from typing import Any

from ..errors import AotbuildError

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

MAX_STEPS = 50

MAX_IMAGES = 4

MAX_BODY_BYTES = 16 * 2**20  # a prompt and a few numbers, or an image and its mask in base64

# Form fields of a multipart request that are numbers (the others are text, and files are pictures).
NUMBER_FIELDS = ("steps", "guidance_scale", "height", "width", "seed", "images", "frames", "strength", "lora_scale",
                 "n")

MAX_PROMPT_CHARS = 4096  # tokenizers read the first 77 to 512 tokens of a prompt


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
    image, mask = (picture_field(body, name, mode) for name, mode in (("image", "RGB"), ("mask", "L")))
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
