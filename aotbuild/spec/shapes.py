"""Dynamic shapes: how each input dim of a component follows the pipeline's (batch, height, width,
and a video's frames), inferred from real captures rather than written per model, turned into torch.export Dims, and
checked again by the runtime (AOTInductor checks no input shape itself).

A dim is one of:
  int                                   static
  {"axis": "batch", "factor": k}        k x the batch (classified in images: k = 2 under classifier-
                                        free guidance; compiled in the call's own batch, k = 1)
  {"axis": "height"|"width", "pixels": f, "multiple": m}
                                        pixels / f, a multiple of m (m = stride / f)
  {"axis": "frames", "per": s}          a video's latent frames: (frames - 1) / s + 1 (s: the VAE's
                                        temporal compression)
  {"axis": "tokens", "min": a, "max": b}
                                        a sequence over height x width (x frames) (Flux's packed latents), or
                                        over the text and the image (Chroma's attention mask)
  {"axis": "max_sequence_length", "min": a, "max": b}
                                        a sequence over the text length (the prompt's tokens)

A dynamic dim also records its size in the exported program ("expr": "s0", "s0 + 512"): the
relations between inputs that the compiled code assumes (Chroma's attention mask spans the text
and the image tokens), checked at every call by `relations_hold`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from typing import Any

import torch

from ..errors import BuildError
from .pipelines import TEXT
from .private_apis import pytree

AXES = ("batch", "height", "width")
FRAME_AXIS = "frames"  # a video's frame count: an axis where a range gives one, after width
SEQUENCES = ("tokens", TEXT)  # dims that are a sequence's length, not a multiple of an axis


def axes_of(ranges: dict[str, Any]) -> tuple[str, ...]:
    """The axes a range spans: batch, height, width and, where it has them, a video's frames and
    the text length."""
    return AXES + tuple(axis for axis in (FRAME_AXIS, TEXT) if axis in ranges)


def probe_points(ranges: dict[str, list[int]], stride: int, frame_stride: int = 1) -> dict[str, tuple[int, ...]]:
    """Points to capture, as sizes along `axes_of(ranges)`: a base point away from the size that
    makes an export dim of 1 and from the range edges where possible (export specializes a dim of
    size 1), and one point per axis moving that axis. Frames step by `frame_stride` (a video
    makes 1 + a multiple of it); 1 frame is one latent frame."""

    def two_values(low: int, high: int, step: int, one: int) -> tuple[int, int]:
        values = list(range(low, high + 1, step))
        inner = [v for v in values if v != one] or values  # `one` is an export Dim of 1
        base = inner[(len(inner) - 1) // 2]
        others = [v for v in values if v != base]
        other = next((v for v in others if v != 1), others[0] if others else base)
        return base, other

    steps = {"height": (stride, stride), "width": (stride, stride), FRAME_AXIS: (frame_stride, 1)}
    axes = axes_of(ranges)
    pairs = [two_values(*ranges[a], *steps.get(a, (1, 1))) for a in axes]
    base = tuple(pair[0] for pair in pairs)
    return {"base": base, **{a: base[:i] + (pairs[i][1],) + base[i + 1:] for i, a in enumerate(axes)}}


def range_points(ranges: dict[str, list[int]], stride: int, frame_stride: int = 1) -> dict[str, tuple[int, ...]]:
    """The range's "min" and "max" corners and its `probe_points`, as sizes along `axes_of(ranges)`."""
    corners = {corner: tuple(ranges[a][i] for a in axes_of(ranges)) for i, corner in enumerate(("min", "max"))}
    return {**corners, **probe_points(ranges, stride, frame_stride)}


