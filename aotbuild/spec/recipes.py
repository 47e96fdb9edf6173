"""What the build applies and the runtime must redo, in one place: the passes' data both sides
read (fused projections' rows) and the quantization recipes, each one object with its build config
and its runtime inverse. Light: plain torch; torchao is imported only when a build quantizes, so
the runtime (`runtime/checkpoint.py`, `runtime/lora.py`) imports this and never `optimize`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# What diffusers' fuse_qkv_projections concatenates into each fused projection, in row order (self-
# attention: to_qkv; cross-attention: to_kv; SD3/Flux joint attention: to_added_qkv). Weights of another
# checkpoint, and LoRA updates of the members, are placed by these rows.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
}


def int8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's `Int8Tensor.from_hp(weight, PerRow())` (the int8_dynamic and int8_weight_only
    recipes): symmetric, one float32 scale per output row, values in [-128, 127]. The scale is
    computed in the weight's dtype, as torchao does, so a bfloat16 build gets its very scales."""
    flat = weight.reshape(weight.shape[0], -1)
    amax = torch.maximum(-flat.amin(dim=1, keepdim=True).clamp(max=0), flat.amax(dim=1, keepdim=True).clamp(min=0))
    scale = (amax / 127.5).clamp(min=torch.finfo(torch.float32).eps).to(torch.float32)
    data = torch.clamp(torch.round(flat * (1.0 / scale)), -128, 127).to(torch.int8)
    return data.reshape(weight.shape), scale


def dequantize_int8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.reshape(data.shape[0], -1).to(torch.float32) * scale).to(dtype).reshape(data.shape)


@dataclass(frozen=True)
class QuantScheme:
    """How a recipe's weights are made from float weights, and read back."""

    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


INT8_PER_ROW = QuantScheme(int8_per_row, dequantize_int8)


def capability(gpu: Any) -> tuple[int, int]:
    major, minor = gpu.capability.split(".")
    return int(major), int(minor)


@dataclass(frozen=True)
class QuantRecipe:
    """A torchao recipe, registered once: its build config (made when a build quantizes), which
    layers it touches, where it runs, how far it may drift, the inductor flags its compile needs,
    and its runtime inverse (`scheme`: how its weights are made again from float weights without
    torchao, for other checkpoints and LoRA merges; None where aotbuild can only build it)."""

    config: Callable[[], Any]
    layer_filter: Callable[[torch.nn.Module, str], bool]
    requires: Callable[[str, Any], str | None]  # (device, gpu) -> why it cannot run, or None
    tolerance: float  # max relative error vs eager float32 (see builder.validate.TOLERANCES)
    inductor: dict[str, Any]
    scheme: QuantScheme | None = None


# Linear shapes diffusion-fast leaves in bf16 for SDXL: quantizing them costs more than it gains.
_SDXL_SKIP_SHAPES = {
    (1280, 640), (1920, 1280), (1920, 640), (2048, 1280), (2048, 2560), (2560, 1280), (256, 128),
    (2816, 1280), (320, 640), (512, 1536), (512, 256), (512, 512), (640, 1280), (640, 1920), (640, 320),
    (640, 5120), (640, 640), (960, 320), (960, 640),
}


def _dynamic_quant_filter(module: torch.nn.Module, fqn: str) -> bool:
    """diffusion-fast's filter: linears wide enough to gain from int8 matmuls."""
    return (isinstance(module, torch.nn.Linear) and module.in_features > 16
            and (module.in_features, module.out_features) not in _SDXL_SKIP_SHAPES)


def _linear_filter(module: torch.nn.Module, fqn: str) -> bool:
    return isinstance(module, torch.nn.Linear) and module.in_features > 16


def _anywhere(device: str, gpu: Any) -> str | None:
    return None


def _cuda_only(device: str, gpu: Any) -> str | None:
    return None if device == "cuda" else "needs CUDA"


def _fp8_capable(device: str, gpu: Any) -> str | None:
    if device != "cuda" or gpu is None or capability(gpu) < (8, 9):
        found = gpu.capability if gpu is not None else device
        return f"needs CUDA compute capability >= 8.9 (Ada, Hopper), target has {found}"
    return None


def _torchao_config(name: str, **kwargs: Any) -> Callable[[], Any]:
    # set_inductor_config=False: torchao would otherwise set inductor flags globally; the recipe's
    # flags are passed per compile instead.
    def make() -> Any:
        import torchao.quantization as tq

        return getattr(tq, name)(set_inductor_config=False, **kwargs)

    return make


QUANT_RECIPES: dict[str, QuantRecipe] = {
    "int8_dynamic": QuantRecipe(_torchao_config("Int8DynamicActivationInt8WeightConfig"), _dynamic_quant_filter,
                                _anywhere, 0.1, {"force_fuse_int_mm_with_mul": True}, INT8_PER_ROW),
    "int8_weight_only": QuantRecipe(_torchao_config("Int8WeightOnlyConfig"), _linear_filter, _anywhere, 0.05,
                                    {"use_mixed_mm": True}, INT8_PER_ROW),
    "float8_dynamic": QuantRecipe(_torchao_config("Float8DynamicActivationFloat8WeightConfig"), _linear_filter,
                                  _fp8_capable, 0.1, {}),
    "int4_weight_only": QuantRecipe(_torchao_config("Int4WeightOnlyConfig", group_size=128), _linear_filter,
                                    _cuda_only, 0.15, {}),
}


def runtime_scheme(recipe: str | None) -> QuantScheme | None:
    """The runtime inverse of a quant recipe the manifest names (None: no recipe, or one aotbuild
    can only build)."""
    found = QUANT_RECIPES.get(recipe) if recipe else None
    return found.scheme if found else None


def rebuildable() -> list[str]:
    """The recipes whose weights the runtime can make again (other checkpoints, LoRA merges)."""
    return [name for name, recipe in QUANT_RECIPES.items() if recipe.scheme is not None]
