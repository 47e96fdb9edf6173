"""OpenAI's images requests (`/v1/images/generations`, `/v1/images/edits`) as this server's own
request: `n`, `size`, `response_format`, an edit's transparent mask."""

from __future__ import annotations

from typing import Any

from ..errors import RequestError
from .schema import OPENAI_EDITS_ROUTE, OPENAI_ROUTE, picture_field, validated


def openai_request(body: Any, *, edits: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """An OpenAI images request (`prompt`, `n`, `size` as "WxH", `response_format` "b64_json";
    `model` and `user` accepted and unused: the server serves one artifact) as this server's own
    request, with what each of its fields is called in the OpenAI request (for messages).
    aotbuild's own fields (`seed`, `steps`, `lora`, ...) pass as they are. `edits`: OpenAI's
    edits request, whose `image` (and `mask`) it takes; a generation takes none.

    Raises:
        RequestError: 400, naming the OpenAI field.
    """
    from .models import OpenAIImageRequest

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
    openai = validated(OpenAIImageRequest, body, {"n": (1, None)}, {})
    request = {k: v for k, v in body.items() if k not in OpenAIImageRequest.model_fields or k == "prompt"}
    if openai.n is not None:
        request["images"] = openai.n
    if openai.size is not None:
        request["width"], request["height"] = (int(side) for side in openai.size.split("x"))
    if edits:
        _openai_mask(request)
    request["output"] = "json"
    return request, {"images": "n", "height": "size", "width": "size"}


def _openai_mask(request: dict[str, Any]) -> None:
    """OpenAI's edit repaints where its mask (else the image itself) is transparent; this
    server's `mask` repaints where it is white: the alpha channel, inverted, becomes the mask. A
    mask without transparency is refused; an image without it, and no mask, is img2img of the whole."""
    from ..generation.media import png_bytes

    if request.get("mask") is None:  # null: no mask, as OpenAI's clients send an absent one
        request.pop("mask", None)
    given = "mask" in request
    picture = picture_field(request, "mask" if given else "image", "RGBA")
    alpha = picture.getchannel("A")
    if alpha.getextrema()[0] == 255:  # nothing transparent
        if given:
            raise RequestError(400, "field 'mask' has no transparent pixels: OpenAI's edits repaint where the mask "
                                    "is transparent (alpha 0)")
        return
    request["mask"] = png_bytes(alpha.point(lambda a: 255 - a))
    if not given:
        request["image"] = png_bytes(picture.convert("RGB"))