def classify(probes: dict[str, list[list[int]]], corners: dict[str, list[list[int]]],
             points: dict[str, tuple[int, ...]], stride: int) -> list[list[Any]]:
    """Per tensor leaf, per dim: how it follows the batch, height, width (and frames, text length).

    Args:
        probes: leaf shapes captured at each of `points` ("base" and one per axis).
        corners: leaf shapes at the range's "min" and "max" corners (for sequence ranges).
        points: the sizes of each probe along the axes (`axes_of`).
        stride: the pipeline's pixel stride.
    """
    axes = [axis for axis in (*AXES, FRAME_AXIS, TEXT) if axis in probes]
    result = []
    for leaf, base_shape in enumerate(probes["base"]):
        dims: list[Any] = []
        for d, value in enumerate(base_shape):
            moved = [axis for axis in axes if probes[axis][leaf][d] != value]
            sequence = {"min": corners["min"][leaf][d], "max": corners["max"][leaf][d]}
            if not moved:
                dims.append(value)
            elif moved == ["batch"]:
                dims.append(_proportional(value, probes["batch"][leaf][d], points, 0, "batch", stride))
            elif moved in (["height"], ["width"]):
                index = AXES.index(moved[0])
                try:
                    dims.append(_proportional(value, probes[moved[0]][leaf][d], points, index, moved[0], stride))
                except BuildError:  # e.g. Flux tokens when the other axis is fixed: a sequence, not a size
                    dims.append({"axis": "tokens", **sequence})
            elif moved == [FRAME_AXIS]:
                dims.append(_latent_frames(value, probes[FRAME_AXIS][leaf][d], points, axes.index(FRAME_AXIS)))
            elif moved == [TEXT]:
                dims.append({"axis": TEXT, **sequence})
            elif "batch" not in moved:  # image tokens, or text and image tokens in one sequence
                dims.append({"axis": "tokens", **sequence})
            else:
                raise BuildError(f"input {leaf} dim {d} changes with {' and '.join(moved)}: no dynamic form for that")
        result.append(dims)
    return result


def with_text_offsets(dims: list[list[Any]], shapes: dict[str, list[list[int]]],
                      texts: dict[str, int]) -> list[list[Any]]:
    """`dims` with {"offset": c} on each text dim that is the text length plus c tokens at every
    point captured (`shapes` and `texts`: each point's leaf shapes and text length), so that the
    runtime names a call's text length, not its sequence's: Qwen-Image-Edit's prompt tokens follow
    the edited image's and its chat template's. A dim that is the text length has none."""
    result = []
    for leaf, leaf_dims in enumerate(dims):
        marked = []
        for d, dim in enumerate(leaf_dims):
            if isinstance(dim, dict) and dim["axis"] == TEXT:
                offsets = {shapes[p][leaf][d] - text for p, text in texts.items()}
                if len(offsets) == 1 and (offset := offsets.pop()):
                    dim = {**dim, "offset": offset}
            marked.append(dim)
        result.append(marked)
    return result


