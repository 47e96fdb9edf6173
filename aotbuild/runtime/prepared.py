"""Constants a compiled model reads in a form prepared from the weights (`optimize.prepack`):
convolution and linear weights in the blocked layout oneDNN computes with, made at load from the
weights bound now, and made again whenever those weights change (another checkpoint, a LoRA
merged, a parameter written in place), so that the weights stay data.

The manifest records, per variant, how each is made (`entry["prepared"]`: name -> recipe). A
recipe is a tree of JSON: `{"weight": FQN}` reads a bound weight; `{"op": "ns.name[.overload]",
"args": [...], "kwargs": {...}}` calls one of the torch operators aotbuild records; an argument is a
recipe, a JSON literal, a list, or `{"memory_format": name}` / `{"dtype": name}`; the operators are
an allow-list (`OPERATORS`), checked at build and at load. E.g. a 3x3
convolution's weight: `mkldnn._reorder_convolution_weight(aten.clone.default(conv.weight,
memory_format=channels_last), [1, 1], [1, 1], [1, 1], 1, [2, 320, 16, 16])`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CorruptArtifactError
from ..spec.private_apis import versions

# The operators a recipe may call, as the build records them: what freezing folds into a weight's
# prepared form (a layout, a dtype, oneDNN's packing, a constant folded into a convolution, the crop
# of a position-embedding table: SD3's; the rotary table of a video's grid, split and concatenated:
# Wan's; `operator.getitem` picks one tensor of a split), and nothing else a manifest might name (no
# in-place write). A recipe's sizes are the artifact's, trusted as its compiled code is.
OPERATORS = frozenset({
    "aten.clone.default", "aten.permute.default", "aten.reshape.default", "aten.view.default", "aten.t.default",
    "aten.transpose.int", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.slice.Tensor", "aten.expand.default",
    "aten.split.Tensor", "aten.split_with_sizes.default", "operator.getitem", "aten.cat.default",
    "aten._to_copy.default", "prims.convert_element_type.default",
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
    "mkldnn._reorder_convolution_weight", "mkldnn._reorder_convolution_transpose_weight",
    "mkldnn._reorder_linear_weight",
})


def resolve(op: str) -> Any:
    """The torch operator a recipe names: `aten.clone.default`, `mkldnn._reorder_convolution_weight`.

    Raises:
        CorruptArtifactError: not one of `OPERATORS`, or one this torch lacks.
    """
    if op not in OPERATORS:
        raise CorruptArtifactError(f"a prepared constant's recipe calls {op!r}, not one of the operators aotbuild "
                                   f"records ({', '.join(sorted(OPERATORS))})")
    if op == "operator.getitem":
        return operator.getitem
    namespace, name, *overload = op.split(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, overload[0]) if overload else packet
    except AttributeError:
        raise CorruptArtifactError(f"a prepared constant's recipe calls {op!r}, which this torch "
                                   f"({torch.__version__}) lacks") from None


def operator_name(target: Any) -> str:
    """How a recipe names the operator an FX node calls (`OPERATORS`)."""
    return "operator.getitem" if target is operator.getitem else str(target)


def sources(recipe: Any) -> set[str]:
    """The weights (FQNs) a recipe reads."""
    if isinstance(recipe, list):
        return set().union(*map(sources, recipe)) if recipe else set()
    if not isinstance(recipe, dict):
        return set()
    if "weight" in recipe:
        return {recipe["weight"]}
    return sources(recipe.get("args", [])) | sources(list(recipe.get("kwargs", {}).values()))


def prepare(recipe: dict[str, Any], weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The recipe's tensor, made from `weights` (no autograd: constants)."""
    with torch.no_grad():
        return _value(recipe, weights)


def _value(node: Any, weights: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_value(item, weights) for item in node]
    if not isinstance(node, dict):
        return node
    if "weight" in node:
        return weights[node["weight"]]
    if "op" in node:
        return resolve(node["op"])(*_value(node.get("args", []), weights),
                                   **{k: _value(v, weights) for k, v in node.get("kwargs", {}).items()})
    if "memory_format" in node:
        return getattr(torch, node["memory_format"])
    if "dtype" in node:
        return getattr(torch, node["dtype"])
    raise CorruptArtifactError(f"a prepared constant's recipe holds {node!r}, which is no recipe step")


