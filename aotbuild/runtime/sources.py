"""Where a pipeline comes from: a Hub id (at a pinned revision), a local diffusers folder, or
`random:NAME`, a config set under `targets/configs/NAME/` (diffusers folder layout, no weights)
whose models get seeded random weights. All three are read the same way: `model_index.json`
names each component's library and class, each component folder holds its config."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

from ..errors import SourceError
from ..spec.pipelines import PipelineSpec

RANDOM_PREFIX = "random:"
LOCAL_PREFIX = "local:"  # how a manifest names a local folder source: by its name, never its path
SOURCE_DIRNAME = "source"  # where an artifact keeps the config set of a random source
HALF_DTYPES = ("float16", "bfloat16")
# diffusers' and transformers' variant file names: model.fp16.safetensors, model.fp16-00001-of-00002.safetensors
FP16_FILE = re.compile(r"\.fp16[.-][^/]*safetensors$")
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(@[\w./-]+)?")  # org/name[@revision]


def hub_id_form(text: str) -> bool:
    """Whether `text` is written as a Hub id (`org/name[@revision]`), not as a path on this machine
    (absolute, `./`, `~/` or deeper than one folder): where nothing is at that path, it names the
    Hub only in this form, and a missing folder is said to be missing, not a malformed repo id."""
    return HUB_ID.fullmatch(text) is not None and not text.startswith((".", "~"))


def is_random(source: str) -> bool:
    return source.startswith(RANDOM_PREFIX)


def is_local_record(source: str) -> bool:
    """Whether a manifest's source id names a local folder (`local:NAME`)."""
    return source.startswith(LOCAL_PREFIX)


def recorded_source(source: str, base_dir: Path) -> str:
    """What a manifest records of the source: the source itself, or `local:NAME` for a local
    folder. A machine path would tie the artifact to the build machine and leak into Hub pushes."""
    folder = None if is_random(source) else local_folder(source, base_dir)
    return f"{LOCAL_PREFIX}{folder.resolve().name}" if folder is not None else source


def source_identity(source: str, revision: str | None, base_dir: Path, folder: Path | None = None) -> dict[str, str]:
    """What the weights of a source are, beyond its name: the commit a Hub revision resolves to
    (`folder`: the snapshot a build read, else resolved now), or a fingerprint of a local folder's
    files (their names and sha256, each file hashed once per identity). A build records it, and a
    build whose source's identity moved is not fresh. Empty for a random config set (the
    artifact keeps that set's files, compared one by one).

    Raises:
        SourceError: a Hub revision that cannot be resolved (offline with nothing cached).
    """
    if is_random(source):
        return {}
    local = local_folder(source, base_dir)
    if local is not None:
        return {"fingerprint": folder_fingerprint(local)}
    if folder is not None and folder.parent.name == "snapshots":
        return {"commit": folder.name}
    return {"commit": hub_commit(source, revision)}


