"""The three ways to run a target's pipeline, for `aotbuild run` and `aotbuild bench`:
`aot` (the built artifact), `eager` (the same optimized modules, uncompiled) and `compile`
(torch.compile of those modules with the target's inductor options)."""

from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..builder.targets import Target
from ..errors import AotbuildError
from ..runtime.artifacts import built_artifact
from ..spec.pipelines import (
    EDITS_SEVERAL,
    FRAMES,
    SIZED_BY_IMAGE,
    TEXT,
    UNGUIDED,
    control_image_argument,
    edits_image,
    exact_size,
    frames_around,
    frames_step,
    inpaints_control_image,
    per_prompt,
    requires_image,
    starts_from_image,
    union_modes,
)

BACKENDS = ("aot", "eager", "compile")
DEFAULT_STEPS = 4


def call_defaults(recorded: dict[str, Any]) -> dict[str, Any]:
    """What a call leaves out defaults to, from a target's recorded content (a manifest's
    `target`, or `Target.to_dict()`): its first bucket (its text length too: a bucket built at
    another than the call's default serves only that) and its guidance (0, off, for an artifact
    built without guidance), 4 steps, seed 0, and the arguments the target passes every call
    (`call`: its artifact was built with them). `aotbuild run` and `aotbuild serve`."""
    first = recorded["shapes"][0]
    guidance = UNGUIDED if recorded.get("guidance") == "unguided" else recorded["guidance_scale"]
    return {"steps": DEFAULT_STEPS, "seed": 0, "height": first["height"], "width": first["width"],
            "batch": first["batch"], "guidance_scale": guidance, "frames": first.get("frames"),
            "text": first.get("max_sequence_length"), "image_prompt": bool(recorded.get("ip_adapter")),
            "call": dict(recorded.get("call") or {})}


LORA_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def parse_lora(text: str) -> tuple[str, float]:
    """`PATH[:SCALE]` (a LoRA file, folder or Hub id, and its adapter weight, 1.0 by default).
    A LoRA that names a file or folder on this machine (a path, not `org/name`) must be there:
    checked before anything loads, not found by diffusers as a Hub id after network retries."""
    path, sep, scale = text.rpartition(":")
    weight = 1.0
    if sep and path and "/" not in scale:
        try:
            weight = float(scale)
        except ValueError:
            raise AotbuildError(f"--lora {text}: the adapter weight {scale!r} after ':' is not a number",
                                hint="give PATH or PATH:WEIGHT, e.g. ink.safetensors:0.7") from None
    else:
        path = text
    local = Path(path).expanduser()
    hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and local.suffix not in LORA_SUFFIXES
    if hub_id:
        return path, weight
    if not local.exists():
        raise AotbuildError(f"--lora {path}: no such file or folder",
                            hint="give a LoRA file or folder on this machine, or a Hub repo as org/name")
    if local.is_file() and (instead := not_a_lora(local)):
        raise AotbuildError(f"--lora {path}: not a LoRA: {instead}", hint=LORA_FORM)
    return str(local), weight  # `~` expanded: diffusers would take the raw text for a Hub id


LORA_FORM = ("a LoRA is a .safetensors file of low-rank weight pairs, named like "
             "'unet.down_blocks.0...to_q.lora_A.weight' (diffusers, PEFT) or 'lora_unet_..._lora_down.weight' (kohya)")
# What names a LoRA's (or LyCORIS') tensors: low-rank pairs, their alphas, LoHa / LoKr factors.
LORA_MARKERS = ("lora", "alpha", "hada_", "lokr_", "dora_scale")


def not_a_lora(path: Path) -> str | None:
    """What a local file given as a LoRA is instead, in words, read from its first bytes and a
    safetensors header (no weights read); None where it may be a LoRA (a pickled .bin or .pt is not
    opened: unpickling runs code)."""
    with open(path, "rb") as file:
        head = file.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        header = file.read(size) if 2 <= size <= 100 * 2**20 else b""
    try:
        names = [name for name in json.loads(header) if name != "__metadata__"]
    except (ValueError, TypeError):
        names = None
    if names is None:
        if path.suffix in LORA_SUFFIXES[1:]:
            return None
        picture = _picture_format(path)
        return (f"a {picture} image" if picture else "an empty file" if not head
                else "not a safetensors file (no safetensors header at its start)")
    if not any(marker in name.lower() for name in names for marker in LORA_MARKERS):
        return (f"it holds a model's own weights ({len(names)} tensors such as {sorted(names)[0]!r}), not "
                f"low-rank pairs; a fine-tuned checkpoint goes to --weights, as its diffusers folder")
    return None


