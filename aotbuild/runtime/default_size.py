"""The size a compiled pipeline makes when a call gives none, at run time.

The build decides it (`builder.capturing.default_pixels`, recorded as the manifest's
`runtime.default_pixels`): the pipeline's own default when a variant covers it, else the first
square bucket. Here the loaded pipeline is made to serve that size, wherever diffusers reads its
default from, and keeps it across `from_pipe`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .component import CompiledComponent, Config
from .guards import StandIn


def served_default(manifest: dict[str, Any]) -> tuple[int, int] | None:
    """(served, native) pixels when the build chose another default size than the pipeline's own
    (`default_pixels` in the manifest's runtime record), else None."""
    sizes = manifest["runtime"].get("default_pixels") or {}
    served, native = sizes.get("served"), sizes.get("native")
    return (served, native) if served is not None and served != native else None


def serve_default_size(manifest: dict[str, Any], modules: dict[str, Any]) -> None:
    """When no variant covers the size a pipeline makes by default, the compiled denoiser reports
    the size the build chose instead as its `sample_size`, which the pipelines read for their
    default; a warning says so once per load, naming both sizes."""
    if (sizes := served_default(manifest)) is None:
        return
    served, native = sizes
    warnings.warn(f"aotbuild: this artifact does not cover {manifest['target']['pipeline']}'s own default size, "
                  f"{native}x{native} px; a call that gives no height and width makes {served}x{served} px (the "
                  f"artifact's first square bucket) instead", stacklevel=2)
    for module in modules.values():
        if isinstance(module, CompiledComponent) and "sample_size" in module.config:
            factor = native // module.config["sample_size"] if module.config["sample_size"] else 0
            if factor and not served % factor:
                module.config = Config({**module.config, "sample_size": served // factor})


def set_pipeline_default_size(pipe: Any, manifest: dict[str, Any]) -> None:
    """Pipelines that keep their default size in `default_sample_size` (SDXL, SD3, Flux) get the
    served one too (Flux's is a constant, not read from the model's config)."""
    sizes = served_default(manifest)
    factor = getattr(pipe, "vae_scale_factor", None)
    if sizes is not None and factor and hasattr(pipe, "default_sample_size"):
        pipe.default_sample_size = sizes[0] // factor


def keeping_default_size(from_pipe: Callable[..., Any]) -> Callable[..., Any]:
    """`from_pipe` whose pipeline, when it holds compiled components, keeps its source's default
    size (Flux's img2img sibling would reset it to the class's constant, a size the artifact may
    not cover)."""

    def keeping(cls: type, pipeline: Any, **kwargs: Any) -> Any:
        made = from_pipe(cls, pipeline, **kwargs)
        compiled = any(isinstance(m, StandIn) for m in made.components.values())
        same_scale = getattr(made, "vae_scale_factor", None) == getattr(pipeline, "vae_scale_factor", None)
        if compiled and same_scale and hasattr(made, "default_sample_size") \
                and hasattr(pipeline, "default_sample_size"):
            made.default_sample_size = pipeline.default_sample_size
        return made

    return keeping
