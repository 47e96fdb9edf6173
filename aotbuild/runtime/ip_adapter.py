"""diffusers' IP-Adapter API on a compiled UNet (or Flux transformer), as bound weights.

An artifact built with an IP-Adapter loaded (a target's `ip_adapter`) has the adapter compiled in:
its image projection runs on the image embeddings and every cross-attention adds the adapter's
attention over the projected tokens. Their weights are constants like any other, so an adapter of
the same form (projection, token count, widths: `describe`) is bound as data, with no compile.

The adapter's state lives where diffusers keeps it, on a copy of the UNet built on the meta device
(the shell): `pipe.load_ip_adapter` converts the adapter there with diffusers' own code (real
tensors only in the adapter's layers), `set_ip_adapter_scale` writes its processors' scales,
`unload_ip_adapter` takes them out. Before each call that state is bound (`IpAdapterState.sync`):

- attention is linear in its values, so a processor's scale s is served by binding s x its
  `to_v_ip` weight (and bias, Flux's): the compiled code adds the adapter's attention at scale 1;
- no adapter (none loaded yet, or unloaded) is served by zero `to_v_ip` weights: the adapter's
  attention is then exactly 0 and the UNet computes what it computes without one (x + 0 is x), as
  eager skips an adapter at scale 0.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

from ..errors import UnsupportedCallError, WeightsMismatchError
from ..spec.private_apis import ip_adapter_layers
from .lora import meta_model

PROJECTION = "encoder_hid_proj"  # where diffusers puts the adapters' image projection layers in the model
KEYS = ("to_k_ip", "to_v_ip")  # an IP-Adapter processor's projections, one per adapter
# Where each model that takes IP-Adapters takes the image embeddings: a dict input and its key.
IMAGE_EMBEDS = {"UNet2DConditionModel": ("added_cond_kwargs", "image_embeds"),
                "FluxTransformer2DModel": ("joint_attention_kwargs", "ip_adapter_image_embeds")}
_generations = itertools.count(1)


def embeds_path(class_name: str) -> str | None:
    """The dotted input through which a model takes the IP-Adapters' image embeddings (None: none)."""
    where = IMAGE_EMBEDS.get(class_name)
    return f"{where[0]}.{where[1]}" if where else None


def adapter_tensors(processors: dict[str, Any], projections: list[Any]) -> dict[str, torch.Tensor]:
    """An adapter's weights by the model's names for them (as its state dict has them once loaded)."""
    tensors = {f"{name}.{key}": t for name, processor in processors.items() if hasattr(processor, KEYS[0])
               for key, t in processor.state_dict().items()}
    for i, layer in enumerate(projections):
        tensors |= {f"{PROJECTION}.image_projection_layers.{i}.{key}": t for key, t in layer.state_dict().items()}
    return tensors


def describe(processors: dict[str, Any], projections: list[Any]) -> list[str]:
    """Each adapter's form as a user names it: its image projection, the tokens it makes and the
    width of the image embeddings it takes (the image encoder's)."""
    counted = next((getattr(p, "num_tokens", None) for p in processors.values() if hasattr(p, KEYS[0])), None)
    forms = []
    for i, layer in enumerate(projections):
        latents = getattr(layer, "latents", None)  # a Plus projection's queries
        count = getattr(layer, "num_image_text_embeds", None) or getattr(layer, "num_tokens", None) or (
            latents.shape[1] if isinstance(latents, torch.Tensor) else counted[i] if counted else "?")
        linear = next((m for m in layer.modules() if isinstance(m, torch.nn.Linear)), None)
        width = f" from {linear.in_features}-wide image embeddings" if linear is not None else ""
        forms.append(f"{type(layer).__name__} ({count} image tokens{width})")
    return forms


def _model_processors(model: torch.nn.Module) -> dict[str, Any]:
    """A model's attention processors but its image projection's (an IP-Adapter Plus projection
    attends too): the ones an adapter's layers go into."""
    return {name: p for name, p in model.attn_processors.items() if not name.startswith(f"{PROJECTION}.")}


def loaded_form(model: torch.nn.Module) -> dict[str, Any] | None:
    """The form of the IP-Adapters loaded into an eager model, as a manifest records it (None: none
    loaded): each adapter's description and every adapter constant's shape."""
    layers = list(getattr(getattr(model, PROJECTION, None), "image_projection_layers", None) or [])
    processors = _model_processors(model) if layers else {}
    if not any(hasattr(p, KEYS[0]) for p in processors.values()):
        return None
    return {"adapters": describe(processors, layers),
            "shapes": {fqn: list(t.shape) for fqn, t in sorted(adapter_tensors(processors, layers).items())}}


