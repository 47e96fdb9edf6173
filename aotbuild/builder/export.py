"""torch.export + AOTInductor for one component: one compiled model per shape variant, all in one
weight-less .pt2 package, plus the exact constants that package binds at load.

Just over 500 lines: the export, the compile options and the prepacking they depend on change
together (a packing inductor does not make is made here because of an option set here)."""

from __future__ import annotations

import contextlib
import math
import operator
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import AotbuildError, BuildError
from ..spec import shapes
from ..spec.private_apis import (
    aot_compile,
    cuda_compiler,
    declare_equal_sizes,
    inductor_config,
    onednn_convolutions,
    onednn_linears,
    package_aoti,
    python_printer,
    recording_folds,
    rewriting_before_folds,
    shape_env,
    size_hints,
)
from .attention import replace_attention

# Options every compile gets, on top of the target's [inductor] table:
# - the package holds code only; weights go to safetensors and are bound at load;
# - every weight stays a named constant (default packaging inlines tiny ones as literals, which
#   binding other weights would then silently miss);
# - no compile-time constant folding, which would bake values computed from the build's weights.
WEIGHTLESS_OPTIONS: dict[str, Any] = {
    "aot_inductor.package": True,
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,
    "joint_graph_constant_folding": False,
}


# `[inductor] profile = NAME` expands to these; explicit keys in the target override them.
PROFILES: dict[str, dict[str, Any]] = {
    "default": {},
    # diffusion-fast's flags: autotuned GEMM/conv choices, 1x1 convs as matmuls, no epilogue fusion.
    "max-autotune": {
        "max_autotune": True,
        "coordinate_descent_tuning": True,
        "coordinate_descent_check_all_directions": True,
        "conv_1x1_as_mm": True,
        "epilogue_fusion": False,
    },
}


# Set from the target's `gpu.multi_arch`, so the manifest's environment and the variant name say it.
MULTI_ARCH_OPTION = "aot_inductor.emit_multi_arch_kernel"
# Inductor compiles host C++ with -march=native by default, CUDA builds' too: a CUDA variant
# built on one x86 host would die with SIGILL on another host with the same GPU. Their host code
# only launches kernels, so it targets the compiler's portable default ("" drops the flag). CPU
# builds keep -march=native for their kernels' speed; the runtime checks the CPU's flags instead.
MARCH_OPTION = "cpp.march"
PORTABLE_MARCH = ""


@dataclass(frozen=True)
class CpuBaseline:
    """A CPU target's `cpu.baseline`: the instruction sets its compiled code may use, for a fleet of
    mixed CPUs (default: the build machine's, -march=native and inductor's widest vectors)."""

    options: dict[str, Any]  # the inductor options that hold the code to it
    isa: str  # what the manifest records as `cpu_isa` (torch's capability names)
    flags: tuple[str, ...]  # and as `cpu_flags`, named as /proc/cpuinfo names them (ISA_FLAG_PREFIXES)


# x86-64-v3: every x86 server CPU since Haswell (2013) and Zen (2017): AVX2, FMA, F16C, BMI, with
# inductor's 256-bit vectors. AVX-512 code takes the build machine's extensions (bf16, VNNI, AMX) as
# inductor finds them, so it is not offered as a baseline: build it on the oldest AVX-512 CPU served.
CPU_BASELINES = {
    "x86-64-v3": CpuBaseline(options={MARCH_OPTION: "x86-64-v3", "cpp.simdlen": 256}, isa="AVX2", flags=(
        "abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "popcnt", "sse", "sse2", "sse4_1", "sse4_2",
        "ssse3")),
}


# Set by `optimize.prepack`: AOTInductor folds the weights' layout changes and oneDNN packing into
# constants, which the manifest records how to make (`compile_variant`).
FREEZING_OPTION = "freezing"


def supports_multi_arch() -> bool:
    """Whether this torch's AOTInductor can emit multi-arch (PTX + SASS) kernels."""
    return MULTI_ARCH_OPTION in inductor_config().get_config_copy()


