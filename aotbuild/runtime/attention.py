"""aotbuild's attention kernel at load: `aotbuild::attention`, registered from the library an
artifact carries (`LIBRARY_FILE`, built with `optimize.sdpa = "aotbuild"`), which its compiled
code calls in place of ATen's CPU flash attention (`builder/attention.py` makes it)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

LIBRARY_FILE = "kernels/attention_cpu.so"  # in an artifact
# The CPU flags (as /proc/cpuinfo names them) the kernel's code needs: AVX512-BF16's dot products.
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def missing_cpu_flags() -> list[str]:
    """The CPU flags the attention kernel needs that this machine lacks."""
    from ..spec.manifest import cpu_isa_flags

    return [flag for flag in CPU_FLAGS if flag not in cpu_isa_flags()]


def registered() -> bool:
    """Whether `aotbuild::attention` is registered in this process."""
    return hasattr(torch.ops.aotbuild, "attention")


def load_library(path: Path) -> None:
    """Register `aotbuild::attention` from the library at `path`, once per process (torch refuses
    a second library registering the namespace), with its shape function for export and compile."""
    if registered():
        return
    torch.ops.load_library(os.fspath(path))

    @torch.library.register_fake("aotbuild::attention")
    def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        batch, heads, tokens, head_size = query.shape
        return query.new_empty((batch, tokens, heads, head_size))
