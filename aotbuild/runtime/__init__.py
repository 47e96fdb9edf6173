"""The lightweight loader: check an artifact against this machine, load its compiled packages,
bind their weights without copies, and swap them into a diffusers pipeline.

One module per concern: `cache` (extracted packages, verified weights, what is trusted),
`weights` (layouts, binding checks, borrowed views), `variant` (one compiled model, and what
the models of one load share), `graphs` (CUDA graphs), `component` (the stand-in module),
`artifacts` (where an artifact is), `coverage` (what a variant serves, in a call's terms),
`refusals` (why a call is not served, in the caller's terms),
`guards` (what a stand-in refuses, and the diffusers pipeline methods that ask first),
`regional` (a regional denoiser: diffusers' forward calling compiled blocks), `step_cache`
(diffusers' step caches, `enable_cache`, on those blocks), `autoencoder` (the
VAE's stand-in: diffusers' encode and decode over the compiled parts), `load` (the public entry
points); where weights and artifacts come from: `sources` (a Hub id, a folder, `random:`), `hub`
(artifacts on the Hub); this process: `openmp` (its threads' spin), `memory` (its RSS).

Imports torch and safetensors (diffusers only when a pipeline is built); never the builder,
torchao or torch._dynamo: what this package imports decides cold start. The names below are
imported on first use: `artifacts`, `coverage` and `cache` need no torch.
"""

from typing import Any

# name: the module defining it. Imported on first use, so that a command reading a manifest
# (`coverage`, `artifacts`, `cache`) imports no torch.
_LAZY = {
    "check_artifact_files": "cache", "clear_package_cache": "cache", "extracted_package": "cache",
    "package_cache_dir": "cache", "package_cache_usage": "cache",
    "CompiledComponent": "component", "Config": "component", "CudaGraph": "graphs", "GraphPool": "graphs",
    "apply": "load", "check_fit": "load", "load_components": "load", "load_pipeline": "load",
    "artifact_folder": "artifacts", "variant_coverage": "coverage",
    "CompiledVariant": "variant", "leaf_name": "variant", "leaf_signature": "variant", "open_model": "variant",
    "load_weights": "weights",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
