"""The stand-in module a pipeline holds in place of a compiled component."""

from __future__ import annotations

import collections
import contextlib
import importlib
import inspect
import math
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from ..errors import (
    AotbuildError,
    MissingAttributeError,
    ShapeNotSupportedError,
    UnsupportedCallError,
    WeightsMismatchError,
)
from ..manifest import DTYPES
from ..pipelines import EDITS_SEVERAL, SIZED_BY_IMAGE, TEXT, frames_around, pipeline_spec
from ..private_apis import IncompatibleKeys, pytree
from . import step_cache
from .checkpoint import module_tensors, placed_writes
from .guards import StandIn, check_autocast
from .lora import pop_scale
from .variant import CompiledVariant, LoadContext, leaf_name
from .weights import dtype_name, same_layout


class Config(dict):
    """A model config readable as attributes, like diffusers' FrozenDict."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class CompiledComponent(StandIn):
    """Stands in for a pipeline module: keeps its `config`, `dtype`, `device` and the attributes the
    pipeline reads, and routes calls to the compiled variant matching the input shapes.

    Every entry point a diffusers user reaches either does what it does on the eager module or
    refuses (`guards`): its parameters are the bound weights (edits in place reach the next call),
    `load_state_dict` writes into them through the recorded passes, `.to()` can only confirm the
    dtype and device it runs, and calls are taken as the eager forward takes them (arguments left
    out are its defaults). A denoiser takes diffusers' LoRA API (`lora.lora_component_class`). The
    load's lock orders calls and weight switches: a switch waits for a running call and the next
    call sees all of it.
    """

    def __init__(self, name: str, entry: dict[str, Any], variants: list[CompiledVariant],
                 weights: dict[str, torch.Tensor], context: LoadContext, eager: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.component_name = name
        self.config = Config(entry["config"])
        self.variants = variants
        self._weights = weights  # the base weights, bound by pointer: must live as long as the models
        self._lock = context.lock
        self._lora = None  # lora.LoraState, made by the first LoRA call
        self._leaf_paths = {leaf["path"] for v in variants for leaf in v.inputs}
        self._dtype = DTYPES[entry["dtype"]]
        # A VAE compiled in float32 inside a half-precision artifact: diffusers upcasts it itself.
        upcast = entry["dtype"] == "float32" and entry.get("config", {}).get("force_upcast")
        self._also_dtypes = frozenset({DTYPES[entry["target_dtype"]]} if upcast and "target_dtype" in entry else ())
        self._recipe = entry.get("quantize")  # the quant recipe of its weights, if any
        self._unread = frozenset(entry.get("unread", ()))  # weights no compiled code binds (dead, or fused)
        self._device = context.device
        self._spec = pipeline_spec(entry["pipeline"]).component(name)
        self._eager = [eager] if eager is not None else []  # a list: not registered as a submodule
        self._parameters_out: dict[str, torch.nn.Parameter] = {}  # handed out by named_parameters()
        self._weights_seen = False  # parameters() or state_dict() gave the bound tensors out
        self._replaced: str | None = None  # a bound tensor the eager fallback does not have
        self._signature: Any = None
        traced = variants[0].in_spec  # the call as traced: positional count, keyword arguments' specs
        self._traced = (traced.child(0).num_children, {name: spec for name, spec in zip(
            traced.child(1).context, traced.child(1).children(), strict=True) if name != "return_dict"})
        self.last_variant: str | None = None
        for dotted, value in entry.get("attributes", {}).items():
            _set_dotted(self, dotted, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise MissingAttributeError(self.__dict__.get("component_name", type(self).__name__), name) from None

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def denoiser(self) -> bool:
        """Whether this is the pipeline's denoiser (its spec says so)."""
        return self._spec.denoiser

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The base constants by FQN (the artifact's, or another checkpoint's), as bound at load."""
        return self._weights

    # -- parameters and state dicts: the bound weights ----------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The bound weights, named as the compiled code binds them (a fused projection's
        `to_qkv`, an int8 weight's data and scale): in-place edits reach the next call, and a
        parameter whose `.data` is replaced is bound anew before it. Buffers are among them."""
        for fqn in list(self._weights):
            yield (f"{prefix}.{fqn}" if prefix else fqn), self._parameter(fqn)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())  # every bound tensor is listed as a parameter

    def get_parameter(self, target: str) -> torch.nn.Parameter:
        if target not in self._weights:
            raise AttributeError(f"{self.component_name} has no parameter {target!r} (its parameters are named as "
                                 f"the compiled code binds them)")
        return self._parameter(target)

    def _parameter(self, fqn: str) -> torch.nn.Parameter:
        self._weights_seen = True
        param = self._parameters_out.get(fqn)
        if param is None:
            param = self._parameters_out[fqn] = torch.nn.Parameter(self._weights[fqn], requires_grad=False)
        return param

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The bound weights by the compiled code's names (sharing their memory, as an eager
        module's state dict does)."""
        self._weights_seen = True
        destination = collections.OrderedDict() if destination is None else destination
        for fqn, tensor in self._weights.items():
            destination[prefix + fqn] = self._parameter(fqn) if keep_vars else tensor.detach()
        return destination

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """The eager module's `load_state_dict`: tensors named as the eager module names them (any
        subset with `strict=False`) are written into the bound weights through the recorded passes
        (dtype, fused QKV rows, layout, int8 with the recorded scheme), in place: the next call
        computes what the eager module would with them. Nothing changes when anything is wrong.

        Raises:
            WeightsMismatchError: keys missing or unexpected (strict), a tensor of another shape,
                or one the compiled code has no place for.
        """
        eager = self.eager_tensors()
        with self._lock:
            missing, unexpected = key_differences(self.component_name, state_dict, eager, strict)
            self._write(self._planned_writes(state_dict, eager), state_dict)
        return IncompatibleKeys(missing, unexpected)

    def eager_tensors(self) -> dict[str, torch.Tensor]:
        """The eager module's parameters and buffers by name, on the meta device (shapes only)."""
        from .lora import meta_model

        return module_tensors(self._spec.export_module(meta_model(self.config, torch.float32)))

    def _planned_writes(self, state_dict: Mapping[str, torch.Tensor],
                        eager: dict[str, torch.Tensor] | None = None) -> list[tuple[str, slice, torch.Tensor]]:
        """Where the state dict's tensors go in the bound weights (`checkpoint.placed_writes`)."""
        eager = self.eager_tensors() if eager is None else eager
        given = {name: tensor for name, tensor in state_dict.items() if name in eager}
        return placed_writes(self.component_name, given, eager, self._weights, self._dtype, self._recipe,
                             self._unread)

    def _write(self, writes: list[tuple[str, slice, torch.Tensor]], state_dict: Mapping[str, torch.Tensor]) -> None:
        """Write planned values into the bound weights (the caller holds the lock); the LoRA merges
        are made again from them before the next call, and the eager fallback gets them too."""
        with torch.no_grad():
            for fqn, rows, values in writes:
                self._weights[fqn][rows].copy_(values)
        if writes and self._lora is not None:
            self._lora.rebase()
        if self._eager:
            eager = self._spec.export_module(self._eager[0])
            names = {name for name, _ in [*eager.named_parameters(), *eager.named_buffers()]}
            eager.load_state_dict({k: v for k, v in state_dict.items() if k in names}, strict=False)

    def _follow_parameters(self) -> None:
        """A parameter handed out whose `.data` was replaced since (`p.data = new`): bind the new
        tensor, as the eager module would then read it; refused when the compiled code cannot read
        it as it is."""
        for fqn, param in self._parameters_out.items():
            base = self._weights[fqn]
            if param.data_ptr() == base.data_ptr() and param.stride() == base.stride() and param.shape == base.shape \
                    and param.dtype == base.dtype:
                continue
            if not same_layout(param.data, base, base.device):
                raise UnsupportedCallError(
                    f"{self.component_name}: parameter {fqn!r} was replaced by a {list(param.shape)} "
                    f"{dtype_name(param.dtype)} tensor with strides {list(param.stride())} on {param.device}; the "
                    f"compiled code reads {list(base.shape)} {dtype_name(base.dtype)} with strides "
                    f"{list(base.stride())} on {base.device}",
                    hint="write new values into the parameter in place (with torch.no_grad(): p.copy_(new)), or "
                         "use load_state_dict()")
            self._weights[fqn] = param.data
            self._rebind({fqn: param.data})
            self._replaced = fqn
            if self._lora is not None:
                self._lora.rebase()

    # -- weights ------------------------------------------------------------------------------

    def _rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Bind `tensors` (by FQN, each like the base constant it replaces: shape, dtype, strides,
        device) for the next call, in every variant at once, by pointer: writing into a bound
        tensor later changes the next call too."""
        for fqn, tensor in tensors.items():
            base = self._weights.get(fqn)
            if base is None or not same_layout(tensor, base, base.device):
                raise AotbuildError(f"{self.component_name}: cannot bind {fqn!r}: the compiled code reads "
                                    + (f"{list(base.shape)} {base.dtype} with strides {list(base.stride())} on "
                                       f"{base.device}" if base is not None else "no such constant"))
        with self._lock:
            self._bind(tensors)

    def _bind(self, tensors: dict[str, torch.Tensor]) -> None:
        for variant in self.variants:
            variant.rebind(tensors)

    def _lora_state(self) -> Any:
        from .lora import LoraState

        if self._lora is None:
            self._lora = LoraState(self.config, self._dtype, self._device, self._weights, self._rebind,
                                   self._recipe, self._unread)
            self.add_module("lora_shell", self._lora.shell)  # diffusers walks modules() for peft layers
        return self._lora

    # -- step caches: diffusers' CacheMixin (step_cache) ----------------------------------------

    def _step_cache_model(self) -> torch.nn.Module | None:
        """The model tree a step cache hooks: a regional component's (None: one compiled graph)."""
        return None

    def enable_cache(self, config: Any) -> None:
        """diffusers' `enable_cache(config)`: on a regional artifact, the hooks go where diffusers
        puts them on the eager model, around the compiled blocks; refused where they cannot work."""
        if not step_cache.takes_caches(self.config):
            raise MissingAttributeError(self.component_name, "enable_cache", message=(
                f"{self.component_name} ({self.config['_class_name']}) has no enable_cache, eager or compiled: "
                f"diffusers' step caches are for its transformers (CacheMixin)"), hint="run without a step cache")
        with self._lock:
            step_cache.enable(self.component_name, self._step_cache_model(), dict(self.config), config)

    def disable_cache(self) -> None:
        """diffusers' `disable_cache()`: the next call runs every block again."""
        model = self._step_cache_model()
        if step_cache.enabled(model):
            with self._lock:
                model.disable_cache()

    @property
    def is_cache_enabled(self) -> bool:
        return step_cache.enabled(self._step_cache_model())

    def _reset_stateful_cache(self, recurse: bool = True) -> None:
        """What diffusers calls as a pipeline call ends: the cache starts afresh with the next one."""
        if self.is_cache_enabled:
            self._step_cache_model()._reset_stateful_cache(recurse)

    def cache_context(self, name: str, **where: Any) -> contextlib.AbstractContextManager:
        """diffusers' CacheMixin hook (Flux enters it around each call; Wan says where the loop is:
        step_index, sigma): the cache's state for that call, if a cache is on."""
        return step_cache.context(self._step_cache_model(), name, **where)

    # -- calls --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        check_autocast(self.component_name, self._device, self._dtype)
        with self._lock:
            if self._parameters_out:
                self._follow_parameters()
            return self._forward(args, kwargs)

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        return_dict = kwargs.pop("return_dict", True)
        lora_scale = pop_scale(kwargs, self._leaf_paths)  # without adapters it scales nothing, as in diffusers
        if self._lora is not None:
            self._lora.sync(lora_scale)
        call_args, call_kwargs = self._spec.call_inputs(*self._as_traced(args, kwargs))
        for variant in self.variants:
            leaves = variant.flatten(call_args, call_kwargs)
            if leaves is not None and variant.accepts(leaves):
                self.last_variant = variant.name
                outputs = variant.run(leaves)
                break
        else:
            message = unsupported_call(self.component_name, self.variants, call_args, call_kwargs)
            if not self._eager:
                # A size, text length, frame count or guidance the variants do not cover (the message
                # lists what they do): the target can cover it; an input the code lacks, it cannot.
                raise ShapeNotSupportedError(message, hint=COVER_HINT if "this artifact covers:" in message else None)
            if self._lora is not None and self._lora.active:
                raise ShapeNotSupportedError(f"{message}; the eager fallback runs without the LoRA adapters loaded "
                                             f"into the compiled model")
            if reason := self._fallback_differs():
                raise ShapeNotSupportedError(f"{message}; the eager fallback cannot run this {self.component_name}'s "
                                             f"weights: {reason}")
            warnings.warn(f"aotbuild: {message}; running eager", stacklevel=2)
            self.last_variant = "eager"
            with torch.no_grad():
                outputs = self._spec.export_module(self._eager[0])(*call_args, **call_kwargs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        if not return_dict:  # the module's tuple, whatever the class it would return
            return tuple(outputs)
        if self._spec.output_class is None:  # a VAE part: the tensor, as diffusers' encoder/decoder give it
            return outputs[0]
        module_name, class_name = self._spec.output_class.rsplit(".", 1)
        return getattr(importlib.import_module(module_name), class_name)(sample=outputs[0])

    def _fallback_differs(self) -> str | None:
        """Why the eager module kept for the fallback would not compute with the bound weights."""
        if self._replaced is not None:
            return f"parameter {self._replaced!r} was replaced, and the eager module keeps the tensor it had"
        if self._weights_seen:
            eager = {t.data_ptr() for t in module_tensors(self._spec.export_module(self._eager[0])).values()}
            if not all(t.data_ptr() in eager for t in self._weights.values()):
                return ("its parameters were handed out (parameters(), state_dict()) and may have been edited in "
                        "place, and the eager module holds its own copy of them")
        return None

    def _as_traced(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call as the compiled code was traced: each argument the traced call passed by
        position or by name, where this call passes it either way; the ones it leaves out taken at
        the eager forward's defaults; an empty dict and None alike where diffusers passes either
        for "no attention kwargs". Arguments the traced call did not have stay, for the refusal
        to name them."""
        positional, keywords = self._traced
        if len(args) == positional and kwargs.keys() == keywords.keys():
            # The pipeline's own calls: already as traced (binding the signature costs ~30 us a call).
            return args, {name: _empty_as_traced(value, keywords[name]) for name, value in kwargs.items()}
        signature = self._forward_signature()
        if signature is None:
            return args, kwargs
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:  # what the eager forward says of the same call
            raise TypeError(f"{self.component_name}.forward(): {exc}") from None
        bound.apply_defaults()
        values = bound.arguments
        names = list(signature.parameters)
        call_kwargs = {name: _empty_as_traced(values[name], spec) for name, spec in keywords.items()}
        for name in names[positional:]:
            if name not in call_kwargs and name != "return_dict" and values[name] is not None \
                    and values[name] is not signature.parameters[name].default:
                call_kwargs[name] = values[name]
        return tuple(values[name] for name in names[:positional]), call_kwargs

    def _forward_signature(self) -> inspect.Signature | None:
        """The eager forward's signature without `self` (a denoiser's; None for a VAE part, whose
        diffusers code calls it with one tensor, or a forward taking *args or **kwargs)."""
        if self._signature is None:
            self._signature = False
            if self._spec.output_class is not None:
                import diffusers

                cls = getattr(diffusers, self.config.get("_class_name", ""), None)
                if cls is not None:
                    parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
                    if all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters):
                        self._signature = inspect.Signature(parameters)
        return self._signature or None

    def extra_repr(self) -> str:
        return f"{self.component_name}, variants={[v.name for v in self.variants]}"


def _empty_as_traced(value: Any, traced: Any) -> Any:
    """None where the traced call passed None, {} where it passed an empty dict, for either."""
    if value is None and traced.type is dict and traced.num_children == 0:
        return {}
    if isinstance(value, dict) and not value and traced.is_leaf():
        return None
    return value


def key_differences(component: str, state_dict: Mapping[str, torch.Tensor], eager: dict[str, torch.Tensor],
                     strict: bool) -> tuple[list[str], list[str]]:
    """(missing keys, unexpected keys) of a state dict against the eager module's names; with
    `strict`, either is a WeightsMismatchError naming them, as the eager module would refuse."""
    missing = sorted(set(eager) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(eager))
    if strict and (missing or unexpected):
        def listed(keys: list[str]) -> str:
            return ", ".join(map(repr, keys[:3])) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

        problems = ([f"missing keys {listed(missing)}"] if missing else []) + (
            [f"unexpected keys {listed(unexpected)}"] if unexpected else [])
        raise WeightsMismatchError(f"{component}.load_state_dict(strict=True): {'; '.join(problems)}; nothing was "
                                   f"loaded")
    return missing, unexpected


def _images(low: int, high: int, what: str = "image") -> str:
    return f"{low} {what}{'s' * (high > 1)}" if low == high else f"{low}-{high} {what}s"


def variant_coverage(entry: dict[str, Any]) -> str:
    """What a variant serves, in the pipeline call's terms: "64x96 px, 1-2 images, with and
    without guidance" for a bucket, ranges for the dynamic model, tile sizes for a tile model."""
    guidance = entry.get("guidance")
    suffix = "" if guidance is None else ", " + {("guided",): "with guidance only",
                                                  ("unguided",): "without guidance only"}.get(
        tuple(guidance), "with and without guidance")
    if entry.get("tile"):
        d = entry["dynamic"]
        return (f"tiles up to {d['height'][1]}x{d['width'][1]} px (multiples of {d['stride']} px), "
                f"{_images(*d['batch'])}")
    lengths = text_lengths(entry)
    text = "" if lengths is None else f", text length {_span(lengths)}"
    if "dynamic" in entry:
        d = entry["dynamic"]
        fixed = d["height"][0] == d["height"][1] and d["width"][0] == d["width"][1]
        multiples = "" if fixed else f" (multiples of {d['stride']})"
        size = f"{_span(d['height'])}x{_span(d['width'])} px{multiples}"
        if "frames" in d:  # "5-13 frames (1 + multiples of 4) at 32-64x32-64 px (multiples of 16), 1 video"
            step = f" (1 + multiples of {d['frame_stride']})" if d["frames"][0] != d["frames"][1] else ""
            return f"{_span(d['frames'])} frames{step} at {size}, {_images(*d['batch'], 'video')}{text}{suffix}"
        return f"{size}{_edited(d)}, {_images(*d['batch'])}{text}{suffix}"
    b = entry["bucket"]
    edit = f" editing a {b['image'][0]}x{b['image'][1]} px image" if "image" in b else _edited(b)
    if "frames" in b:  # a video: "81 frames at 480x832 px, 1 video"
        return f"{b['frames']} frames at {b['height']}x{b['width']} px, {_images(1, b['batch'], 'video')}{text}{suffix}"
    return f"{b['height']}x{b['width']} px{edit}, {_images(1, b['batch'])}{text}{suffix}"


def _edited(covered: dict[str, Any]) -> str:
    """The images a variant's calls edit, where its target named them (`images`): " editing a
    64x128 px image", " editing 64x64 + 64x128 px images together"."""
    sizes = [f"{height}x{width}" for height, width in covered.get("images", ())]
    if len(sizes) < 2:
        return "".join(f" editing a {size} px image" for size in sizes)
    return f" editing {' + '.join(sizes)} px images together"


def _span(low_high: tuple[int, int]) -> str:
    """512, or 128-512."""
    low, high = low_high
    return str(low) if low == high else f"{low}-{high}"


def text_lengths(entry: dict[str, Any]) -> tuple[int, int] | None:
    """The text lengths (`max_sequence_length`) a variant was compiled for, as (min, max); None
    when its pipeline takes none, or for an artifact built before text length was a shape."""
    if "dynamic" in entry:
        lengths = entry["dynamic"].get(TEXT)
        return (lengths[0], lengths[1]) if lengths else None
    length = entry.get("bucket", {}).get(TEXT)
    return (length, length) if length else None


def variant_covers(entry: dict[str, Any], images: int, height: int, width: int, guided: bool,
                   text: int | None = None, frames: int | None = None) -> bool:
    """Whether a denoiser variant serves a text-to-image (or text-to-video, of `frames` frames)
    pipeline call of `images` at height x width pixels, with guidance or without, at text length
    `text` (None: the pipeline's default, or it takes none): what `variant_coverage` says, as a
    test. A bucket compiled for editing an image serves no such call: the edited image's tokens
    are part of its sequence."""
    guidance = entry.get("guidance")
    if entry.get("tile") or (guidance is not None and ("guided" if guided else "unguided") not in guidance):
        return False
    lengths = text_lengths(entry)
    if text is not None and lengths is not None and not lengths[0] <= text <= lengths[1]:
        return False
    if "dynamic" in entry:
        d = entry["dynamic"]
        in_frames = "frames" not in d or (frames is not None and d["frames"][0] <= frames <= d["frames"][1]
                                          and frames_around(frames, d["frame_stride"]) is None)
        return in_frames and d["batch"][0] <= images <= d["batch"][1] and all(
            d[axis][0] <= size <= d[axis][1] and size % d["stride"] == 0
            for axis, size in (("height", height), ("width", width)))
    b = entry["bucket"]
    return ((b["height"], b["width"], b.get("frames")) == (height, width, frames) and 1 <= images <= b["batch"]
            and "image" not in b)


# Inputs a diffusers feature adds to a call, named as the user asks for that feature.
FEATURE_INPUTS = {
    "skip_layers": "SD3 skip-layer guidance (skip_guidance_layers=...)",
    "down_block_additional_residuals": "a ControlNet",
    "mid_block_additional_residual": "a ControlNet",
    "block_controlnet_hidden_states": "a ControlNet",
    "controlnet_block_samples": "a ControlNet",
    "controlnet_single_block_samples": "a ControlNet",
    "added_cond_kwargs.image_embeds": "an IP-Adapter",
    "cross_attention_kwargs.ip_adapter_masks": "IP-Adapter masks",
    "timestep_cond": "a guidance embedding (time_cond_proj_dim)",
}

COVER_HINT = ("cover this call in the target (a [[shapes]] bucket, or a wider [dynamic] range) and rebuild: aotbuild "
              "build --target NAME --force; or load with eager_fallback=True to run such calls eager")

# The denoiser's constant inputs a pipeline call's argument sets, to name that argument in refusals.
CALL_SETS = {"rope_interpolation_scale": "frame_rate"}  # LTX-Video: VAE temporal compression / frame_rate


# Inputs that are sizes as Python values, constants of the compiled model: Qwen-Image's
# transformer takes each image's (frames, height, width) in latent patches as a list.
SIZE_CONSTANTS = {"img_shapes": "(each image's frames, height and width in latent patches: the output's, then each "
                                 "edited image's)"}


def _sizes_not_compiled(component: str, head: str, given: dict[str, Any], expected: dict[str, dict],
                        variants: list[CompiledVariant]) -> str:
    """A size input the compiled code holds as constants, in the call's terms: the sizes asked for
    and compiled, per image of the first prompt."""

    def per_image(values: dict[str, Any]) -> str:
        images: dict[str, list[str]] = {}
        for path, value in values.items():
            parts = path.split(".")
            if parts[0] == head and len(parts) == 4 and parts[1] == "0":
                images.setdefault(parts[2], []).append(str(value))
        return ", ".join(f"({', '.join(v)})" for v in images.values())

    call = pipeline_call()
    asked = "" if call is None else f" ({_call_text(call, ('height', 'width'))})"
    covered = "; ".join(variant_coverage(v.entry) for v in variants)
    return (f"{component}: this call's image sizes are not compiled: {head} {SIZE_CONSTANTS[head]} is "
            f"{per_image({p: x for p, x in given.items()})} in this call{asked}, compiled "
            f"{per_image({p: e.get('value') for p, e in expected.items()})}: sizes the compiled model holds as "
            f"constants{_resized_by_pipeline(call)}; this artifact covers: {covered}")


def _resized_by_pipeline(call: tuple[str, dict[str, Any]] | None) -> str:
    """Why a SIZED_BY_IMAGE pipeline's edit is of sizes the call did not give ("" for another)."""
    if call is None or call[0] not in SIZED_BY_IMAGE:
        return ""
    side = math.isqrt(SIZED_BY_IMAGE[call[0]])
    if call[0] in EDITS_SEVERAL:
        return (f"; {call[0]} resizes each image to edit to ~{side}x{side} px at its own aspect ratio, and an "
                f"artifact edits the images its target names (a bucket's or [dynamic]'s `images`; by default one "
                f"image of the bucket's height x width), in their order")
    return (f"; {call[0]} resizes the image to edit to ~{side}x{side} px at its own aspect ratio, and an artifact "
            f"edits one image per call, of its buckets' aspect ratios (a bucket's height x width is captured "
            f"editing an image of that size)")


def unsupported_call(component: str, variants: list[CompiledVariant], args: tuple, kwargs: dict) -> str:
    """Why no variant takes this call, in the user's terms: an input the compiled code was not
    traced with (named, with the diffusers feature that adds it), or a size or guidance outside
    what the variants cover (with the pipeline call that asked for it, when one is running)."""
    # The variant whose inputs have this call's structure (variants may edit different numbers of
    # images), else the first: what the call is compared with, input by input.
    reference = next((v for v in variants if v.flatten(args, kwargs) is not None), variants[0])
    expected = {leaf["path"]: leaf for leaf in reference.inputs}
    given = {leaf_name(p): x for p, x in pytree.tree_flatten_with_path((args, kwargs))[0]}
    # The traced call's arguments, empty ones included (Flux's joint_attention_kwargs={} has no leaf).
    heads = {path.split(".")[0] for path in expected} | set(reference.in_spec.child(1).context)
    for path, value in given.items():
        spec = expected.get(path)
        if spec is None:
            head = path.split(".")[0]
            if head in SIZE_CONSTANTS and value is not None:  # more images than compiled (Qwen-Image-Edit-2509's)
                return _sizes_not_compiled(component, head, given, expected, variants)
            if head not in heads:  # a whole argument the traced call did not have (a list: its first item)
                return f"{head!r} is not an input of the compiled {component}{_feature(head)}"
            if value is not None:
                return f"{_input_name(path)} is not an input of the compiled {component}{_feature(path)}"
            continue
        shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
        traced = spec.get("value", "a tensor")
        if shown != traced and not (shown == "a tensor" and "value" not in spec):
            if path.split(".")[0] in SIZE_CONSTANTS:
                return _sizes_not_compiled(component, path.split(".")[0], given, expected, variants)
            argument = CALL_SETS.get(path.split(".")[0])
            if argument and (call := pipeline_call()) and call[1].get(argument) is not None:
                return (f"{component}: {call[0]}'s {argument}={call[1][argument]!r} sets {_input_name(path)} to "
                        f"{shown}, compiled at {traced}; this artifact serves the {argument} it was built at "
                        f"(the call's default)")
            return (f"{_input_name(path)} is {shown} in this call and {traced} in the compiled "
                    f"{component}{_feature(path)}")
    missing = [p for p, spec in expected.items() if p not in given and spec.get("value") not in ("None", "{}")]
    if missing and missing[0].split(".")[0] in SIZE_CONSTANTS:  # fewer images than compiled
        return _sizes_not_compiled(component, missing[0].split(".")[0], given, expected, variants)
    if missing:
        return f"the compiled {component} takes {_input_name(missing[0])}, which this call does not pass"
    shapes = ", ".join(f"{path} {list(x.shape)}" for path, x in given.items() if isinstance(x, torch.Tensor))
    covered = "; ".join(variant_coverage(v.entry) for v in variants)
    if assumed := _assumption_broken(variants, args, kwargs):
        return (f"{component}: this call's sizes ({shapes}) are in the range compiled, but break what the compiled "
                f"code assumes of them: {assumed} (a branch the model's code took at the sizes it was exported at); "
                f"this artifact covers: {covered}, less such sizes; cover them with a [[shapes]] bucket and rebuild")
    call = pipeline_call()
    asked = ""
    if call is not None:
        name, values = call
        asked = f" ({_call_text(call)})"
        cap, text = values.get(TEXT), _text_length(variants, args, kwargs)
        lengths = [text_lengths(v.entry) for v in variants]
        if text is not None and all(r is not None and not r[0] <= text <= r[1] for r in lengths):
            compiled = ", ".join(sorted({_span(r) for r in lengths}))
            asked = f"{TEXT}={cap}" if cap in (None, text) else f"the prompt's tokens; {TEXT}={cap}"
            return (f"{component}: text length {text} ({asked}) in this call; compiled: {compiled}; "
                    f"this artifact covers: {covered}")
        guidance = {g for v in variants for g in v.entry.get("guidance", ())}
        scale = values.get("guidance_scale")
        if guidance and scale is not None:
            wanted = "guided" if scale > 1 else "unguided"
            if wanted not in guidance:
                return (f"{component}: guidance_scale={scale:g} needs the {wanted} variants, which this artifact was "
                        f"built without (rebuild it with guidance = \"both\" in the target); it covers: {covered}")
    edit = ""
    sequences = any(isinstance(d, dict) and d["axis"] == "tokens" for v in variants for leaf in v.inputs
                    for d in leaf.get("dims", ()))
    if sequences and call is not None and call[1].get("image_height") is not None:
        edit = (f" (an edited image of {call[1]['image_height']}x{call[1]['image_width']} px adds its tokens to the "
                f"output's: a dynamic model serves edits whose tokens together fit its range)")
    if component == "vae_encoder":  # Qwen-Image-Edit's encoder sees the image at the size it was resized to
        edit = _resized_by_pipeline(call)
    return f"{component}: no compiled variant for this call{asked}: {shapes}; this artifact covers: {covered}{edit}"


def _text_length(variants: list[CompiledVariant], args: tuple, kwargs: dict) -> int | None:
    """The text length the denoiser is given in this call: the size of an input dim that follows
    the text alone (the padded `max_sequence_length`, or the prompt's real token count where the
    pipeline trims it: Qwen-Image, Z-Image), less the tokens before the prompt's in that sequence
    (Qwen-Image-Edit's edited image)."""
    for variant in variants:
        leaves = variant.flatten(args, kwargs)
        if leaves is None:  # another structure (more or fewer images)
            continue
        for (_, leaf), expected in zip(leaves, variant.inputs, strict=True):
            for d, dim in enumerate(expected.get("dims", ())):
                if isinstance(dim, dict) and dim["axis"] == TEXT and isinstance(leaf, torch.Tensor):
                    return leaf.shape[d] - dim.get("offset", 0)
    return None


def _assumption_broken(variants: list[CompiledVariant], args: tuple, kwargs: dict) -> str | None:
    """The guard a dynamic variant's export took that these inputs break, where their sizes are
    otherwise in its range, with its symbols named as inputs ("s43 = args[2].0 dim 0")."""
    for variant in variants:
        leaves = variant.flatten(args, kwargs)
        guard = variant.broken_guard(leaves) if leaves is not None else None
        if guard:
            named: dict[str, str] = {}
            for leaf in variant.inputs:
                for i, d in enumerate(leaf.get("dims", ())):
                    for symbol in re.findall(r"[A-Za-z_]\w*", d.get("expr", "") if isinstance(d, dict) else ""):
                        named.setdefault(symbol, f"{leaf['path']} dim {i} = {d['expr']}")
            found = sorted(set(re.findall(r"[A-Za-z_]\w*", guard)) & set(named))
            return f"{guard} ({'; '.join(named[s] for s in found)})" if found else guard
    return None


def _input_name(path: str) -> str:
    head, _, rest = path.partition(".")
    return f"{head} key {rest!r}" if rest else repr(head)


def _feature(path: str) -> str:
    feature = FEATURE_INPUTS.get(path) or FEATURE_INPUTS.get(path.split(".")[0])
    return f" ({feature} is not compiled)" if feature else ""


def _call_text(call: tuple[str, dict[str, Any]], names: tuple[str, ...] | None = None) -> str:
    """`Pipeline(height=64, width=64, ...)`: a `pipeline_call()`'s arguments that were given
    (`names`: only these)."""
    name, values = call
    shown = ", ".join(f"{k}={v!r}" for k, v in values.items() if v is not None and (names is None or k in names))
    return f"{name}({shown})"


def pipeline_call() -> tuple[str, dict[str, Any]] | None:
    """The diffusers pipeline call running on this thread, if any: its class and the arguments
    that choose a variant (read from its frame, to phrase errors in the caller's terms)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "__call__" and type(owner).__module__.startswith("diffusers.pipelines"):
            # Flux Kontext scales height x width to max_area and resizes the edited image (image_height...).
            names = ("height", "width", "num_frames", "num_images_per_prompt", "num_videos_per_prompt",
                     "guidance_scale", TEXT, "max_area", "image_height", "image_width", "_auto_resize",
                     *CALL_SETS.values())
            return type(owner).__name__, {k: frame.f_locals.get(k) for k in names}
        frame = frame.f_back
    return None


def _set_dotted(root: Any, dotted: str, value: Any) -> None:
    """root.a.b.c = value, creating plain namespaces for the missing parents."""
    *parents, leaf = dotted.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            setattr(node, part, SimpleNamespace())
        node = getattr(node, part)
    setattr(node, leaf, value)
