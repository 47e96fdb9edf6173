"""Every private API of torch, diffusers and Ray that aotbuild uses, in one place: what each is for,
the versions it was checked against, and what breaks without it. Nothing else in aotbuild reaches
into a private name, so a new release of one of these libraries is checked here first.

Checked against torch 2.13.0, diffusers 0.42.1 and Ray 2.60.0. Light to import (the runtime reads
it): torch's compiler modules are imported by the functions that need them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import weakref
from collections.abc import Callable, Iterator
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
    "IncompatibleKeys", "accept_compiled_class", "aot_compile", "aoti_runner", "attention_flop_formulas",
    "block_registry", "borrowed_mkldnn",
    "cuda_compiler", "declare_equal_sizes", "fake_tensor_mode", "inductor_config", "mkldnn_memory",
    "onednn_convolutions", "onednn_linears",
    "package_aoti", "python_printer", "pytree", "ray_started_head", "recording_folds", "rewriting_before_folds",
    "serve_http_port", "shape_env", "size_hints", "storage_at", "unwrap_tensor_subclasses", "versions",
    "check_inputs_multiple", "attributes_read", "returned_classes", "running_pipeline_call",
    "ip_adapter_layers", "ip_adapter_loras", "onednn_runs", "sets_attention_processors",
]


def onednn_runs(dtype: str) -> bool:
    """Whether oneDNN computes `dtype`'s matrix products and convolutions on this CPU (bf16: AVX-512
    or AMX; fp16: AVX512-FP16 or AMX-FP16): `torch.ops.mkldnn._is_mkldnn_{bf16,fp16}_supported`.
    Without them ATen takes a reference path (an AVX2 EPYC: 0.8 GFLOP/s for a 1024x1024 bf16
    matmul, 68 in float32). Without this op: no warning of that, nothing else."""
    name = {"bfloat16": "_is_mkldnn_bf16_supported", "float16": "_is_mkldnn_fp16_supported"}.get(dtype)
    try:
        return name is None or bool(getattr(torch.ops.mkldnn, name)())
    except (AttributeError, RuntimeError):  # a torch without oneDNN's operators: nothing to say
        return True


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


def borrowed_mkldnn(tensor: torch.Tensor) -> torch.Tensor:
    """A oneDNN (mkldnn-layout) tensor over the memory of `tensor`, owning none of it: made by
    AOTInductor's C shim `aoti_torch_create_tensor_from_blob_v2` (how a compiled model makes its
    own oneDNN constants over its weight blob), read back with `torch._C._aoti`'s
    `alloc_tensor_by_stealing_from_void_ptr`; `torch.ops.mkldnn.data_ptr` and
    `_get_mkldnn_serialized_md` give the memory and its oneDNN descriptor. Without it: a prepared
    constant bound by pointer is kept alive by torch 2.13 until the process ends (see
    `runtime.weights.Lender`), so every load of a prepacked artifact would leak its prepared weights."""
    import ctypes

    shim = _c_shim()
    descriptor = torch.ops.mkldnn._get_mkldnn_serialized_md(tensor)
    ndim = tensor.dim()
    codes = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if tensor.dtype not in codes:
        raise RuntimeError(f"a {tensor.dtype} oneDNN tensor: only {', '.join(map(str, codes))} are bound by view")
    dtype = getattr(shim, f"aoti_torch_dtype_{codes[tensor.dtype]}")()
    handle = ctypes.c_void_p()
    error = shim.aoti_torch_create_tensor_from_blob_v2(
        ctypes.c_void_p(mkldnn_memory(tensor)[0]), ctypes.c_int64(ndim), (ctypes.c_int64 * ndim)(*tensor.shape),
        (ctypes.c_int64 * ndim)(*[0] * ndim), ctypes.c_int64(0), dtype, shim.aoti_torch_device_type_cpu(),
        ctypes.c_int32(0), ctypes.byref(handle), shim.aoti_torch_layout__mkldnn(),
        ctypes.c_void_p(descriptor.data_ptr()), ctypes.c_int64(descriptor.numel()))
    if error or not handle.value:
        raise RuntimeError(f"aoti_torch_create_tensor_from_blob_v2 failed ({error}) for a {tensor.dtype} oneDNN tensor")
    capsule = ctypes.pythonapi.PyCapsule_New(handle.value, None, None)
    return torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(capsule)


def mkldnn_memory(tensor: torch.Tensor) -> tuple[int, int]:
    """torch.ops.mkldnn.data_ptr and _nbytes: where a oneDNN tensor's memory is and its size (such
    a tensor has no storage). Without it: the views bound of prepared constants cannot be shared."""
    return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)


def versions(tensors: list[torch.Tensor]) -> list[int]:
    """Tensor._version of each: the counter every in-place write moves (views share their base's).
    Raises RuntimeError for an inference tensor, which keeps none. Without it: a weight written in
    place (a LoRA merged into its buffer, `p.mul_()`) would not reach its prepared constant."""
    return [tensor._version for tensor in tensors]


@functools.cache
def _c_shim() -> Any:
    import ctypes

    shim = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    for name in ("aoti_torch_dtype_float32", "aoti_torch_dtype_bfloat16", "aoti_torch_dtype_float16",
                 "aoti_torch_device_type_cpu", "aoti_torch_layout__mkldnn", "aoti_torch_create_tensor_from_blob_v2"):
        getattr(shim, name).restype = ctypes.c_int32
    ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
    ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return shim


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


@contextlib.contextmanager
def recording_folds(describe: Callable[[torch.fx.Node], Any]) -> Iterator[dict[str, Any]]:
    """torch._inductor.constant_folding.replace_node_with_constant (also bound in
    torch._inductor.freezing), wrapped for the block: each constant that freezing folds from the
    weights (`_frozen_paramN`: a oneDNN-packed convolution or linear weight, a transposed one) is
    recorded, by the name the compiled model binds it under, as `describe(node)` of the graph node
    it replaces, taken before the node is gone. Without it: a frozen model's constants are values
    of the build's weights, and another checkpoint or a LoRA could not be prepared the same way.

    On leaving the block the graph modules the compile made and left alive lose their weights and
    frozen constants: inductor keeps the last graph it lowered alive after the compile (torch 2.13;
    reached through an iterator in a closure aotbuild cannot touch), and with it every weight and
    packed copy the compiled code binds: for SDXL's UNet 5 GiB of packed constants and 4.8 GiB of
    weights, held through a UNet-only build's validation (21.7 GiB at peak, 11.1 without them;
    11.8 with a VAE compiled after the UNet, whose graph took the UNet's place)."""
    from torch._inductor import constant_folding, freezing

    folds: dict[str, Any] = {}
    original = constant_folding.replace_node_with_constant

    def replace(gm: torch.fx.GraphModule, node: torch.fx.Node, constant: torch.Tensor | None = None,
                name: str | None = None) -> None:
        made = describe(node) if constant is not None else None
        before = set(gm._buffers)
        original(gm, node, constant, name)
        for new in set(gm._buffers) - before:
            folds[new] = made

    constant_folding.replace_node_with_constant = freezing.replace_node_with_constant = replace
    before = weakref.WeakSet(_graph_modules())
    try:
        yield folds
    finally:
        constant_folding.replace_node_with_constant = freezing.replace_node_with_constant = original
        _drop_compile_leftovers(before)


def _graph_modules() -> Iterator[torch.fx.GraphModule]:
    return (o for o in gc.get_objects() if isinstance(o, torch.fx.GraphModule))


def _drop_compile_leftovers(before: weakref.WeakSet) -> None:
    """Remove every weight and frozen constant (`_frozen_paramN` buffers) from the graph modules
    made since `before` and alive after collection: the compile's output is its files, nothing
    runs those graphs again. (Freezing leaves the graph it was given as it was.)"""
    gc.collect()
    for graph in _graph_modules():
        if graph not in before:
            for module in graph.modules():
                module._parameters.clear()
                module._buffers.clear()


@contextlib.contextmanager
def rewriting_before_folds(rewrite: Callable[[torch.fx.GraphModule], None]) -> Iterator[None]:
    """torch._inductor.freezing.constant_fold (also what torch._inductor.fx_passes.freezing_patterns
    imports from it at each call), wrapped for the block: `rewrite(graph_module)` runs before each
    constant fold of freezing, the last of which follows inductor's oneDNN weight packing. Without
    it: a freezing graph cannot be given a weight preparation inductor does not make (packed
    convolution weights at dynamic input sizes: `export.pack_dynamic_convolutions`; the faster of
    two linear packings: `export.choose_linear_packings`)."""
    from torch._inductor import freezing

    original = freezing.constant_fold

    def constant_fold(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> None:
        rewrite(gm)
        original(gm, *args, **kwargs)

    freezing.constant_fold = constant_fold
    try:
        yield
    finally:
        freezing.constant_fold = original


def onednn_convolutions() -> tuple[dict[Any, tuple[int, int]], Any]:
    """torch.ops.mkldnn's `_convolution_pointwise` (.default, .binary) and `_convolution_pointwise_`
    (.binary): the convolutions inductor's freezing makes on CPU, each with where its input and its
    weight are in the call; and `_reorder_convolution_weight(weight, padding, stride, dilation,
    groups, input_size)`, the packing freezing gives their weights at static sizes. Without it: no
    packed convolution weights for a model of dynamic sizes (`export.pack_dynamic_convolutions`)."""
    mkldnn = torch.ops.mkldnn
    return ({mkldnn._convolution_pointwise.default: (0, 1), mkldnn._convolution_pointwise.binary: (0, 2),
             mkldnn._convolution_pointwise_.binary: (1, 2)}, mkldnn._reorder_convolution_weight)


def onednn_linears() -> tuple[dict[Any, tuple[int, int]], Any, Any]:
    """torch.ops.mkldnn's `_linear_pointwise` (.default, .binary): the linears inductor's freezing
    makes on CPU, each with where its input and its weight are in the call; the packing freezing
    gives their weights, `_reorder_linear_weight(weight, rows)` (as the graph calls it: the
    overload packet); and `_linear_pointwise.default(input, packed weight, bias, "none", [], "")`
    to time a packing with. Without it: the packing oneDNN picks for the rows inductor hints,
    however slow (`export.choose_linear_packings`)."""
    mkldnn = torch.ops.mkldnn
    return ({mkldnn._linear_pointwise.default: (0, 1), mkldnn._linear_pointwise.binary: (0, 2)},
            mkldnn._reorder_linear_weight, mkldnn._linear_pointwise.default)


def size_hints(shape: Any) -> list[int]:
    """torch.fx.experimental.symbolic_shapes.optimization_hint of each size: the value a symbolic
    size had in the example the program was traced with (plain ints as they are). Without it: no
    concrete size to prepare a weight for in a dynamic-shape graph."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return [int(optimization_hint(s)) if isinstance(s, torch.SymInt) else int(s) for s in shape]


def package_aoti(path: Path, compiled: dict[str, list]) -> None:
    """torch._inductor.package.package_aoti: the compiled files of several named models written
    as one .pt2. Without it: one package per variant."""
    from torch._inductor.package import package_aoti as package

    package(os.fspath(path), compiled)


def fake_tensor_mode() -> Any:
    """torch._subclasses.fake_tensor.FakeTensorMode: runs an exported program on tensors with
    shapes and no data, to check every call a variant serves, or count its FLOPs, at no compute
    cost. Without it: a size export made static silently would only show as a wrong result at run
    time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def attention_flop_formulas() -> dict[Any, Any]:
    """FlopCounterMode's formulas for attention kernels it has none for: ATen's CPU flash attention
    (aten._scaled_dot_product_flash_attention_for_cpu, what SDPA runs on CPU and on fake CPU
    tensors) counted as its two matmuls (torch.utils.flop_counter.sdpa_flop_count), as the CUDA
    kernels are. Without it: attention counts 0 FLOPs on CPU (SDXL at 1024 px: 1.57 of 13.5 TFLOP)."""
    from torch.utils.flop_counter import sdpa_flop_count

    def flash_for_cpu(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    return {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: flash_for_cpu}


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
    (`UNet2DConditionModel`); the compiled denoiser, a ModelMixin of its own class (and a
    compiled ControlNet, whose `__class__` is its model's), would be dropped and the new
    pipeline refused. Every signature's accepted types get the compiled
    classes (read by `from_pipe` and `from_pretrained` only). Without it:
    `Img2ImgPipeline.from_pipe(pipe)` loses the compiled denoiser."""
    from diffusers import DiffusionPipeline

    if cls not in _COMPILED_CLASSES:  # the whole-model and the regional denoiser, a compiled ControlNet
        _COMPILED_CLASSES.append(cls)
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


def declare_equal_sizes(program: torch.export.ExportedProgram, size: Any, same: Any) -> None:
    """ShapeEnv._set_replacement: tell the exported program's symbolic shapes that the input size
    `size` (a sympy Symbol) is `same`. torch.export gives each input dim its own symbol even where
    one `Dim` spans several inputs (it checks their equality only at the inputs), so inductor
    lowers the UNet's `view(batch, -1, heads, dim)` to floor(s1 * n / s2) and nests it deeper at
    each attention: on the real SDXL UNet sympy's simplification of those sizes outgrew 30 minutes.
    Without it: a dynamic batch over a real-size denoiser does not finish compiling."""
    shape_env(program)._set_replacement(size, same, "aotbuild: one export Dim")


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


# diffusers' code read as text, or its running call's locals: no public API says these. Each was
# checked with diffusers 0.42.1; `tests/test_pipelines.py` reads them from the installed diffusers
# and fails by name when a release writes its code otherwise.

def check_inputs_multiple(cls: type) -> int | None:
    """The multiple a pipeline's `check_inputs` holds height to, where its code writes one
    (`height % 16 != 0` in Wan's, 32 in LTX-Video's). Without it: a tiny model's stride would be
    looser than the pipeline's own check, and a size it refuses would be built."""
    import inspect
    import re

    check = getattr(cls, "check_inputs", None)
    try:
        found = re.search(r"height\s*%\s*(\d+)\s*!=\s*0", inspect.getsource(check)) if check else None
    except (OSError, TypeError):  # no source (a compiled or dynamically made class)
        return None
    return int(found.group(1)) if found else None


def attributes_read(cls: type, attribute: str) -> list[str]:
    """The attributes of `self.<attribute>` a pipeline class's code reads, dotted paths whole
    (Z-Image reads `transformer.in_channels`, SDXL's img2img `unet.add_embedding.linear_1.in_features`).
    Without it: the runtime's stand-in would lack an attribute the pipeline reads, and the call
    would fail."""
    import inspect
    import re

    try:
        return re.findall(rf"self\.{attribute}\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", inspect.getsource(cls))
    except (OSError, TypeError):
        return []


def sets_attention_processors(cls: type) -> bool:
    """Whether a pipeline class's own code sets its denoiser's attention processors (diffusers'
    `set_attn_processor`, `set_processor`, or `.processor =`), read from its source. Without it: such
    a pipeline (FLUX.2 [klein] KV's cache) would build, and fail at load or compute other attention."""
    import inspect
    import re

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(r"\.(set_attn_processor|set_processor)\(|\.processor\s*=[^=]", source) is not None


def returned_classes(forward: Callable) -> list[type]:
    """The classes a model's forward returns by name (`return Transformer2DModelOutput(...)`), in
    the module that defines it: its output type where the annotation says a tensor (Wan, LTX-Video).
    Without it: the stand-in would return a tuple where the pipeline reads `.sample`."""
    import inspect
    import re
    import sys

    namespace = vars(sys.modules[forward.__module__])
    return [namespace[name] for name in re.findall(r"return\s+(\w+)\(", inspect.getsource(forward))
            if isinstance(namespace.get(name), type)]


def running_pipeline_call(names: tuple[str, ...]) -> tuple[Any, dict[str, Any]] | None:
    """The diffusers pipeline whose `__call__` is running on this thread, and the values of these
    local variables there (its arguments, and `batch_size` once computed); None outside one. Read
    from the call's frame. Without it: a refusal could not say the call in the caller's terms
    (pixels, images, frames), only the compiled model's tensor shapes."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "__call__" and type(owner).__module__.startswith("diffusers.pipelines"):
            return owner, {name: frame.f_locals.get(name) for name in names}
        frame = frame.f_back
    return None


def ip_adapter_layers(unet: torch.nn.Module, state_dicts: list[dict[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
    """UNet2DConditionModel's `_convert_ip_adapter_attn_to_diffusers` and
    `_convert_ip_adapter_image_proj_to_diffusers` (loaders/unet.py): IP-Adapter state dicts as
    diffusers' attention processors (by processor name) and image projection layers, the two halves
    of its `_load_ip_adapter_weights`, which also installs them; built on the host as real modules
    (`low_cpu_mem_usage=False`) from a UNet that may be on the meta device (read for its config and
    processor names only). Without it: aotbuild would convert every adapter form itself."""
    processors = unet._convert_ip_adapter_attn_to_diffusers(state_dicts, low_cpu_mem_usage=False)
    projections = [unet._convert_ip_adapter_image_proj_to_diffusers(state_dict["image_proj"], low_cpu_mem_usage=False)
                   for state_dict in state_dicts]
    return processors, projections


def ip_adapter_loras(unet: torch.nn.Module, state_dicts: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """UNet2DConditionModel's `_load_ip_adapter_loras` (loaders/unet.py): the LoRAs an IP-Adapter
    FaceID state dict carries, which `load_ip_adapter` loads with `load_lora_weights` (empty for
    other adapters); read from the UNet's processor names only. Without it: `load_ip_adapter` on a
    compiled UNet fails after the adapter is loaded."""
    return unet._load_ip_adapter_loras(state_dicts)
