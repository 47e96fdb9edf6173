"""The regional build: each repeated block of a denoiser exported and compiled once per
variant, every instance's weights and the eager part's stored beside them."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import BuildError
from ..spec.pipelines import ComponentSpec
from ..spec.private_apis import pytree
from . import regions
from .context import BuildContext
from .packaging import (
    compile_all,
    component_record,
    export_checked,
    is_literal,
    served_guidance,
    variant_entry,
    write_package,
)
from .plan import VariantPlan


def build_regional(ctx: BuildContext, spec: ComponentSpec, module: torch.nn.Module, found: list[regions.Region],
                   instances: dict[str, torch.nn.Module], plans: list[VariantPlan], dtype: str) -> dict[str, Any]:
    """Export and compile each region once per variant, package them all in one file, and store
    every instance's weights and the eager part's (`runtime/regional.py` runs them); returns the
    component's manifest entry. The component's variants record the call signatures the runtime
    checks each call against, as for a whole model."""
    module = module.eval()
    variants = []
    for plan in plans:
        call = ctx.examples[plan.points[0]][spec.name]
        entry = variant_entry(plan, call, *ctx.dims[spec.name][plan.name], served_guidance(spec, plan, ctx.modes))
        for leaf in entry["inputs"]:
            if "value" in leaf and not is_literal(leaf["value"]):
                raise BuildError(f"{spec.name}: input {leaf['path']} is {leaf['value']}, which a regional model cannot "
                                 f"record", hint='use [compile] mode = "whole"')
        entry["in_spec"] = pytree.treespec_dumps(pytree.tree_flatten((tuple(call.args), call.kwargs))[1])
        entry["out_spec"] = pytree.treespec_dumps(pytree.tree_flatten((call.output,))[1])
        variants.append(entry)
    programs: dict[str, torch.export.ExportedProgram] = {}
    region_entries = []
    for region in found:
        block = instances[region.instances[0]].eval()
        entries = []
        for plan in plans:
            call = ctx.examples[plan.points[0]][region.name]
            leaf_dims, call_batch = ctx.dims[region.name][plan.name]
            entry = {**variant_entry(plan, call, leaf_dims, call_batch, None), "model": f"{region.name}__{plan.name}"}
            programs[entry["model"]] = export_checked(ctx, block, region.name, plan, call, leaf_dims, call_batch, entry,
                                                      {p: ctx.reference[p][region.name] for p in plan.points})
            entries.append(entry)
        region_entries.append({"name": region.name, "class": region.block_class, "instances": list(region.instances),
                               "variants": entries})
    compiled, _, compile_s = compile_all(ctx, programs, spec.name)  # no freezing: prepack is refused for regional
    with ctx.stages("package", f"{spec.name}.pt2 + {spec.name}.safetensors"):
        constants, layouts = write_package(ctx.out, spec.name, compiled, programs, torch.device(ctx.target.device),
                                           regional=(module, found, instances, region_entries))
    in_blocks = sum(t.numel() for fqn in instances for t in instances[fqn].parameters())
    total = sum(t.numel() for t in module.parameters())
    record = component_record(spec, module, dtype, compiled, compile_s, constants, layouts, variants)
    record.update(mode="regional", regions=region_entries, eager={
        "parameters": total - in_blocks, "share": round((total - in_blocks) / max(total, 1), 4),
        "reason": "the code between blocks (embeddings, norms, convolutions, the final projection) runs as "
                  "eager torch on the artifact's weights: diffusers' own forward, calling the compiled blocks"})
    return record
