"""The server's requests as typed models (pydantic, which Ray Serve's FastAPI brings): what
`schema.parse_request` validates a body against, and what the OpenAPI page at /docs shows. The
limits a server is started with (steps, images) and what its artifact makes are checked after."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .schema import MAX_PROMPT_CHARS, REQUEST_FIELDS

PICTURE = "a picture in base64 (PNG, JPEG or WebP), or a multipart file"


def _field(name: str, **limits: object) -> object:
    return Field(None, description=REQUEST_FIELDS[name], **limits)


class ImageRequest(BaseModel):
    """POST /: a JSON object, or a multipart form whose files are `image`, `mask` and
    `ip_adapter_image`. Fields left
    out take the artifact's first bucket (size, frames) and the server's defaults."""

    # strict: "4" and true are not numbers; extra: a misspelt field is an error, not ignored
    model_config = ConfigDict(extra="forbid", strict=True, title="aotbuild request")

    prompt: str = Field(description=REQUEST_FIELDS["prompt"], max_length=MAX_PROMPT_CHARS)
    negative_prompt: str | None = _field("negative_prompt", max_length=MAX_PROMPT_CHARS)
    steps: int | None = _field("steps", ge=1)
    guidance_scale: float | None = _field("guidance_scale", ge=0, allow_inf_nan=False)
    height: int | None = _field("height", ge=1)
    width: int | None = _field("width", ge=1)
    seed: int | None = _field("seed", ge=0, le=2**63 - 1)
    images: int | None = _field("images", ge=1)
    frames: int | None = _field("frames", ge=1)
    output: Literal["png", "mp4", "json"] | None = _field("output")
    image: str | bytes | None = _field("image")
    mask: str | bytes | None = _field("mask")
    strength: float | None = _field("strength", gt=0, le=1)
    ip_adapter_image: str | bytes | None = _field("ip_adapter_image")
    lora: str | None = _field("lora")
    lora_scale: float | None = _field("lora_scale", allow_inf_nan=False)
    weights: str | None = _field("weights")


class OpenAIImageRequest(BaseModel):
    """POST /v1/images/generations (and /v1/images/edits, with `image` and `mask`): OpenAI's images
    request; this server's own fields (`seed`, `steps`, `lora`, ...) pass as they are."""

    model_config = ConfigDict(extra="allow", strict=True, title="OpenAI images request")

    prompt: str = Field(description=REQUEST_FIELDS["prompt"], max_length=MAX_PROMPT_CHARS)
    n: int | None = Field(None, description="images for the prompt (at most the server's --max-images)")
    size: str | None = Field(None, pattern=r"^[1-9]\d{0,5}x[1-9]\d{0,5}$", description='"WIDTHxHEIGHT"',
                             examples=["1024x1024"])
    response_format: Literal["b64_json"] | None = Field(None, description="images in the response only")
    model: str | None = Field(None, description="accepted, unused: the server serves one artifact")
    user: str | None = Field(None, description="accepted, unused")
