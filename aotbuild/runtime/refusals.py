"""Why a compiled model does not take a call, said in the caller's terms: what each variant
covers (`coverage`), the pipeline call that asked (read from its frame), the inputs a diffusers
feature adds, and the sizes and branches export fixed. The stand-ins
(`component`, `regional`) and the server (`covered`) ask here; nothing here runs a model."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..spec.pipelines import EDITS_SEVERAL, FRAMES, SIZED_BY_IMAGE, TEXT
from ..spec.private_apis import pytree, running_pipeline_call
from ..spec.shapes import polynomial
from .coverage import span, text_lengths, uncovered, variant_coverage
from .variant import CompiledVariant, leaf_name

# Inputs a diffusers feature adds to a call, named as the user asks for that feature.
FEATURE_INPUTS = {
    "skip_layers": "SD3 skip-layer guidance (skip_guidance_layers=...)",
    "down_block_additional_residuals": "a ControlNet",
    "mid_block_additional_residual": "a ControlNet",
    "block_controlnet_hidden_states": "a ControlNet",
    "controlnet_block_samples": "a ControlNet",
    "controlnet_single_block_samples": "a ControlNet",
    "added_cond_kwargs.image_embeds": "an IP-Adapter",
    "cross_attention_kwargs.ip_adapter_masks": "IP-Adapter masks",
    "timestep_cond": "a guidance embedding (time_cond_proj_dim)",
}

COVER_HINT = ("cover this call in the target (a [[shapes]] bucket, or a wider [dynamic] range) and rebuild: aotbuild "
              "build --target NAME --force; or load with eager_fallback=True to run such calls eager")

# The denoiser's constant inputs a pipeline call's argument sets, to name that argument in refusals.
CALL_SETS = {"rope_interpolation_scale": "frame_rate"}  # LTX-Video: VAE temporal compression / frame_rate


# Inputs that are sizes as Python values, constants of the compiled model: Qwen-Image's
# transformer takes each image's (frames, height, width) in latent patches as a list.
SIZE_CONSTANTS = {"img_shapes": "(each image's frames, height and width in latent patches: the output's, then each "
                                 "edited image's)"}


def _sizes_not_compiled(component: str, head: str, given: dict[str, Any], expected: dict[str, dict],
                        variants: list[CompiledVariant]) -> str:
    """A size input the compiled code holds as constants, in the call's terms: the sizes asked for
    and compiled, per image of the first prompt."""

    def per_image(values: dict[str, Any]) -> str:
        images: dict[str, list[str]] = {}
        for path, value in values.items():
            parts = path.split(".")
            if parts[0] == head and len(parts) == 4 and parts[1] == "0":
                images.setdefault(parts[2], []).append(str(value))
        return ", ".join(f"({', '.join(v)})" for v in images.values())

    call = pipeline_call()
    asked = "" if call is None else f" ({_call_text(call, ('height', 'width'))})"
    covered = "; ".join(variant_coverage(v.entry) for v in variants)
    return (f"{component}: this call's image sizes are not compiled: {head} {SIZE_CONSTANTS[head]} is "
            f"{per_image({p: x for p, x in given.items()})} in this call{asked}, compiled "
            f"{per_image({p: e.get('value') for p, e in expected.items()})}: sizes the compiled model holds as "
            f"constants{_resized_by_pipeline(call)}; this artifact covers: {covered}")


def _resized_by_pipeline(call: tuple[str, dict[str, Any]] | None) -> str:
    """Why a SIZED_BY_IMAGE pipeline's edit is of sizes the call did not give ("" for another)."""
    if call is None or call[0] not in SIZED_BY_IMAGE:
        return ""
    side = math.isqrt(SIZED_BY_IMAGE[call[0]])
    if call[0] in EDITS_SEVERAL:
        return (f"; {call[0]} resizes each image to edit to ~{side}x{side} px at its own aspect ratio, and an "
                f"artifact edits the images its target names (a bucket's or [dynamic]'s `images`; by default one "
                f"image of the bucket's height x width), in their order")
    return (f"; {call[0]} resizes the image to edit to ~{side}x{side} px at its own aspect ratio, and an artifact "
            f"edits one image per call, of its buckets' aspect ratios (a bucket's height x width is captured "
            f"editing an image of that size)")


