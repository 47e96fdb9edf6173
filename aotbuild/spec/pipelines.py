"""What aotbuild knows about each supported pipeline class: which components it compiles, how the
pipeline calls them, which attributes it reads from them, and which shapes they accept.

Adding a pipeline means adding a `PipelineSpec` here; capture, export, runtime and target
validation all read these descriptions. A diffusers pipeline class without an entry gets one
derived from its component types (`derived_spec`): built by capture, and marked not curated.
This module imports no torch at import (the VAE parts' modules are in `vae_parts`), and diffusers
only when a spec is derived or a class is read.

Over 500 lines, as one module: most of it is the table of curated pipelines (`PIPELINES`), which
reads best whole; the derivation for any other class sits beside the table it imitates.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import TargetError

if TYPE_CHECKING:
    import torch

CallInputs = tuple[tuple[Any, ...], dict[str, Any]]
# The text length a pipeline pads its prompt to (diffusers' call argument): a shape like the size.
TEXT = "max_sequence_length"
# A video pipeline's frame count (diffusers' call argument; `frames` in a target's [[shapes]]).
FRAMES = "num_frames"
# The guidance_scale of a call without guidance: every pipeline's guidance is off at 0 (Z-Image
# guides above 0, most pipelines above 1).
UNGUIDED = 0.0


# Submodules of a VAE part's export module that no compiled code reads and the pipeline does:
# FLUX.2 normalizes its latents with its VAE's BatchNorm running statistics (`vae.bn`). Their
# tensors are stored and bound with the part's weights, and the stand-in exposes them.
KEPT_MODULES = ("bn",)
# The VAEs whose decoder and encoder aotbuild compiles: AutoencoderKL's code (FLUX.2's is the same),
# and the frame-wise causal VAEs for one frame. Those (Qwen-Image's) encode and decode a video frame
# by frame, each call with caches of the frames before; an image is one frame, whose caches are
# empty, and then the parts are the plain modules (diffusers' first-frame call and the part called
# without caches agree bit for bit), compiled on inputs of one frame: (batch, channels, 1, h, w).
FRAMEWISE_VAES = ("AutoencoderKLQwenImage",)
COMPILED_VAES = ("AutoencoderKL", "AutoencoderKLFlux2", *FRAMEWISE_VAES)


# How an input the compiled model takes as zeros is shaped when a call leaves it out
# (`ComponentSpec.zero_when_absent`): like the sample in every dim, as tokens of the sample's area,
# or like it in its batch only.
SIZED, TOKENS, BATCHED = "sized", "tokens", "batched"


def _same_module(module: torch.nn.Module) -> torch.nn.Module:
    return module


def _forward_without_return_dict(args: tuple, kwargs: dict) -> CallInputs:
    """The denoiser is exported as called, with `return_dict=False` pinned so outputs are tuples."""
    return tuple(args), {**kwargs, "return_dict": False}


def _first_tensor(args: tuple, kwargs: dict) -> CallInputs:
    return (args[0] if args else next(iter(kwargs.values())),), {}


def vae_factor(config: Mapping[str, Any]) -> int:
    """Pixels per latent pixel of a VAE config: AutoencoderKL downsamples once per block but the
    last; Qwen-Image's and Wan's VAEs once per entry of `temperal_downsample` (spatially each time)."""
    if "temperal_downsample" in config:
        return 2 ** len(config["temperal_downsample"])
    return 2 ** (len(config["block_out_channels"]) - 1)


def _vae_part(name: str) -> Callable:
    """`vae_parts.<name>`, imported at its first call: this module imports no torch, so that
    reading a target or an artifact's manifest answers at once."""
    def call(*args: Any) -> Any:
        from . import vae_parts

        return getattr(vae_parts, name)(*args)

    call.__name__ = call.__qualname__ = name
    return call


@dataclass(frozen=True)
class ComponentSpec:
    """One compilable component of a pipeline.

    Attributes:
        name: the component's name in targets and artifacts (`unet`, `vae_decoder`).
        attribute: the pipeline attribute holding the module (`unet`, `vae`).
        method: the method the pipeline calls and the runtime replaces (`forward`, `decode`).
        export_module: picks the module to export out of the pipeline's module.
        call_inputs: turns a recorded pipeline call into the exported module's (args, kwargs).
        output_class: dotted path of the `return_dict=True` output type, holding one `sample`
            (None: the call returns the tensor, as the VAE's encoder and decoder parts do).
        read_attributes: dotted attributes the pipeline reads besides `config`, `dtype`, `device`;
            the runtime's light module keeps their values.
        denoiser: the model the pipeline calls per step: its batch doubles under classifier-free
            guidance (where the pipeline batches it), and diffusers loads LoRAs into it.
        part: the VAE part it is (`decoder`, `encoder`): the runtime's stand-in for the VAE runs
            diffusers' own encode/decode (slicing and tiling included) on the compiled parts.
        random_call: example inputs at (batch, height, width) pixels, for calls the
            text-to-image pipeline does not make (encoding, tiles); None: always recorded.
        recorded: the text-to-image pipeline calls it, so its inputs are recorded there.
        runtime_config: the config keys of its module that no compiled code reads (the
            pipeline or the stand-in does: `VAE_RUNTIME_CONFIG`), with who reads them; another
            checkpoint's values of these are used. Every other key is compiled into the code, and
            another checkpoint must hold the artifact's value (`checkpoint.checkpoint_config`).
        beside_denoiser: called each step beside the denoiser, on the denoiser's batch (a
            ControlNet): planned, batched under guidance and held to the pipeline call as the
            denoiser is; no LoRA goes into it.
        output_fields: the fields of `output_class`, in the order the forward's tuple holds them.
        finish: what the eager forward does after the part compiled at fixed arguments, given
            the module's config, the compiled outputs and the call's keyword arguments (a
            ControlNet's conditioning scale and guess mode); None: nothing.
        zero_when_absent: inputs (dotted paths) a call may leave out that the compiled model takes
            as zeros, by how their zeros are shaped: SIZED (at the sample's batch and size, a
            ControlNet's residuals, which a UNet adds to its skip connections: x + 0 is x), TOKENS
            (at the sample's batch, as many tokens as its size makes: SD3's ControlNet's block
            samples, tokens of a latent image) or BATCHED (at the sample's batch, the rest as
            traced: an IP-Adapter's image embeddings, whose attention the stand-in zeroes through
            its weights when no adapter is loaded).
        class_checked: the pipeline checks `isinstance(module, <its class>)` (diffusers' ControlNet
            pipelines assert it): the stand-in reports the model's class as its `__class__`.
        prepare: what the stand-in does to a call's keyword arguments before the compiled code,
            given the module's config (a Flux ControlNet without modes drops the mode it ignores);
            None: nothing.
        capture_arguments: arguments of the pipeline's call a capture passes for this component,
            given its config (a ControlNet-Union's control mode); None: none.
        submodules: submodules the pipeline reads off the model or hands it when it is made (an
            SD3.5 Large ControlNet is given a copy of the SD3 transformer's `pos_embed`): the
            stand-in gives one read as a module over its bound weights, and writes one handed to
            it into them through the recorded passes, as eager's copy is.
        methods: methods of the model's class the pipeline calls on it, run as the class's own on
            the stand-in (their code reads only what the stand-in keeps).
    """

    name: str
    attribute: str
    method: str
    export_module: Callable[[torch.nn.Module], torch.nn.Module]
    call_inputs: Callable[[tuple, dict], CallInputs]
    output_class: str | None
    read_attributes: tuple[str, ...] = ()
    denoiser: bool = False
    part: str | None = None
    random_call: Callable[[torch.nn.Module, int, int, int, torch.Generator], CallInputs] | None = None
    recorded: bool = True
    runtime_config: Mapping[str, str] = dataclasses.field(default_factory=dict)
    beside_denoiser: bool = False
    output_fields: tuple[str, ...] = ("sample",)
    finish: Callable[[Mapping[str, Any], Any, dict[str, Any]], Any] | None = None
    zero_when_absent: Mapping[str, str] = dataclasses.field(default_factory=dict)
    class_checked: bool = False
    prepare: Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    capture_arguments: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    submodules: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()

    @property
    def per_step(self) -> bool:
        """Called every step on the denoiser's batch: the denoiser, or a model beside it."""
        return self.denoiser or self.beside_denoiser

    def unheld_submodules(self, model: Any) -> tuple[str, ...]:
        """The name prefixes (`pos_embed.`) of the `submodules` the pipeline hands the model that
        `model` holds none of yet: its config makes none, or it was read from its checkpoint alone."""
        return tuple(f"{name}." for name in self.submodules if getattr(model, name, None) is None)


