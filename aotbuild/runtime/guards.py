"""What the compiled stand-ins cannot honour exactly, refused in the user's terms before anything
changes, and the diffusers pipeline methods that must ask them first.

A stand-in that accepts a call and does nothing is worse than one that raises: a module whose
compiled code runs one dtype on one device cannot follow `.to(torch.bfloat16)`, autocast, layerwise
casting or another attention kernel. Each such entry point either does exactly what it does on an
eager diffusers model, or raises an `UnsupportedCallError` naming the way that works.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsupportedCallError
from .weights import dtype_name

# What each refused ModelMixin / nn.Module method would change, and the way that works instead.
REFUSED_METHODS: dict[str, tuple[str, str]] = {
    "enable_layerwise_casting": ("stores weights in another dtype and casts them per layer",
                                 "build a target with the dtype you want (dtype = \"bfloat16\", or a quantize recipe)"),
    "enable_group_offload": ("moves weights between devices during each call",
                             "load the artifact on the device it runs on"),
    "enable_parallelism": ("splits the model over devices", "run one replica per device (aotbuild serve)"),
    "enable_gradient_checkpointing": ("is for training: the compiled code computes no gradients",
                                      "train the eager model, then build its weights"),
    "enable_xformers_memory_efficient_attention": ("changes the attention kernel, which is compiled in",
                                                   "set optimize.sdpa in the target and rebuild"),
    "enable_npu_flash_attention": ("changes the attention kernel, which is compiled in",
                                   "set optimize.sdpa in the target and rebuild"),
    "enable_xla_flash_attention": ("changes the attention kernel, which is compiled in",
                                   "set optimize.sdpa in the target and rebuild"),
    "set_attention_backend": ("changes the attention kernel, which is compiled in",
                              "set optimize.sdpa in the target and rebuild"),
    "compile_repeated_blocks": ("compiles the model, which is compiled ahead of time already",
                                "for blocks compiled once each, build with [compile] mode = \"regional\""),
    "compile": ("compiles the model, which is compiled ahead of time already",
                "call it as it is: it runs compiled code from its first call"),
    "save_pretrained": ("saves diffusers weights, and the compiled model holds its weights as its compiled code "
                        "binds them (fused, quantized, in another layout)",
                        "ship the artifact folder (aotbuild push), or save the pipeline it was built from"),
    "push_to_hub": ("pushes diffusers weights, and the compiled model holds its weights as its compiled code "
                    "binds them", "push the artifact: aotbuild push"),
    "from_pretrained": ("loads a diffusers model", "aotbuild.load_pipeline(artifact) or aotbuild.apply(pipe, "
                                                   "artifact)"),
    "apply": ("walks submodules, and the compiled model has none: the function would reach no weight",
              "change weights with load_state_dict(), or through parameters() in place"),
}
# Refused only when they turn something on (`valid=True`); turning it off is what the compiled code does.
REFUSED_WHEN_ENABLING = {
    "set_use_memory_efficient_attention_xformers": "enable_xformers_memory_efficient_attention",
    "set_use_npu_flash_attention": "enable_npu_flash_attention",
    "set_use_xla_flash_attention": "enable_xla_flash_attention",
}


def refusal(component: str, method: str) -> UnsupportedCallError:
    what, instead = REFUSED_METHODS[method]
    return UnsupportedCallError(f"{component}.{method}() {what}; the {component} is compiled by aotbuild",
                                hint=instead)


def refused_method(method: str) -> Callable:
    """A method that raises `refusal` when called, to put on a stand-in class."""
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise refusal(self.component_name, method)

    refused.__name__ = method
    refused.__doc__ = f"Refused: {REFUSED_METHODS[method][0]}."
    return refused


def model_mixin_refusals() -> dict[str, Callable]:
    """The methods a compiled denoiser (a diffusers ModelMixin) refuses, by name."""
    def refuse_enabling(method: str, enabler: str) -> Callable:
        def setter(self: Any, valid: bool, *args: Any, **kwargs: Any) -> None:
            if valid:
                raise refusal(self.component_name, enabler)

        setter.__name__ = method
        return setter

    methods = {name: refused_method(name) for name in REFUSED_METHODS if name not in StandIn.__dict__}
    methods |= {name: refuse_enabling(name, enabler) for name, enabler in REFUSED_WHEN_ENABLING.items()}
    return methods


class StandIn(torch.nn.Module):
    """What every compiled stand-in (a component, the VAE) does with nn.Module's own entry points:
    `.to()` and the like can only confirm the dtype and device it runs; training, `apply(fn)` and
    `compile()` are refused. Subclasses give `component_name`, `dtype`, `device` and
    `also_dtypes` (dtypes `.to()` may ask for that change nothing, see `check_move`)."""

    also_dtypes: frozenset[torch.dtype] = frozenset()
    apply = refused_method("apply")
    compile = refused_method("compile")

    # nn.Module's own: diffusers' ModelMixin versions (ahead of them in a compiled denoiser's MRO
    # otherwise) check quantization and warn about fp32 modules, which a stand-in has none of.
    to, cuda, half, float = torch.nn.Module.to, torch.nn.Module.cuda, torch.nn.Module.half, torch.nn.Module.float

    def _apply(self, fn: Any, recurse: bool = True) -> StandIn:
        """`.to()`, `.half()`, `.cuda()`: the compiled code runs where it was loaded, in its dtype;
        asking for exactly that changes nothing, asking for another is refused."""
        check_move(self.component_name, fn, self.dtype, self.device, self.also_dtypes)
        return self

    def train(self, mode: bool = True) -> StandIn:
        if mode:
            raise UnsupportedCallError(f"{self.component_name}.train(): the compiled code runs in eval mode and "
                                       f"computes no gradients", hint="train the eager model, then build its weights")
        return super().train(False)

    def requires_grad_(self, requires_grad: bool = True) -> StandIn:
        if requires_grad:
            raise UnsupportedCallError(f"{self.component_name}.requires_grad_(): the compiled code computes no "
                                       f"gradients", hint="train the eager model, then build its weights")
        return self


def check_move(component: str, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
               device: torch.device, also: frozenset[torch.dtype] = frozenset()) -> None:
    """`.to()`, `.half()`, `.cuda()` and the like reach a module through `_apply(fn)`: what `fn`
    does to a tensor of the component's dtype on its device says what the call asks. The compiled
    code runs in one dtype (or `also`: a VAE diffusers upcasts itself) on one device; asking for
    another is refused, asking for these is exactly a no-op.

    Raises:
        UnsupportedCallError: naming what was asked and what the artifact runs.
    """
    moved = fn(torch.empty(0, dtype=dtype, device=device))
    if moved.dtype != dtype and moved.dtype not in also:
        raise UnsupportedCallError(
            f"{component} is compiled by aotbuild for {dtype_name(dtype)} and cannot run {dtype_name(moved.dtype)} "
            f"(.to(), .half() and the like would convert its weights; its compiled code reads them as "
            f"{dtype_name(dtype)})", hint=f"build a target with dtype = \"{dtype_name(moved.dtype)}\"")
    if moved.device != device:
        raise UnsupportedCallError(
            f"{component} is compiled by aotbuild for {device} and cannot move to {moved.device}",
            hint=f"load an artifact built for {moved.device.type}: aotbuild.load_pipeline(artifact, "
                 f"device=\"{moved.device}\")")


def check_autocast(component: str, device: torch.device, dtype: torch.dtype) -> None:
    """Under `torch.autocast` eager diffusers computes in the autocast dtype; the compiled code
    computes in the dtype it was built for, so a call under another autocast dtype is refused."""
    if torch.is_autocast_enabled(device.type):
        cast = torch.get_autocast_dtype(device.type)
        if cast != dtype:
            raise UnsupportedCallError(
                f"{component} is called under torch.autocast(\"{device.type}\", dtype={cast}); it is compiled by "
                f"aotbuild for {dtype_name(dtype)} and cannot follow autocast",
                hint=f"call the pipeline outside autocast, or build a target with dtype = \"{dtype_name(cast)}\"")


def _to_arguments(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(device, dtype) of `DiffusionPipeline.to(*args, **kwargs)`, parsed as diffusers does."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    if len(args) == 1:
        if isinstance(args[0], torch.dtype):
            dtype = args[0]
        else:
            device = args[0]
    elif len(args) == 2:
        device, dtype = args
    return device, dtype


def _stand_ins(module: Any) -> list[StandIn]:
    """The compiled stand-ins a pipeline component is or holds (a model of several ControlNets
    holds one per ControlNet, in `nets`)."""
    if isinstance(module, StandIn):
        return [module]
    return [net for net in getattr(module, "nets", ()) if isinstance(net, StandIn)]


def install_pipeline_guards() -> None:
    """Once per process, on diffusers' DiffusionPipeline:
    - `to()` first asks every compiled component whether it can follow (a refusal leaves every
      component as it was: the text encoders are not converted before the UNet refuses);
    - `save_pretrained()` refuses before writing anything when a component is compiled;
    - `from_pipe` and `from_pretrained` accept aotbuild's compiled classes wherever a signature
      names a model class (see `private_apis.accept_compiled_class`), and a pipeline made by `from_pipe` from a
      compiled one keeps its default size (`default_size.keeping_default_size`)."""
    from diffusers import DiffusionPipeline

    from .default_size import keeping_default_size  # it imports this module's StandIn

    if getattr(DiffusionPipeline.to, "checks_compiled", False):
        return
    original_to, original_save = DiffusionPipeline.to, DiffusionPipeline.save_pretrained

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        device, dtype = _to_arguments(args, kwargs)
        for module in self.components.values():
            for stand_in in _stand_ins(module):
                stand_in.to(device=device, dtype=dtype)  # raises, or changes nothing
        return original_to(self, *args, **kwargs)

    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = [name for name, module in self.components.items() if _stand_ins(module)]
        if compiled:
            what, instead = REFUSED_METHODS["save_pretrained"]
            verb = "is" if len(compiled) == 1 else "are"
            raise UnsupportedCallError(f"save_pretrained(): {', '.join(compiled)} {verb} compiled by aotbuild; it "
                                       f"{what}; nothing was written", hint=instead)
        return original_save(self, *args, **kwargs)

    to.checks_compiled = True
    DiffusionPipeline.to, DiffusionPipeline.save_pretrained = to, save_pretrained

    def keep_default_size(*classes: type) -> None:
        for cls in classes:
            cls.from_pipe = classmethod(keeping_default_size(cls.__dict__["from_pipe"].__func__))

    keep_default_size(DiffusionPipeline)
    # The Auto classes make their pipeline without DiffusionPipeline.from_pipe. Their module imports
    # every pipeline diffusers has (0.36 s of a 0.78 s load, measured: an artifact started slower
    # than eager), so they are patched when a user imports them, or now if one has.
    when_imported(AUTO_PIPELINES, lambda auto: keep_default_size(
        auto.AutoPipelineForText2Image, auto.AutoPipelineForImage2Image, auto.AutoPipelineForInpainting))


AUTO_PIPELINES = "diffusers.pipelines.auto_pipeline"


def when_imported(name: str, patch: Callable[[types.ModuleType], None]) -> None:
    """Call `patch(module)` once module `name` is imported: now if it is, else right after its code
    runs, whoever imports it."""
    if name in sys.modules:
        patch(sys.modules[name])
        return

    class PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)  # found by the finders after this one
            run = spec.loader.exec_module

            def exec_module(module: types.ModuleType) -> None:
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, PatchOnImport())
