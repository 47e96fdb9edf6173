"""`aotbuild bench`: cold start, steady state and memory of eager / compile / compile-cached / aot,
each repetition of each case in a fresh process, cases interleaved so machine drift cancels.

The parent (`run_bench`) spawns `python -m aotbuild.bench --case ...` workers; each worker times
from its own spawn (the parent's clock just before starting it) to pipeline ready, first denoising
step and first image, then steady per-step and per-image latency, and peak memory.

A `random:` target's pipeline is saved once per run (its seeded weights, as safetensors), and every
case loads what it does not take from its artifact from that folder, read cold: eager reads the
weights aot reads, as with a real checkpoint, and no case spends time creating random weights (work
a real source does not do, which eager would do more of than aot). `random_init_s` stays reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .errors import AotbuildError
from .openmp import spin_setting
from .peers import PEERS

CASES = ("eager", "compile", "compile-cached", "aot")
# Opt-in: the same artifact served by its dynamic model only, at the first bucket's shape (the
# cost of dynamism next to the static bucket); served with CUDA graphs on or off, whatever the
# target says (`aot` runs it as built).
GRAPH_CASES = {"aot-cuda-graphs": True, "aot-no-cuda-graphs": False}  # case: cuda_graphs forced to
# Opt-in: the artifact switching between two random LoRAs (rank 16 on every attention projection).
LORA_CASE = "aot-lora"
LORA_RANK = 16
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
LORA_SWITCHES = 5
# Opt-in: the first bucket's latents decoded whole (its bucket model) and by tiles (the tile model,
# diffusers' tiling and blending), steady, in the same process.
TILING_CASE = "aot-tiling"
# Opt-in: the target built with [compile] mode = "regional" (as `<target>-regional`). With it in the
# run, the whole-model and the regional artifact are both built afresh first, one after the other.
REGIONAL_CASE = "aot-regional"
# Opt-in: steady images with diffusers' First-Block Cache on a regional artifact's denoiser
# (`enable_cache`), alternating with the same calls uncached, in the same process.
CACHE_CASE = "aot-cache"
CACHE_THRESHOLD = 0.2  # default: diffusers' own example's; the images' difference to uncached is reported beside it
# Opt-in: the runtimes users pick instead (`peers.PEERS`), on the whole pipeline: its denoiser
# converted by the peer from the float32 model at the first bucket's call (once per bench run, in a
# fresh process: the case's build_s), the rest of the pipeline eager, as a user would deploy it.
PEER_CASES = tuple(PEERS)
EXTRA_CASES = ("aot-dynamic", *GRAPH_CASES, LORA_CASE, TILING_CASE, REGIONAL_CASE, CACHE_CASE, *PEER_CASES)
FIGURES = {
    "ready_s": "process start to pipeline ready",
    "first_step_s": "process start to first denoising step done",
    "first_image_s": "process start to first image",
    "steady_step_s": "steady denoising step latency",
    "steady_image_s": "steady image latency",
    "load_s": "pipeline load (after imports)",
    "weights_read_s": "reading the artifact's weight bytes alone, page cache dropped (aot)",
    "load_over_floor": "load_s / weights_read_s (aot)",
    "random_init_s": "creating random weights, kept out of the timed figures (random: sources are saved and read)",
    "weights_mib": "bytes of the weights the pipeline needs",
    "load_rss_mib": "RSS added by loading the pipeline",
    "peak_rss_mib": "peak RSS",
    "peak_cuda_mib": "peak CUDA memory",
    "artifact_mib": "artifact bytes",
    "package_mib": "compiled code bytes: the .pt2 packages (aot cases)",
    "build_s": "aotbuild build --force in a fresh process, empty inductor cache, once per bench run (aot and "
               "aot-regional, when aot-regional is in the run); a peer's conversion of the denoiser (peers)",
    "lora_switch_s": "LoRA A -> B with diffusers' hotswap=True: read B (page cache dropped), merge, bind (aot-lora)",
    "lora_load_switch_s": "LoRA A -> B as a new adapter: load it, activate it, delete A, merge, bind (aot-lora)",
    "lora_floor_s": "reading the LoRA file cold plus one copy of the weights it touches (aot-lora)",
    "lora_switch_over_floor": "lora_switch_s / lora_floor_s, median of per-switch ratios (aot-lora)",
    "lora_load_switch_over_floor": "lora_load_switch_s / lora_floor_s (aot-lora)",
    "lora_touched_mib": "bytes of the constants a LoRA touches (aot-lora)",
    "lora_buffers_mib": "merge buffers the LoRAs added: one per touched constant, reused by every switch (aot-lora)",
    "lora_rss_mib": "RSS added by loading LoRAs and switching (freed heap pages are reused: can be less) (aot-lora)",
    "lora_new_files": "files the switches added to the inductor and package caches: compiles or extractions (aot-lora)",
    "untiled_decode_s": "steady VAE decode of the first bucket's latents by its bucket model (aot-tiling)",
    "tiled_decode_s": "the same latents with vae.enable_tiling(): tile model, diffusers' blending (aot-tiling)",
    "tiled_over_untiled": "tiled_decode_s / untiled_decode_s, median of paired runs (aot-tiling)",
    "tiles": "tiles per decode (aot-tiling)",
    "cached_image_s": "steady image latency with First-Block Cache on the regional denoiser (aot-cache)",
    "uncached_image_s": "the same calls without it, alternating with the cached ones (aot-cache)",
    "cached_over_uncached": "cached_image_s / uncached_image_s, median of paired runs (aot-cache)",
    "cache_max_abs": "largest difference of a cached image's pixels (0-1) from the uncached image (aot-cache)",
    "cache_threshold": "the First-Block Cache threshold used (aot-cache)",
}
BENCH_NAME = "bench.json"
SAVED_SOURCE = "source"  # a random: target's pipeline, saved in the run's work folder
# A bench process that runs longer than this is stopped: a hang fails the bench instead of stalling it.
WORKER_TIMEOUT_S = 3600
BUILD_TIMEOUT_S = 3 * 3600


class BenchError(AotbuildError):
    """A benchmark worker failed."""


def summarize(values: list[float]) -> dict[str, Any]:
    """Median and spread of one figure over repetitions (None values, e.g. no CUDA, are dropped)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "values": values}
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "values": values}


