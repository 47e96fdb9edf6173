"""One build: target -> artifact folder. Read top to bottom, this is the whole flow:

load -> capture (fp32 eager reference) -> optimize -> capture (example inputs) -> export ->
compile -> package (+ weights) -> validate (compiled vs reference) -> manifest -> rename into place.

Everything is written to a staging folder inside `artifacts/` (the same filesystem, so the final
rename cannot fail with EXDEV on a mounted volume) and renamed into place only when complete, so a
failed or killed build leaves the previous artifact untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import inspect
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import capture, export, optimize, regions, shapes, sources
from .errors import AotbuildError, BuildError, NumericsError
from .manifest import (
    DTYPES,
    REGIONAL_SCHEMA,
    SCHEMA_VERSION,
    aotbuild_version,
    check_compatible,
    environment,
    library_versions,
    read_manifest,
    sha256_file,
    validated_with_tf32,
    write_manifest,
)
from .pipelines import (
    COMPILED_VAES,
    FRAMEWISE_VAES,
    KEPT_MODULES,
    SIZED_BY_IMAGE,
    TEXT,
    UNCURATED,
    UNGUIDED,
    ComponentSpec,
    PipelineSpec,
    default_text_length,
    frames_around,
    frames_step,
    pipeline_spec,
    plain_attribute,
    resized_image,
    seeded_image,
    vae_factor,
)
from .runtime import CompiledVariant, GraphPool, leaf_signature, load_weights, open_model
from .runtime.cache import check_artifact_files, mark_verified
from .runtime.checkpoint import module_tensors
from .runtime.regional import component_variants
from .runtime.variant import LoadContext, leaf_name, tf32
from .targets import ShapeBucket, Target, images_text

# Largest allowed relative error (max |compiled - eager fp32| / max |eager fp32|) per compute dtype.
TOLERANCES = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}
STAGING_DIRNAME = ".staging"  # inside the artifacts folder: builds in progress, one folder per target
# A CUDA graph replays the very kernels of a plain run on the same inputs: only the order of
# atomic additions may differ.
GRAPH_TOLERANCE = 1e-3

Progress = Callable[[str, str], None]


def print_progress(stage: str, message: str) -> None:
    print(f"[{stage:>9}] {message}", file=sys.stderr, flush=True)


@dataclass
class BuildResult:
    folder: Path
    manifest: dict[str, Any]
    skipped: bool = False
    timings: dict[str, float] = field(default_factory=dict)


class _Stages:
    """Times each stage (summed over repeats) and reports it through `progress`; on a CUDA build
    also each stage's peak GPU memory (the highest over its repeats)."""

    def __init__(self, progress: Progress, cuda: bool = False) -> None:
        self.progress = progress
        self.cuda = cuda
        self.timings: dict[str, float] = {}
        self.peak_gpu_mib: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str, message: str) -> Iterator[None]:
        self.progress(stage, message)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        self.timings[stage] = self.timings.get(stage, 0.0) + elapsed
        suffix = ""
        if self.cuda:
            peak = torch.cuda.max_memory_allocated() / 2**20
            self.peak_gpu_mib[stage] = round(max(peak, self.peak_gpu_mib.get(stage, 0.0)), 1)
            suffix = f", peak GPU memory {peak / 1024:.1f} GiB"
        self.progress(stage, f"done in {elapsed:.1f}s{suffix}")


def variant_name(bucket: ShapeBucket) -> str:
    text = f"_text{bucket.max_sequence_length}" if bucket.max_sequence_length else ""
    edit = f"_image{bucket.image[0]}x{bucket.image[1]}" if bucket.image else ""
    edit += f"_images{images_text(bucket.images)}" if bucket.images else ""
    frames = f"_{bucket.frames}f" if bucket.frames else ""
    return f"b{bucket.batch}_{bucket.height}x{bucket.width}{frames}{text}{edit}"


def is_fresh(folder: Path, target: Target) -> bool:
    """The folder holds an intact artifact of exactly this target, built by this aotbuild from the
    same weights (the commit its revision resolves to now, the local folder's files, the random
    config set), with the same diffusers, transformers, torchao and peft, that fits this machine."""
    try:
        manifest = read_manifest(folder)
        if (manifest.get("target_hash") != target.content_hash() or manifest.get("aotbuild") != aotbuild_version()
                or manifest["environment"].get("libraries") != library_versions()):
            return False
        check_artifact_files(folder, manifest)  # intact, at load's cost: weights hashed once
        check_compatible(manifest)
        if sources.is_random(target.source):
            config_set = sources.config_set_dir(target.source, target.base_dir)
            current = {f"{sources.SOURCE_DIRNAME}/{p.relative_to(config_set)}": sha256_file(p)
                       for p in config_set.rglob("*") if p.is_file()}
            built = {k: v["sha256"] for k, v in manifest["files"].items()
                     if k.startswith(sources.SOURCE_DIRNAME + "/")}
            if current != built:
                return False
        return manifest["source"] == _source_record(target)  # last: a Hub revision is resolved
    except AotbuildError:
        return False


def build(target: Target, artifacts_dir: str | os.PathLike = "artifacts", *, force: bool = False,
          allow_numerics_drift: bool = False, progress: Progress = print_progress,
          wait: float | None = None) -> BuildResult:
    """Build `target` into `artifacts_dir/<target.name>/`, or skip when it is already fresh.

    Args:
        wait: seconds to wait for another build of the same target to finish (None: as long as it
            takes); the wait is reported through `progress`, naming that build.

    Raises:
        BuildError, NumericsError, SourceError: the previous artifact, if any, is left as it was
            (BuildError too when another build of the target still runs after `wait` seconds).
    """
    artifacts_dir = Path(artifacts_dir)
    folder = artifacts_dir / target.name
    if not force and is_fresh(folder, target):
        progress("fresh", f"{folder} is up to date (use --force to rebuild)")
        return BuildResult(folder, read_manifest(folder), skipped=True)
    _check_device(target)

    try:
        staging_root = artifacts_dir / STAGING_DIRNAME
        staging_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot write into {artifacts_dir}: {exc}") from None
    with _target_lock(staging_root, target.name, wait, progress) as staging_dir:
        # A concurrent build of this target may have finished while this one waited for the lock.
        if not force and is_fresh(folder, target):
            progress("fresh", f"{folder} was just built by another process")
            return BuildResult(folder, read_manifest(folder), skipped=True)
        _recover_stale_staging(staging_dir, folder)
        staging = Path(tempfile.mkdtemp(prefix="build-", dir=staging_dir))
        staging.chmod(0o755)
        try:
            stages = _Stages(progress, target.device == "cuda")
            with tf32(optimize.uses_tf32(target.optimize, target.device)):  # never left set for the process
                manifest = _build_into(target, staging, allow_numerics_drift, stages)
            _replace_folder(staging, folder, staging_dir)
        except OSError as exc:
            raise BuildError(f"could not write the artifact: {exc}") from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return BuildResult(folder, manifest, timings=manifest["timings"])


@contextlib.contextmanager
def _target_lock(staging_root: Path, name: str, wait: float | None = None,
                 progress: Progress = print_progress) -> Iterator[Path]:
    """One build of a target at a time: an flock on `<staging>/<name>.lock`, held by the building
    process until it ends (the kernel drops it when the process dies, whatever its PID becomes).
    The holder writes who it is into the file, for a waiting build to say; a build waits `wait`
    seconds at most (None: as long as it takes). Yields the target's staging folder: whoever holds
    the lock owns everything in it, so what it finds there was left by a build that died.

    A build that ends leaves nothing behind: it removes its staging folder, then the lock file
    while it holds it, then `<staging>` if no other build uses it. A build that then locks the file
    just removed finds it is no longer the one at the path and opens the path again."""
    import json
    import socket

    path = staging_root / f"{name}.lock"
    waited_since, holder = None, ""
    while True:
        lock = _open_lock(staging_root, path)
        held = _try_lock(lock)
        if held and _is_current(lock, path):
            break
        lock.close()
        if held:  # a file a finished build removed: take the one at the path now
            continue
        if waited_since is None:
            holder = _lock_holder(path)
            limit = "" if wait is None else f" (up to {wait:g} s)"
            progress("wait", f"another build of {name} is running ({holder}); waiting for it to finish{limit}")
            waited_since = time.monotonic()
        elif wait is not None and time.monotonic() - waited_since >= wait:
            raise BuildError(f"another build of {name} is still running ({holder}) after {wait:g} s",
                             hint="let it finish, or wait longer: aotbuild build --wait SECONDS")
        time.sleep(0.25)
    staging_dir = staging_root / name
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}))
        lock.flush()
        staging_dir.mkdir(exist_ok=True)
        yield staging_dir
    finally:
        for remove in (staging_dir.rmdir, path.unlink, staging_root.rmdir):  # rmdir: only when empty
            with contextlib.suppress(OSError):
                remove()
        lock.close()


