"""The plan: where the pipeline is captured (capture points) and which compiled models each
component gets (a bucket's, the dynamic model's, a tile model's), from the target's shapes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import BuildError
from ..spec import shapes
from ..spec.pipelines import (
    FRAMEWISE_VAES,
    TEXT,
    ComponentSpec,
    PipelineSpec,
    default_text_length,
    frames_around,
    frames_step,
    resized_image,
    vae_factor,
)
from .targets import ShapeBucket, Target, images_text


def variant_name(bucket: ShapeBucket) -> str:
    text = f"_text{bucket.max_sequence_length}" if bucket.max_sequence_length else ""
    edit = f"_image{bucket.image[0]}x{bucket.image[1]}" if bucket.image else ""
    edit += f"_images{images_text(bucket.images)}" if bucket.images else ""
    frames = f"_{bucket.frames}f" if bucket.frames else ""
    return f"b{bucket.batch}_{bucket.height}x{bucket.width}{frames}{text}{edit}"


@dataclass(frozen=True)
class CapturePoint:
    """Where a capture runs the pipeline: images per prompt, pixel size, with guidance or without.
    A point of one component `alone` is one random call of it instead, at this size: a VAE part's
    tile, or the VAE encoder at a batch no pipeline run shows it (`role` says which)."""

    batch: int
    height: int
    width: int
    guided: bool = True
    alone: str | None = None
    role: str = "tile"
    text: int | None = None  # the call's max_sequence_length (None: the pipeline takes none)
    image: tuple[int, int] | None = None  # the size of the image an editing call takes
    frames: int | None = None  # a video's frame count (None: an image pipeline)
    resized: tuple[int, int] | None = None  # the size a SIZED_BY_IMAGE pipeline encodes its image at
    images: tuple[tuple[int, int], ...] | None = None  # the images an EDITS_SEVERAL call edits together

    def __str__(self) -> str:
        size = f"{self.batch}x{self.height}x{self.width}"
        if self.alone:
            return f"{self.alone} {self.role} {size}"
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


def guidance_modes(target: Target, spec: PipelineSpec) -> tuple[bool, ...]:
    """The guidance of the captures, the first one's being the export point's (guided: the larger
    denoiser batch). A pipeline whose denoiser batch ignores guidance is captured as configured."""
    if not spec.cfg_batch:
        return (True,)
    return {"both": (True, False), "guided": (True,), "unguided": (False,)}[target.guidance]


def plan_target(target: Target, spec: PipelineSpec, specs: list[ComponentSpec], vae: Any,
          frame_stride: int) -> tuple[dict[str, CapturePoint], dict[str, list[VariantPlan]]]:
    """Every capture point by name, and every component's variants.

    A bucket serves 1 to its batch of images: its model's batch dim spans the calls captured with
    1 image and with the bucket's batch, and for a denoiser, with and without guidance (the calls
    only differ in batch, so one model serves them all). The dynamic model spans its ranges and,
    for a denoiser, both guidance batches. A tile model spans every tile `vae.enable_tiling()` cuts
    from images of the target's stride. A video's frames step by `frame_stride`."""
    modes = guidance_modes(target, spec)
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
            served = [p for p in ran if s.per_step or points[p].guided == modes[0]]
            if s.part == "encoder" and (bucket.image or encoding):  # the edited images' sizes
                _plan_encoded(plans[s.name], points, encoding or served, bucket.frames)
                continue
            # The text does not reach the VAE decoder: it decodes the output.
            untexted = dataclasses.replace(bucket, max_sequence_length=None, image=None, images=None)
            if s.per_step:
                plans[s.name].append(VariantPlan(name, "bucket", tuple(served), bucket=bucket))
            elif all(plan.bucket != untexted for plan in plans[s.name]):
                named = variant_name(untexted) if bucket.image or points[name].resized else name
                control = _guided_control(spec, s, points, name, modes)  # the export point, if any
                plans[s.name].append(VariantPlan(named, "bucket", (*control, *served), bucket=untexted))
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
            served = ("dynamic:base", "dynamic:min", "dynamic:max", *(unguided if both and s.per_step else ()))
            reached = ranges if s.per_step else {a: r for a, r in ranges.items() if a != TEXT}
            if s.part == "encoder" and encoding:  # the edited images' sizes, whatever the output's
                _plan_encoded(plans[s.name], points, encoding, points["dynamic:base"].frames)
                continue
            if not s.per_step and _within_a_bucket(s, [points[p] for p in served], plans[s.name]):
                continue  # a range of text lengths alone: the VAE sees one size
            # Twice the largest batch; a fixed batch's twice is its batch probe (as guidance's is a denoiser's).
            fixed = ranges["batch"][0] == ranges["batch"][1]
            served = (*served, *_guided_control(spec, s, points, "dynamic:base" if fixed else "dynamic:max", modes))
            video = {"frame_stride": frame_stride} if shapes.FRAME_AXIS in ranges else {}
            plans[s.name].append(VariantPlan("dynamic", "dynamic", served,
                                             ranges={**reached, "stride": target.stride, **video},
                                             images=target.dynamic_images if s.per_step else None))
    largest = max([b.batch for b in target.shapes] + ([target.dynamic["batch"][1]] if target.dynamic else []))
    for s in specs:
        if s.name in target.tiling:
            ranges = _tile_ranges(s, vae, target.stride, largest * _encoded_per_image(spec, s, modes))
            for probe, size in shapes.range_points(ranges, ranges["stride"]).items():
                points[f"tile:{s.name}:{probe}"] = CapturePoint(*size, alone=s.name)
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


def _encoded_per_image(spec: PipelineSpec, component: ComponentSpec, modes: tuple[bool, ...]) -> int:
    """Images a VAE part sees per image of the call: 2 for the VAE encoder of a pipeline that
    encodes its control image once per guidance half (`PipelineSpec.encodes_guided_control`: SD3's
    ControlNet pipeline) when it is captured with guidance, else 1."""
    return 2 if component.part == "encoder" and spec.encodes_guided_control and modes[0] else 1


def _guided_control(spec: PipelineSpec, component: ComponentSpec, points: dict[str, CapturePoint], name: str,
                    modes: tuple[bool, ...]) -> list[str]:
    """The VAE encoder's point at `_encoded_per_image` times `name`'s images, where that is more
    than 1, so that its model spans the control image's encoding as well as an image-to-image call's
    (`<name>:control`)."""
    per_image = _encoded_per_image(spec, component, modes)
    if per_image == 1:
        return []
    points[f"{name}:control"] = dataclasses.replace(points[name], batch=per_image * points[name].batch,
                                                    alone=component.name, role="control image per guidance half")
    return [f"{name}:control"]


def _plan_encoded(plans: list[VariantPlan], points: dict[str, CapturePoint], served: list[str],
                  frames: int | None) -> None:
    """The VAE encoder of an editing pipeline: a bucket at each size it sees an edited image at
    (Flux Kontext's as given, Qwen-Image-Edit's resized by the pipeline), served by the points
    that encode one at that size (the largest call first: the one it is exported at), unless a
    bucket of that size and batch is planned."""
    for size in dict.fromkeys(points[p].encoded for p in served):
        at = tuple(sorted((p for p in served if points[p].encoded == size), key=lambda p: -points[p].batch))
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


def check_frames(target: Target, pipe: Any) -> None:
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
