"""diffusers' IP-Adapter API on a compiled UNet, as bound weights.

An artifact built with an IP-Adapter loaded (a target's `ip_adapter`) has the adapter compiled in:
its image projection runs on the image embeddings and every cross-attention adds the adapter's
attention over the projected tokens. Their weights are constants like any other, so an adapter of
the same form (projection, token count, widths: `describe`) is bound as data, with no compile.

The adapter's state lives where diffusers keeps it, on a copy of the UNet built on the meta device
(the shell): `pipe.load_ip_adapter` converts the adapter there with diffusers' own code (real
tensors only in the adapter's layers), `set_ip_adapter_scale` writes its processors' scales,
`unload_ip_adapter` takes them out. Before each call that state is bound (`IpAdapterState.sync`):

- attention is linear in its values and `to_v_ip` has no bias, so a processor's scale s is served
  by binding s x its `to_v_ip` weight (the compiled code adds the adapter's attention at scale 1);
- no adapter (none loaded yet, or unloaded) is served by zero `to_v_ip` weights: the adapter's
  attention is then exactly 0 and the UNet computes what it computes without one (x + 0 is x), as
  eager skips an adapter at scale 0.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..errors import UnsupportedCallError, WeightsMismatchError
from ..spec.private_apis import ip_adapter_layers
from .lora import meta_model

PROJECTION = "encoder_hid_proj"  # where diffusers puts the adapters' image projection layers in the UNet
KEYS = ("to_k_ip", "to_v_ip")  # an IP-Adapter processor's weights, one per adapter
_generations = itertools.count(1)


def is_adapter_constant(fqn: str) -> bool:
    """Whether a UNet constant is an IP-Adapter's (not in any base checkpoint of the UNet)."""
    return fqn.startswith(f"{PROJECTION}.") or any(f".processor.{key}." in fqn for key in KEYS)


def adapter_tensors(processors: dict[str, Any], projections: list[Any]) -> dict[str, torch.Tensor]:
    """An adapter's weights by the UNet's names for them (as its state dict has them once loaded)."""
    tensors = {f"{name}.{key}": t for name, processor in processors.items() if hasattr(processor, KEYS[0])
               for key, t in processor.state_dict().items()}
    for i, layer in enumerate(projections):
        tensors |= {f"{PROJECTION}.image_projection_layers.{i}.{key}": t for key, t in layer.state_dict().items()}
    return tensors


def describe(processors: dict[str, Any], projections: list[Any]) -> list[str]:
    """Each adapter's form as a user names it: its image projection, the tokens it makes and the
    width of the image embeddings it takes (the image encoder's)."""
    tokens = next((p.num_tokens for p in processors.values() if hasattr(p, KEYS[0])), [None] * len(projections))
    forms = []
    for layer, count in zip(projections, tokens, strict=True):
        linear = next((m for m in layer.modules() if isinstance(m, torch.nn.Linear)), None)
        width = f" from {linear.in_features}-wide image embeddings" if linear is not None else ""
        forms.append(f"{type(layer).__name__} ({count} image tokens{width})")
    return forms


def loaded_form(unet: torch.nn.Module) -> dict[str, Any] | None:
    """The form of the IP-Adapters loaded into an eager UNet, as a manifest records it (None: none
    loaded): each adapter's description and every adapter constant's shape."""
    projection = getattr(unet, PROJECTION, None)
    layers = list(getattr(projection, "image_projection_layers", None) or [])
    if not layers or not any(hasattr(p, KEYS[0]) for p in unet.attn_processors.values()):
        return None
    processors = unet.attn_processors
    return {"adapters": describe(processors, layers),
            "shapes": {fqn: list(t.shape) for fqn, t in sorted(adapter_tensors(processors, layers).items())}}