@dataclass(frozen=True)
class Refusal:
    """Why no variant takes a call, in the caller's terms; `coverable`: the call asks for sizes,
    images, frames or a text length a target can cover (a bucket, a wider range), rather than an
    input or a value the compiled code has no place for."""

    message: str
    coverable: bool


def unsupported_call(component: str, variants: list[CompiledVariant], args: tuple, kwargs: dict,
                     denoiser: bool = False) -> Refusal:
    """Why no variant takes this call, in the user's terms. A denoiser called by a pipeline is
    first held to what the pipeline call asks (images, pixels, frames, guidance, text length:
    `beyond_coverage`); then an input the compiled code was not traced with is named, with the
    diffusers feature that adds it, or a size or branch outside what the variants cover."""
    call = pipeline_call()
    if denoiser and call is not None and (beyond := beyond_coverage(component, variants, call, args, kwargs)):
        return beyond
    # The variant whose inputs have this call's structure (variants may edit different numbers of
    # images), else the first: what the call is compared with, input by input.
    reference = next((v for v in variants if v.flatten(args, kwargs) is not None), variants[0])
    expected = {leaf["path"]: leaf for leaf in reference.inputs}
    given = {leaf_name(p): x for p, x in pytree.tree_flatten_with_path((args, kwargs))[0]}
    # The traced call's arguments, empty ones included (Flux's joint_attention_kwargs={} has no leaf).
    heads = {path.split(".")[0] for path in expected} | set(reference.in_spec.child(1).context)
    for path, value in given.items():
        spec = expected.get(path)
        if spec is None:
            head = path.split(".")[0]
            if head in SIZE_CONSTANTS and value is not None:  # more images than compiled (Qwen-Image-Edit-2509's)
                return Refusal(_sizes_not_compiled(component, head, given, expected, variants), True)
            if head not in heads:  # a whole argument the traced call did not have (a list: its first item)
                return Refusal(f"{head!r} is not an input of the compiled {component}{_feature(head)}", False)
            if value is not None:
                return Refusal(_samples_differ(component, head, given, expected) or
                               f"{_input_name(path)} is not an input of the compiled {component}{_feature(path)}",
                               False)
            continue
        shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
        traced = spec.get("value", "a tensor")
        if shown != traced and not (shown == "a tensor" and "value" not in spec):
            if path.split(".")[0] in SIZE_CONSTANTS:
                return Refusal(_sizes_not_compiled(component, path.split(".")[0], given, expected, variants), True)
            argument = CALL_SETS.get(path.split(".")[0])
            if argument and call is not None and call[1].get(argument) is not None:
                return Refusal(f"{component}: {call[0]}'s {argument}={call[1][argument]!r} sets {_input_name(path)} "
                               f"to {shown}, compiled at {traced}; this artifact serves the {argument} it was built "
                               f"at (the call's default)", False)
            return Refusal(f"{_input_name(path)} is {shown} in this call and {traced} in the compiled "
                           f"{component}{_feature(path)}", False)
    missing = [p for p, spec in expected.items() if p not in given and spec.get("value") not in ("None", "{}")]
    if missing and missing[0].split(".")[0] in SIZE_CONSTANTS:  # fewer images than compiled
        return Refusal(_sizes_not_compiled(component, missing[0].split(".")[0], given, expected, variants), True)
    if missing:
        return Refusal(_samples_differ(component, missing[0].split(".")[0], given, expected) or
                       f"the compiled {component} takes {_input_name(missing[0])}, which this call does not pass",
                       False)
    shapes = ", ".join(f"{path} {list(x.shape)}" for path, x in given.items() if isinstance(x, torch.Tensor))
    covered = "; ".join(variant_coverage(v.entry) for v in variants)
    asked = "" if call is None else f" ({_call_text(call)})"
    if assumed := _assumption_broken(variants, args, kwargs):
        return Refusal(f"{component}: this call's sizes{asked} are in the range compiled, but break what the compiled "
                       f"code assumes of them: {assumed} (a branch the model's code took at the sizes it was exported "
                       f"at); this artifact covers: {covered}, less such sizes; cover them with a [[shapes]] bucket "
                       f"and rebuild", True)
    if call is not None and (refusal := _text_refusal(component, variants, _text_length(variants, args, kwargs),
                                                      call[1].get(TEXT))):
        return refusal  # an edit's (whose sizes are checked above), or a call whose sizes the variants cover
    edit = ""
    sequences = any(isinstance(d, dict) and d["axis"] == "tokens" for v in variants for leaf in v.inputs
                    for d in leaf.get("dims", ()))
    if sequences and call is not None and call[1].get("image_height") is not None:
        edit = (f" (an edited image of {call[1]['image_height']}x{call[1]['image_width']} px adds its tokens to the "
                f"output's: a dynamic model serves edits whose tokens together fit its range)")
    if component == "vae_encoder":  # Qwen-Image-Edit's encoder sees the image at the size it was resized to
        edit = _resized_by_pipeline(call)
    return Refusal(f"{component}: no compiled variant for this call{asked}: {shapes}; this artifact covers: "
                   f"{covered}{edit}", True)


