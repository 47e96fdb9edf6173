"""The runtime's public entry points: check an artifact, load its compiled components, and put
them into a diffusers pipeline (a new one, or one the user already has)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    AotbuildError,
    IncompatibleArtifactError,
    PrecisionError,
    SourceError,
    TargetError,
)
from ..spec.manifest import (
    DTYPES,
    check_compatible,
    check_libraries,
    library_versions,
    read_manifest,
    sha256_file,
    validated_with_tf32,
)
from ..spec.pipelines import MULTI_CONTROLNETS, ComponentSpec, PipelineSpec, pipeline_spec, runtime_config_keys
from ..spec.private_apis import accept_compiled_class, onednn_runs
from .artifacts import artifact_folder
from .attention import load_library
from .autoencoder import CompiledAutoencoderBase, autoencoder_class
from .cache import open_artifact_files
from .checkpoint import checkpoint_config, checkpoint_constants, module_tensors
from .component import CompiledComponent
from .default_size import serve_default_size, set_pipeline_default_size
from .graphs import GraphPool
from .guards import install_pipeline_guards
from .hub import check_trusted
from .lora import lora_component_class
from .regional import RegionalComponent, component_variants
from .variant import LoadContext
from .weights import dtype_name, load_weights, page_releaser

# Threads inside `quiet_libraries()`, with their nesting depth: their log records below ERROR are dropped.
_QUIET_THREADS: dict[int, int] = {}


def _drop_quiet_threads_records() -> None:
    """Make `logging.Logger.handle` drop records below ERROR from threads in `_QUIET_THREADS` (once
    per process; records of every other thread pass as before). Every record passes through the
    `handle` of the logger that made it, whatever its handlers, including loggers and handlers
    that libraries create while they are imported."""
    original = logging.Logger.handle
    if getattr(original, "drops_quiet_threads", False):
        return

    def handle(self: logging.Logger, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR and record.thread in _QUIET_THREADS:
            return
        original(self, record)

    handle.drops_quiet_threads = True
    logging.Logger.handle = handle


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Within the block, log records below ERROR made by this thread are dropped: a load prints
    nothing the user did not ask for. diffusers, transformers and torchao log warnings about this
    machine's optional packages when their modules are first imported (torchvision missing,
    torchao's CUDA kernels on a CPU build), and diffusers and transformers reset their loggers'
    levels as they do, so no logger's level can say it. Other threads' records still pass, and
    aotbuild's own warnings (`warnings.warn`) and errors still reach the user."""
    _drop_quiet_threads_records()
    thread = threading.get_ident()
    _QUIET_THREADS[thread] = _QUIET_THREADS.get(thread, 0) + 1
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")  # torch's own pytree specs
            yield
    finally:
        _QUIET_THREADS[thread] -= 1
        if not _QUIET_THREADS[thread]:
            del _QUIET_THREADS[thread]


def _quietly(function: Callable) -> Callable:
    """`function` run within `quiet_libraries()`."""
    @functools.wraps(function)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with quiet_libraries():
            return function(*args, **kwargs)

    return quiet


# Operator namespaces torch registers itself: compiled code calling them needs no extra import.
TORCH_NAMESPACES = {"aten", "prims", "quantized", "quantized_decomposed", "_c10d_functional", "fbgemm", "mkldnn",
                    "onednn", "_quantized", "higher_order"}


def _import_custom_ops(namespaces: list[str]) -> None:
    """Register the operators compiled code calls back into (only for artifacts that need them)."""
    for namespace in namespaces:
        if namespace in TORCH_NAMESPACES or namespace == "aotbuild":  # aotbuild's kernels: in the artifact
            continue
        try:
            importlib.import_module(namespace)
        except ImportError:
            raise AotbuildError(f"this artifact's compiled code calls {namespace} operators, and {namespace} "
                                f"is not installed", hint=f"pip install {namespace}") from None


