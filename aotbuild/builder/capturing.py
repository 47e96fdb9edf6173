"""Capture: load the pipeline, run it at every capture point with its components' calls
recorded, apply the optimization passes."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import BuildError
from ..runtime import sources
from ..spec.manifest import DTYPES
from ..spec.pipelines import (
    COMPILED_VAES,
    SIZED_BY_IMAGE,
    UNGUIDED,
    ComponentSpec,
    PipelineSpec,
    inpaints_control_image,
    seeded_image,
)
from ..spec.private_apis import pytree
from . import capture, optimize, regions
from .context import Progress
from .plan import CapturePoint, VariantPlan
from .targets import Target


def free_memory(device: torch.device) -> None:
    """Hand freed tensors back: exported graphs hold their weights in reference cycles, which
    only the collector frees, and glibc keeps freed heap pages unless asked: a real-size build's
    validation loaded its weights on top of them (SDXL, 4.9 GiB of weights: 22.1 GiB at peak, 12.2
    with this)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def release_others(pipe: Any, specs: list[ComponentSpec]) -> None:
    """Move the pipeline's models that are not compiled (a VAE built without its decoder, a
    safety checker; the text encoders are already off) to the host."""
    compiled = {s.attribute for s in specs}
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name not in compiled:
            component.to("cpu")


def capture_all(pipe: Any, spec: PipelineSpec, specs: list, target: Target, points: dict[str, CapturePoint],
                 device: torch.device, progress: Progress, blocks: dict[str, torch.nn.Module] | None = None,
                 timed: dict[str, tuple[torch.nn.Module, str]] | None = None, timed_points: Sequence[str] = (),
                 loop: Loop | None = None,
                 ) -> tuple[dict[str, dict[str, capture.CapturedCall]], dict[str, regions.BlockCalls],
                            dict[str, dict[str, float]]]:
    """({point name: {component: CapturedCall}}, {point name: the `blocks`' calls}, {point name:
    seconds in each of the `timed` methods (at `timed_points`) and the run's steps}, for the point
    that ran the pipeline): one pipeline call per distinct point for the components the pipeline
    calls (`capture.capture_inputs`: it decodes only where it times the decode, and leaves a VAE
    decoder's outputs to `capture.decode_pending`); random
    inputs for the others (the encoder) and for tiles. At `loop`'s point, also a short denoising loop, whose
    call and final latents it keeps (`Loop`: the build runs the same loop compiled).

    One group of models is on the device at a time: the text encoders encode the prompt for each
    batch size and leave, then the denoiser and VAE run the pipeline from those embeddings. The
    peak is the larger group, not the whole pipeline (full-size Flux in float32: T5-XXL 19 GB,
    the transformer 48 GB)."""
    recorded = [s for s in specs if s.recorded]
    runs = {p.run for p in points.values() if p.alone is None}
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
    per_step: dict[tuple, dict[str, tuple[float, bool]]] = {}  # by run: calls a step, the first two alike
    seconds: dict[str, dict[str, float]] = {}
    calls: dict[str, dict[str, capture.CapturedCall]] = {}
    block_calls: dict[str, regions.BlockCalls] = {}
    for name, point in points.items():
        key = point.run
        calls[name] = {}
        if point.alone is None and recorded:  # capture_inputs records these only
            shape = {"batch": point.batch, "height": point.height, "width": point.width,
                     "guidance_scale": target.guidance_scale if point.guided else UNGUIDED, "text": point.text,
                     "prompt_embeds": embeds.get((point.batch, point.guided, point.text)),
                     "extras": call_extras(pipe, spec, target, point.batch, point.height, point.width,
                                           point.images),
                     "image": point.image, "frames": point.frames}
            twin = dataclasses.replace(point, guided=True).run
            if key not in runs_done and not point.guided and _guidance_kept_batch(
                    runs_done.get(twin), per_step.get(twin, {}), specs, point.batch):
                # Its guided twin called the denoiser twice a step at the images' batch, two calls alike
                # (Wan, Chroma): this run's calls are those. Not run again: a float32 step of a
                # real-size video model is minutes.
                progress("capture", f"at {point}: the guided run's calls (guidance did not double the batch)")
                runs_done[key], block_runs[key] = runs_done[twin], block_runs[twin]
            if key not in runs_done:
                progress("capture", f"at {point} (batch x height x width)")
                with regions.recording(blocks or {}) as block_runs[key]:
                    runs_done[key] = capture.capture_inputs(
                        pipe, recorded, **shape, timed_methods=timed if name in timed_points else None,
                        timings=seconds.setdefault(name, {}), per_step=per_step.setdefault(key, {}))
            if loop is not None and name == loop.point:
                loop.steps = max(loop.steps, seconds.get(name, {}).get("steps", 1))  # every model called
                progress("capture", f"a {loop.steps}-step denoising loop at {point}")
                loop.arguments = capture.detached(capture.call_arguments(pipe, **shape))
                loop.latents = loop.run(pipe)
            calls[name].update(runs_done[key])
            if blocks:
                block_calls[name] = block_runs[key]
        for s in specs:
            if (not s.recorded and point.alone is None) or point.alone == s.name:
                calls[name][s.name] = capture.random_call(pipe, s, point.batch, *point.encoded, device)
    return calls, block_calls, seconds