def beyond_coverage(component: str, variants: list[CompiledVariant], call: tuple[str, dict[str, Any]],
                    args: tuple, kwargs: dict) -> Refusal | None:
    """The refusal of a denoiser's call when the pipeline call asks for what no variant covers
    (`uncovered`), named in its terms: images, pixels, frames, guidance, text length; None when
    some variant covers it (what then differs is the call's inputs themselves)."""
    name, values = call
    height, width, frames = values.get("height"), values.get("width"), values.get(FRAMES)
    if not isinstance(height, int) or not isinstance(width, int) or _edits(name, values, variants):
        return None
    text = _asked_text_length(variants, args, kwargs, values.get(TEXT))
    per_prompt = values.get("num_images_per_prompt") or values.get("num_videos_per_prompt") or 1
    prompts = values.get("batch_size") if isinstance(values.get("batch_size"), int) else 1
    images, guided = prompts * per_prompt, values.get("_guided")
    missing = [uncovered(v.entry, images, height, width, guided, text, frames) for v in variants]
    if not all(missing):
        return None
    blamed = [m for m in missing[0] if all(m in other for other in missing)]
    if blamed == ["text"]:
        return _text_refusal(component, variants, text, values.get(TEXT))
    covered = "; ".join(variant_coverage(v.entry) for v in variants)
    if blamed == ["guidance"]:
        wanted = "guided" if guided else "unguided"
        return Refusal(f"{component}: guidance_scale={values.get('guidance_scale'):g} needs the {wanted} variants, "
                       f"which this artifact was built without (rebuild it with guidance = \"both\" in the target); "
                       f"it covers: {covered}", False)
    made = "video" if frames is not None else "image"
    asked = (f"{images} {made}{'s' * (images > 1)}" + (f" of {frames} frames" if frames is not None else "")
             + f" at {height}x{width} px")
    if guided is not None and any(v.entry.get("guidance") is not None for v in variants):
        asked += " with guidance" if guided else " without guidance"
    if text is not None and any(text_lengths(v.entry) for v in variants):
        asked += f", text length {text}"
    phrases = {"images": f"{images} {made}s per call" if images > 1 else f"1 {made} per call",
               "size": f"{height}x{width} px", "frames": f"{frames} frames", "text": f"text length {text}",
               "guidance": "with guidance" if guided else "without guidance", "edit": "without an image to edit"}
    named = [phrases[m] for m in blamed if m in phrases]
    return Refusal(f"{component}: no compiled variant for this call ({_call_text(call)}): {asked}"
                   + (f"; none compiled for {' and '.join(named)}" if named else "")
                   + f"; this artifact covers: {covered}", True)