def nvcc() -> str | None:
    """The CUDA compiler inductor would use (it bundles multi-arch kernels with nvcc where it cannot
    use fatbinary): torch and Triton wheels do not ship it."""
    import shutil

    return shutil.which(cuda_compiler() or "nvcc")


def check_inductor_keys(options: dict[str, Any], error: type[AotbuildError], origin: str = "") -> None:
    """Each [inductor] key is an inductor config option of this torch that aotbuild does not set
    itself; an unknown one is refused naming the closest options (a typo)."""
    import difflib

    known = list(inductor_config().get_config_copy())
    where = f"{origin}: " if origin else ""
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.7)
            raise error(f"{where}[inductor] key {key!r} is not an inductor config option of torch {torch.__version__}",
                        hint=f"did you mean {' or '.join(map(repr, close))}?" if close else
                        "see torch._inductor.config for the options")
        if key in WEIGHTLESS_OPTIONS:
            raise error(f"{where}[inductor] key {key!r} is set by aotbuild to keep packages weight-less")
        if key == MULTI_ARCH_OPTION:
            raise error(f"{where}[inductor] key {key!r} is set by aotbuild",
                        hint="use gpu = { ..., multi_arch = true }")
        if key == FREEZING_OPTION:
            raise error(f"{where}[inductor] key {key!r} is set by aotbuild", hint="use optimize.prepack = true: "
                        "frozen constants are then made from the bound weights at load, so weights stay data")
        if key == MARCH_OPTION:
            raise error(f"{where}[inductor] key {key!r} is set by aotbuild: CPU code is built for this machine's CPU "
                        f"(checked at load), CUDA host code for a portable baseline",
                        hint=f"for a fleet of older CPUs: cpu = {{ baseline = \"{next(iter(CPU_BASELINES))}\" }}")


def cpu_gemm_templates(options: dict[str, Any]) -> bool:
    """Whether these [inductor] options (profile expanded) let inductor's CPU GEMM templates run:
    they pack each weight at compile time into a constant of the compiled code, made by Python
    no graph records, so other weights (`weights=`, a LoRA, `load_state_dict`) could not reach it."""
    config = inductor_config()
    tuned = options.get("max_autotune", config.max_autotune) or options.get("max_autotune_gemm",
                                                                            config.max_autotune_gemm)
    backends = str(options.get("max_autotune_gemm_backends", config.max_autotune_gemm_backends)).upper()
    return bool(tuned) and "CPP" in backends.split(",") and \
        bool(options.get("cpp.weight_prepack", config.cpp.weight_prepack))


def inductor_options(target_options: dict[str, Any], pass_flags: dict[str, Any] | None = None, *,
                     multi_arch: bool = False, device: str = "cpu", cpu_baseline: str | None = None) -> dict[str, Any]:
    """The full per-compile option dict: profile, then the passes' flags, then the target's explicit
    keys, then the options aotbuild owns (weight-less packaging, multi-arch kernels, a portable
    host-code baseline on CUDA, a CPU target's `cpu_baseline`). Unknown inductor keys are refused
    by name."""
    explicit = {k: v for k, v in target_options.items() if k != "profile"}
    check_inductor_keys(explicit, BuildError)
    profile = PROFILES[target_options.get("profile", "default")]
    owned = {**WEIGHTLESS_OPTIONS, **({MULTI_ARCH_OPTION: True} if multi_arch else {}),
             **({MARCH_OPTION: PORTABLE_MARCH} if device == "cuda" else {}),
             **(CPU_BASELINES[cpu_baseline].options if cpu_baseline else {})}
    return {**profile, **(pass_flags or {}), **explicit, **owned}


def custom_ops_called(files: list) -> list[str]:
    """Namespaces of non-aten operators the compiled code calls back into Python for (the proxy
    executor's op list), e.g. ["torchao"]: the runtime must import that library first."""
    import json

    namespaces = set()
    for path in files:
        if isinstance(path, str) and path.endswith(".json") and not path.endswith("_metadata.json"):
            try:
                nodes = json.loads(Path(path).read_text()).get("nodes", [])
            except (ValueError, AttributeError):
                continue
            for node in nodes:
                target = node.get("node", {}).get("target", "")
                if "::" in target or "." in target:
                    namespace = target.replace("::", ".").split(".")[0]
                    if namespace not in ("aten", "prims", "_operator"):
                        namespaces.add(namespace)
    return sorted(namespaces)


