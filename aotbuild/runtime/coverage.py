"""What a compiled variant serves, in a pipeline call's terms (pixels, images, frames, text
length, guidance), from its manifest entry alone: no torch, so that `aotbuild inspect` and the
server's checks answer without loading anything."""

from __future__ import annotations

from typing import Any

from ..spec.pipelines import TEXT, frames_around


def _images(low: int, high: int, what: str = "image") -> str:
    return f"{low} {what}{'s' * (high > 1)}" if low == high else f"{low}-{high} {what}s"


def variant_coverage(entry: dict[str, Any]) -> str:
    """What a variant serves, in the pipeline call's terms: "64x96 px, 1-2 images, with and
    without guidance" for a bucket, ranges for the dynamic model, tile sizes for a tile model."""
    guidance = entry.get("guidance")
    suffix = "" if guidance is None else ", " + {("guided",): "with guidance only",
                                                  ("unguided",): "without guidance only"}.get(
        tuple(guidance), "with and without guidance")
    if entry.get("tile"):
        d = entry["dynamic"]
        return (f"tiles up to {d['height'][1]}x{d['width'][1]} px (multiples of {d['stride']} px), "
                f"{_images(*d['batch'])}")
    lengths = text_lengths(entry)
    text = "" if lengths is None else f", text length {span(lengths)}"
    if "dynamic" in entry:
        d = entry["dynamic"]
        fixed = d["height"][0] == d["height"][1] and d["width"][0] == d["width"][1]
        multiples = "" if fixed else f" (multiples of {d['stride']})"
        size = f"{span(d['height'])}x{span(d['width'])} px{multiples}"
        if "frames" in d:  # "5-13 frames (1 + multiples of 4) at 32-64x32-64 px (multiples of 16), 1 video"
            step = f" (1 + multiples of {d['frame_stride']})" if d["frames"][0] != d["frames"][1] else ""
            return f"{span(d['frames'])} frames{step} at {size}, {_images(*d['batch'], 'video')}{text}{suffix}"
        return f"{size}{_edited(d)}, {_images(*d['batch'])}{text}{suffix}"
    b = entry["bucket"]
    edit = f" editing a {b['image'][0]}x{b['image'][1]} px image" if "image" in b else _edited(b)
    if "frames" in b:  # a video: "81 frames at 480x832 px, 1 video"
        return f"{b['frames']} frames at {b['height']}x{b['width']} px, {_images(1, b['batch'], 'video')}{text}{suffix}"
    return f"{b['height']}x{b['width']} px{edit}, {_images(1, b['batch'])}{text}{suffix}"


def _edited(covered: dict[str, Any]) -> str:
    """The images a variant's calls edit, where its target named them (`images`): " editing a
    64x128 px image", " editing 64x64 + 64x128 px images together"."""
    sizes = [f"{height}x{width}" for height, width in covered.get("images", ())]
    if len(sizes) < 2:
        return "".join(f" editing a {size} px image" for size in sizes)
    return f" editing {' + '.join(sizes)} px images together"


def span(low_high: tuple[int, int]) -> str:
    """512, or 128-512."""
    low, high = low_high
    return str(low) if low == high else f"{low}-{high}"


def text_lengths(entry: dict[str, Any]) -> tuple[int, int] | None:
    """The text lengths (`max_sequence_length`) a variant was compiled for, as (min, max); None
    when its pipeline takes none, or for an artifact built before text length was a shape."""
    if "dynamic" in entry:
        lengths = entry["dynamic"].get(TEXT)
        return (lengths[0], lengths[1]) if lengths else None
    length = entry.get("bucket", {}).get(TEXT)
    return (length, length) if length else None


def uncovered(entry: dict[str, Any], images: int, height: int, width: int, guided: bool | None,
              text: int | None = None, frames: int | None = None) -> list[str]:
    """What of a pipeline call a denoiser variant does not serve, in the call's terms: "guidance"
    (`guided`: whether the call guides; None, not known), "text" (`text`: its text length; None,
    the pipeline's default, or it takes none), "images" (`images` per call), "size" (height x
    width pixels), "frames" (a video's), "edit" (a bucket compiled editing an image serves no
    text-to-image call: the edited image's tokens are part of its sequence), "tile" (a tile model
    serves tiles only). Empty: it serves the call, as `variant_coverage` says."""
    if entry.get("tile"):
        return ["tile"]
    missing = []
    guidance = entry.get("guidance")
    if guided is not None and guidance is not None and ("guided" if guided else "unguided") not in guidance:
        missing.append("guidance")
    lengths = text_lengths(entry)
    if text is not None and lengths is not None and not lengths[0] <= text <= lengths[1]:
        missing.append("text")
    if "dynamic" in entry:
        d = entry["dynamic"]
        if "frames" in d and not (frames is not None and d["frames"][0] <= frames <= d["frames"][1]
                                  and frames_around(frames, d["frame_stride"]) is None):
            missing.append("frames")
        if not d["batch"][0] <= images <= d["batch"][1]:
            missing.append("images")
        if not all(d[axis][0] <= size <= d[axis][1] and size % d["stride"] == 0
                   for axis, size in (("height", height), ("width", width))):
            missing.append("size")
        return missing
    b = entry["bucket"]
    if (b["height"], b["width"]) != (height, width):
        missing.append("size")
    if b.get("frames") != frames:
        missing.append("frames")
    if not 1 <= images <= b["batch"]:
        missing.append("images")
    if "image" in b:
        missing.append("edit")
    return missing


def variant_covers(entry: dict[str, Any], images: int, height: int, width: int, guided: bool | None,
                   text: int | None = None, frames: int | None = None) -> bool:
    """Whether a denoiser variant serves a text-to-image (or text-to-video, of `frames` frames)
    pipeline call: nothing `uncovered`."""
    return not uncovered(entry, images, height, width, guided, text, frames)
