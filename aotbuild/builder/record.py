"""What the manifest records besides the components: the environment, the source read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..runtime import sources
from ..spec.manifest import environment
from . import export
from .targets import Target


def permuted_inputs(components: dict[str, Any]) -> bool:
    """Whether an input is laid out as a permutation (older runtimes would make it contiguous)."""
    entries = [*components.values(), *(r for c in components.values() for r in c.get("regions", ()))]
    return any(isinstance(leaf.get("layout"), list) for e in entries for v in e["variants"] for leaf in v["inputs"])


def build_environment(target: Target, inductor_options: dict[str, Any]) -> dict[str, Any]:
    """This machine's fingerprint, plus what the build decided about its code: whether the kernels
    carry PTX for later GPUs (the compatibility check and the Hub variant name read it from here),
    which CPU baseline the host code of a CUDA build targets, and the Triton that made the kernels;
    a CPU build for a `cpu_baseline` records the baseline's ISA and flags, which loading checks."""
    env = environment(target.device)
    if target.cpu_baseline:
        baseline = export.CPU_BASELINES[target.cpu_baseline]
        env.update(cpu_baseline=target.cpu_baseline, cpu_isa=baseline.isa, cpu_flags=list(baseline.flags))
    if target.gpu is not None:
        env["gpu_multi_arch"] = target.gpu.multi_arch
    if target.device == "cuda":
        env["host_march"] = inductor_options.get(export.MARCH_OPTION, "native")
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


def source_record(target: Target, folder: Path | None = None) -> dict[str, Any]:
    """Where the pipeline came from: a Hub id and revision, a random config set and seed, or a
    local folder by its name only (its path would tie the artifact to this machine); and what its
    weights were (`sources.source_identity`: the commit, or the folder's fingerprint), from the
    `folder` read, else as the source is now."""
    return {"id": sources.recorded_source(target.source, target.base_dir), "revision": target.revision,
            "seed": target.seed if sources.is_random(target.source) else None,
            **sources.source_identity(target.source, target.revision, target.base_dir, folder)}
