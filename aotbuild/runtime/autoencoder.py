"""The stand-in for a pipeline's VAE: diffusers' own `AutoencoderKL` encode and decode code
(slicing, tiling and blending, the latent distribution) run over the compiled parts, so every
path gives what eager diffusers gives, and a missing part or tile model is named, not a crash."""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import AotbuildError, MissingAttributeError, UnsupportedCallError
from ..spec.pipelines import FRAMEWISE_VAES, vae_factor
from ..spec.private_apis import IncompatibleKeys
from .checkpoint import module_tensors
from .component import CompiledComponent, Config, key_differences
from .guards import StandIn

# AutoencoderKL's methods run as they are on the stand-in: each calls `self.encoder(x)` /
# `self.decoder(z)` per image, slice or tile, and those are the compiled parts.
BORROWED = ("encode", "_encode", "decode", "_decode", "tiled_decode", "_tiled_encode", "tiled_encode",
            "blend_v", "blend_h")
# What each part needs in the target when a call needs it.
PART_COMPONENTS = {"decoder": "vae_decoder", "encoder": "vae_encoder"}


class CompiledAutoencoderBase(StandIn):
    """Holds the compiled `decoder` and `encoder` parts (either may be absent) as diffusers'
    AutoencoderKL holds its own, with its config and tile settings. Its parameters and state dict
    are its parts' bound weights, named as AutoencoderKL names them (each part's export module
    holds `decoder`/`post_quant_conv` or `encoder`/`quant_conv`)."""

    framewise = False  # parts compiled for one frame of a frame-wise causal VAE (FRAMEWISE_VAES)

    def __init__(self, config: dict[str, Any], parts: dict[str, CompiledComponent]) -> None:
        super().__init__()
        self.config = Config(config)
        self.parts = parts  # a plain dict as well: the registered submodules call these
        for name, part in parts.items():
            self.add_module(name, FirstFrame(part) if self.framewise else part)
        # The compiled parts include the quant convs: diffusers' code calls these as no-ops.
        self.quant_conv = self.post_quant_conv = torch.nn.Identity()
        self.use_slicing = False
        self.use_tiling = False
        if self.framewise:
            # What AutoencoderKLQwenImage.__init__ sets that its pipelines (temperal_downsample) and
            # `_decode` read. Its tile sizes are its class defaults, never used: no tiles are built
            # for it, and `enable_tiling` refuses.
            self.z_dim = config["z_dim"]
            self.temperal_downsample = list(config["temperal_downsample"])
            self.temperal_upsample = self.temperal_downsample[::-1]
            self.spatial_compression_ratio = vae_factor(config)
            self.tile_sample_min_height = self.tile_sample_min_width = 256
            self.tile_sample_stride_height = self.tile_sample_stride_width = 192
        else:
            sample_size = config["sample_size"]
            sample_size = sample_size[0] if isinstance(sample_size, (list, tuple)) else sample_size
            self.tile_sample_min_size = config["sample_size"]
            self.tile_latent_min_size = int(sample_size / vae_factor(config))  # as AutoencoderKL.__init__
            self.tile_overlap_factor = 0.25
        self.component_name = "vae"
        self._eager_shapes: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[str]] | None = None
        # FLUX.2's latent BatchNorm, read by its pipeline: the first part's bound tensors (loads
        # write them in place, so it follows every checkpoint the parts take).
        kept = self._first.bound_tensors("bn.")
        if kept:
            self.bn = LatentStatistics(kept)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in PART_COMPONENTS:
                component = PART_COMPONENTS[name]
                raise MissingAttributeError("vae", name, f"this artifact has no {component}: " + (
                    "img2img and inpainting encode images with it" if name == "encoder" else "decoding needs it"),
                    hint=f"add `{component} = {{}}` to [components] in the target and rebuild") from None
            raise MissingAttributeError("vae", name) from None

    @property
    def _first(self) -> CompiledComponent:
        return next(iter(self.parts.values()))

    @property
    def dtype(self) -> torch.dtype:
        return self._first.dtype

    @property
    def device(self) -> torch.device:
        return self._first.device

    @property
    def last_variant(self) -> str | None:
        """The variant the decoder (else the encoder) ran last."""
        return self.parts.get("decoder", self._first).last_variant

    @property
    def also_dtypes(self) -> frozenset[torch.dtype]:
        return self._first.also_dtypes

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The eager VAE's parameters (see `CompiledComponent.named_parameters`): each from the
        compiled part that holds it, on the meta device for a part the artifact does not compile."""
        for name, meta in self.eager_names()[0].items():
            part = self._holder(name)
            yield (f"{prefix}.{name}" if prefix else name), part.parameter(name) if part is not None else \
                torch.nn.Parameter(meta, requires_grad=False)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for name, meta in self.eager_names()[1].items():
            part = self._holder(name)
            yield (f"{prefix}.{name}" if prefix else name), part.eager_tensor(name)[0] if part is not None else meta

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The eager VAE's state dict over the parts' bound weights (meta where no part is compiled)."""
        destination = collections.OrderedDict() if destination is None else destination
        persistent = self.eager_names()[2]
        for name, tensor in self.named_parameters():
            destination[prefix + name] = tensor if keep_vars else tensor.detach()
        for name, tensor in self.named_buffers():
            if name in persistent:
                destination[prefix + name] = tensor.detach()
        return destination

    def eager_names(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[str]]:
        """The eager VAE's parameters and buffers by name, on the meta device, and its persistent
        buffers; made once."""
        if self._eager_shapes is None:
            from .lora import meta_model

            model = meta_model(self.config, self.dtype)
            params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
            self._eager_shapes = params, buffers, set(buffers) & set(model.state_dict(keep_vars=True))
        return self._eager_shapes

    def _holder(self, name: str) -> CompiledComponent | None:
        """The compiled part whose module holds the eager VAE's tensor `name`, if any."""
        return next((part for part in self.parts.values()
                     if name in part.eager_names()[0] or name in part.eager_names()[1]), None)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """AutoencoderKL's `load_state_dict`: each part takes its tensors (see
        `CompiledComponent.load_state_dict`); the tensors of a part the artifact does not compile
        are checked by name only, as that part cannot run. Nothing changes when anything is wrong."""
        from .lora import meta_model

        eager = module_tensors(meta_model(self.config, torch.float32))
        with self._first.lock:
            missing, unexpected = key_differences("vae", state_dict, eager, strict)
            planned = [(part, part.planned_writes(state_dict)) for part in self.parts.values()]
            for part, writes in planned:
                part.write_planned(writes, state_dict)
        return IncompatibleKeys(missing, unexpected)

    def enable_slicing(self) -> None:
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    def enable_tiling(self) -> None:
        """Tiled encode and decode run the parts' tile models; a part built without one is refused
        here, before any call."""
        if self.framewise:
            raise AotbuildError(f"vae.enable_tiling(): aotbuild does not build tiles of {self.config['_class_name']} "
                                f"(its tiled encode and decode cut tiles of their own sizes)",
                                hint="images decode whole: leave tiling off, or run this VAE eager for tiling (a "
                                     "target without vae_decoder and vae_encoder in [components])")
        for name, part in self.parts.items():
            if not any(v.entry.get("tile") for v in part.variants):
                component = PART_COMPONENTS[name]
                raise AotbuildError(f"vae.enable_tiling(): this artifact's {component} has no tile variant",
                                    hint=f"set `{component} = {{ tiling = true }}` in [components] of the target "
                                         f"and rebuild")
        self.use_tiling = True

    def disable_tiling(self) -> None:
        self.use_tiling = False

    def extra_repr(self) -> str:
        return f"parts={list(self.parts)}"


