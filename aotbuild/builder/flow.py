"""One build: target -> artifact folder. Read top to bottom, this is the whole flow:

load -> capture (fp32 eager reference) -> optimize -> capture (example inputs) -> the VAE
decoder's fp32 reference -> export -> compile -> package (+ weights) -> validate (compiled vs
reference) -> manifest -> rename into place.

A file per step: `transaction` (lock, staging, swap, recovery), `plan` (capture points and
variants), `capturing` (load, capture, passes), `packaging` (export, compile, package one
component), `regional` (a denoiser's blocks), `validate`, `record` (what the manifest says of
the environment and the source); `context` holds what the steps share.

Everything is written to a staging folder inside `artifacts/` (the same filesystem, so the final
rename cannot fail with EXDEV on a mounted volume) and renamed into place only when complete, so a
failed or killed build leaves the previous artifact untouched.
"""

from __future__ import annotations

import copy
import datetime
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import AotbuildError, BuildError
from ..runtime import sources
from ..runtime.cache import check_artifact_files, mark_verified
from ..runtime.load import warn_slow_precision
from ..runtime.variant import tf32
from ..spec.manifest import (
    DTYPES,
    REGIONAL_SCHEMA,
    SCHEMA_VERSION,
    aotbuild_version,
    check_compatible,
    library_versions,
    read_manifest,
    sha256_file,
    write_manifest,
)
from ..spec.pipelines import UNCURATED, frames_step, pipeline_spec
from . import capture, export, optimize, regions
from .capturing import (
    Loop,
    capture_all,
    default_pixels,
    eager_share,
    eager_vae_record,
    free_memory,
    load_source_pipeline,
    optimize_pipeline,
    release_others,
)
from .context import BuildContext, BuildResult, Progress, Stages, print_progress
from .packaging import batches_guidance, build_component, variant_dims
from .plan import check_frames, guidance_modes, plan_target
from .record import build_environment, permuted_inputs, source_record
from .regional import build_regional
from .targets import Target
from .transaction import STAGING_DIRNAME, recover_stale_staging, replace_folder, target_lock
from .validate import load_artifact, validate_artifact, validate_loop


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
        return manifest["source"] == source_record(target)  # last: a Hub revision is resolved
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
    check_device(target)
    if target.device == "cpu":  # a CPU artifact runs on CPUs like this one
        warn_slow_precision([target.dtype], f"target {target.name}")

    try:
        staging_root = artifacts_dir / STAGING_DIRNAME
        staging_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot write into {artifacts_dir}: {exc}") from None
    with target_lock(staging_root, target.name, wait, progress) as staging_dir:
        # A concurrent build of this target may have finished while this one waited for the lock.
        if not force and is_fresh(folder, target):
            progress("fresh", f"{folder} was just built by another process")
            return BuildResult(folder, read_manifest(folder), skipped=True)
        recover_stale_staging(staging_dir, folder)
        staging = Path(tempfile.mkdtemp(prefix="build-", dir=staging_dir))
        staging.chmod(0o755)
        try:
            stages = Stages(progress, target.device == "cuda")
            with tf32(optimize.uses_tf32(target.optimize, target.device)):  # never left set for the process
                manifest = _build_into(target, staging, allow_numerics_drift, stages)
            replace_folder(staging, folder, staging_dir)
        except OSError as exc:
            raise BuildError(f"could not write the artifact: {exc}") from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return BuildResult(folder, manifest, timings=manifest["timings"])


def check_device(target: Target) -> None:
    """A CUDA target builds only on a GPU of its compute capability (and with nvcc for
    multi-arch kernels): refused before anything loads, saying where to build it."""
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