def _guidance_kept_batch(calls: dict[str, capture.CapturedCall] | None, per_step: dict[str, tuple[float, bool]],
                         specs: list, images: int) -> bool:
    """Whether a guided run called each denoiser twice a step (or more) at the images' batch, its
    first two calls alike in structure and shapes: the guidance of two calls, either of which
    has the unguided run's shapes (not Z-Image's, which doubles its list of images in one call, nor
    a negative prompt of another text length than the prompt's)."""
    denoisers = [s.name for s in specs if s.denoiser and calls and s.name in calls]
    for name in denoisers:
        calls_per_step, alike = per_step.get(name, (0, False))
        if capture.call_batch(calls[name]) != images or calls_per_step < 2 or not alike:
            return False
    return bool(denoisers)


def call_extras(pipe: Any, spec: PipelineSpec, target: Target, batch: int, height: int, width: int,
                images: Sequence[tuple[int, int]] | None = None) -> dict[str, Any] | None:
    """The arguments a capture's call takes besides the prompt and size (`PipelineSpec.call_extras`),
    those its components' configs ask for (`ComponentSpec.capture_arguments`), the image prompt
    of a target built with an IP-Adapter, and the target's own `call`."""
    extras = spec.call_extras(batch, height, width, images)
    for component in spec.components.values():
        config = getattr(getattr(pipe, component.attribute, None), "config", None)
        if component.capture_arguments is not None and config is not None:
            extras = {**(extras or {}), **component.capture_arguments(config)}
    if target.ip_adapter:
        extras = {**(extras or {}), "ip_adapter_image": seeded_image(height, width)}
    if target.call:
        extras = {**(extras or {}), **target.call}
    return extras


@dataclass
class Loop:
    """A short denoising loop the build runs eager at capture, in the reference's dtype (at `point`,
    for `steps` steps: the target's `validation_steps`, or as many as the capture needed for every
    model to be called) and again compiled: the pipeline call it made (`arguments`) and its final latents
    (`latents`). A single call within tolerance can still drift over steps: the loop shows it."""

    point: str
    steps: int
    arguments: dict[str, Any] | None = None
    latents: Any = None
    output_type: str = "latent"  # "np" for a pipeline that gives no latents: its final images

    def run(self, pipe: Any) -> Any:
        """The loop's final latents (on the host) from this pipeline: eager, or compiled."""
        if self.latents is None:  # eager: images where the pipeline cannot return its latents
            made, self.output_type = capture.run_pipeline_to(pipe, self.arguments, self.steps, self.output_type)
        else:  # compiled: as eager ran
            made = capture.run_pipeline(pipe, self.arguments, self.steps, self.output_type)
        return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True),
                                    made if self.output_type == "latent" else torch.as_tensor(made))


def eager_vae_record(pipe: Any, spec: PipelineSpec, specs: list[ComponentSpec]) -> dict[str, Any] | None:
    """Why the pipeline's VAE decodes eager where no part of it is compiled, and the methods whose
    time a capture measures for `eager_share` (None: a VAE part is compiled, or no VAE)."""
    vae = getattr(pipe, "vae", None)
    if vae is None or not any(s.denoiser for s in specs) or any(s.attribute == "vae" for s in specs):
        return None
    if "vae_decoder" in spec.components:
        reason = "the target's [components] lists no vae_decoder"
    else:
        reason = (f"{type(vae).__name__} is not one of the VAEs whose decoder and encoder aotbuild compiles "
                  f"({', '.join(COMPILED_VAES)})")
    denoisers = {s.name: (getattr(pipe, s.attribute), s.method) for s in specs if s.per_step}  # Wan 2.2: two
    return {"class": type(vae).__name__, "reason": reason, "timed": {"decode": (vae, "decode"), **denoisers}}


def eager_share(pipe: Any, plans: list[VariantPlan], seconds: dict[str, dict[str, float]],
                dtype: str) -> dict[str, Any]:
    """The eager VAE's share of a generation at each of the denoiser's buckets (`plans`), from a
    capture in the target's `dtype` (eager on the build machine, one step unless a model is called
    later): decode / (decode + the denoisers' seconds per step x the pipeline's default number of steps)."""
    parameter = inspect.signature(type(pipe).__call__).parameters.get("num_inference_steps")
    steps = parameter.default if parameter is not None and isinstance(parameter.default, int) else 50
    shares = {}
    for plan in plans:
        measured = dict(seconds.get(plan.points[0]) or {})
        decode, runs = measured.pop("decode", 0.0), measured.pop("steps", 0)
        step = sum(measured.values()) / runs if runs else 0.0  # every denoiser call of a step
        if plan.kind == "bucket" and step > 0:
            shares[plan.name] = {"decode_s": round(decode, 6), "denoiser_step_s": round(step, 6), "steps": steps,
                                 "share": round(decode / (decode + steps * step), 4), "dtype": dtype}
    return shares


