"""Any checkpoint of an artifact's architecture in the form its compiled code binds.

Compiled code depends on the architecture, the recipe and the shapes, never on weight values: the
artifact's recorded passes are replayed on a module's tensors (dtype, fused QKV rows, memory
layout, int8 quantization with the recorded scheme), each checked against the constant the code
was compiled for (name, shape, dtype, strides). Tensors that need no change are bound as they are,
by pointer: a checkpoint already in the artifact's dtype costs no copy.

Plain torch only: the int8 scheme is torchao's, re-implemented (and tested bit-exact against
torchao), so a serving machine needs no torchao.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..errors import AotbuildError, WeightsMismatchError
from ..spec.recipes import FUSED_PROJECTIONS, QuantScheme, rebuildable, runtime_scheme
from .weights import dtype_name, same_layout

QUANTIZED = ".parametrizations.weight.original"  # torchao's unwrapped subclass: original0 data, original1 scale


def quant_scheme(recipe: str | None, component: str) -> QuantScheme:
    scheme = runtime_scheme(recipe)
    if scheme is None:
        raise AotbuildError(
            f"{component}: this artifact's weights are quantized with the {recipe!r} recipe, which aotbuild can "
            f"only build, not redo at load: other weights and LoRAs need {' or '.join(rebuildable())}",
            hint="build the artifact from these weights instead")
    return scheme


def fused_members(fqn: str) -> tuple[str, tuple[str, ...], str] | None:
    """(attention path, member projections in row order, 'weight' or 'bias') when `fqn` is a
    projection fuse_qkv made (`...attn1.to_qkv.weight`), else None."""
    parts = fqn.split(".")
    if len(parts) >= 2 and parts[-2] in FUSED_PROJECTIONS:
        return ".".join(parts[:-2]), FUSED_PROJECTIONS[parts[-2]], parts[-1]
    return None


def child(path: str, *names: str) -> str:
    """A dotted name below `path` ("" is the root module)."""
    return ".".join(filter(None, (path, *names)))


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by name, with LoRA layers (peft) seen through to the
    weights they wrap: a fused LoRA lives in those weights."""
    tensors = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if ".lora_" in name or "lora_magnitude_vector" in name:
            continue
        tensors[name.replace(".base_layer.", ".")] = tensor.detach()
    return tensors


