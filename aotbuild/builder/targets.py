"""Targets: what to build, for which machine, at which shapes. Parsed from TOML once, validated once,
then trusted; `Target.to_dict()` is the JSON form stored in the manifest and round-trips.

Importing this module imports no torch: finding a target by name, listing the folder (`describe`)
and their errors answer at once; validating one (`parse_target`) imports the compile options and
the diffusers classes it checks against.

Over 500 lines, as one module: the target file's whole schema (every table, key and check, one
small function per table) is read in one place."""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SourceError, TargetError
from ..spec.manifest import DTYPE_NAMES as DTYPES
from ..spec.pipelines import (
    EDITS_SEVERAL,
    FRAMES,
    TEXT,
    default_text_length,
    frame_stride,
    frames_around,
    pipeline_spec,
)

DEVICES = ("cpu", "cuda")
TOP_LEVEL_KEYS = (
    "name", "description", "pipeline", "source", "revision", "seed", "device", "gpu", "cpu", "dtype",
    "guidance_scale", "guidance", "shapes", "dynamic", "components", "optimize", "inductor", "cuda_graphs", "compile",
    "controlnet", "ip_adapter", "image_encoder", "validation_steps", "reference_dtype", "call",
)
# How a denoiser is compiled: as one model, or each repeated block once for all its instances (the
# code between blocks running eager).
COMPILE_MODES = ("whole", "regional")
# The build's denoising loop, by default: long enough for an error to grow over steps, short at any size.
LOOP_STEPS = 3
# Which denoiser batches the variants serve: with classifier-free guidance (2 x images), without
# it (guidance_scale <= 1: turbo, LCM, lightning checkpoints), or both on one artifact.
GUIDANCE_MODES = ("both", "guided", "unguided")
COMPONENT_OPTIONS = ("tiling",)
# A pipeline call's arguments the build sets itself at each capture point: a target's `call` may not.
CAPTURE_SETS = ("prompt", "prompt_embeds", "negative_prompt_embeds", "height", "width", "num_images_per_prompt",
                "num_videos_per_prompt", "guidance_scale", "num_inference_steps", "output_type", "generator",
                "latents", "return_dict", "image", "mask_image", "control_image", "max_area", "strength",
                "ip_adapter_image", "control_mode", "control_mask", "callback_on_step_end",
                "callback_on_step_end_tensor_inputs")
REQUIRED_KEYS = ("name", "pipeline", "source", "device", "shapes", "components")
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True)
class ShapeBucket:
    """A static shape: images (videos) per prompt, pixel size and, where the pipeline's call takes
    it, the text length (None: the pipeline's default), the (height, width) of the image an editing
    call takes (Flux Kontext: its tokens join the denoiser's sequence; None: text-to-image calls),
    the (height, width) of each image a call edits together (`EDITS_SEVERAL`; None: one image of
    the bucket's own size) and a video's frame count (None: an image pipeline). Guidance doubles
    the denoiser batch."""

    batch: int
    height: int
    width: int
    max_sequence_length: int | None = None
    image: tuple[int, int] | None = None
    frames: int | None = None
    images: tuple[tuple[int, int], ...] | None = None

    def __str__(self) -> str:
        text = f"/text{self.max_sequence_length}" if self.max_sequence_length else ""
        edit = f"/image{self.image[0]}x{self.image[1]}" if self.image else ""
        edit += f"/images{images_text(self.images)}" if self.images else ""
        frames = f"/{self.frames}frames" if self.frames else ""
        return f"{self.batch}x{self.height}x{self.width}{frames}{text}{edit}"


def images_text(images: Sequence[Sequence[int]]) -> str:
    """The images a call edits together, as a name: 64x64+64x128."""
    return "+".join(f"{height}x{width}" for height, width in images)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    capability: str
    # Kernels as fatbins with PTX as well as SASS (`aot_inductor.emit_multi_arch_kernel`): the
    # driver can JIT them for newer GPUs where the PTX is not arch-specific (see manifest.gpu_fits).
    multi_arch: bool = False


