"""The stand-in module a pipeline holds in place of a compiled component."""

from __future__ import annotations

import contextlib
import importlib
import warnings
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import ShapeNotSupportedError
from ..manifest import DTYPES
from ..pipelines import pipeline_spec
from .variant import CompiledVariant, leaf_name


class Config(dict):
    """A model config readable as attributes, like diffusers' FrozenDict."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class CompiledComponent(torch.nn.Module):
    """Stands in for a pipeline module: keeps its `config`, `dtype`, `device` and the attributes the
    pipeline reads, and routes calls to the compiled variant matching the input shapes."""

    def __init__(self, name: str, entry: dict[str, Any], variants: list[CompiledVariant],
                 weights: dict[str, torch.Tensor], device: torch.device,
                 eager: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.component_name = name
        self.config = Config(entry["config"])
        self.variants = variants
        self._weights = weights  # bound by pointer (user_managed): must live as long as the models
        self._dtype = DTYPES[entry["dtype"]]
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

    def cache_context(self, name: str) -> contextlib.AbstractContextManager:
        """diffusers' CacheMixin hook (Flux enters it around each call); nothing to cache here."""
        return contextlib.nullcontext()

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return_dict = kwargs.pop("return_dict", True)
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