class IpAdapterState:
    """The IP-Adapters of one compiled UNet: the shell diffusers' API works on, and the weights
    bound for its state."""

    def __init__(self, component: str, form: dict[str, Any], config: dict[str, Any], dtype: torch.dtype,
                 device: torch.device, base: dict[str, torch.Tensor], rebind: Any) -> None:
        self._config, self._shell = config, None
        self._component, self._form, self._dtype, self._device = component, form, dtype, device
        self._base, self._rebind = base, rebind
        self._tensors: dict[str, torch.Tensor] = {}  # the loaded adapters' constants, as the code reads them
        self._generation = 0  # which load made them
        self._zeros: dict[tuple, torch.Tensor] = {}  # a zero tensor per (shape, strides): no adapter
        self._scaled: dict[str, torch.Tensor] = {}  # a buffer per to_v_ip constant at a scale other than 1
        self._bound_state: tuple | None = ()

    @property
    def shell(self) -> torch.nn.Module:
        """The UNet on the meta device that diffusers' IP-Adapter API works on, made at its first use."""
        if self._shell is None:
            self._shell = meta_model(self._config, self._dtype)
        return self._shell

    @property
    def loaded(self) -> bool:
        return bool(self._tensors)

    def unload(self) -> None:
        """What `unload_ip_adapter` asks first (`unet.encoder_hid_proj = None`): no adapter any more;
        the processors it then sets are the shell's."""
        setattr(self.shell, PROJECTION, None)
        self._tensors, self._scaled = {}, {}

    def load(self, state_dicts: list[dict[str, Any]]) -> None:
        """diffusers' `_load_ip_adapter_weights` on the shell: the adapters converted with its own
        code, checked against the artifact's form, and installed; refused, with nothing changed,
        when their form differs."""
        processors, projections = ip_adapter_layers(self.shell, state_dicts)
        self.install(processors, projections)

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
                f"artifact); nothing was loaded",
                hint="load an IP-Adapter of the artifact's form, or build one for this adapter (a target's ip_adapter)")
        made = {}
        for fqn, tensor in tensors.items():
            base = self._base[fqn]
            made[fqn] = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device=base.device)
            made[fqn].copy_(tensor.detach())
        self.shell.set_attn_processor(processors)
        setattr(self.shell, PROJECTION, MultiIPAdapterImageProjection(projections).to(self._device, self._dtype))
        self.shell.config.encoder_hid_dim_type = "ip_image_proj"
        self._tensors, self._generation = made, next(_generations)
        self._scaled.clear()

    def adopt(self, unet: torch.nn.Module) -> None:
        """The IP-Adapters loaded into an eager UNet (a pipeline given to `apply`), with their scales."""
        if loaded_form(unet) is not None:
            self.install(unet.attn_processors, list(getattr(unet, PROJECTION).image_projection_layers))

    def _scales(self) -> tuple:
        """Each adapter processor's scales, by name: what the call's bound weights follow."""
        scales = []
        for name, processor in self.shell.attn_processors.items():
            if hasattr(processor, KEYS[0]):
                if any(isinstance(s, list) for s in processor.scale):
                    raise UnsupportedCallError(
                        f"{self._component}: an IP-Adapter scale per image ({name}: {processor.scale}) is for "
                        f"IP-Adapter masks, which this artifact does not compile", hint="set one scale per IP-Adapter")
                scales.append((name, tuple(float(s) for s in processor.scale)))
        return tuple(scales)

    def sync(self, kwargs: dict[str, Any]) -> None:
        """Bind the weights the adapters' state asks for, if it changed since the last call; a call
        without image embeddings while an adapter is loaded is refused as the eager UNet refuses it."""
        if self.loaded and (kwargs.get("added_cond_kwargs") or {}).get("image_embeds") is None:
            raise ValueError(f"{self.shell.__class__.__name__} has the config param `encoder_hid_dim_type` set to "
                             f"'ip_image_proj' which requires the keyword argument `image_embeds` to be passed in  "
                             f"`added_conditions`")
        state = (self._generation, self._scales()) if self.loaded else None
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
                    fqn = f"{name}.to_v_ip.{i}.weight"
                    if scale != 1.0:  # scale x attention(q, k, v) is attention(q, k, scale x v)
                        buffer = self._scaled.setdefault(fqn, torch.empty_like(self._tensors[fqn]))
                        bind[fqn] = torch.mul(self._tensors[fqn], scale, out=buffer)
        self._rebind(bind)
        self._bound_state = state

    def _zero_like(self, base: torch.Tensor) -> torch.Tensor:
        key = (tuple(base.shape), base.stride(), base.dtype)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros_like(base)
        return self._zeros[key]


def _adapters(forms: list[str]) -> str:
    return f"{len(forms)} IP-Adapter{'s' if len(forms) > 1 else ''}: " + ", ".join(forms)