@dataclass(frozen=True)
class PipelineSpec:
    """A supported diffusers pipeline class."""

    class_name: str
    components: dict[str, ComponentSpec]
    pixel_stride: Callable[[dict[str, dict]], int]
    default_stride: int
    # The pixel size the pipeline uses when a call gives no height/width (None: read from the
    # pipeline object, its `default_sample_size` or the denoiser's `sample_size`).
    default_pixels: Callable[[dict[str, dict]], int] | None
    max_denoiser_batch: int | None = None
    # The denoiser sees 2 x images under classifier-free guidance (Flux is guidance-distilled: its
    # true CFG calls the transformer twice at the same batch).
    cfg_batch: bool = True
    # The largest height/width the denoiser's position embedding covers, from the configs (None:
    # no such limit), and the value for a Hub source, whose configs are not read at parse time.
    max_pixels: Callable[[dict[str, dict]], int] | None = None
    default_max_pixels: int | None = None
    # Arguments the pipeline's call needs besides the prompt and size, at (batch, height, width):
    # an inpainting pipeline's image and mask.
    capture_extras: Callable[[int, int, int], dict[str, Any]] | None = None
    # What `encode_prompt` returns, named as the pipeline's call takes it back (None: not taken).
    # (None: unknown, the capture calls the pipeline with the prompt, its text encoders on the device).
    prompt_embeds: tuple[str | None, ...] | None = ("prompt_embeds", "negative_prompt_embeds",
                                                    "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    # False: derived from the class by `derived_spec`, nothing about it written or tested here.
    curated: bool = True
    # The call edits an image whose tokens join the denoiser's sequence (Flux Kontext): a bucket's
    # `image` size is a shape, and the capture passes such an image unresized.
    edits: bool = False
    # The VAE encoder also encodes the control image, once per guidance half (SD3's ControlNet
    # pipeline): its model spans twice the images as well.
    encodes_guided_control: bool = False
    # The call makes videos: it takes `num_frames` (every curated pipeline makes images; a derived
    # spec reads it from the class, as a test does for the curated ones).
    makes_video: bool = False

    def call_extras(self, batch: int, height: int, width: int,
                    images: Sequence[tuple[int, int]] | None = None) -> dict[str, Any] | None:
        """The arguments a capture's call takes besides the prompt and size (`capture_extras`), and
        the images an `EDITS_SEVERAL` call edits together (`images`, in order)."""
        extras = self.capture_extras(batch, height, width) if self.capture_extras else None
        if images:
            extras = {**(extras or {}), "image": seeded_images(images)}
        return extras

    def component(self, name: str) -> ComponentSpec:
        try:
            return self.components[name]
        except KeyError:
            raise TargetError(
                f"{self.class_name} has no compilable component {name!r}; "
                f"known: {', '.join(self.components)}"
            ) from None


def _vae_factor(configs: dict[str, dict]) -> int:
    return vae_factor(configs["vae"])


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
    denoiser=True,
    zero_when_absent={"down_block_additional_residuals": SIZED, "mid_block_additional_residual": SIZED,
                      "added_cond_kwargs.image_embeds": BATCHED},  # a ControlNet's, an IP-Adapter's
)

TRANSFORMER = ComponentSpec(
    name="transformer",
    attribute="transformer",
    method="forward",
    export_module=_same_module,
    call_inputs=_forward_without_return_dict,
    output_class="diffusers.models.modeling_outputs.Transformer2DModelOutput",
    denoiser=True,
    # Flux's ControlNet's samples, SD3's, and Flux's IP-Adapter's image embeddings
    zero_when_absent={"controlnet_block_samples": SIZED, "controlnet_single_block_samples": SIZED,
                      "block_controlnet_hidden_states": TOKENS,
                      "joint_attention_kwargs.ip_adapter_image_embeds": BATCHED},
)


def _unscaled_residuals(args: tuple, kwargs: dict) -> CallInputs:
    """A ControlNet is compiled at conditioning_scale 1 and guess mode off: its residuals as the
    network makes them. The stand-in scales them as diffusers' forward does (`_scaled_residuals`),
    so one model serves every scale, the guidance window (scale 0 outside it) and guess mode."""
    return tuple(args), {**kwargs, "conditioning_scale": 1.0, "guess_mode": False, "return_dict": False}


def _unscaled_samples(args: tuple, kwargs: dict) -> CallInputs:
    """Flux's and SD3's ControlNets at conditioning_scale 1 (they have no guess mode):
    `_unscaled_residuals`."""
    return tuple(args), {**kwargs, "conditioning_scale": 1.0, "return_dict": False}


