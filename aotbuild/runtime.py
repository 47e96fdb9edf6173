"""The lightweight loader: check an artifact against this machine, load its compiled packages,
bind their weights without copies, and swap them into a diffusers pipeline.

Imports torch and safetensors (diffusers only when a pipeline is built); never the builder,
torchao or torch._dynamo: what this module imports decides cold start.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .errors import AotbuildError, CorruptArtifactError, ShapeNotSupportedError
from .manifest import DTYPES, check_compatible, read_manifest, sha256_file, verify_files
from .pipelines import pipeline_spec
from .shapes import infer_size

_SHA256 = re.compile(r"[0-9a-f]{64}")
# Operator namespaces torch registers itself: compiled code calling them needs no extra import.
TORCH_NAMESPACES = {"aten", "prims", "quantized", "quantized_decomposed", "_c10d_functional", "fbgemm", "mkldnn",
                    "onednn", "_quantized", "higher_order"}


class Config(dict):
    """A model config readable as attributes, like diffusers' FrozenDict."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


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
            leaves.append({"path": key, "shape": list(leaf.shape), "dtype": str(leaf.dtype).removeprefix("torch."),
                           "stride": list(leaf.stride())})
        else:
            leaves.append({"path": key, "value": repr(leaf)})
    return leaves


def package_cache_dir() -> Path:
    """Where extracted packages live: $AOTBUILD_CACHE/packages, else ~/.cache/aotbuild/packages."""
    return Path(os.environ.get("AOTBUILD_CACHE", Path.home() / ".cache" / "aotbuild")) / "packages"


def extracted_package(package: Path, sha256: str) -> Path:
    """The package's files, extracted once per content hash and reused by every later process.

    `sha256` must be the hash of `package` as checked by the caller (never a manifest's claim):
    the cache is trusted by name. Extraction goes to a private temporary folder renamed into place
    when complete, so concurrent processes never see a partial folder; the loser of a rename race
    drops its copy. A cache that cannot be written falls back to a private temporary folder.
    """
    root = package_cache_dir()
    folder = root / sha256
    if (folder / ".complete").is_file():
        return folder
    if folder.is_dir():  # unmarked: never renamed into place by an extraction, so not trusted
        _remove_entry(folder)
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{sha256[:16]}-", dir=root))
    except OSError:  # read-only home in a container: extract privately, once per process
        root, folder = Path(tempfile.mkdtemp(prefix="aotbuild-packages-")), None
        staging = root / sha256
    try:
        with zipfile.ZipFile(package) as archive:
            archive.extractall(staging)
        (staging / ".complete").touch()
        if folder is None:
            return staging
        os.rename(staging, folder)
    except zipfile.BadZipFile:
        raise CorruptArtifactError(f"{package} is not a valid package archive") from None
    except OSError:
        if folder is None or not (folder / ".complete").is_file():
            raise
    finally:
        if folder is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _cache_entries(root: Path) -> list[Path]:
    """The extracted packages (named by their sha256; extractions in progress are dot-named)."""
    return [p for p in root.iterdir() if _SHA256.fullmatch(p.name)] if root.is_dir() else []


