"""Export, compile and package one component: each variant's input signature and dims, its
exported program checked against the calls it serves, AOTInductor, the weight-less package and
its weights, the component's manifest entry."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import BuildError
from ..runtime import leaf_signature, open_model
from ..runtime.attention import LIBRARY_FILE
from ..runtime.checkpoint import module_tensors
from ..runtime.ip_adapter import loaded_form
from ..runtime.prepared import sources as prepared_sources
from ..runtime.variant import leaf_name
from ..runtime.weights import same_layout
from ..spec import shapes
from ..spec.manifest import sha256_file
from ..spec.pipelines import KEPT_MODULES, TEXT, ComponentSpec, plain_attribute
from ..spec.private_apis import fake_tensor_mode, pytree
from . import attention, capture, export, optimize, regions
from .context import BuildContext
from .plan import CapturePoint, VariantPlan


def variant_dims(component: str, plan: VariantPlan, reference: dict,
                  points: dict[str, CapturePoint]) -> tuple[list | None, list[int] | None]:
    """(how each input dim follows the call's batch, height, width and text length; the call batches served),
    or (None, None) for a static model. Batch dims are in units of the call's batch."""
    calls = [reference[p][component] for p in plan.points]
    batches = [capture.call_batch(c) for c in calls]
    call_batch = [min(batches), max(batches)]
    if plan.kind == "bucket":
        if call_batch[0] == call_batch[1]:
            return None, None
        high, low = calls[0], calls[batches.index(call_batch[0])]
        probes = {"base": capture.tensor_shapes(high), "batch": capture.tensor_shapes(low)}
        probes |= {"height": probes["base"], "width": probes["base"]}
        sizes = {"base": (batches[0], 0, 0), "batch": (call_batch[0], 0, 0), "height": (batches[0], 0, 0),
                 "width": (batches[0], 0, 0)}
        return shapes.classify(probes, {"min": probes["base"], "max": probes["base"]}, sizes, 1), call_batch
    prefix = plan.points[0].rsplit(":", 1)[0]

    def at(probe: str) -> list[list[int]]:
        return capture.tensor_shapes(reference[f"{prefix}:{probe}"][component])

    probes = {probe: at(probe) for probe in ("base", *shapes.axes_of(plan.ranges))}
    corners = {probe: at(probe) for probe in ("min", "max")}
    sizes = {probe: (points[f"{prefix}:{probe}"].batch, points[f"{prefix}:{probe}"].height,
                     points[f"{prefix}:{probe}"].width, points[f"{prefix}:{probe}"].frames) for probe in probes}
    # A fixed batch of images that guidance moves (a denoiser's), or the control image's encoding
    # per guidance half (SD3's ControlNet pipeline's VAE encoder): its batch probe, in call batches.
    twin = next((t for t in ("base:unguided", "base:control") if f"{prefix}:{t}" in plan.points), None)
    if twin is not None:
        probes["batch"] = at(twin)
        sizes = {probe: (batches[0], *size[1:]) for probe, size in sizes.items()}
        sizes["batch"] = (batches[plan.points.index(f"{prefix}:{twin}")], *sizes["base"][1:])
    dims = shapes.classify(probes, corners, sizes, plan.ranges["stride"])
    if TEXT in plan.ranges:
        texts = {probe: points[f"{prefix}:{probe}"].text for probe in (*probes, *corners)}
        dims = shapes.with_text_offsets(dims, probes | corners, texts)
    return shapes.in_call_batches(dims), call_batch


def variant_entry(plan: VariantPlan, call: capture.CapturedCall, leaf_dims: list | None,
                   call_batch: list[int] | None, guidance: list[str] | None) -> dict[str, Any]:
    """The manifest entry of one variant: what it covers and its inputs' signature."""
    entry: dict[str, Any] = {"name": plan.name}
    if plan.kind == "bucket":
        bucket = plan.bucket
        entry["bucket"] = {"batch": bucket.batch, "height": bucket.height, "width": bucket.width,
                           **({TEXT: bucket.max_sequence_length} if bucket.max_sequence_length else {}),
                           **({"image": list(bucket.image)} if bucket.image else {}),
                           **({"images": [list(size) for size in bucket.images]} if bucket.images else {}),
                           **({"frames": bucket.frames} if bucket.frames else {})}
        entry["inputs"] = leaf_signature((call.args, call.kwargs))
        if leaf_dims is not None:
            tensor_dims = iter(leaf_dims)
            for leaf in entry["inputs"]:
                if "shape" in leaf:
                    leaf["dims"] = next(tensor_dims)
    else:
        entry["dynamic"] = dict(plan.ranges)
        if plan.images:
            entry["dynamic"]["images"] = [list(size) for size in plan.images]
        entry["inputs"] = _dynamic_signature(call, leaf_dims)
    if call_batch is not None:
        entry["call_batch"] = call_batch
    if guidance is not None:
        entry["guidance"] = guidance
    if plan.kind == "tile":
        entry["tile"] = True
    return entry


def batches_guidance(reference: dict[str, dict[str, capture.CapturedCall]], specs: list[ComponentSpec]) -> bool:
    """Whether the pipeline doubles its denoiser's batch under guidance, as captured: not when a
    guided call and its unguided twin pass the same batch (Chroma calls it twice per step)."""
    for point, calls in reference.items():
        if point.endswith(":unguided"):
            twin = reference[point.removesuffix(":unguided")]
            if any(s.denoiser and s.name in calls
                   and capture.call_batch(calls[s.name]) == capture.call_batch(twin[s.name]) for s in specs):
                return False
    return True


def served_guidance(spec: ComponentSpec, plan: VariantPlan, modes: tuple[bool, ...]) -> list | None:
    """Which guidance a denoiser's variant serves (None: not a denoiser whose batch it changes,
    `modes` empty)."""
    if not (spec.per_step and modes):
        return None
    served = {False if p.endswith(":unguided") else modes[0] for p in plan.points}
    return [g for g, on in (("guided", True), ("unguided", False)) if on in served]


def export_checked(ctx: BuildContext, module: torch.nn.Module, name: str, plan: VariantPlan,
                   call: capture.CapturedCall, leaf_dims: list | None, call_batch: list[int] | None,
                   entry: dict[str, Any], served: dict[str, capture.CapturedCall]) -> torch.export.ExportedProgram:
    """torch.export of one variant: static, or dynamic over its dims, with what the program
    assumes of its input sizes recorded in `entry` and checked against every call it serves.
    Sequences (Flux's image tokens, Chroma's attention mask over text + image tokens) are related
    by the code: export infers how (Dim.AUTO). A dynamic export that traces the model in Python
    (non-strict) and fixes a size the calls vary (Z-Image's `len(caption)`) is traced again by
    TorchDynamo (strict), which keeps such sizes symbolic."""
    from torch.export import Dim

    dynamic_shapes = None
    if leaf_dims is not None:
        ranges = {**(plan.ranges or {}), "batch": call_batch}
        dynamic_shapes = shapes.export_dynamic_shapes(module, call.args, call.kwargs, leaf_dims, ranges,
                                                      (plan.ranges or {}).get("stride", 1), tokens=Dim.AUTO)

    def traced(strict: bool) -> torch.export.ExportedProgram:
        with ctx.stages("export", f"{name} {plan.name}" + (" (again, strict: a size was fixed)" if strict else "")):
            return export.export_variant(module, call.args, call.kwargs, optimize.export_context(ctx.target.optimize),
                                         dynamic_shapes, strict=strict)

    def checked(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        entry.pop("guards", None)
        _record_relations(entry, program, call, name)
        _check_served(program, entry, call, served, name, plan.name)
        if leaf_dims is not None:
            export.unify_input_sizes(program, leaf_dims)
        return program

    _check_values(call, served, name, plan.name)
    program = traced(strict=False)
    try:
        return checked(program)
    except BuildError as fixed:
        if dynamic_shapes is None:
            raise
        try:
            program = traced(strict=True)
        except BuildError:
            raise fixed from None  # strict tracing failed: the first reason is the one to read
        return checked(program)


def _record_relations(entry: dict[str, Any], program: torch.export.ExportedProgram, call: capture.CapturedCall,
                      component: str) -> None:
    """Each dynamic dim of the entry's inputs gets its size in the exported program ("expr"), which
    the runtime checks every call against. A dim export made static, or relations the runtime
    could not check, fail the build: AOTInductor would run any shape on them unchecked."""
    exported = iter(export.input_dims(program))
    for leaf in entry["inputs"]:
        if "value" in leaf:
            continue
        sizes = next(exported)
        for d, (dim, size) in enumerate(zip(leaf.get("dims", ()), sizes, strict=False)):
            if not isinstance(dim, dict):
                continue
            if isinstance(size, int):
                raise BuildError(f"{component} {entry['name']}: torch.export made input {leaf['path']} dim {d} static "
                                 f"({size}) where the pipeline's calls vary it: the model does not take it dynamic",
                                 hint="cover those sizes with [[shapes]] buckets instead of [dynamic]")
            if shapes.polynomial(size) is None:
                raise BuildError(f"{component} {entry['name']}: input {leaf['path']} dim {d} is {size} in the exported "
                                 f"program, a relation aotbuild cannot check at call time",
                                 hint="cover those sizes with [[shapes]] buckets instead of [dynamic]")
            dim["expr"] = size
    dims = [leaf.get("dims", leaf.get("shape")) for leaf in entry["inputs"] if "value" not in leaf]
    guards = export.shape_guards(program)
    if uncheckable := shapes.uncheckable_guard(guards):
        raise BuildError(f"{component} {entry['name']}: the exported program assumes {uncheckable} of its input "
                         f"sizes, which aotbuild cannot check at call time (not integer arithmetic on them)",
                         hint="cover those sizes with [[shapes]] buckets instead of [dynamic]")
    if guards:
        entry["guards"] = guards
    if not shapes.relations_hold(dims, capture.tensor_shapes(call), guards):
        found = ", ".join(d["expr"] for leaf in dims for d in leaf if isinstance(d, dict))
        raise BuildError(f"{component} {entry['name']}: the exported program relates its inputs' sizes in a way "
                         f"aotbuild cannot check at call time ({found})",
                         hint="cover those sizes with [[shapes]] buckets instead of [dynamic]")


def _check_served(program: torch.export.ExportedProgram, entry: dict[str, Any], example: capture.CapturedCall,
                  calls: dict[str, capture.CapturedCall], component: str, variant: str) -> None:
    """Check each call the variant serves against what the exported program assumes (its
    relations and guards), then run the program on fake tensors shaped as the call. Export can
    make a size static without a word (a tensor built from a Python list as long as the batch
    becomes a constant), and compiled code checks no shape: a call of another size would corrupt
    memory at run time. Fake tensors cost no compute, and the ops' own shape checks run."""
    graph = program.module(check_guards=False)
    examples = [t for t in pytree.tree_leaves((example.args, example.kwargs)) if isinstance(t, torch.Tensor)]
    dims = [leaf.get("dims", leaf.get("shape")) for leaf in entry["inputs"] if "value" not in leaf]
    for point, call in calls.items():
        sizes = capture.tensor_shapes(call)
        if sizes == capture.tensor_shapes(example):
            continue
        bound = shapes.solve(dims, sizes)
        if bound is None:
            raise BuildError(f"{component} {variant}: the exported program fixes or relates its input sizes in a way "
                             f"the call at {point} breaks: torch.export fixed a size that this call changes",
                             hint="cover those sizes with [[shapes]] buckets of their own")
        if guard := shapes.failed_guard(entry.get("guards", ()), bound):
            raise BuildError(f"{component} {variant}: the exported program assumes {guard} of its input sizes (a "
                             f"branch the model's code took at the example's sizes), which the call at {point} breaks",
                             hint="cover those sizes with [[shapes]] buckets of their own, or a [dynamic] range "
                                  "whose sizes all take the same branch")
        with fake_tensor_mode():
            fakes = [_empty_like(t, size) for t, size in zip(examples, sizes, strict=True)]
            leaves, structure = pytree.tree_flatten((example.args, example.kwargs))
            taken = iter(fakes)
            args, kwargs = pytree.tree_unflatten([next(taken) if isinstance(leaf, torch.Tensor) else leaf
                                                  for leaf in leaves], structure)
            try:
                graph(*args, **kwargs)
            except Exception as exc:
                raise BuildError(f"{component} {variant}: the exported program cannot run the call at {point} "
                                 f"({str(exc).splitlines()[0]}): torch.export fixed a size that this call changes",
                                 hint="cover those sizes with [[shapes]] buckets of their own") from exc


def _check_values(example: capture.CapturedCall, calls: dict[str, capture.CapturedCall], component: str,
                  variant: str) -> None:
    """Every call the variant serves passes its inputs in the example's structure, and the ones
    that are not tensors are the same: a compiled model takes them as constants (Qwen-Image's
    `img_shapes` follow the size). Z-Image passes a list with an entry per image and per guidance
    branch, so its guided and unguided calls differ in structure."""
    values, structure = dict(_value_leaves(example)), pytree.tree_structure((example.args, example.kwargs))
    for point, call in calls.items():
        if pytree.tree_structure((call.args, call.kwargs)) != structure:
            given = {path for path, _ in pytree.tree_flatten_with_path((call.args, call.kwargs))[0]}
            expected = {path for path, _ in pytree.tree_flatten_with_path((example.args, example.kwargs))[0]}
            inputs = ", ".join(sorted(leaf_name(p) for p in given ^ expected)) or "their nesting"
            raise BuildError(f"{component} {variant}: the call at {point} passes other inputs than the example "
                             f"({inputs}): one compiled model takes one structure",
                             hint='build guided and unguided calls as targets of their own (guidance = "guided" or '
                                  '"unguided"), or each size as a [[shapes]] bucket')
        for path, value in _value_leaves(call):
            if repr(value) != repr(values.get(path)):
                raise BuildError(f"{component} {variant}: input {path} is {value!r} at {point} and "
                                 f"{values.get(path)!r} at the example: a Python value that follows the call's "
                                 f"size, which one compiled model takes as a constant",
                                 hint="cover those sizes with [[shapes]] buckets of their own")


def _value_leaves(call: capture.CapturedCall) -> list[tuple[str, Any]]:
    """The call's inputs that are not tensors (Qwen-Image's `img_shapes`), by path."""
    return [(leaf_name(path), leaf) for path, leaf in pytree.tree_flatten_with_path((call.args, call.kwargs))[0]
            if not isinstance(leaf, torch.Tensor)]


def _empty_like(tensor: torch.Tensor, size: list[int]) -> torch.Tensor:
    """An empty tensor of `size` with `tensor`'s dtype, device and memory format."""
    nhwc = tensor.ndim == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last)
    return torch.empty(size, dtype=tensor.dtype, device=tensor.device,
                       memory_format=torch.channels_last if nhwc else torch.contiguous_format)


def compile_all(ctx: BuildContext, programs: dict[str, torch.export.ExportedProgram],
                what: str) -> tuple[dict[str, list], dict[str, dict[str, Any]], float]:
    """Each program compiled: its files, the recipes of the constants it folded (prepack), and
    the seconds the compiles took. With `optimize.sdpa = "aotbuild"` the attention kernel's
    library goes into the artifact once a program calls it."""
    compiled, folded, start = {}, {}, time.perf_counter()
    kernel, calling = ctx.target.optimize.get("sdpa") == "aotbuild", False
    for i, (name, program) in enumerate(programs.items(), 1):
        with ctx.stages("compile", f"{what} {name} ({i}/{len(programs)}, AOTInductor)"):
            compiled[name], folded[name], (replaced, attentions) = export.compile_variant(
                program, ctx.inductor_options, attention=kernel)
        if kernel and attentions:
            rest = "" if replaced == attentions else (f", the rest ATen's (a mask, causal, float16, or a head size "
                                                      f"over {attention.MAX_HEAD_SIZE} or odd in bf16)")
            ctx.stages.progress("compile", f"{what} {name}: {replaced} of {attentions} attentions call aotbuild's "
                                           f"kernel{rest}")
        calling |= replaced > 0
    if calling:
        (ctx.out / LIBRARY_FILE).parent.mkdir(exist_ok=True)
        shutil.copyfile(attention.compiled_library(), ctx.out / LIBRARY_FILE)
    return compiled, folded, time.perf_counter() - start


def _block_counts(spec: ComponentSpec, module: torch.nn.Module) -> dict[str, int]:
    """The lists of blocks the pipeline reads of a model, by their number (Bria FIBO counts its
    transformer's): `runtime.component.CompiledBlocks`. A key of their own, which a runtime that
    does not know it leaves out (the pipeline then says the attribute is missing)."""
    return {a: len(value) for a in spec.read_attributes
            if isinstance(value := _get_dotted(module, a, None), torch.nn.ModuleList)}


def component_record(spec: ComponentSpec, module: torch.nn.Module, dtype: str, compiled: dict[str, list],
                      compile_s: float, constants: dict[str, torch.Tensor], layouts: dict[str, dict],
                      variants: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "attribute": spec.attribute, "method": spec.method,
        "package": f"{spec.name}.pt2", "weights": f"{spec.name}.safetensors",
        "dtype": dtype,
        "custom_ops": sorted({ns for files in compiled.values() for ns in export.custom_ops_called(files)}),
        # Less the folder it was read from: a machine path (an HF cache, a local checkout); the
        # defaults diffusers filled in, sorted (it lists them from a set: an order per process).
        "config": {k: sorted(v) if k == "_use_default_values" else v for k, v in module.config.items()
                   if k != "_name_or_path"},
        "attributes": {a: value for a in spec.read_attributes  # that the model has (Chroma's
                       # `encoder_hid_proj.num_ip_adapters` where `encoder_hid_proj` is None: not)
                       if (value := _get_dotted(module, a, _ABSENT)) is not _ABSENT and plain_attribute(value)},
        **({"block_counts": counts} if (counts := _block_counts(spec, module)) else {}),
        **({"ip_adapter": form} if (form := loaded_form(module)) is not None else {}),
        "constants": {"count": len(constants), "bytes": sum(t.nbytes for t in constants.values()),
                      "layouts": layouts},
        "compile_s": round(compile_s, 1),  # AOTInductor, every variant: how the build's cost grows with the model
        "variants": variants,
    }


def build_component(ctx: BuildContext, spec: ComponentSpec, module: torch.nn.Module, plans: list[VariantPlan],
                    dtype: str) -> dict[str, Any]:
    """Export, compile and package every variant of one component; returns its manifest entry."""
    exported = spec.export_module(module).eval()
    programs, variants = {}, []
    for plan in plans:
        call = ctx.examples[plan.points[0]][spec.name]
        leaf_dims, call_batch = ctx.dims[spec.name][plan.name]
        variants.append(variant_entry(plan, call, leaf_dims, call_batch, served_guidance(spec, plan, ctx.modes)))
        programs[plan.name] = export_checked(ctx, exported, spec.name, plan, call, leaf_dims, call_batch, variants[-1],
                                             {p: ctx.reference[p][spec.name] for p in plan.points})
    export.name_constants_apart(programs)
    compiled, folded, compile_s = compile_all(ctx, programs, spec.name)
    kept = {fqn: tensor for fqn, tensor in module_tensors(exported).items() if fqn.split(".")[0] in KEPT_MODULES}
    with ctx.stages("package", f"{spec.name}.pt2 + {spec.name}.safetensors"):
        constants, layouts = write_package(ctx.out, spec.name, compiled, programs, torch.device(ctx.target.device),
                                           kept=kept, folded=folded)
    for variant in variants:
        if folded[variant["name"]]:
            variant["prepared"] = folded[variant["name"]]
    record = component_record(spec, module, dtype, compiled, compile_s, constants, layouts, variants)
    if unread := export.unread_weights(list(programs.values()), constants):
        record["unread"] = unread
    return record


def is_literal(text: str) -> bool:
    """Whether a recorded non-tensor input can be made again from its repr (the runtime does)."""
    import ast

    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    return True


def _dynamic_signature(call: capture.CapturedCall, dims: list) -> list[dict[str, Any]]:
    """Like leaf_signature, with each tensor's dims as classified and its memory layout."""
    leaves = leaf_signature((call.args, call.kwargs))
    tensor_dims = iter(dims)
    tensors = iter(t for t in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(t, torch.Tensor))
    for leaf in leaves:
        if "shape" in leaf:
            tensor = next(tensors)
            del leaf["shape"], leaf["stride"]
            leaf["dims"] = next(tensor_dims)
            nhwc = tensor.ndim == 4 and not tensor.is_contiguous() and tensor.is_contiguous(
                memory_format=torch.channels_last)
            if nhwc or tensor.is_contiguous() or not export.dense(tensor):
                leaf["layout"] = "channels_last" if nhwc else "contiguous"
            else:  # a permuted view (SD 1.5's transformer blocks take one): its dims from outer to inner in memory
                leaf["layout"] = sorted(range(tensor.ndim), key=lambda d: (-tensor.stride(d), d))
    return leaves


def write_package(out: Path, name: str, compiled: dict[str, list], programs: dict[str, torch.export.ExportedProgram],
                   device: torch.device, regional: tuple | None = None, kept: dict[str, torch.Tensor] | None = None,
                   folded: dict[str, dict[str, Any]] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Write the package, then the weights: exactly the constants some variant binds (the
    programs also hold parameters no compiled code reads, e.g. the q/k/v projections that
    fuse_qkv replaced), each in the memory order the code reads it, and the `kept` tensors the
    pipeline reads from the module itself (`KEPT_MODULES`). Returns (constants, layouts).

    `regional` (model, regions, instances, region entries): the constants are every instance's
    (by the model's FQNs), each region's lifted ones once (`<region>.<name>`), and the eager
    part's parameters and buffers; each region variant's entry records the names it binds.

    `folded` (prepack), by model: the recipes of the constants freezing folded. Those the model
    binds are made at load from weights, which are stored instead; `folded` keeps only them."""
    from safetensors.torch import save_file

    package_file, weights_file = f"{name}.pt2", f"{name}.safetensors"
    export.package(out / package_file, compiled)
    sha256 = sha256_file(out / package_file)
    binds = {model: list(open_model(out / package_file, sha256, model, device).get_constant_fqns())
             for model in compiled}
    known = {fqn for program in programs.values() for fqn in (*program.state_dict, *program.constants)}
    for model, recipes in (folded or {}).items():
        made = {name: recipes[name] for name in binds[model] if name in recipes}
        recipes.clear()
        recipes.update(made)
        binds[model] = sorted((set(binds[model]) - set(made)).union(*map(prepared_sources, made.values())))
        if unrecorded := [fqn for fqn in binds[model] if fqn not in known]:
            raise BuildError(f"{name} {model}: the compiled model binds {unrecorded[0]!r}, a constant inductor made "
                             f"from the weights in a way aotbuild did not record, so it could not be made from other "
                             f"weights at load", hint="build without the [inductor] options that pack weights "
                                                      "themselves, or without optimize.prepack")
    if regional is None:
        constants = export.constants_of(list(programs.values()), {fqn for names in binds.values() for fqn in names})
    else:
        constants = regional_constants(*regional, binds, programs)
    constants = {**constants, **(kept or {})}
    stored, layouts = export.storage_order(constants)
    save_file({k: v.cpu() for k, v in stored.items()}, os.fspath(out / weights_file))
    (out / weights_file).chmod(0o644)
    return constants, layouts


_ABSENT = object()


def _get_dotted(obj: Any, dotted: str, *default: Any) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, *default)
    return obj


def regional_constants(module: torch.nn.Module, found: list[regions.Region], instances: dict[str, torch.nn.Module],
                        entries: list[dict[str, Any]], binds: dict[str, list[str]],
                        programs: dict[str, torch.export.ExportedProgram]) -> dict[str, torch.Tensor]:
    constants: dict[str, torch.Tensor] = {}
    for region, entry in zip(found, entries, strict=True):
        names = sorted({n for v in entry["variants"] for n in binds[v["model"]]})
        for variant in entry["variants"]:
            variant["constants"] = binds[variant["model"]]
        first = instances[region.instances[0]]
        own = {n for n, _ in [*first.named_parameters(), *first.named_buffers()]}
        lifted = export.constants_of([programs[v["model"]] for v in entry["variants"]], set(names) - own)
        entry["shared_constants"] = sorted(lifted)
        constants.update({f"{region.name}.{n}": t for n, t in lifted.items()})
        per_instance = [regions.instance_constants(region, instances[fqn], fqn, names, lifted)
                        for fqn in region.instances]
        for mine in per_instance:
            for (full, tensor), like in zip(mine.items(), per_instance[0].values(), strict=True):
                if not same_layout(tensor, like, like.device):
                    raise BuildError(f"{region.name}: {full} is {list(tensor.shape)} {tensor.dtype}, unlike the "
                                     f"region's first block {region.instances[0]}")
            constants.update(mine)
    prefixes = tuple(f"{fqn}." for fqn in instances)
    for fqn, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if not fqn.startswith(prefixes):
            constants[fqn] = tensor.detach()
    return constants