def _open_lock(staging_root: Path, path: Path) -> Any:
    """The lock file, opened for appending (never truncated before it is held: the holder's record
    stays readable); `staging_root` is made again when a finishing build removed it meanwhile."""
    while True:
        # exist_ok does not cover a folder removed between mkdir's own two checks: open then retries
        with contextlib.suppress(FileExistsError):
            staging_root.mkdir(parents=True, exist_ok=True)
        try:
            return open(path, "a+")
        except FileNotFoundError:
            continue


def _is_current(lock: Any, path: Path) -> bool:
    """Whether the open lock file is still the file at `path` (not one a finished build removed)."""
    try:
        return os.path.samestat(os.fstat(lock.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _try_lock(lock: Any) -> bool:
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_holder(path: Path) -> str:
    """Who holds a target's build lock, as its holder wrote it: "pid 123 on host-a since ...Z"."""
    import json

    try:
        record = json.loads(path.read_text())
        return f"pid {record['pid']} on {record['host']} since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a build that has not said who it is"


def _check_device(target: Target) -> None:
    if target.device == "cuda":
        if not torch.cuda.is_available():
            cpu = " (this torch is a CPU build)" if torch.version.cuda is None else ""
            raise BuildError(f"target {target.name} is for cuda, and this machine has no CUDA device{cpu}",
                             hint="build it on a machine with its GPU (or through Ray: aotbuild build --ray --address "
                                  "HOST:PORT, with a GPU node), or build a CPU target here (aotbuild targets lists "
                                  "the cpu-* ones)")
        found = "{}.{}".format(*torch.cuda.get_device_capability())
        if target.gpu and found != target.gpu.capability:
            raise BuildError(f"target {target.name} is for compute capability {target.gpu.capability} "
                             f"({target.gpu.name}); this GPU is {found}",
                             hint=f"build it on a {target.gpu.name}, or copy the target and set its gpu to this "
                                  f"one's (an artifact runs on the capability it was built for)")
        if target.gpu and target.gpu.multi_arch and not export.nvcc():
            raise BuildError(f"target {target.name} asks for multi-arch kernels, and nvcc (the CUDA toolkit) is "
                             f"not on PATH", hint="install the CUDA toolkit and put nvcc on PATH, or set CUDACXX to it")


def _build_into(target: Target, out: Path, allow_drift: bool, stages: _Stages) -> dict[str, Any]:
    spec = pipeline_spec(target.pipeline)
    specs = [spec.component(name) for name in target.components]
    device = torch.device(target.device)
    inductor_options = export.inductor_options(target.inductor, optimize.inductor_flags(target.optimize),
                                               multi_arch=bool(target.gpu and target.gpu.multi_arch),
                                               device=target.device)

    with stages("load", f"{target.pipeline} from {target.source}"):
        folder = sources.resolve_folder(target.source, target.revision, target.base_dir, skip=set(),
                                        dtype=target.dtype)
        source = _source_record(target, folder)  # what was read: the commit a branch resolved to, a fingerprint
        pipe = _load_pipeline(target, spec, torch.device("cpu"), folder)  # _capture_all places the models
    _check_frames(target, pipe)
    points, plans = _plan(target, spec, specs, getattr(pipe, "vae", None), frames_step(pipe))
    regional = next((s for s in specs if s.denoiser), None) if target.compile_mode == "regional" else None
    instances = regions.block_instances(getattr(pipe, regional.attribute), regional.name) if regional else {}
    eager_vae = _eager_vae(pipe, spec, specs)
    with stages("capture", "eager float32 reference"), tf32(False):  # plain float32, whatever the recipe
        reference, block_calls, seconds = _capture_all(pipe, spec, specs, target, points, device, stages.progress,
                                                       instances, timed=eager_vae and eager_vae.pop("timed"))
    if eager_vae:
        eager_vae["share"] = _eager_share(pipe, plans[next(s.name for s in specs if s.denoiser)], seconds)
    found = regions.group(instances, block_calls) if instances else []
    for point, record in block_calls.items():
        reference[point] |= {r.name: regions.region_call(r, record) for r in found}
    if found:
        stages.progress("regions", f"{regional.name}: {len(instances)} blocks in {len(found)} regions: "
                        + ", ".join(f"{r.name} x{len(r.instances)}" for r in found))
    del block_calls
    export_points = {plan.points[0] for component in plans.values() for plan in component}
    examples = {name: reference[name] for name in export_points}
    # The references wait on the host (validate moves each input back): only the export points'
    # calls stay on the device, as example inputs.
    reference = {point: {c: call.to("cpu") for c, call in calls.items()} for point, calls in reference.items()}
    dims = {s.name: {plan.name: _variant_dims(s.name, plan, reference, points) for plan in plans[s.name]}
            for s in specs}
    dims |= {r.name: {plan.name: _variant_dims(r.name, plan, reference, points) for plan in plans[regional.name]}
             for r in found}
    with stages("optimize", ", ".join(["dtype", *target.optimize])):
        modules, records = optimize_pipeline(pipe, specs, target)
    if records["changes_inputs"]:
        with stages("capture", "example inputs of the optimized pipeline"):
            optimized, block_calls, _ = _capture_all(pipe, spec, specs, target, {n: points[n] for n in examples},
                                                     device, stages.progress, instances)
            for name, record in block_calls.items():  # the optimized blocks' calls, by region
                optimized[name] |= {r.name: regions.region_call(r, record) for r in found}
        examples = {name: {c: capture.CapturedCall(*optimize.adapt_example_inputs(
                        target.optimize, (call.args, call.kwargs)), call.output) for c, call in
                        optimized[name].items()}
                    for name in examples}
        del optimized
    for s in specs:  # a denoiser takes every scheduler's timesteps: float ones, whatever the capture's were
        if s.denoiser:
            for calls in examples.values():
                if s.name in calls:  # not at a VAE tile's point
                    calls[s.name] = capture.float_timestep(calls[s.name], modules[s.name])
    runtime = {"cuda_graphs": target.cuda_graphs, "scheduler": type(pipe.scheduler).__name__,
               # Not weights, but part of the recipe: where the scheduler keeps its sigmas (on CPU,
               # each step's sigma lookup costs no device sync; diffusers' Euler schedulers do this).
               "sigmas_device": str(getattr(getattr(pipe.scheduler, "sigmas", None), "device", "n/a")),
               "default_pixels": _default_pixels(pipe, spec, target)}
    # Compile needs only the modules being compiled and the example inputs on the device.
    _release_others(pipe, specs)
    del pipe
    _free_device_memory(device)

    components = {}
    # The guidance each denoiser variant serves, where its batch says it (none: the same either way).
    modes = _guidance_modes(target, spec) if spec.cfg_batch and _batches_guidance(reference, specs) else ()
    for s in specs:
        if s is regional:
            components[s.name] = _build_regional(s, modules[s.name], found, instances, target, plans[s.name], examples,
                                                 reference, dims, modes, records["dtype"][s.name], inductor_options,
                                                 out, stages)
        else:
            components[s.name] = _build_component(s, modules[s.name], target, plans[s.name], examples, reference,
                                                  dims[s.name], modes, records["dtype"][s.name], inductor_options, out,
                                                  stages)
    del modules, examples, instances  # validate binds the packaged weights: the eager copies go first
    _free_device_memory(device)
    if sources.is_random(target.source):
        shutil.copytree(sources.config_set_dir(target.source, target.base_dir), out / sources.SOURCE_DIRNAME)

    manifest = {
        "schema": REGIONAL_SCHEMA if regional or _permuted_inputs(components) else SCHEMA_VERSION,
        "aotbuild": aotbuild_version(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "target": {**target.to_dict(), "source": source["id"]},
        "target_hash": target.content_hash(),
        "source": source,
        "environment": _environment(target, inductor_options),
        "optimizations": {"dtype": records["dtype"], "passes": records["passes"], "inductor": inductor_options},
        "components": components,
        "pipeline": {"curated": True} if spec.curated else {"curated": False, "note": UNCURATED},
        **({"eager": {"vae": eager_vae}} if eager_vae else {}),
        "runtime": runtime,
        "files": {},
        "timings": {},
    }
    with stages("validate", "compiled vs eager float32 on the captured inputs"):
        _validate(out, manifest, reference, points, plans, device, allow_drift)
    manifest["files"] = {
        str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(out.rglob("*")) if p.is_file()
    }
    for entry in components.values():  # just hashed: this machine's first load need not read them again
        mark_verified(out / entry["weights"], manifest["files"][entry["weights"]]["sha256"])
    manifest["timings"] = {k: round(v, 3) for k, v in stages.timings.items()}
    if stages.cuda:
        manifest["peak_gpu_mib"] = stages.peak_gpu_mib
    write_manifest(out, manifest)
    return manifest


def _permuted_inputs(components: dict[str, Any]) -> bool:
    """Whether an input is laid out as a permutation (older runtimes would make it contiguous)."""
    entries = [*components.values(), *(r for c in components.values() for r in c.get("regions", ()))]
    return any(isinstance(leaf.get("layout"), list) for e in entries for v in e["variants"] for leaf in v["inputs"])


def _environment(target: Target, inductor_options: dict[str, Any]) -> dict[str, Any]:
    """This machine's fingerprint, plus what the build decided about its code: whether the kernels
    carry PTX for later GPUs (the compatibility check and the Hub variant name read it from here),
    which CPU baseline the host code of a CUDA build targets, and the Triton that made the kernels."""
    env = environment(target.device)
    if target.gpu is not None:
        env["gpu_multi_arch"] = target.gpu.multi_arch
    if target.device == "cuda":
        env["host_march"] = inductor_options.get(export.MARCH_OPTION, "native")
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


def _free_device_memory(device: torch.device) -> None:
    """Hand freed tensors back to the device (exported graphs hold their weights in reference cycles)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _release_others(pipe: Any, specs: list[ComponentSpec]) -> None:
    """Move the pipeline's models that are not compiled (a VAE built without its decoder, a
    safety checker; the text encoders are already off) to the host."""
    compiled = {s.attribute for s in specs}
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name not in compiled:
            component.to("cpu")


def _source_record(target: Target, folder: Path | None = None) -> dict[str, Any]:
    """Where the pipeline came from: a Hub id and revision, a random config set and seed, or a
    local folder by its name only (its path would tie the artifact to this machine); and what its
    weights were (`sources.source_identity`: the commit, or the folder's fingerprint), from the
    `folder` read, else as the source is now."""
    return {"id": sources.recorded_source(target.source, target.base_dir), "revision": target.revision,
            "seed": target.seed if sources.is_random(target.source) else None,
            **sources.source_identity(target.source, target.revision, target.base_dir, folder)}


@dataclass(frozen=True)
class CapturePoint:
    """Where a capture runs the pipeline: images per prompt, pixel size, with guidance or without.
    A tile point (`tile_of`) is one random call of that VAE part instead, at a tile's size."""

    batch: int
    height: int
    width: int
    guided: bool = True
    tile_of: str | None = None
    text: int | None = None  # the call's max_sequence_length (None: the pipeline takes none)
    image: tuple[int, int] | None = None  # the size of the image an editing call takes
    frames: int | None = None  # a video's frame count (None: an image pipeline)
    resized: tuple[int, int] | None = None  # the size a SIZED_BY_IMAGE pipeline encodes its image at
    images: tuple[tuple[int, int], ...] | None = None  # the images an EDITS_SEVERAL call edits together

    def __str__(self) -> str:
        size = f"{self.batch}x{self.height}x{self.width}"
        if self.tile_of:
            return f"{self.tile_of} tile {size}"
        edit = f" editing {self.image[0]}x{self.image[1]}" if self.image else ""
        edit += f" editing {images_text(self.images)}" if self.images else ""
        frames = f" {self.frames} frames" if self.frames else ""
        return size + frames + (f" text {self.text}" if self.text else "") + edit + ("" if self.guided else " unguided")

    @property
    def run(self) -> tuple[Any, ...]:
        """What a pipeline run at this point is called with: points that share it share the run."""
        return self.batch, self.height, self.width, self.guided, self.text, self.image, self.frames, self.images

    @property
    def encoded(self) -> tuple[int, int]:
        """The pixel size the VAE encoder sees: the edited image's, else the point's."""
        return self.image or self.resized or (self.height, self.width)


@dataclass(frozen=True)
class VariantPlan:
    """One compiled model of a component: the capture points it serves, the first being the one it
    is exported at (the largest call), and its kind: a `bucket`, the `dynamic` model, a `tile` model."""

    name: str
    kind: str
    points: tuple[str, ...]
    bucket: ShapeBucket | None = None
    ranges: dict[str, Any] | None = None  # dynamic and tile: batch (images), height, width (pixels), stride
    images: tuple[tuple[int, int], ...] | None = None  # dynamic: the images an EDITS_SEVERAL call edits


def _guidance_modes(target: Target, spec: PipelineSpec) -> tuple[bool, ...]:
    """The guidance of the captures, the first one's being the export point's (guided: the larger
    denoiser batch). A pipeline whose denoiser batch ignores guidance is captured as configured."""
    if not spec.cfg_batch:
        return (True,)
    return {"both": (True, False), "guided": (True,), "unguided": (False,)}[target.guidance]


def _plan(target: Target, spec: PipelineSpec, specs: list[ComponentSpec], vae: Any,
          frame_stride: int) -> tuple[dict[str, CapturePoint], dict[str, list[VariantPlan]]]:
    """Every capture point by name, and every component's variants.

    A bucket serves 1 to its batch of images: its model's batch dim spans the calls captured with
    1 image and with the bucket's batch, and for a denoiser, with and without guidance (the calls
    only differ in batch, so one model serves them all). The dynamic model spans its ranges and,
    for a denoiser, both guidance batches. A tile model spans every tile `vae.enable_tiling()` cuts
    from images of the target's stride. A video's frames step by `frame_stride`."""
    modes = _guidance_modes(target, spec)
    text = default_text_length(target.pipeline)  # what each call pads its prompt to, unless a shape says
    points: dict[str, CapturePoint] = {}
    plans: dict[str, list[VariantPlan]] = {s.name: [] for s in specs}
    for bucket in target.shapes:
        name = variant_name(bucket)
        bucket = dataclasses.replace(bucket, max_sequence_length=bucket.max_sequence_length or text)
        for guided in modes:
            for images in sorted({bucket.batch, 1}, reverse=True):
                suffix = ("" if images == bucket.batch else ":one") + ("" if guided == modes[0] else ":unguided")
                points[name + suffix] = CapturePoint(images, bucket.height, bucket.width, guided,
                                                     text=bucket.max_sequence_length, image=bucket.image,
                                                     frames=bucket.frames, images=bucket.images)
        ran = [p for p in points if p.split(":")[0] == name]
        encoding = _add_resized(target.pipeline, points, [p for p in ran if points[p].guided == modes[0]])
        for s in specs:
            served = [p for p in ran if s.denoiser or points[p].guided == modes[0]]
            if s.part == "encoder" and (bucket.image or encoding):  # the edited images' sizes
                _plan_encoded(plans[s.name], points, encoding or served, bucket.frames)
                continue
            # The text does not reach the VAE decoder: it decodes the output.
            untexted = dataclasses.replace(bucket, max_sequence_length=None, image=None, images=None)
            if s.denoiser:
                plans[s.name].append(VariantPlan(name, "bucket", tuple(served), bucket=bucket))
            elif all(plan.bucket != untexted for plan in plans[s.name]):
                named = variant_name(untexted) if points[name].resized else name
                plans[s.name].append(VariantPlan(named, "bucket", tuple(served), bucket=untexted))
    if target.dynamic:
        ranges = {**target.dynamic, **({TEXT: target.dynamic.get(TEXT, [text, text])} if text else {})}
        axes = shapes.axes_of(ranges)
        probes = shapes.range_points(ranges, target.stride, frame_stride)
        for probe, size in probes.items():
            at = dict(zip(axes, size, strict=True))
            points[f"dynamic:{probe}"] = CapturePoint(at["batch"], at["height"], at["width"], modes[0],
                                                      text=at.get(TEXT), frames=at.get(shapes.FRAME_AXIS),
                                                      images=target.dynamic_images)
        encoding = _add_resized(target.pipeline, points, [f"dynamic:{probe}" for probe in probes])
        both = len(modes) > 1
        unguided = ("dynamic:min:unguided",)
        if both:
            points["dynamic:min:unguided"] = dataclasses.replace(points["dynamic:min"], guided=False)
        if both and ranges["batch"][0] == ranges["batch"][1]:  # guidance alone moves the batch: its probe
            points["dynamic:base:unguided"] = dataclasses.replace(points["dynamic:base"], guided=False)
            unguided += ("dynamic:base:unguided",)
        for s in specs:
            served = ("dynamic:base", "dynamic:min", "dynamic:max", *(unguided if both and s.denoiser else ()))
            reached = ranges if s.denoiser else {a: r for a, r in ranges.items() if a != TEXT}
            if s.part == "encoder" and encoding:  # the edited images' sizes, whatever the output's
                _plan_encoded(plans[s.name], points, encoding, points["dynamic:base"].frames)
                continue
            if not s.denoiser and _within_a_bucket(s, [points[p] for p in served], plans[s.name]):
                continue  # a range of text lengths alone: the VAE sees one size
            video = {"frame_stride": frame_stride} if shapes.FRAME_AXIS in ranges else {}
            plans[s.name].append(VariantPlan("dynamic", "dynamic", served,
                                             ranges={**reached, "stride": target.stride, **video},
                                             images=target.dynamic_images if s.denoiser else None))
    largest = max([b.batch for b in target.shapes] + ([target.dynamic["batch"][1]] if target.dynamic else []))
    for s in specs:
        if s.name in target.tiling:
            ranges = _tile_ranges(s, vae, target.stride, largest)
            for probe, size in shapes.range_points(ranges, ranges["stride"]).items():
                points[f"tile:{s.name}:{probe}"] = CapturePoint(*size, tile_of=s.name)
            served = tuple(f"tile:{s.name}:{probe}" for probe in ("base", "min", "max"))
            plans[s.name].append(VariantPlan("tile", "tile", served, ranges=ranges))
    return points, plans


def _add_resized(pipeline: str, points: dict[str, CapturePoint], names: list[str]) -> list[str]:
    """Where a SIZED_BY_IMAGE pipeline resizes the images it edits: each of these points encodes
    its first image's size; for each other size its images are resized to, a point of the same
    run encodes that one (`<point>:image<k>`, its VAE encoder's calls only). Returns the names of
    every point that encodes an edited image: none for another pipeline."""
    encoding = []
    for name in names:
        point = points[name]
        edited = point.images or ((point.height, point.width),)
        sizes = list(dict.fromkeys(resized_image(pipeline, *size) for size in edited))
        if sizes[0] is None:
            return []
        points[name] = dataclasses.replace(point, resized=sizes[0])
        encoding.append(name)
        for k, size in enumerate(sizes[1:], start=2):
            points[f"{name}:image{k}"] = dataclasses.replace(point, resized=size)
            encoding.append(f"{name}:image{k}")
    return encoding


def _plan_encoded(plans: list[VariantPlan], points: dict[str, CapturePoint], served: list[str],
                  frames: int | None) -> None:
    """The VAE encoder of an editing pipeline: a bucket at each size it sees an edited image at
    (Flux Kontext's as given, Qwen-Image-Edit's resized by the pipeline), served by the points
    that encode one at that size, unless a bucket of that size and batch is planned."""
    for size in dict.fromkeys(points[p].encoded for p in served):
        at = tuple(p for p in served if points[p].encoded == size)
        bucket = ShapeBucket(max(points[p].batch for p in at), *size, frames=frames)
        if all(plan.bucket != bucket for plan in plans):
            plans.append(VariantPlan(variant_name(bucket), "bucket", at, bucket=bucket))


def _within_a_bucket(spec: ComponentSpec, served: list[CapturePoint], plans: list[VariantPlan]) -> bool:
    """Whether the calls a dynamic model of a VAE part would serve are all of one size that one of
    its bucket plans serves (a target whose range is of text lengths alone: the text does not
    reach the VAE)."""
    sizes = {(*(p.encoded if spec.part == "encoder" else (p.height, p.width)), p.frames) for p in served}
    batch = max(p.batch for p in served)
    return len(sizes) == 1 and any(plan.bucket is not None and batch <= plan.bucket.batch and sizes ==
                                   {(plan.bucket.height, plan.bucket.width, plan.bucket.frames)} for plan in plans)


def _tile_ranges(spec: ComponentSpec, vae: Any, stride: int, largest: int) -> dict[str, Any]:
    """The tiles diffusers' tiled encode/decode cuts from images whose sides are multiples of
    `stride` px: full tiles and the remainders at the edges, all multiples of the step between
    tiles and the stride (pixels, batch in images)."""
    if type(vae).__name__ in FRAMEWISE_VAES:
        raise BuildError(f"{spec.name}: tiling = true: {type(vae).__name__}'s tiles are not built by aotbuild (its "
                         f"tiled encode and decode cut tiles of their own sizes)",
                         hint=f"remove tiling from {spec.name} in [components]: images decode whole")
    factor = vae_factor(vae.config)
    if spec.part == "decoder":  # tiles are cut from latents
        tile = vae.tile_latent_min_size
        step = math.gcd(int(tile * (1 - vae.tile_overlap_factor)), stride // factor) * factor
        tile *= factor
    else:
        tile = vae.tile_sample_min_size
        step = math.gcd(int(tile * (1 - vae.tile_overlap_factor)), stride)
        if step % factor:
            raise BuildError(f"{spec.name}: tiles of {tile} px overlapping by {vae.tile_overlap_factor} leave edges "
                             f"of {step} px, not a multiple of the VAE's factor {factor}")
    return {"batch": [1, largest], "height": [step, tile], "width": [step, tile], "stride": step}


def _capture_all(pipe: Any, spec: PipelineSpec, specs: list, target: Target, points: dict[str, CapturePoint],
                 device: torch.device, progress: Progress, blocks: dict[str, torch.nn.Module] | None = None,
                 timed: dict[str, tuple[torch.nn.Module, str]] | None = None,
                 ) -> tuple[dict[str, dict[str, capture.CapturedCall]], dict[str, regions.BlockCalls],
                            dict[str, dict[str, float]]]:
    """({point name: {component: CapturedCall}}, {point name: the `blocks`' calls}, {point name:
    seconds in each of the `timed` methods and the run's steps}, for the point that ran the pipeline):
    one pipeline call per distinct point for the components the pipeline calls; random inputs for
    the others (the encoder) and for tiles.

    One group of models is on the device at a time: the text encoders encode the prompt for each
    batch size and leave, then the denoiser and VAE run the pipeline from those embeddings. The
    peak is the larger group, not the whole pipeline (full-size Flux in float32: T5-XXL 19 GB,
    the transformer 48 GB)."""
    recorded = [s for s in specs if s.recorded]
    runs = {p.run for p in points.values() if p.tile_of is None}
    models = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    encoders = [m for n, m in models.items() if n.startswith("text_encoder")]
    others = [m for n, m in models.items() if not n.startswith("text_encoder")]
    embeds: dict[tuple[int, bool, int | None], Any] = {}  # (images, guided, text length)
    if spec.prompt_embeds is None:  # the pipeline encodes its prompt at each capture
        others += encoders
    elif recorded and runs:
        for module in encoders:
            module.to(device)
        embeds = {(batch, guided, text): capture.encode_prompt(
                      pipe, spec, batch=batch, device=device,
                      guidance_scale=target.guidance_scale if guided else UNGUIDED, text=text)
                  for batch, guided, text in sorted({(r[0], r[3], r[4]) for r in runs}, key=str)}
        for module in encoders:
            module.to("cpu")
    for module in others:
        module.to(device)
    runs_done: dict[tuple, dict] = {}
    block_runs: dict[tuple, regions.BlockCalls] = {}
    seconds: dict[str, dict[str, float]] = {}
    calls: dict[str, dict[str, capture.CapturedCall]] = {}
    block_calls: dict[str, regions.BlockCalls] = {}
    for name, point in points.items():
        key = point.run
        calls[name] = {}
        if point.tile_of is None and recorded:  # capture_inputs records these only
            if key not in runs_done:
                progress("capture", f"at {point} (batch x height x width)")
                extras = spec.capture_extras(point.batch, point.height, point.width) if spec.capture_extras else None
                if point.images:  # an EDITS_SEVERAL call: the images it edits together, in order
                    extras = {**(extras or {}), "image": [seeded_image(*size) for size in point.images]}
                with regions.recording(blocks or {}) as block_runs[key]:
                    runs_done[key] = capture.capture_inputs(
                        pipe, recorded, batch=point.batch, height=point.height, width=point.width,
                        guidance_scale=target.guidance_scale if point.guided else UNGUIDED, text=point.text,
                        prompt_embeds=embeds.get((point.batch, point.guided, point.text)), extras=extras,
                        image=point.image, frames=point.frames, timed_methods=timed,
                        timings=seconds.setdefault(name, {}))
            calls[name].update(runs_done[key])
            if blocks:
                block_calls[name] = block_runs[key]
        for s in specs:
            if (not s.recorded and point.tile_of is None) or point.tile_of == s.name:
                calls[name][s.name] = capture.random_call(pipe, s, point.batch, *point.encoded, device)
    return calls, block_calls, seconds


def _check_frames(target: Target, pipe: Any) -> None:
    """Each bucket's frames against the loaded pipeline's temporal compression (a Hub source's
    configs are first read here): diffusers would round another count and make fewer frames."""
    step = frames_step(pipe)
    counts = [(f"shapes[{i}].frames", bucket.frames) for i, bucket in enumerate(target.shapes)]
    counts += [(f"dynamic.frames bound {bound}", bound) for bound in (target.dynamic or {}).get("frames", ())]
    for key, frames in counts:
        if frames is not None and (around := frames_around(frames, step)):
            raise BuildError(f"target {target.name}: key '{key}' = {frames}: {target.pipeline} makes 1 + a multiple "
                             f"of {step} frames (its VAE's temporal compression); {around[0]} or {around[1]} would "
                             f"be built")


def _eager_vae(pipe: Any, spec: PipelineSpec, specs: list[ComponentSpec]) -> dict[str, Any] | None:
    """Why the pipeline's VAE decodes eager where no part of it is compiled, and the methods whose
    time the reference capture measures for `_eager_share` (None: a VAE part is compiled, or no VAE)."""
    vae = getattr(pipe, "vae", None)
    if vae is None or not any(s.denoiser for s in specs) or any(s.attribute == "vae" for s in specs):
        return None
    if "vae_decoder" in spec.components:
        reason = "the target's [components] lists no vae_decoder"
    else:
        reason = (f"{type(vae).__name__} is not one of the VAEs whose decoder and encoder aotbuild compiles "
                  f"({', '.join(COMPILED_VAES)})")
    denoisers = {s.name: (getattr(pipe, s.attribute), s.method) for s in specs if s.denoiser}  # Wan 2.2: two
    return {"class": type(vae).__name__, "reason": reason, "timed": {"decode": (vae, "decode"), **denoisers}}


def _eager_share(pipe: Any, plans: list[VariantPlan], seconds: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The eager VAE's share of a generation at each of the denoiser's buckets (`plans`), from the
    reference capture (eager float32 on the build machine, one step unless a model is called later):
    decode / (decode + the denoisers' seconds per step x the pipeline's default number of steps)."""
    parameter = inspect.signature(type(pipe).__call__).parameters.get("num_inference_steps")
    steps = parameter.default if parameter is not None and isinstance(parameter.default, int) else 50
    shares = {}
    for plan in plans:
        measured = dict(seconds.get(plan.points[0]) or {})
        decode, runs = measured.pop("decode", 0.0), measured.pop("steps", 0)
        step = sum(measured.values()) / runs if runs else 0.0  # every denoiser call of a step
        if plan.kind == "bucket" and step > 0:
            shares[plan.name] = {"decode_s": round(decode, 6), "denoiser_step_s": round(step, 6), "steps": steps,
                                 "share": round(decode / (decode + steps * step), 4)}
    return shares


def _tensor_shapes(call: capture.CapturedCall) -> list[list[int]]:
    return [list(leaf.shape) for leaf in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(leaf, torch.Tensor)]


def _call_batch(call: capture.CapturedCall) -> int:
    """The batch of a call: the first dim of its first tensor (latents, images)."""
    return _tensor_shapes(call)[0][0]


def _variant_dims(component: str, plan: VariantPlan, reference: dict,
                  points: dict[str, CapturePoint]) -> tuple[list | None, list[int] | None]:
    """(how each input dim follows the call's batch, height, width and text length; the call batches served),
    or (None, None) for a static model. Batch dims are in units of the call's batch."""
    calls = [reference[p][component] for p in plan.points]
    batches = [_call_batch(c) for c in calls]
    call_batch = [min(batches), max(batches)]
    if plan.kind == "bucket":
        if call_batch[0] == call_batch[1]:
            return None, None
        high, low = calls[0], calls[batches.index(call_batch[0])]
        probes = {"base": _tensor_shapes(high), "batch": _tensor_shapes(low)}
        probes |= {"height": probes["base"], "width": probes["base"]}
        sizes = {"base": (batches[0], 0, 0), "batch": (call_batch[0], 0, 0), "height": (batches[0], 0, 0),
                 "width": (batches[0], 0, 0)}
        return shapes.classify(probes, {"min": probes["base"], "max": probes["base"]}, sizes, 1), call_batch
    prefix = plan.points[0].rsplit(":", 1)[0]

    def at(probe: str) -> list[list[int]]:
        return _tensor_shapes(reference[f"{prefix}:{probe}"][component])

    probes = {probe: at(probe) for probe in ("base", *shapes.axes_of(plan.ranges))}
    corners = {probe: at(probe) for probe in ("min", "max")}
    sizes = {probe: (points[f"{prefix}:{probe}"].batch, points[f"{prefix}:{probe}"].height,
                     points[f"{prefix}:{probe}"].width, points[f"{prefix}:{probe}"].frames) for probe in probes}
    if f"{prefix}:base:unguided" in plan.points:  # a fixed batch of images, moved by guidance: in call batches
        probes["batch"] = at("base:unguided")
        sizes = {probe: (batches[0], *size[1:]) for probe, size in sizes.items()}
        sizes["batch"] = (batches[plan.points.index(f"{prefix}:base:unguided")], *sizes["base"][1:])
    dims = shapes.classify(probes, corners, sizes, plan.ranges["stride"])
    if TEXT in plan.ranges:
        texts = {probe: points[f"{prefix}:{probe}"].text for probe in (*probes, *corners)}
        dims = shapes.with_text_offsets(dims, probes | corners, texts)
    return shapes.in_call_batches(dims), call_batch


def _variant_entry(plan: VariantPlan, call: capture.CapturedCall, leaf_dims: list | None,
                   call_batch: list[int] | None, guidance: list[str] | None) -> dict[str, Any]:
    """The manifest entry of one variant: what it covers and its inputs' signature."""
    entry: dict[str, Any] = {"name": plan.name}
    if plan.kind == "bucket":
        bucket = plan.bucket
        entry["bucket"] = {"batch": bucket.batch, "height": bucket.height, "width": bucket.width,
                           **({TEXT: bucket.max_sequence_length} if bucket.max_sequence_length else {}),
                           **({"image": list(bucket.image)} if bucket.image else {}),
                           **({"images": [list(size) for size in bucket.images]} if bucket.images else {}),
                           **({"frames": bucket.frames} if bucket.frames else {})}
        entry["inputs"] = leaf_signature((call.args, call.kwargs))
        if leaf_dims is not None:
            tensor_dims = iter(leaf_dims)
            for leaf in entry["inputs"]:
                if "shape" in leaf:
                    leaf["dims"] = next(tensor_dims)
    else:
        entry["dynamic"] = dict(plan.ranges)
        if plan.images:
            entry["dynamic"]["images"] = [list(size) for size in plan.images]
        entry["inputs"] = _dynamic_signature(call, leaf_dims)
    if call_batch is not None:
        entry["call_batch"] = call_batch
    if guidance is not None:
        entry["guidance"] = guidance
    if plan.kind == "tile":
        entry["tile"] = True
    return entry


def _batches_guidance(reference: dict[str, dict[str, capture.CapturedCall]], specs: list[ComponentSpec]) -> bool:
    """Whether the pipeline doubles its denoiser's batch under guidance, as captured: not when a
    guided call and its unguided twin pass the same batch (Chroma calls it twice per step)."""
    for point, calls in reference.items():
        if point.endswith(":unguided"):
            twin = reference[point.removesuffix(":unguided")]
            if any(s.denoiser and s.name in calls and _call_batch(calls[s.name]) == _call_batch(twin[s.name])
                   for s in specs):
                return False
    return True


def _served_guidance(spec: ComponentSpec, plan: VariantPlan, modes: tuple[bool, ...]) -> list | None:
    """Which guidance a denoiser's variant serves (None: not a denoiser whose batch it changes,
    `modes` empty)."""
    if not (spec.denoiser and modes):
        return None
    served = {False if p.endswith(":unguided") else modes[0] for p in plan.points}
    return [g for g, on in (("guided", True), ("unguided", False)) if on in served]


def _export(module: torch.nn.Module, name: str, plan: VariantPlan, call: capture.CapturedCall,
            leaf_dims: list | None, call_batch: list[int] | None, target: Target, stages: _Stages,
            entry: dict[str, Any], served: dict[str, capture.CapturedCall]) -> torch.export.ExportedProgram:
    """torch.export of one variant: static, or dynamic over its dims, with what the program
    assumes of its input sizes recorded in `entry` and checked against every call it serves.
    Sequences (Flux's image tokens, Chroma's attention mask over text + image tokens) are related
    by the code: export infers how (Dim.AUTO). A dynamic export that traces the model in Python
    (non-strict) and fixes a size the calls vary (Z-Image's `len(caption)`) is traced again by
    TorchDynamo (strict), which keeps such sizes symbolic."""
    from torch.export import Dim

    dynamic_shapes = None
    if leaf_dims is not None:
        ranges = {**(plan.ranges or {}), "batch": call_batch}
        dynamic_shapes = shapes.export_dynamic_shapes(module, call.args, call.kwargs, leaf_dims, ranges,
                                                      (plan.ranges or {}).get("stride", 1), tokens=Dim.AUTO)

    def traced(strict: bool) -> torch.export.ExportedProgram:
        with stages("export", f"{name} {plan.name}" + (" (again, strict: a size was fixed)" if strict else "")):
            return export.export_variant(module, call.args, call.kwargs, optimize.export_context(target.optimize),
                                         dynamic_shapes, strict=strict)

    def checked(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        entry.pop("guards", None)
        _record_relations(entry, program, call, name)
        _check_served(program, entry, call, served, name, plan.name)
        return program

    _check_values(call, served, name, plan.name)
    program = traced(strict=False)
    try:
        return checked(program)
    except BuildError as fixed:
        if dynamic_shapes is None:
            raise
        try:
            program = traced(strict=True)
        except BuildError:
            raise fixed from None  # strict tracing failed: the first reason is the one to read
        return checked(program)


def _record_relations(entry: dict[str, Any], program: torch.export.ExportedProgram, call: capture.CapturedCall,
                      component: str) -> None:
    """Each dynamic dim of the entry's inputs gets its size in the exported program ("expr"), which
    the runtime checks every call against. A dim export made static, or relations the runtime
    could not check, fail the build: AOTInductor would run any shape on them unchecked."""
    exported = iter(export.input_dims(program))
    for leaf in entry["inputs"]:
        if "value" in leaf:
            continue
        sizes = next(exported)
        for d, (dim, size) in enumerate(zip(leaf.get("dims", ()), sizes, strict=False)):
            if not isinstance(dim, dict):
                continue
            if isinstance(size, int):
                raise BuildError(f"{component} {entry['name']}: torch.export made input {leaf['path']} dim {d} static "
                                 f"({size}) where the pipeline's calls vary it: the model does not take it dynamic",
                                 hint="cover those sizes with [[shapes]] buckets instead of [dynamic]")
            if shapes.polynomial(size) is None:
                raise BuildError(f"{component} {entry['name']}: input {leaf['path']} dim {d} is {size} in the exported "
                                 f"program, a relation aotbuild cannot check at call time",
                                 hint="cover those sizes with [[shapes]] buckets instead of [dynamic]")
            dim["expr"] = size
    dims = [leaf.get("dims", leaf.get("shape")) for leaf in entry["inputs"] if "value" not in leaf]
    guards = export.shape_guards(program)
    if guards:
        entry["guards"] = guards
    if not shapes.relations_hold(dims, _tensor_shapes(call), guards):
        found = ", ".join(d["expr"] for leaf in dims for d in leaf if isinstance(d, dict))
        raise BuildError(f"{component} {entry['name']}: the exported program relates its inputs' sizes in a way "
                         f"aotbuild cannot check at call time ({found})",
                         hint="cover those sizes with [[shapes]] buckets instead of [dynamic]")


def _check_served(program: torch.export.ExportedProgram, entry: dict[str, Any], example: capture.CapturedCall,
                  calls: dict[str, capture.CapturedCall], component: str, variant: str) -> None:
    """Check each call the variant serves against what the exported program assumes (its
    relations and guards), then run the program on fake tensors shaped as the call. Export can
    make a size static without a word (a tensor built from a Python list as long as the batch
    becomes a constant), and compiled code checks no shape: a call of another size would corrupt
    memory at run time. Fake tensors cost no compute, and the ops' own shape checks run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = program.module(check_guards=False)
    examples = [t for t in pytree.tree_leaves((example.args, example.kwargs)) if isinstance(t, torch.Tensor)]
    dims = [leaf.get("dims", leaf.get("shape")) for leaf in entry["inputs"] if "value" not in leaf]
    for point, call in calls.items():
        sizes = _tensor_shapes(call)
        if sizes == _tensor_shapes(example):
            continue
        bound = shapes.solve(dims, sizes)
        if bound is None:
            raise BuildError(f"{component} {variant}: the exported program fixes or relates its input sizes in a way "
                             f"the call at {point} breaks: torch.export fixed a size that this call changes",
                             hint="cover those sizes with [[shapes]] buckets of their own")
        if guard := shapes.failed_guard(entry.get("guards", ()), bound):
            raise BuildError(f"{component} {variant}: the exported program assumes {guard} of its input sizes (a "
                             f"branch the model's code took at the example's sizes), which the call at {point} breaks",
                             hint="cover those sizes with [[shapes]] buckets of their own, or a [dynamic] range "
                                  "whose sizes all take the same branch")
        with FakeTensorMode(allow_non_fake_inputs=True):
            fakes = [_empty_like(t, size) for t, size in zip(examples, sizes, strict=True)]
            leaves, structure = pytree.tree_flatten((example.args, example.kwargs))
            taken = iter(fakes)
            args, kwargs = pytree.tree_unflatten([next(taken) if isinstance(leaf, torch.Tensor) else leaf
                                                  for leaf in leaves], structure)
            try:
                graph(*args, **kwargs)
            except Exception as exc:
                raise BuildError(f"{component} {variant}: the exported program cannot run the call at {point} "
                                 f"({str(exc).splitlines()[0]}): torch.export fixed a size that this call changes",
                                 hint="cover those sizes with [[shapes]] buckets of their own") from exc


def _check_values(example: capture.CapturedCall, calls: dict[str, capture.CapturedCall], component: str,
                  variant: str) -> None:
    """Every call the variant serves passes its inputs in the example's structure, and the ones
    that are not tensors are the same: a compiled model takes them as constants (Qwen-Image's
    `img_shapes` follow the size). Z-Image passes a list with an entry per image and per guidance
    branch, so its guided and unguided calls differ in structure."""
    values, structure = dict(_value_leaves(example)), pytree.tree_structure((example.args, example.kwargs))
    for point, call in calls.items():
        if pytree.tree_structure((call.args, call.kwargs)) != structure:
            given = {path for path, _ in pytree.tree_flatten_with_path((call.args, call.kwargs))[0]}
            expected = {path for path, _ in pytree.tree_flatten_with_path((example.args, example.kwargs))[0]}
            inputs = ", ".join(sorted(leaf_name(p) for p in given ^ expected)) or "their nesting"
            raise BuildError(f"{component} {variant}: the call at {point} passes other inputs than the example "
                             f"({inputs}): one compiled model takes one structure",
                             hint='build guided and unguided calls as targets of their own (guidance = "guided" or '
                                  '"unguided"), or each size as a [[shapes]] bucket')
        for path, value in _value_leaves(call):
            if repr(value) != repr(values.get(path)):
                raise BuildError(f"{component} {variant}: input {path} is {value!r} at {point} and "
                                 f"{values.get(path)!r} at the example: a Python value that follows the call's "
                                 f"size, which one compiled model takes as a constant",
                                 hint="cover those sizes with [[shapes]] buckets of their own")


def _value_leaves(call: capture.CapturedCall) -> list[tuple[str, Any]]:
    """The call's inputs that are not tensors (Qwen-Image's `img_shapes`), by path."""
    return [(leaf_name(path), leaf) for path, leaf in pytree.tree_flatten_with_path((call.args, call.kwargs))[0]
            if not isinstance(leaf, torch.Tensor)]


def _empty_like(tensor: torch.Tensor, size: list[int]) -> torch.Tensor:
    """An empty tensor of `size` with `tensor`'s dtype, device and memory format."""
    nhwc = tensor.ndim == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last)
    return torch.empty(size, dtype=tensor.dtype, device=tensor.device,
                       memory_format=torch.channels_last if nhwc else torch.contiguous_format)


def _compile_all(programs: dict[str, torch.export.ExportedProgram], what: str, inductor_options: dict[str, Any],
                 stages: _Stages) -> dict[str, list]:
    compiled = {}
    for i, (name, program) in enumerate(programs.items(), 1):
        with stages("compile", f"{what} {name} ({i}/{len(programs)}, AOTInductor)"):
            compiled[name] = export.compile_variant(program, inductor_options)
    return compiled


def _component_record(spec: ComponentSpec, module: torch.nn.Module, dtype: str, compiled: dict[str, list],
                      constants: dict[str, torch.Tensor], layouts: dict[str, dict],
                      variants: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "attribute": spec.attribute, "method": spec.method,
        "package": f"{spec.name}.pt2", "weights": f"{spec.name}.safetensors",
        "dtype": dtype,
        "custom_ops": sorted({ns for files in compiled.values() for ns in export.custom_ops_called(files)}),
        # Less the folder it was read from: a machine path (an HF cache, a local checkout).
        "config": {k: v for k, v in module.config.items() if k != "_name_or_path"},
        "attributes": {a: value for a in spec.read_attributes
                       if plain_attribute(value := _get_dotted(module, a, None))},
        "constants": {"count": len(constants), "bytes": sum(t.nbytes for t in constants.values()),
                      "layouts": layouts},
        "variants": variants,
    }


def _build_component(spec: ComponentSpec, module: torch.nn.Module, target: Target, plans: list[VariantPlan],
                     examples: dict, reference: dict, dims: dict[str, tuple], modes: tuple[bool, ...], dtype: str,
                     inductor_options: dict[str, Any], out: Path, stages: _Stages) -> dict[str, Any]:
    """Export, compile and package every variant of one component; returns its manifest entry."""
    exported = spec.export_module(module).eval()
    programs, variants = {}, []
    for plan in plans:
        call = examples[plan.points[0]][spec.name]
        leaf_dims, call_batch = dims[plan.name]
        variants.append(_variant_entry(plan, call, leaf_dims, call_batch, _served_guidance(spec, plan, modes)))
        programs[plan.name] = _export(exported, spec.name, plan, call, leaf_dims, call_batch, target, stages,
                                      variants[-1], {p: reference[p][spec.name] for p in plan.points})
    export.name_constants_apart(programs)
    compiled = _compile_all(programs, spec.name, inductor_options, stages)
    kept = {fqn: tensor for fqn, tensor in module_tensors(exported).items() if fqn.split(".")[0] in KEPT_MODULES}
    with stages("package", f"{spec.name}.pt2 + {spec.name}.safetensors"):
        constants, layouts = _write_package(out, spec.name, compiled, programs, torch.device(target.device),
                                            kept=kept)
    record = _component_record(spec, module, dtype, compiled, constants, layouts, variants)
    if unread := export.unread_weights(list(programs.values()), constants):
        record["unread"] = unread
    return record


def _build_regional(spec: ComponentSpec, module: torch.nn.Module, found: list[regions.Region],
                    instances: dict[str, torch.nn.Module], target: Target, plans: list[VariantPlan],
                    examples: dict, reference: dict, dims: dict[str, dict[str, tuple]], modes: tuple[bool, ...],
                    dtype: str, inductor_options: dict[str, Any], out: Path, stages: _Stages) -> dict[str, Any]:
    """Export and compile each region once per variant, package them all in one file, and store
    every instance's weights and the eager part's (`runtime/regional.py` runs them); returns the
    component's manifest entry. The component's variants record the call signatures the runtime
    checks each call against, as for a whole model."""
    module = module.eval()
    variants = []
    for plan in plans:
        call = examples[plan.points[0]][spec.name]
        entry = _variant_entry(plan, call, *dims[spec.name][plan.name], _served_guidance(spec, plan, modes))
        for leaf in entry["inputs"]:
            if "value" in leaf and not _is_literal(leaf["value"]):
                raise BuildError(f"{spec.name}: input {leaf['path']} is {leaf['value']}, which a regional model cannot "
                                 f"record", hint='use [compile] mode = "whole"')
        entry["in_spec"] = pytree.treespec_dumps(pytree.tree_flatten((tuple(call.args), call.kwargs))[1])
        entry["out_spec"] = pytree.treespec_dumps(pytree.tree_flatten((call.output,))[1])
        variants.append(entry)
    programs: dict[str, torch.export.ExportedProgram] = {}
    region_entries = []
    for region in found:
        block = instances[region.instances[0]].eval()
        entries = []
        for plan in plans:
            call = examples[plan.points[0]][region.name]
            leaf_dims, call_batch = dims[region.name][plan.name]
            entry = {**_variant_entry(plan, call, leaf_dims, call_batch, None), "model": f"{region.name}__{plan.name}"}
            programs[entry["model"]] = _export(block, region.name, plan, call, leaf_dims, call_batch, target, stages,
                                               entry, {p: reference[p][region.name] for p in plan.points})
            entries.append(entry)
        region_entries.append({"name": region.name, "class": region.block_class, "instances": list(region.instances),
                               "variants": entries})
    compiled = _compile_all(programs, spec.name, inductor_options, stages)
    with stages("package", f"{spec.name}.pt2 + {spec.name}.safetensors"):
        constants, layouts = _write_package(out, spec.name, compiled, programs, torch.device(target.device),
                                            regional=(module, found, instances, region_entries))
    in_blocks = sum(t.numel() for fqn in instances for t in instances[fqn].parameters())
    total = sum(t.numel() for t in module.parameters())
    record = _component_record(spec, module, dtype, compiled, constants, layouts, variants)
    record.update(mode="regional", regions=region_entries, eager={
        "parameters": total - in_blocks, "share": round((total - in_blocks) / max(total, 1), 4),
        "reason": "the code between blocks (embeddings, norms, convolutions, the final projection) runs as "
                  "eager torch on the artifact's weights: diffusers' own forward, calling the compiled blocks"})
    return record


def _is_literal(text: str) -> bool:
    """Whether a recorded non-tensor input can be made again from its repr (the runtime does)."""
    import ast

    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    return True


def _dynamic_signature(call: capture.CapturedCall, dims: list) -> list[dict[str, Any]]:
    """Like leaf_signature, with each tensor's dims as classified and its memory layout."""
    leaves = leaf_signature((call.args, call.kwargs))
    tensor_dims = iter(dims)
    tensors = iter(t for t in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(t, torch.Tensor))
    for leaf in leaves:
        if "shape" in leaf:
            tensor = next(tensors)
            del leaf["shape"], leaf["stride"]
            leaf["dims"] = next(tensor_dims)
            nhwc = tensor.ndim == 4 and not tensor.is_contiguous() and tensor.is_contiguous(
                memory_format=torch.channels_last)
            if nhwc or tensor.is_contiguous() or not export.dense(tensor):
                leaf["layout"] = "channels_last" if nhwc else "contiguous"
            else:  # a permuted view (SD 1.5's transformer blocks take one): its dims from outer to inner in memory
                leaf["layout"] = sorted(range(tensor.ndim), key=lambda d: (-tensor.stride(d), d))
    return leaves


def _load_pipeline(target: Target, spec: PipelineSpec, device: torch.device, folder: Path | None = None) -> Any:
    """The target's pipeline in float32 on `device`, from `folder` (its source, already resolved)."""
    if folder is None:
        folder = sources.resolve_folder(target.source, target.revision, target.base_dir, skip=set(),
                                        dtype=target.dtype)
    seed = target.seed if sources.is_random(target.source) else None
    components = sources.load_components(folder, seed=seed, skip=set(), dtype=torch.float32,
                                         half_files=target.dtype in sources.HALF_DTYPES)
    pipe = sources.assemble_pipeline(spec, folder, components)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _default_pixels(pipe: Any, spec: PipelineSpec, target: Target) -> dict[str, int | None]:
    """The size the pipeline makes when a call gives none ("native"), and the size the compiled
    pipeline makes instead ("served"): the native one when a bucket or the dynamic range covers it
    for one image, else the first square bucket (None: no square bucket, the caller must choose)."""
    configs = {name: dict(m.config) for name, m in pipe.components.items()
               if isinstance(getattr(m, "config", None), dict)}  # diffusers models' configs (FrozenDict)
    fixed = _call_default_pixels(pipe)  # a size in the call's signature: no config can move it
    native = fixed or (spec.default_pixels(configs) if spec.default_pixels else _pipeline_default_pixels(pipe, spec))
    if native is None:
        return {"native": None, "served": None}
    dynamic = target.dynamic
    covered = any(b.height == b.width == native for b in target.shapes) or bool(
        dynamic and not native % target.stride and all(dynamic[a][0] <= native <= dynamic[a][1]
                                                       for a in ("height", "width")))
    square = None if fixed else next((b.height for b in target.shapes if b.height == b.width), None)
    return {"native": native, "served": native if covered else square}


def _call_default_pixels(pipe: Any) -> int | None:
    """The square size a pipeline's call defaults to in its signature (AuraFlow's 1024; Flux
    Kontext scales every size to the area `max_area`, 1024 x 1024 by default; Qwen-Image-Edit
    makes the edited image's aspect ratio at its area, `SIZED_BY_IMAGE`), if any."""
    parameters = inspect.signature(type(pipe).__call__).parameters
    area = parameters["max_area"].default if "max_area" in parameters else SIZED_BY_IMAGE.get(type(pipe).__name__)
    if isinstance(area, int) and math.isqrt(area) ** 2 == area:
        return math.isqrt(area)
    sizes = {parameters[a].default for a in ("height", "width") if a in parameters}
    size = sizes.pop() if len(sizes) == 1 else None
    return size if isinstance(size, int) else None


def _pipeline_default_pixels(pipe: Any, spec: PipelineSpec) -> int | None:
    """What most pipelines do when a call gives no size: `default_sample_size` (else the
    denoiser's `sample_size`) latent pixels times `vae_scale_factor`; None when they say neither."""
    denoiser = next(getattr(pipe, c.attribute) for c in spec.components.values() if c.denoiser)
    latent = getattr(pipe, "default_sample_size", None) or getattr(denoiser.config, "sample_size", None)
    factor = getattr(pipe, "vae_scale_factor", None)
    return latent * factor if isinstance(latent, int) and isinstance(factor, int) else None


def optimize_pipeline(pipe: Any, specs: list[ComponentSpec], target: Target) -> tuple[dict, dict[str, Any]]:
    """Apply the target's dtype and passes: the compiled modules get the passes, the other models
    (text encoders) the dtype, as a served pipeline would have them. Returns (modules, records).
    The VAE's parts are one module: it gets each pass once, under its first part's name."""
    modules = {s.name: getattr(pipe, s.attribute) for s in specs}
    first = {}
    for name, module in modules.items():
        first.setdefault(id(module), name)
    unique = {name: modules[name] for name in first.values()}
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module) and id(component) not in first \
                and getattr(component, "dtype", None) != DTYPES[target.dtype]:  # a cast that is no cast warns
            component.to(DTYPES[target.dtype])
    force_upcast = {name: bool(getattr(m.config, "force_upcast", False)) for name, m in unique.items()}
    dtypes = optimize.apply_dtype(unique, target.dtype, force_upcast)
    dtypes = {name: dtypes[first[id(module)]] for name, module in modules.items()}
    passes = optimize.apply_passes(unique, target.optimize, target.device)
    changes_inputs = any(d != "float32" for d in dtypes.values()) or bool(target.optimize)
    return modules, {"dtype": dtypes, "passes": passes, "changes_inputs": changes_inputs}


def _write_package(out: Path, name: str, compiled: dict[str, list], programs: dict[str, torch.export.ExportedProgram],
                   device: torch.device, regional: tuple | None = None, kept: dict[str, torch.Tensor] | None = None,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Write the package, then the weights: exactly the constants some variant binds (the
    programs also hold parameters no compiled code reads, e.g. the q/k/v projections that
    fuse_qkv replaced), each in the memory order the code reads it, and the `kept` tensors the
    pipeline reads from the module itself (`KEPT_MODULES`). Returns (constants, layouts).

    `regional` (model, regions, instances, region entries): the constants are every instance's
    (by the model's FQNs), each region's lifted ones once (`<region>.<name>`), and the eager
    part's parameters and buffers; each region variant's entry records the names it binds."""
    from safetensors.torch import save_file

    package_file, weights_file = f"{name}.pt2", f"{name}.safetensors"
    export.package(out / package_file, compiled)
    sha256 = sha256_file(out / package_file)
    binds = {model: list(open_model(out / package_file, sha256, model, device).get_constant_fqns())
             for model in compiled}
    if regional is None:
        constants = export.constants_of(list(programs.values()), {fqn for names in binds.values() for fqn in names})
    else:
        constants = _regional_constants(*regional, binds, programs)
    constants = {**constants, **(kept or {})}
    stored, layouts = export.storage_order(constants)
    save_file({k: v.cpu() for k, v in stored.items()}, os.fspath(out / weights_file))
    (out / weights_file).chmod(0o644)
    return constants, layouts


def _regional_constants(module: torch.nn.Module, found: list[regions.Region], instances: dict[str, torch.nn.Module],
                        entries: list[dict[str, Any]], binds: dict[str, list[str]],
                        programs: dict[str, torch.export.ExportedProgram]) -> dict[str, torch.Tensor]:
    from .runtime.weights import same_layout

    constants: dict[str, torch.Tensor] = {}
    for region, entry in zip(found, entries, strict=True):
        names = sorted({n for v in entry["variants"] for n in binds[v["model"]]})
        for variant in entry["variants"]:
            variant["constants"] = binds[variant["model"]]
        first = instances[region.instances[0]]
        own = {n for n, _ in [*first.named_parameters(), *first.named_buffers()]}
        lifted = export.constants_of([programs[v["model"]] for v in entry["variants"]], set(names) - own)
        entry["shared_constants"] = sorted(lifted)
        constants.update({f"{region.name}.{n}": t for n, t in lifted.items()})
        per_instance = [regions.instance_constants(region, instances[fqn], fqn, names, lifted)
                        for fqn in region.instances]
        for mine in per_instance:
            for (full, tensor), like in zip(mine.items(), per_instance[0].values(), strict=True):
                if not same_layout(tensor, like, like.device):
                    raise BuildError(f"{region.name}: {full} is {list(tensor.shape)} {tensor.dtype}, unlike the "
                                     f"region's first block {region.instances[0]}")
            constants.update(mine)
    prefixes = tuple(f"{fqn}." for fqn in instances)
    for fqn, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if not fqn.startswith(prefixes):
            constants[fqn] = tensor.detach()
    return constants


def _validate(out: Path, manifest: dict[str, Any], reference: dict, points: dict[str, CapturePoint],
              plans: dict[str, list[VariantPlan]], device: torch.device, allow_drift: bool) -> None:
    """Run each compiled variant through the runtime's own loader on the float32 captured inputs
    (cast to the variant's dtypes) and compare with the eager float32 output at every point it
    serves: a bucket with 1 image and its batch (and with and without guidance), the dynamic model
    at the range's corners and its base point, a tile model at the smallest and largest tiles."""
    failures, graph_failures = [], []
    graph_pool = GraphPool(device) if manifest["runtime"]["cuda_graphs"] else None
    tf32 = validated_with_tf32(manifest)
    for name, entry in manifest["components"].items():
        layouts = entry["constants"]["layouts"]
        weights = load_weights(out / entry["weights"], device, layouts)
        tolerance = optimize.tolerance(manifest["target"]["optimize"], TOLERANCES[entry["dtype"]])
        package_sha = sha256_file(out / entry["package"])
        opened, _ = component_variants(out / entry["package"], entry, weights, package_sha, layouts,
                                       LoadContext(device, tf32=tf32))
        plain = {variant.name: variant for variant in opened}
        for variant_entry in entry["variants"]:
            variant = plain[variant_entry["name"]]
            checked = next(plan.points for plan in plans[name] if plan.name == variant.name)
            errors = {}
            for point in checked:
                call = reference[point][name]
                leaves = variant.flatten(call.args, call.kwargs)
                if leaves is None or not variant.accepts(leaves):
                    raise BuildError(f"{name} {variant.name}: the compiled model refuses the inputs captured at "
                                     f"{points[point]}")
                with torch.no_grad():
                    errors[str(points[point])] = output_error(variant.run(leaves), call.output)
            worst_abs, worst_rel = max(errors.values(), key=lambda e: e[1] if e[1] == e[1] else float("inf"))
            variant_entry["numerics"] = {
                "max_abs_error": worst_abs, "max_rel_error": worst_rel, "tolerance": tolerance,
                "reference": "eager float32, unoptimized", "checked_at": list(errors),
            }
            if not worst_rel <= tolerance:  # also catches NaN
                failures.append(f"{name} {variant.name}: relative error {worst_rel:.3g} > {tolerance:g}")
        if graph_pool is not None:
            graph_failures += _check_cuda_graphs(out / entry["package"], entry, name, plain, weights, package_sha,
                                                 layouts, reference, LoadContext(device, graph_pool, tf32))
        # The bound weights stay on the device regardless: torch 2.13 never deletes its handle to a
        # user-managed constant (fixed upstream by pytorch#194480), so they live until the build ends.
        del plain, weights, variant
    if graph_failures:  # a wrong replay is a defect, not drift: no flag accepts it
        raise BuildError("; ".join(graph_failures), hint="set cuda_graphs = false in the target")
    if failures and not allow_drift:
        raise NumericsError("compiled output differs from eager: " + "; ".join(failures),
                            hint="inspect the recipe, or accept with --allow-numerics-drift")


def _check_cuda_graphs(package: Path, entry: dict[str, Any], component: str, plain: dict[str, CompiledVariant],
                       weights: dict, package_sha: str, layouts: dict[str, dict], reference: dict,
                       context: LoadContext) -> list[str]:
    """The runtime's graph mode against plain runs, used as the runtime uses it: every bucket of the
    component captured into one shared pool, then each replayed on new random inputs. Records each
    variant's largest relative difference in its numerics; returns the failures."""
    opened, _ = component_variants(package, entry, weights, package_sha, layouts, context)
    graphed = {v.name: v for v in opened if "bucket" in v.entry}
    generator = torch.Generator().manual_seed(0)
    diffs: dict[str, float] = dict.fromkeys(graphed, 0.0)
    first: dict[str, torch.Tensor] = {}
    failures = []
    for fresh in (False, True):
        for name, model in graphed.items():
            call = reference[name][component]  # a bucket's export point is named after it
            leaves = [(path, torch.randn(leaf.shape, generator=generator).to(leaf.dtype)
                       if fresh and isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf)
                      for path, leaf in plain[name].flatten(call.args, call.kwargs)]
            with torch.no_grad():
                got, want = (_first_output(m.run(leaves)).float() for m in (model, plain[name]))
            diff = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
            diffs[name] = max(diffs[name], diff, key=lambda d: d if d == d else float("inf"))  # NaN wins
            if fresh and torch.equal(got, first[name]):
                failures.append(f"{component} {name}: the CUDA graph replay ignored its new inputs")
            first[name] = got
    for name, diff in diffs.items():
        plain[name].entry["numerics"]["cuda_graph_rel_diff"] = diff
        if not diff <= GRAPH_TOLERANCE:
            failures.append(f"{component} {name}: CUDA graph replay differs from the plain run by {diff:.3g} "
                            f"(relative) > {GRAPH_TOLERANCE:g}")
    return failures


def output_error(result: Any, expected: Any) -> tuple[float, float]:
    """(largest absolute difference, that / the largest absolute value of `expected`) between a
    model's sample (`_first_output`) and the eager float32 one: the build's numerics, and the bench's."""
    got, want = _first_output(result).float(), _flat(expected).float()
    error = (got - want.to(got.device)).abs().max().item()
    return error, error / max(want.abs().max().item(), 1e-6)


def _first_output(result: Any) -> torch.Tensor:
    """A compiled model's sample (the first output), flat: Z-Image's is a list, one per image."""
    return _flat(result[0] if isinstance(result, tuple) else result)


def _flat(tree: Any) -> torch.Tensor:
    leaves = pytree.tree_leaves(tree)
    return leaves[0] if len(leaves) == 1 else torch.cat([t.flatten() for t in leaves])


def _get_dotted(obj: Any, dotted: str, *default: Any) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, *default)
    return obj


def _replace_folder(new: Path, folder: Path, staging_dir: Path) -> None:
    """Move the complete `new` folder to `folder`, replacing what was there. The previous artifact
    is parked as `old-*/artifact` in the target's staging folder for the instant between the two
    renames; a build killed right there gets it back from `_recover_stale_staging`."""
    old = None
    if folder.exists():
        old = Path(tempfile.mkdtemp(prefix="old-", dir=staging_dir))
        os.rename(folder, old / "artifact")
    os.rename(new, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _recover_stale_staging(staging_dir: Path, folder: Path) -> None:
    """Clean up after killed builds of this target (called under its lock, so every entry is from
    a build that died): put back a parked previous artifact whose replacement never arrived,
    delete partial staging folders."""
    for path in staging_dir.iterdir():
        parked = path / "artifact"
        if path.name.startswith("old-") and parked.is_dir() and not folder.exists():
            os.rename(parked, folder)
        shutil.rmtree(path, ignore_errors=True)
