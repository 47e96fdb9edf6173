"""Validation: every compiled variant, loaded as the runtime loads it, against the eager reference
(float32, or the target's `reference_dtype`) on the captured calls (and replayed as a CUDA graph
where the target asks)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import BuildError, NumericsError
from ..runtime import CompiledComponent
from ..runtime.load import load_built_ip_adapter
from ..runtime.regional import component_variants
from ..runtime.variant import LoadContext
from ..spec.manifest import reference_dtype, validated_with_tf32, write_manifest
from ..spec.pipelines import PipelineSpec
from ..spec.private_apis import pytree
from . import optimize
from .capturing import Loop
from .plan import CapturePoint, VariantPlan

# Largest allowed relative error (max |compiled - eager fp32| / max |eager fp32|) per compute dtype.
TOLERANCES = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}
# A CUDA graph replays the very kernels of a plain run on the same inputs: only the order of
# atomic additions may differ.
GRAPH_TOLERANCE = 1e-3


def load_artifact(out: Path, manifest: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The artifact loaded as a load loads it (the manifest written first, with its files' hashes):
    once, for both validations. A second load would hold a second copy of every packed constant
    till the build ends: torch 2.13 never deletes its handle to a user-managed constant (fixed
    upstream by pytorch#194480). Returns {pipeline attribute: module}, as `load_components` does."""
    from ..runtime import load_components
    from ..runtime.load import SlowPrecisionWarning

    write_manifest(out, manifest)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPrecisionWarning)  # the build said so as it began
        _, modules = load_components(out, device=device)
    return modules


def loaded_components(modules: dict[str, Any]) -> dict[str, CompiledComponent]:
    """A load's compiled components by component name: a VAE stand-in's parts by theirs."""
    found = {}
    for module in modules.values():
        for component in module.parts.values() if isinstance(getattr(module, "parts", None), dict) else [module]:
            found[component.component_name] = component
    return found


def validate_artifact(out: Path, manifest: dict[str, Any], modules: dict[str, Any], reference: dict,
                      points: dict[str, CapturePoint], plans: dict[str, list[VariantPlan]],
                      allow_drift: bool) -> None:
    """Run each compiled variant of the loaded artifact (`load_artifact`'s modules) on the reference's
    captured inputs (cast to the variant's dtypes) and compare with the eager reference's output at
    every point it serves: a bucket with 1 image and its batch (and with and without guidance),
    the dynamic model at the range's corners and its base point, a tile model at the smallest and
    largest tiles. Records each variant's errors in `manifest`."""
    failures, graph_failures = [], []
    components = loaded_components(modules)
    for name, entry in manifest["components"].items():
        component = components[name]
        tolerance = optimize.tolerance(manifest["target"]["optimize"], TOLERANCES[entry["dtype"]])
        loaded = {variant.name: variant for variant in component.variants}
        for variant_entry in entry["variants"]:
            variant = loaded[variant_entry["name"]]
            checked = next(plan.points for plan in plans[name] if plan.name == variant.name)
            errors = {}
            for point in checked:
                call = reference[point][name]
                leaves = variant.flatten(call.args, call.kwargs)
                if leaves is None or not variant.accepts(leaves):
                    raise BuildError(f"{name} {variant.name}: the compiled model refuses the inputs captured at "
                                     f"{points[point]}")
                with torch.no_grad():
                    errors[str(points[point])] = output_errors(variant.run(leaves), call.output)
            worst = {key: max((e[key] for e in errors.values()), key=_nan_first) for key in ERROR_KEYS}
            variant_entry["numerics"] = {
                **worst, "tolerance": tolerance, "reference": f"eager {reference_dtype(manifest)}, unoptimized, "
                                                               f"every output",
                "checked_at": list(errors),
            }
            if problem := beyond_tolerance(worst, tolerance):
                failures.append(f"{name} {variant.name}: {problem}")
        if any(getattr(variant, "graph_pool", None) is not None for variant in loaded.values()):
            graph_failures += _check_cuda_graphs(out / entry["package"], manifest["files"][entry["package"]]["sha256"],
                                                 entry, name, component, reference, validated_with_tf32(manifest))
    if graph_failures:  # a wrong replay is a defect, not drift: no flag accepts it
        raise BuildError("; ".join(graph_failures), hint="set cuda_graphs = false in the target")
    if failures and not allow_drift:
        raise NumericsError("compiled output differs from eager: " + "; ".join(failures),
                            hint="inspect the recipe, or accept with --allow-numerics-drift")


def validate_loop(manifest: dict[str, Any], modules: dict[str, Any], pipe: Any, spec: PipelineSpec, loop: Loop,
                  device: torch.device, allow_drift: bool, base_dir: Path = Path(".")) -> dict[str, Any]:
    """The capture's short denoising loop again, in the pipeline with the artifact's `modules`
    swapped in (`load_artifact`'s), against the eager reference loop's final latents: an error every
    single call keeps within tolerance can grow over the steps, and fails the build here. Returns
    what the manifest records of it (`validation.loop`). `base_dir`: the target's folder, where a
    local file it names is looked for."""
    for attribute, module in modules.items():
        setattr(pipe, attribute, module)
    if manifest["target"].get("ip_adapter"):  # as load_pipeline loads it
        load_built_ip_adapter(pipe, manifest["target"], base_dir)
    encodes = spec.prompt_embeds is None  # the pipeline encodes its prompt itself, as at capture
    others = [m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module) and name not in modules
              and (encodes or not name.startswith("text_encoder"))]
    for module in others:
        module.to(device)
    try:
        got = loop.run(pipe)
    finally:
        for module in others:
            module.to("cpu")
    errors = output_errors(got, loop.latents)
    tolerance = max(v["numerics"]["tolerance"] for name, entry in manifest["components"].items()
                    if spec.component(name).denoiser for v in entry["variants"])
    against = f"eager {reference_dtype(manifest)}"
    record = {"steps": loop.steps, "at": loop.point, "compared": "final latents" if loop.output_type == "latent"
              else "final images", **errors, "tolerance": tolerance, "reference": f"{against}, unoptimized"}
    if (problem := beyond_tolerance(errors, tolerance)) and not allow_drift:
        raise NumericsError(f"a {loop.steps}-step denoising loop at {loop.point} drifts from {against}: its "
                            f"{record['compared']}' {problem} (every single call was within it: the error grows "
                            f"over the steps)", hint="inspect the recipe, or accept with --allow-numerics-drift")
    return record