def load_source_pipeline(target: Target, spec: PipelineSpec, device: torch.device, folder: Path | None = None,
                         dtype: torch.dtype = torch.float32) -> Any:
    """The target's pipeline in `dtype` on `device`, from `folder` (its source, already resolved).
    Each model is cast as it is read: in bfloat16, no float32 copy of the pipeline is ever held whole."""
    if folder is None:
        folder = sources.resolve_folder(target.source, target.revision, target.base_dir, skip=set(),
                                        dtype=target.dtype)
    seed = target.seed if sources.is_random(target.source) else None
    half = target.dtype in sources.HALF_DTYPES
    components = sources.load_components(folder, seed=seed, skip={"controlnet"} if target.controlnet else set(),
                                         dtype=dtype, half_files=half)
    if target.controlnet:  # a ControlNet of its own repo, beside a base checkpoint
        components["controlnet"] = sources.load_model(target.controlnet, target.base_dir, dtype, half)
    if "controlnet" in components:
        _check_controlnet_form(components["controlnet"], spec.class_name)
    pipe = sources.assemble_pipeline(spec, folder, components)
    for name in target.components:  # Wan 2.1 in a Wan 2.2 pipeline: no second expert to compile
        attribute = spec.component(name).attribute
        if getattr(pipe, attribute, None) is None:
            raise BuildError(f"components.{name}: {target.source} has no {attribute} (its model_index.json holds "
                             f"none)", hint=f"remove {name} from the target's [components]")
    if target.ip_adapter:  # its UNet is compiled with the adapter's layers, and takes any of its form
        sources.load_ip_adapter(pipe, target.ip_adapter, target.base_dir, target.seed, target.image_encoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _check_controlnet_form(controlnet: Any, pipeline: str) -> None:
    """Refuse, before capturing, a ControlNet of a form aotbuild does not compile yet, or one the
    pipeline cannot call (an SD3 ControlNet taking a mask, or none, in the other SD3 pipeline)."""
    import diffusers

    config = dict(controlnet.config)
    extra = config.get("extra_conditioning_channels") or 0
    sd3 = type(controlnet).__name__ == "SD3ControlNetModel"
    masked = sd3 and inpaints_control_image(getattr(diffusers, pipeline))
    if sd3 and extra != int(masked):  # an inpainting pipeline gives one channel beside the image: the mask
        if not masked:
            raise BuildError(f"the ControlNet inpaints: it takes a mask beside the image (extra_conditioning_channels "
                             f"= {extra}), which {pipeline} does not give it",
                             hint="build it as a StableDiffusion3ControlNetInpaintingPipeline target")
        raise BuildError(f"the ControlNet takes {extra} channels beside the image (extra_conditioning_channels = "
                         f"{extra}), and {pipeline} gives its ControlNet the masked image with one: the mask",
                         hint="build it as a StableDiffusion3ControlNetPipeline target, or with an inpainting "
                              "ControlNet (Alimama's, extra_conditioning_channels = 1)")
    if masked and config.get("use_pos_embed") is False:
        raise BuildError(f"the ControlNet takes the transformer's position embedding (use_pos_embed = false), which "
                         f"{pipeline} does not hand it (eager fails too)",
                         hint="build it as a StableDiffusion3ControlNetPipeline target")
    if getattr(controlnet, "input_hint_block", None) is not None:
        raise BuildError("the ControlNet takes the control image's pixels through an input_hint_block (XLabs' Flux "
                         "ControlNets), a module the compiled pipeline's stand-in does not keep: not compiled by "
                         "aotbuild yet", hint="build a ControlNet that takes the control image's latents (InstantX's, "
                                              "Shakker-Labs' Flux ControlNets)")


def default_pixels(pipe: Any, spec: PipelineSpec, target: Target) -> dict[str, int | None]:
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
    optimize.check_passes(unique, target.optimize)  # the build checked before capturing; eager runs check here
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module) and id(component) not in first \
                and getattr(component, "dtype", None) != DTYPES[target.dtype]:  # a cast that is no cast warns
            component.to(DTYPES[target.dtype])
    force_upcast = {name: bool(getattr(m.config, "force_upcast", False)) for name, m in unique.items()}
    read = {name: m.dtype for name, m in unique.items()}  # float32, or a reference in the target's dtype
    dtypes = optimize.apply_dtype(unique, target.dtype, force_upcast)
    dtypes = {name: dtypes[first[id(module)]] for name, module in modules.items()}
    passes = optimize.apply_passes(unique, target.optimize, target.device)
    changes_inputs = any(m.dtype != read[name] for name, m in unique.items()) or bool(target.optimize)
    return modules, {"dtype": dtypes, "passes": passes, "changes_inputs": changes_inputs}
