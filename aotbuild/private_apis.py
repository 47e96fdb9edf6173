"""Every private API of torch, diffusers and Ray that aotbuild uses, in one place: what each is for,
the versions it was checked against, and what breaks without it. Nothing else in aotbuild reaches
into a private name, so a new release of one of these libraries is checked here first.

Checked against torch 2.13.0, diffusers 0.42.1 and Ray 2.60.0. Light to import (the runtime reads
it): torch's compiler modules are imported by the functions that need them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

# torch.nn.modules.module._IncompatibleKeys: the (missing_keys, unexpected_keys) named tuple
# `load_state_dict` returns; the stand-ins return the same type. Without it: callers reading
# `.missing_keys` of a compiled module's load_state_dict would fail.
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys

# torch.utils._pytree: the trees torch.export writes call signatures in (`TreeSpec`,
# `treespec_dumps`/`treespec_loads`, `tree_flatten`, `SUPPORTED_NODES`). Without it: no in_spec to
# record at build or check at load, no flattening of a call into the compiled model's inputs.
from torch.utils import _pytree as pytree

__all__ = [
    "IncompatibleKeys", "accept_compiled_class", "aot_compile", "aoti_runner", "block_registry", "cuda_compiler",
    "fake_tensor_mode", "inductor_config", "package_aoti", "python_printer", "pytree", "ray_started_head",
    "serve_http_port", "shape_env", "storage_at", "unwrap_tensor_subclasses",
]


def aoti_runner(folder: str | os.PathLike, name: str, device_index: int) -> Any:
    """torch._C._aoti.AOTIModelPackageLoader(folder, model name, run_single_threaded=True,
    num_runners=1, device_index): one compiled model of a package already extracted. The public
    `torch._inductor.aoti_load_package` extracts the archive into the temporary folder at every
    load and runs the threaded runner (it waits for the previous call's CUDA event and cannot be
    captured in a CUDA graph). Without it: every process start extracts again, and no CUDA graphs."""
    return torch._C._aoti.AOTIModelPackageLoader(os.fspath(folder), name, True, 1, device_index)


def storage_at(data_ptr: int, device: torch.device, nbytes: int) -> torch.UntypedStorage:
    """torch._C._construct_storage_from_data_pointer: a storage over memory another tensor owns,
    which a compiled model's constants are bound to by pointer. Without it: binding weights
    copies them (twice the memory of the weights at load)."""
    return torch._C._construct_storage_from_data_pointer(data_ptr, device, nbytes)


def inductor_config() -> Any:
    """torch._inductor.config: the options a compile takes, checked against a target's
    [inductor] keys. Without it: a misspelt option would pass unnoticed."""
    from torch._inductor import config

    return config


def cuda_compiler() -> str | None:
    """torch._inductor.codegen.cuda.compile_utils._cuda_compiler: the CUDA compiler inductor
    would call for multi-arch kernels. Without it: `gpu.multi_arch` is not checked before a build."""
    from torch._inductor.codegen.cuda.compile_utils import _cuda_compiler

    return _cuda_compiler()


def aot_compile(graph: torch.fx.GraphModule, args: tuple, kwargs: dict, options: dict[str, Any]) -> list:
    """torch._inductor.aot_compile: an exported graph compiled to files, not yet packaged, so
    that several variants go into one package. Without it: one package per variant."""
    return torch._inductor.aot_compile(graph, args, kwargs, options=options)


def package_aoti(path: Path, compiled: dict[str, list]) -> None:
    """torch._inductor.package.package_aoti: the compiled files of several named models written
    as one .pt2. Without it: one package per variant."""
    from torch._inductor.package import package_aoti as package

    package(os.fspath(path), compiled)


def fake_tensor_mode() -> Any:
    """torch._subclasses.fake_tensor.FakeTensorMode: runs an exported program on tensors with
    shapes and no data, to check every call a variant serves at no compute cost. Without it: a
    size export made static silently would only show as a wrong result at run time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def unwrap_tensor_subclasses(module: torch.nn.Module) -> None:
    """torch._functorch._aot_autograd.subclass_parametrization.unwrap_tensor_subclass_parameters:
    torchao's quantized weights (tensor subclasses) as plain tensors the safetensors file holds.
    Without it: quantized targets cannot be built weight-less."""
    from torch._functorch._aot_autograd.subclass_parametrization import unwrap_tensor_subclass_parameters

    unwrap_tensor_subclass_parameters(module)


def ray_started_head() -> bool:
    """ray._private.worker._global_node.head: whether `ray.init` started a head node here rather
    than joining a cluster. Without it: `aotbuild serve` cannot tell whether stopping Ray would
    stop a cluster it joined."""
    import ray

    return bool(getattr(ray._private.worker._global_node, "head", False))


_COMPILED_CLASSES: list[type] = []


def accept_compiled_class(cls: type) -> None:
    """diffusers' `DiffusionPipeline._get_signature_types`, widened: `from_pipe` keeps a
    ModelMixin only when its class is the very one the new pipeline's signature names
    (`UNet2DConditionModel`); the compiled denoiser, a ModelMixin of its own class, would be
    dropped and the new pipeline refused. Every signature's accepted types get the compiled
    classes (read by `from_pipe` and `from_pretrained` only). Without it:
    `Img2ImgPipeline.from_pipe(pipe)` loses the compiled denoiser."""
    from diffusers import DiffusionPipeline

    _COMPILED_CLASSES.append(cls)  # the whole-model and the regional denoiser
    original = DiffusionPipeline.__dict__["_get_signature_types"].__func__
    if getattr(original, "accepts_compiled", False):
        return

    def _get_signature_types(pipeline_cls: type) -> dict[str, tuple]:
        return {name: (*types, *_COMPILED_CLASSES) for name, types in original(pipeline_cls).items()}

    _get_signature_types.accepts_compiled = True
    DiffusionPipeline._get_signature_types = classmethod(_get_signature_types)


def shape_env(program: torch.export.ExportedProgram) -> Any:
    """torch.export.exported_program._get_shape_env: the symbolic shapes of an exported program,
    whose guards say what it assumed of its dynamic sizes (a branch taken at the example's
    sizes). Without it: those assumptions are not recorded, and a call breaking them would run."""
    from torch.export.exported_program import _get_shape_env

    return _get_shape_env(program.graph_module)


def python_printer() -> Any:
    """torch.utils._sympy.printers.PythonPrinter: a shape guard as a Python expression over the
    input dims' symbols, the form the manifest records and the runtime evaluates."""
    from torch.utils._sympy.printers import PythonPrinter

    return PythonPrinter()


def block_registry() -> Any:
    """diffusers.hooks._helpers.TransformerBlockRegistry: which outputs of a transformer block
    are its hidden states, read by diffusers' block-level step caches. Without it: a compiled
    block is unknown to First-Block Cache and the caches refuse it."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    return TransformerBlockRegistry


def serve_http_port() -> int:
    """ray.serve.context._get_global_client().http_config.port: the port Ray Serve listens on
    (the first `serve.start` on a cluster fixes it; Serve has no public reader). Raises where
    Serve's internals differ; the caller falls back to the port it asked for."""
    from ray.serve.context import _get_global_client

    return int(_get_global_client().http_config.port)