def export_variant(module: torch.nn.Module, args: tuple, kwargs: dict, context: Any = None,
                   dynamic_shapes: dict[str, Any] | None = None, strict: bool = False) -> torch.export.ExportedProgram:
    """torch.export of the module at one static shape, or over `dynamic_shapes` (non-strict by
    default: traces through diffusers code in Python). A dim the model forces to one size is an
    error naming it, never a silently static "dynamic" model: explicit Dims make export refuse
    rather than specialize."""
    with context or contextlib.nullcontext():
        try:
            return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
        except Exception as exc:
            kind = "dynamic " if dynamic_shapes else ""
            raise BuildError(f"torch.export ({kind}shapes) failed for {type(module).__name__}: {exc}") from exc


def input_dims(program: torch.export.ExportedProgram) -> list[list[int | str]]:
    """Each tensor input's dims as the exported program takes them, in the call's leaf order: an
    int where export made the dim static, its symbolic size where dynamic ("s0", "s0 + 512":
    the relations between inputs that the compiled code assumes and AOTInductor never checks)."""
    return [[d if isinstance(d, int) else str(d.node.expr) for d in shape] for shape in _input_shapes(program)]


def unify_input_sizes(program: torch.export.ExportedProgram, dims: list[list[Any]]) -> None:
    """Give the input dims that one export `Dim` spans (`shapes.export_dim_key`; `dims`: each
    tensor input's, in the call's leaf order) one symbol in the program's symbolic shapes, as they
    have one size at every call (the runtime checks it). Export gives each its own symbol, and
    inductor then nests floor divisions of them at each attention's reshape: minutes per lowering
    on a real-size denoiser (`private_apis.declare_equal_sizes`)."""
    import sympy

    first: dict[tuple, Any] = {}
    for leaf_dims, shape in zip(dims, _input_shapes(program), strict=True):
        for dim, size in zip(leaf_dims, shape, strict=True):
            key = shapes.export_dim_key(dim)
            if key is None or isinstance(size, int):
                continue
            coefficient, symbol = sympy.sympify(size.node.expr).as_coeff_Mul()
            if not isinstance(symbol, sympy.Symbol):
                continue
            same = first.setdefault((*key, coefficient), symbol)
            if same != symbol:
                declare_equal_sizes(program, symbol, same)


def _input_shapes(program: torch.export.ExportedProgram) -> list[tuple]:
    from torch.export.graph_signature import InputKind, TensorArgument

    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    return [tuple(placeholders[spec.arg.name].meta["val"].shape) for spec in program.graph_signature.input_specs
            if spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, TensorArgument)]


def shape_guards(program: torch.export.ExportedProgram) -> list[str]:
    """What the exported program assumes of its inputs' dynamic sizes beyond their relations: the
    guards export added where the traced code branched on a size (Z-Image pads its caption to a
    multiple of 32 only when it is not one; a size-1 pad would be specialized), as Python
    expressions over the symbols of `input_dims`. AOTInductor checks none of them at run time."""
    env = shape_env(program)
    if env is None:
        return []
    inputs = {symbol for shape in _input_shapes(program) for d in shape if not isinstance(d, int)
              for symbol in d.node.expr.free_symbols}
    printer, guards = python_printer(), []
    for guard in env.guards:
        expr = env.replace(guard.expr)
        if expr.free_symbols and expr.free_symbols <= inputs and expr not in (True, False):
            text = printer.doprint(expr)
            if text not in guards:
                guards.append(text)
    return guards