class LatentStatistics(torch.nn.Module):
    """A VAE's latent BatchNorm as its pipeline reads it (`running_mean`, `running_var`): the
    statistics are weights of the checkpoint, never computed here."""

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AotbuildError("vae.bn holds the latent statistics the pipeline reads; aotbuild does not run it")


class FirstFrame(torch.nn.Module):
    """A part of a frame-wise causal VAE as diffusers calls it: frame by frame, with caches of the
    frames before (`feat_cache`, `feat_idx`). Compiled for one frame, whose caches are empty, it
    takes that call without them; the stand-in refuses a call of more frames before any part runs."""

    def __init__(self, part: CompiledComponent) -> None:
        super().__init__()
        self.part = part

    def forward(self, x: torch.Tensor, feat_cache: Any = None, feat_idx: Any = None) -> torch.Tensor:
        return self.part(x)


def _one_frame_only(method: Any, part: str) -> Any:
    """`_encode` / `_decode` of a frame-wise VAE, refusing a video: its parts are compiled for one
    frame (its later frames read the caches of the frames before, which they do not take)."""

    @functools.wraps(method)
    def checked(self: CompiledAutoencoderBase, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if x.ndim == 5 and x.shape[2] != 1:
            raise UnsupportedCallError(
                f"vae.{part.removesuffix('r')}(): {x.shape[2]} frames in this call; this artifact's "
                f"{PART_COMPONENTS[part]} is compiled for images (one frame: its later frames read the caches of "
                f"the frames before)", hint="run the VAE eager for videos: build without vae_decoder and "
                                            "vae_encoder in [components]")
        return method(self, x, *args, **kwargs)

    return checked


@functools.cache
def autoencoder_class(class_name: str = "AutoencoderKL") -> type:
    """CompiledAutoencoderBase with the encode/decode methods of the VAE class (FLUX.2's are
    AutoencoderKL's code; AutoencoderKL's where it lacks one; a frame-wise VAE's `clear_cache` and
    one-frame checks too). diffusers is imported here, when a pipeline is built, not when the
    runtime is."""
    import diffusers

    own, base = getattr(diffusers, class_name, diffusers.AutoencoderKL), diffusers.AutoencoderKL
    methods = {name: own.__dict__.get(name, base.__dict__[name]) for name in BORROWED}
    if class_name in FRAMEWISE_VAES:
        methods |= {"framewise": True, "clear_cache": own.clear_cache,
                    "_encode": _one_frame_only(methods["_encode"], "encoder"),
                    "_decode": _one_frame_only(methods["_decode"], "decoder")}
    return type("CompiledAutoencoder", (CompiledAutoencoderBase,), methods)
