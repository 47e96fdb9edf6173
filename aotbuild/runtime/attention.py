"""aotbuild's attention kernel at load: `aotbuild::attention`, registered from the library an
artifact carries (`LIBRARY_FILE`, built with `optimize.sdpa = "aotbuild"`), which its compiled
code calls in place of ATen's CPU flash attention (`builder/attention.py` makes it)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import warnings
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


_LOCK = threading.Lock()
_LOADED: list[str] = []  # the sha256 of the library registered in this process


def load_library(path: Path, sha256: str | None = None) -> None:
    """Register `aotbuild::attention` from the library at `path` (an artifact's file as checked:
    `/proc/self/fd/N`, opened as is, not by its name again; `sha256`, its checked hash, else read
    here), with its shape function for export and compile. Once per process: torch refuses a
    second library registering the namespace, so a library of other content asked for later
    (another artifact's kernel) is not loaded, and said.

    Raises:
        OSError: the library cannot be loaded (not this platform's).
    """
    digest = sha256 or hashlib.sha256(Path(path).read_bytes()).hexdigest()
    with _LOCK:
        if registered():
            if _LOADED and _LOADED[0] != digest:
                warnings.warn(f"aotbuild: this process runs the attention kernel it loaded first (sha256 "
                              f"{_LOADED[0][:16]}), not {path}'s ({digest[:16]}): one kernel per process",
                              stacklevel=3)
            return
        ctypes.CDLL(os.fspath(path))  # registers the operator (its TORCH_LIBRARY)
        _LOADED.append(digest)

        @torch.library.register_fake("aotbuild::attention")
        def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
            batch, heads, tokens, head_size = query.shape
            return query.new_empty((batch, tokens, heads, head_size))
