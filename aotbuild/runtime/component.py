"""The stand-in module a pipeline holds in place of a compiled component."""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import warnings
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import AotbuildError, ShapeNotSupportedError
from ..manifest import DTYPES
from ..pipelines import pipeline_spec
from .lora import pop_scale
from .variant import CompiledVariant, leaf_name
from .weights import same_layout


class Config(dict):
    """A model config readable as attributes, like diffusers' FrozenDict."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class CompiledComponent(torch.nn.Module):
    """Stands in for a pipeline module: keeps its `config`, `dtype`, `device` and the attributes the
    pipeline reads, and routes calls to the compiled variant matching the input shapes.

    Its weights are data: `rebind` binds other tensors for some constants, and a denoiser takes
    diffusers' LoRA API (`lora.lora_component_class`). One lock, shared with its variants, orders
    calls and weight switches: a switch waits for a running call and the next call sees all of it.
    """

    def __init__(self, name: str, entry: dict[str, Any], variants: list[CompiledVariant],
                 weights: dict[str, torch.Tensor], device: torch.device,
                 eager: torch.nn.Module | None = None, lock: threading.RLock | None = None) -> None:
        super().__init__()
        self.component_name = name
        self.config = Config(entry["config"])
        self.variants = variants
        self._weights = weights  # the base weights, bound by pointer: must live as long as the models
        self._lock = lock or threading.RLock()
        self._lora = None  # lora.LoraState, made by the first LoRA call
        self._leaf_paths = {leaf["path"] for v in variants for leaf in v.inputs}
        self._dtype = DTYPES[entry["dtype"]]
        self._recipe = entry.get("quantize")  # the quant recipe of its weights, if any
        self._device = device
        self._spec = pipeline_spec(entry["pipeline"]).component(name)
        self._eager = [eager] if eager is not None else []  # a list: not registered as a submodule
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

    def _apply(self, fn: Any, recurse: bool = True) -> CompiledComponent:
        """`.to()` / `.half()` move nothing: the compiled code runs where it was loaded, on the
        weights bound there (and the LoRA shell's weights are meta)."""
        return self

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The base constants by FQN (the artifact's, or another checkpoint's), as bound at load."""
        return self._weights

    def rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Bind `tensors` (by FQN, each like the base constant it replaces: shape, dtype, strides,
        device) for the next call, in every variant at once, by pointer: writing into a bound
        tensor later changes the next call too. torch 2.13 keeps a reference to every tensor ever
        bound (pytorch#194480): bind few distinct tensors and write new values into them."""
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
            self._lora = LoraState(self.config, self._dtype, self._device, self._weights, self.rebind,
                                   self._recipe)
            self.add_module("lora_shell", self._lora.shell)  # diffusers walks modules() for peft layers
        return self._lora

    def cache_context(self, name: str) -> contextlib.AbstractContextManager:
        """diffusers' CacheMixin hook (Flux enters it around each call); nothing to cache here."""
        return contextlib.nullcontext()

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._forward(args, kwargs)

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        return_dict = kwargs.pop("return_dict", True)
        lora_scale = pop_scale(kwargs, self._leaf_paths)  # without adapters it scales nothing, as in diffusers
        if self._lora is not None:
            self._lora.sync(lora_scale)
        call_args, call_kwargs = self._spec.call_inputs(args, kwargs)
        for variant in self.variants:
            leaves = variant.flatten(call_args, call_kwargs)
            if leaves is not None and variant.accepts(leaves):
                self.last_variant = variant.name
                outputs = variant.run(leaves, self._device)
                break
        else:
            message = unsupported_call(self.component_name, self.variants, call_args, call_kwargs)
            if not self._eager:
                raise ShapeNotSupportedError(message)
            if self._lora is not None and self._lora.active:
                raise ShapeNotSupportedError(f"{message}; the eager fallback runs without the LoRA adapters loaded "
                                             f"into the compiled model")
            warnings.warn(f"aotbuild: {message}; running eager", stacklevel=2)
            self.last_variant = "eager"
            with torch.no_grad():
                outputs = self._spec.export_module(self._eager[0])(*call_args, **call_kwargs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        if self._spec.output_class is None:  # a VAE part: the tensor, as diffusers' encoder/decoder give it
            return outputs[0]
        if not return_dict:
            return tuple(outputs)
        module_name, class_name = self._spec.output_class.rsplit(".", 1)
        return getattr(importlib.import_module(module_name), class_name)(sample=outputs[0])

    def extra_repr(self) -> str:
        return f"{self.component_name}, variants={[v.name for v in self.variants]}"


class MissingAttributeError(AotbuildError, AttributeError):
    """An attribute the eager module has and aotbuild's stand-in does not keep. An AttributeError
    too, so `hasattr` and `getattr(..., default)` in diffusers keep working."""

    def __init__(self, component: str, name: str, message: str | None = None, hint: str | None = None) -> None:
        super().__init__(message or f"{component} is compiled by aotbuild and has no attribute {name!r}: the "
                                    f"stand-in keeps the config, dtype, device, the attributes the pipeline reads "
                                    f"and the calls it makes",
                         hint=hint or "call it on an eager pipeline, or load the artifact with eager_fallback=True "
                                      "for calls the compiled code does not cover")


def _images(low: int, high: int) -> str:
    return f"{low} image{'s' * (high > 1)}" if low == high else f"{low}-{high} images"


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
    if "dynamic" in entry:
        d = entry["dynamic"]
        return (f"{d['height'][0]}-{d['height'][1]}x{d['width'][0]}-{d['width'][1]} px (multiples of {d['stride']}), "
                f"{_images(*d['batch'])}{suffix}")
    b = entry["bucket"]
    return f"{b['height']}x{b['width']} px, {_images(1, b['batch'])}{suffix}"


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


def unsupported_call(component: str, variants: list[CompiledVariant], args: tuple, kwargs: dict) -> str:
    """Why no variant takes this call, in the user's terms: an input the compiled code was not
    traced with (named, with the diffusers feature that adds it), or a size or guidance outside
    what the variants cover (with the pipeline call that asked for it, when one is running)."""
    expected = {leaf["path"]: leaf for leaf in variants[0].inputs}
    given = {leaf_name(p): x for p, x in pytree.tree_flatten_with_path((args, kwargs))[0]}
    # The traced call's arguments, empty ones included (Flux's joint_attention_kwargs={} has no leaf).
    heads = {path.split(".")[0] for path in expected} | set(variants[0].in_spec.child(1).context)
    for path, value in given.items():
        spec = expected.get(path)
        if spec is None:
            head = path.split(".")[0]
            if head not in heads:  # a whole argument the traced call did not have (a list: its first item)
                return f"{head!r} is not an input of the compiled {component}{_feature(head)}"
            if value is not None:
                return f"{_input_name(path)} is not an input of the compiled {component}{_feature(path)}"
            continue
        shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
        traced = spec.get("value", "a tensor")
        if shown != traced and not (shown == "a tensor" and "value" not in spec):
            return (f"{_input_name(path)} is {shown} in this call and {traced} in the compiled "
                    f"{component}{_feature(path)}")
    missing = [p for p, spec in expected.items() if p not in given and spec.get("value") not in ("None", "{}")]
    if missing:
        return f"the compiled {component} takes {_input_name(missing[0])}, which this call does not pass"
    shapes = ", ".join(f"{path} {list(x.shape)}" for path, x in given.items() if isinstance(x, torch.Tensor))
    covered = "; ".join(variant_coverage(v.entry) for v in variants)
    call = pipeline_call()
    asked = ""
    if call is not None:
        name, values = call
        asked = f" ({name}({', '.join(f'{k}={v!r}' for k, v in values.items() if v is not None)}))"
        guidance = {g for v in variants for g in v.entry.get("guidance", ())}
        scale = values.get("guidance_scale")
        if guidance and scale is not None:
            wanted = "guided" if scale > 1 else "unguided"
            if wanted not in guidance:
                return (f"{component}: guidance_scale={scale:g} needs the {wanted} variants, which this artifact was "
                        f"built without (rebuild it with guidance = \"both\" in the target); it covers: {covered}")
    return f"{component}: no compiled variant for this call{asked}: {shapes}; this artifact covers: {covered}"


def _input_name(path: str) -> str:
    head, _, rest = path.partition(".")
    return f"{head} key {rest!r}" if rest else repr(head)


def _feature(path: str) -> str:
    feature = FEATURE_INPUTS.get(path) or FEATURE_INPUTS.get(path.split(".")[0])
    return f" ({feature} is not compiled)" if feature else ""


def pipeline_call() -> tuple[str, dict[str, Any]] | None:
    """The diffusers pipeline call running on this thread, if any: its class and the arguments
    that choose a variant (read from its frame, to phrase errors in the caller's terms)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "__call__" and type(owner).__module__.startswith("diffusers.pipelines"):
            names = ("height", "width", "num_images_per_prompt", "guidance_scale")
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