def _scaled_samples(config: Mapping[str, Any], outputs: Any, kwargs: dict[str, Any]) -> Any:
    """FluxControlNetModel.forward's and SD3ControlNetModel.forward's scaling, on samples made at
    scale 1: each list scaled, an empty one None (the compiled model returns None for it already)."""
    scale = kwargs.get("conditioning_scale", 1.0)
    if scale == 1.0:  # x * 1 is x
        return tuple(None if samples is None else list(samples) for samples in outputs)
    return tuple(None if samples is None else [sample * scale for sample in samples] for samples in outputs)


def _scaled_residuals(config: Mapping[str, Any], outputs: Any, kwargs: dict[str, Any]) -> Any:
    """ControlNetModel.forward's scaling (its step 6), on residuals made at scale 1: the same
    operations on the same values, so the result is eager's bit for bit. (A model with
    `global_pool_conditions` pools before this scales: equal up to rounding.)"""
    import torch

    scale, guess_mode = kwargs.get("conditioning_scale", 1.0), kwargs.get("guess_mode", False)
    down, mid = outputs
    if scale == 1.0 and not guess_mode:  # x * 1 is x: the copies eager makes change no value
        return list(down), mid
    if guess_mode and not config.get("global_pool_conditions"):
        scales = torch.logspace(-1, 0, len(down) + 1, device=mid.device) * scale  # 0.1 to 1.0
        return [sample * s for sample, s in zip(down, scales, strict=False)], mid * scales[-1]
    return [sample * scale for sample in down], mid * scale


CONTROLNET = ComponentSpec(
    name="controlnet",
    attribute="controlnet",
    method="forward",
    export_module=_same_module,
    call_inputs=_unscaled_residuals,
    output_class="diffusers.models.controlnets.controlnet.ControlNetOutput",
    beside_denoiser=True,
    output_fields=("down_block_res_samples", "mid_block_res_sample"),
    finish=_scaled_residuals,
    class_checked=True,
)


def union_modes(config: Mapping[str, Any]) -> int | None:
    """How many control modes a ControlNet-Union's config gives it (Flux's `num_mode`, SDXL's
    ControlNetUnionModel's `num_control_type`); None: not a union."""
    return config.get("num_mode", config.get("num_control_type"))