def _picture_format(path: Path) -> str | None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as picture:
            return f"{picture.format} {picture.width}x{picture.height}"
    except (UnidentifiedImageError, OSError):
        return None


def load_loras(pipe: Any, loras: list[tuple[str, float]]) -> list[str]:
    """Load each LoRA through diffusers' own API and activate them all with their weights;
    returns the adapter names (`lora0`, `lora1`, ...)."""
    names = []
    for i, (path, _) in enumerate(loras):
        name = f"lora{i}"
        try:
            pipe.load_lora_weights(path, adapter_name=name)
        except (OSError, ValueError) as exc:  # diffusers' words for a missing or malformed LoRA
            raise AotbuildError(f"LoRA {path}: {exc}", hint=LORA_FORM) from None
        names.append(name)
    if names:
        pipe.set_adapters(names, adapter_weights=[scale for _, scale in loras])
    return names


def raised_by_input_checks(exc: ValueError) -> bool:
    """Whether a pipeline's own input checks refused the call: diffusers' `check_inputs` raising
    ValueError (a size it does not take, a prompt and its embeddings both given), the caller's
    mistake. A ValueError from anywhere else in the call is a failure."""
    frame = exc.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_name == "check_inputs":
            return True
        frame = frame.tb_next
    return False


def prepare_artifact(artifact: str, *, cuda_graphs: bool | None = None, weights: str | None = None,
                     loras: list[tuple[str, float]] = (), trust_remote_code: bool = False,
                     variant: str | None = None, dtype: str | None = None) -> tuple[Any, dict[str, Any]]:
    """A ready pipeline for an artifact folder or `hf://org/name[@revision]` (no target file
    needed; a Hub artifact's native code is loaded only with `trust_remote_code`), and the target
    its manifest records. `dtype`: as `load_pipeline`'s."""
    from ..runtime import artifact_folder, load_pipeline
    from ..runtime.hub import check_trusted
    from ..spec.manifest import read_manifest

    check_trusted(artifact, trust_remote_code)
    folder, _ = artifact_folder(artifact, variant=variant, dtype=dtype)
    if not folder.is_dir():
        raise AotbuildError(f"no artifact at {artifact}", hint="give an artifact folder or hf://org/name[@revision]")
    manifest = read_manifest(folder)
    pipe = load_pipeline(folder, cuda_graphs=cuda_graphs, weights=weights, dtype=dtype)
    load_loras(pipe, list(loras))
    pipe.set_progress_bar_config(disable=True)
    return pipe, manifest["target"]


def prepare(target: Target, backend: str, artifacts_dir: Path, *, cuda_graphs: bool | None = None,
            weights: str | None = None, loras: list[tuple[str, float]] = (), dtype: str | None = None) -> Any:
    """A ready pipeline for `target` run the `backend` way (`cuda_graphs`: aot only, None = as built).
    aot only: `weights` another checkpoint of the architecture, `loras` (path, scale) to apply,
    `dtype` as `load_pipeline`'s."""
    if (weights is not None or loras) and backend != "aot":
        raise AotbuildError(f"--weights and --lora run the artifact (--backend aot), not {backend}: the eager and "
                            f"compile backends run the target's own pipeline")
    if backend == "aot":
        from ..runtime import load_pipeline
        from ..runtime.sources import is_random, local_folder

        # An artifact names a local source by its name only: the target knows where it is.
        source = None if is_random(target.source) or weights is not None else local_folder(target.source,
                                                                                            target.base_dir)
        pipe = load_pipeline(built_artifact(target.name, artifacts_dir), cuda_graphs=cuda_graphs, source=source,
                             weights=weights, dtype=dtype)
        load_loras(pipe, list(loras))
    elif backend in ("eager", "compile"):
        from ..builder.capturing import load_source_pipeline, optimize_pipeline
        from ..builder.flow import check_device
        from ..spec.pipelines import pipeline_spec

        check_device(target)
        spec = pipeline_spec(target.pipeline)
        pipe = load_source_pipeline(target, spec, torch.device(target.device))
        specs = [spec.component(name) for name in target.components]
        optimize_pipeline(pipe, specs, target)
        if backend == "compile":
            options = compile_options(target)
            for s in specs:
                module = getattr(pipe, s.attribute)
                compiled = torch.compile(getattr(module, s.method), options=options)
                setattr(module, s.method, compiled)
    else:
        raise AotbuildError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def compile_options(target: Target) -> dict[str, Any]:
    """torch.compile's inductor options for the target: the build's, less the AOT-only packaging ones."""
    from ..builder.export import FREEZING_OPTION, WEIGHTLESS_OPTIONS, inductor_options
    from ..builder.optimize import inductor_flags

    options = inductor_options(target.inductor, inductor_flags(target.optimize), cpu_baseline=target.cpu_baseline)
    # Without freezing too: torch.compile would bake the weights it first saw into its code, and
    # a LoRA or checkpoint loaded afterwards would change nothing.
    return {k: v for k, v in options.items() if k not in WEIGHTLESS_OPTIONS and k != FREEZING_OPTION}


