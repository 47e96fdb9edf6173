"""The stand-in module a pipeline holds in place of a compiled component."""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib
import inspect
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ..errors import (
    AotbuildError,
    MissingAttributeError,
    ShapeNotSupportedError,
    UnsupportedCallError,
    WeightsMismatchError,
)
from ..spec.manifest import DTYPES
from ..spec.pipelines import SIZED, TOKENS, pipeline_spec
from ..spec.private_apis import IncompatibleKeys, accept_compiled_class, ip_adapter_loras
from . import step_cache
from .checkpoint import QUANTIZED, module_tensors, placed_writes, placement, quant_scheme
from .guards import StandIn, check_autocast
from .ip_adapter import KEYS, IpAdapterState, embeds_path, loaded_form
from .lora import pop_scale
from .refusals import COVER_HINT, unsupported_call
from .variant import CompiledVariant, LoadContext
from .weights import dtype_name, same_layout


class Config(dict):
    """A model config readable as attributes, like diffusers' FrozenDict."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class CompiledComponent(StandIn):
    """Stands in for a pipeline module: keeps its `config`, `dtype`, `device` and the attributes the
    pipeline reads, and routes calls to the compiled variant matching the input shapes.

    Every entry point a diffusers user reaches either does what it does on the eager module or
    refuses (`guards`): its parameters are the bound weights (edits in place reach the next call),
    `load_state_dict` writes into them through the recorded passes, `.to()` can only confirm the
    dtype and device it runs, and calls are taken as the eager forward takes them (arguments left
    out are its defaults). A denoiser takes diffusers' LoRA API (`lora.lora_component_class`). The
    load's lock orders calls and weight switches: a switch waits for a running call and the next
    call sees all of it.
    """

    def __init__(self, name: str, entry: dict[str, Any], variants: list[CompiledVariant],
                 weights: dict[str, torch.Tensor], context: LoadContext, eager: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.component_name = name
        self.config = Config(entry["config"])
        self.variants = variants
        self._weights = weights  # the base weights, bound by pointer: must live as long as the models
        self._lock = context.lock
        self._lora = None  # lora.LoraState, made by the first LoRA call
        self._leaf_paths = {leaf["path"] for v in variants for leaf in v.inputs}
        self._dtype = DTYPES[entry["dtype"]]
        # A VAE compiled in float32 inside a half-precision artifact: diffusers upcasts it itself.
        upcast = entry["dtype"] == "float32" and entry.get("config", {}).get("force_upcast")
        self.also_dtypes = frozenset({DTYPES[entry["target_dtype"]]} if upcast and "target_dtype" in entry else ())
        self._recipe = entry.get("quantize")  # the quant recipe of its weights, if any
        self._unread = frozenset(entry.get("unread", ()))  # weights no compiled code binds (dead, or fused)
        self._device = context.device
        self._spec = pipeline_spec(entry["pipeline"]).component(name)
        self._model_class: type | None = None  # what `__class__` says, where the pipeline checks it
        if self._spec.class_checked:  # a ModelMixin to isinstance(): from_pipe keeps it only if its type is named
            self._model_class = self._class()
            accept_compiled_class(type(self))
        self._eager = [eager] if eager is not None else []  # a list: not registered as a submodule
        self._parameters_out: dict[str, torch.nn.Parameter] = {}  # handed out by named_parameters()
        # What each was made as, its version then, and whether it is a copy of the bound memory.
        self._handed: dict[str, tuple[torch.Tensor, int, bool]] = {}
        self._eager_shapes: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[str]] | None = None
        self._meta_submodules: dict[str, torch.nn.Module | None] = {}  # `_submodule`'s, on the meta device
        self._weights_seen = False  # parameters() or state_dict() gave the bound tensors out
        self._replaced: str | None = None  # a bound tensor the eager fallback does not have
        self._signature: Any = None
        traced = variants[0].in_spec  # the call as traced: positional count, keyword arguments' specs
        self._traced = (traced.child(0).num_children, {name: spec for name, spec in zip(
            traced.child(1).context, traced.child(1).children(), strict=True) if name != "return_dict"})
        self.last_variant: str | None = None
        # The inputs the compiled code takes as zeros where a call leaves them out (`zero_when_absent`):
        # each leaf's traced shape by its path, under the input it belongs to; and the traced sample
        # (the first input), whose batch (and size) the zeros follow.
        self._zeros_sample = variants[0].inputs[0]
        self._zeros: dict[str, dict[str, list[int]]] = {}
        for leaf in variants[0].inputs:
            absent = next((n for n in self._spec.zero_when_absent if leaf["path"] == n
                           or leaf["path"].startswith(f"{n}.")), None)
            if absent is not None and leaf.get("shape") is not None and self._zeros_sample.get("shape") is not None:
                self._zeros.setdefault(absent, {})[leaf["path"]] = leaf["shape"]
        form = entry.get("ip_adapter")  # the IP-Adapter form compiled in (None: none)
        self._ip = IpAdapterState(name, form, entry["config"], self._dtype, self._device, weights, self._rebind,
                                  self._zeros.get(embeds_path(entry["config"]["_class_name"]), {})) if form else None
        for dotted, value in entry.get("attributes", {}).items():
            _set_dotted(self, dotted, value)
        for dotted, count in entry.get("block_counts", {}).items():
            _set_dotted(self, dotted, CompiledBlocks(name, dotted, count))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            spec = self.__dict__.get("_spec")
            if spec is not None and name in spec.methods:  # the model class's own code, on the stand-in
                return getattr(self._model_class or self._class(), name).__get__(self)
            if spec is not None and name in spec.submodules and (module := self._submodule(name)) is not None:
                return module
            raise MissingAttributeError(self.__dict__.get("component_name", type(self).__name__), name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        spec = self.__dict__.get("_spec")
        if spec is not None and name in spec.submodules and isinstance(value, torch.nn.Module):
            self._take_submodule(name, value)
        else:
            super().__setattr__(name, value)

    def _class(self) -> type:
        import diffusers

        return getattr(diffusers, self.config["_class_name"])

    def _submodule(self, name: str) -> torch.nn.Module | None:
        """The eager model's submodule `name` over the bound weights (None where the model's config
        makes none: SD3.5 Large's ControlNet's `pos_embed`, handed to it by the pipeline). It holds
        the bound tensors themselves, as `named_parameters` gives them: what a pipeline reads of it
        (`state_dict()`) is what the compiled code computes with."""
        if name not in self._meta_submodules:  # the model's layout, built once
            from .lora import meta_model

            self._meta_submodules[name] = getattr(self._spec.export_module(meta_model(self.config, self._dtype)),
                                                  name, None)
        if self._meta_submodules[name] is None:
            return None
        module = copy.deepcopy(self._meta_submodules[name])
        tensors = {key: self.eager_tensor(f"{name}.{key}")[0] for key in module.state_dict(keep_vars=True)}
        if lacking := sorted(key for key, tensor in tensors.items() if tensor.is_meta):
            raise UnsupportedCallError(f"{self.component_name}.{name}: the compiled code keeps no {lacking[0]!r} "
                                       f"(it was compiled into the code as a constant)")
        self._weights_seen = True  # handed out by pointer, as parameters() hands them
        module.load_state_dict(tensors, assign=True)
        return module

    def _take_submodule(self, name: str, module: torch.nn.Module) -> None:
        """A submodule the pipeline hands the model when it is made (`ComponentSpec.submodules`):
        its weights are written into the bound ones through the recorded passes, as eager's copy
        is. Unchanged ones (the artifact's own transformer's) are not written: no copy of a mapped
        file's pages."""
        state = {f"{name}.{key}": tensor for key, tensor in module.state_dict().items()}
        params, buffers, _ = self.eager_names()  # made once, the handed-in ones included
        read = {fqn for fqn in [*params, *buffers] if fqn.startswith(f"{name}.")}
        if set(state) != read:  # another architecture's: nothing is written, nothing ignored
            differing = sorted(set(state) ^ read)
            raise WeightsMismatchError(f"{self.component_name}.{name} = {type(module).__name__}(...): the compiled "
                                       f"code reads {len(read)} tensors of it, this one has {len(state)} "
                                       f"({differing[0]!r} differs): another architecture than the artifact's")
        with torch.no_grad():
            current = {fqn: self.eager_tensor(fqn)[0] for fqn in state}
            if all(torch.equal(now, state[fqn].to(now.device, self._dtype)) for fqn, now in current.items()):
                return
        self.load_state_dict(state, strict=False)

    @property
    def __class__(self) -> type:  # noqa: PLE0307
        """The model's class where the pipeline checks it (`ComponentSpec.class_checked`: diffusers'
        ControlNet pipelines assert `isinstance(pipe.controlnet, ControlNetModel)`), else this
        class: `isinstance(stand_in, CompiledComponent)` holds either way (it reads the type)."""
        return self.__dict__.get("_model_class") or type(self)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def denoiser(self) -> bool:
        """Whether this is the pipeline's denoiser (its spec says so)."""
        return self._spec.denoiser

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The base constants by FQN (the artifact's, or another checkpoint's), as bound at load."""
        return self._weights

    # -- parameters and state dicts: the eager model's, over the bound weights ------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The eager model's parameters, by its names, shapes and dtype, over the bound weights: a
        weight the code binds as it is is that very tensor, one fused into a projection its rows
        of it (a view), an int8 weight a float copy made from it; one no compiled code reads is on
        the meta device (it holds no values here). In-place edits reach the next call (a copy's
        are written back through the recorded passes), and a parameter whose `.data` is replaced
        is bound, or written, anew before it. Lifted constants (rotary tables) are none of them."""
        for name in self.eager_names()[0]:
            yield (f"{prefix}.{name}" if prefix else name), self.parameter(name)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The eager model's buffers: the bound tensor where the code binds one of that name, else
        on the meta device (a table the model computes, compiled in as a constant)."""
        for name in self.eager_names()[1]:
            yield (f"{prefix}.{name}" if prefix else name), self.eager_tensor(name)[0]

    def get_parameter(self, target: str) -> torch.nn.Parameter:
        if target not in self.eager_names()[0]:
            raise AttributeError(f"{self.component_name} has no parameter {target!r}")
        return self.parameter(target)

    def eager_names(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[str]]:
        """The eager model's parameters and buffers by name, on the meta device, and the buffers
        its state dict holds (the persistent ones); made once."""
        if self._eager_shapes is None:
            from .lora import meta_model

            model = self._spec.export_module(meta_model(self.config, self._dtype))
            params, buffers = ({name.replace(".base_layer.", "."): tensor for name, tensor in named}
                               for named in (model.named_parameters(), model.named_buffers()))
            handed = self._handed_in(model, self._dtype)
            self._eager_shapes = params, buffers | handed, set(buffers) & set(model.state_dict(keep_vars=True)) \
                | set(handed)
        return self._eager_shapes

    def _handed_in(self, model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The bound weights of the submodules a pipeline hands the model that its config makes
        none of (`ComponentSpec.submodules`), on the meta device: parts of the eager model as the
        pipeline makes it (kept as buffers: its state dict holds them, no LoRA targets them)."""
        prefixes = self._spec.unheld_submodules(model)
        return {fqn: torch.empty(tensor.shape, dtype=dtype, device="meta") for fqn, tensor in self._weights.items()
                if prefixes and fqn.startswith(prefixes)}

    def eager_tensor(self, name: str) -> tuple[torch.Tensor, bool]:
        """An eager parameter or buffer made of the bound weights (see `named_parameters`), and
        whether it is a copy of them rather than their memory."""
        params, buffers, _ = self.eager_names()
        meta = params.get(name, buffers.get(name))
        fqn, rows = placement(name, {**params, **buffers}, self._weights)
        if fqn is None:
            return torch.empty(meta.shape, dtype=meta.dtype, device="meta"), False
        bound = self._weights[fqn]
        if QUANTIZED in fqn:  # an int8 weight: its float values
            scale = self._weights[fqn[:-1] + "1"]
            scheme = quant_scheme(self._recipe, self.component_name)
            return scheme.dequantize(bound[rows], scale[rows], self._dtype), True
        return (bound if rows == slice(0, None) else bound[rows]), False

    def parameter(self, name: str) -> torch.nn.Parameter:
        self._weights_seen = True
        param = self._parameters_out.get(name)
        if param is None:
            tensor, copied = self.eager_tensor(name)
            param = self._parameters_out[name] = torch.nn.Parameter(tensor, requires_grad=False)
            self._handed[name] = (tensor, param._version, copied)
        return param

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The eager model's state dict (its names, its persistent buffers too), over the bound
        weights as `named_parameters` gives them: `load_state_dict` takes it back."""
        self._weights_seen = True
        destination = collections.OrderedDict() if destination is None else destination
        params, buffers, persistent = self.eager_names()
        for name in params:
            destination[prefix + name] = self.parameter(name) if keep_vars else self.parameter(name).detach()
        for name in buffers:
            if name in persistent:
                destination[prefix + name] = self.eager_tensor(name)[0].detach()
        return destination

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """The eager module's `load_state_dict`: tensors named as the eager module names them (any
        subset with `strict=False`) are written into the bound weights through the recorded passes
        (dtype, fused QKV rows, layout, int8 with the recorded scheme), in place: the next call
        computes what the eager module would with them. Nothing changes when anything is wrong.

        Raises:
            WeightsMismatchError: keys missing or unexpected (strict), a tensor of another shape,
                or one the compiled code has no place for.
        """
        eager = self.eager_tensors()
        with self._lock:
            missing, unexpected = key_differences(self.component_name, state_dict, eager, strict)
            self.write_planned(self.planned_writes(state_dict, eager), state_dict)
        return IncompatibleKeys(missing, unexpected)

    def eager_tensors(self) -> dict[str, torch.Tensor]:
        """The eager module's parameters and buffers by name, on the meta device (shapes only)."""
        from .lora import meta_model

        model = self._spec.export_module(meta_model(self.config, torch.float32))
        return module_tensors(model) | self._handed_in(model, torch.float32)

    @property
    def lock(self) -> Any:
        """The lock of this load: held while weights are written, LoRAs merged, or a call runs."""
        return self._lock

    def bound_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The bound weights whose names start with `prefix`, by name without it (a load writes them in
        place, so they follow every checkpoint the component takes)."""
        return {fqn.removeprefix(prefix): tensor for fqn, tensor in self._weights.items() if fqn.startswith(prefix)}

    def planned_writes(self, state_dict: Mapping[str, torch.Tensor],
                        eager: dict[str, torch.Tensor] | None = None) -> list[tuple[str, slice, torch.Tensor]]:
        """Where the state dict's tensors go in the bound weights (`checkpoint.placed_writes`)."""
        eager = self.eager_tensors() if eager is None else eager
        given = {name: tensor for name, tensor in state_dict.items() if name in eager}
        return placed_writes(self.component_name, given, eager, self._weights, self._dtype, self._recipe,
                             self._unread)

    def write_planned(self, writes: list[tuple[str, slice, torch.Tensor]],
                      state_dict: Mapping[str, torch.Tensor]) -> None:
        """Write planned values into the bound weights (the caller holds the lock); the LoRA merges
        are made again from them before the next call, and the eager fallback gets them too."""
        with torch.no_grad():
            for fqn, rows, values in writes:
                self._weights[fqn][rows].copy_(values)
        if writes and self._lora is not None:
            self._lora.rebase()
        if self._eager:
            eager = self._spec.export_module(self._eager[0])
            names = {name for name, _ in [*eager.named_parameters(), *eager.named_buffers()]}
            eager.load_state_dict({k: v for k, v in state_dict.items() if k in names}, strict=False)

    def _follow_parameters(self) -> None:
        """Parameters handed out, as the eager module would read them now: one whose `.data` was
        replaced (`p.data = new`) is bound anew where the code binds it as it is (refused when the
        compiled code cannot read the new tensor as it is), else written through the recorded
        passes; a copy (an int8 weight's float values) edited in place is written back."""
        for name, param in self._parameters_out.items():
            handed, version, copied = self._handed[name]
            same = param.data_ptr() == handed.data_ptr() and param.stride() == handed.stride() \
                and param.shape == handed.shape and param.dtype == handed.dtype
            if same and (not copied or param._version == version):
                continue  # unchanged, or edited in place in the memory the code reads
            if name in self._weights and not same:  # bound as it is: the new tensor is bound
                base = self._weights[name]
                if not same_layout(param.data, base, base.device):
                    raise UnsupportedCallError(
                        f"{self.component_name}: parameter {name!r} was replaced by a {list(param.shape)} "
                        f"{dtype_name(param.dtype)} tensor with strides {list(param.stride())} on {param.device}; "
                        f"the compiled code reads {list(base.shape)} {dtype_name(base.dtype)} with strides "
                        f"{list(base.stride())} on {base.device}",
                        hint="write new values into the parameter in place (with torch.no_grad(): p.copy_(new)), or "
                             "use load_state_dict()")
                self._weights[name] = param.data
                self._rebind({name: param.data})
                self._replaced = name
                if self._lora is not None:
                    self._lora.rebase()
                copied = False  # the parameter is the bound memory again
            else:  # rows of a fused projection, an int8 weight: its values written through the passes
                self.write_planned(self.planned_writes({name: param.data}), {name: param.data})
                copied = True  # the parameter's memory is the caller's: later edits are written back too
            self._handed[name] = (param.data, param._version, copied)

    # -- weights ------------------------------------------------------------------------------

    def _rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Bind `tensors` (by FQN, each like the base constant it replaces: shape, dtype, strides,
        device) for the next call, in every variant at once, by pointer: writing into a bound
        tensor later changes the next call too."""
        for fqn, tensor in tensors.items():
            base = self._weights.get(fqn)
            if base is None or not same_layout(tensor, base, base.device):
                raise AotbuildError(f"{self.component_name}: cannot bind {fqn!r}: the compiled code reads "
                                    + (f"{list(base.shape)} {base.dtype} with strides {list(base.stride())} on "
                                       f"{base.device}" if base is not None else "no such constant"))
        with self._lock:
            self._bind(tensors)

    def _bind(self, tensors: dict[str, torch.Tensor]) -> None:
        for variant in self.variants:
            variant.rebind(tensors)

    def _lora_state(self) -> Any:
        from .lora import LoraState

        if self._lora is None:
            self._lora = LoraState(self.config, self._dtype, self._device, self._weights, self._rebind,
                                   self._recipe, self._unread)
            self.add_module("lora_shell", self._lora.shell)  # diffusers walks modules() for peft layers
        return self._lora

    # -- IP-Adapters: diffusers' IPAdapterMixin on a UNet built with one (ip_adapter) -----------

    def _ip_state(self, asked: str) -> IpAdapterState:
        if self._ip is None:
            raise MissingAttributeError(self.component_name, asked, message=(
                f"{self.component_name}: this artifact takes no IP-Adapter: its target was built without one"),
                hint="build the target with an IP-Adapter of the form you will load: ip_adapter = "
                     "\"org/name/subfolder/weights.safetensors\"")
        return self._ip

    def _load_ip_adapter_weights(self, state_dicts: Any, low_cpu_mem_usage: bool = True) -> None:
        """What `pipe.load_ip_adapter` asks of the UNet: the adapters, converted by diffusers and
        bound as data from the next call (`ip_adapter.IpAdapterState.load`)."""
        state = self._ip_state("load_ip_adapter")
        with self._lock:
            state.load(state_dicts if isinstance(state_dicts, list) else [state_dicts])

    def _load_ip_adapter_loras(self, state_dicts: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """The LoRAs an IP-Adapter FaceID carries (`load_ip_adapter` loads them as LoRAs)."""
        return ip_adapter_loras(self._ip_state("load_ip_adapter").shell, state_dicts)

    @property
    def ip_adapter(self) -> IpAdapterState | None:
        """The IP-Adapter state of a UNet built with one (None: built without)."""
        return self._ip

    @property
    def attn_processors(self) -> dict[str, Any]:
        """The UNet's attention processors, as diffusers' IP-Adapter API reads and sets them (their
        scales); the compiled attention is the artifact's."""
        return self._ip_state("attn_processors").shell.attn_processors

    @property
    def down_blocks(self) -> torch.nn.ModuleList:
        """The UNet's blocks on the meta device, which `set_ip_adapter_scale` reads for a per-block scale."""
        return self._ip_state("down_blocks").shell.down_blocks

    @property
    def up_blocks(self) -> torch.nn.ModuleList:
        return self._ip_state("up_blocks").shell.up_blocks

    def set_attn_processor(self, processor: Any) -> None:
        """What `unload_ip_adapter` sets once the adapter is gone: the processors without one. The
        compiled attention is the artifact's: nothing else is taken."""
        state = self._ip_state("set_attn_processor")
        given = processor.values() if isinstance(processor, dict) else [processor]
        if state.loaded or any(hasattr(p, KEYS[0]) for p in given):
            raise UnsupportedCallError(
                f"{self.component_name}.set_attn_processor(): the compiled attention and its IP-Adapter layers are "
                f"the artifact's", hint="load IP-Adapters with pipe.load_ip_adapter(), remove them with "
                                        "pipe.unload_ip_adapter(), scale them with pipe.set_ip_adapter_scale()")
        with self._lock:
            state.shell.set_attn_processor(processor)

    @property
    def encoder_hid_proj(self) -> Any:
        """The adapters' image projection layers (None: no adapter loaded), which the pipeline reads."""
        return self._ip.shell.encoder_hid_proj if self._ip is not None and self._ip.loaded else None

    @encoder_hid_proj.setter
    def encoder_hid_proj(self, value: Any) -> None:
        if value is not None:
            raise UnsupportedCallError(f"{self.component_name}.encoder_hid_proj: the compiled UNet's image projection "
                                       f"is the loaded IP-Adapter's", hint="load adapters with pipe.load_ip_adapter()")
        if self._ip is not None:  # unload_ip_adapter()
            with self._lock:
                self._ip.unload()

    # -- step caches: diffusers' CacheMixin (step_cache) ----------------------------------------

    def _step_cache_model(self) -> torch.nn.Module | None:
        """The model tree a step cache hooks: a regional component's (None: one compiled graph)."""
        return None

    def enable_cache(self, config: Any) -> None:
        """diffusers' `enable_cache(config)`: on a regional artifact, the hooks go where diffusers
        puts them on the eager model, around the compiled blocks; refused where they cannot work."""
        if not step_cache.takes_caches(self.config):
            raise MissingAttributeError(self.component_name, "enable_cache", message=(
                f"{self.component_name} ({self.config['_class_name']}) has no enable_cache, eager or compiled: "
                f"diffusers' step caches are for its transformers (CacheMixin)"), hint="run without a step cache")
        with self._lock:
            step_cache.enable(self.component_name, self._step_cache_model(), dict(self.config), config)

    def disable_cache(self) -> None:
        """diffusers' `disable_cache()`: the next call runs every block again."""
        model = self._step_cache_model()
        if step_cache.enabled(model):
            with self._lock:
                model.disable_cache()

    @property
    def is_cache_enabled(self) -> bool:
        return step_cache.enabled(self._step_cache_model())

    def _reset_stateful_cache(self, recurse: bool = True) -> None:
        """What diffusers calls as a pipeline call ends: the cache starts afresh with the next one."""
        if self.is_cache_enabled:
            self._step_cache_model()._reset_stateful_cache(recurse)

    def cache_context(self, name: str, **where: Any) -> contextlib.AbstractContextManager:
        """diffusers' CacheMixin hook (Flux enters it around each call; Wan says where the loop is:
        step_index, sigma): the cache's state for that call, if a cache is on."""
        return step_cache.context(self._step_cache_model(), name, **where)

    # -- calls --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        check_autocast(self.component_name, self._device, self._dtype)
        with self._lock:
            if self._parameters_out:
                self._follow_parameters()
            return self._forward(args, kwargs)

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        return_dict = kwargs.pop("return_dict", True)
        lora_scale = pop_scale(kwargs, self._leaf_paths)  # without adapters it scales nothing, as in diffusers
        if self._lora is not None:
            self._lora.sync(lora_scale)
        args, kwargs = self._as_traced(args, kwargs)
        if self._spec.prepare is not None:  # on the call as traced: an argument given by position is named
            kwargs = self._spec.prepare(self.config, kwargs)
        if self._ip is not None:
            self._ip.sync(kwargs)
        if self._zeros:
            kwargs = self._zeros_given(args, kwargs)
        call_args, call_kwargs = self._spec.call_inputs(args, kwargs)
        for variant in self.variants:
            leaves = variant.flatten(call_args, call_kwargs)
            if leaves is not None and variant.accepts(leaves):
                self.last_variant = variant.name
                outputs = variant.run(leaves)
                break
        else:
            refusal = unsupported_call(self.component_name, self.variants, call_args, call_kwargs,
                                       self._spec.per_step)
            message = refusal.message
            if not self._eager:
                # A size, text length, frame count or guidance the variants do not cover (the message
                # lists what they do): the target can cover it; an input the code lacks, it cannot.
                raise ShapeNotSupportedError(message, hint=COVER_HINT if refusal.coverable else None)
            if self._lora is not None and self._lora.active:
                raise ShapeNotSupportedError(f"{message}; the eager fallback runs without the LoRA adapters loaded "
                                             f"into the compiled model")
            if reason := self._fallback_differs():
                raise ShapeNotSupportedError(f"{message}; the eager fallback cannot run this {self.component_name}'s "
                                             f"weights: {reason}")
            warnings.warn(f"aotbuild: {message}; running eager", stacklevel=2)
            self.last_variant = "eager"
            with torch.no_grad():
                outputs = self._spec.export_module(self._eager[0])(*call_args, **call_kwargs)
        if self._spec.finish is not None:  # what the eager forward does after the compiled part
            outputs = self._spec.finish(self.config, outputs, kwargs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        if not return_dict:  # the module's tuple, whatever the class it would return
            return tuple(outputs)
        if self._spec.output_class is None:  # a VAE part: the tensor, as diffusers' encoder/decoder give it
            return outputs[0]
        module_name, class_name = self._spec.output_class.rsplit(".", 1)
        output_class = getattr(importlib.import_module(module_name), class_name)
        return output_class(**dict(zip(self._spec.output_fields, outputs, strict=False)))

    def _zeros_given(self, args: tuple, kwargs: dict) -> dict:
        """The call with zeros for each `zero_when_absent` input it leaves out (a UNet compiled with
        a ControlNet's residuals, called with no ControlNet; one compiled with an IP-Adapter, called
        with no image): shaped as traced, at the sample's batch (and, `SIZED`, its size; `TOKENS`,
        as many tokens as its area makes), in its dtype, on its device; a list where the traced
        call had several (diffusers' ControlNet pipelines pass a list). The caller's dicts are not
        changed (a pipeline reuses them)."""
        first = self._zeros_sample["path"]  # the traced call's first input: `args[0]`, or its name
        sample = (args[0] if args else None) if first == "args[0]" else kwargs.get(first)
        if not isinstance(sample, torch.Tensor):
            return kwargs
        traced, given = self._zeros_sample["shape"], kwargs
        for name, leaves in self._zeros.items():
            head, _, key = name.partition(".")  # an input, or a key of a dict input (added_cond_kwargs)
            holder = kwargs.get(head) if key else kwargs
            if (holder or {}).get(key or head) is not None:
                continue
            values = []
            for path, shape in leaves.items():
                rule = self._spec.zero_when_absent[name]
                if rule == SIZED:
                    # Each dim as traced, scaled as the sample's scaled: a UNet's residuals follow its latents'
                    # size (its channels stay), Flux's ControlNet samples its image tokens (their width stays).
                    if len(shape) != sample.dim() or len(traced) != sample.dim():
                        return given  # not this model's sample: the call is refused as it is
                    dims = [size * now // then for size, now, then in zip(shape[1:], sample.shape[1:], traced[1:],
                                                                             strict=True)]
                elif rule == TOKENS:
                    # SD3's ControlNet's samples: tokens of the latent image, as many as its area makes.
                    if len(traced) != sample.dim():
                        return given
                    dims = [shape[1] * math.prod(sample.shape[2:]) // math.prod(traced[2:]), *shape[2:]]
                else:
                    dims = shape[1:]
                values.append((path, sample.new_zeros(sample.shape[0], *dims)))
            value = values[0][1] if values[0][0] == name else [zeros for _, zeros in values]
            kwargs = {**kwargs, head: {**(holder or {}), key: value}} if key else {**kwargs, head: value}
        return kwargs

    def _fallback_differs(self) -> str | None:
        """Why the eager module kept for the fallback would not compute with the bound weights."""
        if self._ip is not None and (self._ip.loaded or loaded_form(self._spec.export_module(self._eager[0]))):
            return ("the IP-Adapter state is the compiled model's (load_ip_adapter, set_ip_adapter_scale, "
                    "unload_ip_adapter), not the eager module's")
        if self._replaced is not None:
            return f"parameter {self._replaced!r} was replaced, and the eager module keeps the tensor it had"
        if self._weights_seen:
            eager = {t.data_ptr() for t in module_tensors(self._spec.export_module(self._eager[0])).values()}
            if not all(t.data_ptr() in eager for t in self._weights.values()):
                return ("its parameters were handed out (parameters(), state_dict()) and may have been edited in "
                        "place, and the eager module holds its own copy of them")
        return None

    def _as_traced(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call as the compiled code was traced: each argument the traced call passed by
        position or by name, where this call passes it either way; the ones it leaves out taken at
        the eager forward's defaults; an empty dict and None alike where diffusers passes either
        for "no attention kwargs", a list and a tuple alike. Arguments the traced call did not
        have stay, for the refusal to name them."""
        positional, keywords = self._traced
        if len(args) == positional and kwargs.keys() == keywords.keys():
            # The pipeline's own calls: already as traced (binding the signature costs ~30 us a call).
            return args, {name: _container_as_traced(value, keywords[name]) for name, value in kwargs.items()}
        signature = self._forward_signature()
        if signature is None:
            return args, kwargs
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:  # what the eager forward says of the same call
            raise TypeError(f"{self.component_name}.forward(): {exc}") from None
        bound.apply_defaults()
        values = bound.arguments
        names = list(signature.parameters)
        call_kwargs = {name: _container_as_traced(values[name], spec) for name, spec in keywords.items()}
        for name in names[positional:]:
            if name not in call_kwargs and name != "return_dict" and values[name] is not None \
                    and values[name] is not signature.parameters[name].default:
                call_kwargs[name] = values[name]
        return tuple(values[name] for name in names[:positional]), call_kwargs

    def _forward_signature(self) -> inspect.Signature | None:
        """The eager forward's signature without `self` (a denoiser's; None for a VAE part, whose
        diffusers code calls it with one tensor, or a forward taking *args or **kwargs)."""
        if self._signature is None:
            self._signature = False
            if self._spec.output_class is not None:
                import diffusers

                cls = getattr(diffusers, self.config.get("_class_name", ""), None)
                if cls is not None:
                    parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
                    if all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters):
                        self._signature = inspect.Signature(parameters)
        return self._signature or None

    def extra_repr(self) -> str:
        return f"{self.component_name}, variants={[v.name for v in self.variants]}"


def _container_as_traced(value: Any, traced: Any) -> Any:
    """None where the traced call passed None, {} where it passed an empty dict, for either; a
    list where it passed a list and this call a tuple, and the reverse (diffusers' models take
    either: SD3's several ControlNets sum their samples into a tuple, one gives a list)."""
    if value is None and traced.type is dict and traced.num_children == 0:
        return {}
    if isinstance(value, dict) and not value and traced.is_leaf():
        return None
    if type(value) in (list, tuple) and traced.type in (list, tuple) and type(value) is not traced.type:
        return traced.type(value)
    return value


def key_differences(component: str, state_dict: Mapping[str, torch.Tensor], eager: dict[str, torch.Tensor],
                     strict: bool) -> tuple[list[str], list[str]]:
    """(missing keys, unexpected keys) of a state dict against the eager module's names; with
    `strict`, either is a WeightsMismatchError naming them, as the eager module would refuse."""
    missing = sorted(set(eager) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(eager))
    if strict and (missing or unexpected):
        def listed(keys: list[str]) -> str:
            return ", ".join(map(repr, keys[:3])) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

        problems = ([f"missing keys {listed(missing)}"] if missing else []) + (
            [f"unexpected keys {listed(unexpected)}"] if unexpected else [])
        raise WeightsMismatchError(f"{component}.load_state_dict(strict=True): {'; '.join(problems)}; nothing was "
                                   f"loaded")
    return missing, unexpected


class CompiledBlocks(Sequence):
    """A compiled model's repeated blocks as its pipeline reads them (Bria FIBO sizes its text
    layers by `len(transformer.transformer_blocks)`): counted, not reached; they are in the
    compiled code."""

    def __init__(self, component: str, name: str, count: int) -> None:
        self._component, self._name, self._count = component, name, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        raise MissingAttributeError(self._component, f"{self._name}[{index}]",
                                    message=f"{self._component} is compiled by aotbuild: its {self._name} are in the "
                                            f"compiled code, and the stand-in keeps only their number "
                                            f"({self._count})")


def _set_dotted(root: Any, dotted: str, value: Any) -> None:
    """root.a.b.c = value, creating plain namespaces for the missing parents."""
    *parents, leaf = dotted.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            setattr(node, part, SimpleNamespace())
        node = getattr(node, part)
    setattr(node, leaf, value)