def folder_fingerprint(folder: Path) -> str:
    """sha256 over each file's path in the folder and its sha256 (hidden files left out)."""
    import hashlib

    from .cache import file_sha256

    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        if not any(part.startswith(".") for part in relative.split("/")):
            digest.update(f"{relative}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def hub_commit(repo_id: str, revision: str | None) -> str:
    """The commit a Hub revision (a branch, a tag, or a commit itself) resolves to, now; offline
    (HF_HUB_OFFLINE=1), the one the cache last resolved it to."""
    from .hub import commit_of

    try:
        return commit_of(repo_id, revision, "model_index.json")
    except Exception as exc:  # huggingface_hub raises many types; all mean the same to the user
        raise SourceError(f"cannot resolve {repo_id}@{revision or 'main'} on the Hub: {exc}") from None


def config_set_dir(source: str, base_dir: Path) -> Path:
    """The folder of a `random:NAME` source, looked up under `base_dir/configs/`."""
    folder = base_dir / "configs" / source[len(RANDOM_PREFIX):]
    if not (folder / "model_index.json").is_file():
        raise SourceError(f"random source {source!r}: no config set at {folder} (model_index.json missing)",
                          hint="random: config sets are looked up in configs/ beside the target file: copy the "
                               "set there (aotbuild's are in its targets/configs/)")
    return folder


def local_folder(source: str, base_dir: Path) -> Path | None:
    """The folder holding the source's configs when it is on this machine, else None (Hub id)."""
    if is_random(source):
        return config_set_dir(source, base_dir)
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = base_dir / path if (base_dir / path).exists() else path
    return path if (path / "model_index.json").is_file() else None


def read_configs(folder: Path) -> dict[str, dict]:
    """Each component's config.json (scheduler_config.json for schedulers), by component name."""
    configs = {}
    for name in json.loads((folder / "model_index.json").read_text()):
        for filename in ("config.json", "scheduler_config.json"):
            if (folder / name / filename).is_file():
                configs[name] = json.loads((folder / name / filename).read_text())
                break
    return configs


def pixel_stride(spec: PipelineSpec, source: str, base_dir: Path) -> int:
    """Height and width must be multiples of this; read from the configs when they are local."""
    return from_configs(source, base_dir, spec.pixel_stride, spec.default_stride)


def max_pixels(spec: PipelineSpec, source: str, base_dir: Path) -> int | None:
    """The largest height and width the model takes (None: no limit of its own)."""
    if spec.max_pixels is None:
        return None
    return from_configs(source, base_dir, spec.max_pixels, spec.default_max_pixels)


def from_configs(source: str, base_dir: Path, read: Any, default: Any) -> Any:
    """`read(configs)` where the source's configs are on this machine, else the Hub model's `default`."""
    folder = local_folder(source, base_dir)
    if folder is None:
        return default
    try:
        return read(read_configs(folder))
    except (KeyError, TypeError) as exc:
        raise SourceError(f"source {source!r}: config lacks {exc}") from None


def hub_folder(repo_id: str, revision: str | None, skip: set[str], dtype: str | None = None) -> Path:
    """Download the pipeline from the Hub: configs, tokenizers and the safetensors weights of each
    component except `skip` (never the repo's single-file checkpoints, ONNX or Flax copies). A
    float16 or bfloat16 pipeline takes each component's fp16 variant files where the repo has them
    (half the bytes: 5 GB instead of 10 GB for SDXL's UNet), the full ones otherwise. Offline
    (HF_HUB_OFFLINE=1), the cached snapshot of that revision is used as it is."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download

    from .hub import hub_api, hub_endpoint

    try:
        endpoint = hub_endpoint()
        index = json.loads(Path(hf_hub_download(repo_id, "model_index.json", revision=revision,
                                                endpoint=endpoint)).read_text())
        components = [k for k, v in index.items() if is_component(v) and k not in skip]
        patterns = ["model_index.json", "*/*.json", "*/*.txt", "*/*.model"]
        if not constants.HF_HUB_OFFLINE:
            files = hub_api().list_repo_files(repo_id, revision=revision)
            patterns += [f for name in components for f in _weights_files(files, name, dtype in HALF_DTYPES)]
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, endpoint=endpoint))
    except Exception as exc:  # huggingface_hub raises many types; all mean the same to the user
        raise SourceError(f"cannot fetch {repo_id}@{revision or 'main'} from the Hub: {exc}") from None


def _weights_files(files: list[str], component: str, half: bool) -> list[str]:
    """The safetensors files of one component folder to use: its fp16 variant for a half-precision
    pipeline (or when the folder has nothing else), else the full-precision files."""
    weights = [f for f in files if f.startswith(f"{component}/") and f.count("/") == 1 and f.endswith(".safetensors")]
    fp16 = [f for f in weights if FP16_FILE.search(f)]
    return fp16 if fp16 and (half or len(fp16) == len(weights)) else [f for f in weights if f not in fp16]


# safetensors' dtype names of floating point tensors, as torch names them.
SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def stored_dtype(folder: Path, component: str) -> str | None:
    """The floating point dtype a component of a diffusers folder is stored in (the one most of
    its bytes have, in the files a load reads: `_weights_files`), from the safetensors headers
    alone; None when it has no safetensors files."""
    chosen = _weights_files([f"{component}/{p.name}" for p in (folder / component).glob("*.safetensors")],
                            component, False)
    stored: dict[str, int] = {}
    for name in chosen:
        with open(folder / name, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for key, record in header.items():
            if key != "__metadata__" and record.get("dtype") in SAFETENSORS_FLOATS:
                start, end = record["data_offsets"]
                stored[SAFETENSORS_FLOATS[record["dtype"]]] = stored.get(SAFETENSORS_FLOATS[record["dtype"]], 0) + \
                    end - start
    return max(stored, key=stored.get) if stored else None


def is_component(entry: Any) -> bool:
    """Whether a model_index.json entry names a component (`["diffusers", "AutoencoderKL"]`), not
    a value of the pipeline's config (Krea 2's `text_encoder_select_layers = [0, 1, 2]`) or none."""
    return isinstance(entry, list) and len(entry) == 2 and all(isinstance(part, str) for part in entry)


def component_classes(folder: Path) -> dict[str, type]:
    """The class of each component model_index.json names (importing its module)."""
    index = json.loads((folder / "model_index.json").read_text())
    return {name: _component_class(*entry) for name, entry in index.items()
            if not name.startswith("_") and is_component(entry)}


def _component_class(library: str, class_name: str) -> type:
    # A library that is a diffusers pipeline module's name holds a component of that pipeline's own
    # (StableUnCLIP's `["stable_diffusion", "StableUnCLIPImageNormalizer"]`), as diffusers reads it.
    for module in (library, f"diffusers.pipelines.{library}"):
        try:
            return getattr(importlib.import_module(module), class_name)
        except (ImportError, AttributeError):
            continue
    raise SourceError(f"component class {library}.{class_name} is not available")


# Seconds this process spent giving models random weights: work a real source does not do (it
# reads weights instead), which `aotbuild bench` keeps out of its timed windows.
_random_init_seconds = 0.0


def random_init_seconds() -> float:
    """Seconds this process has spent so far creating random-weight models (`random:` sources)."""
    return _random_init_seconds


def _random_component(cls: type, folder: Path, seed: int) -> Any:
    import time

    import torch

    global _random_init_seconds
    start = time.perf_counter()
    # The caller's random state is left as it was: the seed is for these weights only.
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if hasattr(cls, "config_class"):  # transformers model
                return cls._from_config(cls.config_class.from_pretrained(folder))
            if hasattr(cls, "from_config") and hasattr(cls, "load_config"):  # diffusers model or scheduler
                made = cls.from_config(cls.load_config(folder))
                if "ControlNet" in cls.__name__:
                    _unzeroed(made)
                return made
            return weightless(cls, folder)
    finally:
        _random_init_seconds += time.perf_counter() - start


def _unzeroed(model: Any) -> None:
    """Seeded random values for a fresh ControlNet's zero-initialized weights (its zero
    convolutions, made so that training starts from the base model): with them zero it adds
    nothing, and a random ControlNet should steer the image as a trained one does."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1 and not parameter.any():
                parameter.normal_(0.0, parameter[0].numel() ** -0.5)