def _bytes_under(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # removed by a concurrent clear
            total += path.stat().st_size if path.is_file() else 0
    return total


def package_cache_usage() -> tuple[Path, int, int]:
    """(cache folder, extracted packages in it, their bytes)."""
    root = package_cache_dir()
    entries = _cache_entries(root)
    return root, len(entries), sum(_bytes_under(entry) for entry in entries)


def clear_package_cache() -> int:
    """Delete every extracted package (each is extracted again at its next load); returns the
    bytes freed. Each is renamed aside before it is deleted, so a loader sees it whole or not at
    all; processes that already loaded one keep their mapped libraries."""
    return sum(_remove_entry(entry) for entry in _cache_entries(package_cache_dir()))


def _remove_entry(entry: Path) -> int:
    """Rename a cache entry aside (a dot-name no loader looks at), then delete it; its bytes, or 0
    when it was gone already or not ours to move."""
    doomed = entry.parent / f".deleting-{entry.name}-{os.getpid()}"
    try:
        os.rename(entry, doomed)
    except OSError:
        return 0
    size = _bytes_under(doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return size


def _weight(weights: dict[str, torch.Tensor], fqn: str, package: Path) -> torch.Tensor:
    try:
        return weights[fqn]
    except KeyError:
        raise CorruptArtifactError(f"{package}: the weights file lacks constant {fqn!r}") from None


class GraphPool:
    """The memory pool and the one stream capturing into it, shared by the CUDA graphs of one load:
    they run one after another, the outputs they keep alive are never handed out again, and the
    allocator reuses a pool's free blocks only on the stream that freed them."""

    def __init__(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            self.handle = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)


class CudaGraph:
    """One static-shape compiled model captured as a CUDA graph on its first call, then replayed.

    AOTInductor launches every kernel from the host on each call; a replay launches the recorded
    sequence at once. Inputs are copied into static buffers (the copy also converts dtype, device
    and layout to what the model was compiled for); outputs are cloned out of the graph's memory,
    which the next replay overwrites.

    `run` must be a single-threaded runner: the threaded one records and queries a CUDA event
    around each run, and querying is not allowed while a stream is being captured.
    """

    def __init__(self, name: str, run: Any, inputs: list[dict[str, Any]], device: torch.device,
                 pool: GraphPool) -> None:
        self._name, self._run, self._device, self._pool = name, run, device, pool
        self._static = [torch.empty_strided(e["shape"], e["stride"], dtype=getattr(torch, e["dtype"]), device=device)
                        for e in inputs if "shape" in e]
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: list[torch.Tensor] = []

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.cuda.device(self._device):  # replay launches on the current device's stream
            for static, tensor in zip(self._static, tensors, strict=True):
                static.copy_(tensor)
            if self._graph is None:
                self._graph = self._capture()
            self._graph.replay()
            return [output.clone() for output in self._outputs]

    def _capture(self) -> torch.cuda.CUDAGraph:
        # One ordinary run first, on a side stream: it loads the kernels (module loading cannot be
        # captured) and settles the allocator. The model takes the current stream, so under
        # `torch.cuda.graph` its launches are recorded. The runner empties the list it is given.
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            self._run(list(self._static))
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool.handle, stream=self._pool.stream):
                self._outputs = self._run(list(self._static))
        except RuntimeError as exc:
            raise AotbuildError(f"CUDA graph capture of compiled model {self._name} failed: {exc}",
                                hint="load with cuda_graphs=False (aotbuild run --no-cuda-graphs); "
                                     "to build without graphs, set cuda_graphs = false in the target") from exc
        return graph


class CompiledVariant:
    """One compiled model of a package (one shape variant), bound to its weights.

    On CPU the model's library is loaded straight from the extracted-package cache with the
    container runner (no archive extraction per process); on CUDA through torch's package loader.
    A static variant given a `cuda_graph_pool` replays as a CUDA graph (`CudaGraph`).
    """

    def __init__(self, package: Path, entry: dict[str, Any], device: torch.device,
                 weights: dict[str, torch.Tensor], sha256: str | None = None,
                 cuda_graph_pool: GraphPool | None = None) -> None:
        self.name = entry["name"]
        self.entry = entry
        self.inputs = entry["inputs"]
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        graphed = device.type == "cuda" and cuda_graph_pool is not None and "bucket" in entry
        # Bind before any call: a weight-less model run without constants crashes the process.
        if device.type == "cpu":
            folder = extracted_package(package, sha256 or sha256_file(package))  # callers pass checked hashes
            library = next(folder.glob(f"*/data/aotinductor/{self.name}/*.so"), None)
            if library is None:
                raise CorruptArtifactError(f"{package}: no compiled library for variant {self.name}")
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(os.fspath(library), 1)
            names = runner.get_constant_names_to_original_fqns()
            runner.update_constant_buffer({name: _weight(weights, fqn, package) for name, fqn in names.items()},
                                          False, True, True)
            self._run = runner.run
        else:
            runner = torch._C._aoti.AOTIModelPackageLoader(os.fspath(package), self.name, graphed, 1, device.index)
            runner.load_constants({k: _weight(weights, k, package) for k in runner.get_constant_fqns()},
                                  False, True, True)
            self._run = runner.boxed_run
        in_spec, out_spec = runner.get_call_spec()
        self.in_spec = pytree.treespec_loads(in_spec)
        self.out_spec = pytree.treespec_loads(out_spec)
        self.cuda_graph = None
        if graphed:
            self.cuda_graph = CudaGraph(self.name, self._run, self.inputs, device, cuda_graph_pool)

    def flatten(self, args: tuple, kwargs: dict) -> list[tuple[str, Any]] | None:
        """The call's leaves in this model's order, or None when its structure differs."""
        kwargs_spec = self.in_spec.child(1)
        if set(kwargs) != set(kwargs_spec.context):
            return None
        ordered = {k: kwargs[k] for k in kwargs_spec.context}
        leaves, spec = pytree.tree_flatten_with_path((tuple(args), ordered))
        if spec != self.in_spec:
            return None
        return [(leaf_name(path), leaf) for path, leaf in leaves]

    def accepts(self, leaves: list[tuple[str, Any]]) -> bool:
        """Whether this model computes these inputs correctly (AOTInductor itself checks nothing)."""
        for (_, leaf), expected in zip(leaves, self.inputs, strict=True):
            if isinstance(leaf, torch.Tensor) != ("value" not in expected):
                return False
            if not isinstance(leaf, torch.Tensor) and repr(leaf) != expected["value"]:
                return False
            if isinstance(leaf, torch.Tensor) and "shape" in expected and list(leaf.shape) != expected["shape"]:
                return False
        if "dynamic" in self.entry:
            tensors = [(list(leaf.shape), e["dims"]) for (_, leaf), e in zip(leaves, self.inputs, strict=True)
                       if isinstance(leaf, torch.Tensor)]
            ranges = self.entry["dynamic"]
            return infer_size([d for _, d in tensors], [s for s, _ in tensors], ranges, ranges["stride"]) is not None
        return True

    def run(self, leaves: list[tuple[str, Any]], device: torch.device) -> Any:
        if self.cuda_graph is not None:
            tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
            return pytree.tree_unflatten(self.cuda_graph(tensors), self.out_spec)
        tensors = []
        for (_, leaf), expected in zip(leaves, self.inputs, strict=True):
            if isinstance(leaf, torch.Tensor):
                # Every input in the dtype the model was compiled for: AOTInductor reads raw memory, so
                # an int64 timestep from another scheduler would otherwise be read as float bits.
                want = getattr(torch, expected["dtype"])
                leaf = leaf.to(device=device, dtype=want)
                if "stride" in expected and list(leaf.stride()) != expected["stride"]:  # e.g. NHWC builds
                    leaf = torch.empty_strided(expected["shape"], expected["stride"], dtype=want,
                                               device=device).copy_(leaf)
                elif expected.get("layout") == "channels_last":
                    leaf = leaf.contiguous(memory_format=torch.channels_last)
                elif "layout" in expected:
                    leaf = leaf.contiguous()
                tensors.append(leaf)
        # The runner launches on the current device's stream: make that this model's device.
        with torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext():
            return pytree.tree_unflatten(self._run(tensors), self.out_spec)

    def __repr__(self) -> str:
        return f"CompiledVariant({self.name}, bucket={self.entry.get('bucket')})"


class CompiledComponent(torch.nn.Module):
    """Stands in for a pipeline module: keeps its `config`, `dtype`, `device` and the attributes the
    pipeline reads, and routes calls to the compiled variant matching the input shapes."""

    def __init__(self, name: str, entry: dict[str, Any], variants: list[CompiledVariant],
                 weights: dict[str, torch.Tensor], device: torch.device,
                 eager: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.component_name = name
        self.config = Config(entry["config"])
        self.variants = variants
        self._weights = weights  # bound by pointer (user_managed): must live as long as the models
        self._dtype = DTYPES[entry["dtype"]]
        self._device = device
        self._spec = pipeline_spec(entry["pipeline"]).component(name)
        self._eager = [eager] if eager is not None else []  # a list: not registered as a submodule
        self.last_variant: str | None = None
        for dotted, value in entry.get("attributes", {}).items():
            _set_dotted(self, dotted, value)
        if self._spec.method != "forward":
            setattr(self, self._spec.method, self.forward)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def cache_context(self, name: str) -> contextlib.AbstractContextManager:
        """diffusers' CacheMixin hook (Flux enters it around each call); nothing to cache here."""
        return contextlib.nullcontext()

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return_dict = kwargs.pop("return_dict", True)
        call_args, call_kwargs = self._spec.call_inputs(args, kwargs)
        for variant in self.variants:
            leaves = variant.flatten(call_args, call_kwargs)
            if leaves is not None and variant.accepts(leaves):
                self.last_variant = variant.name
                outputs = variant.run(leaves, self._device)
                break
        else:
            if not self._eager:
                raise ShapeNotSupportedError(self._coverage_message(call_args, call_kwargs))
            warnings.warn(f"aotbuild: {self._coverage_message(call_args, call_kwargs)}; running eager", stacklevel=2)
            self.last_variant = "eager"
            return getattr(self._eager[0], self._spec.method)(*args, return_dict=return_dict, **kwargs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        if not return_dict:
            return tuple(outputs)
        module_name, class_name = self._spec.output_class.rsplit(".", 1)
        return getattr(importlib.import_module(module_name), class_name)(sample=outputs[0])

    def _coverage_message(self, args: tuple, kwargs: dict) -> str:
        shapes = [f"{leaf_name(p)} {list(x.shape)}" for p, x in pytree.tree_flatten_with_path((args, kwargs))[0]
                  if isinstance(x, torch.Tensor)]
        covered = "; ".join(variant_coverage(v.entry) for v in self.variants)
        return (f"{self.component_name}: no compiled variant for inputs {', '.join(shapes)}; "
                f"this artifact covers (batch x height x width): {covered}")

    def extra_repr(self) -> str:
        return f"{self.component_name}, variants={[v.name for v in self.variants]}"


def variant_coverage(entry: dict[str, Any]) -> str:
    """What shapes a variant serves: "2x64x96" for a bucket, ranges for the dynamic model."""
    if "dynamic" in entry:
        d = entry["dynamic"]
        return (f"{d['batch'][0]}-{d['batch'][1]}x{d['height'][0]}-{d['height'][1]}x{d['width'][0]}-{d['width'][1]} "
                f"(dynamic, multiples of {d['stride']} px)")
    b = entry["bucket"]
    return f"{b['batch']}x{b['height']}x{b['width']}"


def _set_dotted(root: Any, dotted: str, value: Any) -> None:
    """root.a.b.c = value, creating plain namespaces for the missing parents."""
    *parents, leaf = dotted.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            setattr(node, part, SimpleNamespace())
        node = getattr(node, part)
    setattr(node, leaf, value)


def _import_custom_ops(namespaces: list[str]) -> None:
    """Register the operators compiled code calls back into (only for artifacts that need them)."""
    for namespace in namespaces:
        if namespace in TORCH_NAMESPACES:
            continue
        try:
            importlib.import_module(namespace)
        except ImportError:
            raise AotbuildError(f"this artifact's compiled code calls {namespace} operators, and {namespace} "
                                f"is not installed", hint=f"pip install {namespace}") from None


def _load_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.fspath(path), device=str(device))


def load_components(folder: str | os.PathLike, *, device: str | torch.device | None = None,
                    dtype: str | None = None, eager: dict[str, torch.nn.Module] | None = None,
                    verify: bool = True, cuda_graphs: bool | None = None,
                    ) -> tuple[dict[str, Any], dict[str, CompiledComponent]]:
    """Check an artifact and load its compiled components.

    Args:
        folder: the artifact folder.
        device: where to run; defaults to the artifact's device type.
        dtype: refuse the artifact unless it was built for this dtype.
        eager: original modules by component name, used (with a warning) for uncovered shapes.
        verify: check every file's sha256 before loading native code.
        cuda_graphs: replay static buckets as CUDA graphs; None takes the target's `cuda_graphs`.

    Returns:
        (manifest, {pipeline attribute: CompiledComponent}).

    Raises:
        IncompatibleArtifactError, CorruptArtifactError.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    device = torch.device(device or manifest["environment"]["device_type"])
    check_compatible(manifest, device=device.type, dtype=dtype)
    if verify:
        verify_files(folder, manifest)
    if manifest["optimizations"]["passes"].get("tf32", {}).get("enabled") and device.type == "cuda":
        # The artifact was validated with TF32 matmuls; cuBLAS calls inside it read these flags.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if cuda_graphs is None:
        cuda_graphs = manifest["runtime"].get("cuda_graphs", False)
    if cuda_graphs and device.type != "cuda":
        raise AotbuildError(f"CUDA graphs need a CUDA device; this artifact runs on {device.type}",
                            hint="load it with cuda_graphs=False")
    modules = {}
    pool = GraphPool(device) if cuda_graphs else None
    for name, entry in manifest["components"].items():
        _import_custom_ops(entry.get("custom_ops", []))
        weights = _load_weights(folder / entry["weights"], device)
        sha256 = manifest["files"][entry["package"]]["sha256"] if verify else None  # None: hash the file
        variants = [CompiledVariant(folder / entry["package"], v, device, weights, sha256, pool)
                    for v in entry["variants"]]
        modules[entry["attribute"]] = CompiledComponent(
            name, {**entry, "pipeline": manifest["target"]["pipeline"]}, variants, weights, device,
            eager=(eager or {}).get(name))
    return manifest, modules


def artifact_folder(artifact: str | os.PathLike, *, device: str | None = None, dtype: str | None = None,
                    pipeline: str | None = None) -> tuple[Path, Any]:
    """(local folder, `hub.Resolved` or None for a local folder). `hf://org/name[@revision]` is
    resolved to the variant fitting this machine (and `pipeline`) in the HF cache, downloading only
    that variant, whose hashes are then already checked."""
    if isinstance(artifact, str) and artifact.startswith("hf://"):
        from .hub import resolve

        resolved = resolve(artifact, device=device, dtype=dtype, pipeline=pipeline)
        return resolved.folder, resolved
    return Path(artifact), None


def apply(pipe: Any, artifact: str | os.PathLike, *, eager_fallback: bool = False,
          cuda_graphs: bool | None = None) -> Any:
    """Swap an artifact's compiled components into a pipeline the user already has.

    The pipeline's original modules of those components are released (unless `eager_fallback`,
    which keeps them to run shapes no variant covers, with a warning). `cuda_graphs` as in
    `load_components`.

    Returns:
        The same pipeline, modified in place.
    """
    device = next((m.device for m in pipe.components.values() if isinstance(m, torch.nn.Module)), None)
    artifact, resolved = artifact_folder(artifact, device=device.type if device is not None else None,
                                         pipeline=type(pipe).__name__)
    manifest = read_manifest(artifact)
    if type(pipe).__name__ != manifest["target"]["pipeline"]:
        raise AotbuildError(f"artifact is for {manifest['target']['pipeline']}, not {type(pipe).__name__}")
    eager = None
    if eager_fallback:
        eager = {name: getattr(pipe, entry["attribute"]) for name, entry in manifest["components"].items()}
    _, modules = load_components(artifact, device=device, eager=eager, verify=resolved is None,
                                 cuda_graphs=cuda_graphs)
    for attribute, module in modules.items():
        setattr(pipe, attribute, module)
    return pipe


def load_pipeline(artifact: str | os.PathLike, *, device: str | None = None, dtype: str | None = None,
                  cuda_graphs: bool | None = None) -> Any:
    """Build the artifact's pipeline with its compiled components plugged in. `artifact` is a folder
    or `hf://org/name[@revision]`; `cuda_graphs` as in `load_components`.

    The original weights of compiled components are never loaded; the other components come from
    the manifest's source (the Hub at the pinned revision, a local folder, or the artifact's own
    config set with seeded random weights).

    Raises:
        IncompatibleArtifactError, CorruptArtifactError, SourceError.
    """
    from .sources import SOURCE_DIRNAME, assemble_pipeline, is_random, resolve_folder
    from .sources import load_components as load_source_components

    folder, resolved = artifact_folder(artifact, device=device, dtype=dtype)
    manifest, modules = load_components(folder, device=device, dtype=dtype, verify=resolved is None,
                                        cuda_graphs=cuda_graphs)
    target = manifest["target"]
    spec = pipeline_spec(target["pipeline"])
    if is_random(target["source"]):
        source_folder, seed = folder / SOURCE_DIRNAME, target["seed"]
    else:
        source = manifest["source"].get("folder") or target["source"]  # a local source, resolved at build
        source_folder = resolve_folder(source, target.get("revision"), folder, set(modules))
        seed = None
    others = load_source_components(source_folder, seed=seed, skip=set(modules), dtype=DTYPES[target["dtype"]])
    pipe = assemble_pipeline(spec, source_folder, {**others, **modules})
    return pipe.to(torch.device(device or manifest["environment"]["device_type"]))
