"""The optimization stack: a registry of named passes applied in a fixed order before export.

Each pass validates its target value before any model is loaded (`validate`), changes the
pipeline's compiled modules (`apply`) and returns what it did, which the manifest records.
Passes that matter during tracing (`sdpa`) also give a context entered around export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TargetError
from ..runtime.attention import LIBRARY_FILE, load_library, missing_cpu_flags
from ..spec.manifest import DTYPES, cpu_isa_flags
from ..spec.private_apis import pytree, unwrap_tensor_subclasses
from ..spec.recipes import QUANT_RECIPES, capability
from .attention import compiled_library
from .export import FREEZING_OPTION

Modules = dict[str, torch.nn.Module]  # component name -> the pipeline module it compiles


def _no_context(value: Any) -> ContextManager:
    return contextlib.nullcontext()


def _same_inputs(value: Any, tree: Any) -> Any:
    return tree


def _no_check(modules: Modules, value: Any) -> None:
    return None


@dataclass(frozen=True)
class Pass:
    """A named optimization. `validate(value, device, gpu)` raises TargetError before any load;
    `apply(modules, value, device)` changes the modules and returns what it did;
    `export_context(value)` is entered around torch.export; `example_inputs(value, tree)` adapts
    captured inputs to what the optimized model should be compiled for (the runtime converts
    calls to the recorded layout); `check(modules, value)` raises TargetError, once the models
    are loaded and before anything is captured, where the pass cannot change them exactly."""

    name: str
    doc: str
    validate: Callable[[Any, str, Any], None]
    apply: Callable[[Modules, Any, str], dict[str, Any]]
    export_context: Callable[[Any], ContextManager] = _no_context
    example_inputs: Callable[[Any, Any], Any] = _same_inputs
    check: Callable[[Modules, Any], None] = _no_check


PASSES: dict[str, Pass] = {}  # insertion order is the order passes are applied


def register(name: str, *, validate: Callable, export_context: Callable = _no_context,
             example_inputs: Callable = _same_inputs, check: Callable = _no_check) -> Callable:
    """Register `apply` under `name`; its docstring says what the pass does and when it helps."""

    def wrap(apply: Callable) -> Callable:
        PASSES[name] = Pass(name=name, doc=(apply.__doc__ or "").strip(), validate=validate, apply=apply,
                            export_context=export_context, example_inputs=example_inputs, check=check)
        return apply

    return wrap


def _bool(name: str) -> Callable[[Any, str, Any], None]:
    def check(value: Any, device: str, gpu: Any) -> None:
        if not isinstance(value, bool):
            raise TargetError(f"optimize.{name} must be true or false, got {value!r}")

    return check


@register("tf32", validate=_bool("tf32"))
def apply_tf32(modules: Modules, value: bool, device: str) -> dict[str, Any]:
    """TF32 matmuls and convolutions on CUDA (Ampere and newer): ~2x matmul throughput at ~1e-3
    relative precision. No effect on CPU, recorded as such. Never set for the process: the build
    turns it on around its own work after the float32 reference (`uses_tf32`), and each call of
    the artifact around itself (`runtime.variant.tf32`)."""
    if device != "cuda":
        return {"enabled": False, "reason": "TF32 exists on CUDA only"}
    return {"enabled": value}


def uses_tf32(options: dict[str, Any], device: str) -> bool:
    """Whether a target's compiled code is made and checked with TF32 matmuls."""
    return device == "cuda" and bool(options.get("tf32"))


SDPA_BACKENDS = ("auto", "flash", "efficient", "math", "cudnn", "aotbuild")


def _validate_sdpa(value: Any, device: str, gpu: Any) -> None:
    if value not in SDPA_BACKENDS:
        raise TargetError(f"optimize.sdpa is {value!r}; allowed: {', '.join(SDPA_BACKENDS)}")
    if device == "cpu" and value in ("flash", "efficient", "cudnn"):
        raise TargetError(f"optimize.sdpa = {value!r} needs CUDA; on cpu use \"auto\", \"math\" or \"aotbuild\"")
    if device == "cuda" and value == "aotbuild":
        raise TargetError("optimize.sdpa = \"aotbuild\" is aotbuild's attention for CPUs; on cuda use \"auto\" or "
                          "one of torch's kernels")
    if value == "flash" and gpu is not None and capability(gpu) < (8, 0):
        raise TargetError(f"optimize.sdpa = 'flash' needs compute capability >= 8.0, target gpu is {gpu.capability}")


def _sdpa_context(value: str) -> ContextManager:
    if value in ("auto", "aotbuild"):  # aotbuild's kernel replaces ATen's after export
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[value]
    return sdpa_kernel(backend)


def _check_sdpa(modules: Modules, value: str) -> None:
    if value == "aotbuild" and (missing := missing_cpu_flags()):
        raise TargetError(f"optimize.sdpa = \"aotbuild\" runs on x86 CPUs with AVX512-BF16, and this machine's CPU "
                          f"lacks {', '.join(missing)}", hint="build on such a CPU (an AMX Xeon, an AVX-512 EPYC "
                                                              "from Zen 4 on), or use sdpa = \"auto\"")