@functools.cache
def _placed(cls: type, device: torch.device) -> type:
    """`cls` reporting `device` as its device: a model built on the meta device whose adapter layers
    diffusers' converters make on the model's device (Flux's), made there instead."""
    return type(cls.__name__, (cls,), {"device": property(lambda self: device), "__module__": cls.__module__})


class IpAdapterState:
    """The IP-Adapters of one compiled model: the shell diffusers' API works on, and the weights
    bound for its state."""

    def __init__(self, component: str, form: dict[str, Any], config: dict[str, Any], dtype: torch.dtype,
                 device: torch.device, base: dict[str, torch.Tensor], rebind: Any,
                 traced: dict[str, list[int]]) -> None:
        self._config, self._shell = config, None
        self._component, self._form, self._dtype, self._device = component, form, dtype, device
        self._base, self._rebind = base, rebind
        self._holder, self._key = IMAGE_EMBEDS[config["_class_name"]]
        self._traced = traced  # the image embeddings' traced shapes, by input path
        self._tensors: dict[str, torch.Tensor] = {}  # the loaded adapters' constants, as the code reads them
        # The shell's adapter processors, by name: listed once per load, not at each call (diffusers'
        # `attn_processors` walks every module: ~3 ms on SDXL's UNet, 2 cores).
        self._processors: list[tuple[str, Any]] = []
        self._generation = 0  # which load made them
        self._zeros: dict[tuple, torch.Tensor] = {}  # a zero tensor per (shape, strides, dtype): no adapter
        self._scaled: dict[str, torch.Tensor] = {}  # a buffer per to_v_ip constant at a scale other than 1
        self._bound_state: tuple | None = ()

    @property
    def shell(self) -> torch.nn.Module:
        """The model on the meta device that diffusers' IP-Adapter API works on, made at its first use."""
        if self._shell is None:
            shell = meta_model(self._config, self._dtype)
            shell.__class__ = _placed(type(shell), self._device)
            self._shell = shell
        return self._shell

    @property
    def loaded(self) -> bool:
        return bool(self._tensors)

    def unload(self) -> None:
        """What `unload_ip_adapter` asks first (`encoder_hid_proj = None`): no adapter any more; the
        processors it then sets are the shell's."""
        setattr(self.shell, PROJECTION, None)
        self._tensors, self._scaled, self._processors = {}, {}, []

    def load(self, state_dicts: list[dict[str, Any]]) -> None:
        """diffusers' `_load_ip_adapter_weights` on the shell: the adapters converted with its own
        code (with no projection in place, as diffusers does: a Plus projection has processors of
        its own), checked against the artifact's form, and installed; refused, with the shell as it
        was, when their form differs. The converted layers then go to the meta device: their
        values are in the bound constants."""
        shell = self.shell
        before = getattr(shell, PROJECTION, None)
        setattr(shell, PROJECTION, None)
        try:
            processors, projections = ip_adapter_layers(shell, state_dicts)
            self.install(processors, projections)
        except Exception:
            setattr(shell, PROJECTION, before)
            raise
        for module in [*processors.values(), *projections]:
            module.to("meta")

    def install(self, processors: dict[str, Any], projections: list[Any]) -> None:
        """Adapters' layers (real modules) into the shell, their weights made as the code reads them."""
        from diffusers.models.embeddings import MultiIPAdapterImageProjection

        tensors = adapter_tensors(processors, projections)
        shapes = {fqn: list(t.shape) for fqn, t in tensors.items()}
        if shapes != self._form["shapes"]:
            differ = sorted(set(shapes) ^ set(self._form["shapes"])) or sorted(
                fqn for fqn in shapes if shapes[fqn] != self._form["shapes"][fqn])
            first = differ[0]
            raise WeightsMismatchError(
                f"{self._component}: this artifact takes {_adapters(self._form['adapters'])}; the IP-Adapter given is "
                f"{_adapters(describe(processors, projections))} (first difference: {first!r} "
                f"{shapes.get(first, 'absent')} in the adapter, {self._form['shapes'].get(first, 'absent')} in the "
                f"artifact); the {self._component} keeps the adapter it had",
                hint="load an IP-Adapter of the artifact's form, or build one for this adapter (a target's ip_adapter)")
        made = {}
        for fqn, tensor in tensors.items():
            base = self._base[fqn]
            made[fqn] = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device=base.device)
            made[fqn].copy_(tensor.detach())
        self.shell.set_attn_processor(processors)
        self._processors = [(name, p) for name, p in _model_processors(self.shell).items() if hasattr(p, KEYS[0])]
        setattr(self.shell, PROJECTION, MultiIPAdapterImageProjection(projections))
        self.shell.config.encoder_hid_dim_type = "ip_image_proj"
        self._tensors, self._generation = made, next(_generations)
        self._scaled.clear()

    def adopt(self, model: torch.nn.Module) -> None:
        """The IP-Adapters loaded into an eager model (a pipeline given to `apply`), with their scales."""
        if loaded_form(model) is not None:
            self.install(_model_processors(model), list(getattr(model, PROJECTION).image_projection_layers))

    def first_difference(self) -> str | None:
        """The first adapter constant whose loaded values differ from the base weights bound at
        load (the artifact's: the adapter it was built with), if any."""
        return next((fqn for fqn, tensor in self._tensors.items() if not torch.equal(tensor, self._base[fqn])), None)

    def _scales(self) -> tuple:
        """Each adapter processor's scales, by name: what the call's bound weights follow. A list
        (a scale per image, for masks) is eager's skip when all zeros, else eager's TypeError."""
        scales = []
        for name, processor in self._processors:
            values = []
            for scale in processor.scale:
                if isinstance(scale, list) and any(scale):
                    raise UnsupportedCallError(
                        f"{self._component}: an IP-Adapter scale per image ({name}: {processor.scale}) is for "
                        f"IP-Adapter masks, which this artifact does not compile", hint="set one scale per IP-Adapter")
                values.append(0.0 if isinstance(scale, list) else float(scale))
            scales.append((name, tuple(values)))
        return tuple(scales)

    def sync(self, kwargs: dict[str, Any]) -> None:
        """Bind the weights the adapters' state asks for, if it changed since the last call: the
        adapters at their scales when one is loaded and the call gives image embeddings, else none.
        A call without image embeddings while an adapter is loaded is refused, as eager refuses it
        (the UNet with a ValueError, Flux's processors with a TypeError); image embeddings of another
        number of images per adapter than compiled are refused in those terms."""
        embeds = (kwargs.get(self._holder) or {}).get(self._key)
        if embeds is None and self.loaded:
            raise ValueError(f"{self._component}: an IP-Adapter is loaded and this call gives it no image "
                             f"(ip_adapter_image or ip_adapter_image_embeds), which eager diffusers refuses too; "
                             f"give one, or pipe.unload_ip_adapter()")
        if embeds is not None and self.loaded:
            self._check_images(embeds)
        state = (self._generation, self._scales()) if self.loaded and embeds is not None else None
        if state == self._bound_state:
            return
        bind = {}
        if state is None:  # no adapter: its attention adds zeros
            for fqn in self._form["shapes"]:
                if ".to_v_ip." in fqn:
                    bind[fqn] = self._zero_like(self._base[fqn])
        else:
            bind = dict(self._tensors)
            for name, scales in state[1]:
                for i, scale in enumerate(scales):
                    for fqn in (f"{name}.to_v_ip.{i}.weight", f"{name}.to_v_ip.{i}.bias"):
                        if scale != 1.0 and fqn in self._tensors:  # s x attention(q, k, v) = attention(q, k, s x v)
                            buffer = self._scaled.setdefault(fqn, torch.empty_like(self._tensors[fqn]))
                            bind[fqn] = torch.mul(self._tensors[fqn], scale, out=buffer)
        self._rebind(bind)
        self._bound_state = state

    def _check_images(self, embeds: Any) -> None:
        """Each adapter's embeddings hold as many images as compiled (their dim 1, where a dim
        follows the batch: several images for one adapter make more image tokens)."""
        for i, tensor in enumerate(embeds if isinstance(embeds, (list, tuple)) else [embeds]):
            traced = self._traced.get(f"{self._holder}.{self._key}.{i}")
            if traced is not None and len(traced) >= 3 and tensor.dim() == len(traced) and tensor.shape[1] != traced[1]:
                raise UnsupportedCallError(
                    f"{self._component}: IP-Adapter {i} is given {tensor.shape[1]} images in this call; this artifact "
                    f"takes {traced[1]} per IP-Adapter (each image makes image tokens of its own, a size compiled in)",
                    hint="give one image per IP-Adapter, or build a target whose capture gives as many")

    def _zero_like(self, base: torch.Tensor) -> torch.Tensor:
        key = (tuple(base.shape), base.stride(), base.dtype)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros_like(base)
        return self._zeros[key]


def _adapters(forms: list[str]) -> str:
    return f"{len(forms)} IP-Adapter{'s' if len(forms) > 1 else ''}: " + ", ".join(forms)
