"""Regional compilation, build side: a denoiser's repeated blocks (diffusers' `_repeated_blocks`),
grouped so that each group is exported and compiled once and serves every instance in it.

Two instances share compiled code when nothing the code depends on differs: the same class, the
same module structure (submodule types, their scalar settings such as head counts, every tensor's
name, shape, dtype and strides) and the same call at every capture point (shapes, dtypes, strides
and non-tensor values). SDXL's UNet thus gets one group per width and resolution level; Flux one
per block kind. The runtime side is `runtime/regional.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import BuildError
from ..runtime.variant import leaf_signature
from ..spec.private_apis import pytree
from .capture import CapturedCall, detached, patched_methods

# Denoisers whose diffusers class declares no `_repeated_blocks` (diffusers 0.42.1).
REPEATED_BLOCKS: dict[str, tuple[str, ...]] = {"SD3Transformer2DModel": ("JointTransformerBlock",)}


def repeated_block_classes(model: torch.nn.Module) -> tuple[str, ...]:
    declared = tuple(getattr(model, "_repeated_blocks", None) or ())
    return declared or REPEATED_BLOCKS.get(type(model).__name__, ())


def block_instances(model: torch.nn.Module, component: str) -> dict[str, torch.nn.Module]:
    """The model's repeated blocks by FQN, in module order (a block inside a block is part of it).

    Raises:
        BuildError: the model declares no repeated blocks, or has none of them.
    """
    classes = repeated_block_classes(model)
    if not classes:
        raise BuildError(f"{component}: {type(model).__name__} declares no repeated blocks (_repeated_blocks), so "
                         f"it has no regions to compile", hint='use [compile] mode = "whole" for this target')
    found: dict[str, torch.nn.Module] = {}
    for fqn, module in model.named_modules():
        if type(module).__name__ in classes and not any(fqn.startswith(outer + ".") for outer in found):
            found[fqn] = module
    if not found:
        raise BuildError(f"{component}: {type(model).__name__} has none of its repeated blocks "
                         f"({', '.join(classes)})")
    return found


def fingerprint(module: torch.nn.Module) -> str:
    """What a block's compiled code depends on besides its inputs: submodule types and their scalar
    settings (head counts, eps, processors' types), and every tensor's name, shape, dtype, strides."""
    parts = []
    for name, sub in module.named_modules():
        settings = sorted((k, _setting(v)) for k, v in vars(sub).items()
                          if not k.startswith("_") and k != "training" and not isinstance(v, torch.Tensor))
        parts.append((name, type(sub).__qualname__, settings))
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        parts.append((name, list(tensor.shape), str(tensor.dtype), list(tensor.stride())))
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def _setting(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return type(value).__qualname__  # a processor, an activation: its kind, not its identity


@dataclass
class BlockCalls:
    """The block calls of one pipeline run: each instance's key (its fingerprint and call
    signature) and one recorded call per key (instances with the same key take the same inputs'
    shapes: one example serves them all, and memory does not grow with depth)."""

    keys: dict[str, str] = field(default_factory=dict)
    calls: dict[str, CapturedCall] = field(default_factory=dict)


@contextlib.contextmanager
def recording(instances: dict[str, torch.nn.Module]) -> Iterator[BlockCalls]:
    """Within the block, the first call of each instance is keyed and, first of its key, recorded."""
    record = BlockCalls()
    prints = {fqn: fingerprint(module) for fqn, module in instances.items()}
    pending: dict[str, tuple] = {}

    def recorder(fqn: str, forward: Callable) -> Callable:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if fqn not in record.keys:
                signature = json.dumps(leaf_signature((args, kwargs)))
                key = hashlib.sha256(f"{prints[fqn]}|{signature}".encode()).hexdigest()[:16]
                record.keys[fqn] = key
                if key not in record.calls and key not in {k for k, _ in pending.values()}:
                    pending[fqn] = (key, detached((tuple(args), dict(kwargs))))
            output = forward(*args, **kwargs)
            if fqn in pending:
                key, (call_args, call_kwargs) = pending.pop(fqn)
                first = next(t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor))  # SD3's: (None, x)
                record.calls[key] = CapturedCall(call_args, call_kwargs, first.detach().clone())
            return output

        return recorded

    # The one way the build records calls: the method patched on the instance, as capture does.
    with patched_methods({fqn: (module, "forward") for fqn, module in instances.items()}, recorder):
        yield record


@dataclass(frozen=True)
class Region:
    """A group of block instances compiled once: `name` names its models in the package."""

    name: str
    block_class: str
    instances: tuple[str, ...]


def group(instances: dict[str, torch.nn.Module], records: dict[str, BlockCalls]) -> list[Region]:
    """Regions of the instances from their calls at every capture point (`records`, by point), in
    the order their first instances run."""
    by_keys: dict[tuple, list[str]] = {}
    for fqn in instances:
        missing = [point for point, record in records.items() if fqn not in record.keys]
        if missing:
            raise BuildError(f"block {fqn} was not called at capture point {missing[0]}: regions need every "
                             f"repeated block to run on every call")
        by_keys.setdefault(tuple(records[p].keys[fqn] for p in records), []).append(fqn)
    regions = []
    for index, fqns in enumerate(by_keys.values()):
        block_class = type(instances[fqns[0]]).__name__
        regions.append(Region(f"r{index}_{block_class}", block_class, tuple(fqns)))
    return regions


def region_call(region: Region, record: BlockCalls) -> CapturedCall:
    """The region's call in one run: the one recorded under its first instance's key (see `BlockCalls`)."""
    return record.calls[record.keys[region.instances[0]]]


def instance_constants(region: Region, block: torch.nn.Module, fqn: str, names: list[str],
                       shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The constants the region's code binds (`names`, relative to a block) for one instance, by
    the model's FQN; those in `shared` are not weights (export lifted them from the code) and are
    stored once per region, under `<region>.<name>`."""
    own = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    result = {}
    for name in names:
        if name in shared:
            continue
        tensor = own.get(name)
        if tensor is None:
            raise BuildError(f"{region.name}: block {fqn} has no tensor {name!r}, which the region's code binds")
        result[f"{fqn}.{name}"] = tensor.detach()
    return result
