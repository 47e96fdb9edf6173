"""The statistics every bench reports: median and spread over repetitions, ratios paired by
repetition (so drift between repetitions cancels), quartiles and percentiles."""

from __future__ import annotations

import statistics
from typing import Any


def summarize(values: list[float | None]) -> dict[str, Any]:
    """Median and spread of one figure over repetitions (None values, e.g. no CUDA, are dropped)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "values": values}
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "values": values}


def ratios_to_aot(runs: dict[str, list[dict[str, Any]]], figures: tuple[str, ...]) -> dict:
    """Per case and figure, the median over repetitions of case/aot, paired by repetition."""
    out: dict[str, dict[str, float | None]] = {}
    for case, case_runs in runs.items():
        out[case] = {}
        for figure in figures:
            pairs = [r[figure] / a[figure] for r, a in zip(case_runs, runs["aot"], strict=False)
                     if r.get(figure) and a.get(figure)]
            out[case][figure] = statistics.median(pairs) if pairs else None
    return out


def quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles (one value: itself twice)."""
    if len(values) < 2:
        return [values[0], values[0]]
    first, _, third = statistics.quantiles(values, n=4, method="inclusive")
    return [first, third]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