def check_fit(manifest: dict[str, Any], *, device: str | torch.device | None = None,
              dtype: str | None = None) -> PipelineSpec:
    """Everything a load checks of an artifact against this machine before it reads a file of it
    (`aotbuild verify` says the same): torch, device, CPU or GPU (`manifest.check_compatible`),
    the libraries a regional artifact runs (`check_libraries`), the packages whose operators its
    compiled code calls, and its pipeline class in the installed diffusers. Returns that
    pipeline's spec.

    Raises:
        IncompatibleArtifactError, AotbuildError: naming what does not fit and what would.
    """
    check_compatible(manifest, device=device, dtype=dtype)
    check_libraries(manifest)
    for entry in manifest["components"].values():
        _import_custom_ops(entry.get("custom_ops", []))
    pipeline = manifest["target"]["pipeline"]
    try:
        return pipeline_spec(pipeline)
    except TargetError:
        built = (manifest["environment"].get("libraries") or {}).get("diffusers")
        raise IncompatibleArtifactError(
            "diffusers", library_versions()["diffusers"], built,
            hint=f"this artifact's pipeline, {pipeline}, is not in the installed diffusers: install the diffusers it "
                 f"was built with" + (f" (pip install diffusers=={built})" if built else "")) from None


@_quietly
def load_components(folder: str | os.PathLike, *, device: str | torch.device | None = None,
                    dtype: str | None = None, eager: dict[str, torch.nn.Module] | None = None,
                    verify: bool = True, cuda_graphs: bool | None = None,
                    weights: dict[str, torch.nn.Module] | None = None,
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
        weights: modules by component name (the pipeline attribute's module, e.g. the VAE for
            `vae_decoder`) whose weights to bind instead of the artifact's: the recorded passes are
            applied to them (`checkpoint.checkpoint_constants`); tensors that need no change are
            bound by pointer. Their config too: the stand-in keeps each module's own config
            (`pipe.vae.config.scaling_factor` is the module's), once every key compiled into the
            code holds the artifact's value (`checkpoint.checkpoint_config`). A
            `MultiControlNetModel` gives one compiled ControlNet per model it holds, each with its
            own weights, in a `MultiControlNetModel`.

    Returns:
        (manifest, {pipeline attribute: CompiledComponent}).

    Raises:
        IncompatibleArtifactError (also: a `weights` module of another architecture),
        CorruptArtifactError.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    device = torch.device(device or manifest["environment"]["device_type"])
    spec = check_fit(manifest, device=device, dtype=dtype)
    if cuda_graphs is None:
        cuda_graphs = manifest["runtime"].get("cuda_graphs", False)
    if cuda_graphs and device.type != "cuda":
        raise AotbuildError(f"CUDA graphs need a CUDA device; this artifact runs on {device.type}",
                            hint="load it with cuda_graphs=False")
    context = LoadContext(device, tf32=validated_with_tf32(manifest))
    if cuda_graphs:
        context.graph_pool = GraphPool(context.device)
    install_pipeline_guards()
    modules: dict[str, Any] = {}
    parts: dict[str, tuple[dict, dict[str, CompiledComponent]]] = {}
    if not manifest.get("pipeline", {}).get("curated", True):
        warnings.warn(f"aotbuild: {spec.class_name} was {manifest['pipeline']['note']}", UncuratedPipelineWarning,
                      stacklevel=3)
    if device.type == "cpu":
        warn_slow_precision([entry["dtype"] for entry in manifest["components"].values()], "this artifact", 4)
    with open_artifact_files(folder, manifest, verify=verify) as files:
        library = manifest["optimizations"]["passes"].get("sdpa", {}).get("library")
        if library in manifest["files"]:  # optimize.sdpa = "aotbuild": the kernel its compiled code calls
            load_library(files.path(library), manifest["files"][library]["sha256"])
        for name, entry in manifest["components"].items():
            source = (weights or {}).get(name)
            eager_module = (eager or {}).get(name)
            if _several_controlnets(source):  # one compiled model each
                modules[entry["attribute"]] = compiled_multi_controlnet(type(source))([
                    _load_component(folder, files, manifest, name, net, context, eager_module and eager_module.nets[i])
                    for i, net in enumerate(source.nets)])
                continue
            component = _load_component(folder, files, manifest, name, source, context, eager_module)
            part = spec.component(name).part
            if part is None:
                modules[entry["attribute"]] = component
            else:  # the VAE's parts share one stand-in, made once all are loaded
                parts.setdefault(entry["attribute"], (component.config, {}))[1][part] = component
    for attribute, (config, found) in parts.items():
        modules[attribute] = autoencoder_class(config.get("_class_name", "AutoencoderKL"))(config, found)
    serve_default_size(manifest, modules)
    return manifest, modules


def _several_controlnets(module: Any) -> bool:
    """Whether a module is diffusers' model of several ControlNets that aotbuild compiles each of
    (`MULTI_CONTROLNETS`); another kind's is refused."""
    if module is None or not hasattr(module, "nets"):
        return False
    from diffusers.models import controlnets  # MultiControlNetUnionModel is not at diffusers' top level

    if not isinstance(module, tuple(getattr(controlnets, name) for name in MULTI_CONTROLNETS.values())):
        raise AotbuildError(f"{type(module).__name__}: several ControlNets of this kind are not compiled by aotbuild "
                            f"yet", hint="run one ControlNet per call")
    return True


@functools.cache
def compiled_multi_controlnet(multi: type) -> type:
    """diffusers' model of several ControlNets (`MULTI_CONTROLNETS`) over compiled ones: its dtype
    and device are its first net's (diffusers reads them from parameters, which stand-ins keep no
    module of); `from_pipe` keeps it."""

    class CompiledMultiControlNet(multi):
        @property
        def dtype(self) -> torch.dtype:
            return self.nets[0].dtype

        @property
        def device(self) -> torch.device:
            return self.nets[0].device

    accept_compiled_class(CompiledMultiControlNet)
    return CompiledMultiControlNet


def _load_component(folder: Path, files: Any, manifest: dict[str, Any], name: str, source: torch.nn.Module | None,
                    context: LoadContext, eager: torch.nn.Module | None) -> CompiledComponent:
    """One compiled component's stand-in, bound to the artifact's weights or to `source`'s."""
    spec = pipeline_spec(manifest["target"]["pipeline"])
    entry = manifest["components"][name]
    layouts = entry["constants"].get("layouts", {})
    recipe = manifest["target"]["optimize"].get("quantize")
    # The weights as the check opened them: the folder may be replaced meanwhile.
    stored = files.path(entry["weights"])
    config = entry["config"]
    if source is None:
        tensors = load_weights(stored, context.device, layouts)
    else:  # the artifact's file gives the layouts only: mapped, never read
        config = checkpoint_config(name, entry["config"], source.config, type(source),
                                   runtime_config_keys(spec.component(name), manifest["target"]["dtype"]))
        module = spec.component(name).export_module(source)
        stored_tensors = load_weights(stored, torch.device("cpu"), layouts, read_ahead=False)
        tensors = checkpoint_constants(
            name, module_tensors(module), stored_tensors, DTYPES[entry["dtype"]], recipe, context.device,
            entry.get("unread", ()), optional={*entry.get("ip_adapter", {}).get("shapes", ()),
                                               *_not_handed_yet(spec.component(name), module, stored_tensors)})
    package = folder / entry["package"]  # extracted only from bytes of the checked hash
    sha256 = files.sha256.get(entry["package"]) or sha256_file(files.path(entry["package"]))
    # The artifact's own weights, read only to be packed: out of memory as soon as packed.
    release = page_releaser(stored) if source is None else None
    variants, regional = component_variants(package, entry, tensors, sha256, layouts, context, release)
    base, extra = (RegionalComponent, {"regional": regional}) if regional else (CompiledComponent, {})
    cls = lora_component_class(base) if spec.component(name).denoiser else base
    described = {**entry, "config": config, "pipeline": manifest["target"]["pipeline"], "quantize": recipe,
                 "target_dtype": manifest["target"]["dtype"]}
    component = cls(name, described, variants, tensors, context, eager=eager, **extra)
    if source is not None and component.ip_adapter is not None:  # the pipeline's own adapter, at its scales
        component.ip_adapter.adopt(spec.component(name).export_module(source))
    return component


def _not_handed_yet(spec: ComponentSpec, module: torch.nn.Module, names: Iterable[str]) -> set[str]:
    """The constants of the submodules a pipeline hands the model when it is made
    (`ComponentSpec.submodules`) that `module` holds none of yet (an SD3.5 Large ControlNet read
    from its checkpoint alone): they keep the artifact's until the pipeline hands its own."""
    prefixes = spec.unheld_submodules(module)
    return {name for name in names if prefixes and name.startswith(prefixes)}


class UncuratedPipelineWarning(UserWarning):
    """The artifact's pipeline class has no aotbuild entry: it was built by capture."""


class SlowPrecisionWarning(UserWarning):
    """A CPU model in bf16 or fp16 on a CPU whose matrix products have no kernel in that dtype."""


def warn_slow_precision(dtypes: Iterable[str], doing: str, stacklevel: int = 3) -> None:
    """Say, in a warning, that `doing` (a build, a load) runs models in a half precision this CPU has
    no fast matrix products for: correct, and tens of times slower than float32."""
    slow = sorted({dtype for dtype in dtypes if not onednn_runs(dtype)})
    if slow:
        needs = {"bfloat16": "AVX-512 or AMX", "float16": "AVX512-FP16 or AMX-FP16"}
        warnings.warn(f"aotbuild: {doing} runs {' and '.join(slow)} on a CPU whose matrix products and convolutions "
                      f"have no {' or '.join(slow)} kernel ({'; '.join(needs[d] for d in slow)} has them; this "
                      f"CPU: {torch.backends.cpu.get_cpu_capability()}): correct, but tens of times slower than "
                      f"float32 here. Build a float32 target for CPUs like this one", SlowPrecisionWarning,
                      stacklevel=stacklevel)


WEIGHTS_CHOICES = ("pipeline", "artifact")


@_quietly
def apply(pipe: Any, artifact: str | os.PathLike, *, weights: str = "pipeline", eager_fallback: bool = False,
          cuda_graphs: bool | None = None, trust_remote_code: bool = False, variant: str | None = None,
          dtype: str | None = None) -> Any:
    """Swap an artifact's compiled components into a pipeline the user already has.

    Args:
        artifact: a folder or `hf://org/name[@revision]`.
        weights: "pipeline" (default) runs the pipeline's own weights: the artifact's recorded
            passes (dtype, fused QKV, layout, quantization) are applied to them and they are
            bound, so a fine-tuned checkpoint or a fused LoRA gives the images eager gives.
            "artifact" binds the artifact's weights files instead.
        eager_fallback: keep the original modules to run shapes no variant covers (with a
            warning); otherwise the pipeline drops them.
        cuda_graphs: as in `load_components`.
        trust_remote_code, variant: as in `load_pipeline`.
        dtype: the precision the caller accepts: the artifact's dtype, named. Without it, a
            pipeline whose compiled modules are in another dtype than the artifact computes (a
            float32 pipeline, a bfloat16 artifact) is refused: its images would change.

    Returns:
        The same pipeline, modified in place.

    Raises:
        PrecisionError: the pipeline's modules are in another dtype, and `dtype` does not say so.
        IncompatibleArtifactError: a module's architecture differs from the artifact's (the
            first differing tensor is named).
        AotbuildError: LoRA adapters loaded and not fused (load them after apply instead).
    """
    if weights not in WEIGHTS_CHOICES:
        raise AotbuildError(f"weights={weights!r}; choose from {', '.join(map(repr, WEIGHTS_CHOICES))}",
                            hint="another checkpoint: aotbuild.load_pipeline(artifact, weights=SOURCE)")
    check_trusted(artifact, trust_remote_code)
    device = next((m.device for m in pipe.components.values() if isinstance(m, torch.nn.Module)), None)
    artifact, _ = artifact_folder(artifact, device=device.type if device is not None else None,
                                  pipeline=type(pipe).__name__, variant=variant)
    manifest = read_manifest(artifact)
    if type(pipe).__name__ != manifest["target"]["pipeline"]:
        raise AotbuildError(f"artifact is for {manifest['target']['pipeline']}, not {type(pipe).__name__}")
    originals = {name: getattr(pipe, entry["attribute"]) for name, entry in manifest["components"].items()}
    for name, module in originals.items():
        if isinstance(module, (CompiledComponent, CompiledAutoencoderBase)):
            raise AotbuildError(f"the pipeline's {name} is compiled by aotbuild already")
        if weights == "artifact" and _several_controlnets(module):
            raise AotbuildError(f"the pipeline holds {len(module.nets)} ControlNets and weights='artifact' binds the "
                                f"artifact's one", hint="apply with weights='pipeline' (the default): each of them "
                                                        "runs compiled with its own weights")
        if weights == "pipeline":
            _check_lora_fused(manifest["components"][name]["attribute"], module)
    check_precision(manifest, {name: dtype_name(module.dtype) for name, module in originals.items()}, dtype,
                    lambda name: f"pipe.{manifest['components'][name]['attribute']}")
    _, modules = load_components(artifact, device=device, dtype=dtype, eager=originals if eager_fallback else None,
                                 cuda_graphs=cuda_graphs, weights=originals if weights == "pipeline" else None)
    for attribute, module in modules.items():
        setattr(pipe, attribute, module)
    set_pipeline_default_size(pipe, manifest)
    return pipe


HALF_DTYPES = ("bfloat16", "float16")


def check_precision(manifest: dict[str, Any], given: dict[str, str | None], accepted: str | None,
                    named: Callable[[str], str]) -> None:
    """Refuse to run weights in another dtype than they are given in unless the caller said so:
    `given` holds, by component, the dtype of the pipeline's module or of the checkpoint's stored
    weights (None: unknown); `accepted` is the dtype the caller named (the artifact's, or
    `check_compatible` refuses it). A component compiled in that very dtype (a float16 target's
    VAE kept in float32) and half-precision weights in a float32 artifact (every value exact,
    float32 diffusers' own default) change nothing. `named` says a component as the user knows it.

    Raises:
        PrecisionError: naming the module, both dtypes and the way to say so.
    """
    computes = manifest["target"]["dtype"]
    if accepted is not None:
        return
    for name, found in given.items():
        if found in (None, computes, manifest["components"][name]["dtype"]) or (
                computes == "float32" and found in HALF_DTYPES):
            continue
        raise PrecisionError(
            f"{named(name)} is {found} and this artifact computes {computes}: its images would not be the ones "
            f"{found} weights make eager",
            hint=f"to run them in {computes}, say so: dtype=\"{computes}\" in Python, --dtype {computes} on the "
                 f"command line; or build a target with dtype = \"{found}\"")


def _check_lora_fused(attribute: str, module: torch.nn.Module) -> None:
    """A LoRA counts in the weights only when it is fused into them (peft layers keep the others
    beside the weights, applied at each call)."""
    outside, fused = set(), set()
    for layer in module.modules():
        if not (hasattr(layer, "merged_adapters") and hasattr(layer, "lora_A")):  # a peft LoRA layer
            continue
        fused.update(layer.merged_adapters)
        if layer.disable_adapters and layer.merged_adapters:  # peft unmerges these at the next call
            outside.update(layer.merged_adapters)
        elif not layer.disable_adapters and not layer.merged_adapters:
            outside.update(a for a in layer.active_adapters if a in layer.lora_A)
    if outside:
        raise AotbuildError(f"pipe.{attribute} has LoRA adapters that are not fused into its weights "
                            f"({', '.join(sorted(outside))}); aotbuild binds the weights themselves",
                            hint="call aotbuild.apply() first and load the LoRAs after (the compiled pipeline "
                                 "takes diffusers' LoRA API), or fuse them first: pipe.fuse_lora()")
    if fused:
        warnings.warn(f"aotbuild: the LoRA adapters fused into pipe.{attribute} ({', '.join(sorted(fused))}) are "
                      f"part of the compiled weights now: unfuse_lora() cannot take them out; to switch them, "
                      f"unfuse before apply() and load them after", stacklevel=3)


@_quietly
def load_pipeline(artifact: str | os.PathLike, *, device: str | None = None, dtype: str | None = None,
                  cuda_graphs: bool | None = None, source: str | os.PathLike | None = None,
                  weights: str | os.PathLike | None = None, trust_remote_code: bool = False,
                  variant: str | None = None, controlnet: Any = None, ip_adapter: bool = True) -> Any:
    """Build the artifact's pipeline with its compiled components plugged in.

    Args:
        artifact: a folder or `hf://org/name[@revision]` (the revision is resolved to one commit).
        device, cuda_graphs: as in `load_components`.
        dtype: refuse the artifact unless it computes this dtype; with `weights` stored in another
            dtype than the artifact computes, naming it is how the caller accepts their new precision.
        source: where the components that were not compiled come from, instead of the source the
            artifact records: a local diffusers folder or a Hub id (`org/name[@revision]`).
            Needed for an artifact built from a local folder, whose path it does not record.
        weights: another checkpoint of the artifact's architecture (a local diffusers folder or a
            Hub id `org/name[@revision]`): the compiled components run its weights (the recorded
            passes applied at load) and, unless `source` says otherwise, the other components
            come from it too.
        trust_remote_code: load the native code of an `hf://` artifact (required for one: it runs
            in this process); local folders are trusted.
        variant: in a Hub repo holding several targets that fit this machine, which one (a target
            name, or a `target/variant` path).
        controlnet: for a ControlNet artifact, the ControlNet(s) to run, as diffusers'
            `from_pretrained(..., controlnet=...)` takes them: a model of the artifact's
            architecture (`ControlNetModel.from_pretrained(...)`), or a list of such models (each
            compiled with its own weights, in a `MultiControlNetModel`); its weights are bound,
            nothing is compiled.
        ip_adapter: for an artifact built with an IP-Adapter (its target's `ip_adapter`), load that
            adapter (its image encoder too, where the pipeline has none) as the build did; False:
            none, and `pipe.load_ip_adapter(...)` loads one of the artifact's form later.

    Without `weights`, the original weights of compiled components are never loaded (nor
    downloaded); the other components come from the source (the Hub at the pinned revision, a
    local folder, or the artifact's own config set with seeded random weights).

    Raises:
        IncompatibleArtifactError (PrecisionError: `weights` stored in another dtype, and `dtype`
        not given), CorruptArtifactError, SourceError, UntrustedCodeError, NoMatchingVariantError.
    """
    from .sources import assemble_pipeline, component_classes
    from .sources import load_components as load_source_components

    check_trusted(artifact, trust_remote_code)
    folder, _ = artifact_folder(artifact, device=device, dtype=dtype, variant=variant)
    manifest = read_manifest(folder)
    target = manifest["target"]
    spec = pipeline_spec(target["pipeline"])
    checkpoint = None
    given = {} if controlnet is None else {"controlnet": _controlnet_weights(manifest, controlnet)}
    if weights is not None:
        # A base checkpoint holds no ControlNet: one given as `controlnet` is not looked for in it.
        checked = {**manifest, "components": {n: e for n, e in manifest["components"].items() if n not in given}}
        weights_folder = _resolve_source(weights, manifest, skip=set())
        check_checkpoint(checked, weights_folder, os.fspath(weights), dtype)  # before any weights are read
        wanted = {entry["attribute"] for entry in checked["components"].values()}
        checkpoint = load_source_components(weights_folder, seed=None, skip=set(component_classes(weights_folder))
                                            - wanted, dtype=DTYPES[target["dtype"]])
        given |= {name: checkpoint[entry["attribute"]] for name, entry in checked["components"].items()}
        source = weights if source is None else source
    manifest, modules = load_components(folder, device=device, dtype=dtype, cuda_graphs=cuda_graphs,
                                        weights=given or None)
    del checkpoint, given  # what was not bound by pointer goes now
    source_folder, seed = _source_folder(manifest, folder, source, skip=set(modules))
    others = load_source_components(source_folder, seed=seed, skip=set(modules), dtype=DTYPES[target["dtype"]])
    pipe = assemble_pipeline(spec, source_folder, {**others, **modules})
    if ip_adapter and target.get("ip_adapter"):
        load_built_ip_adapter(pipe, target, Path("."))
    set_pipeline_default_size(pipe, manifest)
    return pipe.to(torch.device(device or manifest["environment"]["device_type"]))


def load_built_ip_adapter(pipe: Any, target: dict[str, Any], base_dir: Path) -> None:
    """The IP-Adapter an artifact was built with (its target's `ip_adapter`, a local file looked for
    from `base_dir`), loaded into its pipeline as the build loaded it; refused when what the target
    names holds other weights now than the artifact was built with (a file replaced, a Hub file
    updated since: pin its revision), the pipeline's adapter then unloaded."""
    from .sources import load_ip_adapter

    load_ip_adapter(pipe, target["ip_adapter"], base_dir, target["seed"], target.get("image_encoder"))
    for name, module in pipe.components.items():
        state = getattr(module, "ip_adapter", None) if isinstance(module, CompiledComponent) else None
        if state is not None and (fqn := state.first_difference()) is not None:
            pipe.unload_ip_adapter()
            raise SourceError(f"the IP-Adapter {target['ip_adapter']!r} holds other weights now than this artifact was "
                              f"built with ({name} constant {fqn!r} differs)",
                              hint="pin the adapter's revision (@sha) in the target and rebuild; or load with "
                                   "ip_adapter=False and pipe.load_ip_adapter() the adapter you want")


def _controlnet_weights(manifest: dict[str, Any], controlnet: Any) -> torch.nn.Module:
    """`load_pipeline`'s `controlnet`: the module whose weights the compiled ControlNet binds (a
    list: a MultiControlNetModel of them)."""
    from diffusers.models import controlnets

    if "controlnet" not in manifest["components"]:
        raise AotbuildError(f"controlnet=: this artifact ({manifest['target']['pipeline']}) compiles no ControlNet",
                            hint="build a target of a ControlNet pipeline with controlnet = {} in [components]")
    models = list(controlnet) if isinstance(controlnet, (list, tuple)) else [controlnet]
    if not models or not all(isinstance(m, torch.nn.Module) and hasattr(m, "config") for m in models):
        raise AotbuildError(f"controlnet={controlnet!r}: give a ControlNet model, or a list of them, as diffusers "
                            f"takes them", hint="controlnet=ControlNetModel.from_pretrained(repo_or_folder)")
    if not isinstance(controlnet, (list, tuple)):
        return models[0]
    kind = manifest["components"]["controlnet"]["config"]["_class_name"]
    if kind not in MULTI_CONTROLNETS:
        raise AotbuildError(f"controlnet=[...]: several {kind}s at once are not compiled by aotbuild yet",
                            hint="give one ControlNet")
    return getattr(controlnets, MULTI_CONTROLNETS[kind])(models)


def check_checkpoint(manifest: dict[str, Any], folder: Path, named: str | None = None,
                     dtype: str | None = None) -> None:
    """Whether a diffusers folder's checkpoint can run in the artifact's compiled code, read from
    its model_index.json, configs and safetensors headers alone (no weights): every compiled
    component there, its config equal to the artifact's where the config is compiled
    (`checkpoint.checkpoint_config`), stored in the dtype the artifact computes unless `dtype`
    names it (`check_precision`). `named`: the checkpoint as the user named it (default: the folder).

    Raises:
        SourceError: a compiled component the folder lacks.
        WeightsMismatchError: a compiled config key that differs, named with both values.
        PrecisionError: weights stored in another dtype, not accepted by `dtype`.
    """
    from .sources import component_classes, stored_dtype

    named = named or os.fspath(folder)

    spec = pipeline_spec(manifest["target"]["pipeline"])
    classes = component_classes(folder)
    missing = sorted({entry["attribute"] for entry in manifest["components"].values()} - set(classes))
    if missing:
        raise SourceError(f"weights {named!r} have no {', '.join(missing)}, which this artifact compiles")
    for name, entry in manifest["components"].items():
        model = classes[entry["attribute"]]
        config = model.load_config(folder / entry["attribute"])
        checkpoint_config(name, entry["config"], config, model,
                          runtime_config_keys(spec.component(name), manifest["target"]["dtype"]))
    check_precision(manifest, {name: stored_dtype(folder, entry["attribute"])
                               for name, entry in manifest["components"].items()}, dtype,
                    lambda name: f"{named}'s {manifest['components'][name]['attribute']}")


def _resolve_source(text: str | os.PathLike, manifest: dict[str, Any], skip: set[str]) -> Path:
    """A user's source: a local diffusers folder, or a Hub id with an optional @revision,
    downloaded without the `skip` components' weights."""
    from .sources import hub_id_form, resolve_folder

    text = os.fspath(text)
    if Path(text).expanduser().is_file():
        raise SourceError(f"{text} is a single file; weights= takes a diffusers folder or a Hub id",
                          hint="convert it first, e.g. diffusers' from_single_file(...).save_pretrained(folder)")
    local = Path(text).expanduser().exists()
    if not local and not hub_id_form(text):
        raise SourceError(f"{text}: no such folder", hint="give a diffusers folder on this machine (one holding "
                                                          "model_index.json), or a Hub id as org/name[@revision]")
    repo, _, revision = (text, "", "") if local else text.partition("@")
    return resolve_folder(repo, revision or None, Path.cwd(), skip, dtype=manifest["target"]["dtype"])


def _source_folder(manifest: dict[str, Any], artifact: Path, source: str | os.PathLike | None,
                   skip: set[str]) -> tuple[Path, int | None]:
    """(diffusers folder of the components not compiled, random seed or None)."""
    from .sources import SOURCE_DIRNAME, is_local_record, is_random, resolve_folder

    target, recorded = manifest["target"], manifest["source"]
    dtype = target["dtype"]
    if source is not None:
        return _resolve_source(source, manifest, skip), None
    if is_random(recorded["id"]):
        return artifact / SOURCE_DIRNAME, recorded["seed"]
    if is_local_record(recorded["id"]):
        name = recorded["id"].split(":", 1)[1]
        raise SourceError(f"this artifact was built from a local folder ({name!r}), which it does not include: "
                          f"its other components need that folder",
                          hint=f"aotbuild.load_pipeline(artifact, source='/path/to/{name}')")
    # The commit the build read, not what its branch names today.
    revision = recorded.get("commit") or recorded.get("revision")
    return resolve_folder(recorded["id"], revision, artifact, skip, dtype=dtype), None
