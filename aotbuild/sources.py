"""Where a pipeline comes from: a Hub id (at a pinned revision), a local diffusers folder, or
`random:NAME`, a config set under `targets/configs/NAME/` (diffusers folder layout, no weights)
whose models get seeded random weights. All three are read the same way: `model_index.json`
names each component's library and class, each component folder holds its config."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from .errors import SourceError
from .pipelines import PipelineSpec

RANDOM_PREFIX = "random:"
SOURCE_DIRNAME = "source"  # where an artifact keeps the config set of a random source


def is_random(source: str) -> bool:
    return source.startswith(RANDOM_PREFIX)


def config_set_dir(source: str, base_dir: Path) -> Path:
    """The folder of a `random:NAME` source, looked up under `base_dir/configs/`."""
    folder = base_dir / "configs" / source[len(RANDOM_PREFIX):]
    if not (folder / "model_index.json").is_file():
        raise SourceError(f"random source {source!r}: no config set at {folder} (model_index.json missing)")
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
    return _from_configs(source, base_dir, spec.pixel_stride, spec.default_stride)


def max_pixels(spec: PipelineSpec, source: str, base_dir: Path) -> int | None:
    """The largest height and width the model takes (None: no limit of its own)."""
    if spec.max_pixels is None:
        return None
    return _from_configs(source, base_dir, spec.max_pixels, spec.default_max_pixels)


def _from_configs(source: str, base_dir: Path, read: Any, default: Any) -> Any:
    """`read(configs)` where the source's configs are on this machine, else the Hub model's `default`."""
    folder = local_folder(source, base_dir)
    if folder is None:
        return default
    try:
        return read(read_configs(folder))
    except (KeyError, TypeError) as exc:
        raise SourceError(f"source {source!r}: config lacks {exc}") from None


def hub_folder(repo_id: str, revision: str | None, skip: set[str]) -> Path:
    """Download the pipeline from the Hub: configs, tokenizers and the safetensors weights of each
    component except `skip` (never the repo's single-file checkpoints, ONNX or Flax copies)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        index = json.loads(Path(hf_hub_download(repo_id, "model_index.json", revision=revision)).read_text())
        components = [k for k, v in index.items() if isinstance(v, list) and v[0] is not None and k not in skip]
        patterns = ["model_index.json", "*/*.json", "*/*.txt", "*/*.model"]
        patterns += [f"{name}/*.safetensors" for name in components]
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                      ignore_patterns=["*.fp16.safetensors", "*/*.fp16.*"]))
    except Exception as exc:  # huggingface_hub raises many types; all mean the same to the user
        raise SourceError(f"cannot fetch {repo_id}@{revision or 'main'} from the Hub: {exc}") from None


def _component_class(library: str, class_name: str) -> type:
    try:
        return getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        raise SourceError(f"component class {library}.{class_name} is not available") from None


def _random_component(cls: type, folder: Path, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    if hasattr(cls, "config_class"):  # transformers model
        return cls._from_config(cls.config_class.from_pretrained(folder))
    if hasattr(cls, "from_config") and hasattr(cls, "load_config"):  # diffusers model or scheduler
        return cls.from_config(cls.load_config(folder))
    return cls.from_pretrained(folder)  # tokenizers and other weight-less components


def load_components(
    folder: Path, *, seed: int | None, skip: set[str], dtype: Any = None,
) -> dict[str, Any]:
    """Instantiate every component of the diffusers folder except `skip`.

    Args:
        folder: a diffusers pipeline folder (model_index.json plus one folder per component).
        seed: random weights from this seed (config sets), or None to load the folder's weights.
        skip: pipeline attributes not to load (the compiled ones).
        dtype: torch dtype for models.
    """
    import torch

    index = json.loads((folder / "model_index.json").read_text())
    components: dict[str, Any] = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[0] is None:
            continue
        if name in skip:
            continue
        cls = _component_class(*entry)
        sub = folder / name
        if seed is not None:
            obj = _random_component(cls, sub, seed)
        elif issubclass(cls, torch.nn.Module):
            obj = cls.from_pretrained(sub, torch_dtype=dtype)
        else:  # tokenizers, schedulers
            obj = cls.from_pretrained(sub)
        if isinstance(obj, torch.nn.Module):
            if dtype is not None and obj.dtype != dtype:
                obj = obj.to(dtype)
            obj = obj.eval()
        components[name] = obj
    return components


def resolve_folder(source: str, revision: str | None, base_dir: Path, skip: set[str]) -> Path:
    """The diffusers folder of any source kind; Hub sources are downloaded without `skip` weights."""
    folder = local_folder(source, base_dir)
    if folder is None:
        if Path(source).expanduser().exists():
            raise SourceError(f"source {source!r} is a path but holds no model_index.json")
        folder = hub_folder(source, revision, skip)
    return folder


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