def weightless(cls: type, folder: Path) -> Any:
    """A config set's tokenizer, scheduler or processor, from its files. A processor with a video
    part (Qwen2-VL's, Qwen-Image-Edit's) needs torchvision for it even when fed images only; where
    torchvision is not installed, the config set's processor is its image part (PIL backend) and its
    tokenizer, which is all an image pipeline calls."""
    if not cls.__module__.startswith("transformers"):
        return cls.from_pretrained(folder)
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import is_torchvision_available

    video = issubclass(cls, ProcessorMixin) and "video_processor" in cls.get_attributes()
    if not video or is_torchvision_available():
        return cls.from_pretrained(folder)
    images_only = type(cls.__name__, (cls,), {"check_argument_for_proper_class": _check_present_parts})
    return images_only(image_processor=AutoImageProcessor.from_pretrained(folder, backend="pil"),
                       tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None)


def _check_present_parts(processor: Any, name: str, part: Any) -> Any:
    # transformers checks each part's class; without torchvision the video class cannot be imported.
    from transformers.processing_utils import ProcessorMixin

    return None if part is None else ProcessorMixin.check_argument_for_proper_class(processor, name, part)


def load_components(
    folder: Path, *, seed: int | None, skip: set[str], dtype: Any = None, half_files: bool = False,
) -> dict[str, Any]:
    """Instantiate every component of the diffusers folder except `skip`.

    Args:
        folder: a diffusers pipeline folder (model_index.json plus one folder per component).
        seed: random weights from this seed (config sets), or None to load the folder's weights.
        skip: pipeline attributes not to load (the compiled ones).
        dtype: torch dtype for models.
        half_files: read a component's fp16 variant files where it has them (a half-precision
            target: the files `hub_folder` downloads for it).
    """
    import torch

    components: dict[str, Any] = {}
    same_class: dict[type, int] = {}  # two models of one class (Wan 2.2's experts) get weights of their own
    for name, cls in component_classes(folder).items():
        instance = same_class[cls] = same_class.get(cls, -1) + 1
        if name in skip:
            continue
        sub = folder / name
        if seed is not None:
            obj = _random_component(cls, sub, seed + instance)
        elif issubclass(cls, torch.nn.Module):
            chosen = _weights_files([f"{name}/{p.name}" for p in sub.glob("*.safetensors")], name, half_files)
            fp16 = bool(chosen) and FP16_FILE.search(chosen[0]) is not None  # all variant files or none
            obj = cls.from_pretrained(sub, torch_dtype=dtype, variant="fp16" if fp16 else None)
        else:  # tokenizers, schedulers
            obj = cls.from_pretrained(sub)
        if isinstance(obj, torch.nn.Module):
            if dtype is not None and obj.dtype != dtype:
                obj = obj.to(dtype)
            obj = obj.eval()
        components[name] = obj
    return components


