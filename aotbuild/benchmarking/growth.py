"""`aotbuild bench --growth T1,T2,... --component NAME`: how cost grows as the work grows, read
from artifacts already built (and benched with `bench --component`), in one document and plot.

- The component's call: each runtime's seconds against the call's floating-point work (GFLOP,
  counted by `bench --component`), e.g. SDXL's UNet at 256 to 1024 px. Seconds per GFLOP against
  the first target's: above 1, the call grows faster than its work (attention's share at long
  sequences, memory traffic, a layout), a finding to explain.
- The build: wall time, the component's AOTInductor compile time and the build's peak RSS against
  the parameters compiled (tiny -> mid -> full). Seconds per parameter and peak RSS per weight
  byte, against the first target's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import AotbuildError

GROWTH_FIGURES = {
    "parameters": "the compiled components' parameters (their stored constants' bytes / their dtype's size)",
    "weights_mib": "bytes of the compiled components' weights, as stored",
    "build_s": "the build's wall time, every stage (the manifest's timings)",
    "compile_s": "AOTInductor's time for the component, every variant (manifest components.<name>.compile_s)",
    "peak_rss_mib": "the build's peak RSS, its highest stage",
    "gflop": "the component's call at the target's first bucket: floating-point work (bench --component)",
    "call_s": "each runtime's call, the median over its rounds (bench --component)",
    "s_per_gflop_vs_first": "call_s / gflop, against the first target's: above 1 grows faster than the work",
    "build_s_per_parameter_vs_first": "build_s / parameters, against the first target's",
    "rss_per_weight_byte_vs_first": "peak_rss_mib / weights_mib, against the first target's",
}
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}


def growth_name(component: str) -> str:
    return f"growth-{component}.json"


def measure_growth(targets: list[str], artifacts_dir: Path, component: str) -> dict[str, Any]:
    """The growth document of `component` over these targets' artifacts (written to
    `artifacts_dir/growth-<component>.json`, and returned). A target whose artifact has no
    `bench-<component>.json` has build figures only.

    Raises:
        AotbuildError: fewer than two targets, a target not built, or one that does not compile
            the component.
    """
    from ..builder.targets import load_target
    from ..runtime.artifacts import built_artifact
    from ..spec.manifest import read_manifest
    from .component import component_bench_name
    from .report import write_document

    if len(targets) < 2:
        raise AotbuildError("--growth compares two targets or more: give them comma-separated")
    builds, calls = [], []
    for name in targets:
        target = load_target(name)
        folder = built_artifact(target.name, artifacts_dir)
        manifest = read_manifest(folder)
        if component not in manifest["components"]:
            raise AotbuildError(f"{target.name} compiles {', '.join(manifest['components'])}; not {component!r}")
        entries = manifest["components"].values()
        weights = sum(e["constants"]["bytes"] for e in entries)
        builds.append({
            "target": target.name, "dtype": target.dtype, "shape": str(target.shapes[0]),
            "parameters": round(sum(e["constants"]["bytes"] / ITEM_BYTES.get(e["dtype"], 4) for e in entries)),
            "weights_mib": weights / 2**20, "build_s": sum(manifest["timings"].values()),
            "compile_s": manifest["components"][component].get("compile_s"),
            "peak_rss_mib": max(manifest.get("peak_rss_mib", {}).values(), default=None)})
        bench = folder / component_bench_name(component)
        if bench.is_file():
            document = json.loads(bench.read_text())
            calls.append({"target": target.name, "shape": document["meta"]["shape"],
                          "gflop": document["meta"].get("gflop"),
                          "call_s": {case: f["call_s"] for case, f in document["runtimes"].items()},
                          "gflop_s": {case: f.get("gflop_s") for case, f in document["runtimes"].items()}})
    _against_first(builds, "build_s_per_parameter_vs_first", lambda b: b["build_s"] / b["parameters"])
    if all(b["peak_rss_mib"] for b in builds):
        _against_first(builds, "rss_per_weight_byte_vs_first", lambda b: b["peak_rss_mib"] / b["weights_mib"])
    calls = [c for c in calls if c["gflop"]]  # a bench document from before FLOPs were counted
    for case in sorted(set().union(*(c["call_s"] for c in calls)) if calls else ()):
        series = [c for c in calls if case in c["call_s"]]
        first = series[0]["call_s"][case] / series[0]["gflop"]
        for c in series:
            c.setdefault("s_per_gflop_vs_first", {})[case] = c["call_s"][case] / c["gflop"] / first
    document = {"meta": {"component": component, "targets": list(targets)}, "figures": GROWTH_FIGURES,
                "builds": builds, "calls": calls}
    write_document(artifacts_dir / growth_name(component), document)
    return document


def _against_first(rows: list[dict[str, Any]], key: str, value: Any) -> None:
    first = value(rows[0])
    for row in rows:
        row[key] = value(row) / first


def plot_growth(document: dict[str, Any], path: Path) -> None:
    """Two panels: each runtime's call time against the call's GFLOP (log-log, with the line of
    time proportional to work through the first point; where two targets or more were timed), and
    the build's time and peak RSS against the parameters compiled (per target where the targets are
    one model at several sizes)."""
    from .report import pyplot

    plt = pyplot()
    timed = len(document["calls"]) > 1  # a call timed at one target alone has nothing to grow against
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12 if timed else 6.5, 4.5), squeeze=False)
    calls, builds = axes[0] if timed else (None, axes[0][0])
    for case in sorted(set().union(*(c["call_s"] for c in document["calls"]))) if timed else ():
        series = [c for c in document["calls"] if case in c["call_s"]]
        work, seconds = [c["gflop"] for c in series], [c["call_s"][case] for c in series]
        line, = calls.loglog(work, seconds, "o-", label=case)
        calls.loglog(work, [seconds[0] * w / work[0] for w in work], ":", color=line.get_color(), linewidth=1)
    if timed:
        calls.set(xlabel="the call's work (GFLOP)", ylabel="call (s)",
                  title=f"{document['meta']['component']}'s call; dotted: proportional to the work")
        calls.legend()
    rows = document["builds"]
    parameters = [b["parameters"] for b in rows]
    by_size = max(parameters) > 1.5 * min(parameters)  # else one model at several sizes: by target
    places = parameters if by_size else list(range(len(rows)))

    def draw(axes: Any, key: str, per: float, style: str, label: str, **line: Any) -> None:
        known = [i for i, b in enumerate(rows) if b[key] is not None]  # compile_s: not in older manifests
        axes.plot([places[i] for i in known], [rows[i][key] / per for i in known], style, label=label, **line)
        axes.set_xscale("log" if by_size else "linear")

    draw(builds, "build_s", 60, "o-", "build (min)")
    draw(builds, "compile_s", 60, "s-", f"{document['meta']['component']} compile (min)")
    memory = builds.twinx()
    draw(memory, "peak_rss_mib", 1024, "^--", "peak RSS (GiB)", color="#c66")
    if by_size:
        builds.set(xlabel="parameters compiled", ylabel="minutes", title="builds")
    else:
        builds.set_xticks(range(len(rows)), [f"{b['target']}\n{b['shape']}" for b in rows], fontsize=8)
        builds.set(ylabel="minutes", title="builds")
    builds.set_ylim(bottom=0)
    memory.set_ylim(bottom=0)
    memory.set_ylabel("peak RSS (GiB)")
    builds.legend(loc="upper left")
    memory.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