def _text_refusal(component: str, variants: list[CompiledVariant], text: int | None, cap: Any) -> Refusal | None:
    """The refusal of a text length no variant compiles (`cap`: the call's max_sequence_length,
    where the denoiser is given the prompt's real tokens instead); None when one does."""
    lengths = [text_lengths(v.entry) for v in variants]
    if text is None or not all(r is not None and not r[0] <= text <= r[1] for r in lengths):
        return None
    said = f"{TEXT}={cap}" if cap in (None, text) else f"the prompt's tokens; {TEXT}={cap}"
    return Refusal(f"{component}: text length {text} ({said}) in this call; compiled: "
                   f"{', '.join(sorted({span(r) for r in lengths}))}; this artifact covers: "
                   f"{'; '.join(variant_coverage(v.entry) for v in variants)}", True)


def _edits(name: str, values: dict[str, Any], variants: list[CompiledVariant]) -> bool:
    """Whether the call or the artifact edits images (Flux Kontext's edited image, Qwen-Image-Edit's,
    a target's `image` or `images`): their tokens join the sequence, and the input-by-input
    comparison says what differs."""
    return values.get("image_height") is not None or name in SIZED_BY_IMAGE or any(
        key in v.entry.get(kind, {}) for v in variants for kind in ("bucket", "dynamic") for key in ("image", "images"))


def _asked_text_length(variants: list[CompiledVariant], args: tuple, kwargs: dict, cap: Any) -> int | None:
    """The call's text length in the variants' terms: where a variant's input follows the text
    (a dynamic model's), the length the denoiser is given (`_text_length`: the prompt's real tokens
    where the pipeline trims them), else the padded length the call asks for (`cap`)."""
    if any(isinstance(d, dict) and d.get("axis") == TEXT for v in variants for leaf in v.inputs
           for d in leaf.get("dims", ())):
        return _text_length(variants, args, kwargs)
    return cap if isinstance(cap, int) else None


def _text_length(variants: list[CompiledVariant], args: tuple, kwargs: dict) -> int | None:
    """The text length the denoiser is given in this call: the size of an input dim that follows
    the text alone (the padded `max_sequence_length`, or the prompt's real token count where the
    pipeline trims it: Qwen-Image, Z-Image), less the tokens before the prompt's in that sequence
    (Qwen-Image-Edit's edited image)."""
    for variant in variants:
        leaves = variant.flatten(args, kwargs)
        if leaves is None:  # another structure (more or fewer images)
            continue
        for (_, leaf), expected in zip(leaves, variant.inputs, strict=True):
            for d, dim in enumerate(expected.get("dims", ())):
                if isinstance(dim, dict) and dim["axis"] == TEXT and isinstance(leaf, torch.Tensor):
                    return leaf.shape[d] - dim.get("offset", 0)
    return None


def _assumption_broken(variants: list[CompiledVariant], args: tuple, kwargs: dict) -> str | None:
    """The guard a dynamic variant's export took that these inputs break, where their sizes are
    otherwise in its range, with its symbols said in the call's terms where a dim gives one alone
    ("s89 = height / 4 px", "s43 = the text length"), else as inputs ("s43 = args[2].0 dim 0")."""
    for variant in variants:
        leaves = variant.flatten(args, kwargs)
        guard = variant.broken_guard(leaves) if leaves is not None else None
        if guard:
            named: dict[str, str] = {}
            for leaf in variant.inputs:
                for i, d in enumerate(leaf.get("dims", ())):
                    for symbol in re.findall(r"[A-Za-z_]\w*", d.get("expr", "") if isinstance(d, dict) else ""):
                        meaning = _symbol_meaning(d, symbol)
                        if meaning or symbol not in named:
                            named[symbol] = meaning or f"{leaf['path']} dim {i} = {d['expr']}"
            found = sorted(set(re.findall(r"[A-Za-z_]\w*", guard)) & set(named))
            return f"{guard}, with {' and '.join(f'{s} = {named[s]}' for s in found)}" if found else guard
    return None


