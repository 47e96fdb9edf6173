"""The lightweight loader: check an artifact against this machine, load its compiled packages,
bind their weights without copies, and swap them into a diffusers pipeline.

One module per concern: `cache` (extracted packages, verified weights, what is trusted),
`weights` (layouts, binding checks, borrowed views), `variant` (one compiled model, and what
the models of one load share), `graphs` (CUDA graphs), `component` (the stand-in module),
`refusals` (why a call is not served, in the caller's terms),
`guards` (what a stand-in refuses, and the diffusers pipeline methods that ask first),
`regional` (a regional denoiser: diffusers' forward calling compiled blocks), `step_cache`
(diffusers' step caches, `enable_cache`, on those blocks), `autoencoder` (the
VAE's stand-in: diffusers' encode and decode over the compiled parts), `load` (the public entry
points).

Imports torch and safetensors (diffusers only when a pipeline is built); never the builder,
torchao or torch._dynamo: what this package imports decides cold start.
"""

from .cache import (
    check_artifact_files,
    clear_package_cache,
    extracted_package,
    package_cache_dir,
    package_cache_usage,
)
from .component import CompiledComponent, Config
from .graphs import CudaGraph, GraphPool
from .load import apply, artifact_folder, check_fit, load_components, load_pipeline
from .refusals import variant_coverage
from .variant import CompiledVariant, leaf_name, leaf_signature, open_model
from .weights import load_weights

__all__ = [
    "CompiledComponent", "CompiledVariant", "Config", "CudaGraph", "GraphPool", "apply", "artifact_folder", "check_fit",
    "check_artifact_files", "clear_package_cache", "extracted_package", "load_components", "load_pipeline",
    "load_weights", "leaf_name", "leaf_signature", "open_model", "package_cache_dir", "package_cache_usage",
    "variant_coverage",
]