@dataclass
class Generation:
    images: list  # PIL images; for a video pipeline, videos (each its frames)
    first_step_s: float  # call start to the end of the first denoising step
    total_s: float
    step_durations_s: list[float]  # each denoising step (the first includes prompt encoding)


def ip_adapter_loaded(pipe: Any) -> bool:
    """Whether an IP-Adapter is loaded into the pipeline's UNet or Flux transformer (compiled or eager)."""
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    return hasattr(getattr(denoiser, "encoder_hid_proj", None), "image_projection_layers")


def control_modes(pipe: Any) -> int | None:
    """How many control modes the pipeline's ControlNet-Union has (`union_modes`; several
    ControlNets: their first's, as diffusers reads them); None: its ControlNet, if any, is not a
    union one."""
    controlnet = getattr(pipe, "controlnet", None)
    controlnet = controlnet.nets[0] if hasattr(controlnet, "nets") else controlnet
    return union_modes(dict(getattr(controlnet, "config", None) or {}))


def _checked_mode(pipe: Any, mode: int | None) -> int | None:
    """The call's `control_mode`, given exactly when the ControlNet is a union one, and one it has
    (the stand-in checks the mode too, in the library's terms; this says it in the CLI's)."""
    modes = control_modes(pipe)
    if modes is not None and mode is None:
        raise AotbuildError(f"{type(pipe).__name__}'s ControlNet is a ControlNet-Union: give the control image's "
                            f"mode (--control-mode 0 to {modes - 1}, in the order its model card lists them)")
    if mode is not None and modes is None:
        raise AotbuildError(f"{type(pipe).__name__}'s ControlNet takes no control mode: it is not a ControlNet-Union",
                            hint="leave out --control-mode")
    if mode is not None and not 0 <= mode < modes:
        raise AotbuildError(f"control mode {mode}: this ControlNet-Union has modes 0 to {modes - 1}")
    return mode