@dataclass(frozen=True)
class Target:
    """A validated build target. Build with `aotbuild.build(target)`."""

    name: str
    pipeline: str
    source: str
    device: str
    shapes: tuple[ShapeBucket, ...]
    components: tuple[str, ...]
    description: str = ""
    revision: str | None = None
    seed: int = 0
    gpu: GpuSpec | None = None
    cpu_baseline: str | None = None  # export.CPU_BASELINES: the CPUs its code runs on (None: the build machine's)
    dtype: str = "float32"
    guidance_scale: float = 5.0  # the guidance of the guided captures
    guidance: str = "both"  # GUIDANCE_MODES
    tiling: tuple[str, ...] = ()  # VAE parts that get a tile variant (vae.enable_tiling())
    dynamic: dict[str, list[int]] | None = None  # {"batch"|"height"|"width"[|"frames"][|TEXT]: [min, max]}
    dynamic_images: tuple[tuple[int, int], ...] | None = None  # [dynamic] images: as a bucket's `images`
    optimize: dict[str, Any] = field(default_factory=dict)
    inductor: dict[str, Any] = field(default_factory=dict)
    cuda_graphs: bool = False  # runtime default: replay each static bucket as a CUDA graph
    compile_mode: str = "whole"  # COMPILE_MODES
    # Arguments every capture's call passes besides those the build sets (`CAPTURE_SETS`), plain
    # values: a pipeline default the target's sizes cannot take (PixArt's resolution binning, whose
    # table has no tiny model's sizes: `use_resolution_binning = false`).
    call: dict[str, Any] = field(default_factory=dict)
    # Where a ControlNet pipeline's ControlNet comes from, when not from `source` (a Hub model repo
    # `org/name[@revision]` or a model folder): base checkpoints hold none.
    controlnet: str | None = None
    # The IP-Adapter the UNet is built with (`sources.ip_adapter_arguments`, or "random": a seeded one
    # of the plain form): the artifact then takes any adapter of its form as data (`runtime.ip_adapter`).
    ip_adapter: str | None = None
    # Where the IP-Adapter's image encoder comes from when the pipeline has none and the adapter's repo
    # holds none beside it (XLabs' Flux adapter: openai/clip-vit-large-patch14): a Hub repo or folder.
    image_encoder: str | None = None
    # The denoising loop the build runs eager float32 and compiled, whose final latents it compares
    # (`capturing.Loop`): fewer steps for a model whose float32 call takes minutes on the build machine.
    validation_steps: int = LOOP_STEPS
    # The dtype of the eager pipeline the build captures and compares the compiled one against:
    # float32, or the target's own dtype where a float32 copy of the model would not fit the build
    # machine (a 20B model in float32 is 80 GB) or sets its peak (`docs/targets.md`).
    reference_dtype: str = "float32"
    base_dir: Path = field(default=Path("."), compare=False)

    @property
    def stride(self) -> int:
        """Height and width must be multiples of this many pixels."""
        from ..runtime.sources import pixel_stride

        return pixel_stride(pipeline_spec(self.pipeline), self.source, self.base_dir)

    def to_dict(self) -> dict[str, Any]:
        """The resolved target as plain JSON data (no paths of this machine)."""
        data = asdict(self)
        data.pop("base_dir")
        data["shapes"] = [{k: json.loads(json.dumps(v)) for k, v in asdict(s).items() if v is not None}
                          for s in self.shapes]
        if data.pop("dynamic_images"):  # kept out when absent: the hashes of other targets stay as they were
            data["dynamic"] = {**data["dynamic"], "images": [list(size) for size in self.dynamic_images]}
        data["components"] = list(self.components)
        data["tiling"] = list(self.tiling)
        if self.compile_mode == "whole":  # the default leaves the hashes of whole-model targets as they were
            del data["compile_mode"]
        if self.cpu_baseline is None:  # likewise
            del data["cpu_baseline"]
        for key in ("controlnet", "ip_adapter", "image_encoder"):  # likewise
            if data[key] is None:
                del data[key]
        if self.validation_steps == LOOP_STEPS:  # likewise
            del data["validation_steps"]
        if self.reference_dtype == "float32":  # likewise
            del data["reference_dtype"]
        if not self.call:  # likewise
            del data["call"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: Path = Path(".")) -> Target:
        """Inverse of `to_dict` (validates again)."""
        raw = dict(data)
        tiling = set(raw.pop("tiling", ()))
        raw["compile"] = {"mode": raw.pop("compile_mode", "whole")}
        if baseline := raw.pop("cpu_baseline", None):
            raw["cpu"] = {"baseline": baseline}
        raw["components"] = {name: {"tiling": True} if name in tiling else {}
                             for name in raw.get("components", ())}
        raw = {k: v for k, v in raw.items() if v is not None}
        return parse_target(raw, origin="<manifest>", base_dir=base_dir)

    def content_hash(self) -> str:
        """sha256 of the canonical JSON form: two targets with the same hash build the same thing."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def default_targets_dir() -> Path:
    """$AOTBUILD_TARGETS, else ./targets when present, else the repository's targets/ (editable installs)."""
    env = os.environ.get("AOTBUILD_TARGETS")
    if env:
        return Path(env)
    local = Path.cwd() / "targets"
    if local.is_dir():
        return local
    return Path(__file__).resolve().parents[2] / "targets"  # aotbuild/builder/targets.py -> the repository


def is_target_name(text: str) -> bool:
    """Whether `--target TEXT` names a target in the targets folder, rather than a TOML file's path."""
    return not (text.endswith(".toml") or Path(text).is_file())


def targets_dir_note() -> str | None:
    """Where targets named without a path come from, when it is not ./targets (printed by the
    commands, so a build run from another folder says which targets it read)."""
    directory = default_targets_dir()
    if directory.resolve() == (Path.cwd() / "targets").resolve():
        return None
    why = "$AOTBUILD_TARGETS" if os.environ.get("AOTBUILD_TARGETS") else "no ./targets here"
    return f"targets from {directory} ({why})"


def load_target(name_or_path: str | os.PathLike, targets_dir: Path | None = None) -> Target:
    """Load and validate a target by name (a file in `targets_dir`) or by path to a TOML file.

    Raises:
        TargetError: the file is missing or invalid; the message names the file and key.
    """
    path = target_file(name_or_path, targets_dir)
    target = parse_target(read_target_file(path), origin=str(path), base_dir=path.parent)
    if target.name != path.stem:
        raise TargetError(f"{path}: key 'name' is {target.name!r} but the file is named {path.stem!r}",
                          hint=f"a target is found by its file name: rename the file to {target.name}.toml or set "
                               f"name = {path.stem!r}")
    return target


