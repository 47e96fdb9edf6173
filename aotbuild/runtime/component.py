"""The stand-in module a pipeline holds in place of a compiled component."""

from __future__ import annotations

import contextlib
import importlib
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
        if self._spec.method != "forward":
            setattr(self, self._spec.method, self.forward)

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
            if not self._eager:
                raise ShapeNotSupportedError(self._coverage_message(call_args, call_kwargs))
            if self._lora is not None and self._lora.active:
                raise ShapeNotSupportedError(f"{self._coverage_message(call_args, call_kwargs)}; the eager fallback "
                                             f"runs without the LoRA adapters loaded into the compiled model")
            warnings.warn(f"aotbuild: {self._coverage_message(call_args, call_kwargs)}; running eager", stacklevel=2)
            self.last_variant = "eager"
            return getattr(self._eager[0], self._spec.method)(*args, return_dict=return_dict, **kwargs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        if not return_dict:
            return tuple(outputs)
        module_name, class_name = self._spec.output_class.rsplit(".", 1)
        return getattr(importlib.import_module(module_name), class_name)(sample=outputs[0])

    def _coverage_message(self, args: tuple, kwargs: dict) -> str:
        shapes = [f"{leaf_name(p)} {list(x.shape)}" for p, x in pytree.tree_flatten_with_path((args, kwargs))[0]
                  if isinstance(x, torch.Tensor)]
        covered = "; ".join(variant_coverage(v.entry) for v in self.variants)
        return (f"{self.component_name}: no compiled variant for inputs {', '.join(shapes)}; "
                f"this artifact covers (batch x height x width): {covered}")

    def extra_repr(self) -> str:
        return f"{self.component_name}, variants={[v.name for v in self.variants]}"


def variant_coverage(entry: dict[str, Any]) -> str:
    """What shapes a variant serves: "2x64x96" for a bucket, ranges for the dynamic model."""
    if "dynamic" in entry:
        d = entry["dynamic"]
        return (f"{d['batch'][0]}-{d['batch'][1]}x{d['height'][0]}-{d['height'][1]}x{d['width'][0]}-{d['width'][1]} "
                f"(dynamic, multiples of {d['stride']} px)")
    b = entry["bucket"]
    return f"{b['batch']}x{b['height']}x{b['width']}"


def _set_dotted(root: Any, dotted: str, value: Any) -> None:
    """root.a.b.c = value, creating plain namespaces for the missing parents."""
    *parents, leaf = dotted.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            setattr(node, part, SimpleNamespace())
        node = getattr(node, part)
    setattr(node, leaf, value)
