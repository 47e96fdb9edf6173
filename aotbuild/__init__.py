"""aotbuild: ahead-of-time compiled diffusers pipelines that start at full speed.

Public API: `load_pipeline`, `apply`, `build`, `load_target`, `Target` and the errors. Heavy
modules (torch, diffusers) are imported on first use, not at `import aotbuild`.
"""

from __future__ import annotations

from typing import Any

from .errors import (
    AotbuildError,
    ArtifactError,
    BuildError,
    CorruptArtifactError,
    HubError,
    IncompatibleArtifactError,
    LossyInputError,
    MissingAttributeError,
    NoMatchingVariantError,
    NumericsError,
    PrecisionError,
    ShapeNotSupportedError,
    SourceError,
    TargetError,
    UnsupportedCallError,
    UntrustedCodeError,
    WeightsMismatchError,
)
from .runtime.openmp import spin_before_torch as _spin_before_torch

# OpenMP's threads spin briefly in this process when it imports aotbuild before torch: libgomp
# reads the setting once, as torch loads it, and a long spin costs processes sharing the cores up
# to 1.5x (runtime/openmp.py). Nothing else is set at import.
_spin_before_torch()

__version__ = "0.1.0"

_LAZY = {
    "load_pipeline": "runtime", "apply": "runtime",
    "build": "builder",
    "Target": "builder.targets", "load_target": "builder.targets", "list_targets": "builder.targets",
}

__all__ = [
    "AotbuildError", "ArtifactError", "BuildError", "CorruptArtifactError", "HubError", "IncompatibleArtifactError",
    "LossyInputError", "MissingAttributeError", "NoMatchingVariantError", "NumericsError", "PrecisionError",
    "ShapeNotSupportedError", "SourceError", "TargetError", "UnsupportedCallError", "UntrustedCodeError",
    "WeightsMismatchError", *_LAZY,
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'aotbuild' has no attribute {name!r}")
