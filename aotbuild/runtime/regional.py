"""A regionally compiled denoiser: diffusers' own forward (the code between the blocks: embeddings,
norms, convolutions, the final projection) runs as eager torch on the artifact's weights, and each
repeated block runs its region's compiled code, bound once to that instance's own weights.

One region's compiled model is opened once per instance (two runners of one library keep their
own constants), so nothing is rebound per call. Calls are checked once, at the component's entry,
against the variants the build validated; the blocks then run the variant of the same name.
The whole forward is one CUDA graph when graphs are on: eager kernels and the blocks' compiled
kernels are all launched on the capturing stream.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import AotbuildError, CorruptArtifactError
from ..spec.private_apis import pytree
from . import step_cache
from .component import CompiledComponent
from .lora import meta_model
from .refusals import unsupported_call
from .variant import CompiledVariant, LoadContext


class CompiledBlock(torch.nn.Module):
    """One block instance in the model's module tree: its region's compiled variants, bound to its
    own weights; runs the variant the component chose for the current call. Instances are of
    `CompiledBlock.of(eager class)`, which diffusers' hooks read as they read the eager block."""

    @staticmethod
    @functools.cache
    def of(eager: type) -> type[CompiledBlock]:
        """The compiled block class standing in for the eager block class `eager`: its name, its
        forward's signature (hooks find `hidden_states` by position in it) and its entry in
        diffusers' block registry (which outputs are the hidden states)."""

        def forward(self: CompiledBlock, *args: Any, **kwargs: Any) -> Any:
            return CompiledBlock.forward(self, *args, **kwargs)

        forward.__signature__ = inspect.signature(eager.forward)
        compiled = type(eager.__name__, (CompiledBlock,), {"forward": forward, "__module__": __name__})
        step_cache.register_block_class(compiled, eager)
        return compiled

    def __init__(self, fqn: str, variants: dict[str, CompiledVariant], state: _CallState) -> None:
        super().__init__()
        self.fqn = fqn
        self.variants = variants
        self._state = state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        variant = self.variants[self._state.variant]
        leaves = variant.flatten(args, kwargs)
        if leaves is None or not variant.accepts(leaves):  # a builder defect, never silent
            raise AotbuildError(f"block {self.fqn}: its compiled variant {variant.name} does not take the call the "
                                f"model makes under the component's variant of that name: "
                                + unsupported_call(f"block {self.fqn}", [variant], args, kwargs).message)
        return variant.run(leaves)

    def extra_repr(self) -> str:
        return f"{self.fqn}, compiled"


class _CallState:
    """What the running call chose, read by every block (one call at a time: the load's lock)."""

    def __init__(self) -> None:
        self.variant: str | None = None