def target_file(name_or_path: str | os.PathLike, targets_dir: Path | None = None) -> Path:
    """The TOML file of a target named in the targets folder, or given by its path (no torch: a
    mistyped name is refused at once, with the closest name)."""
    text = os.fspath(name_or_path)
    path = Path(text)
    if is_target_name(text):
        directory = targets_dir or default_targets_dir()
        path = directory / f"{text}.toml"
        if not path.is_file():
            known = sorted(p.stem for p in directory.glob("*.toml"))
            close = difflib.get_close_matches(text, known, n=1, cutoff=0.6)
            where = f"{directory} ($AOTBUILD_TARGETS, else ./targets)"
            raise TargetError(f"no target named {text!r} in {where}",
                              hint=(f"did you mean {close[0]}? " if close else "")
                              + (f"aotbuild targets lists the {len(known)} there; " if known else "")
                              + "or give the path of a target's TOML file")
    if not path.is_file():
        raise TargetError(f"target file {path} does not exist")
    return path


def read_target_file(path: Path) -> dict[str, Any]:
    """A target file's TOML, as written (not validated)."""
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TargetError(f"{path}: not valid TOML: {exc}") from None


def target_files(targets_dir: Path | None = None) -> list[Path]:
    """The target files in the folder, sorted by name."""
    directory = targets_dir or default_targets_dir()
    return sorted(directory.glob("*.toml"), key=lambda p: p.stem)


def list_targets(targets_dir: Path | None = None) -> list[Target]:
    """Every valid target in the folder, sorted by name (invalid files raise TargetError)."""
    return [load_target(p) for p in target_files(targets_dir)]


def stride_of(raw: dict[str, Any], base_dir: Path) -> int | None:
    """The pixel stride of a target file's model (`raw`, its TOML as read; `base_dir`, its folder),
    read before the file is validated (validation reads the diffusers classes: seconds), so that a
    size the model cannot make is refused at once. None where the file does not name a pipeline and
    a source plainly: `load_target` says why."""
    from ..runtime.sources import pixel_stride

    pipeline, source = raw.get("pipeline"), raw.get("source")
    if not (isinstance(pipeline, str) and isinstance(source, str)):
        return None
    try:
        return pixel_stride(pipeline_spec(pipeline), source, base_dir)
    except (TargetError, SourceError):
        return None


def describe(path: Path) -> tuple[str, ...]:
    """What `aotbuild targets` lists of a target file, read as written, without validating it (no
    torch or diffusers import): name, device, dtype, pipeline, then shapes, components and runtime
    options as one text.

    Raises:
        TargetError: the file is not TOML, or not laid out as a target (`load_target` says where).
    """
    raw = read_target_file(path)
    try:
        shapes = [str(ShapeBucket(**{key: tuple(map(tuple, value)) if key == "images" else
                                     tuple(value) if key == "image" else value for key, value in table.items()}))
                  for table in raw["shapes"]]
        if dynamic := raw.get("dynamic"):
            text = "{}-{}x{}-{}x{}-{}".format(*dynamic["batch"], *dynamic["height"], *dynamic["width"])
            text += "/{}-{}frames".format(*dynamic["frames"]) if "frames" in dynamic else ""
            text += "/text{}-{}".format(*dynamic[TEXT]) if TEXT in dynamic else ""
            shapes.append(text + (f"/images{images_text(dynamic['images'])}" if "images" in dynamic else ""))
        components = ",".join(name + "[tiling]" * bool(options.get("tiling"))
                              for name, options in raw["components"].items())
        runtime = (["cuda_graphs"] * bool(raw.get("cuda_graphs")) + ["multi_arch"] * bool(raw.get("gpu", {}).get(
            "multi_arch")) + ["regional"] * (raw.get("compile", {}).get("mode") == "regional"))
        runtime += [f"cpu={raw['cpu']['baseline']}"] if "cpu" in raw else []
        if raw.get("guidance", Target.guidance) != Target.guidance:
            runtime.append(f"guidance={raw['guidance']}")
        return (raw["name"], raw["device"], raw.get("dtype", Target.dtype), raw["pipeline"],
                f"shapes={','.join(shapes)} components={components}" + "".join(f" {r}" for r in runtime))
    except (KeyError, TypeError, ValueError, AttributeError):  # malformed in a way only validation names
        raise TargetError(f"{path}: not laid out as a target", hint=f"aotbuild build --target {path} says "
                                                                    f"which key is wrong") from None