def _symbol_meaning(dim: dict[str, Any], symbol: str) -> str | None:
    """What a symbol of a dynamic dim is in the call's terms, where the dim is that symbol times a
    number (a latent side: "height / 4 px"; "the text length"); None otherwise."""
    terms = polynomial(dim.get("expr", ""))
    if not terms or len(terms) != 1 or terms[0][1] != (symbol,):
        return None
    k = terms[0][0]
    if dim["axis"] in ("height", "width"):  # the dim is the side / pixels: the symbol, that / k
        per = dim["pixels"] * k
        return f"{dim['axis']} / {per} px" if per != 1 else f"the {dim['axis']} in px"
    if dim["axis"] == TEXT and k == 1:
        return "the text length"
    return None


def _samples_differ(component: str, head: str, given: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why a call's ControlNet residuals do not fit: another count than compiled (a ControlNet of
    another depth, put into the pipeline past the checks `load_pipeline` and `apply` make)."""
    if FEATURE_INPUTS.get(head) != "a ControlNet":
        return None
    count = {name: sum(1 for path in paths if path.split(".")[0] == head) for name, paths in
             (("given", given), ("compiled", expected))}
    if not count["given"] or not count["compiled"] or count["given"] == count["compiled"]:
        return None
    return (f"the ControlNet gives {count['given']} {head} in this call, the compiled {component} takes "
            f"{count['compiled']}: a ControlNet of another architecture than this artifact's (load it with "
            f"load_pipeline(artifact, controlnet=...) to see what differs; build a target with it to run it)")


def _input_name(path: str) -> str:
    head, _, rest = path.partition(".")
    return f"{head} key {rest!r}" if rest else repr(head)


def _feature(path: str) -> str:
    """The diffusers feature an input is of: its path's, or its first one or two parts' (a list's
    items are `...ip_adapter_masks.0`)."""
    parts = path.split(".")
    feature = next((FEATURE_INPUTS[p] for p in (path, ".".join(parts[:2]), parts[0]) if p in FEATURE_INPUTS), None)
    return f" ({feature} is not compiled)" if feature else ""


def _call_text(call: tuple[str, dict[str, Any]], names: tuple[str, ...] | None = None) -> str:
    """`Pipeline(height=64, width=64, ...)`: a `pipeline_call()`'s arguments that were given
    (`names`: only these)."""
    name, values = call
    shown = ", ".join(f"{k}={v!r}" for k, v in values.items() if v is not None and k not in HIDDEN_VALUES
                      and (names is None or k in names))
    return f"{name}({shown})"


HIDDEN_VALUES = ("batch_size", "_guided")  # what `pipeline_call` reads beside the call's arguments


def pipeline_call() -> tuple[str, dict[str, Any]] | None:
    """The diffusers pipeline call running on this thread, if any: its class and the arguments
    that choose a variant (read from its frame, to phrase errors in the caller's terms)."""
    # Flux Kontext scales height x width to max_area and resizes the edited image (image_height...).
    # Not shown as arguments: the prompts (`batch_size`, an int once computed).
    names = ("height", "width", "num_frames", "num_images_per_prompt", "num_videos_per_prompt", "guidance_scale",
             TEXT, "max_area", "image_height", "image_width", "_auto_resize", *CALL_SETS.values(), "batch_size")
    found = running_pipeline_call(names)
    if found is None:
        return None
    owner, values = found
    try:  # whether the call guides, by the pipeline's own test (Z-Image guides above 0, most above 1)
        values["_guided"] = bool(owner.do_classifier_free_guidance)
    except (AttributeError, TypeError):  # no such property, or not set yet
        values["_guided"] = None
    return type(owner).__name__, values
