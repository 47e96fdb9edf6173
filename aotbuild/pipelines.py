"""What aotbuild knows about each supported pipeline class: which components it compiles, how the
pipeline calls them, which attributes it reads from them, and which shapes they accept.

Adding a pipeline means adding a `PipelineSpec` here; capture, export, runtime and target
validation all read these descriptions. This module imports torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import TargetError

CallInputs = tuple[tuple[Any, ...], dict[str, Any]]


class VaeDecoderModule(torch.nn.Module):
    """The part of `AutoencoderKL.decode` worth compiling: post-quant conv then decoder.

    Holding only these two submodules keeps the encoder's weights out of the exported program.
    """

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.post_quant_conv = getattr(vae, "post_quant_conv", None)
        self.decoder = vae.decoder

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)
        return self.decoder(latents)


def _same_module(module: torch.nn.Module) -> torch.nn.Module:
    return module


def _forward_without_return_dict(args: tuple, kwargs: dict) -> CallInputs:
    """The denoiser is exported as called, with `return_dict=False` pinned so outputs are tuples."""
    return tuple(args), {**kwargs, "return_dict": False}


def _latents_only(args: tuple, kwargs: dict) -> CallInputs:
    latents = args[0] if args else kwargs["z"]
    return (latents,), {}


@dataclass(frozen=True)
class ComponentSpec:
    """One compilable component of a pipeline.

    Attributes:
        name: the component's name in targets and artifacts (`unet`, `vae_decoder`).
        attribute: the pipeline attribute holding the module (`unet`, `vae`).
        method: the method the pipeline calls and the runtime replaces (`forward`, `decode`).
        export_module: picks the module to export out of the pipeline's module.
        call_inputs: turns a recorded pipeline call into the exported module's (args, kwargs).
        output_class: dotted path of the `return_dict=True` output type, holding one `sample`.
        read_attributes: dotted attributes the pipeline reads besides `config`, `dtype`, `device`;
            the runtime's light module keeps their values.
        lora: diffusers loads LoRAs into it (the denoiser): the compiled stand-in takes the LoRA API.
    """

    name: str
    attribute: str
    method: str
    export_module: Callable[[torch.nn.Module], torch.nn.Module]
    call_inputs: Callable[[tuple, dict], CallInputs]
    output_class: str
    read_attributes: tuple[str, ...] = ()
    lora: bool = False


@dataclass(frozen=True)
class PipelineSpec:
    """A supported diffusers pipeline class."""

    class_name: str
    components: dict[str, ComponentSpec]
    pixel_stride: Callable[[dict[str, dict]], int]
    default_stride: int
    max_denoiser_batch: int | None = None
    # The largest height/width the denoiser's position embedding covers, from the configs (None:
    # no such limit), and the value for a Hub source, whose configs are not read at parse time.
    max_pixels: Callable[[dict[str, dict]], int] | None = None
    default_max_pixels: int | None = None
    # What `encode_prompt` returns, named as the pipeline's call takes it back (None: not taken).
    prompt_embeds: tuple[str | None, ...] = ("prompt_embeds", "negative_prompt_embeds",
                                             "pooled_prompt_embeds", "negative_pooled_prompt_embeds")

    def component(self, name: str) -> ComponentSpec:
        try:
            return self.components[name]
        except KeyError:
            raise TargetError(
                f"{self.class_name} has no compilable component {name!r}; "
                f"known: {', '.join(self.components)}"
            ) from None


def _vae_factor(configs: dict[str, dict]) -> int:
    return 2 ** (len(configs["vae"]["block_out_channels"]) - 1)


def _unet_pixel_stride(configs: dict[str, dict]) -> int:
    # The UNet downsamples once per down block but the last, so latents must divide by that.
    return _vae_factor(configs) * 2 ** (len(configs["unet"]["down_block_types"]) - 1)


UNET = ComponentSpec(
    name="unet",
    attribute="unet",
    method="forward",
    export_module=_same_module,
    call_inputs=_forward_without_return_dict,
    output_class="diffusers.models.unets.unet_2d_condition.UNet2DConditionOutput",
    read_attributes=("add_embedding.linear_1.in_features",),
    lora=True,
)

TRANSFORMER = ComponentSpec(
    name="transformer",
    attribute="transformer",
    method="forward",
    export_module=_same_module,
    call_inputs=_forward_without_return_dict,
    output_class="diffusers.models.modeling_outputs.Transformer2DModelOutput",
    lora=True,
)

VAE_DECODER = ComponentSpec(
    name="vae_decoder",
    attribute="vae",
    method="decode",
    export_module=VaeDecoderModule,
    call_inputs=_latents_only,
    output_class="diffusers.models.autoencoders.vae.DecoderOutput",
)

def _patch_pixel_stride(configs: dict[str, dict]) -> int:
    return _vae_factor(configs) * configs["transformer"].get("patch_size", 1)


def _pos_embed_max_pixels(configs: dict[str, dict]) -> int:
    # SD3 crops a fixed grid of pos_embed_max_size patches per side; larger latents do not fit it.
    return configs["transformer"]["pos_embed_max_size"] * _patch_pixel_stride(configs)


def _packed_pixel_stride(configs: dict[str, dict]) -> int:
    # Flux packs 2x2 latent patches into one token.
    return _vae_factor(configs) * 2


PIPELINES: dict[str, PipelineSpec] = {
    "StableDiffusionXLPipeline": PipelineSpec(
        class_name="StableDiffusionXLPipeline",
        components={"unet": UNET, "vae_decoder": VAE_DECODER},
        pixel_stride=_unet_pixel_stride,
        default_stride=32,  # SDXL base: VAE factor 8 x UNet factor 4
        max_denoiser_batch=63,
    ),
    "StableDiffusionPipeline": PipelineSpec(
        class_name="StableDiffusionPipeline",
        components={"unet": dataclasses.replace(UNET, read_attributes=()), "vae_decoder": VAE_DECODER},
        pixel_stride=_unet_pixel_stride,
        default_stride=64,  # SD 1.5: VAE factor 8 x UNet factor 8
        max_denoiser_batch=63,
        prompt_embeds=("prompt_embeds", "negative_prompt_embeds"),
    ),
    "StableDiffusion3Pipeline": PipelineSpec(
        class_name="StableDiffusion3Pipeline",
        components={"transformer": TRANSFORMER, "vae_decoder": VAE_DECODER},
        pixel_stride=_patch_pixel_stride,
        default_stride=16,  # SD3 medium: VAE factor 8 x patch 2
        max_pixels=_pos_embed_max_pixels,
        default_max_pixels=3072,  # SD3 medium: pos_embed_max_size 192 x 16
    ),
    "FluxPipeline": PipelineSpec(
        class_name="FluxPipeline",
        components={"transformer": TRANSFORMER, "vae_decoder": VAE_DECODER},
        pixel_stride=_packed_pixel_stride,
        default_stride=16,  # Flux: VAE factor 8 x 2x2 packing
        prompt_embeds=("prompt_embeds", "pooled_prompt_embeds", None),  # text_ids: recomputed
    ),
}


def pipeline_spec(class_name: str) -> PipelineSpec:
    """The spec of a supported pipeline class; the error lists the supported ones."""
    try:
        return PIPELINES[class_name]
    except KeyError:
        raise TargetError(
            f"pipeline {class_name!r} is not supported; supported: {', '.join(PIPELINES)}"
        ) from None
