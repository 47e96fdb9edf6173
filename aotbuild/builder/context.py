"""What every step of a build shares: progress reporting and stage timings, the result."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..targets import Target

Progress = Callable[[str, str], None]


def print_progress(stage: str, message: str) -> None:
    print(f"[{stage:>9}] {message}", file=sys.stderr, flush=True)


@dataclass
class BuildResult:
    folder: Path
    manifest: dict[str, Any]
    skipped: bool = False
    timings: dict[str, float] = field(default_factory=dict)


class Stages:
    """Times each stage (summed over repeats) and reports it through `progress`; on a CUDA build
    also each stage's peak GPU memory (the highest over its repeats)."""

    def __init__(self, progress: Progress, cuda: bool = False) -> None:
        self.progress = progress
        self.cuda = cuda
        self.timings: dict[str, float] = {}
        self.peak_gpu_mib: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str, message: str) -> Iterator[None]:
        self.progress(stage, message)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        self.timings[stage] = self.timings.get(stage, 0.0) + elapsed
        suffix = ""
        if self.cuda:
            peak = torch.cuda.max_memory_allocated() / 2**20
            self.peak_gpu_mib[stage] = round(max(peak, self.peak_gpu_mib.get(stage, 0.0)), 1)
            suffix = f", peak GPU memory {peak / 1024:.1f} GiB"
        self.progress(stage, f"done in {elapsed:.1f}s{suffix}")


@dataclass
class BuildContext:
    """What the export, compile and package steps of one build read, passed as one: the target,
    the artifact's staging folder, progress and timings, the compile options, and, once captured,
    the calls each variant is exported at (`examples`) and checked against (`reference`, by capture
    point), each variant's dims by component, and the guidance the denoiser's variants serve."""

    target: Target
    out: Path
    stages: Stages
    inductor_options: dict[str, Any]
    examples: dict[str, dict[str, Any]] = field(default_factory=dict)
    reference: dict[str, dict[str, Any]] = field(default_factory=dict)
    dims: dict[str, dict[str, tuple]] = field(default_factory=dict)
    modes: tuple[bool, ...] = ()