def ratios_to_aot(runs: dict[str, list[dict[str, Any]]], figures: tuple[str, ...] = tuple(FIGURES)) -> dict:
    """Per case and figure, the median over repetitions of case/aot, paired by repetition."""
    out: dict[str, dict[str, float | None]] = {}
    for case, case_runs in runs.items():
        out[case] = {}
        for figure in figures:
            pairs = [r[figure] / a[figure] for r, a in zip(case_runs, runs["aot"], strict=False)
                     if r.get(figure) and a.get(figure)]
            out[case][figure] = statistics.median(pairs) if pairs else None
    return out


def report(runs: dict[str, list[dict[str, Any]]], environment: dict[str, Any], meta: dict[str, Any],
           figures: dict[str, str] = FIGURES) -> dict:
    """The bench.json document from the raw per-repetition `figures` (name -> meaning)."""
    summary = {case: {f: summarize([r.get(f) for r in case_runs]) for f in figures} for case, case_runs in runs.items()}
    document = {"meta": meta, "environment": environment, "figures": figures, "runs": runs, "summary": summary}
    if "aot" in runs:
        document["ratio_to_aot"] = ratios_to_aot(runs, tuple(figures))
    return document


DEFAULT_RATIOS = ("first_step_s", "first_image_s", "steady_step_s", "steady_image_s", "peak_rss_mib")
REGIONAL_RATIOS = ("build_s", "package_mib", "artifact_mib", "first_image_s", "steady_step_s", "steady_image_s")


def format_table(document: dict[str, Any], ratios: tuple[str, ...] = DEFAULT_RATIOS) -> str:
    """A fixed-width table: median [min, max] per case and figure (the median alone where they are
    one value), then the `ratios` figures' ratios to aot. Cells are apart by a space at least,
    however wide a figure."""
    cases = list(document["summary"])
    width = 26
    lines = [f"{'figure':<26}" + "".join(f" {c:>{width - 1}}" for c in cases)]
    for figure in document["figures"]:
        if all(document["summary"][case][figure]["median"] is None for case in cases):
            continue  # measured by no case run (build_s without a regional build)
        row = f"{figure:<26}"
        for case in cases:
            s = document["summary"][case][figure]
            cell = "-" if s["median"] is None else f"{s['median']:.3g}" + (
                "" if s["min"] == s["max"] else f" [{s['min']:.3g}, {s['max']:.3g}]")
            row += f" {cell:>{width - 1}}"
        lines.append(row)
    if "ratio_to_aot" in document:
        lines.append("ratio to aot (median of per-repetition ratios)")
        for figure in ratios:
            if all(document["ratio_to_aot"][case][figure] is None for case in cases):
                continue
            row = f"  {figure:<24}"
            for case in cases:
                r = document["ratio_to_aot"][case][figure]
                row += f" {'-' if r is None else f'{r:.2f}x':>{width - 1}}"
            lines.append(row)
    return "\n".join(lines)