class PreparedConstants:
    """One variant's prepared constants, each made once from the weights it reads and made again
    when they change: `rebind` for weights bound anew, `refresh` before each call for weights
    written in place (their version counters). A oneDNN-packed constant is remade in place (the
    compiled model keeps its pointer); any other (a reshape, a layout copy) may be a view of its
    weight, so it is made anew and returned, for the caller to bind instead. A view sees its
    weight's in-place writes by itself: `refresh` watches only the weights of the others (the
    check runs before every call: a third of tiny SDXL's UNet weights are read by views alone)."""

    def __init__(self, recipes: dict[str, dict[str, Any]], weights: dict[str, torch.Tensor], package: Any,
                 release: Callable[[list[str]], Any] | None = None) -> None:
        """`release`: given the weights (FQNs) a constant just made is a copy of, takes their pages
        out of memory (a load's, `weights.page_releaser`): each weight goes as soon as it is packed."""
        self._recipes = recipes
        self._reads = {name: sorted(sources(recipe)) for name, recipe in recipes.items()}
        needed = set().union(*self._reads.values()) if recipes else set()
        if missing := sorted(needed - set(weights)):
            raise CorruptArtifactError(f"{package}: the weights file lacks {missing[0]!r}, which a prepared "
                                       f"constant is made from")
        self._sources = {fqn: weights[fqn] for fqn in needed}
        self.tensors = {}
        for name, recipe in recipes.items():
            made = self.tensors[name] = prepare(recipe, self._sources)
            if release is not None and not _views_its_weights(made, [self._sources[f] for f in self._reads[name]]):
                release(self._reads[name])
        self._watch()

    def _watch(self) -> None:
        """The weights `refresh` checks: those read by a constant that is not a view of them."""
        copies = [name for name, tensor in self.tensors.items()
                  if not _views_its_weights(tensor, [self._sources[fqn] for fqn in self._reads[name]])]
        self.copied = set().union(*(self._reads[name] for name in copies))  # weights read by the copies
        self.viewed = set().union(*(self._reads[name] for name in self.tensors if name not in copies))  # by views
        self._order = sorted(self.copied)
        self._sources_in_order = [self._sources[fqn] for fqn in self._order]
        self._versions = self._read_versions()

    def _read_versions(self) -> list[Any]:
        try:
            return versions(self._sources_in_order)
        except RuntimeError:  # an inference tensor keeps no version: taken as written at every look
            return [object() if tensor.is_inference() else versions([tensor])[0] for tensor in self._sources_in_order]

    def rebind(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Weights now bound to other tensors (by FQN; others ignored): their constants remade.
        Returns the ones to bind anew."""
        changed = {fqn for fqn, tensor in tensors.items() if fqn in self._sources and tensor is not self._sources[fqn]}
        if not changed:
            return {}
        self._sources.update({fqn: tensors[fqn] for fqn in changed})
        return self._remake(changed)

    def refresh(self) -> dict[str, torch.Tensor]:
        """Remake the constants whose weights were written in place since they were made. Returns
        the ones to bind anew."""
        versions_now = self._read_versions()
        if versions_now == self._versions:
            return {}
        return self._remake({fqn for fqn, now, then in zip(self._order, versions_now, self._versions, strict=True)
                             if now != then})

    def _remake(self, changed: set[str]) -> dict[str, torch.Tensor]:
        anew = {}
        for name, reads in self._reads.items():
            if changed.intersection(reads):
                made = prepare(self._recipes[name], self._sources)
                if made.is_mkldnn:
                    self.tensors[name].copy_(made)
                else:
                    self.tensors[name] = anew[name] = made
        self._watch()  # a reshape of a weight laid out otherwise is a copy, no longer a view
        return anew


def _views_its_weights(tensor: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether `tensor` shares memory with one of the weights it is made from."""
    if tensor.is_mkldnn:
        return False
    memory = tensor.untyped_storage().data_ptr()
    return any(not weight.is_mkldnn and weight.untyped_storage().data_ptr() == memory for weight in weights)
