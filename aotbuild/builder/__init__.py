"""The build side: a target file into an artifact folder.

`targets` (a TOML file into a validated `Target`), `optimize` (the passes), `capture` (every call a
component gets while the real pipeline runs), `regions` (a denoiser's repeated blocks), `export`
(torch.export and AOTInductor for one component), and the build itself, a file per step: `flow`
(the whole build, read top to bottom), `transaction`, `plan`, `capturing`, `packaging`,
`regional`, `validate`, `record`, `context`.

`build`, `is_fresh` and `check_device` are imported on first use, so that reading a target
(`aotbuild.builder.targets`) imports no torch.
"""

from typing import Any

_LAZY = {"build": "flow", "is_fresh": "flow", "check_device": "flow"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