def compile_variant(program: torch.export.ExportedProgram, options: dict[str, Any], attention: bool = False,
                    ) -> tuple[list, dict[str, Any], tuple[int, int]]:
    """AOTInductor compile of one exported program; returns the files to package, when it
    freezes (`optimize.prepack`) how each constant it folded is made from the weights (by the
    name the model binds it under: `runtime.prepared`'s recipes, not yet checked against it),
    and with `attention` (`optimize.sdpa = "aotbuild"`) how many of its attentions call
    aotbuild's kernel, of how many (`attention.replace_attention`)."""
    args, kwargs = program.example_inputs
    graph = program.module(check_guards=False)
    attentions = replace_attention(graph) if attention else (0, 0)
    # Tensors the forward makes from Python data (Chroma's torch.tensor([0] * batch)) are lifted
    # constants, plain attributes of the unlifted module, which AOTInductor would rename
    # (_tensor_constant0): as buffers they keep the names the weights file stores them under.
    for fqn, value in program.constants.items():
        owner, _, attribute = fqn.rpartition(".")
        module = graph.get_submodule(owner)
        if isinstance(value, torch.Tensor) and attribute not in module._buffers:
            delattr(module, attribute)
            module.register_buffer(attribute, value, persistent=False)
    freezing = bool(options.get("freezing"))
    timed: dict[tuple, float] = {}

    def prepare_weights(gm: torch.fx.GraphModule) -> None:
        pack_dynamic_convolutions(gm)
        choose_linear_packings(gm, timed)

    # Freezing prepacks oneDNN weights only for code that computes no gradients.
    with recording_folds(_fold_step) if freezing else contextlib.nullcontext({}) as folds, \
            rewriting_before_folds(prepare_weights) if freezing else contextlib.nullcontext(), \
            torch.no_grad() if freezing else contextlib.nullcontext():
        try:
            files = aot_compile(graph, args, kwargs, dict(options))
        except Exception as exc:
            raise BuildError(f"AOTInductor compile failed: {exc}") from exc
    return files, {name: _inlined(step, folds) for name, step in folds.items() if step is not None}, attentions


def pack_dynamic_convolutions(gm: torch.fx.GraphModule) -> None:
    """Give each oneDNN convolution of a dynamic-size input the weight packed, as inductor packs
    it at a static size: `mkldnn._reorder_convolution_weight` of the plain weight at the size the
    program was exported at (its largest call), which freezing's next fold makes a constant (and
    the manifest a recipe). Inductor leaves such weights plain, and oneDNN then reorders each of
    them at every call: 21 ms of a 240 ms bf16 UNet call with guided and unguided batches. At
    another size oneDNN may want another blocking, and reorders the packed weight, as before.

    Left plain: a weight already packed or made by the graph, and an input of one channel, whose
    strides inductor reads as contiguous while a packed weight makes the output channels-last."""
    ops, reorder = onednn_convolutions()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ops:
            continue
        at_input, at_weight = ops[node.target]
        inputs, weight = node.args[at_input], node.args[at_weight]
        size = getattr(inputs.meta.get("val"), "shape", None) if isinstance(inputs, torch.fx.Node) else None
        if weight.op != "get_attr" or size is None or all(isinstance(s, int) for s in size) or size[1] == 1:
            continue
        tensor = operator.attrgetter(weight.target)(gm)
        if tensor.is_mkldnn or tensor.dim() not in (4, 5):
            continue
        padding, stride, dilation, groups = node.args[at_weight + 2:at_weight + 6]
        with gm.graph.inserting_before(node):
            packed = gm.graph.call_function(reorder, (weight, padding, stride, dilation, groups, size_hints(size)))
        node.replace_input_with(weight, packed)


# Another packing replaces inductor's only when it measures at most this share of its time: the
# choice is made by timing, and a margin keeps noise from flipping it between builds.
PACKING_MARGIN = 0.9


