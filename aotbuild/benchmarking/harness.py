"""`aotbuild bench`: cold start, steady state and memory of eager / compile / compile-cached / aot,
each repetition of each case in a fresh process, cases interleaved so machine drift cancels.

The parent (`run_bench`, here) spawns `python -m aotbuild.benchmarking.worker --case ...`
processes; each times from its own spawn (the parent's clock just before starting it) to pipeline
ready, first denoising step and first image, then steady per-step and per-image latency, and peak
memory.

A `random:` target's pipeline is saved once per run (its seeded weights, as safetensors), and every
case loads what it does not take from its artifact from that folder, read cold: eager reads the
weights aot reads, as with a real checkpoint, and no case spends time creating random weights (work
a real source does not do, which eager would do more of than aot). `random_init_s` stays reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import AotbuildError, BenchError
from ..runtime.openmp import spin_setting
from .peers import PEERS
from .report import pyplot, report, write_document

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

WORKER = (sys.executable, "-m", "aotbuild.benchmarking.worker")  # one case in a fresh process

# A bench process that runs longer than this is stopped: a hang fails the bench instead of stalling it.
WORKER_TIMEOUT_S = 3600

BUILD_TIMEOUT_S = 3 * 3600


def run_bench(target_path: str, artifacts_dir: Path, *, repeats: int = 3, steps: int = 4, steady: int = 3,
              cases: tuple[str, ...] = CASES, progress: Any = None,
              cache_threshold: float = CACHE_THRESHOLD) -> dict[str, Any]:
    """Run every case `repeats` times in fresh processes; write and return bench.json.
    `cache_threshold`: First-Block Cache's, in case aot-cache.

    Raises:
        AotbuildError: unknown case, missing artifact, or a worker failure (with its stderr).
    """
    from ..builder.targets import load_target
    from ..runtime.artifacts import built_artifact
    from ..runtime.sources import is_random
    from ..spec.manifest import environment

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
                                 or max(first.height, first.width) <= tile_pixels(target)):
        raise AotbuildError(f"case {TILING_CASE} needs vae_decoder = {{ tiling = true }} and a first bucket larger "
                            f"than a tile ({tile_pixels(target)} px); {target.name} lacks one")
    if "compile-cached" in cases and "compile" not in cases:
        raise AotbuildError("case compile-cached needs case compile (it loads the cache compile saved)")
    if CACHE_CASE in cases:
        check_takes_caches(target)
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
    ran = {t.name: t for t in (case_target(case, target_path) for case in cases)}
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
            document = report(runs, environment(target.device), meta, FIGURES)
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
    from ..builder.targets import Target

    if target.compile_mode == "regional":
        raise AotbuildError(f"case {REGIONAL_CASE} compares a whole-model target with its regional build; "
                            f"{target.name} is regional already")
    return Target.from_dict({**target.to_dict(), "name": f"{target.name}-regional", "compile_mode": "regional"},
                            base_dir=target.base_dir)


def case_target(case: str, target_path: str, source_dir: str | None = None) -> Any:
    """The target a case runs; `source_dir`: a folder its pipeline was saved to, read instead of its source."""
    from ..builder.targets import Target, load_target

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
        cmd = [*WORKER, "--build", "--case", case, "--target", str(target_path),
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
    cmd = [*WORKER, "--case", "eager", "--save-source", str(folder),
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
    cmd = [*WORKER, "--case", case, "--convert", "--target", target_path,
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
    artifact = artifacts_dir / case_target(case, target_path).name
    if case.startswith("aot"):
        drop_page_cache([p for p in artifact.rglob("*") if p.is_file()])
    if case in PEERS:
        drop_page_cache([p for p in (work / _peer_folder(case)).rglob("*") if p.is_file()])
    if source_dir is not None:
        drop_page_cache([p for p in source_dir.rglob("*") if p.is_file()])
    cache_dir = tempfile.mkdtemp(prefix="inductor-", dir=work)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
    cmd = [*WORKER, "--case", case, "--target", str(target_path),
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


def tile_pixels(target: Any) -> int:
    from ..runtime.sources import local_folder, read_configs

    folder = local_folder(target.source, target.base_dir)
    size = read_configs(folder)["vae"]["sample_size"] if folder else 1024
    return size[0] if isinstance(size, list) else size


def check_takes_caches(target: Any) -> None:
    """Case aot-cache refused before any build when the target's denoiser has no step caches in
    diffusers (UNets), where its configs are on this machine (a Hub source's worker says so)."""
    from ..runtime.sources import local_folder, read_configs
    from ..runtime.step_cache import takes_caches

    folder = local_folder(target.source, target.base_dir)
    configs = read_configs(folder) if folder is not None else {}
    attribute = next((a for a in ("transformer", "unet") if a in configs), None)
    if attribute is not None and not takes_caches(configs[attribute]):
        raise AotbuildError(f"case {CACHE_CASE}: {target.name}'s {attribute} ({configs[attribute]['_class_name']}) "
                            f"has no step caches in diffusers (enable_cache is on its transformers)")