def _expect(origin: str, key: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TargetError(f"{origin}: key {key!r} must be {what}, got {value!r}")
    return value


def _choice(origin: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise TargetError(f"{origin}: key {key!r} is {value!r}; allowed: {', '.join(allowed)}")
    return value


def parse_target(raw: dict[str, Any], origin: str, base_dir: Path) -> Target:
    """Validate raw TOML data into a Target; every error names `origin` and the offending key."""
    from ..runtime.sources import max_pixels, pixel_stride

    unknown = sorted(set(raw) - set(TOP_LEVEL_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], TOP_LEVEL_KEYS, n=1, cutoff=0.6)
        raise TargetError(f"{origin}: unknown key {unknown[0]!r}; allowed: {', '.join(TOP_LEVEL_KEYS)}",
                          hint=f"did you mean {close[0]!r}?" if close else None)
    for key in REQUIRED_KEYS:
        if key not in raw:
            raise TargetError(f"{origin}: missing required key {key!r}")

    name = _expect(origin, "name", raw["name"], str, "a string")
    if not NAME_PATTERN.match(name):
        raise TargetError(f"{origin}: key 'name' {name!r} must match {NAME_PATTERN.pattern}")
    try:
        spec = pipeline_spec(_expect(origin, "pipeline", raw["pipeline"], str, "a string"))
    except TargetError as exc:
        raise TargetError(f"{origin}: key 'pipeline': {exc.message}", hint=exc.hint) from None
    source = _expect(origin, "source", raw["source"], str, "a string")
    device = _choice(origin, "device", raw["device"], DEVICES)
    dtype = _choice(origin, "dtype", raw.get("dtype", "float32"), DTYPES)

    gpu = _parse_gpu(origin, raw, device)
    cpu_baseline = _parse_cpu(origin, raw["cpu"], device) if "cpu" in raw else None

    components = _parse_components(origin, raw["components"], spec)

    revision = raw.get("revision")
    if revision is not None:
        _expect(origin, "revision", revision, str, "a string")
    seed = _expect(origin, "seed", raw.get("seed", 0), int, "an integer")
    guidance, guidance_mode = _parse_guidance(origin, raw, spec)
    validation_steps = _expect(origin, "validation_steps", raw.get("validation_steps", LOOP_STEPS), int,
                               "a whole number of denoising steps (at least 1)")
    if validation_steps < 1:
        raise TargetError(f"{origin}: key 'validation_steps' = {validation_steps}: the build's denoising loop "
                          f"takes at least 1 step", hint=f"the default is {LOOP_STEPS}")
    reference_dtype = raw.get("reference_dtype", "float32")
    if reference_dtype not in ("float32", dtype) or reference_dtype == "float16":
        # float16: a VAE the recipe keeps in float32 (force_upcast) upcasts itself mid-call in an
        # eager float16 pipeline (SDXL's), so its calls are no reference for the compiled one
        raise TargetError(f"{origin}: key 'reference_dtype' = {reference_dtype!r}: the build compares the compiled "
                          f"pipeline with the eager one in float32, or in bfloat16 for a bfloat16 target",
                          hint="leave it out for float32" + ("" if dtype != "bfloat16" else
                                                             "; reference_dtype = \"bfloat16\" halves the build's "
                                                             "memory for the model"))

    try:
        stride = pixel_stride(spec, source, base_dir)
        largest = max_pixels(spec, source, base_dir)
    except SourceError as exc:
        raise TargetError(f"{origin}: key 'source': {exc.message}", hint=exc.hint) from None
    shapes = _parse_shapes(origin, raw["shapes"], spec, stride, largest, source, base_dir)
    dynamic, dynamic_images = None, None
    if "dynamic" in raw:
        frame_step = _frame_stride(spec, source, base_dir, origin) if spec.makes_video else None
        dynamic, dynamic_images = _parse_dynamic(origin, raw["dynamic"], stride, largest, spec, guidance_mode,
                                                 frame_step)

    # The keys below are checked against torch's inductor and the pass registry (torch imported);
    # those above need no torch, and diffusers only for a class aotbuild has no entry for (or a
    # text length, `_check_takes_text`).
    from .optimize import validate_optimize  # the pass registry validates its own keys

    optimize = _expect(origin, "optimize", raw.get("optimize", {}), dict, "a table")
    validate_optimize(optimize, origin=origin, device=device, gpu=gpu)
    if optimize.get("sdpa") == "aotbuild" and (dtype == "float16" or cpu_baseline):
        raise TargetError(f"{origin}: optimize.sdpa = \"aotbuild\" is aotbuild's bf16 and float32 attention for "
                          f"CPUs with AVX512-BF16, and this target " + (f"is {dtype}" if not cpu_baseline else
                                                                        f"runs on any {cpu_baseline} CPU"),
                          hint="use it with dtype = \"bfloat16\" or \"float32\" and no [cpu] baseline, or "
                               "sdpa = \"auto\"")
    inductor = _parse_inductor(origin, raw.get("inductor", {}), device)

    cuda_graphs = _expect(origin, "cuda_graphs", raw.get("cuda_graphs", False), bool, "true or false")
    if cuda_graphs and device != "cuda":
        raise TargetError(f"{origin}: key 'cuda_graphs' is only allowed with device = \"cuda\"")

    compile_mode = _parse_compile(origin, raw.get("compile", {}), spec, components, optimize)
    controlnet = raw.get("controlnet")
    if controlnet is not None:
        _expect(origin, "controlnet", controlnet, str, "a string: a Hub model repo (org/name[@revision]) or a folder")
        if "controlnet" not in spec.components:
            raise TargetError(f"{origin}: key 'controlnet': {spec.class_name} takes no ControlNet",
                              hint="a ControlNet pipeline: StableDiffusionXLControlNetPipeline, "
                                   "StableDiffusionControlNetPipeline, FluxControlNetPipeline, ...")
        if "controlnet" not in components:  # the artifact holds it, or a load would find none
            raise TargetError(f"{origin}: key 'controlnet' names a ControlNet that [components] does not compile",
                              hint="add controlnet = {} to [components]")

    ip_adapter = _parse_ip_adapter(origin, raw.get("ip_adapter"), spec, optimize, compile_mode)
    call = _parse_call(origin, raw.get("call", {}), spec)
    image_encoder = raw.get("image_encoder")
    if image_encoder is not None:
        _expect(origin, "image_encoder", image_encoder, str, "a string: a Hub model repo (org/name[@revision]) or a "
                "folder")
        if ip_adapter is None:
            raise TargetError(f"{origin}: key 'image_encoder' is the IP-Adapter's, and the target names none",
                              hint="add ip_adapter = ...")

    return Target(
        name=name, pipeline=spec.class_name, source=source, device=device, shapes=shapes,
        components=tuple(components), description=str(raw.get("description", "")),
        revision=revision, seed=seed, gpu=gpu, cpu_baseline=cpu_baseline, dtype=dtype, guidance_scale=guidance,
        guidance=guidance_mode,
        tiling=tuple(c for c, options in components.items() if options.get("tiling")), dynamic=dynamic,
        dynamic_images=dynamic_images,
        optimize=dict(optimize), inductor=dict(inductor), cuda_graphs=cuda_graphs, compile_mode=compile_mode,
        controlnet=controlnet, ip_adapter=ip_adapter, image_encoder=image_encoder,
        validation_steps=validation_steps, reference_dtype=reference_dtype, call=call, base_dir=base_dir,
    )


def _parse_call(origin: str, table: Any, spec: Any) -> dict[str, Any]:
    """A target's `call`: arguments of the pipeline's call, each a plain value or an array of them
    (FLUX.2 [klein]'s `text_encoder_out_layers`), none the build sets."""
    table = _expect(origin, "call", table, dict, "a table of the pipeline call's arguments")
    plain = (bool, int, float, str)
    for key, value in table.items():  # what the file alone says, before diffusers is imported
        if key in CAPTURE_SETS or key in (TEXT, FRAMES):
            raise TargetError(f"{origin}: key 'call.{key}': the build sets it at each capture point",
                              hint="sizes, frames and text lengths are [[shapes]]; guidance is guidance_scale")
        if not isinstance(value, plain) and not (isinstance(value, list) and all(isinstance(v, plain) for v in value)):
            raise TargetError(f"{origin}: key 'call.{key}' must be a plain value (true/false, a number, a string, or "
                              f"an array of them), got {value!r}")
    if not table:  # most targets: read without diffusers
        return {}
    import diffusers

    parameters = inspect.signature(getattr(diffusers, spec.class_name).__call__).parameters
    for key in table:
        if key not in parameters:
            close = difflib.get_close_matches(key, list(parameters), n=1, cutoff=0.6)
            raise TargetError(f"{origin}: key 'call.{key}': {spec.class_name}'s call takes no {key!r}",
                              hint=f"did you mean {close[0]!r}?" if close else None)
    return dict(table)


# Passes that would drop or rewrite the IP-Adapter's layers: diffusers' fuse_qkv_projections sets
# its own processors over the adapter's; a quantized or prepacked to_v_ip could not be scaled at load.
IP_ADAPTER_PASSES = ("fuse_qkv", "quantize", "prepack")


def _parse_ip_adapter(origin: str, value: Any, spec: Any, optimize: dict[str, Any],
                      compile_mode: str) -> str | None:
    """A target's `ip_adapter`: what its UNet is built with (see `Target.ip_adapter`)."""
    if value is None:
        return None
    _expect(origin, "ip_adapter", value, str, "a string: a weights file in a Hub repo "
            "(org/name/subfolder/weights.safetensors[@revision]) or on this machine")
    import diffusers
    from diffusers.loaders import FluxIPAdapterMixin, IPAdapterMixin

    # The UNet pipelines' adapters and Flux's (SD3's takes the timestep in its projection: not compiled).
    if not issubclass(getattr(diffusers, spec.class_name), (IPAdapterMixin, FluxIPAdapterMixin)):
        raise TargetError(f"{origin}: key 'ip_adapter': {spec.class_name} is not a pipeline whose IP-Adapter aotbuild "
                          f"compiles (SDXL's and SD 1.5's UNet pipelines, FluxPipeline and its img2img and inpainting "
                          f"siblings)")
    if "transformer" in spec.components and "controlnet" in spec.components:
        raise TargetError(f"{origin}: key 'ip_adapter': {spec.class_name} passes the image embeddings to its "
                          f"ControlNet too, which aotbuild does not compile with them yet",
                          hint="build FluxPipeline with the adapter")
    passes = [name for name in IP_ADAPTER_PASSES if optimize.get(name)]
    if passes or compile_mode != "whole":
        what = f"the {', '.join(passes)} pass" if passes else "regional compilation"
        raise TargetError(f"{origin}: key 'ip_adapter': an IP-Adapter is not compiled with {what} yet (its scale is "
                          f"bound as scaled weights, which those rewrite)", hint="drop one of them")
    return value


def _parse_gpu(origin: str, raw: dict[str, Any], device: str) -> GpuSpec | None:
    """gpu = { name, capability[, multi_arch] }: a CUDA target's GPU, required there."""
    if "gpu" not in raw:
        if device == "cuda":
            raise TargetError(f"{origin}: device = \"cuda\" needs key 'gpu' = {{ name = ..., capability = ... }}")
        return None
    if device != "cuda":
        raise TargetError(f"{origin}: key 'gpu' is only allowed with device = \"cuda\"")
    table = _expect(origin, "gpu", raw["gpu"], dict, "a table {name, capability[, multi_arch]}")
    extra = sorted(set(table) - {"name", "capability", "multi_arch"})
    if extra or not {"name", "capability"} <= set(table):
        raise TargetError(f"{origin}: key 'gpu' needs name and capability (and optionally multi_arch), "
                          f"got {sorted(table)}")
    capability = str(table["capability"])
    if not re.fullmatch(r"\d+\.\d+", capability):
        raise TargetError(f"{origin}: key 'gpu.capability' must look like \"9.0\", got {capability!r}")
    multi_arch = _expect(origin, "gpu.multi_arch", table.get("multi_arch", False), bool, "true or false")
    from .export import supports_multi_arch

    if multi_arch and not supports_multi_arch():
        import torch

        raise TargetError(f"{origin}: key 'gpu.multi_arch': torch {torch.__version__} has no "
                          f"aot_inductor.emit_multi_arch_kernel option")
    return GpuSpec(name=str(table["name"]), capability=capability, multi_arch=multi_arch)


def _parse_components(origin: str, table: Any, spec: Any) -> dict[str, dict[str, Any]]:
    """[components] NAME = { [tiling = true] }: what to compile, each a component of the pipeline."""
    components = _expect(origin, "components", table, dict, "a table of component names")
    if not components:
        raise TargetError(f"{origin}: key 'components' is empty; known: {', '.join(spec.components)}")
    for comp, options in components.items():
        if comp not in spec.components:
            raise TargetError(
                f"{origin}: key 'components.{comp}': {spec.class_name} has no such component; "
                f"allowed: {', '.join(spec.components)}"
            )
        _expect(origin, f"components.{comp}", options, dict, "a table of options")
        unknown_options = sorted(set(options) - set(COMPONENT_OPTIONS))
        if unknown_options:
            raise TargetError(f"{origin}: key 'components.{comp}.{unknown_options[0]}' is not an option; "
                              f"allowed: {', '.join(COMPONENT_OPTIONS)}")
        if _expect(origin, f"components.{comp}.tiling", options.get("tiling", False), bool, "true or false") \
                and spec.components[comp].part is None:
            raise TargetError(f"{origin}: key 'components.{comp}.tiling': only the VAE's parts (vae_decoder, "
                              f"vae_encoder) decode or encode by tiles")
    return components


def _parse_guidance(origin: str, raw: dict[str, Any], spec: Any) -> tuple[float, str]:
    """guidance_scale (the guided captures') and guidance (GUIDANCE_MODES)."""
    guidance = float(_expect(origin, "guidance_scale", raw.get("guidance_scale", 5.0), (int, float), "a number"))
    guidance_mode = _choice(origin, "guidance", raw.get("guidance", "both"), GUIDANCE_MODES)
    if guidance_mode != "unguided" and guidance <= 1:
        raise TargetError(f"{origin}: key 'guidance_scale' = {guidance:g} turns guidance off, and guidance = "
                          f"{guidance_mode!r} builds guided variants: give a scale above 1 (used for the guided "
                          f"captures), or set guidance = \"unguided\"")
    if guidance_mode != "both" and not spec.cfg_batch:
        raise TargetError(f"{origin}: key 'guidance': {spec.class_name}'s denoiser batch is the same with and "
                          f"without guidance, so there is nothing to choose; remove the key")
    return guidance, guidance_mode


def _parse_shapes(origin: str, table_list: Any, spec: Any, stride: int, largest: int | None, source: str,
                  base_dir: Path) -> tuple[ShapeBucket, ...]:
    """[[shapes]]: the static buckets, each a multiple of the model's pixel `stride` and at most
    `largest`, with frames where the pipeline makes videos."""
    shapes_raw = _expect(origin, "shapes", table_list, list, "an array of [[shapes]] tables")
    if not shapes_raw:
        raise TargetError(f"{origin}: key 'shapes' needs at least one [[shapes]] bucket")
    video = spec.makes_video
    shapes: list[ShapeBucket] = []
    for i, table in enumerate(shapes_raw):
        where = f"shapes[{i}]"
        _expect(origin, where, table, dict,
                "a table {batch, height, width[, frames][, max_sequence_length][, image][, images]}")
        optional = {TEXT, "image", "images", "frames"}
        if not {"batch", "height", "width"} <= set(table) <= {"batch", "height", "width", *optional}:
            raise TargetError(f"{origin}: key {where!r} needs batch, height, width (and optionally frames, {TEXT}, "
                              f"image, images); got {sorted(table)}")
        if TEXT in table:
            _check_takes_text(origin, f"{where}.{TEXT}", spec)
        if video != ("frames" in table):
            raise TargetError(f"{origin}: key {where!r}: {spec.class_name} makes videos: give its frames "
                              f"(the call's num_frames)" if video else
                              f"{origin}: key '{where}.frames': {spec.class_name} makes images, so frames is not a "
                              f"shape to choose")
        table = dict(table)
        if "image" in table:
            table["image"] = _edited_image(origin, f"{where}.image", table["image"], stride, spec)
        if "images" in table:
            table["images"] = _edited_images(origin, f"{where}.images", table["images"], spec)
        for dim in sorted(set(table) - {"image", "images"}):
            value = _expect(origin, f"{where}.{dim}", table[dim], int, "a positive integer")
            if value <= 0:
                raise TargetError(f"{origin}: key '{where}.{dim}' must be positive, got {value}")
        if "frames" in table:
            _check_frames(origin, f"{where}.frames", table["frames"], _frame_stride(spec, source, base_dir, origin),
                          spec)
        for dim in ("height", "width"):
            if table[dim] % stride:
                raise TargetError(
                    f"{origin}: key '{where}.{dim}' = {table[dim]} is not a multiple of {stride}, "
                    f"the pixel stride of this model (VAE factor x UNet downsampling or patch, and the multiple "
                    f"{spec.class_name} checks)"
                )
            _check_largest(origin, f"{where}.{dim}", table[dim], largest, spec)
        for side, dim in zip(table.get("image", ()), ("height", "width"), strict=False):
            _check_largest(origin, f"{where}.image {dim}", side, largest, spec)
        bucket = ShapeBucket(**table)
        if bucket in shapes:
            raise TargetError(f"{origin}: key {where!r} repeats bucket {bucket}")
        shapes.append(bucket)

    return tuple(shapes)


def _parse_inductor(origin: str, table: Any, device: str) -> dict[str, Any]:
    """[inductor]: options of this torch's inductor (a profile, then keys), checked by name."""
    from .export import PROFILES, check_inductor_keys, cpu_gemm_templates

    inductor = _expect(origin, "inductor", table, dict, "a table")
    for key, value in inductor.items():
        _expect(origin, f"inductor.{key}", value, (bool, int, float, str), "a boolean, number or string")
    if inductor.get("profile", "default") not in PROFILES:
        raise TargetError(f"{origin}: key 'inductor.profile' is {inductor['profile']!r}; "
                          f"allowed: {', '.join(PROFILES)}")
    check_inductor_keys({k: v for k, v in inductor.items() if k != "profile"}, TargetError, origin)
    if device == "cpu" and cpu_gemm_templates({**PROFILES[inductor.get("profile", "default")], **inductor}):
        raise TargetError(f"{origin}: [inductor] max_autotune on a CPU target: inductor's CPU GEMM templates pack "
                          f"the weights into constants of the compiled code, which other weights (weights=, LoRAs, "
                          f"load_state_dict) could not reach",
                          hint='leave max_autotune (and profile = "max-autotune") to CUDA targets, or set '
                               'max_autotune_gemm_backends = "ATEN"')
    return inductor


def _parse_cpu(origin: str, table: Any, device: str) -> str:
    """cpu = { baseline = "x86-64-v3" }: the CPUs a CPU target's code runs on."""
    from .export import CPU_BASELINES

    if device != "cpu":
        raise TargetError(f"{origin}: key 'cpu' is only allowed with device = \"cpu\" (a CUDA build's host code "
                          f"targets a portable baseline already)")
    _expect(origin, "cpu", table, dict, "a table { baseline = ... }")
    if set(table) != {"baseline"}:
        raise TargetError(f"{origin}: key 'cpu' takes baseline only, got {sorted(table)}")
    return _choice(origin, "cpu.baseline", table["baseline"], tuple(CPU_BASELINES))


def _parse_compile(origin: str, table: Any, spec: Any, components: dict[str, Any], optimize: dict[str, Any]) -> str:
    """[compile] mode = "whole" | "regional"."""
    _expect(origin, "compile", table, dict, 'a table {mode = "whole" | "regional"}')
    unknown = sorted(set(table) - {"mode"})
    if unknown:
        raise TargetError(f"{origin}: unknown key 'compile.{unknown[0]}'; allowed: mode")
    mode = _choice(origin, "compile.mode", table.get("mode", "whole"), COMPILE_MODES)
    if mode == "regional":
        if not any(spec.components[name].denoiser for name in components):
            raise TargetError(f"{origin}: key 'compile.mode' = \"regional\" compiles a denoiser's repeated blocks, "
                              f"and [components] has no denoiser "
                              f"({', '.join(n for n, c in spec.components.items() if c.denoiser)})")
        denoisers = [name for name in components if spec.components[name].denoiser]
        if len(denoisers) > 1:
            raise TargetError(f"{origin}: key 'compile.mode' = \"regional\" compiles the blocks of one denoiser, and "
                              f"[components] has {len(denoisers)} ({', '.join(denoisers)}: Wan 2.2's experts)",
                              hint='use [compile] mode = "whole" for both experts')
        if "quantize" in optimize:
            raise TargetError(f"{origin}: key 'compile.mode' = \"regional\" does not combine with optimize.quantize: "
                              f"the code between blocks runs eager, and the runtime does not import torchao",
                              hint='use [compile] mode = "whole" for a quantized target')
        if optimize.get("prepack"):
            raise TargetError(f"{origin}: key 'compile.mode' = \"regional\" does not combine with optimize.prepack: "
                              f"each region's code is bound to every block's weights in turn, and prepared "
                              f"constants are made per model", hint='use [compile] mode = "whole" to prepack')
    return mode


def _check_largest(origin: str, key: str, pixels: int, largest: int | None, spec: Any) -> None:
    if largest is not None and pixels > largest:
        raise TargetError(f"{origin}: key {key!r} = {pixels} is above {largest}, the largest size "
                          f"{spec.class_name}'s position embedding covers (pos_embed_max_size x patch x VAE factor)")


def _edited_image(origin: str, key: str, value: Any, stride: int, spec: Any) -> tuple[int, int]:
    """A bucket's `image = [height, width]`: the pixel size of the image an editing call takes."""
    if not spec.edits:
        raise TargetError(f"{origin}: key {key!r}: {spec.class_name} edits no image (its call takes no image "
                          f"whose tokens join the denoiser's), so an image size is not a shape to choose")
    valid = isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)
    if not valid:
        raise TargetError(f"{origin}: key {key!r} must be [height, width] in pixels, got {value!r}")
    for side in value:
        if side % stride:
            raise TargetError(f"{origin}: key {key!r} = {value}: {side} is not a multiple of {stride}, the pixel "
                              f"stride of this model")
    return value[0], value[1]


def _edited_images(origin: str, key: str, value: Any, spec: Any) -> tuple[tuple[int, int], ...]:
    """`images = [[height, width], ...]`: the images a call of a pipeline that edits several
    together takes, in order (`EDITS_SEVERAL`). The pipeline resizes each to its own area at the
    image's aspect ratio, so their aspect ratios are what the compiled model holds."""
    if spec.class_name not in EDITS_SEVERAL:
        raise TargetError(f"{origin}: key {key!r}: {spec.class_name}'s call edits no list of images together, so "
                          f"their sizes are not a shape to choose",
                          hint=f"{' and '.join(EDITS_SEVERAL)} edit several")
    valid = isinstance(value, list) and value and all(
        isinstance(size, list) and len(size) == 2 and all(type(v) is int and v > 0 for v in size) for size in value)
    if not valid:
        raise TargetError(f"{origin}: key {key!r} must be a list of [height, width] in pixels, one per image a "
                          f"call edits, got {value!r}")
    return tuple((height, width) for height, width in value)


def _frame_stride(spec: Any, source: str, base_dir: Path, origin: str) -> int:
    from ..runtime.sources import from_configs

    try:  # a Hub source's configs are not read here: the build checks its frames against the pipeline's
        return from_configs(source, base_dir, frame_stride, 1)
    except SourceError as exc:
        raise TargetError(f"{origin}: key 'source': {exc.message}", hint=exc.hint) from None


def _check_frames(origin: str, key: str, frames: int, step: int, spec: Any) -> None:
    """A video's frame count is 1 + a multiple of the VAE's temporal compression: diffusers rounds
    any other count to one (Wan warns, then makes fewer frames than asked)."""
    if around := frames_around(frames, step):
        raise TargetError(f"{origin}: key {key!r} = {frames}: {spec.class_name} makes 1 + a multiple of {step} "
                          f"frames (its VAE's temporal compression); {around[0]} or {around[1]} would be built")


def _check_takes_text(origin: str, key: str, spec: Any) -> None:
    if default_text_length(spec.class_name) is None:  # reads the diffusers class: only when a target asks
        raise TargetError(f"{origin}: key {key!r}: {spec.class_name}'s call takes no {TEXT}, so its text length "
                          f"is not a shape to choose")


def _parse_dynamic(origin: str, table: Any, stride: int, largest: int | None, spec: Any, guidance: str,
                   frame_step: int | None) -> tuple[dict[str, list[int]], tuple[tuple[int, int], ...] | None]:
    """[dynamic] batch/height/width[/frames][/max_sequence_length] = [min, max], in images (videos),
    pixels, frames, tokens, and the `images` its calls edit together (`EDITS_SEVERAL`). A video
    pipeline's range gives its frames (`frame_step`: 1 + a multiple of it), an image pipeline's none."""
    images = None
    if isinstance(table, dict) and "images" in table:
        table = dict(table)
        images = _edited_images(origin, "dynamic.images", table.pop("images"), spec)
    ranges = _dynamic_ranges(origin, table, stride, spec, guidance, frame_step)
    for axis in ("height", "width"):
        _check_largest(origin, f"dynamic.{axis}", ranges[axis][1], largest, spec)
    return ranges, images


def _dynamic_ranges(origin: str, table: Any, stride: int, spec: Any, guidance: str,
                    frame_step: int | None) -> dict[str, list[int]]:
    """The [min, max] ranges of [dynamic], each checked (`_parse_dynamic`)."""
    video = frame_step is not None
    _expect(origin, "dynamic", table, dict, "a table {batch, height, width[, frames][, max_sequence_length]}")
    required = ("batch", "height", "width", *(("frames",) if video else ()))
    if "frames" in table and not video:
        raise TargetError(f"{origin}: key 'dynamic.frames': {spec.class_name} makes images, so frames is not a "
                          f"shape to choose")
    if not set(required) <= set(table) <= {*required, TEXT}:
        raise TargetError(f"{origin}: key 'dynamic' needs {', '.join(required)} (and optionally {TEXT}); "
                          f"got {sorted(table)}", hint=f"{spec.class_name} makes videos: give the range of its "
                                                        f"frames (the call's num_frames)" if video else None)
    if TEXT in table:
        _check_takes_text(origin, f"dynamic.{TEXT}", spec)
    ranges = {}
    for axis in [a for a in ("batch", "height", "width", "frames", TEXT) if a in table]:
        value = table[axis]
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                    for v in value)):
            raise TargetError(f"{origin}: key 'dynamic.{axis}' must be [min, max] integers, got {value!r}")
        low, high = value
        if not 1 <= low <= high:
            raise TargetError(f"{origin}: key 'dynamic.{axis}' = {value} needs 1 <= min <= max")
        if axis in ("height", "width"):
            for bound in value:
                if bound % stride:
                    raise TargetError(f"{origin}: key 'dynamic.{axis}' bound {bound} is not a multiple of {stride}, "
                                      f"the pixel stride of this model")
        if axis == "frames":
            for bound in value:
                _check_frames(origin, f"dynamic.frames bound {bound}", bound, frame_step, spec)
        ranges[axis] = [low, high]
    factor = 2 if guidance != "unguided" and spec.cfg_batch else 1
    if spec.max_denoiser_batch and factor * ranges["batch"][1] > spec.max_denoiser_batch:
        raise TargetError(
            f"{origin}: key 'dynamic.batch' max {ranges['batch'][1]} gives a denoiser batch of "
            f"{factor * ranges['batch'][1]}; {spec.class_name}'s must stay <= {spec.max_denoiser_batch} "
            f"(diffusers' upsampling takes another path from batch 64)")
    if all(low == high for low, high in ranges.values()):
        raise TargetError(f"{origin}: key 'dynamic' covers a single shape; make it a [[shapes]] bucket")
    return ranges