def choose_linear_packings(gm: torch.fx.GraphModule, timed: dict[tuple, float]) -> None:
    """Give each oneDNN linear weight the faster of two packings on this CPU: the one inductor
    makes, for the rows of the input at the export size, and the one for a single row. oneDNN
    blocks them differently (bf16 on AMX: AB16b32a2b and AB16b64a2b), and which runs faster
    depends on the matmul's sizes, not on the hint: on cpu-sdxl-mid's bf16 UNet, 512 rows x 2560
    by 640 took 1.47 ms packed for 512 rows and 0.86 ms packed for one, while 512 x 640 by 5120
    took 1.23 and 1.35 ms. The rows hint is an argument of the packing, so the recipe records the
    choice and any weights are packed the same way. `timed`: seconds by (rows, columns, outputs,
    dtype, hint), shared by the graph's linears of the same sizes."""
    linears, reorder, _ = onednn_linears()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not reorder or len(node.args) != 2 \
                or node.args[1] in (None, 1):
            continue
        users = [user for user in node.users if user.target in linears and "val" in user.meta
                 and user.args[linears[user.target][1]] is node]
        inputs = users[0].args[linears[users[0].target][0]] if users else None
        if not isinstance(inputs, torch.fx.Node) or "val" not in inputs.meta:
            continue
        *leading, columns = size_hints(inputs.meta["val"].shape)
        sizes = (math.prod(leading), columns, size_hints(users[0].meta["val"].shape)[-1], inputs.meta["val"].dtype)
        rows_hint = node.args[1]
        for hint in (rows_hint, 1):
            if (*sizes, hint) not in timed:
                timed[(*sizes, hint)] = packed_linear_seconds(*sizes, hint)
        if timed[(*sizes, 1)] <= PACKING_MARGIN * timed[(*sizes, rows_hint)]:
            node.args = (node.args[0], 1)


def packed_linear_seconds(rows: int, columns: int, outputs: int, dtype: torch.dtype, hint: int) -> float:
    """The median time of oneDNN's linear of these sizes, its weight packed for `hint` rows, on
    random data (the values do not change the time)."""
    _, reorder, linear = onednn_linears()
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(rows, columns, generator=generator).to(dtype)
    weight = reorder(torch.randn(outputs, columns, generator=generator).to(dtype), hint)
    return _median_seconds(lambda: linear(inputs, weight, None, "none", [], ""))


def _median_seconds(call: Callable[[], Any], repeats: int = 7) -> float:
    call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _fold_step(node: torch.fx.Node) -> dict[str, Any]:
    """The graph node freezing replaces by a constant, as a recipe step (`runtime.prepared`):
    constants it reads are `{"constant": name}` until `_inlined` resolves them."""
    from ..runtime.prepared import OPERATORS, operator_name, resolve

    if node.op == "get_attr":
        return {"constant": node.target}
    op = operator_name(node.target)
    if node.op != "call_function" or op not in OPERATORS or resolve(op) != node.target:
        raise BuildError(f"freezing folded {node.op} {node.target} into a constant: not one of the operators a "
                         f"prepared constant's recipe may call (runtime.prepared.OPERATORS)",
                         hint="build without optimize.prepack, or report the operator: the allow-list lacks it")
    step: dict[str, Any] = {"op": op, "args": [_fold_argument(a) for a in node.args]}
    if node.kwargs:
        step["kwargs"] = {k: _fold_argument(v) for k, v in node.kwargs.items()}
    return step


def _fold_argument(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return _fold_step(value)
    if isinstance(value, (list, tuple)):
        return [_fold_argument(item) for item in value]
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise BuildError(f"freezing folded a constant with an argument aotbuild cannot record: {value!r}")


def _inlined(step: Any, folds: dict[str, Any]) -> Any:
    """The step with every constant it reads either inlined (another folded constant's recipe)
    or a weight (`{"weight": fqn}`)."""
    if isinstance(step, list):
        return [_inlined(item, folds) for item in step]
    if not isinstance(step, dict):
        return step
    if "constant" in step:
        name = step["constant"]
        if name not in folds:
            return {"weight": name}
        if folds[name] is None:
            raise BuildError(f"freezing folded a constant from {name}, which no weight makes")
        return _inlined(folds[name], folds)
    return {key: _inlined(value, folds) for key, value in step.items()}


def package(path: Path, compiled: dict[str, list]) -> None:
    """Write one .pt2 holding every variant as a named model."""
    package_aoti(path, compiled)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.detach().to(a.device))