def generate(pipe: Any, prompt: str | list[str], *, steps: int, seed: int | list[int], height: int | None = None,
             width: int | None = None, batch: int = 1, guidance_scale: float = 5.0,
             negative_prompt: str | None = None, image: Any = None, strength: float | None = None,
             frames: int | None = None, text: int | None = None, mask: Any = None,
             control: Any = None, control_mode: int | None = None, image_prompt: Any = None,
             built_with: dict[str, Any] | None = None) -> Generation:
    """One image (or video, of `frames` frames) call, timing the first denoising step (the cost a
    cold start shows) and the total. With `image` (a PIL image; a list of those, edited together
    by an `EDITS_SEVERAL` pipeline), img2img: the pipeline's
    image-to-image sibling (`from_pipe`, sharing its models) starts from it, resized to height x
    width; `strength` as diffusers takes it. With `mask` too (white repaints, black keeps), inpainting:
    the pipeline's inpainting sibling. `control`: a ControlNet pipeline's control image (resized to
    height x width, as the pipeline would), with `mask` the image SD3's inpainting ControlNet
    pipeline inpaints (its `control_mask`); `control_mode`, a ControlNet-Union's mode for it, needed
    exactly when the ControlNet is one. `image_prompt`: the image an IP-Adapter loaded into the
    pipeline takes (`ip_adapter_image`), needed exactly when one is loaded. `text`: the call's
    max_sequence_length (None: its default). `built_with`: the target's `call`, the arguments its
    artifact was built with (PixArt's `use_resolution_binning = false`), passed as the build did.
    Several requests in one call: a list of prompts and a seed each, one image each (`batch` 1);
    each image's noise is drawn from its own seed, as when its prompt is made alone."""
    if isinstance(prompt, list) != isinstance(seed, list) or isinstance(seed, list) and (
            len(seed) != len(prompt) or batch != 1):
        raise AotbuildError("a batch of requests is a list of prompts with a seed each, one image per prompt")
    # SD3's inpainting ControlNet pipeline inpaints its control image, under `control_mask`.
    masks_control = inpaints_control_image(type(pipe))
    if masks_control and image is not None:
        raise AotbuildError(f"{type(pipe).__name__} inpaints its control image: it takes no other image",
                            hint="give the image to inpaint as the control image (--control-image) with --mask")
    if masks_control and control is not None and mask is None:
        raise AotbuildError(f"{type(pipe).__name__} inpaints its control image: give the mask of what it repaints "
                            f"(--mask: white repaints, black keeps)")
    if mask is not None and not masks_control and (image is None or isinstance(image, list)):
        raise AotbuildError("a mask goes with one image: the image to inpaint", hint=(
            f"{type(pipe).__name__} inpaints --image; SD3's inpainting ControlNet pipeline repaints --control-image"
            if control is not None else None))
    marks: list[float] = []
    # CUDA runs ahead of the host: without a sync a step's mark is when its kernels were queued.
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)

    def on_step_end(pipeline: Any, step: int, timestep: Any, kwargs: dict) -> dict:
        sync()
        marks.append(time.perf_counter())
        return kwargs

    def sized(picture: Any) -> Any:  # a picture the call takes, at the call's size where it gives one
        return picture.resize((width, height)) if height and width else picture

    call: dict[str, Any] = {"num_inference_steps": steps, per_prompt(type(pipe).__call__): batch,
                            "guidance_scale": guidance_scale, "negative_prompt": negative_prompt, FRAMES: frames,
                            TEXT: text}
    if image is None:
        call |= exact_size(type(pipe), height, width) if height and width else {}
    else:
        # The sibling taking what the call brings (FLUX.2 edits with its own call; an inpainting
        # checkpoint's pipeline takes the mask itself).
        needed = "mask_image" if mask is not None else "image"
        takes_control = control_image_argument(type(pipe)) == "image"  # SDXL's ControlNet: its `image` is the control
        if needed not in inspect.signature(type(pipe).__call__).parameters or takes_control:
            from ..runtime.load import quiet_libraries

            with quiet_libraries():
                from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

                sibling = AutoPipelineForInpainting if mask is not None else AutoPipelineForImage2Image
                made = "inpainting" if mask is not None else "img2img"
                try:
                    chosen = sibling.from_pipe(pipe)
                except ValueError as exc:  # diffusers has no such sibling for this pipeline
                    raise AotbuildError(f"{type(pipe).__name__} has no {made} sibling in diffusers ({exc})") from None
            if inpaints_control_image(type(chosen)):  # SD3's: an inpainting ControlNet's pipeline, not this one's
                raise AotbuildError(f"{type(pipe).__name__} has no {made} sibling for its ControlNet: diffusers' "
                                    f"{type(chosen).__name__} inpaints through an inpainting ControlNet",
                                    hint="build a StableDiffusion3ControlNetInpaintingPipeline target with one, and "
                                         "give it the image to inpaint as --control-image with --mask")
            pipe = chosen
            pipe.set_progress_bar_config(disable=True)
        if isinstance(image, list) and type(pipe).__name__ not in EDITS_SEVERAL:
            raise AotbuildError(f"{type(pipe).__name__} takes one image, not {len(image)}",
                                hint=f"give --image once; {', '.join(EDITS_SEVERAL)} edits several together")
        # Qwen-Image-Edit sizes its call from the image's aspect ratio: resizing it would squash it.
        sized_by_image = type(pipe).__name__ in SIZED_BY_IMAGE
        call["image"] = image if sized_by_image else sized(image)
        if mask is not None:
            call["mask_image"] = sized(mask)
        call["strength"] = strength
    taken = inspect.signature(type(pipe).__call__).parameters
    # Those of the build's arguments this pipeline takes (an img2img sibling may take fewer).
    call |= {name: value for name, value in (built_with or {}).items() if name in taken}
    step = frames_step(pipe)
    if frames is not None and (around := frames_around(frames, step)):
        raise AotbuildError(f"{type(pipe).__name__} makes 1 + a multiple of {step} frames (its VAE's temporal "
                            f"compression), not {frames}", hint=f"ask for {around[0]} or {around[1]} frames")
    control_argument = control_image_argument(type(pipe))
    if control is not None and control_argument is None:
        raise AotbuildError(f"{type(pipe).__name__} takes no control image: it has no ControlNet")
    if control is None and control_argument is not None:
        raise AotbuildError(f"{type(pipe).__name__} needs a control image (the ControlNet's condition: edges, depth, "
                            f"pose...): give one (--control-image)")
    if control is not None:
        call[control_argument] = sized(control)
        if masks_control:
            call["control_mask"] = sized(mask)
        call["control_mode"] = _checked_mode(pipe, control_mode)
    elif control_mode is not None:
        raise AotbuildError("a control mode goes with a control image (--control-image)")
    prompted = ip_adapter_loaded(pipe)
    if image_prompt is None and prompted:
        raise AotbuildError(f"{type(pipe).__name__} has an IP-Adapter loaded, which takes an image prompt in every "
                            f"call: give one (--ip-adapter-image)")
    if image_prompt is not None and not prompted:
        raise AotbuildError(f"{type(pipe).__name__} takes no image prompt: it has no IP-Adapter loaded",
                            hint="build the target with ip_adapter = ... (its artifact loads that adapter)")
    if image_prompt is not None:
        call["ip_adapter_image"] = image_prompt
    if image is None and (requires_image(type(pipe)) or starts_from_image(type(pipe))):
        made = "a video from it" if frames_step(pipe) > 1 else "an edit of it"
        raise AotbuildError(f"{type(pipe).__name__} needs an image: give one (--image), it makes {made}")
    if image is not None and height and width and edits_image(type(pipe)):
        call |= exact_size(type(pipe), height, width, editing=True)  # Flux Kontext edits the image
    refused = [name for name, value in call.items() if value is not None and name not in taken]
    if refused:
        raise AotbuildError(f"{type(pipe).__name__} takes no {refused[0]}",
                            hint=f"leave out the option that sets {refused[0]}")
    # An option not given is not passed: the pipeline's own default holds (PixArt's negative_prompt is "").
    call = {name: value for name, value in call.items() if name in taken and value is not None}
    if "callback_on_step_end" in taken:
        call["callback_on_step_end"] = on_step_end
    elif "callback" in taken:  # the older per-step hook (PixArt), whose **kwargs would swallow the newer one
        call |= {"callback": lambda step, timestep, latents: on_step_end(pipe, step, timestep, {}), "callback_steps": 1}
    start = time.perf_counter()
    try:
        with torch.no_grad():
            generator = ([torch.Generator("cpu").manual_seed(s) for s in seed] if isinstance(seed, list)
                         else torch.Generator("cpu").manual_seed(seed))
            # diffusers draws from torch's global generator where it passes none (SD3's ControlNet
            # pipeline samples its control image's latents so): seeded too, for a repeatable image.
            torch.manual_seed(seed[0] if isinstance(seed, list) else seed)
            result = pipe(prompt=prompt, generator=generator, output_type="pil", **call)
    except ValueError as exc:
        if not raised_by_input_checks(exc):  # not a refusal: a failure, shown as one
            raise
        asked = ", ".join(f"{k}={v}" for k, v in call.items() if k in ("height", "width", FRAMES, "strength"))
        raise AotbuildError(f"{type(pipe).__name__} refuses this call ({asked}): {str(exc).strip()}",
                            hint="change the option it names") from None
    total = time.perf_counter() - start
    ends = [start, *marks]
    images = result.frames if hasattr(result, "frames") else result.images
    return Generation(images=list(images), first_step_s=(marks[0] - start) if marks else total, total_s=total,
                      step_durations_s=[b - a for a, b in zip(ends, ends[1:], strict=False)])