def _build_into(target: Target, out: Path, allow_drift: bool, stages: Stages) -> dict[str, Any]:
    spec = pipeline_spec(target.pipeline)
    specs = [spec.component(name) for name in target.components]
    device = torch.device(target.device)
    inductor_options = export.inductor_options(target.inductor, optimize.inductor_flags(target.optimize),
                                               multi_arch=bool(target.gpu and target.gpu.multi_arch),
                                               device=target.device, cpu_baseline=target.cpu_baseline)

    with stages("load", f"{target.pipeline} from {target.source}"):
        folder = sources.resolve_folder(target.source, target.revision, target.base_dir, skip=set(),
                                        dtype=target.dtype)
        source = source_record(target, folder)  # what was read: the commit a branch resolved to, a fingerprint
        pipe = load_source_pipeline(target, spec, torch.device("cpu"), folder,  # capture_all places the models
                                    dtype=DTYPES[target.reference_dtype])
    check_frames(target, pipe)
    optimize.check_passes({s.name: getattr(pipe, s.attribute) for s in specs}, target.optimize)
    points, plans = plan_target(target, spec, specs, getattr(pipe, "vae", None), frames_step(pipe))
    regional = next((s for s in specs if s.denoiser), None) if target.compile_mode == "regional" else None
    instances = regions.block_instances(getattr(pipe, regional.attribute), regional.name) if regional else {}
    eager_vae = eager_vae_record(pipe, spec, specs)
    denoiser = next((s for s in specs if s.denoiser), None)
    # The short denoising loop: at the denoiser's first variant's export point, eager now, compiled at the end.
    loop = Loop(plans[denoiser.name][0].points[0], target.validation_steps) if denoiser else None
    # An eager VAE's decode is timed at each bucket's first point, for its share of a generation, in
    # the target's dtype, as it runs at generation: in the capture of the optimized pipeline's example
    # inputs where the dtype changes (that capture runs at every plan's first point), else here. Not
    # beside the float32 pipeline: Wan 2.1 1.3B's float32 decode of 9 frames at 480x832 px, ~8 GiB.
    timed = eager_vae.pop("timed") if eager_vae else None
    timed_points = [plan.points[0] for plan in plans[denoiser.name] if plan.kind == "bucket"] if eager_vae else []
    timed_later = eager_vae is not None and target.dtype != target.reference_dtype
    with stages("capture", f"eager {target.reference_dtype} reference"), tf32(False):  # no TF32, whatever the recipe
        reference, block_calls, seconds = capture_all(pipe, spec, specs, target, points, device, stages.progress,
                                                       instances, timed=None if timed_later else timed,
                                                       timed_points=timed_points, loop=loop)
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
    dims = {s.name: {plan.name: variant_dims(s.name, plan, reference, points) for plan in plans[s.name]}
            for s in specs}
    dims |= {r.name: {plan.name: variant_dims(r.name, plan, reference, points) for plan in plans[regional.name]}
             for r in found}
    # The capture recorded the VAE decoder's calls without decoding (`capture.recording`): the VAE
    # as captured (float32) decodes them once the denoiser is cast to the target's dtype (a copy of
    # it: the pipeline's is cast too), or now where nothing is cast (a reference in that dtype).
    decoder = next((s for s in specs if s.part == "decoder"), None)
    pending = decoder and any(isinstance(getattr(calls.get(decoder.name), "output", None), capture.PendingOutput)
                              for calls in reference.values())

    def decode_reference(vae: torch.nn.Module) -> None:
        with stages("capture", f"the VAE decoder's {target.reference_dtype} reference"), tf32(False):
            capture.decode_pending(reference, decoder, vae)

    captured_vae = None
    if pending and target.dtype == target.reference_dtype:
        decode_reference(getattr(pipe, decoder.attribute))
    elif pending:
        captured_vae = copy.deepcopy(getattr(pipe, decoder.attribute))
    with stages("optimize", ", ".join(["dtype", *target.optimize])):
        modules, records = optimize_pipeline(pipe, specs, target)
    if records["changes_inputs"] or timed_later:  # the second: always the first too (a cast denoiser)
        with stages("capture", "example inputs of the optimized pipeline"):
            optimized, block_calls, timings = capture_all(
                pipe, spec, specs, target, {n: points[n] for n in examples}, device, stages.progress, instances,
                timed=timed if timed_later else None, timed_points=timed_points)
            seconds = timings if timed_later else seconds
            for name, record in block_calls.items():  # the optimized blocks' calls, by region
                optimized[name] |= {r.name: regions.region_call(r, record) for r in found}
        examples = {name: {c: capture.CapturedCall(*optimize.adapt_example_inputs(
                        target.optimize, (call.args, call.kwargs)), call.output) for c, call in
                        optimized[name].items()}
                    for name in examples}
        del optimized
    if eager_vae:
        eager_vae["share"] = eager_share(pipe, plans[denoiser.name], seconds, target.dtype)
    if captured_vae is not None:
        free_memory(device)  # the float32 denoiser's pages, before the decode's activations
        decode_reference(captured_vae)
        del captured_vae
    for s in specs:  # a denoiser takes every scheduler's timesteps: float ones, whatever the capture's were
        if s.per_step:
            for calls in examples.values():
                if s.name in calls:  # not at a VAE tile's point
                    calls[s.name] = capture.float_timestep(calls[s.name], modules[s.name])
    runtime = {"cuda_graphs": target.cuda_graphs, "scheduler": type(pipe.scheduler).__name__,
               # Not weights, but part of the recipe: where the scheduler keeps its sigmas (on CPU,
               # each step's sigma lookup costs no device sync; diffusers' Euler schedulers do this).
               "sigmas_device": str(getattr(getattr(pipe.scheduler, "sigmas", None), "device", "n/a")),
               "default_pixels": default_pixels(pipe, spec, target)}
    # Compile needs only the modules being compiled and the example inputs on the device; the loop
    # needs the pipeline's other components, later: they wait on the host.
    release_others(pipe, specs)
    for s in specs:
        setattr(pipe, s.attribute, None)
    if loop is None:
        del pipe
    free_memory(device)

    # The guidance each denoiser variant serves, where its batch says it (none: the same either way).
    modes = guidance_modes(target, spec) if spec.cfg_batch and batches_guidance(reference, specs) else ()
    ctx = BuildContext(target, out, stages, inductor_options, examples, reference, dims, modes)
    components = {}
    for s in specs:
        dtype = records["dtype"][s.name]
        components[s.name] = build_regional(ctx, s, modules[s.name], found, instances, plans[s.name], dtype) \
            if s is regional else build_component(ctx, s, modules[s.name], plans[s.name], dtype)
        free_memory(device)  # its exported programs and compiled graphs, before the next one's
    # validate binds the packaged weights: the eager copies and the example inputs go first
    del modules, examples, instances, ctx
    free_memory(device)
    if sources.is_random(target.source):
        shutil.copytree(sources.config_set_dir(target.source, target.base_dir), out / sources.SOURCE_DIRNAME)

    manifest = {
        "schema": REGIONAL_SCHEMA if regional or permuted_inputs(components) else SCHEMA_VERSION,
        "aotbuild": aotbuild_version(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "target": {**target.to_dict(), "source": source["id"]},
        "target_hash": target.content_hash(),
        "source": source,
        "environment": build_environment(target, inductor_options),
        "optimizations": {"dtype": records["dtype"], "passes": records["passes"], "inductor": inductor_options},
        "components": components,
        "pipeline": {"curated": True} if spec.curated else {"curated": False, "note": UNCURATED},
        **({"eager": {"vae": eager_vae}} if eager_vae else {}),
        "runtime": runtime,
        "files": {},
        "timings": {},
    }
    manifest["files"] = {
        str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(out.rglob("*")) if p.is_file()
    }
    for entry in components.values():  # just hashed: this machine's first load need not read them again
        mark_verified(out / entry["weights"], manifest["files"][entry["weights"]]["sha256"])
    with stages("validate", f"compiled vs eager {target.reference_dtype} on the captured inputs"):
        loaded = load_artifact(out, manifest, device)
        validate_artifact(out, manifest, loaded, reference, points, plans, allow_drift)
    if loop is not None:
        with stages("validate", f"a {loop.steps}-step denoising loop, compiled vs eager {target.reference_dtype}"):
            manifest["validation"] = {"loop": validate_loop(manifest, loaded, pipe, spec, loop, device, allow_drift,
                                                            target.base_dir)}
        del pipe
    del loaded
    manifest["timings"] = {k: round(v, 3) for k, v in stages.timings.items()}
    if stages.peak_rss_mib:
        manifest["peak_rss_mib"] = stages.peak_rss_mib
    if stages.cuda:
        manifest["peak_gpu_mib"] = stages.peak_gpu_mib
    write_manifest(out, manifest)
    return manifest
