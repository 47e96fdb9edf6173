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

from .targets import Target

Progress = Callable[[str, str], None]


def print_progress(stage: str, message: str) -> None:
    print(f"[{stage:>9}] {message}", file=sys.stderr, flush=True)


@dataclass
class BuildResult:
    folder: Path
    manifest: dict[str, Any]
    skipped: bool = False
    timings: dict[str, float] = field(default_factory=dict)


def _status_mib(key: str) -> float | None:
    """A size from /proc/self/status (VmRSS, VmHWM), MiB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> None:
    """Start VmHWM (the process's peak RSS) again from its current RSS (Linux 4.0+), so that each
    stage's peak is its own; where it cannot be reset, a stage's peak is the process's so far."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


class Stages:
    """Times each stage (summed over repeats) and reports it through `progress`, with each stage's
    peak host RSS (Linux) and, on a CUDA build, peak GPU memory (the highest over its repeats):
    where a real-size build's memory goes."""

    def __init__(self, progress: Progress, cuda: bool = False) -> None:
        self.progress = progress
        self.cuda = cuda
        self.timings: dict[str, float] = {}
        self.peak_gpu_mib: dict[str, float] = {}
        self.peak_rss_mib: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str, message: str) -> Iterator[None]:
        self.progress(stage, message)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        _reset_peak_rss()
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        self.timings[stage] = self.timings.get(stage, 0.0) + elapsed
        suffix = ""
        if (rss := _status_mib("VmHWM")) is not None:
            self.peak_rss_mib[stage] = round(max(rss, self.peak_rss_mib.get(stage, 0.0)), 1)
            suffix = f", peak RSS {rss / 1024:.1f} GiB"
        if self.cuda:
            peak = torch.cuda.max_memory_allocated() / 2**20
            self.peak_gpu_mib[stage] = round(max(peak, self.peak_gpu_mib.get(stage, 0.0)), 1)
            suffix += f", peak GPU memory {peak / 1024:.1f} GiB"
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

