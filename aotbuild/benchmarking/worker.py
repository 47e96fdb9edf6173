"""One `aotbuild bench` case in a fresh process (`python -m aotbuild.benchmarking.worker`, spawned by
`harness.run_bench`): prepare the case's pipeline, time the first and steady calls, and the
figures of the cases that measure more (LoRA switches, tiled decoding, step caches, a peer's
denoiser); or build an artifact, save a random source, convert for a peer. It prints its figures
as JSON for the parent."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ..runtime.memory import rss_mib
from .harness import (
    CACHE_CASE,
    CACHE_THRESHOLD,
    CASES,
    EXTRA_CASES,
    FIGURES,
    GRAPH_CASES,
    LORA_CASE,
    LORA_RANK,
    LORA_SWITCHES,
    LORA_TARGETS,
    TILING_CASE,
    BenchError,
    case_target,
    drop_page_cache,
)
from .peers import PEERS


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

    from ..runtime.guards import StandIn

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


def _worker(args: argparse.Namespace) -> None:
    """Body of one fresh process: prepare the case's pipeline, time the first and steady calls."""
    import resource

    import torch

    from ..generation.backends import control_modes, generate, ip_adapter_loaded, prepare
    from ..runtime.sources import random_init_seconds
    from ..spec.pipelines import (
        control_image_argument,
        inpaints_control_image,
        repaint_mask,
        requires_image,
        seeded_image,
        seeded_images,
    )

    def since_spawn() -> float:
        return time.time() - args.spawn_time - random_init_seconds()

    target = case_target(args.case, args.target, args.source_dir)
    bucket = target.shapes[0]
    if args.case == "compile-cached":
        torch.compiler.load_cache_artifacts(Path(args.mega_cache).read_bytes())
    artifact = Path(args.artifacts) / target.name
    # Imported before the clock, the pipeline's model classes too (transformers imports them lazily,
    # seconds for CLIP): load_s is loading, not importing.
    import diffusers  # noqa: F401

    from ..runtime.sources import component_classes, local_folder

    if (source_folder := local_folder(target.source, target.base_dir)) is not None:
        component_classes(source_folder)

    rss_before, load_start = rss_mib(), time.perf_counter()
    backend = "aot" if args.case.startswith("aot") else "compile" if args.case == "compile-cached" else \
        "eager" if args.case in PEERS else args.case
    pipe = prepare(target, backend, Path(args.artifacts), cuda_graphs=GRAPH_CASES.get(args.case))
    chose = _denoiser_on_peer(pipe, target, args.case, Path(args.peer_dir)) if args.case in PEERS else {}
    load_s = time.perf_counter() - load_start - random_init_seconds()
    if args.case == "aot-dynamic":
        from ..runtime import CompiledComponent

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

    # A ControlNet pipeline is steered by a seeded control image of the output's size.
    control = seeded_image(bucket.height, bucket.width) if control_image_argument(type(pipe)) else None
    # SD3's inpainting ControlNet pipeline repaints the control image's right half.
    mask = repaint_mask(bucket.height, bucket.width) if inpaints_control_image(type(pipe)) else None
    # A ControlNet-Union's first mode.
    control_mode = 0 if control is not None and control_modes(pipe) is not None else None
    # An IP-Adapter (the target's, loaded by every case) takes a seeded image prompt.
    image_prompt = seeded_image(bucket.height, bucket.width) if ip_adapter_loaded(pipe) else None

    def call() -> Any:
        return generate(pipe, "a photo of a red fox in the snow", steps=args.steps, seed=0, height=bucket.height,
                        width=bucket.width, batch=bucket.batch, guidance_scale=target.guidance_scale,
                        frames=bucket.frames, image=image, text=bucket.max_sequence_length, mask=mask,
                        control=control, control_mode=control_mode,
                        image_prompt=image_prompt, built_with=target.call)

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

    from ..builder.capturing import load_source_pipeline
    from ..builder.targets import load_target
    from ..spec.pipelines import pipeline_spec

    target = load_target(target_path)
    pipe = load_source_pipeline(target, pipeline_spec(target.pipeline), torch.device("cpu"))
    pipe.save_pretrained(folder, safe_serialization=True)


def _denoiser_spec(target: Any) -> Any:
    from ..spec.pipelines import pipeline_spec

    return next(spec for spec in pipeline_spec(target.pipeline).components.values() if spec.denoiser)


def _convert(args: argparse.Namespace) -> None:
    """Body of a conversion process: the denoiser's float32 model, exported at the call the float32
    pipeline makes at the first bucket, converted by the peer and saved into --peer-dir, with the
    dtypes of the tensors it takes."""
    from .peers import call_tensors, reference_call, tensor_program

    target = case_target(args.case, args.target)
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

    from ..runtime.lora import meta_model

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

    from ..runtime.cache import package_cache_dir

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


def _tiled_against_untiled(pipe: Any, bucket: Any, runs: int) -> dict[str, Any]:
    """Decode the bucket's latents whole and by tiles, alternating, `runs` + 1 times each (the
    first pair warms up); the same compiled pipeline, the same latents."""
    import torch

    from ..spec.pipelines import vae_factor

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
        from ..builder.flow import build

        build(case_target(args.case, args.target), Path(args.artifacts), force=True)
        return
    _worker(args)


if __name__ == "__main__":
    main()