def _control_mode(config: Mapping[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """FluxControlNetModel reads `controlnet_mode` only with `num_mode` (a ControlNet-Union). One
    without modes is compiled without it: the mode FluxMultiControlNetModel passes every ControlNet
    (-1 where the call gives none) is dropped. A union one's must be a mode it has, said in the
    call's terms (`control_mode`; eager: an IndexError, compiled code: its bounds assert). Checked
    where the mode is on the CPU: on a GPU it would cost a sync a step, and the lookup's own device
    assert refuses it there, as eager's does."""
    mode, modes = kwargs.get("controlnet_mode"), union_modes(config)
    if modes is None:
        return kwargs if mode is None else {**kwargs, "controlnet_mode": None}
    on_cpu = getattr(getattr(mode, "device", None), "type", None) == "cpu"
    if mode is None or on_cpu and bool((mode == -1).all()):  # -1: FluxMultiControlNetModel's "none given"
        raise ValueError(f"this ControlNet-Union takes a control mode in every call: control_mode=0 to {modes - 1}")
    if on_cpu and not bool(((mode >= 0) & (mode < modes)).all()):
        lacking = sorted({m for m in mode.flatten().tolist() if not 0 <= m < modes})
        raise ValueError(f"control_mode {lacking}: this ControlNet-Union has modes 0 to {modes - 1}")
    return kwargs


def _first_mode(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ControlNet-Union is captured at mode 0: the mode is an input of its code."""
    return {"control_mode": 0} if union_modes(config) is not None else {}


FLUX_CONTROLNET = dataclasses.replace(
    CONTROLNET,
    call_inputs=_unscaled_samples,
    output_class="diffusers.models.controlnets.controlnet_flux.FluxControlNetOutput",
    output_fields=("controlnet_block_samples", "controlnet_single_block_samples"),
    finish=_scaled_samples,
    # None for InstantX's ControlNets (the pipeline then feeds it the control image's latents);
    # XLabs' have a module there, which no stand-in keeps.
    read_attributes=("input_hint_block",),
    prepare=_control_mode,
    capture_arguments=_first_mode,
)

def _union_unscaled(args: tuple, kwargs: dict) -> CallInputs:
    """SDXL's ControlNet-Union at conditioning_scale 1 and guess mode off (`_unscaled_residuals`),
    its control types' indices an input of its code, so every control mode is one model: a tensor
    of one row per condition, not the Python ints diffusers passes (which export would freeze into
    the code). A row is a 1-element tensor, which `task_embedding[row]` indexes as a tensor (a 0-d
    one would be read back as a Python int, a host sync export cannot keep)."""
    sample = args[0] if args else kwargs["sample"]
    return _unscaled_residuals(args, {**kwargs, "control_type_idx": _index_rows(
        tuple(kwargs["control_type_idx"]), sample.device)})


@functools.cache
def _index_rows(indices: tuple[int, ...], device: Any) -> Any:
    """`_union_unscaled`'s index tensor, made once per mode and device: a host-to-device copy
    each step would wait for the device (the compiled code only reads it)."""
    import torch

    return torch.tensor([[i] for i in indices], dtype=torch.long, device=device)


def _one_condition(config: Mapping[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """SDXL's ControlNet-Union is compiled for one control image per call, with its mode; several
    are weighed by their scales inside the model, which its code does not take. With one, diffusers'
    two paths (one ControlNet, or one of a MultiControlNetUnionModel: `from_multi`) compute alike.
    Each refusal in the call's terms: eager fails on some of these too, less clearly."""
    images, modes = kwargs.get("controlnet_cond"), list(kwargs.get("control_type_idx") or [])
    count = len(images) if isinstance(images, (list, tuple)) else 0
    types, prompts = kwargs.get("control_type"), kwargs.get("encoder_hidden_states")
    if count != 1:
        raise ValueError(f"this ControlNet-Union is compiled for one control image per call (with its control_mode); "
                         f"this call gives {count}")
    if len(modes) != 1:
        raise ValueError(f"control_mode gives {len(modes)} modes for 1 control image")
    if not 0 <= modes[0] < union_modes(config):
        raise ValueError(f"control_mode {modes[0]}: this ControlNet-Union has modes 0 to {union_modes(config) - 1}")
    if getattr(types, "shape", None) and getattr(prompts, "shape", None) and types.shape[0] != prompts.shape[0]:
        raise ValueError("guess_mode with guidance: diffusers' ControlNet-Union pipeline gives the ControlNet the "
                         "control types of both guidance halves and the conditional half's latents (eager fails "
                         "too); use guess_mode with guidance_scale=1")
    return {name: value for name, value in kwargs.items() if name != "from_multi"}  # as traced: its default


def _union_scaled(config: Mapping[str, Any], outputs: Any, kwargs: dict[str, Any]) -> Any:
    """ControlNetUnionModel.forward's scaling at one condition: `_scaled_residuals` at its scale
    (the pipeline passes a list of one, MultiControlNetUnionModel a float)."""
    scale = kwargs.get("conditioning_scale", 1.0)
    return _scaled_residuals(config, outputs, {**kwargs, "conditioning_scale": scale[0] if isinstance(scale, list)
                                               else scale})


UNION_CONTROLNET = dataclasses.replace(CONTROLNET, call_inputs=_union_unscaled, prepare=_one_condition,
                                       finish=_union_scaled, capture_arguments=_first_mode)

# SD3.5 Large's ControlNets (`use_pos_embed = false`) have no position embedding of their own: the
# pipeline hands each a copy of the transformer's when it is made (`_get_pos_embed_from_transformer`,
# which reads the transformer's `inner_dim` and `pos_embed`).
SD3_CONTROLNET = dataclasses.replace(
    CONTROLNET,
    call_inputs=_unscaled_samples,
    output_class="diffusers.models.controlnets.controlnet_sd3.SD3ControlNetOutput",
    output_fields=("controlnet_block_samples",),
    finish=_scaled_samples,
    submodules=("pos_embed",),
    methods=("_get_pos_embed_from_transformer",),
)
SD3_TRANSFORMER = dataclasses.replace(TRANSFORMER, read_attributes=("inner_dim",), submodules=("pos_embed",))

# The model diffusers holds several ControlNets of a class in (a pipeline given a list of them): each
# is a compiled one. (Flux's calls one ControlNet-Union once per control image given with it.)
MULTI_CONTROLNETS = {"ControlNetModel": "MultiControlNetModel", "ControlNetUnionModel": "MultiControlNetUnionModel",
                     "FluxControlNetModel": "FluxMultiControlNetModel", "SD3ControlNetModel": "SD3MultiControlNetModel"}

# The config keys of the VAEs aotbuild compiles (COMPILED_VAES) that no compiled code reads, and who
# reads them. Every other key (block_out_channels, norm_num_groups, act_fn, ...) shapes the compiled
# graph: a checkpoint differing there is refused. A denoiser has none: its pipeline reads only keys
# that shape its graph (in_channels, patch_size, guidance_embeds, sample_size for the default size).
VAE_RUNTIME_CONFIG = {
    "scaling_factor": "the pipeline scales latents by it",
    "shift_factor": "the pipeline shifts latents by it",
    "latents_mean": "the pipeline normalizes latents with it",
    "latents_std": "the pipeline normalizes latents with it",
    "force_upcast": "the pipeline upcasts a float16 VAE by it",
    "sample_size": "the stand-in's tiles are cut at it (checked against the tile models at each call)",
    "batch_norm_eps": "FLUX.2's pipeline normalizes latents with the VAE's statistics and it",
    "batch_norm_momentum": "training only",
    "dropout": "training only",
}
# Keys of those that decide what is compiled in a target of a dtype: a float16 target keeps a VAE
# whose force_upcast is set in float32.
COMPILED_AT_DTYPE = {"float16": ("force_upcast",)}

def runtime_config_keys(component: ComponentSpec, dtype: str) -> set[str]:
    """The config keys of a component that no compiled code of a target of `dtype` reads."""
    return set(component.runtime_config) - set(COMPILED_AT_DTYPE.get(dtype, ()))


VAE_DECODER = ComponentSpec(
    name="vae_decoder",
    attribute="vae",
    method="decode",
    export_module=_vae_part("VaeDecoderModule"),
    call_inputs=_first_tensor,
    output_class=None,
    part="decoder",
    random_call=_vae_part("random_latents"),
    runtime_config=VAE_RUNTIME_CONFIG,
)

VAE_ENCODER = dataclasses.replace(VAE_DECODER, name="vae_encoder", method="encode",
                                  export_module=_vae_part("VaeEncoderModule"), part="encoder",
                                  random_call=_vae_part("random_images"), recorded=False)


def _patch_pixel_stride(configs: dict[str, dict]) -> int:
    return _vae_factor(configs) * configs["transformer"].get("patch_size", 1)


def _pos_embed_max_pixels(configs: dict[str, dict]) -> int:
    # SD3 crops a fixed grid of pos_embed_max_size patches per side; larger latents do not fit it.
    return configs["transformer"]["pos_embed_max_size"] * _patch_pixel_stride(configs)


def _packed_pixel_stride(configs: dict[str, dict]) -> int:
    # Flux packs 2x2 latent patches into one token.
    return _vae_factor(configs) * 2


def _denoiser_sample_size(attribute: str) -> Callable[[dict[str, dict]], int]:
    def pixels(configs: dict[str, dict]) -> int:
        return configs[attribute]["sample_size"] * _vae_factor(configs)

    return pixels


def _flux_default_pixels(configs: dict[str, dict]) -> int:
    return 128 * _vae_factor(configs)  # FluxPipeline.default_sample_size, a constant


PIPELINES: dict[str, PipelineSpec] = {
    "StableDiffusionXLPipeline": PipelineSpec(
        class_name="StableDiffusionXLPipeline",
        components={"unet": UNET, "vae_decoder": VAE_DECODER, "vae_encoder": VAE_ENCODER},
        pixel_stride=_unet_pixel_stride,
        default_stride=32,  # SDXL base: VAE factor 8 x UNet factor 4
        default_pixels=_denoiser_sample_size("unet"),
        max_denoiser_batch=63,
    ),
    "StableDiffusionPipeline": PipelineSpec(
        class_name="StableDiffusionPipeline",
        components={"unet": dataclasses.replace(UNET, read_attributes=()), "vae_decoder": VAE_DECODER,
                    "vae_encoder": VAE_ENCODER},
        pixel_stride=_unet_pixel_stride,
        default_stride=64,  # SD 1.5: VAE factor 8 x UNet factor 8
        default_pixels=_denoiser_sample_size("unet"),
        max_denoiser_batch=63,
        prompt_embeds=("prompt_embeds", "negative_prompt_embeds"),
    ),
    "StableDiffusion3Pipeline": PipelineSpec(
        class_name="StableDiffusion3Pipeline",
        components={"transformer": SD3_TRANSFORMER, "vae_decoder": VAE_DECODER, "vae_encoder": VAE_ENCODER},
        pixel_stride=_patch_pixel_stride,
        default_stride=16,  # SD3 medium: VAE factor 8 x patch 2
        default_pixels=_denoiser_sample_size("transformer"),
        max_pixels=_pos_embed_max_pixels,
        default_max_pixels=3072,  # SD3 medium: pos_embed_max_size 192 x 16
    ),
    "FluxPipeline": PipelineSpec(
        class_name="FluxPipeline",
        components={"transformer": TRANSFORMER, "vae_decoder": VAE_DECODER, "vae_encoder": VAE_ENCODER},
        pixel_stride=_packed_pixel_stride,
        default_stride=16,  # Flux: VAE factor 8 x 2x2 packing
        default_pixels=_flux_default_pixels,
        cfg_batch=False,
        prompt_embeds=("prompt_embeds", "pooled_prompt_embeds", None),  # text_ids: recomputed
    ),
}


def seeded_image(height: int, width: int) -> Any:
    """An RGB PIL image of random pixels, seeded by its size: the image captures edit or inpaint."""
    import torch
    from PIL import Image

    generator = torch.Generator("cpu").manual_seed(height * 1009 + width)
    return Image.fromarray((torch.rand(height, width, 3, generator=generator) * 255).to(torch.uint8).numpy())


def seeded_images(sizes: Sequence[tuple[int, int]]) -> list[Any]:
    """The images an `EDITS_SEVERAL` call edits together, in order, each seeded by its size: what
    captures and benches edit for a bucket's or [dynamic]'s `images`."""
    return [seeded_image(height, width) for height, width in sizes]


def repaint_mask(height: int, width: int) -> Any:
    """A PIL mask repainting the right half (white) and keeping the left (black): what captures and
    benches inpaint with."""
    import torch
    from PIL import Image

    mask = (torch.arange(width) >= width // 2).to(torch.uint8).mul(255).expand(height, width)
    return Image.fromarray(mask.contiguous().numpy())


def _inpaint_extras(batch: int, height: int, width: int) -> dict[str, Any]:
    """A seeded image and `repaint_mask`; strength 1 so one inference step still runs the denoiser
    (SDXL inpainting's default 0.9999 would run none)."""
    return {"image": seeded_image(height, width), "mask_image": repaint_mask(height, width), "strength": 1.0}


# Inpainting checkpoints (a UNet taking 9 channels: latents, mask, masked image latents) are targets
# like any other: the same components, called with an image and a mask.
for _text2img, _inpaint in (("StableDiffusionXLPipeline", "StableDiffusionXLInpaintPipeline"),
                            ("StableDiffusionPipeline", "StableDiffusionInpaintPipeline")):
    PIPELINES[_inpaint] = dataclasses.replace(PIPELINES[_text2img], class_name=_inpaint, capture_extras=_inpaint_extras)


def _control_extras(batch: int, height: int, width: int) -> dict[str, Any]:
    """A ControlNet text-to-image call's control image: seeded, at the call's size."""
    return {"image": seeded_image(height, width)}


def _control_img2img_extras(batch: int, height: int, width: int) -> dict[str, Any]:
    """A ControlNet img2img call's image to start from and control image (strength 1: the first
    step runs at the first timestep, as text-to-image's does)."""
    return {"image": seeded_image(height, width), "control_image": seeded_image(height, width), "strength": 1.0}


def _control_inpaint_extras(batch: int, height: int, width: int) -> dict[str, Any]:
    return {**_inpaint_extras(batch, height, width), "control_image": seeded_image(height, width)}


# ControlNet pipelines: the denoiser's components and a ControlNet, called each step before the
# UNet with the control image; the UNet takes its residuals.
for _base, _family in (("StableDiffusionXLPipeline", "StableDiffusionXLControlNet"),
                       ("StableDiffusionPipeline", "StableDiffusionControlNet")):
    for _suffix, _extras in (("", _control_extras), ("Img2Img", _control_img2img_extras),
                             ("Inpaint", _control_inpaint_extras)):
        _class = f"{_family}{_suffix}Pipeline"
        PIPELINES[_class] = dataclasses.replace(
            PIPELINES[_base], class_name=_class, capture_extras=_extras,
            components={**PIPELINES[_base].components, "controlnet": CONTROLNET})


def _control_image_extras(batch: int, height: int, width: int) -> dict[str, Any]:
    return {"control_image": seeded_image(height, width)}


# SDXL's ControlNet-Union pipelines: SDXL's ControlNet pipelines whose ControlNet takes control
# images with their modes (one, compiled: `_one_condition`; captured at mode 0: `_first_mode`).
for _suffix, _extras in (("", _control_image_extras), ("Img2Img", _control_img2img_extras),
                         ("Inpaint", _control_inpaint_extras)):
    _class = f"StableDiffusionXLControlNetUnion{_suffix}Pipeline"
    PIPELINES[_class] = dataclasses.replace(
        PIPELINES["StableDiffusionXLPipeline"], class_name=_class, capture_extras=_extras,
        components={**PIPELINES["StableDiffusionXLPipeline"].components, "controlnet": UNION_CONTROLNET})


# Flux's ControlNet pipelines: the ControlNet takes the control image's latents (the VAE encodes it:
# `vae_encoder`), and the transformer its samples. Their siblings take SD's siblings' arguments.
for _suffix, _extras in (("", _control_image_extras), ("Img2Img", _control_img2img_extras),
                         ("Inpaint", _control_inpaint_extras)):
    _class = f"FluxControlNet{_suffix}Pipeline"
    PIPELINES[_class] = dataclasses.replace(
        PIPELINES["FluxPipeline"], class_name=_class, capture_extras=_extras,
        components={**PIPELINES["FluxPipeline"].components, "controlnet": FLUX_CONTROLNET})

# SD3's ControlNet pipeline: as Flux's, the ControlNet takes the control image's latents; the
# transformer adds its block samples to its blocks' tokens.
PIPELINES["StableDiffusion3ControlNetPipeline"] = dataclasses.replace(
    PIPELINES["StableDiffusion3Pipeline"], class_name="StableDiffusion3ControlNetPipeline",
    capture_extras=_control_image_extras, encodes_guided_control=True,
    components={**PIPELINES["StableDiffusion3Pipeline"].components, "controlnet": SD3_CONTROLNET})


def _control_mask_extras(batch: int, height: int, width: int) -> dict[str, Any]:
    return {"control_image": seeded_image(height, width), "control_mask": repaint_mask(height, width)}


# SD3's inpainting ControlNet pipeline (Alimama's): the ControlNet inpaints, taking the masked
# image's latents (encoded once, then repeated for guidance) and the mask as its control image.
PIPELINES["StableDiffusion3ControlNetInpaintingPipeline"] = dataclasses.replace(
    PIPELINES["StableDiffusion3ControlNetPipeline"], class_name="StableDiffusion3ControlNetInpaintingPipeline",
    capture_extras=_control_mask_extras, encodes_guided_control=False)

# Flux Kontext: FluxPipeline's components and text encoders; an edited image's latents are packed
# into tokens after the generated ones (so a bucket names the image's size too), and its VAE
# encoder encodes that image.
PIPELINES["FluxKontextPipeline"] = dataclasses.replace(PIPELINES["FluxPipeline"], class_name="FluxKontextPipeline",
                                                       edits=True)


# What a manifest and a load say of a pipeline built from a derived spec.
UNCURATED = ("built by capture: aotbuild has no entry for this pipeline class. Its denoiser and VAE were found from "
             "the pipeline's component types, their inputs, shapes and guidance batching from the calls the pipeline "
             "made at capture, and each compiled model was checked against eager on those calls. Nothing else was "
             "tested by aotbuild: other calls (img2img or editing, LoRAs, another text length or scheduler) are "
             "served only where they match a recorded signature, and refused otherwise")


def pipeline_spec(class_name: str) -> PipelineSpec:
    """The spec of a pipeline class: its entry, else one derived from the diffusers class."""
    spec = PIPELINES.get(class_name) or derived_spec(class_name)
    if spec is None:
        reason = not_derivable(class_name)
        if reason is None:
            raise TargetError(
                f"pipeline {class_name!r} is neither one aotbuild knows ({', '.join(PIPELINES)}) nor a diffusers "
                f"pipeline class with a transformer or unet to compile"
            )
        raise TargetError(f"pipeline {class_name!r} {reason}")
    return spec


@functools.cache  # asked by derived_spec, then by pipeline_spec for its message
def not_derivable(class_name: str) -> str | None:
    """Why a diffusers pipeline class gets no derived spec, in what it makes and takes (None: not a
    diffusers pipeline class, or one that gets a spec)."""
    import diffusers

    from .private_apis import sets_attention_processors

    cls = getattr(diffusers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        return None
    init = inspect.signature(cls.__init__).parameters
    call = inspect.signature(cls.__call__).parameters
    types = _component_types(cls)
    if any("audio" in name for name in call) or "Audio" in class_name:  # Stable Audio 3 names none
        made = "a video with its sound" if FRAMES in call else "audio, not images or videos"
        return f"makes {made}: aotbuild compiles image and silent video pipelines"
    held = next((name for name in ("transformer", "unet") if name in init), None)
    try:
        hint = typing.get_type_hints(cls.__init__).get(held)
    except (NameError, TypeError):  # an annotation that does not resolve here
        hint = None
    if held is not None and held not in types and isinstance(hint, type):  # a class, not a diffusers model
        return (f"runs its {held} outside torch ({hint.__name__}): there is nothing for aotbuild to compile; build "
                f"the torch pipeline of the same model")
    if held is None:
        denoiser = next((name for name in ("prior", "decoder") if name in init), None)
        if denoiser is None:
            return None
        return (f"denoises with a `{denoiser}` and no `transformer` or `unet`, which aotbuild does not compile; it "
                f"compiles pipelines that make images or videos from a prompt with one transformer or UNet")
    if "prompt" not in call:
        first = next(name for name in call if name != "self")
        return (f"takes no `prompt` (its call starts from `{first}`): aotbuild captures pipelines prompted with "
                f"text as `prompt`")
    if "vae" not in init:  # Kandinsky's `movq`, DeepFloyd IF's pixels: no stride to size a bucket by
        quantized = next((name for name in ("movq", "vqvae") if name in init), None)
        how = f"decodes its latents with a VQ model (`{quantized}`)" if quantized else "denoises pixels"
        return f"{how}, with no `vae`: aotbuild sizes a pipeline it has no entry for by its VAE"
    if "pag_scale" in call:
        return ("guides with perturbed attention (PAG): its call swaps the denoiser's attention for part of each "
                "batch, which aotbuild does not compile; build the pipeline without PAG")
    if sets_attention_processors(cls):  # FLUX.2 [klein] KV's key/value cache, Attend-and-Excite, SAG, Text2Video-Zero
        return (f"sets its {held}'s attention processors (its own attention, in place of the model's): a compiled "
                f"{held}'s attention is fixed when it is built; build the pipeline that calls the model as it is")
    video = call.get("video")
    if (FRAMES not in call and any(name == "video" or name.endswith("_video") for name in call)
            or video is not None and video.default is inspect.Parameter.empty):
        return ("makes a video from the video it is given, as many frames as that video has: aotbuild compiles video "
                "pipelines whose call names its frames (`num_frames`)")
    named = next((name for name in ("frames", "video_length") if name in call and FRAMES not in call), None)
    if named:  # Sana Video's `frames`, Latte's `video_length`
        return (f"names its video's frame count `{named}`: aotbuild captures a video pipeline's frames as "
                f"`{FRAMES}`, which its call does not take")
    if "Upscale" in class_name:  # its output is larger than the image it denoises: no size of a call's to compile
        return ("upscales the image it is given (its output's pixels are a multiple of the image's): aotbuild compiles "
                "pipelines that make the size a call names, or the size of the image they start from")
    if not {"height", "width"} <= call.keys() and "image" not in call:
        return "takes neither a height and width nor an image to size its output by"
    return None


@functools.cache
def derived_spec(class_name: str) -> PipelineSpec | None:
    """A spec for a diffusers pipeline class without an entry, from the model classes its
    `__init__` names: the `transformer` or `unet` as the denoiser (called as the pipeline calls
    it, `return_dict=False` pinned where it takes one), the `vae`'s decoder and encoder when it is
    one aotbuild compiles (`COMPILED_VAES`). What the pipeline passes and how shapes and
    guidance batches follow the call are found by capture, as for every pipeline. None: not such
    a class."""
    import diffusers

    cls = getattr(diffusers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        return None
    types = _component_types(cls)
    attribute = next((a for a in ("transformer", "unet") if a in types), None)
    if attribute is None:
        return None
    if not_derivable(class_name):
        return None
    model = types[attribute]
    takes_return_dict = "return_dict" in inspect.signature(model.forward).parameters
    components = {attribute: dataclasses.replace(
        UNET if attribute == "unet" else TRANSFORMER, name=attribute, attribute=attribute,
        read_attributes=_attributes_read(cls, attribute),
        call_inputs=_forward_without_return_dict if takes_return_dict else _as_called,
        output_class=_output_class(model.forward) if takes_return_dict else None)}
    if types.get(f"{attribute}_2") is model:  # Wan 2.2 A14B: a second expert, switched to at boundary_ratio
        components[f"{attribute}_2"] = dataclasses.replace(components[attribute], name=f"{attribute}_2",
                                                           attribute=f"{attribute}_2",
                                                           read_attributes=_attributes_read(cls, f"{attribute}_2"))
    if issubclass(types.get("vae", type(None)), tuple(getattr(diffusers, name) for name in COMPILED_VAES)):
        components |= {"vae_decoder": VAE_DECODER, "vae_encoder": VAE_ENCODER}
    packed = hasattr(cls, "_pack_latents")  # 2x2 latent patches per token, packed by the pipeline
    stride = _unet_pixel_stride if attribute == "unet" else functools.partial(_derived_stride, packed)
    multiple = call_multiple(cls)
    return PipelineSpec(
        class_name=class_name, components=components,
        pixel_stride=functools.partial(_lcm_stride, stride, multiple),
        default_stride=math.lcm(64 if attribute == "unet" else 16, multiple), default_pixels=None,
        prompt_embeds=None, curated=False, capture_extras=_picture_extras(cls),
        makes_video=FRAMES in inspect.signature(cls.__call__).parameters)  # Wan's, CogVideoX's, LTX's


def call_multiple(cls: type) -> int:
    """The multiple a pipeline's own input check holds height and width to, where it writes one
    (`height % 16 != 0` in Wan's, 32 in LTX-Video's): a stricter stride than the model's, for a
    tiny VAE; 1 where it writes none."""
    from .private_apis import check_inputs_multiple

    return check_inputs_multiple(cls) or 1


def _lcm_stride(stride: Callable[[dict[str, dict]], int], multiple: int, configs: dict[str, dict]) -> int:
    return math.lcm(stride(configs), multiple)


# Pipelines that size their call from the image they edit: its aspect ratio at this area, for the
# image the transformer reads and for the output when the call gives no size. Their signature
# defaults the image to None, yet they cannot run without one.
SIZED_BY_IMAGE = {"QwenImageEditPipeline": 1024 * 1024, "QwenImageEditPlusPipeline": 1024 * 1024}
# Of those, the pipelines whose call edits a list of images together (Qwen-Image-Edit-2509/2511:
# "Picture 1: ..., Picture 2: ..."), each resized at its own aspect ratio: each image's tokens join
# the denoiser's sequence and its size is a constant of the compiled model, so a target names them.
EDITS_SEVERAL = ("QwenImageEditPlusPipeline",)


def resized_image(class_name: str, height: int, width: int) -> tuple[int, int] | None:
    """(height, width) px a `SIZED_BY_IMAGE` pipeline resizes an image of this aspect ratio to, by
    its own module's `calculate_dimensions`, for its VAE encoder (None: another pipeline)."""

    import diffusers

    area = SIZED_BY_IMAGE.get(class_name)
    if area is None:
        return None
    module = sys.modules[getattr(diffusers, class_name).__module__]
    resized_width, resized_height = module.calculate_dimensions(area, width / height)[:2]
    return resized_height, resized_width


def requires_image(cls: type) -> bool:
    """Whether a pipeline's call cannot run without an image (Wan's image-to-video: the video starts
    from it, resized to the call's size; Qwen-Image-Edit's edit; a T2I-Adapter's condition)."""
    if cls.__name__ in SIZED_BY_IMAGE:
        return True
    parameter = inspect.signature(cls.__call__).parameters.get("image")
    # An image-to-video pipeline whose signature defaults its image to None (LTX-Video's) needs one
    # too, as does a pipeline whose `adapter` reads it (T2I-Adapter's, at the call's size).
    follows = any(name in cls.__name__ for name in ("ImageToVideo", "I2V", "Image2Video")) \
        or "adapter" in inspect.signature(cls.__init__).parameters
    return parameter is not None and (parameter.default is inspect.Parameter.empty or follows)


def starts_from_image(cls: type) -> bool:
    """Whether a pipeline's call starts from an image its signature defaults to None: img2img (it
    takes a `strength`), inpainting (a `mask_image`), InstructPix2Pix (`image_guidance_scale`)."""
    parameters = inspect.signature(cls.__call__).parameters
    return "image" in parameters and bool(parameters.keys() & {"strength", "mask_image", "image_guidance_scale"})


def control_image_argument(cls: type) -> str | None:
    """The argument through which a ControlNet pipeline's call takes its control image: `image` in
    SDXL's and SD 1.5's text-to-image ones, `control_image` in the others; None: a pipeline with no
    ControlNet."""
    parameters = inspect.signature(cls.__call__).parameters
    if "controlnet" not in inspect.signature(cls.__init__).parameters:
        return None
    return "control_image" if "control_image" in parameters else "image"


def inpaints_control_image(cls: type) -> bool:
    """Whether a ControlNet pipeline inpaints its control image, taking the mask as `control_mask`
    (SD3's inpainting ControlNet pipeline)."""
    return "control_mask" in inspect.signature(cls.__call__).parameters


def edits_image(cls: type) -> bool:
    """Whether a pipeline's call edits the image it takes (Flux Kontext, FLUX.2, Qwen-Image-Edit,
    Wan's image-to-video) rather than starting img2img from it: an image and no `strength` (and
    not a ControlNet's control image)."""
    parameters = inspect.signature(cls.__call__).parameters
    return "image" in parameters and "strength" not in parameters and control_image_argument(cls) != "image"


def _picture_extras(cls: type) -> Callable[[int, int, int], dict[str, Any]] | None:
    """The pictures a derived pipeline's capture passes, by the arguments its call takes: the
    image a pipeline requires, or img2img starts from (it takes a `strength`: captured at 1, so
    its steps are text-to-image's), inpaints (`mask_image`, `repaint_mask`) or follows
    (InstructPix2Pix's `image_guidance_scale`); a Control pipeline's `control_image`. None: text
    alone."""
    parameters = inspect.signature(cls.__call__).parameters
    names = []
    if requires_image(cls) or starts_from_image(cls):
        names.append("image")
    names += [name for name in ("mask_image", "control_image") if name in parameters]
    if not names:
        return None
    return functools.partial(_seeded_pictures, tuple(names), "strength" in parameters and "image" in names)


def _seeded_pictures(names: tuple[str, ...], strength: bool, batch: int, height: int, width: int) -> dict[str, Any]:
    pictures = {name: repaint_mask(height, width) if name == "mask_image" else seeded_image(height, width)
                for name in names}
    return pictures | ({"strength": 1.0} if strength else {})


def _attributes_read(cls: type, attribute: str) -> tuple[str, ...]:
    """The attributes of `self.<attribute>` a pipeline class's code reads (Z-Image reads
    `transformer.in_channels`), less those every stand-in has; the build records the ones that are
    plain values (`plain_attribute`)."""
    from .private_apis import attributes_read

    return tuple(sorted(path for path in set(attributes_read(cls, attribute))
                        if path.split(".")[0] not in ("config", "dtype", "device")))


def plain_attribute(value: Any) -> bool:
    """Whether a module attribute is data a manifest can hold (an int, a tuple of them...)."""
    if isinstance(value, (tuple, list)):
        return all(plain_attribute(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _component_types(cls: type) -> dict[str, type]:
    """The diffusers model class each `__init__` argument of a pipeline class names."""
    from diffusers import ModelMixin

    try:
        hints = typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):  # an annotation that does not resolve here
        return {}
    return {name: found for name, hint in hints.items() if (found := _named_subclass(hint, ModelMixin))}


def _output_class(forward: Callable) -> str | None:
    """Dotted path of the `BaseOutput` class a forward returns with `return_dict=True`, if any: the
    one its return annotation names, else the one its source returns."""
    from diffusers.utils import BaseOutput

    try:
        found = _named_subclass(typing.get_type_hints(forward).get("return"), BaseOutput)
    except (NameError, TypeError):
        found = None
    if found is None:  # annotated as a tensor (Wan, LTX-Video): the class its return_dict branch builds
        from .private_apis import returned_classes

        found = next((cls for cls in returned_classes(forward) if issubclass(cls, BaseOutput)), None)
    return f"{found.__module__}.{found.__qualname__}" if found else None


def _named_subclass(hint: Any, base: type) -> type | None:
    """The first subclass of `base` a type hint names, itself or in a union (`X | None`)."""
    return next((option for option in (hint, *typing.get_args(hint))
                 if isinstance(option, type) and issubclass(option, base)), None)


def _as_called(args: tuple, kwargs: dict) -> CallInputs:
    return tuple(args), dict(kwargs)


def _derived_stride(packed: bool, configs: dict[str, dict]) -> int:
    """Pixels per latent token: the VAE factor x the patch, which is the pipeline's 2 x 2 packing
    where it packs latents (Flux, Chroma, FLUX.2, Qwen-Image: their transformer's own patch_size,
    where it has one, describes the packed tokens), else the transformer's patch_size."""
    config, vae = configs["transformer"], configs.get("vae", {})
    # Z-Image's transformer lists the patch sizes it has embedders for; its pipeline calls the first.
    patch = config.get("patch_size") or (config.get("all_patch_size") or [1])[0]
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch  # (frames, height, width) patches
    if "scale_factor_spatial" in vae:  # Wan's VAE says it
        factor = vae["scale_factor_spatial"]
    elif "spatio_temporal_scaling" in vae:  # LTX-Video's VAE patches, then halves per scaling block
        factor = vae.get("spatial_compression_ratio") or vae["patch_size"] * 2 ** sum(vae["spatio_temporal_scaling"])
    elif "block_out_channels" in vae or "temperal_downsample" in vae:
        factor = _vae_factor(configs)
    else:  # the common 8; a size the pipeline cannot take fails its capture, naming the size
        factor = 8
    return factor * (2 if packed else patch)


def exact_size(pipeline_class: type, height: int, width: int, *, editing: bool = False,
               frames: int | None = None) -> dict[str, Any]:
    """The call's arguments for an image (or a video of `frames` frames) of exactly height x width
    pixels (editing an image at the size it is given), where the pipeline would choose another:
    Flux Kontext scales the size to `max_area` (1024 x 1024 by default) and resizes the edited
    image to a size it was trained at."""
    parameters = inspect.signature(pipeline_class.__call__).parameters
    # Where the call takes no size, its output is the size of the image it starts from (img2img).
    arguments: dict[str, Any] = {"height": height, "width": width} if "height" in parameters else {}
    if frames is not None:
        arguments[FRAMES] = frames
    if "max_area" in parameters:
        arguments["max_area"] = height * width
    if editing and "_auto_resize" in parameters:
        arguments["_auto_resize"] = False
    return arguments


def size_arguments(class_name: str) -> str:
    """The arguments a call of this pipeline class gives for a size of its own choosing."""
    import diffusers

    cls = getattr(diffusers, class_name, None)
    if cls is not None and "max_area" in inspect.signature(cls.__call__).parameters:  # Flux Kontext
        return "height, width and max_area=height*width"
    return "height and width"


def default_text_length(class_name: str) -> int | None:
    """The text length a pipeline class pads its prompt to by default (its call's
    `max_sequence_length`), or None when its call takes no such argument."""
    import diffusers

    parameter = inspect.signature(getattr(diffusers, class_name).__call__).parameters.get(TEXT)
    return parameter.default if parameter is not None and isinstance(parameter.default, int) else None


def frames_step(pipe: Any) -> int:
    """A loaded video pipeline's frame count is 1 + a multiple of this (Wan and CogVideoX name it
    `vae_scale_factor_temporal`, LTX-Video `vae_temporal_compression_ratio`); 1 for images."""
    return getattr(pipe, "vae_scale_factor_temporal", None) or getattr(pipe, "vae_temporal_compression_ratio", 1)


def frames_around(frames: int, step: int) -> tuple[int, int] | None:
    """None where a video pipeline makes `frames` frames (1 + a multiple of `step`, the VAE's
    temporal compression), else the counts it makes just below and above: diffusers rounds any
    other count, warning only."""
    if (frames - 1) % step == 0:
        return None
    below = (frames - 1) // step * step + 1
    return below, below + step


def frame_stride(configs: dict[str, dict]) -> int:
    """A video's frame count is 1 + a multiple of this: the VAE's temporal compression (Wan's and
    Qwen-Image's VAEs halve the frames once per `temperal_downsample` that is true)."""
    vae = configs.get("vae", {})
    if "scale_factor_temporal" in vae:
        return vae["scale_factor_temporal"]
    if "temperal_downsample" in vae:
        return 2 ** sum(bool(d) for d in vae["temperal_downsample"])
    if vae.get("temporal_compression_ratio"):  # CogVideoX's; LTX-Video's where its config gives it
        return vae["temporal_compression_ratio"]
    if "spatio_temporal_scaling" in vae:  # LTX-Video's, derived as its VAE derives it
        return vae.get("patch_size_t", 1) * 2 ** sum(vae["spatio_temporal_scaling"])
    return 1


def per_prompt(function: Callable) -> str:
    """The argument of a pipeline's call (or `encode_prompt`) that counts images per prompt:
    `num_videos_per_prompt` for video pipelines."""
    parameters = inspect.signature(function).parameters
    return "num_videos_per_prompt" if "num_videos_per_prompt" in parameters else "num_images_per_prompt"