def resolve_folder(source: str, revision: str | None, base_dir: Path, skip: set[str],
                   dtype: str | None = None) -> Path:
    """The diffusers folder of any source kind; Hub sources are downloaded without `skip` weights,
    in the files that suit `dtype` (see `hub_folder`)."""
    folder = local_folder(source, base_dir)
    if folder is None:
        if Path(source).expanduser().exists():
            raise SourceError(f"source {source!r} is a path but holds no model_index.json")
        folder = hub_folder(source, revision, skip, dtype)
    return folder


def beside_target(source: str, base_dir: Path) -> Path:
    """A target's path as written: relative to the target's folder (`base_dir`) where something is
    there, else as given (relative to the working folder, `~` expanded)."""
    path = Path(source).expanduser()
    return base_dir / path if not path.is_absolute() and (base_dir / path).exists() else path


def load_model(source: str, base_dir: Path, dtype: Any, half_files: bool = False) -> Any:
    """One diffusers model from its own folder or Hub model repo (`org/name[@revision]`): a config.json
    and its safetensors, the fp16 variant files for a half-precision target where it has them (a
    target's `controlnet`). Its class is its config's `_class_name`."""
    import diffusers

    path = beside_target(source, base_dir)
    if not (path / "config.json").is_file():
        if path.exists():
            raise SourceError(f"model source {source!r} is a path but holds no config.json")
        path = _hub_model_folder(source, half_files)
    class_name = json.loads((path / "config.json").read_text()).get("_class_name", "")
    cls = getattr(diffusers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        raise SourceError(f"model source {source!r}: its config names {class_name!r}, not a diffusers model class")
    chosen = _weights_files([f"./{p.name}" for p in path.glob("*.safetensors")], ".", half_files)
    fp16 = bool(chosen) and FP16_FILE.search(chosen[0]) is not None
    return cls.from_pretrained(path, torch_dtype=dtype, variant="fp16" if fp16 else None)


def _hub_model_folder(source: str, half_files: bool) -> Path:
    """A Hub model repo's config and the safetensors files `load_model` reads."""
    from huggingface_hub import constants, snapshot_download

    from .hub import hub_api, hub_endpoint, parse_repo

    repo_id, revision = parse_repo(source)
    try:
        patterns = ["config.json"]
        if not constants.HF_HUB_OFFLINE:
            files = [f"./{f}" for f in hub_api().list_repo_files(repo_id, revision=revision) if "/" not in f]
            patterns += [f[2:] for f in _weights_files(files, ".", half_files)]
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, endpoint=hub_endpoint()))
    except Exception as exc:  # huggingface_hub raises many types; all mean the same to the user
        raise SourceError(f"cannot fetch the model {repo_id}@{revision or 'main'} from the Hub: {exc}") from None


def assemble_pipeline(spec: PipelineSpec, folder: Path, components: dict[str, Any]) -> Any:
    """The pipeline object from its components, with model_index.json's absent components (null)
    as None and its plain options (e.g. requires_safety_checker) passed when the class takes them."""
    import inspect

    import diffusers

    cls = getattr(diffusers, spec.class_name)
    params = inspect.signature(cls.__init__).parameters
    index = json.loads((folder / "model_index.json").read_text())
    kwargs = {k: (None if isinstance(v, list) else v) for k, v in index.items()
              if k in params and (not isinstance(v, list) or v[0] is None)}
    return cls(**kwargs, **components)


RANDOM_IP_ADAPTER = "random"  # a target's ip_adapter: a seeded one of the plain form, for the source's UNet