def run_bench(target_path: str, artifacts_dir: Path, *, repeats: int = 3, steps: int = 4, steady: int = 3,
              cases: tuple[str, ...] = CASES, progress: Any = None,
              cache_threshold: float = CACHE_THRESHOLD) -> dict[str, Any]:
    """Run every case `repeats` times in fresh processes; write and return bench.json.
    `cache_threshold`: First-Block Cache's, in case aot-cache.

    Raises:
        AotbuildError: unknown case, missing artifact, or a worker failure (with its stderr).
    """
    from .manifest import environment
    from .runtime.artifacts import built_artifact
    from .sources import is_random
    from .targets import load_target

    target = load_target(target_path)
    target_path = str(target.base_dir / f"{target.name}.toml")  # workers resolve the same file
    unknown = [c for c in cases if c not in CASES + EXTRA_CASES]
    if unknown:
        raise AotbuildError(f"unknown bench case {unknown[0]!r}; known: {', '.join(CASES + EXTRA_CASES)}")
    # Fixed order, no repeats: compile-cached loads what compile saved in the same repetition.
    cases = tuple(c for c in CASES + EXTRA_CASES if c in cases)
    if "aot-dynamic" in cases and not target.dynamic:
        raise AotbuildError(f"case aot-dynamic needs a target with [dynamic]; {target.name} has none")
    for case in GRAPH_CASES:
        if case in cases and target.device != "cuda":
            raise AotbuildError(f"case {case} needs a CUDA target; {target.name} runs on {target.device}")
    first = target.shapes[0]
    if TILING_CASE in cases and ("vae_decoder" not in target.tiling
                                 or max(first.height, first.width) <= _tile_pixels(target)):
        raise AotbuildError(f"case {TILING_CASE} needs vae_decoder = {{ tiling = true }} and a first bucket larger "
                            f"than a tile ({_tile_pixels(target)} px); {target.name} lacks one")
    if "compile-cached" in cases and "compile" not in cases:
        raise AotbuildError("case compile-cached needs case compile (it loads the cache compile saved)")
    if CACHE_CASE in cases:
        _check_takes_caches(target)
    skipped = {case: reason for case in cases if case in PEERS and (reason := PEERS[case].missing())}
    cases = tuple(case for case in cases if case not in skipped)
    if any(case in PEERS for case in cases) and target.dtype != "float32":
        raise AotbuildError(f"the peer cases run the float32 model; {target.name} is {target.dtype}",
                            hint="bench the peers on a float32 target")
    builds: dict[str, float] = {}
    # aot-regional compares fresh builds of both; aot-cache on a whole-model target runs on the
    # regional sibling (built here unless aot-regional builds it).
    to_build = ("aot", REGIONAL_CASE) if REGIONAL_CASE in cases else \
        (CACHE_CASE,) if CACHE_CASE in cases and target.compile_mode != "regional" else ()
    if to_build:
        regional_target(target)  # refused here, before any build, when the target cannot be regional
    for case in to_build:
        if progress:
            progress(f"building {case}: aotbuild build --force, fresh process, empty inductor cache")
        builds[case] = _run_build(case, target_path, artifacts_dir)
    # The document goes with the target's own artifact, or with the only one the cases run.
    ran = {t.name: t for t in (_case_target(case, target_path) for case in cases)}
    documented = target if target.name in ran else next(iter(ran.values()))
    folder = built_artifact(documented.name, artifacts_dir)
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    meta = {"target": documented.name, "steps": steps, "steady_runs": steady, "repeats": repeats, "repeats_done": 0,
            "openmp_wait": spin_setting(), "skipped": skipped, "source": target.source,
            "shape": str(target.shapes[0]), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    started, seconds = time.perf_counter(), {case: 0.0 for case in cases}  # each case's worker time so far
    with tempfile.TemporaryDirectory(prefix="aotbuild-bench-") as work:
        source_dir = None
        if is_random(target.source):
            if progress:
                progress(f"saving {target.source} (seed {target.seed}): every case reads these weights from disk")
            source_dir = Path(work) / SAVED_SOURCE
            meta["source"] = f"{target.source} (seed {target.seed}), saved: {_save_source(target_path, source_dir)}"
        converted: dict[str, float] = {}  # a peer's saved conversion (OpenVINO's serves both precisions)
        for case in (c for c in cases if c in PEERS):
            folder_name = _peer_folder(case)
            if folder_name not in converted:
                if progress:
                    progress(f"converting the denoiser for {case}: fresh process, float32 model")
                converted[folder_name] = _run_convert(case, target_path, artifacts_dir, Path(work) / folder_name)
            builds[case] = converted[folder_name]
        for rep in range(repeats):
            mega_cache = Path(work) / f"mega-cache-{rep}.bin"
            for case in cases:
                if progress:
                    progress(f"repetition {rep + 1}/{repeats}: {case}{_eta(started, seconds, rep, case, repeats)}")
                start = time.perf_counter()
                figures = _run_worker(case, target_path, artifacts_dir, steps, steady, mega_cache, Path(work),
                                      cache_threshold, source_dir)
                seconds[case] += time.perf_counter() - start
                runs[case].append({**figures, "build_s": builds.get(case)})
            # Each repetition ends written: an interrupted bench keeps what it measured.
            meta["repeats_done"] = rep + 1
            document = report(runs, environment(target.device), meta)
            write_document(folder / BENCH_NAME, document)
    return document


def _eta(started: float, seconds: dict[str, float], rep: int, case: str, repeats: int) -> str:
    """' (elapsed 4m10s, ~8m02s left)' before `case` of repetition `rep` runs: the time left is each
    case's mean so far times its runs to go (only elapsed during the first repetition)."""
    elapsed = f" (elapsed {_minutes(time.perf_counter() - started)}"
    if rep == 0:
        return elapsed + ")"
    cases = list(seconds)
    here = cases.index(case)
    done = {c: rep + (i < here) for i, c in enumerate(cases)}  # runs each case has finished
    to_go = {c: repeats - done[c] for c in cases}
    left = sum(seconds[c] / done[c] * to_go[c] for c in cases)
    return f"{elapsed}, ~{_minutes(left)} left)"


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def write_document(path: Path, document: dict[str, Any]) -> None:
    """bench.json, replaced whole (a reader never sees half of it)."""
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


def plot(document: dict[str, Any], path: Path) -> None:
    """Bar chart of first-image (cold) and steady image latency per case."""
    plt = pyplot()
    cases = list(document["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, figure, title in ((axes[0], "first_image_s", "cold: process start to first image (s)"),
                              (axes[1], "steady_image_s", "steady image latency (s)")):
        stats = [document["summary"][c][figure] for c in cases]
        medians = [s["median"] or 0 for s in stats]
        errors = [[m - (s["min"] or m) for m, s in zip(medians, stats, strict=True)],
                  [(s["max"] or m) - m for m, s in zip(medians, stats, strict=True)]]
        colors = ["#888", "#c66", "#d96", "#4a8", "#7b9", "#396", "#9c9"]
        ax.bar(cases, medians, yerr=errors, capsize=4, color=colors[: len(cases)])
        ax.set_title(title)
    fig.suptitle(f"aotbuild bench: {document['meta']['target']} ({document['meta']['shape']}, "
                 f"{document['meta']['steps']} steps, {document['meta']['repeats']} repetitions)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def regional_target(target: Any) -> Any:
    """The target as `[compile] mode = "regional"`, named `<name>-regional` (validated as a target file is).

    Raises:
        AotbuildError: the target is regional already, or cannot be (a TargetError, say why).
    """
    from .targets import Target

    if target.compile_mode == "regional":
        raise AotbuildError(f"case {REGIONAL_CASE} compares a whole-model target with its regional build; "
                            f"{target.name} is regional already")
    return Target.from_dict({**target.to_dict(), "name": f"{target.name}-regional", "compile_mode": "regional"},
                            base_dir=target.base_dir)


def _case_target(case: str, target_path: str, source_dir: str | None = None) -> Any:
    """The target a case runs; `source_dir`: a folder its pipeline was saved to, read instead of its source."""
    from .targets import Target, load_target

    target = load_target(target_path)
    if source_dir is not None:
        target = Target.from_dict({**target.to_dict(), "source": str(source_dir)}, base_dir=target.base_dir)
    # A step cache runs in Python around compiled blocks: on a whole-model target, its regional sibling.
    regional = case == REGIONAL_CASE or (case == CACHE_CASE and target.compile_mode != "regional")
    return regional_target(target) if regional else target


def _run_build(case: str, target_path: str, artifacts_dir: Path) -> float:
    """Seconds `aotbuild build --force` of the case's target takes in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="aotbuild-bench-build-") as cache_dir:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "aotbuild.bench", "--build", "--case", case, "--target", str(target_path),
               "--artifacts", str(artifacts_dir)]
        start = time.perf_counter()
        _run_child(cmd, env, BUILD_TIMEOUT_S, f"building case {case}")
        return time.perf_counter() - start


def _run_child(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> None:
    """Run one bench process; a failure or a hang (killed after `timeout` seconds) is a BenchError."""
    try:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what} did not finish in {timeout:g} s and was stopped") from None
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise BenchError(f"{what} failed (exit {result.returncode}):\n{tail}")


def _save_source(target_path: str, folder: Path) -> str:
    """Save the target's source pipeline (a `random:` one: its seeded weights) into `folder`, in a
    fresh process; says how much it wrote and how long it took."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "aotbuild.bench", "--case", "eager", "--save-source", str(folder),
           "--target", target_path, "--artifacts", str(folder)]
    _run_child(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, BUILD_TIMEOUT_S, "saving the source pipeline")
    mib = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
    return f"{mib:.1f} MiB in {time.perf_counter() - start:.1f} s"


def _peer_folder(case: str) -> str:
    """The work folder of a peer case's conversion: one per converter (OpenVINO's two precisions load one)."""
    return f"peer-{PEERS[case].convert.__name__.strip('_')}"


def _run_convert(case: str, target_path: str, artifacts_dir: Path, folder: Path) -> float:
    """Seconds to convert the target's denoiser for the peer of `case` into `folder`, in a fresh process."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "aotbuild.bench", "--case", case, "--convert", "--target", target_path,
           "--artifacts", str(artifacts_dir), "--peer-dir", str(folder)]
    _run_child(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, BUILD_TIMEOUT_S, f"the {case} conversion")
    return time.perf_counter() - start


def _run_worker(case: str, target_path: str, artifacts_dir: Path, steps: int, steady: int,
                mega_cache: Path, work: Path, cache_threshold: float = CACHE_THRESHOLD,
                source_dir: Path | None = None) -> dict[str, Any]:
    out = work / f"{case}-{time.monotonic_ns()}.json"
    # Each process gets an empty inductor cache: `compile` pays its real cold cost, and
    # `compile-cached` starts from the mega-cache alone. Artifacts (a peer's saved model) and the
    # saved source are read from a cold page cache.
    artifact = artifacts_dir / _case_target(case, target_path).name
    if case.startswith("aot"):
        drop_page_cache([p for p in artifact.rglob("*") if p.is_file()])
    if case in PEERS:
        drop_page_cache([p for p in (work / _peer_folder(case)).rglob("*") if p.is_file()])
    if source_dir is not None:
        drop_page_cache([p for p in source_dir.rglob("*") if p.is_file()])
    cache_dir = tempfile.mkdtemp(prefix="inductor-", dir=work)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "aotbuild.bench", "--case", case, "--target", str(target_path),
           "--artifacts", str(artifacts_dir), "--steps", str(steps), "--steady", str(steady),
           "--mega-cache", str(mega_cache), "--out", str(out), "--spawn-time", repr(time.time()),
           "--cache-threshold", repr(cache_threshold)]
    if case in PEERS:
        cmd += ["--peer-dir", str(work / _peer_folder(case))]
    if source_dir is not None:
        cmd += ["--source-dir", str(source_dir)]
    _run_child(cmd, env, WORKER_TIMEOUT_S, f"bench case {case}")
    if not out.is_file():
        raise BenchError(f"bench case {case} ended without writing its results")
    return json.loads(out.read_text())


def drop_page_cache(paths: list[Path]) -> None:
    """Best effort: ask the kernel to forget these files' cached pages (no root needed)."""
    for path in paths:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _cold_read_s(paths: list[Path]) -> float:
    """Seconds to read the files' bytes from disk: the floor for loading their weights."""
    drop_page_cache(paths)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(_READ_BUFFER):
                pass
    return time.perf_counter() - start


_READ_BUFFER = bytearray(1 << 24)


def _weights_mib(pipe: Any) -> float:
    """Bytes of every model the pipeline holds: loaded modules' parameters and the compiled
    components' bound weights."""
    import torch

    from .runtime.guards import StandIn

    tensors: dict[tuple, torch.Tensor] = {}  # each counted once
    for component in pipe.components.values():
        if isinstance(component, StandIn):  # its bound weights (its parameters are the eager model's views of them)
            found = [t for module in component.modules() for t in module.__dict__.get("_weights", {}).values()]
        elif isinstance(component, torch.nn.Module):
            found = [*component.parameters(), *component.buffers()]
        else:
            continue
        tensors.update({(t.data_ptr(), t.numel(), t.dtype): t for t in found})
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20


def rss_mib() -> float:
    """This process's resident memory, MiB (bench workers, serving replicas)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(args: argparse.Namespace) -> None:
    """Body of one fresh process: prepare the case's pipeline, time the first and steady calls."""
    import resource

    import torch

    from .backends import generate, prepare
    from .pipelines import requires_image, seeded_image, seeded_images
    from .sources import random_init_seconds

    def since_spawn() -> float:
        return time.time() - args.spawn_time - random_init_seconds()

    target = _case_target(args.case, args.target, args.source_dir)
    bucket = target.shapes[0]
    if args.case == "compile-cached":
        torch.compiler.load_cache_artifacts(Path(args.mega_cache).read_bytes())
    artifact = Path(args.artifacts) / target.name
    # Imported before the clock, the pipeline's model classes too (transformers imports them lazily,
    # seconds for CLIP): load_s is loading, not importing.
    import diffusers  # noqa: F401

    from .sources import component_classes, local_folder

    if (source_folder := local_folder(target.source, target.base_dir)) is not None:
        component_classes(source_folder)

    rss_before, load_start = rss_mib(), time.perf_counter()
    backend = "aot" if args.case.startswith("aot") else "compile" if args.case == "compile-cached" else \
        "eager" if args.case in PEERS else args.case
    pipe = prepare(target, backend, Path(args.artifacts), cuda_graphs=GRAPH_CASES.get(args.case))
    chose = _denoiser_on_peer(pipe, target, args.case, Path(args.peer_dir)) if args.case in PEERS else {}
    load_s = time.perf_counter() - load_start - random_init_seconds()
    if args.case == "aot-dynamic":
        from .runtime import CompiledComponent

        for component in pipe.components.values():
            for module in component.modules() if isinstance(component, torch.nn.Module) else ():
                if isinstance(module, CompiledComponent):
                    module.variants = [v for v in module.variants if v.name == "dynamic"]
    figures: dict[str, Any] = {"ready_s": since_spawn(), "load_s": load_s, "random_init_s": random_init_seconds(),
                               "load_rss_mib": rss_mib() - rss_before, "weights_mib": _weights_mib(pipe)}

    # A pipeline that makes videos from an image (Wan's image-to-video) starts from a seeded one;
    # one that edits several images together edits the bucket's, as the build captured them.
    image = seeded_images(bucket.images) if bucket.images else \
        seeded_image(bucket.height, bucket.width) if requires_image(type(pipe)) else None

    def call() -> Any:
        return generate(pipe, "a photo of a red fox in the snow", steps=args.steps, seed=0, height=bucket.height,
                        width=bucket.width, batch=bucket.batch, guidance_scale=target.guidance_scale,
                        frames=bucket.frames, image=image, text=bucket.max_sequence_length)

    started = since_spawn()
    first = call()
    figures["first_step_s"] = started + first.first_step_s
    figures["first_image_s"] = started + first.total_s
    if args.case == "compile":
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(args.mega_cache).write_bytes(saved[0])
    steady = [call() for _ in range(args.steady)]
    step_times = [d for g in steady for d in g.step_durations_s[1:]]  # step 0 also encodes the prompt
    figures["steady_step_s"] = statistics.median(step_times) if step_times else None
    figures["steady_image_s"] = statistics.median(g.total_s for g in steady) if steady else None
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    figures["artifact_mib"] = figures["package_mib"] = figures["weights_read_s"] = figures["load_over_floor"] = None
    figures.update(dict.fromkeys(f for f in FIGURES if f.startswith("lora_") or "tile" in f or "cache" in f))
    if args.case == LORA_CASE:
        figures.update(_lora_switches(pipe, Path(args.out).parent / f"loras-{os.getpid()}"))
    if args.case == TILING_CASE:
        figures.update(_tiled_against_untiled(pipe, bucket, args.steady))
    if args.case == CACHE_CASE:
        figures.update(_cached_against_uncached(pipe, call, args.steady, args.cache_threshold))
    if args.case in PEERS:
        figures["artifact_mib"] = sum(p.stat().st_size for p in Path(args.peer_dir).iterdir()) / 2**20
        figures["peer"] = chose
    if args.case.startswith("aot"):
        figures["artifact_mib"] = sum(p.stat().st_size for p in artifact.rglob("*") if p.is_file()) / 2**20
        figures["package_mib"] = sum(p.stat().st_size for p in artifact.glob("*.pt2")) / 2**20
        figures["weights_read_s"] = _cold_read_s(sorted(artifact.glob("*.safetensors")))
        figures["load_over_floor"] = load_s / figures["weights_read_s"]
    Path(args.out).write_text(json.dumps(figures))


def _save_pipeline(target_path: str, folder: Path) -> None:
    import torch

    from .builder.capturing import load_source_pipeline
    from .pipelines import pipeline_spec
    from .targets import load_target

    target = load_target(target_path)
    pipe = load_source_pipeline(target, pipeline_spec(target.pipeline), torch.device("cpu"))
    pipe.save_pretrained(folder, safe_serialization=True)


def _denoiser_spec(target: Any) -> Any:
    from .pipelines import pipeline_spec

    return next(spec for spec in pipeline_spec(target.pipeline).components.values() if spec.denoiser)


def _convert(args: argparse.Namespace) -> None:
    """Body of a conversion process: the denoiser's float32 model, exported at the call the float32
    pipeline makes at the first bucket, converted by the peer and saved into --peer-dir, with the
    dtypes of the tensors it takes."""
    from .component_bench import reference_call
    from .peers import call_tensors, tensor_program

    target = _case_target(args.case, args.target)
    _, reference, call = reference_call(target, _denoiser_spec(target))
    folder = Path(args.peer_dir)
    folder.mkdir(parents=True, exist_ok=True)
    PEERS[args.case].convert(tensor_program(reference, call.args, call.kwargs), folder)
    dtypes = [str(t.dtype).removeprefix("torch.") for t in call_tensors(call.args, call.kwargs)]
    (folder / PEER_INPUTS).write_text(json.dumps(dtypes))


PEER_INPUTS = "inputs.json"


def _denoiser_on_peer(pipe: Any, target: Any, case: str, folder: Path) -> dict[str, Any]:
    """The pipeline's denoiser computed by the peer's saved model: its forward replaced by the peer's
    runner (the module stays for what the pipeline reads of it: config, dtype). Returns what the
    peer chose (precision, threads).

    Raises:
        BenchError: a call with other tensors than the converted one takes (another pipeline call).
    """
    import torch

    from .peers import call_tensors

    dtypes = [getattr(torch, name) for name in json.loads((folder / PEER_INPUTS).read_text())]
    runner, chose = PEERS[case].load(folder)

    def forward(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        tensors = call_tensors(args, kwargs)
        if len(tensors) != len(dtypes):
            raise BenchError(f"{case}: the denoiser got {len(tensors)} tensors; the converted model takes "
                             f"{len(dtypes)}")
        # The timestep as exported (float32, see capture.float_timestep), every other tensor as it is.
        return tuple(runner([t.to(dtype) for t, dtype in zip(tensors, dtypes, strict=True)]))

    getattr(pipe, _denoiser_spec(target).attribute).forward = forward
    return chose


def random_lora(pipe: Any, attribute: str, path: Path, seed: int, rank: int = LORA_RANK) -> Path:
    """A random LoRA file in diffusers' PEFT format for the pipeline's compiled denoiser: rank
    `rank` on every attention projection (`LORA_TARGETS`), in the denoiser's dtype."""
    import torch
    from safetensors.torch import save_file

    from .runtime.lora import meta_model

    denoiser = getattr(pipe, attribute)
    model = meta_model(denoiser.config, denoiser.dtype)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(LORA_TARGETS):
            down = torch.randn(rank, module.in_features, generator=generator) / module.in_features ** 0.5
            up = torch.randn(module.out_features, rank, generator=generator) * 0.01
            tensors[f"{attribute}.{name}.lora_A.weight"] = down.to(denoiser.dtype)
            tensors[f"{attribute}.{name}.lora_B.weight"] = up.to(denoiser.dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, os.fspath(path))
    return path


def _files_under(*folders: Path) -> int:
    return sum(1 for folder in folders if folder.is_dir() for p in folder.rglob("*") if p.is_file())


def _lora_switches(pipe: Any, work: Path) -> dict[str, Any]:
    """Switch between two random LoRAs `LORA_SWITCHES` times each way, every switch timed against
    its floor: diffusers' fast switch (`hotswap=True`: the new matrices copied into the active
    adapter) and a switch to a newly loaded adapter (peft injects its layers, the old one deleted)."""
    import torch
    from safetensors.torch import load_file

    from .runtime.cache import package_cache_dir

    attribute, denoiser = next((n, m) for n, m in pipe.components.items() if hasattr(m, "update_weights"))
    files = [random_lora(pipe, attribute, work / f"lora{i}.safetensors", seed=i) for i in (0, 1)]
    caches = (Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", work / "none")), package_cache_dir())
    files_before, rss_before = _files_under(*caches), rss_mib()
    pipe.load_lora_weights(files[0], adapter_name="lora")
    denoiser.update_weights()
    touched = [denoiser.weights[fqn] for fqn in denoiser._lora._merged]
    scratch = torch.empty(max(t.numel() for t in touched), dtype=touched[0].dtype, device=touched[0].device)

    def timed(switch: Any, path: Path) -> float:
        drop_page_cache([path])
        start = time.perf_counter()
        switch(path)
        denoiser.update_weights()
        return time.perf_counter() - start

    def floor(path: Path) -> float:
        drop_page_cache([path])
        start = time.perf_counter()
        load_file(os.fspath(path))
        for tensor in touched:
            scratch[: tensor.numel()].view(tensor.shape).copy_(tensor)
        return time.perf_counter() - start

    def to_new_adapter(path: Path) -> None:
        current = pipe.get_active_adapters()[0]
        pipe.load_lora_weights(path, adapter_name=f"{current}+")
        pipe.set_adapters(f"{current}+")
        pipe.delete_adapters(current)

    hotswaps, loads, floors = [], [], []
    for i in range(1, LORA_SWITCHES + 1):
        hotswaps.append(timed(lambda path: pipe.load_lora_weights(path, adapter_name="lora", hotswap=True),
                              files[i % 2]))
        floors.append(floor(files[i % 2]))
    for i in range(1, LORA_SWITCHES + 1):
        loads.append(timed(to_new_adapter, files[i % 2]))
    median_floor = statistics.median(floors)
    return {"lora_switch_s": statistics.median(hotswaps), "lora_load_switch_s": statistics.median(loads),
            "lora_floor_s": median_floor,
            "lora_switch_over_floor": statistics.median(h / f for h, f in zip(hotswaps, floors, strict=True)),
            "lora_load_switch_over_floor": statistics.median(loads) / median_floor,
            "lora_touched_mib": sum(t.numel() * t.element_size() for t in touched) / 2**20,
            "lora_buffers_mib": sum(b.numel() * b.element_size() for b in denoiser._lora._buffers.values()) / 2**20,
            "lora_rss_mib": rss_mib() - rss_before, "lora_new_files": _files_under(*caches) - files_before}


def _tile_pixels(target: Any) -> int:
    from .sources import local_folder, read_configs

    folder = local_folder(target.source, target.base_dir)
    size = read_configs(folder)["vae"]["sample_size"] if folder else 1024
    return size[0] if isinstance(size, list) else size


def _tiled_against_untiled(pipe: Any, bucket: Any, runs: int) -> dict[str, Any]:
    """Decode the bucket's latents whole and by tiles, alternating, `runs` + 1 times each (the
    first pair warms up); the same compiled pipeline, the same latents."""
    import torch

    from .pipelines import vae_factor

    vae = pipe.vae
    factor = vae_factor(vae.config)
    latents = torch.randn(bucket.batch, vae.config.latent_channels, bucket.height // factor, bucket.width // factor,
                          generator=torch.Generator().manual_seed(0))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(runs + 1):
        for tiled in (False, True):
            (vae.enable_tiling if tiled else vae.disable_tiling)()
            start = time.perf_counter()
            with torch.no_grad():
                vae.decode(latents)
            times[tiled].append(time.perf_counter() - start)
    vae.disable_tiling()
    untiled, tiled = times[False][1:], times[True][1:]
    step = int(vae.tile_latent_min_size * (1 - vae.tile_overlap_factor))
    tiles = len(range(0, latents.shape[2], step)) * len(range(0, latents.shape[3], step))
    return {"untiled_decode_s": statistics.median(untiled), "tiled_decode_s": statistics.median(tiled),
            "tiled_over_untiled": statistics.median(t / u for t, u in zip(tiled, untiled, strict=True)),
            "tiles": tiles}


def _check_takes_caches(target: Any) -> None:
    """Case aot-cache refused before any build when the target's denoiser has no step caches in
    diffusers (UNets), where its configs are on this machine (a Hub source's worker says so)."""
    from .runtime.step_cache import takes_caches
    from .sources import local_folder, read_configs

    folder = local_folder(target.source, target.base_dir)
    configs = read_configs(folder) if folder is not None else {}
    attribute = next((a for a in ("transformer", "unet") if a in configs), None)
    if attribute is not None and not takes_caches(configs[attribute]):
        raise AotbuildError(f"case {CACHE_CASE}: {target.name}'s {attribute} ({configs[attribute]['_class_name']}) "
                            f"has no step caches in diffusers (enable_cache is on its transformers)")


def _cached_against_uncached(pipe: Any, call: Any, runs: int, threshold: float) -> dict[str, Any]:
    """The same call uncached and with First-Block Cache on the denoiser, alternating, `runs` + 1
    times each (the first pair warms up); the images compared with each other."""
    import numpy as np
    from diffusers.hooks import FirstBlockCacheConfig

    denoiser = next(m for m in pipe.components.values() if getattr(m, "denoiser", False))
    times: dict[bool, list[float]] = {False: [], True: []}
    pixels: dict[bool, Any] = {}
    for _ in range(runs + 1):
        for cached in (False, True):
            if cached:
                denoiser.enable_cache(FirstBlockCacheConfig(threshold=threshold))
            try:
                made = call()
            finally:
                if cached:
                    denoiser.disable_cache()
            times[cached].append(made.total_s)
            pixels[cached] = np.asarray(made.images, dtype=np.float32) / 255
    uncached, cached = times[False][1:], times[True][1:]
    return {"cached_image_s": statistics.median(cached), "uncached_image_s": statistics.median(uncached),
            "cached_over_uncached": statistics.median(c / u for c, u in zip(cached, uncached, strict=True)),
            "cache_max_abs": float(np.abs(pixels[True] - pixels[False]).max()), "cache_threshold": threshold}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one aotbuild bench worker (spawned by `aotbuild bench`)")
    parser.add_argument("--case", choices=CASES + EXTRA_CASES, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--artifacts", required=True)
    parser.add_argument("--build", action="store_true", help="build the case's artifact (--force) and exit")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--steady", type=int)
    parser.add_argument("--mega-cache")
    parser.add_argument("--out")
    parser.add_argument("--spawn-time", type=float)
    parser.add_argument("--cache-threshold", type=float, default=CACHE_THRESHOLD)
    parser.add_argument("--convert", action="store_true", help="a peer case: convert the denoiser and exit")
    parser.add_argument("--peer-dir", help="a peer case: its saved conversion")
    parser.add_argument("--source-dir", help="a folder the target's pipeline was saved to: read instead of its source")
    parser.add_argument("--save-source", help="save the target's source pipeline into this folder and exit")
    args = parser.parse_args(argv)
    if args.save_source:
        _save_pipeline(args.target, Path(args.save_source))
        return
    if args.convert:
        _convert(args)
        return
    if args.build:
        from .builder import build

        build(_case_target(args.case, args.target), Path(args.artifacts), force=True)
        return
    _worker(args)


if __name__ == "__main__":
    main()