@register("sdpa", validate=_validate_sdpa, export_context=_sdpa_context, check=_check_sdpa)
def apply_sdpa(modules: Modules, value: str, device: str) -> dict[str, Any]:
    """Which scaled-dot-product-attention kernel the exported graph calls. "auto" lets torch pick
    (flash or memory-efficient on CUDA); pinning one makes the artifact's kernel explicit.
    "aotbuild" (CPU, bf16 or float32): aotbuild's flash attention for AVX512-BF16 CPUs
    (`builder/attention.py`), in bf16 1.5-2.3x ATen's speed at 1,000-16,000 tokens; the artifact
    holds the library, and every attention it cannot take exactly (a mask, causal, float16, a head
    size over 512 or odd in bf16) stays ATen's."""
    if value != "aotbuild":
        return {"backend": value}
    load_library(compiled_library())  # before export: the compile traces the op
    record = {"backend": value, "library": LIBRARY_FILE}
    if "amx_bf16" in cpu_isa_flags():  # ATen's attention packs for AMX's tiles; this kernel does not
        record["note"] = ("this CPU has AMX, whose tiles ATen's CPU attention uses and aotbuild's kernel does not; "
                          "the kernel was measured faster on AVX512-BF16 CPUs without AMX: compare both "
                          "(aotbuild bench --component ... --against a target with sdpa = \"auto\")")
    return record


# The models whose fuse_qkv_projections puts diffusers' FusedJointAttnProcessor2_0 on every attention.
JOINT_FUSED = ("SD3Transformer2DModel", "SD3ControlNetModel")


def _check_fusable(modules: Modules, value: bool) -> None:
    """FusedJointAttnProcessor2_0 computes SD3's plain joint attention only: it skips q/k
    normalization, needs the text stream, and replaces any other processor: SD3.5's transformers
    (qk_norm; Medium's image-only attn2) would compute something else, or fail."""
    for name, module in modules.items() if value else ():
        if type(module).__name__ not in JOINT_FUSED:
            continue
        for layer, attention in module.named_modules():
            if not hasattr(attention, "processor"):
                continue
            why = ("normalizes its queries and keys (qk_norm, SD3.5's)"
                   if getattr(attention, "norm_q", None) is not None or getattr(attention, "norm_added_q", None)
                   is not None else
                   "attends to the image alone (SD3.5 Medium's dual attention)"
                   if getattr(attention, "add_q_proj", None) is None else
                   f"runs {type(attention.processor).__name__}, which fusing would replace"
                   if type(attention.processor).__name__ != "JointAttnProcessor2_0" else None)
            if why:
                raise TargetError(f"optimize.fuse_qkv: {name}'s attention {layer} {why}: diffusers' fused SD3 "
                                  f"attention computes plain joint attention only, so the model's output would "
                                  f"change", hint="remove fuse_qkv from the target's [optimize]")


@register("fuse_qkv", validate=_bool("fuse_qkv"), check=_check_fusable)
def apply_fuse_qkv(modules: Modules, value: bool, device: str) -> dict[str, Any]:
    """Fuse each attention's q/k/v projections into one linear (diffusers' fuse_qkv_projections):
    one larger matmul instead of three, a small win on GPUs (diffusion-fast: 2.54 -> 2.52 s)."""
    fused = []
    if value:
        for name, module in modules.items():
            if hasattr(module, "fuse_qkv_projections"):
                module.fuse_qkv_projections()
                fused.append(name)
    return {"enabled": value, "components": fused}


@register("channels_last", validate=_bool("channels_last"),
          example_inputs=lambda value, tree: _channels_last_inputs(tree) if value else tree)
def apply_channels_last(modules: Modules, value: bool, device: str) -> dict[str, Any]:
    """NHWC memory format for convolution weights and 4-D inputs: faster convolutions on GPUs with
    tensor cores and with oneDNN on CPU. The compiled model expects NHWC inputs; the runtime
    converts contiguous ones."""
    if value:
        for module in modules.values():
            module.to(memory_format=torch.channels_last)
    return {"enabled": value, "components": list(modules) if value else []}


def _channels_last_inputs(tree: Any) -> Any:
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.contiguous(memory_format=torch.channels_last) if t.ndim == 4 else t, tree)


def _validate_quantize(value: Any, device: str, gpu: Any) -> None:
    if value not in QUANT_RECIPES:
        raise TargetError(f"optimize.quantize is {value!r}; known recipes: {', '.join(QUANT_RECIPES)}")
    why = QUANT_RECIPES[value].requires(device, gpu)
    if why:
        raise TargetError(f"optimize.quantize = {value!r} {why}")