def ip_adapter_arguments(source: str, base_dir: Path) -> dict[str, Any]:
    """A target's `ip_adapter` as `load_ip_adapter` takes it: a weights file in a Hub repo
    (`org/name/subfolder/file.safetensors[@revision]`) or on this machine (its image encoder, if
    the pipeline has none, in the folder's `image_encoder`)."""
    path = beside_target(source, base_dir)
    if path.is_file():
        return {"pretrained_model_name_or_path_or_dict": str(path.parent), "subfolder": "", "weight_name": path.name}
    text, _, revision = source.partition("@")
    parts = text.split("/")
    if len(parts) < 3 or not parts[-1].endswith((".safetensors", ".bin")) or path.exists():
        raise SourceError(f"ip_adapter {source!r}: neither a weights file on this machine nor one in a Hub repo "
                          f"(org/name/subfolder/weights.safetensors[@revision])")
    return {"pretrained_model_name_or_path_or_dict": "/".join(parts[:2]), "subfolder": "/".join(parts[2:-1]),
            "weight_name": parts[-1], **({"revision": revision} if revision else {})}


def random_ip_adapter(model: Any, image_embed_dim: int, seed: int) -> dict[str, dict[str, Any]]:
    """A seeded IP-Adapter of the plain form (an image projection to 4 tokens) for a UNet or a Flux
    transformer, as its weights file holds it: `to_k_ip`/`to_v_ip` for each attention that takes
    one, in the model's processor order (a UNet's cross-attentions, numbered 1, 3, 5, ...; Flux's
    double-stream blocks, 0, 1, 2, ..., with biases), and the projection's `proj` and `norm`."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * shape[-1] ** -0.5

    config, adapter = model.config, {}
    flux = "joint_attention_dim" in config
    width = config.joint_attention_dim if flux else config.cross_attention_dim  # what to_k_ip takes
    layers = [name for name in model.attn_processors if not name.startswith("single_transformer_blocks")
              and not name.endswith("attn1.processor")]
    for i, name in enumerate(layers):
        key = i if flux else 2 * i + 1
        if flux:
            hidden = config.num_attention_heads * config.attention_head_dim  # its inner_dim
        else:
            block, index = name.split(".")[0], int(name.split(".")[1]) if not name.startswith("mid_block") else 0
            hidden = {"mid_block": config.block_out_channels[-1], "down_blocks": config.block_out_channels[index],
                      "up_blocks": list(reversed(config.block_out_channels))[index]}[block]
        for part in ("to_k_ip", "to_v_ip"):
            adapter[f"{key}.{part}.weight"] = weight(hidden, width)
            if flux:
                adapter[f"{key}.{part}.bias"] = weight(1, hidden)[0]
    projection = {"proj.weight": weight(4 * width, image_embed_dim), "proj.bias": torch.zeros(4 * width),
                  "norm.weight": torch.ones(width), "norm.bias": torch.zeros(width)}
    return {"image_proj": projection, "ip_adapter": adapter}


def load_ip_adapter(pipe: Any, source: str, base_dir: Path, seed: int, image_encoder: str | None = None) -> None:
    """The target's IP-Adapter loaded into its pipeline (diffusers' `load_ip_adapter`), with the
    image encoder the target names (`image_encoder`) where the pipeline has none."""
    if image_encoder is not None and getattr(pipe, "image_encoder", None) is None:
        pipe.register_modules(image_encoder=load_image_encoder(image_encoder, base_dir, pipe.dtype))
    if source == RANDOM_IP_ADAPTER:
        encoder = getattr(pipe, "image_encoder", None)
        if encoder is None:
            raise SourceError("ip_adapter = \"random\" makes an adapter for the source's image encoder, and its "
                              "pipeline has none (image_encoder)")
        denoiser = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
        pipe.load_ip_adapter(random_ip_adapter(denoiser, encoder.config.projection_dim, seed),
                             subfolder="", weight_name="")
        return
    try:
        pipe.load_ip_adapter(**ip_adapter_arguments(source, base_dir))
    except (OSError, ValueError, RuntimeError) as exc:  # a missing file or repo, no adapter, other widths
        raise SourceError(f"cannot load the IP-Adapter {source!r}: {exc}") from None


def load_image_encoder(source: str, base_dir: Path, dtype: Any) -> Any:
    """A CLIP image encoder (`CLIPVisionModelWithProjection`) from a folder or Hub repo (`org/name[@revision]`)."""
    from transformers import CLIPVisionModelWithProjection

    path = beside_target(source, base_dir)
    from .hub import parse_repo

    name, revision = (str(path), None) if path.exists() else parse_repo(source)
    try:
        return CLIPVisionModelWithProjection.from_pretrained(name, revision=revision, torch_dtype=dtype).eval()
    except OSError as exc:
        raise SourceError(f"cannot load the image encoder {source!r}: {exc}") from None
