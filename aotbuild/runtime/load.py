"""The runtime's public entry points: check an artifact, load its compiled components, and put
them into a diffusers pipeline (a new one, or one the user already has)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import AotbuildError, SourceError
from ..manifest import DTYPES, check_compatible, read_manifest, sha256_file
from ..pipelines import pipeline_spec
from .cache import check_artifact_files
from .component import CompiledComponent
from .graphs import GraphPool
from .variant import CompiledVariant
from .weights import load_weights

# Operator namespaces torch registers itself: compiled code calling them needs no extra import.
TORCH_NAMESPACES = {"aten", "prims", "quantized", "quantized_decomposed", "_c10d_functional", "fbgemm", "mkldnn",
                    "onednn", "_quantized", "higher_order"}


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


def load_components(folder: str | os.PathLike, *, device: str | torch.device | None = None,
                    dtype: str | None = None, eager: dict[str, torch.nn.Module] | None = None,
                    verify: bool = True, cuda_graphs: bool | None = None,
                    ) -> tuple[dict[str, Any], dict[str, CompiledComponent]]:
    """Check an artifact and load its compiled components.

    Args:
        folder: the artifact folder.
        device: where to run ("cpu", "cuda", "cuda:1"); defaults to the artifact's device type.
        dtype: refuse the artifact unless it was built for this dtype.
        eager: original modules by component name, used (with a warning) for uncovered shapes.
        verify: check the files first (`cache.check_artifact_files`: packages hashed, weights
            hashed once per file); False skips that, for tests that alter an artifact on purpose.
        cuda_graphs: replay static buckets as CUDA graphs; None takes the target's `cuda_graphs`.

    Returns:
        (manifest, {pipeline attribute: CompiledComponent}).

    Raises:
        IncompatibleArtifactError, CorruptArtifactError.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    device = torch.device(device or manifest["environment"]["device_type"])
    check_compatible(manifest, device=device, dtype=dtype)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    hashed = check_artifact_files(folder, manifest) if verify else {}
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
        layouts = entry["constants"].get("layouts", {})
        weights = load_weights(folder / entry["weights"], device, layouts)
        package = folder / entry["package"]
        sha256 = hashed.get(entry["package"]) or sha256_file(package)  # the cache is keyed by checked hashes
        variants = [CompiledVariant(package, v, device, weights, sha256, layouts, pool) for v in entry["variants"]]
        modules[entry["attribute"]] = CompiledComponent(
            name, {**entry, "pipeline": manifest["target"]["pipeline"]}, variants, weights, device,
            eager=(eager or {}).get(name))
    return manifest, modules


def artifact_folder(artifact: str | os.PathLike, *, device: str | None = None, dtype: str | None = None,
                    pipeline: str | None = None, verify: bool = False) -> tuple[Path, Any]:
    """(local folder, `hub.Resolved` or None for a local folder). `hf://org/name[@revision]` is
    resolved to the variant fitting this machine (and `pipeline`) in the HF cache, downloading only
    that variant; `verify` hashes its every file (loading checks them its own way)."""
    if isinstance(artifact, str) and artifact.startswith("hf://"):
        from ..hub import resolve

        resolved = resolve(artifact, device=device, dtype=dtype, pipeline=pipeline, verify=verify)
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
    artifact, _ = artifact_folder(artifact, device=device.type if device is not None else None,
                                  pipeline=type(pipe).__name__)
    manifest = read_manifest(artifact)
    if type(pipe).__name__ != manifest["target"]["pipeline"]:
        raise AotbuildError(f"artifact is for {manifest['target']['pipeline']}, not {type(pipe).__name__}")
    eager = None
    if eager_fallback:
        eager = {name: getattr(pipe, entry["attribute"]) for name, entry in manifest["components"].items()}
    _, modules = load_components(artifact, device=device, eager=eager, cuda_graphs=cuda_graphs)
    for attribute, module in modules.items():
        setattr(pipe, attribute, module)
    return pipe


def load_pipeline(artifact: str | os.PathLike, *, device: str | None = None, dtype: str | None = None,
                  cuda_graphs: bool | None = None, source: str | os.PathLike | None = None) -> Any:
    """Build the artifact's pipeline with its compiled components plugged in.

    Args:
        artifact: a folder or `hf://org/name[@revision]`.
        device, dtype, cuda_graphs: as in `load_components`.
        source: where the components that were not compiled come from, instead of the source the
            artifact records: a local diffusers folder or a Hub id (`org/name[@revision]`).
            Needed for an artifact built from a local folder, whose path it does not record.

    The original weights of compiled components are never loaded (nor downloaded); the other
    components come from the source (the Hub at the pinned revision, a local folder, or the
    artifact's own config set with seeded random weights).

    Raises:
        IncompatibleArtifactError, CorruptArtifactError, SourceError.
    """
    from ..sources import assemble_pipeline
    from ..sources import load_components as load_source_components

    folder, _ = artifact_folder(artifact, device=device, dtype=dtype)
    manifest, modules = load_components(folder, device=device, dtype=dtype, cuda_graphs=cuda_graphs)
    target = manifest["target"]
    spec = pipeline_spec(target["pipeline"])
    source_folder, seed = _source_folder(manifest, folder, source, skip=set(modules))
    others = load_source_components(source_folder, seed=seed, skip=set(modules), dtype=DTYPES[target["dtype"]])
    pipe = assemble_pipeline(spec, source_folder, {**others, **modules})
    return pipe.to(torch.device(device or manifest["environment"]["device_type"]))


def _source_folder(manifest: dict[str, Any], artifact: Path, source: str | os.PathLike | None,
                   skip: set[str]) -> tuple[Path, int | None]:
    """(diffusers folder of the components not compiled, random seed or None)."""
    from ..sources import SOURCE_DIRNAME, is_local_record, is_random, resolve_folder

    target, recorded = manifest["target"], manifest["source"]
    dtype = target["dtype"]
    if source is not None:
        text = os.fspath(source)
        repo, _, revision = (text, "", "") if Path(text).expanduser().exists() else text.partition("@")
        return resolve_folder(repo, revision or None, Path.cwd(), skip, dtype=dtype), None
    if is_random(recorded["id"]):
        return artifact / SOURCE_DIRNAME, recorded["seed"]
    if is_local_record(recorded["id"]):
        name = recorded["id"].split(":", 1)[1]
        raise SourceError(f"this artifact was built from a local folder ({name!r}), which it does not include: "
                          f"its other components need that folder",
                          hint=f"aotbuild.load_pipeline(artifact, source='/path/to/{name}')")
    return resolve_folder(recorded["id"], recorded.get("revision"), artifact, skip, dtype=dtype), None