class RegionalModel:
    """The denoiser's module tree on the artifact's weights, its blocks compiled: runs a call under
    one of the component's variants, and binds other tensors for any of its constants."""

    def __init__(self, package: Path, entry: dict[str, Any], weights: dict[str, torch.Tensor], sha256: str,
                 layouts: dict[str, dict], context: LoadContext) -> None:
        self.state = _CallState()
        self.model = meta_model(entry["config"], torch.float32)
        self.blocks: dict[str, CompiledBlock] = {}
        self._owners: dict[str, list[tuple[CompiledVariant, str]]] = {}  # block constants -> (model, its name)
        # The blocks run inside the component's call, which holds the lock and any graph capture.
        blocks = dataclasses.replace(context, graph_pool=None, tf32=False)
        for region in entry["regions"]:
            for fqn in region["instances"]:
                block_class = CompiledBlock.of(type(self.model.get_submodule(fqn)))
                self.blocks[fqn] = block_class(fqn, self._open_block(package, region, fqn, weights, sha256, layouts,
                                                                       blocks), self.state)
                parent, _, leaf = fqn.rpartition(".")
                setattr(self.model.get_submodule(parent), leaf, self.blocks[fqn])
        self._assign({name: tensor for name, tensor in weights.items() if name not in self._owners})
        unset = [name for name, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta]
        if unset:
            raise CorruptArtifactError(f"{package}: the weights lack {unset[0]!r}, which the eager part of the "
                                       f"regional {entry['attribute']} reads")

    def _open_block(self, package: Path, region: dict[str, Any], fqn: str, weights: dict[str, torch.Tensor],
                    sha256: str, layouts: dict[str, dict], context: LoadContext) -> dict[str, CompiledVariant]:
        """The region's variants for one instance, bound to its weights: `<fqn>.<name>`, and the
        region's lifted constants (`<region>.<name>`), shared by its instances."""
        shared = set(region["shared_constants"])
        variants = {}
        for entry in region["variants"]:
            full = {name: f"{region['name']}.{name}" if name in shared else f"{fqn}.{name}"
                    for name in entry["constants"]}
            variant = variants[entry["name"]] = CompiledVariant(
                package, entry, {name: _lookup(weights, f, package) for name, f in full.items()}, sha256,
                {name: layouts[f] for name, f in full.items() if f in layouts}, context)
            for name, f in full.items():
                self._owners.setdefault(f, []).append((variant, name))
        return variants

    def _assign(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put tensors in place of the eager modules' parameters and buffers, by pointer."""
        for name, tensor in tensors.items():
            path, _, leaf = name.rpartition(".")
            try:
                owner = self.model.get_submodule(path)
            except AttributeError:
                raise CorruptArtifactError(f"the weights hold {name!r}, which the model has no module for") from None
            if leaf in owner._parameters:
                owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
            elif leaf in owner._buffers:
                owner._buffers[leaf] = tensor
            else:
                raise CorruptArtifactError(f"the weights hold {name!r}, which is no parameter or buffer of the model")

    def rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Bind these tensors for the named constants (model FQNs), by pointer, in the blocks'
        compiled code or the eager modules."""
        by_variant: dict[CompiledVariant, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            for variant, own in self._owners.get(name, ()):
                by_variant.setdefault(variant, {})[own] = tensor
        for variant, mine in by_variant.items():
            variant.rebind(mine)
        self._assign({name: t for name, t in tensors.items() if name not in self._owners})

    def forward(self, variant: str, args: Any, kwargs: Any) -> Any:
        self.state.variant = variant
        with torch.no_grad():
            return self.model(*args, **kwargs)


class RegionalVariant(CompiledVariant):
    """A component-level variant of a regional model: the call signature the build validated, run
    through the model's forward with every block on its variant of this name."""

    def __init__(self, entry: dict[str, Any], model: RegionalModel, context: LoadContext) -> None:
        self._init_signature(entry, context)
        self._regional = model
        self._values = [ast.literal_eval(leaf["value"]) if "value" in leaf else None for leaf in self.inputs]
        self._run = self._forward_flat
        self._init_calls(entry["in_spec"], entry["out_spec"])

    def _run_unlocked(self, leaves: list[tuple[str, Any]]) -> Any:
        if self.graph_pool is not None and step_cache.enabled(self._regional.model):
            # A step cache decides in Python, on values read back, which blocks run: a graph
            # replays one fixed sequence of kernels, so the forward runs its blocks ungraphed.
            return self._run_direct(leaves)
        return super()._run_unlocked(leaves)

    def _forward_flat(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        given = iter(tensors)
        leaves = [next(given) if "value" not in leaf else value for leaf, value in zip(self.inputs, self._values,
                                                                                         strict=True)]
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return pytree.tree_leaves(self._regional.forward(self.name, args, kwargs))

    def rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        """The model's constants are rebound by `RegionalModel.rebind`; a captured graph holds
        their old pointers."""
        for graph in self.cuda_graphs.values():
            graph.reset()


class RegionalComponent(CompiledComponent):
    """A compiled component whose blocks are compiled regions (see the module's docstring)."""

    def __init__(self, *args: Any, regional: RegionalModel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.regional = [regional]  # a list: not registered as a submodule (`.to()` moves nothing)

    def _step_cache_model(self) -> torch.nn.Module:
        return self.regional[0].model

    def _bind(self, tensors: dict[str, torch.Tensor]) -> None:
        self.regional[0].rebind(tensors)
        for variant in self.variants:
            variant.rebind(tensors)


def component_variants(package: Path, entry: dict[str, Any], weights: dict[str, torch.Tensor], sha256: str,
                       layouts: dict[str, dict], context: LoadContext,
                       release: Callable[[Iterable[torch.Tensor]], Any] | None = None,
                       ) -> tuple[list[CompiledVariant], RegionalModel | None]:
    """A component entry's variants, bound to `weights`, and for a regional entry its model (None
    for a whole-model entry, whose variants are compiled models of their own). `release`: as
    `CompiledVariant` takes it (a whole-model entry's)."""
    if entry.get("mode") != "regional":
        return [CompiledVariant(package, v, weights, sha256, layouts, context, release)
                for v in entry["variants"]], None
    model = RegionalModel(package, entry, weights, sha256, layouts, context)
    return [RegionalVariant(v, model, context) for v in entry["variants"]], model


def _lookup(weights: dict[str, torch.Tensor], name: str, package: Path) -> torch.Tensor:
    try:
        return weights[name]
    except KeyError:
        raise CorruptArtifactError(f"{package}: the weights file lacks constant {name!r}") from None