def name_constants_apart(programs: dict[str, torch.export.ExportedProgram]) -> None:
    """Give each variant's lifted constant a name of its own where an earlier variant's program
    holds another tensor under that name. Each export names the tensors its forward makes from
    Python data from 0 (`lifted_tensor_0`, ...): guided Z-Image's bucket lifts its RoPE tables under
    those names and its dynamic model boolean scalars, and one weights file would bind one
    program's tensor into the other's code. Renamed in place, before compiling."""
    from torch.export.graph_signature import InputKind

    seen: dict[str, torch.Tensor] = {}
    for variant, program in programs.items():
        for spec in program.graph_signature.input_specs:
            if spec.kind != InputKind.CONSTANT_TENSOR or not isinstance(value := program.constants[spec.target],
                                                                         torch.Tensor):
                continue
            kept = seen.setdefault(spec.target, value)
            if kept is value or _same_tensor(kept, value):
                continue
            name = f"{variant}__{spec.target}"  # variant names are unique: no later program takes it
            program.constants[name] = program.constants.pop(spec.target)
            spec.target = name


def constants_of(programs: list[torch.export.ExportedProgram], bound: set[str]) -> dict[str, torch.Tensor]:
    """The constants the compiled models bind (`bound`: the union of their constant FQNs), by FQN,
    from the programs' parameters, buffers and lifted constants. A program also holds what no
    compiled code reads (fuse_qkv keeps the q/k/v projections beside the fused one): not stored."""
    constants: dict[str, torch.Tensor] = {}
    for program in programs:
        for fqn, value in {**program.state_dict, **program.constants}.items():
            if fqn not in bound or not isinstance(value, torch.Tensor):
                continue
            kept = constants.get(fqn)
            if kept is None:
                constants[fqn] = value.detach()
            elif fqn in program.constants and not _same_tensor(kept, value):
                # Each export names the tensors its forward makes (lifted_tensor_0, ...) from 0: one
                # weights file under one name would bind one program's tensor into the other's code.
                raise BuildError(f"constant {fqn} is one tensor in one variant's program and another in the next "
                                 f"({kept.dtype} {list(kept.shape)} vs {value.dtype} {list(value.shape)}): one "
                                 f"weights file cannot bind both", hint="build those shapes as targets of their own")
    missing = sorted(bound - set(constants))
    if missing:
        raise BuildError(f"the compiled code binds constants the exported programs lack: {', '.join(missing[:5])}")
    return constants


def unread_weights(programs: list[torch.export.ExportedProgram], constants: dict[str, torch.Tensor]) -> list[str]:
    """The module's parameters and buffers no compiled code binds: dead in every program (Qwen-Image's
    last block computes a text stream nothing reads), or replaced by an optimization (fuse_qkv's
    q/k/v projections, bound through the fused weight). A LoRA on a dead one changes nothing."""
    return sorted({fqn for program in programs for fqn in program.state_dict} - set(constants))


def storage_order(constants: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Each constant as safetensors can store it (contiguous, owning its storage) without losing
    the strides the code was compiled for: a constant laid out otherwise (NHWC convolution weights
    under channels_last) is stored in its memory order, and its shape and strides are returned to
    be recorded, so the runtime views it back (`runtime.load_weights`). Returns (stored, layouts)."""
    stored, layouts = {}, {}
    seen: set[int] = set()
    for fqn, tensor in constants.items():
        if not tensor.is_contiguous():
            if not dense(tensor):
                raise BuildError(f"constant {fqn} has a layout no stored copy can have (shape {list(tensor.shape)}, "
                                 f"strides {list(tensor.stride())}: not dense)")
            layouts[fqn] = {"shape": list(tensor.shape), "stride": list(tensor.stride())}
            order = sorted(range(tensor.ndim), key=lambda d: -tensor.stride(d))
            tensor = tensor.permute(order)  # its memory order: contiguous, the same storage
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen or not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.contiguous().clone()  # safetensors refuses shared or partial storage
        seen.add(pointer)
        stored[fqn] = tensor
    return stored, layouts


def dense(tensor: torch.Tensor) -> bool:
    """Every element at its own offset, none skipped: a permutation of a contiguous layout."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(tensor.stride(), tensor.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
