"""One compiled model of a package, bound to its weights: loading it, the input signature it
was compiled for, the checks AOTInductor does not make, and calling it."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptArtifactError, LossyInputError
from ..spec.private_apis import aoti_runner, pytree
from ..spec.shapes import failed_guard, infer_size, relations_hold, solve, uncheckable_guard
from .cache import extracted_package
from .graphs import CudaGraph, GraphPool
from .prepared import PreparedConstants
from .weights import Lender, bindable, contiguous_strides, dtype_name

# A compiled model's name in its package (a variant's, `b1_64x64`; a region's, `r0_dynamic`): one folder
# name, so no manifest can point a load outside the package or at several models with a pattern.
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
SIZES_REMEMBERED = 64  # calls' size sets whose fit a variant keeps (a dynamic model sees many)


def leaf_name(path: tuple) -> str:
    """A readable name for a leaf of an (args, kwargs) pair: `args[0]`, `added_cond_kwargs.time_ids`."""
    keys = [getattr(k, "idx", getattr(k, "key", k)) for k in path]
    if not keys:
        return "input"
    head = f"args[{keys[1]}]" if keys[0] == 0 and len(keys) > 1 else str(keys[1] if len(keys) > 1 else keys[0])
    return ".".join([head, *map(str, keys[2:])])


def leaf_signature(tree: Any) -> list[dict[str, Any]]:
    """Flattened description of a call: per leaf its path and, for tensors, shape/dtype/stride."""
    leaves = []
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        key = leaf_name(path)
        if isinstance(leaf, torch.Tensor):
            leaves.append({"path": key, "shape": list(leaf.shape), "dtype": dtype_name(leaf.dtype),
                           "stride": list(leaf.stride())})
        else:
            leaves.append({"path": key, "value": repr(leaf)})
    return leaves


def open_model(package: Path, sha256: str, name: str, device: torch.device) -> Any:
    """The compiled model `name` of a package, loaded in place from the extracted-package cache
    (no archive extraction per process, nothing written to the temporary folder), with
    AOTInductor's single-threaded runner on every device.

    Why single-threaded: the threaded runner keeps one model instance per concurrent call and,
    before each call, waits for the previous call's CUDA event, so the host cannot queue the next
    denoising step while the GPU runs this one; and querying that event is not allowed while a
    CUDA graph is captured. Pipeline calls are sequential; `CompiledVariant.run` serialises
    concurrent callers with a lock.

    `sha256` must be the package's hash as checked by the caller.
    """
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):  # read from the manifest: a folder's name
        raise CorruptArtifactError(f"{package}: the manifest names a compiled model {name!r}, not a plain folder name "
                                   f"of the package")
    folder = extracted_package(package, sha256)
    if next(folder.glob(f"*/data/aotinductor/{name}/*.so"), None) is None:
        raise CorruptArtifactError(f"{package}: no compiled library for variant {name}")
    index = device.index if device.type == "cuda" and device.index is not None else -1
    return aoti_runner(folder, name, index)


def _flattener(spec: pytree.TreeSpec) -> Callable[[Any, list], bool] | None:
    """A call's flattening for this structure, made once: it appends the call's leaves in `spec`'s
    order and says whether the call has that structure (a dict's keys in any order). A pipeline's
    call is tuples, lists, dicts and leaves; for any other node, None (pytree flattens, ~4x slower)."""
    if spec.is_leaf():
        return _leaf
    children = [_flattener(spec.child(i)) for i in range(spec.num_children)]
    if None in children or spec.type not in (tuple, list, dict):
        return None
    kind = spec.type
    if kind is dict:
        keys = list(spec.context)

        def mapping(value: Any, leaves: list) -> bool:
            return type(value) is dict and len(value) == len(keys) and all(
                key in value and child(value[key], leaves) for key, child in zip(keys, children, strict=True))
        return mapping

    def sequence(value: Any, leaves: list) -> bool:
        return type(value) is kind and len(value) == len(children) and all(
            child(item, leaves) for item, child in zip(value, children, strict=True))
    return sequence


def _leaf(value: Any, leaves: list) -> bool:
    if type(value) in pytree.SUPPORTED_NODES:  # a container where the model took a leaf
        return False
    leaves.append(value)
    return True


@dataclass
class LoadContext:
    """What the compiled models of one load share.

    `lock` orders every call and weight switch of the load's models: one lock for all components,
    because their CUDA graphs share one memory pool and one capture stream, so the UNet of one
    request and the VAE of another must not capture or replay at once; the single-threaded runner
    is not reentrant either. `graph_pool`: CUDA graphs for static buckets (None: none). `tf32`:
    the artifact was validated with TF32 matmuls, which its calls turn on for their duration only.
    `lender`: the borrowed views of the weights the models bind (see `Lender`).
    """

    device: torch.device
    graph_pool: GraphPool | None = None
    tf32: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)
    lender: Lender = field(default_factory=Lender)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())


# The process's open `tf32` blocks (their wish, in the order they were entered) and the flags as
# they were before the first: the flags are process-wide, the blocks may be in several threads.
_TF32_LOCK = threading.Lock()
_TF32_OPEN: dict[object, bool] = {}
_TF32_BEFORE: list[tuple[bool, bool]] = []


def _set_tf32(matmul: bool, cudnn: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 matmuls and convolutions on CUDA (`enabled`) within the block. The flags are the
    process's: while blocks are open, they follow the one entered last that is still open (a
    build's float32 reference inside its TF32 build; the calls of two loads in two threads); when
    the last closes, they are as they were before the first, whatever order the blocks close in.
    A build or a compiled call never changes them for the rest of the process."""
    token = object()
    with _TF32_LOCK:
        if not _TF32_OPEN:
            _TF32_BEFORE[:] = [(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)]
        _TF32_OPEN[token] = enabled
        _set_tf32(enabled, enabled)
    try:
        yield
    finally:
        with _TF32_LOCK:
            del _TF32_OPEN[token]
            if _TF32_OPEN:
                latest = next(reversed(_TF32_OPEN.values()))
                _set_tf32(latest, latest)
            else:
                _set_tf32(*_TF32_BEFORE.pop())


class CompiledVariant:
    """One compiled model of a package (one shape variant), bound to its weights by pointer.

    `weights` maps FQNs to tensors with the strides the code was compiled for (`layouts`: the
    constants stored in another memory order than contiguous); each is checked before binding.
    A static variant of a load with a graph pool replays as a CUDA graph (`CudaGraph`).
    """

    _prepared: PreparedConstants | None = None  # optimize.prepack's constants (a region's variant: none)

    def __init__(self, package: Path, entry: dict[str, Any], weights: dict[str, torch.Tensor], sha256: str,
                 layouts: dict[str, dict] | None, context: LoadContext,
                 release: Callable[[Iterable[torch.Tensor]], Any] | None = None) -> None:
        """`release`: takes weights' pages out of memory (`weights.page_releaser`, at a load of the
        artifact's own weights): each weight read only to be packed, once packed."""
        self._init_signature(entry, context)
        # A region's variant is one of several models of the package (`model`); else it is named so.
        self._model = open_model(package, sha256, entry.get("model", self.name), context.device)
        self.constant_fqns = list(self._model.get_constant_fqns())
        self._fqns = set(self.constant_fqns)
        recipes = entry.get("prepared", {})
        if recipes:  # constants made from the weights at load (optimize.prepack), remade when those change
            read = self._fqns - set(recipes)  # by the code itself, by pointer: their pages stay
            self._prepared = PreparedConstants(recipes, weights, package, release and (
                lambda fqns: release([weights[fqn] for fqn in fqns if fqn not in read])))
        # The tensors bound now, kept alive here for as long as the model may read them.
        self._bound = {fqn: self._prepared.tensors[fqn] if fqn in recipes else
                       bindable(weights, fqn, layouts or {}, package) for fqn in self.constant_fqns}
        # Bind before any call: a weight-less model run without constants crashes the process.
        # user_managed: by pointer, no copy.
        self._model.load_constants(context.lender.views(self._bound), False, True, True)
        self._run = self._model.boxed_run  # takes the list of inputs it is given
        self._init_calls(*self._model.get_call_spec())

    def weight_reads(self) -> tuple[set[str], set[str]]:
        """The weights (FQNs) read to make this model's prepared constants as copies of them
        (oneDNN-packed), and those its code reads (bound by pointer, or through a prepared view)."""
        if self._prepared is None:
            return set(), set(self.constant_fqns)
        code = {fqn for fqn in self.constant_fqns if fqn not in self._prepared.tensors} | self._prepared.viewed
        return self._prepared.copied, code

    def _init_signature(self, entry: dict[str, Any], context: LoadContext) -> None:
        """The variant's name, manifest entry, inputs and load context."""
        self.name = entry["name"]
        self.entry = entry
        self.inputs = entry["inputs"]
        if guard := uncheckable_guard(entry.get("guards", ())):  # never at a call: a damaged manifest
            raise CorruptArtifactError(f"variant {self.name}: the manifest records a shape guard aotbuild cannot "
                                       f"check, {guard!r} (a build writes integer arithmetic on sizes only)",
                                       hint="rebuild the artifact, or pull it again")
        # What each leaf of a call must be, read once from the manifest: a tensor (of this static
        # shape, None where dims vary) or this value's repr (a pipeline calls every step).
        self._leaf_checks = [("value" not in e, e.get("value"),
                              tuple(e["shape"]) if "value" not in e and "dims" not in e else None) for e in self.inputs]
        # Inputs compiled row-major (most): a call's tensor needs only to be contiguous, whatever its batch.
        self._row_major = ["stride" in e and "layout" not in e and contiguous_strides(e["shape"]) == e["stride"]
                           for e in self.inputs]
        self._leaf_names = [leaf["path"] for leaf in self.inputs]  # in the order the model's in_spec flattens
        self._sizes_fit: dict[tuple, bool] = {}  # whether a call's tensor sizes fit, by those sizes
        self._context = context
        self._device = context.device
        self._lock = context.lock

    def _init_calls(self, in_spec: str, out_spec: str) -> None:
        self.in_spec = pytree.treespec_loads(in_spec)
        self.out_spec = pytree.treespec_loads(out_spec)
        self._flatten_call = _flattener(self.in_spec)
        # A bucket's model serves a few call batches (1 image to its batch, guided and not): one
        # graph per call shape, captured on its first call.
        pool = self._context.graph_pool
        self.graph_pool = pool if self._device.type == "cuda" and "bucket" in self.entry else None
        self.cuda_graphs: dict[tuple, CudaGraph] = {}

    def rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Bind these constants (a subset, by FQN) in place of the ones bound now, by pointer; the
        next call reads them, and the tensors bound before are no longer kept alive for it. A
        captured CUDA graph recorded the old pointers: captured again."""
        mine = {fqn: tensor for fqn, tensor in tensors.items() if fqn in self._fqns}
        with self._lock:
            if self._prepared is not None:  # the constants made from these weights, made again
                mine |= self._prepared.rebind(tensors)
            if mine:
                self._bind(mine)

    def _bind(self, mine: dict[str, torch.Tensor]) -> None:
        """Bind these constants by pointer (the caller holds the lock)."""
        self._model.load_constants(self._context.lender.views(mine), False, False, True)
        self._bound.update(mine)
        for graph in self.cuda_graphs.values():
            graph.reset()

    def flatten(self, args: tuple, kwargs: dict) -> list[tuple[str, Any]] | None:
        """The call's leaves in this model's order, or None when its structure differs."""
        if self._flatten_call is not None:
            leaves: list[Any] = []
            return list(zip(self._leaf_names, leaves, strict=True)) \
                if self._flatten_call((tuple(args), kwargs), leaves) else None
        kwargs_spec = self.in_spec.child(1)
        if set(kwargs) != set(kwargs_spec.context):
            return None
        ordered = {k: kwargs[k] for k in kwargs_spec.context}
        # Without key paths (~50 us a call): the leaves' names are the signature's, in the same order.
        leaves, spec = pytree.tree_flatten((tuple(args), ordered))
        if spec != self.in_spec:
            return None
        return list(zip(self._leaf_names, leaves, strict=True))

    def accepts(self, leaves: list[tuple[str, Any]]) -> bool:
        """Whether this model computes these inputs correctly (AOTInductor itself checks nothing)."""
        for (_, leaf), (tensor, value, static) in zip(leaves, self._leaf_checks, strict=True):
            if isinstance(leaf, torch.Tensor):
                if not tensor or (static is not None and leaf.shape != static):
                    return False
            elif tensor or repr(leaf) != value:
                return False
        if "call_batch" in self.entry or "dynamic" in self.entry:
            # A pipeline calls with the same sizes every step: solved once per set of sizes.
            key = tuple(tuple(leaf.shape) for _, leaf in leaves if isinstance(leaf, torch.Tensor))
            fits = self._sizes_fit.get(key)
            if fits is None:
                dims, sizes, ranges = self._sized(leaves)
                fits = infer_size(dims, sizes, ranges, ranges.get("stride", 1)) is not None and relations_hold(
                    dims, sizes, self.entry.get("guards", ()))
                if len(self._sizes_fit) >= SIZES_REMEMBERED:
                    self._sizes_fit.clear()
                self._sizes_fit[key] = fits
            return fits
        return True

    def broken_guard(self, leaves: list[tuple[str, Any]]) -> str | None:
        """The guard export took that these inputs break where their sizes are otherwise in this
        dynamic model's ranges (the reason `accepts` refuses them), else None."""
        if not self.entry.get("guards") or "dynamic" not in self.entry:
            return None
        dims, sizes, ranges = self._sized(leaves)
        bound = solve(dims, sizes) if infer_size(dims, sizes, ranges, ranges.get("stride", 1)) else None
        return None if bound is None else failed_guard(self.entry["guards"], bound)

    def _sized(self, leaves: list[tuple[str, Any]]) -> tuple[list, list[list[int]], dict[str, Any]]:
        """The tensor inputs' dims as recorded, their sizes in this call, and the variant's ranges."""
        tensors = [(list(leaf.shape), e["dims"]) for (_, leaf), e in zip(leaves, self.inputs, strict=True)
                   if isinstance(leaf, torch.Tensor)]
        ranges = {**self.entry.get("dynamic", {}), "batch": self.entry.get("call_batch")}
        return [d for _, d in tensors], [s for s, _ in tensors], ranges

    def bare_call(self, leaves: list[tuple[str, Any]]) -> Callable[[], list[torch.Tensor]]:
        """The compiled model alone on these inputs, prepared once: no dispatch, checks, conversion
        or lock per call (`aotbuild bench --component` times the stand-in's own cost against it)."""
        tensors = self._prepare(leaves)
        return lambda: self._run(list(tensors))  # boxed_run empties the list it is given

    def run(self, leaves: list[tuple[str, Any]]) -> Any:
        with self._lock:  # the single-threaded runner is not reentrant
            with tf32(True) if self._context.tf32 else contextlib.nullcontext():
                return self._run_unlocked(leaves)

    def _run_unlocked(self, leaves: list[tuple[str, Any]]) -> Any:
        if self._prepared is not None and (remade := self._prepared.refresh()):  # weights written in place
            self._bind(remade)
        if self.graph_pool is not None:
            tensors = [self._converted(path, leaf, expected) for (path, leaf), expected
                       in zip(leaves, self.inputs, strict=True) if isinstance(leaf, torch.Tensor)]
            return pytree.tree_unflatten(self._cuda_graph(tensors)(tensors), self.out_spec)
        return self._run_direct(leaves)

    def _run_direct(self, leaves: list[tuple[str, Any]]) -> Any:
        tensors = self._prepare(leaves)
        # The runner launches on the current device's stream: make that this model's device.
        with torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext():
            return pytree.tree_unflatten(self._run(tensors), self.out_spec)

    def _converted(self, path: str, leaf: torch.Tensor, expected: dict[str, Any]) -> torch.Tensor:
        """`leaf` on the model's device in the dtype it was compiled for (AOTInductor reads raw
        memory: an int64 timestep would otherwise be read as float bits). A conversion between
        integer and floating point that changes a value (a float timestep of one scheduler, a
        model traced with another's integer timesteps) is refused; from one floating point type to
        another, the values take the artifact's precision."""
        want = getattr(torch, expected["dtype"])
        if leaf.dtype is want and leaf.device == self._device:  # as compiled: nothing to convert
            return leaf
        converted = leaf.to(device=self._device, dtype=want)
        if leaf.dtype != want and (leaf.is_floating_point() != converted.is_floating_point()
                                   or not leaf.is_floating_point()):
            back = converted.to(device=leaf.device, dtype=leaf.dtype)
            if not torch.equal(back, leaf):
                value = leaf[back != leaf].flatten()[0].item()
                raise LossyInputError(
                    f"input {path} is {value!r} ({dtype_name(leaf.dtype)}) in this call; the compiled model takes "
                    f"{expected['dtype']}, which would make it {back[back != leaf].flatten()[0].item()!r}",
                    hint="rebuild the artifact with this aotbuild (denoisers take float timesteps now), or use a "
                         "scheduler whose timesteps are integers")
        return converted

    def _prepare(self, leaves: list[tuple[str, Any]]) -> list[torch.Tensor]:
        """The call's tensors as the model was compiled for them."""
        tensors = []
        for (path, leaf), expected, row_major in zip(leaves, self.inputs, self._row_major, strict=True):
            if isinstance(leaf, torch.Tensor):
                leaf = self._converted(path, leaf, expected)
                if row_major:
                    leaf = leaf.contiguous()  # itself when it is
                elif "stride" in expected and list(leaf.stride()) != expected["stride"]:  # e.g. NHWC builds
                    # The compiled strides hold for a smaller call batch too (batch is the outer dim).
                    leaf = torch.empty_strided(leaf.shape, expected["stride"], dtype=leaf.dtype,
                                               device=self._device).copy_(leaf)
                elif expected.get("layout") == "channels_last":
                    leaf = leaf.contiguous(memory_format=torch.channels_last)
                elif isinstance(expected.get("layout"), list):  # dims in memory order, outer to inner
                    order = expected["layout"]
                    leaf = leaf.permute(order).contiguous().permute([order.index(d) for d in range(len(order))])
                elif "layout" in expected:
                    leaf = leaf.contiguous()
                tensors.append(leaf)
        return tensors

    def _cuda_graph(self, tensors: list[torch.Tensor]) -> CudaGraph:
        key = tuple(tuple(t.shape) for t in tensors)
        graph = self.cuda_graphs.get(key)
        if graph is None:
            expected = [e for e in self.inputs if "shape" in e]
            shaped = [{**e, "shape": list(t.shape)} for t, e in zip(tensors, expected, strict=True)]
            graph = self.cuda_graphs[key] = CudaGraph(f"{self.name} at {list(key[0])}", self._run, shaped,
                                                      self._device, self.graph_pool)
        return graph

    def __repr__(self) -> str:
        return f"CompiledVariant({self.name}, bucket={self.entry.get('bucket')})"