def checkpoint_constants(component: str, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         dtype: torch.dtype, recipe: str | None, device: torch.device,
                         unread: Collection[str] = (), optional: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """The constants of `expected` (the artifact's, with the dtypes, shapes and strides its code
    reads; left unread on the host) made on `device` from another checkpoint's `tensors` (a
    module's, see `module_tensors`); `dtype` and `recipe` are the component's recorded dtype and
    quant recipe; `unread`, the tensors of the architecture no compiled code reads (the manifest's:
    dead in the model, like Qwen-Image's last text stream), which any checkpoint of it has;
    `optional`, constants a checkpoint may lack, which then keep the artifact's (an IP-Adapter's,
    bound at each call from the adapter loaded, `runtime.ip_adapter`).

    Constants that are not weights (tensors export lifted from the code) keep the artifact's.

    Raises:
        WeightsMismatchError (an IncompatibleArtifactError): a tensor is missing, has another
            shape, or the checkpoint has tensors the compiled code does not read (another
            architecture): never silent.
    """
    used: set[str] = set()

    def source(name: str) -> torch.Tensor:
        if name in tensors:
            used.add(name)
            return tensors[name]
        fused = fused_members(name)
        if fused is not None:
            path, members, kind = fused
            return torch.cat([source(child(path, member, kind)) for member in members])
        raise WeightsMismatchError(f"{component}: the weights have no tensor {name!r}, which the compiled code "
                                   f"reads: another architecture than the artifact's")

    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    result = {}
    for fqn, want in expected.items():
        if QUANTIZED in fqn:
            layer = fqn.split(QUANTIZED)[0]
            if layer not in quantized:
                data = expected[f"{layer}{QUANTIZED}0"]
                weight = conform(component, f"{layer}.weight", source(f"{layer}.weight"),
                                 torch.empty(data.shape, dtype=dtype, device="meta"), device)
                quantized[layer] = quant_scheme(recipe, component).quantize(weight)
            got = quantized[layer][int(fqn[-1])]
        elif fqn in optional and fqn not in tensors:
            got = want
        elif fqn in tensors or fused_members(fqn) is not None or fqn.endswith((".weight", ".bias")):
            got = source(fqn)
        else:  # lifted by export from the code, not a weight
            got = want
        result[fqn] = conform(component, fqn, got, want, device)
    extra = sorted(set(tensors) - used - set(unread))
    if extra:
        raise WeightsMismatchError(f"{component}: the weights have tensors the compiled code does not read, "
                                   f"first {extra[0]!r} {list(tensors[extra[0]].shape)}: another architecture "
                                   f"than the artifact's ({len(extra)} such tensors)")
    return result


# What a config says of itself rather than of the model: never compared.
CONFIG_METADATA = frozenset({"_diffusers_version", "_name_or_path", "_use_default_values"})


def checkpoint_config(component: str, recorded: Mapping[str, Any], given: Mapping[str, Any], model: type,
                      runtime_keys: Collection[str]) -> dict[str, Any]:
    """The config a stand-in keeps for another checkpoint (`given`, the config of its `model`
    class's module, as diffusers loaded it): that checkpoint's own, once every key that is compiled
    into the code holds the artifact's (`recorded`) value. `runtime_keys` are the keys no compiled
    code reads (the pipeline or the stand-in does: `ComponentSpec.runtime_config`, less those the
    target's dtype compiles); every other key counts as compiled. A key one side lacks (another
    diffusers release) counts as the class's default.

    Raises:
        WeightsMismatchError: naming each compiled key that differs and both values.
    """
    given = {**given, "_class_name": model.__name__}
    defaults = {name: p.default for name, p in inspect.signature(model.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    unread = CONFIG_METADATA | set(runtime_keys) | ({"_class_name"} if "_class_name" not in recorded else set())
    differing = []
    for key in sorted((set(recorded) | set(given)) - unread):
        ours, theirs = (_as_json(config.get(key, defaults.get(key))) for config in (recorded, given))
        if ours != theirs:
            differing.append(f"{key!r} ({json.dumps(theirs)} in the weights, {json.dumps(ours)} in the artifact)")
    if differing:
        raise WeightsMismatchError(
            f"{component}: the weights' config differs from the artifact's in {', '.join(differing[:3])}"
            f"{f' and {len(differing) - 3} more keys' if len(differing) > 3 else ''}: the compiled code holds the "
            f"artifact's, so it would not compute what these weights compute eager",
            hint="build a target from these weights (source = their folder or Hub id) to run them compiled")
    return given


def _as_json(value: Any) -> Any:
    """A config value as JSON holds it (tuples as lists), to compare a manifest's with a module's."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


def conform(component: str, fqn: str, got: torch.Tensor, want: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`got` on `device` with `want`'s dtype and strides: as it is when it already has them (bound
    by pointer), else converted once."""
    if list(got.shape) != list(want.shape) or got.is_floating_point() != want.is_floating_point():
        raise WeightsMismatchError(
            f"{component}: tensor {fqn!r} is {list(got.shape)} {dtype_name(got.dtype)} in the weights; the compiled "
            f"code reads {list(want.shape)} {dtype_name(want.dtype)}: another architecture than the artifact's")
    if same_layout(got, want, device):
        return got
    return torch.empty_strided(want.shape, want.stride(), dtype=want.dtype, device=device).copy_(got)


def placed_writes(component: str, given: dict[str, torch.Tensor], eager: dict[str, torch.Tensor],
                  constants: dict[str, torch.Tensor], dtype: torch.dtype, recipe: str | None,
                  unread: Collection[str] = ()) -> list[tuple[str, slice, torch.Tensor]]:
    """Where tensors of the eager module (`given`, any subset, named as the module names them;
    `eager`: every tensor of the module, for shapes) go in the compiled code's constants: one
    (constant, rows, values) per write, the values already in the constant's dtype (a fused
    projection's rows, an int8 weight's rows and scales made again with the recorded scheme).
    A tensor no compiled code reads (`unread`, dead in the model) goes nowhere: it changes nothing.
    Nothing is written here: a caller checks every tensor before it changes any.

    Raises:
        WeightsMismatchError: a tensor of another shape than the module's, or one the compiled
            code has no constant for.
    """
    writes = []
    for name, tensor in given.items():
        if list(tensor.shape) != list(eager[name].shape):
            raise WeightsMismatchError(f"{component}: tensor {name!r} is {list(tensor.shape)}; the model's is "
                                       f"{list(eager[name].shape)}")
        fqn, rows = placement(name, eager, constants)
        if fqn is None and name in unread:
            continue
        if fqn is None:
            raise WeightsMismatchError(f"{component}: the compiled code reads no constant made from {name!r}")
        if QUANTIZED in fqn:
            data, scale = quant_scheme(recipe, component).quantize(tensor.detach().to(constants[fqn].device, dtype))
            writes += [(fqn, rows, data), (fqn[:-1] + "1", rows, scale)]
        else:
            want = constants[fqn][rows]
            if tensor.is_floating_point() != want.is_floating_point():
                raise WeightsMismatchError(f"{component}: tensor {name!r} is {dtype_name(tensor.dtype)}; the compiled "
                                           f"code reads {dtype_name(want.dtype)}")
            writes.append((fqn, rows, tensor.detach().to(want.device, want.dtype).reshape(want.shape)))
    return writes


def placement(name: str, eager: dict[str, torch.Tensor],
              constants: dict[str, torch.Tensor]) -> tuple[str | None, slice]:
    """(the constant holding the eager tensor `name`, its rows there; None when the compiled code
    has none): itself, the int8 data of its weight (its scale beside, `...original1`), or its rows
    of a fused projection, after the members before it (`eager`: the model's tensors, for their
    shapes). Other checkpoints' tensors and LoRA deltas are placed by it."""
    layer, _, kind = name.rpartition(".")
    quantized = f"{layer}{QUANTIZED}0"
    for fqn in (name, quantized if kind == "weight" else None):
        if fqn in constants:
            return fqn, slice(0, None)
    path, _, member = layer.rpartition(".")
    for fused, members in FUSED_PROJECTIONS.items():
        if member not in members:
            continue
        start = sum(eager[child(path, m, kind)].shape[0] for m in members[:members.index(member)])
        rows = slice(start, start + eager[name].shape[0])
        for fqn in (child(path, fused, kind), child(path, fused) + f"{QUANTIZED}0" if kind == "weight" else None):
            if fqn in constants:
                return fqn, rows
    return None, slice(0, None)