def _proportional(value: int, moved_value: int, points: dict, index: int, axis: str, stride: int) -> dict:
    base, moved = points["base"][index], points[axis][index]
    if axis == "batch":
        factor, remainder = divmod(value, base)
        if remainder or factor * moved != moved_value:
            raise BuildError(f"a dim following batch is {value} at batch {base} and {moved_value} at {moved}")
        return {"axis": "batch", "factor": factor}
    pixels, remainder = divmod(base, value)
    if remainder or moved // pixels != moved_value or stride % pixels:
        raise BuildError(f"a dim following {axis} is {value} at {base} px and {moved_value} at {moved} px")
    return {"axis": axis, "pixels": pixels, "multiple": stride // pixels}


def _latent_frames(value: int, moved_value: int, points: dict, index: int) -> dict:
    """A dim following a video's frames: its latent frames, (frames - 1) / per + 1."""
    base, moved = points["base"][index], points[FRAME_AXIS][index]
    per, remainder = divmod(base - moved, value - moved_value) if value != moved_value else (0, 1)
    if remainder or per <= 0 or (base - 1) % per or (base - 1) // per + 1 != value:
        raise BuildError(f"a dim following frames is {value} at {base} frames and {moved_value} at {moved} frames: "
                         f"not the latent frames")
    return {"axis": FRAME_AXIS, "per": per}


def in_call_batches(dims: list[list[Any]]) -> list[list[Any]]:
    """Batch dims counted in the call's own batch (its first tensor's first dim) instead of images:
    a denoiser's 2 x images under guidance becomes 1 x its batch, so one model serves the guided
    and the unguided batches."""
    first = dims[0][0] if dims and dims[0] else None
    if not isinstance(first, dict) or first["axis"] != "batch":
        return dims
    unit = first["factor"]
    result = []
    for leaf in dims:
        converted = []
        for dim in leaf:
            if isinstance(dim, dict) and dim["axis"] == "batch":
                if dim["factor"] % unit:
                    raise BuildError(f"an input dim is {dim['factor']} x images while the call's batch is {unit} x "
                                     f"images: no whole factor of the call's batch")
                dim = {"axis": "batch", "factor": dim["factor"] // unit}
            converted.append(dim)
        result.append(converted)
    return result


def export_dim_key(dim: Any) -> tuple | None:
    """Which export `Dim` `export_dynamic_shapes` gives this leaf dim: dims with the same key get
    the same expression of the same Dim. None for a static dim, and for a sequence (`Dim.AUTO`
    there: export relates them itself)."""
    if not isinstance(dim, dict) or dim["axis"] in SEQUENCES:
        return None
    if dim["axis"] == "batch":
        return ("batch", dim["factor"])
    if dim["axis"] == FRAME_AXIS:
        return (FRAME_AXIS,)
    return (dim["axis"], dim["multiple"])


def export_dynamic_shapes(module: torch.nn.Module, args: tuple, kwargs: dict, dims: list[list[Any]],
                          ranges: dict[str, list[int]], stride: int, tokens: Any = None) -> dict[str, Any]:
    """The `dynamic_shapes` argument of torch.export for this call, keyed by parameter name.
    Token dims over the same range are one Dim; `tokens` (e.g. `Dim.AUTO`) replaces them where
    the code relates sequences of different ranges (a block's rotary embedding spans text + image)."""
    from torch.export import Dim

    roots: dict[str, Any] = {}  # made when a dim uses them: a bucket's model has a batch dim only
    sequences: dict[tuple[int, int], Any] = {}  # token dims over the same range are one sequence (Flux ids)

    def root(axis: str, per: int = 1) -> Any:
        if axis not in roots:
            low, high = ranges[axis]
            if axis == FRAME_AXIS:  # in latent frames
                roots[axis] = Dim(axis, min=(low - 1) // per + 1, max=(high - 1) // per + 1)
            else:
                unit = 1 if axis == "batch" else stride
                roots[axis] = Dim(axis, min=low // unit, max=high // unit)
        return roots[axis]

    def dim_expr(dim: Any) -> Any:
        if dim["axis"] == "batch":
            return root("batch") * dim["factor"] if dim["factor"] != 1 else root("batch")
        if dim["axis"] in SEQUENCES:
            if tokens is not None:
                return tokens
            key = (dim["min"], dim["max"])
            return sequences.setdefault(key, Dim(f"tokens{len(sequences)}", min=dim["min"], max=dim["max"]))
        if dim["axis"] == FRAME_AXIS:
            return root(FRAME_AXIS, dim["per"])
        return root(dim["axis"]) * dim["multiple"] if dim["multiple"] != 1 else root(dim["axis"])

    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    tensor_dims = iter(dims)
    per_leaf = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf_dims = next(tensor_dims)
            per_leaf.append({i: dim_expr(d) for i, d in enumerate(leaf_dims) if isinstance(d, dict)} or None)
        else:
            per_leaf.append(None)
    shaped_args, shaped_kwargs = pytree.tree_unflatten(per_leaf, spec)
    bound = inspect.signature(module.forward).bind(*shaped_args, **shaped_kwargs)
    return dict(bound.arguments)


def infer_size(dims: list[list[Any]], shapes: list[list[int]], ranges: dict[str, list[int]],
               stride: int) -> dict[str, int] | None:
    """The (batch, height, width[, frames]) these tensor shapes stand for, or None when they are not
    a consistent point inside the ranges (the runtime's check before calling a dynamic model)."""
    found: dict[Any, int] = {}
    for leaf_dims, shape in zip(dims, shapes, strict=True):
        if len(leaf_dims) != len(shape):
            return None
        for dim, value in zip(leaf_dims, shape, strict=True):
            if isinstance(dim, int):
                if value != dim:
                    return None
            elif dim["axis"] in SEQUENCES:
                key = (dim["axis"], dim["min"], dim["max"])
                if not dim["min"] <= value <= dim["max"] or found.setdefault(key, value) != value:
                    return None
            elif dim["axis"] == FRAME_AXIS:
                if found.setdefault(FRAME_AXIS, (value - 1) * dim["per"] + 1) != (value - 1) * dim["per"] + 1:
                    return None
            else:
                unit = dim["factor"] if dim["axis"] == "batch" else dim["multiple"]
                if value % unit:
                    return None
                size = value // dim["factor"] if dim["axis"] == "batch" else value * dim["pixels"]
                if found.setdefault(dim["axis"], size) != size:
                    return None
    sizes = {axis: found[axis] for axis in (*AXES, FRAME_AXIS) if axis in found}
    for axis, size in sizes.items():
        low, high = ranges[axis]
        if not low <= size <= high or (axis in ("height", "width") and size % stride):
            return None
    return sizes


_TERM = re.compile(r"([+-]?)\s*((?:\d+|[A-Za-z_]\w*)(?:\s*\*\s*(?:\d+|[A-Za-z_]\w*))*)\s*")


@functools.cache  # relations_hold runs on every call of a dynamic model: each expression is parsed once
def polynomial(expr: str) -> tuple[tuple[int, tuple[str, ...]], ...] | None:
    """A symbolic size ("s0 + 512", "2*s1", "s0*s1 - 1") as (coefficient, symbols) terms; None
    when it is not a sum of products of integers and symbols (a floor division, say)."""
    terms, position, text = [], 0, expr.strip()
    while position < len(text):
        match = _TERM.match(text, position)
        if match is None or (position and not match.group(1)):
            return None
        coefficient, symbols = -1 if match.group(1) == "-" else 1, []
        for factor in re.split(r"\s*\*\s*", match.group(2)):
            if factor.isdigit():
                coefficient *= int(factor)
            else:
                symbols.append(factor)
        terms.append((coefficient, tuple(sorted(symbols))))
        position = match.end()
    return tuple(terms) or None


def relations_hold(dims: list[list[Any]], shapes: list[list[int]], guards: tuple[str, ...] | list[str] = ()) -> bool:
    """Whether a call's tensor shapes meet what the exported program assumes of its dynamic dims:
    the relations between them (each dim's "expr") and the `guards` export took on their values
    (the branches diffusers' code took for the example's sizes: Z-Image pads its caption only when
    its length is not a multiple of 32). Each symbol is solved from a dim of one symbol (`k*s + c`),
    and every dim must then equal its expression. A symbol no such dim gives cannot be checked:
    False, as the build refuses such a program. Dims without an expression (artifacts built
    before relations were recorded) are not checked."""
    bound = solve(dims, shapes)
    return bound is not None and failed_guard(guards, bound) is None


def solve(dims: list[list[Any]], shapes: list[list[int]]) -> dict[str, int] | None:
    """The value of each symbol of the dims' expressions in this call, or None when the shapes
    break a relation (see `relations_hold`)."""
    sized = [(polynomial(dim["expr"]), size) for leaf_dims, shape in zip(dims, shapes, strict=True)
             for dim, size in zip(leaf_dims, shape, strict=True) if isinstance(dim, dict) and "expr" in dim]
    bound: dict[str, int] = {}
    for terms, size in sized:
        variable = [(k, symbols) for k, symbols in terms or () if symbols]
        if len(variable) == 1 and len(variable[0][1]) == 1:
            (k, (symbol,)), constant = variable[0], sum(k for k, symbols in terms if not symbols)
            value, remainder = divmod(size - constant, k)
            if remainder or bound.setdefault(symbol, value) != value:
                return None
    for terms, size in sized:
        if terms is None or any(symbol not in bound for _, symbols in terms for symbol in symbols):
            return None
        total = 0
        for coefficient, symbols in terms:
            for symbol in symbols:
                coefficient *= bound[symbol]
            total += coefficient
        if total != size:
            return None
    return bound


def failed_guard(guards: tuple[str, ...] | list[str], bound: dict[str, int]) -> str | None:
    """The first guard these symbol values break (None: all hold, or one names a symbol not bound,
    which the build refuses)."""
    for guard in guards:
        try:
            if not _guard_function(guard)(bound):
                return guard
        except (KeyError, ZeroDivisionError):
            return guard
    return None


# What a guard may contain: integer arithmetic on symbols, comparisons, and/or/not, max/min.
_GUARD_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.BinOp, ast.Add,
                ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt,
                ast.GtE, ast.Name, ast.Load, ast.Constant, ast.Call)


def uncheckable_guard(guards: tuple[str, ...] | list[str]) -> str | None:
    """The first guard that is not integer arithmetic on symbols (None: every one can be checked):
    a build refuses to record one, a load refuses an artifact recording one."""
    for guard in guards:
        try:
            _guard_function(guard if isinstance(guard, str) else repr(guard))
        except ValueError:
            return guard
    return None


@functools.cache  # each guard is checked on every call of its model: compiled once
def _guard_function(guard: str) -> Any:
    """A guard ("((-1)*s0) % 32 >= 2", as torch's Python printer writes it) as a function of the
    symbols' values; anything but integer arithmetic is a ValueError (the manifest is data, never
    code to run)."""
    try:
        tree = ast.parse(guard, mode="eval")
    except (SyntaxError, ValueError):
        raise ValueError(f"a shape guard aotbuild cannot check: {guard!r}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _GUARD_NODES) or (isinstance(node, ast.Constant) and type(node.value) is not int) \
                or (isinstance(node, ast.Call) and (not isinstance(node.func, ast.Name) or node.keywords
                                                    or node.func.id not in ("max", "min"))):
            raise ValueError(f"a shape guard aotbuild cannot check: {guard!r}")
    code = compile(tree, "<guard>", "eval")
    names = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - {"max", "min"})
    return lambda bound: eval(code, {"__builtins__": {}, "max": max, "min": min}, {n: bound[n] for n in names})
