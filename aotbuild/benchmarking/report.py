"""How a bench's results are kept and shown: the JSON document (figures summarized over
repetitions, ratios to aot), written whole; fixed-width tables, all laid out by one formatter
(`table`); matplotlib for the plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import AotbuildError
from .stats import ratios_to_aot, summarize

DEFAULT_RATIOS = ("first_step_s", "first_image_s", "steady_step_s", "steady_image_s", "peak_rss_mib")
REGIONAL_RATIOS = ("build_s", "package_mib", "artifact_mib", "first_image_s", "steady_step_s", "steady_image_s")


def report(runs: dict[str, list[dict[str, Any]]], environment: dict[str, Any], meta: dict[str, Any],
           figures: dict[str, str]) -> dict:
    """A bench's document from the raw per-repetition `figures` (name -> meaning)."""
    summary = {case: {f: summarize([r.get(f) for r in case_runs]) for f in figures} for case, case_runs in runs.items()}
    document = {"meta": meta, "environment": environment, "figures": figures, "runs": runs, "summary": summary}
    if "aot" in runs:
        document["ratio_to_aot"] = ratios_to_aot(runs, tuple(figures))
    return document


def write_document(path: Path, document: dict[str, Any]) -> None:
    """A bench's JSON document, replaced whole (a reader never sees half of it)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=2) + "\n")
    partial.replace(path)


def pyplot() -> Any:
    """matplotlib.pyplot, drawing to files (no display)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AotbuildError("--plot needs matplotlib", hint="pip install 'aotbuild[plot]'") from None
    return plt


def cell(value: Any, spec: str) -> str:
    """A figure formatted by `spec`, "-" where it was not measured."""
    return "-" if value is None else format(value, spec)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def table(widths: Sequence[int], rows: Sequence[Sequence[str]]) -> list[str]:
    """Fixed-width lines: a row's first cell left-aligned in its width, the next ones right-aligned
    in theirs and at least a space from the cell before, however wide; cells past `widths` follow
    as they are, two spaces apart."""
    lines = []
    for row in rows:
        line = f"{row[0]:<{widths[0]}}" + "".join(f" {c:>{w - 1}}" for c, w in zip(row[1:], widths[1:], strict=False))
        lines.append(line + "".join(f"  {c}" for c in row[len(widths):]))
    return lines


def format_table(document: dict[str, Any], ratios: tuple[str, ...] = DEFAULT_RATIOS) -> str:
    """`aotbuild bench`: median [min, max] per case and figure (the median alone where they are one
    value), then the `ratios` figures' ratios to aot."""
    cases = list(document["summary"])
    widths = [26] * (len(cases) + 1)
    rows = [["figure", *cases]]
    for figure in document["figures"]:
        summaries = [document["summary"][case][figure] for case in cases]
        if all(s["median"] is None for s in summaries):
            continue  # measured by no case run (build_s without a regional build)
        rows.append([figure, *(cell(s["median"], ".3g") + ("" if s["min"] == s["max"] else
                                                            f" [{s['min']:.3g}, {s['max']:.3g}]") for s in summaries)])
    lines = table(widths, rows)
    if "ratio_to_aot" in document:
        lines.append("ratio to aot (median of per-repetition ratios)")
        ratio = document["ratio_to_aot"]
        lines += table(widths, [[f"  {figure}", *(_times(ratio[case][figure]) for case in cases)]
                                for figure in ratios if any(ratio[case][figure] is not None for case in cases)])
    return "\n".join(lines)