def _check_cuda_graphs(package: Path, sha256: str, entry: dict[str, Any], name: str, component: CompiledComponent,
                       reference: dict, tf32: bool) -> list[str]:
    """The runtime's graph mode, as loaded (every bucket of the component captured into one shared
    pool), against plain runs of the same models on the same weights: each replayed on the captured
    inputs, then on new random ones. Records each variant's largest relative difference in its
    numerics (in `entry`); returns the failures."""
    graphed = {v.name: v for v in component.variants if getattr(v, "graph_pool", None) is not None}
    opened, _ = component_variants(package, entry, component.weights, sha256, entry["constants"]["layouts"],
                                   LoadContext(component.device, tf32=tf32))
    plain = {v.name: v for v in opened}
    generator = torch.Generator().manual_seed(0)
    diffs: dict[str, float] = dict.fromkeys(graphed, 0.0)
    first: dict[str, torch.Tensor] = {}
    failures = []
    for fresh in (False, True):
        for variant, model in graphed.items():
            call = reference[variant][name]  # a bucket's export point is named after it
            leaves = [(path, torch.randn(leaf.shape, generator=generator).to(leaf.dtype)
                       if fresh and isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf)
                      for path, leaf in plain[variant].flatten(call.args, call.kwargs)]
            with torch.no_grad():
                got, want = (_first_output(m.run(leaves)).float() for m in (model, plain[variant]))
            diff = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
            diffs[variant] = max(diffs[variant], diff, key=_nan_first)  # NaN wins
            if fresh and torch.equal(got, first[variant]):
                failures.append(f"{name} {variant}: the CUDA graph replay ignored its new inputs")
            first[variant] = got
    for variant_entry in entry["variants"]:
        if (diff := diffs.get(variant_entry["name"])) is not None:
            variant_entry["numerics"]["cuda_graph_rel_diff"] = diff
            if not diff <= GRAPH_TOLERANCE:
                failures.append(f"{name} {variant_entry['name']}: CUDA graph replay differs from the plain run by "
                                f"{diff:.3g} (relative) > {GRAPH_TOLERANCE:g}")
    return failures


# What `output_errors` measures; each relative one is held to the component's tolerance.
ERROR_KEYS = ("max_abs_error", "max_rel_error", "rel_l2_error")


def output_errors(result: Any, expected: Any) -> dict[str, float]:
    """How far a model's outputs are from the eager reference's, the worst over every output (a
    tuple's, a list's): the largest absolute difference, that over the largest absolute value of
    the eager output (an error in a few values), and the relative L2 norm of the difference (an
    error spread over all of them). The build's numerics, and the bench's."""
    got, want = pytree.tree_leaves(result), pytree.tree_leaves(expected)
    if len(got) != len(want):
        nan = float("nan")
        return {"max_abs_error": nan, "max_rel_error": nan, "rel_l2_error": nan}  # fails any tolerance
    worst = dict.fromkeys(ERROR_KEYS, 0.0)
    for g, w in zip(got, want, strict=True):
        if not isinstance(g, torch.Tensor) or not isinstance(w, torch.Tensor):
            continue
        g, w = g.float().flatten(), w.float().flatten().to(g.device)
        difference = g - w if g.shape == w.shape else torch.full((1,), float("nan"))
        error = difference.abs().max().item()
        measured = {"max_abs_error": error, "max_rel_error": error / max(w.abs().max().item(), 1e-6),
                    "rel_l2_error": (difference.norm() / w.norm().clamp_min(1e-6)).item()}
        worst = {key: max(worst[key], measured[key], key=_nan_first) for key in ERROR_KEYS}
    return worst


def beyond_tolerance(errors: dict[str, float], tolerance: float) -> str | None:
    """The relative error past `tolerance` (NaN included), said with its figure; None within."""
    for key in ("max_rel_error", "rel_l2_error"):
        if not errors[key] <= tolerance:
            what = "relative error" if key == "max_rel_error" else "relative L2 error"
            return f"{what} {errors[key]:.3g} > {tolerance:g}"
    return None


def _nan_first(value: float) -> float:
    return value if value == value else float("inf")


def _first_output(result: Any) -> torch.Tensor:
    """A compiled model's sample (the first output), flat: Z-Image's is a list, one per image."""
    return _flat(result[0] if isinstance(result, tuple) else result)


def _flat(tree: Any) -> torch.Tensor:
    leaves = pytree.tree_leaves(tree)
    return leaves[0] if len(leaves) == 1 else torch.cat([t.flatten() for t in leaves])
