"""diffusers' step caches (`enable_cache`: First-Block Cache, MagCache, TaylorSeer, ...) on a
compiled denoiser.

They are Python hooks that skip or reuse whole blocks from one step to the next, deciding on
values computed at run time, so no exported graph can hold them. A regional artifact runs
diffusers' own forward in Python around its compiled blocks: the hooks are put on that model tree
as diffusers puts them on the eager one. Each compiled block is of a class named like its eager
block's, with its forward's signature and its entry in diffusers' block registry, so the hooks read
its call and its outputs as they read the eager block's.

A config that hooks modules inside a block (an attention layer: FasterCache, Pyramid Attention
Broadcast) cannot work there: those modules are compiled code. It is refused, as is any cache on a
whole-model artifact (one graph), each naming what does work.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..errors import UnsupportedCallError
from ..spec.private_apis import block_registry
from .lora import meta_model

REGIONAL_HINT = ('build the target with [compile] mode = "regional": its blocks are compiled and diffusers\' '
                 'forward runs around them, where a cache that skips or reuses whole blocks works as in diffusers')


def takes_caches(config: dict[str, Any]) -> bool:
    """Whether the eager model class this config names has diffusers' `enable_cache` (CacheMixin)."""
    import diffusers
    from diffusers.models.cache_utils import CacheMixin

    return issubclass(getattr(diffusers, config["_class_name"]), CacheMixin)


def register_block_class(compiled: type, eager: type) -> None:
    """Give a compiled block class its eager class's entry in diffusers' block registry (which of
    its outputs are the hidden states), read by the block-level caches."""
    import dataclasses

    registry = block_registry()
    with contextlib.suppress(ValueError):  # an eager class no cache knows: nor does its compiled one
        registry.register(compiled, dataclasses.replace(registry.get(eager)))


def enable(component: str, model: torch.nn.Module | None, model_config: dict[str, Any], config: Any) -> None:
    """`enable_cache(config)` on the compiled `component` (of `model_config`): on its regional model
    tree (`model`), exactly where diffusers puts the hooks on the eager model; None (a whole-model
    artifact) and a config hooking inside the blocks are refused, nothing left enabled."""
    kind = type(config).__name__
    if model is None:
        raise UnsupportedCallError(f"{component}.enable_cache({kind}): a step cache skips or reuses blocks between "
                                   f"steps, in Python, and this artifact compiled the whole {component} as one graph",
                                   hint=REGIONAL_HINT)
    replica = meta_model(model_config, torch.float32)
    replica.enable_cache(config)  # what diffusers hooks on the eager model; its own errors, as in eager
    model.enable_cache(config)
    inside = sorted(hooked_modules(replica) - hooked_modules(model))
    if inside:
        model.disable_cache()
        raise UnsupportedCallError(
            f"{component}.enable_cache({kind}): diffusers hooks {len(inside)} modules inside the blocks (e.g. "
            f"{inside[0]}), and this artifact runs each block as compiled code, whole",
            hint="a cache that skips or reuses whole blocks works here: FirstBlockCacheConfig, MagCacheConfig, "
                 "TaylorSeerCacheConfig(use_lite_mode=True); or run this cache on the eager pipeline")


def hooked_modules(model: torch.nn.Module) -> set[str]:
    """Names of the modules under `model` that carry a diffusers hook."""
    return {name for name, module in model.named_modules()
            if getattr(getattr(module, "_diffusers_hook", None), "hooks", None)}


def enabled(model: torch.nn.Module | None) -> bool:
    return model is not None and getattr(model, "_cache_config", None) is not None


def context(model: torch.nn.Module | None, name: str, **where: Any) -> contextlib.AbstractContextManager:
    """diffusers' `cache_context`: which call of the step (cond, uncond) and where the loop is, for
    the hooks' state; nothing to say without a cache."""
    return model.cache_context(name, **where) if enabled(model) else contextlib.nullcontext()