def format_component_table(document: dict[str, Any]) -> str:
    """`bench --component`: one row per runtime: its call, the ratio to aot's, its error, and what
    preparing it cost."""
    meta, runtimes = document["meta"], document["runtimes"]
    rows = [["runtime", "call ms", "/ " + meta["ratio_base"], "middle half", "rel.err", "GFLOP/s", "of peak",
             "prepare s", "convert s", "disk MiB", "RSS+ MiB", "chose"]]
    for case, f in runtimes.items():
        rows.append([case, cell(f["call_s"] * 1e3, ".2f"), cell(f["ratio_to_aot"], ".2f"),
                     "-".join(f"{q:.2f}" for q in f["ratio_quartiles"]), cell(f["max_rel_error"], ".1e"),
                     cell(f.get("gflop_s"), ".0f"), cell(f.get("of_peak"), ".2f"), cell(f.get("prepare_s"), ".2f"),
                     cell(f.get("convert_s"), ".1f"), cell(f.get("disk_mib"), ".1f"),
                     cell(f.get("rss_added_mib"), ".0f"),
                     ", ".join(f"{k} {f[k]}" for k in ("precision", "threads", "variant") if k in f)])
    lines = [f"{meta['target']} {meta['component']} at {meta['shape']}: {meta['rounds']} rounds, "
             f"{meta['cpus']} CPUs, {meta['busy']} busy processes beside, OpenMP threads wait: "
             f"{meta.get('openmp_wait', 'not recorded')}",
             *table([max(14, *(len(case) + 2 for case in runtimes)), 10, 9, 13, 10, 9, 9, 11, 11, 10, 10], rows)]
    if "gflop" in meta:
        lines.append(f"the call: {meta['gflop']:.1f} GFLOP; this machine's peak in the target's dtype: "
                     + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in meta["peak_gflop_s"].items())
                     + f"; peak RSS {meta['peak_rss_mib'] / 1024:.1f} GiB")
    lines += [f"{case}: the stand-in's own cost per call (the model's run taken out): "
              f"{f['stand_in_us']:.0f} us" for case, f in runtimes.items() if "stand_in_us" in f]
    lines += [f"{case}: skipped, {reason}" for case, reason in document["skipped"].items()]
    return "\n".join(lines)


def format_growth_table(document: dict[str, Any]) -> str:
    """`bench --growth`: the builds against their size, then the calls against their work."""
    component = document["meta"]["component"]
    rows = [["target", "parameters", "weights GiB", "build s", "compile s", "peak RSS GiB", "s/param x first",
             "RSS/byte x first"]]
    for b in document["builds"]:
        rows.append([b["target"], f"{b['parameters']:,}", f"{b['weights_mib'] / 1024:.2f}", f"{b['build_s']:.0f}",
                     cell(b["compile_s"], ".0f"), cell(b["peak_rss_mib"] and b["peak_rss_mib"] / 1024, ".1f"),
                     f"{b['build_s_per_parameter_vs_first']:.2f}", cell(b.get("rss_per_weight_byte_vs_first"), ".2f")])
    lines = [f"builds against their size ({component}'s compile; x first: per parameter, per weight byte)",
             *table([28, 14, 12, 9, 10, 13, 16, 17], rows)]
    if document["calls"]:
        cases = sorted(set().union(*(c["call_s"] for c in document["calls"])))
        rows = [["target", "shape", "GFLOP", *(title for case in cases for title in (case + " s", "x first"))]]
        rows += [[c["target"], c["shape"], f"{c['gflop']:.0f}",
                  *(text for case in cases for text in (cell(c["call_s"].get(case), ".2f"),
                                                        cell(c["s_per_gflop_vs_first"].get(case), ".2f")))]
                 for c in document["calls"]]
        lines += ["", f"{component}'s call against its work (seconds; x first: seconds per GFLOP against the first "
                      "row)", *table([28, 12, 9, *([16, 9] * len(cases))], rows)]
    return "\n".join(lines)


def format_load_table(document: dict[str, Any]) -> str:
    """`bench --serve --load`: one row per phase: latency percentiles, throughput, lost and 5xx
    answers, memory."""
    rows = [["phase", "p50 s", "p95 s", "p99 s", "req/s", "ok", "lost", "5xx", "wrong", "batch",
             "RSS MiB before -> after"]]
    for name, p in document["phases"].items():
        rows.append([name, cell(p["p50_s"], ".2f"), cell(p["p95_s"], ".2f"), cell(p["p99_s"], ".2f"),
                     f"{p['throughput_rps']:.2f}", str(p["answered_ok"]), str(p["lost"]), str(p["server_errors"]),
                     str(len(p["wrong"])), str(p["largest_batch"]),
                     f"{p['rss_before_mib']:.0f} -> {p['rss_after_mib']:.0f}"])
    return "\n".join(table([16, 8, 8, 8, 8, 5, 6, 5, 6, 6, 26], rows))
