"""diffusers' LoRA API on a compiled denoiser, as updates of its bound weights.

The LoRA state lives where diffusers and peft keep it: peft layers injected into a copy of the
original model class built on the meta device (no weights, no memory), so every diffusers call
(`load_lora_weights`, `set_adapters`, `fuse_lora`, `unfuse_lora`, `disable_lora`,
`delete_adapters`, `unload_lora_weights`, the per-call `scale`) changes that state exactly as it
would on the eager model. Only the LoRA matrices are real tensors.

Before each call the compiled component reads that state; when it changed, the constants the
adapters touch are merged again from the base weights (W = W0 + sum of each adapter's delta,
never by subtracting), into one merge buffer per touched constant, and bound. Fused QKV rows,
the recorded dtype and strides, and int8 weights (dequantize the touched rows, merge, quantize
them again with the recorded scheme) are handled. peft is imported only here, when a LoRA is used.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AotbuildError
from ..spec.private_apis import accept_compiled_class
from ..spec.recipes import runtime_scheme
from .checkpoint import QUANTIZED, child, module_tensors, placement
from .guards import model_mixin_refusals

# The keyword arguments through which a pipeline passes the per-call LoRA scale to its denoiser.
SCALE_KWARGS = ("cross_attention_kwargs", "joint_attention_kwargs", "attention_kwargs")
_generations = itertools.count(1)


@dataclass(frozen=True)
class Placement:
    """Where a LoRA layer's delta goes: rows of one constant (a fused projection holds several
    layers), or of an int8 constant's data and scale."""

    fqn: str  # the float weight, or the int8 data (`...original0`) whose scale is `...original1`
    rows: slice


def pop_scale(kwargs: dict[str, Any], traced: set[str]) -> float:
    """Take the per-call LoRA scale out of a denoiser call (the compiled code was traced without
    it). An attention-kwargs dict left empty becomes what the pipeline passes without a scale:
    None where the traced call had that argument as a leaf (`traced`), else {} (Flux's)."""
    scale = 1.0
    for key in SCALE_KWARGS:
        extra = kwargs.get(key)
        if isinstance(extra, dict) and "scale" in extra:
            scale = float(extra["scale"])
            rest = {k: v for k, v in extra.items() if k != "scale"}
            kwargs[key] = rest if rest or key not in traced else None
    return scale


def meta_model(config: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """The diffusers model class a config names, built on the meta device: its module tree and
    shapes, no weights, no memory."""
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, config["_class_name"]).from_config(dict(config))
    return torch.nn.Module.to(model, dtype).eval()  # ModelMixin.to warns about fp32 modules: none here