@register("quantize", validate=_validate_quantize)
def apply_quantize(modules: Modules, value: str, device: str) -> dict[str, Any]:
    """torchao quantization of the layers the recipe's filter picks (int8 dynamic: diffusion-fast
    2.52 -> 2.43 s on A100). Weights become tensor subclasses; they are unwrapped into plain
    tensors (int8 data + scales) so the artifact's safetensors hold ordinary tensors."""
    try:
        from torchao.quantization import quantize_
    except ImportError:
        raise TargetError("optimize.quantize needs torchao at build time: pip install 'torchao>=0.18'") from None

    recipe = QUANT_RECIPES[value]
    layers = {}
    for name, module in modules.items():
        picked = [fqn for fqn, m in module.named_modules() if recipe.layer_filter(m, fqn)]
        if picked:
            quantize_(module, recipe.config(), filter_fn=recipe.layer_filter)
            unwrap_tensor_subclasses(module)
        layers[name] = len(picked)
    return {"recipe": value, "layers": layers, "inductor": recipe.inductor}


def _validate_prepack(value: Any, device: str, gpu: Any) -> None:
    _bool("prepack")(value, device, gpu)
    if value and device != "cpu":
        raise TargetError("optimize.prepack is for CPU targets: it prepares weights in the layout oneDNN's CPU "
                          "kernels compute with", hint="remove it from this target")


@register("prepack", validate=_validate_prepack)
def apply_prepack(modules: Modules, value: bool, device: str) -> dict[str, Any]:
    """CPU: convolution and linear weights in the blocked layout oneDNN computes with, instead of
    reordered on every call. AOTInductor freezes the model (its oneDNN convolutions and linears
    then take packed weights); the manifest records how each packed constant is made from the
    weights, and the runtime makes them at load from the weights it binds, and again when a
    checkpoint, a LoRA or a write changes those weights. Costs the packing at load and a packed
    copy of those weights in memory; measured no faster at float32 on an AVX2 CPU (cpu-sdxl-mid's
    UNet 0.99x paired), it is for CPUs where oneDNN's packed kernels matter more."""
    return {"enabled": value}


def inductor_flags(options: dict[str, Any]) -> dict[str, Any]:
    """Inductor options the passes themselves ask for (a quant recipe's fused int matmuls, prepack's
    freezing)."""
    flags = dict(QUANT_RECIPES[options["quantize"]].inductor) if "quantize" in options else {}
    return {**flags, FREEZING_OPTION: True} if options.get("prepack") else flags


def tolerance(options: dict[str, Any], dtype_tolerance: float) -> float:
    """The numerics tolerance of a component: its dtype's, loosened by a quant recipe."""
    return max(dtype_tolerance, QUANT_RECIPES[options["quantize"]].tolerance) if "quantize" in options \
        else dtype_tolerance


def adapt_example_inputs(options: dict[str, Any], tree: Any) -> Any:
    """Captured inputs as the optimized model is compiled for (e.g. NHWC with channels_last)."""
    for name, value in options.items():
        tree = PASSES[name].example_inputs(value, tree)
    return tree


def validate_optimize(options: dict[str, Any], *, origin: str, device: str, gpu: Any) -> None:
    """Check every [optimize] key before anything is loaded; unknown keys list the known ones."""
    for key, value in options.items():
        if key not in PASSES:
            raise TargetError(f"{origin}: unknown key 'optimize.{key}'; known passes: {', '.join(PASSES)}")
        try:
            PASSES[key].validate(value, device, gpu)
        except TargetError as exc:
            raise TargetError(f"{origin}: {exc.message}", hint=exc.hint) from None
    if options.get("prepack") and "quantize" in options:
        raise TargetError(f"{origin}: optimize.prepack does not combine with optimize.quantize: the quant "
                          f"recipe's int8 weights are not prepared for oneDNN", hint="choose one of them")


def apply_dtype(modules: Modules, dtype: str, force_upcast: dict[str, bool]) -> dict[str, str]:
    """Cast each compiled module to the target dtype; components whose config asks for
    `force_upcast` (SDXL's VAE overflows in float16) stay in float32. Returns dtype per component."""
    record = {}
    for name, module in modules.items():
        chosen = "float32" if dtype == "float16" and force_upcast.get(name) else dtype
        if module.dtype != DTYPES[chosen]:
            module.to(DTYPES[chosen])
        record[name] = chosen
    return record


def check_passes(modules: Modules, options: dict[str, Any]) -> None:
    """Refuse, before anything is captured, models a pass of the target cannot change exactly."""
    for name in PASSES:
        if name in options:
            PASSES[name].check(modules, options[name])


def apply_passes(modules: Modules, options: dict[str, Any], device: str) -> dict[str, Any]:
    """Run the target's passes in registry order (the documented fixed order); returns records."""
    return {name: PASSES[name].apply(modules, options[name], device) for name in PASSES if name in options}


@contextlib.contextmanager
def export_context(options: dict[str, Any]) -> Iterator[None]:
    """The contexts of every pass that must be active while tracing, entered together when the
    block is entered (not when this is called) and left with it."""
    with contextlib.ExitStack() as stack:
        for name, value in options.items():
            stack.enter_context(PASSES[name].export_context(value))
        yield