class LoraState:
    """The LoRA adapters of one compiled component and the merged weights bound for them."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype, device: torch.device,
                 base: dict[str, torch.Tensor], rebind: Any, recipe: str | None = None,
                 unread: frozenset[str] = frozenset()) -> None:
        self.shell = meta_model(config, dtype)
        self._dtype, self._device, self._base, self._rebind = dtype, device, base, rebind
        self._unread = unread  # the build's `unread`: a LoRA on a dead weight changes nothing, as in eager
        self._recipe, self._scheme = recipe, runtime_scheme(recipe)  # None: no quantized weight can be merged
        self._generation: dict[str, int] = {}  # adapter -> which load made it (a name can be reused)
        self._layers: list[tuple[str, Any]] = []
        self._other_tuners: list[Any] = []
        self._placements: dict[str, tuple[Placement, ...]] = {}
        self._shapes: dict[str, torch.Tensor] | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # merge buffer per constant, kept once allocated
        self._merged: set[str] = set()  # constants bound to their merge buffer now
        self._bound_state: tuple = ()

    # -- loading -------------------------------------------------------------------------------

    def load(self, source: Any, **kwargs: Any) -> None:
        """diffusers' `load_lora_adapter` on the shell, keeping the LoRA matrices real: peft puts
        new adapters on the device of the layer they wrap, here meta, so the tensors diffusers
        hands to `load_state_dict` are caught and put back. A LoRA the compiled code cannot apply
        exactly is removed again and refused. `hotswap=True` (diffusers' fast switch) copies the new
        matrices into an existing adapter's, which stay real."""
        if kwargs.get("hotswap"):  # new matrices copied into an adapter's own: no new layers
            self.shell.load_lora_adapter(source, **kwargs)
            self._generation[kwargs["adapter_name"]] = next(_generations)  # same name, new values
            return
        # Assigned, not copied into the shell's meta tensors (a copy into meta warns, and is lost).
        kwargs.setdefault("low_cpu_mem_usage", True)
        caught: dict[str, torch.Tensor] = {}
        load_state_dict = self.shell.load_state_dict

        def catching(state_dict: dict[str, torch.Tensor], *args: Any, **kw: Any) -> Any:
            caught.update(state_dict)
            return load_state_dict(state_dict, *args, **kw)

        before = set(getattr(self.shell, "peft_config", {}))
        self.shell.load_state_dict = catching
        try:
            self.shell.load_lora_adapter(source, **kwargs)
        finally:
            del self.shell.load_state_dict
        added = [name for name in getattr(self.shell, "peft_config", {}) if name not in before]
        for name, tensor in caught.items():
            module_path, _, leaf = name.rpartition(".")
            module = self.shell.get_submodule(module_path)
            current = getattr(module, leaf)
            if current.device.type == "meta":
                dtype = current.dtype if current.is_floating_point() else tensor.dtype
                setattr(module, leaf, torch.nn.Parameter(tensor.to(self._device, dtype), requires_grad=False))
        for name in added:
            self._generation[name] = next(_generations)
        self.refresh()
        problems = self._unsupported(added)
        if problems:
            self.shell.delete_adapters(added)
            self.refresh()
            raise AotbuildError(f"LoRA {', '.join(added)} cannot be applied to the compiled model: {problems}")

    def _unsupported(self, adapters: list[str]) -> str:
        missing, kinds = [], set()
        if self._other_tuners:
            kinds.add(f"{type(self._other_tuners[0]).__name__} layers are not LoRA (a low-rank update)")
        for path, layer in self._layers:
            mine = [a for a in adapters if a in layer.lora_A]
            if not mine:
                continue
            if any(layer.use_dora.get(a) for a in mine):
                kinds.add("DoRA (a magnitude vector, not a low-rank update)")
            if any(getattr(layer, "lora_bias", {}).get(a) for a in mine):
                kinds.add("LoRA biases")
            if not self.placements(path, layer) and child(path, "weight") not in self._unread:
                missing.append(path)
            elif self._scheme is None and any(QUANTIZED in p.fqn for p in self.placements(path, layer)):
                kinds.add(f"the weights it touches are quantized with {self._recipe!r}, which aotbuild cannot redo "
                          f"at load")
        if missing:
            kinds.add(f"it targets modules the compiled code does not have: {', '.join(missing[:5])}"
                      + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        return "; ".join(sorted(kinds))

    def refresh(self) -> None:
        """Re-list the peft layers (after adapters were added or removed)."""
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer

        tuners = [(name, m) for name, m in self.shell.named_modules() if isinstance(m, BaseTunerLayer)]
        self._layers = [(name, m) for name, m in tuners if isinstance(m, LoraLayer)]
        self._other_tuners = [m for _, m in tuners if not isinstance(m, LoraLayer)]  # LoKr and the like
        self._generation = {a: g for a, g in self._generation.items() if a in getattr(self.shell, "peft_config", {})}

    def placements(self, path: str, layer: Any) -> tuple[Placement, ...]:
        """The constant rows a LoRA layer's delta goes to (empty: the compiled code has none)."""
        if path not in self._placements:
            self._placements[path] = self._find_placements(path)
        return self._placements[path]

    def _find_placements(self, path: str) -> tuple[Placement, ...]:
        if self._shapes is None:  # the model's own tensors (peft's base layers seen through), for shapes
            self._shapes = module_tensors(self.shell)
        fqn, rows = placement(child(path, "weight"), self._shapes, self._base)
        return (Placement(fqn, rows),) if fqn is not None else ()

    # -- merging -------------------------------------------------------------------------------

    @staticmethod
    def _adapters(layer: Any, call_scale: float) -> list[tuple[str, float]]:
        """The adapters a peft layer applies now, as its forward would, with the factor on top of
        their scaling: none when disabled; only the merged ones when some are merged (fused);
        else the active ones, times the call's scale."""
        if layer.disable_adapters:
            return []
        if layer.merged_adapters:
            return [(a, 1.0) for a in layer.merged_adapters]
        return [(a, call_scale) for a in layer.active_adapters if a in layer.lora_A]

    def _state(self, call_scale: float) -> tuple:
        return tuple((path, tuple((a, self._generation.get(a), float(layer.scaling[a]), factor)
                                  for a, factor in self._adapters(layer, call_scale)))
                     for path, layer in self._layers)

    @property
    def active(self) -> bool:
        return any(self._adapters(layer, 1.0) for _, layer in self._layers)

    @property
    def loaded(self) -> bool:
        """Whether any adapter is loaded (active or not)."""
        return bool(getattr(self.shell, "peft_config", {}))

    def rebase(self, rebound: set[str] = frozenset()) -> None:
        """The base weights changed (written in place, or `rebound` constants now bound to new
        base tensors): the merges are made again from them before the next call."""
        self._merged -= rebound
        self._bound_state = None

    def sync(self, call_scale: float) -> None:
        """Bind the weights the LoRA state asks for, if it changed since the last call (the caller
        holds the component's lock: no call runs meanwhile)."""
        for _, layer in self._layers:
            if layer.disable_adapters and layer.merged:  # what peft's own forward does
                layer.unmerge()
        state = self._state(call_scale)
        if state == self._bound_state:
            return
        updates: dict[str, dict[tuple[int, int], list[Update]]] = {}  # constant -> rows -> in order
        for path, layer in self._layers:
            for adapter, factor in self._adapters(layer, call_scale):
                for place in self.placements(path, layer):
                    rows = (place.rows.start, place.rows.stop or self._base[place.fqn].shape[0])
                    updates.setdefault(place.fqn, {}).setdefault(rows, []).append(Update(layer, adapter, factor))
        bind: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for fqn, by_rows in updates.items():
                bind.update(self._merge(fqn, by_rows))
        merged = set(bind)
        for fqn in self._merged - merged:  # no adapter touches it any more: the base again
            bind[fqn] = self._base[fqn]
        # Buffers bound before were written in place: only new pointers are bound (a captured CUDA
        # graph is captured again only then).
        self._rebind({fqn: tensor for fqn, tensor in bind.items() if fqn not in self._merged or fqn not in merged})
        if not self.loaded:  # no adapter left to switch back to: their merge buffers go
            for fqn in self._merged - merged:
                self._buffers.pop(fqn, None)
                if fqn.endswith(f"{QUANTIZED}0"):
                    self._buffers.pop(fqn[:-1] + "1", None)
        self._merged = merged
        self._bound_state = state

    def _buffer(self, fqn: str) -> torch.Tensor:
        if fqn not in self._buffers:
            base = self._base[fqn]
            # Not an inference tensor, even when made in a call under torch.inference_mode(): its
            # version counter tells a prepacked artifact that a merge rewrote it (runtime.prepared).
            with torch.inference_mode(False):
                self._buffers[fqn] = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype,
                                                         device=base.device)
        return self._buffers[fqn]

    def _merge(self, fqn: str, by_rows: dict[tuple[int, int], list[Update]]) -> dict[str, torch.Tensor]:
        """Base + each update in turn, into the constant's merge buffer, in one pass over the base
        (rows no adapter touches are copied). An int8 constant's touched rows are dequantized,
        merged and quantized again; its other rows stay the base's bit for bit."""
        base, buffer = self._base[fqn], self._buffer(fqn)
        quantized = fqn.endswith(f"{QUANTIZED}0")
        scale_fqn = fqn[:-1] + "1"
        for rows in _untouched(base.shape[0], list(by_rows)):
            buffer[rows].copy_(base[rows])
            if quantized:
                self._buffer(scale_fqn)[rows].copy_(self._base[scale_fqn][rows])
        for (start, stop), in_order in by_rows.items():
            rows = slice(start, stop)
            if quantized:
                weight = self._scheme.dequantize(base[rows], self._base[scale_fqn][rows], self._dtype)
                for update in in_order:
                    update.add(weight, weight)
                buffer[rows], self._buffer(scale_fqn)[rows] = self._scheme.quantize(weight)
            else:
                source = base[rows]
                for update in in_order:
                    update.add(source, buffer[rows])
                    source = buffer[rows]
        return {fqn: buffer, scale_fqn: self._buffers[scale_fqn]} if quantized else {fqn: buffer}


@dataclass(frozen=True)
class Update:
    """One adapter's delta on one peft layer, times a factor (the call's scale)."""

    layer: Any
    adapter: str
    factor: float

    def add(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """out = source + delta (`out` may be `source`). A linear LoRA's delta is never made: one
        GEMM adds B @ A into the output while reading the source once."""
        down, up = self.layer.lora_A[self.adapter], self.layer.lora_B[self.adapter]
        scale = self.layer.scaling[self.adapter] * self.factor
        if isinstance(down, torch.nn.Linear) and not getattr(self.layer, "fan_in_fan_out", False) and out.ndim == 2:
            torch.addmm(source, up.weight.to(out), down.weight.to(out), alpha=scale, out=out)
        else:  # convolutions and the rest: peft's own delta
            delta = self.layer.get_delta_weight(self.adapter) * self.factor
            torch.add(source, delta.to(out).reshape(out.shape), out=out)


def _untouched(size: int, ranges: list[tuple[int, int]]) -> list[slice]:
    """The row slices of [0, size) outside every (start, stop) range."""
    gaps, position = [], 0
    for start, stop in sorted(ranges):
        if start > position:
            gaps.append(slice(position, start))
        position = max(position, stop)
    return [*gaps, slice(position, size)] if position < size else gaps


# Methods of diffusers' PeftAdapterMixin a pipeline calls on its denoiser, run on the shell.
SHELL_METHODS = ("set_adapters", "set_adapter", "fuse_lora", "unfuse_lora", "unload_lora", "disable_lora",
                 "enable_lora", "delete_adapters", "active_adapters", "disable_adapters", "enable_adapters",
                 "set_lora_device", "enable_lora_hotswap")


@functools.cache
def lora_component_class(base: type) -> type:
    """`base` (CompiledComponent) as a diffusers ModelMixin with the LoRA API: diffusers' pipeline
    methods act only on components that are ModelMixins, and walk their modules for peft layers
    (the shell is registered as a submodule once a LoRA is loaded)."""
    from diffusers.models.modeling_utils import ModelMixin

    def on_shell(name: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                state = self._lora_state()
                result = getattr(state.shell, name)(*args, **kwargs)
                state.refresh()
                if not state.loaded:  # the base weights bound again now, the merge buffers freed
                    state.sync(1.0)
            return result

        method.__name__ = name
        method.__doc__ = f"diffusers' `{name}`, on this compiled model's LoRA state (bound before the next call)."
        return method

    def load_lora_adapter(self: Any, pretrained_model_name_or_path_or_dict: Any, prefix: str = "transformer",
                          **kwargs: Any) -> None:
        """diffusers' `load_lora_adapter`: the adapter's matrices are kept, and merged into the
        bound weights before the next call."""
        with self._lock:
            self._lora_state().load(pretrained_model_name_or_path_or_dict, prefix=prefix, **kwargs)

    def update_weights(self: Any) -> None:
        """Bind now what the LoRA state asks for (otherwise done before the next call): the merge
        work leaves the first call after a switch."""
        with self._lock:
            if self._lora is not None:
                self._lora.sync(1.0)

    def peft_config(self: Any) -> dict:
        if self._lora is None:
            raise AttributeError("peft_config")
        return self._lora.shell.peft_config

    # ModelMixin's own methods the compiled model cannot honour refuse (`guards`); the rest
    # (device, dtype, num_parameters, get_memory_footprint, the disable_* ones) hold as they are.
    methods = {name: on_shell(name) for name in SHELL_METHODS} | model_mixin_refusals()
    methods.update(load_lora_adapter=load_lora_adapter, update_weights=update_weights,
                   peft_config=property(peft_config))
    cls = type(base.__name__, (base, ModelMixin), methods)
    accept_compiled_class(cls)
    return cls
