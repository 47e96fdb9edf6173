"""diffusers' step caches (`enable_cache`) on compiled denoisers. On a regional artifact the hooks
sit where diffusers puts them on the eager model, around the compiled blocks: the same config and
seeds skip the same block calls and make the same images as eager diffusers, a second call starts
afresh, and disabling returns the uncached image bit for bit. Caches that hook inside the blocks,
whole-model artifacts and UNets refuse in the user's terms."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    SeaCacheConfig,
    TaylorSeerCacheConfig,
    TextKVCacheConfig,
)

import aotbuild
from aotbuild.builder import regions
from aotbuild.builder.targets import load_target
from aotbuild.errors import UnsupportedCallError

from .conftest import TARGETS, build_once, eager_pipeline, make_lora

ATOL = 1e-4  # images in [0, 1]; float32 compiled vs eager measured < 1e-6 uncached, ~4e-6 with TaylorSeer
STEPS = 8
PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """target name -> (target, compiled pipeline, eager pipeline), loaded once each."""
    loaded = {}

    def get(name):
        if name not in loaded:
            target = load_target(TARGETS / f"{name}.toml")
            built = build_once(tmp_path_factory, target)
            loaded[name] = target, aotbuild.load_pipeline(built.folder), eager_pipeline(target)
        return loaded[name]

    return get


def run(pipe, target, **call):
    bucket = target.shapes[0]
    size = {"height": bucket.height, "width": bucket.width, **({"num_frames": bucket.frames} if bucket.frames else {})}
    out = pipe(prompt=PROMPT, num_inference_steps=STEPS, output_type="np", generator=torch.Generator().manual_seed(0),
               **size, **call)
    return np.asarray(out.frames if hasattr(out, "frames") else out.images)


@contextlib.contextmanager
def counted_blocks(pipe):
    """Counts the calls that reach the denoiser's blocks' own code (compiled or eager), under
    whatever hooks a cache puts around them (set before the cache, so they wrap this)."""
    denoiser = pipe.transformer
    model = denoiser.regional[0].model if hasattr(denoiser, "regional") else denoiser
    counter = {"calls": 0}
    blocks = regions.block_instances(model, "transformer").values()
    for block in blocks:
        def forward(*args, _forward=block.forward, **kwargs):
            counter["calls"] += 1
            return _forward(*args, **kwargs)
        block.forward = forward
    try:
        yield counter
    finally:
        for block in blocks:
            del block.forward


CACHES = {  # id -> (regional target, config maker, call)
    "first-block": ("cpu-tiny-flux-regional", lambda: FirstBlockCacheConfig(threshold=0.4), {}),
    "first-block-true-cfg": ("cpu-tiny-flux-regional", lambda: FirstBlockCacheConfig(threshold=0.4),
                             {"negative_prompt": "blurry", "true_cfg_scale": 4.0}),
    # Magnitude ratios of 1: the accumulated error stays 0, so every step the config allows is skipped.
    "mag": ("cpu-tiny-flux-regional", lambda: MagCacheConfig(mag_ratios=[1.0] * STEPS, num_inference_steps=STEPS,
                                                             max_skip_steps=2), {}),
    "taylorseer-lite": ("cpu-tiny-flux-regional", lambda: TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=1, use_lite_mode=True), {}),
    "first-block-wan": ("cpu-tiny-wan-regional", lambda: FirstBlockCacheConfig(threshold=0.15), {}),  # guided: CFG
    # Wan's pipeline says where the loop is (step, sigma), which SeaCache needs (Flux's does not).
    "sea-wan": ("cpu-tiny-wan-regional", lambda: SeaCacheConfig(), {}),
    # Text K/V reuse skips no block: it must only change nothing that eager does not.
    "text-kv-wan": ("cpu-tiny-wan-regional", lambda: TextKVCacheConfig(), {}),
}
SKIPS_NO_BLOCK = {"text-kv-wan"}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CACHES))
def test_a_cache_skips_what_eager_skips_and_makes_its_images(pipelines, case):
    name, config, call = CACHES[case]
    target, compiled, eager = pipelines(name)
    with counted_blocks(compiled) as every:
        uncached = run(compiled, target, **call)
    with counted_blocks(compiled) as compiled_blocks, counted_blocks(eager) as eager_blocks:
        for pipe in (compiled, eager):
            pipe.transformer.enable_cache(config())
        assert compiled.transformer.is_cache_enabled
        try:
            cached, want = run(compiled, target, **call), run(eager, target, **call)
            again = run(compiled, target, **call)  # the pipeline resets the cache's state as a call ends
        finally:
            for pipe in (compiled, eager):
                pipe.transformer.disable_cache()
    np.testing.assert_allclose(cached, want, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(again, cached)
    assert compiled_blocks["calls"] == 2 * eager_blocks["calls"]  # compiled: two calls, eager: one
    if case in SKIPS_NO_BLOCK:
        assert eager_blocks["calls"] == every["calls"]
    else:
        assert eager_blocks["calls"] < every["calls"]  # the cache really skipped blocks
        assert np.abs(cached - uncached).max() > 1e-3
    assert not compiled.transformer.is_cache_enabled
    np.testing.assert_array_equal(run(compiled, target, **call), uncached)


@pytest.mark.slow
def test_a_cache_with_a_lora(pipelines, tmp_path):
    target, compiled, eager = pipelines("cpu-tiny-flux-regional")
    lora = make_lora(eager, tmp_path, seed=1)
    for pipe in (eager, compiled):
        pipe.load_lora_weights(lora, adapter_name="style")
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.4))
    try:
        np.testing.assert_allclose(run(compiled, target), run(eager, target), atol=ATOL, rtol=0)
    finally:
        for pipe in (eager, compiled):
            pipe.transformer.disable_cache()
            pipe.unload_lora_weights()


@pytest.mark.slow
def test_a_cache_on_another_checkpoints_weights(tmp_path_factory):
    """A fine-tune's weights bound into the regional artifact (`apply`): the cache decides on that
    checkpoint's values, as on its eager pipeline."""
    target = load_target(TARGETS / "cpu-tiny-flux-regional.toml")
    built = build_once(tmp_path_factory, target)
    finetune, compiled = eager_pipeline(target, seed=7), eager_pipeline(target, seed=7)
    aotbuild.apply(compiled, built.folder)
    with counted_blocks(compiled) as compiled_blocks, counted_blocks(finetune) as eager_blocks:
        for pipe in (finetune, compiled):
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.4))
        np.testing.assert_allclose(run(compiled, target), run(finetune, target), atol=ATOL, rtol=0)
    assert hasattr(compiled.transformer, "regional")
    blocks = len(compiled.transformer.regional[0].blocks)
    assert compiled_blocks["calls"] == eager_blocks["calls"] < blocks * STEPS  # skipped as the fine-tune's eager


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2, current_timestep_callback=lambda: 500),
    FasterCacheConfig(spatial_attention_block_skip_range=2, current_timestep_callback=lambda: 500),
    TaylorSeerCacheConfig(cache_interval=2),  # its default hooks the attention layers
], ids=lambda c: type(c).__name__)
def test_a_cache_hooking_inside_the_blocks_is_refused_and_leaves_nothing_on(pipelines, config):
    target, compiled, _ = pipelines("cpu-tiny-flux-regional")
    uncached = run(compiled, target)
    with pytest.raises(UnsupportedCallError, match=rf"transformer.enable_cache\({type(config).__name__}\): diffusers "
                                                   r"hooks \d+ modules inside the blocks \(e.g. \w+\.0\.attn\), and "
                                                   r"this artifact runs each block as compiled code") as caught:
        compiled.transformer.enable_cache(config)
    assert "FirstBlockCacheConfig" in caught.value.hint
    assert not compiled.transformer.is_cache_enabled
    np.testing.assert_array_equal(run(compiled, target), uncached)


@pytest.mark.slow
def test_whole_model_artifacts_and_unets_refuse_in_their_terms(pipelines):
    _, flux, _ = pipelines("cpu-tiny-flux")
    with pytest.raises(UnsupportedCallError, match=r"compiled the whole transformer as one graph") as caught:
        flux.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    assert 'mode = "regional"' in caught.value.hint and not flux.transformer.is_cache_enabled
    flux.transformer.disable_cache()  # nothing on: nothing to do, as in diffusers
    _, sdxl, eager = pipelines("cpu-tiny-sdxl")
    assert not hasattr(eager.unet, "enable_cache")
    with pytest.raises(AttributeError, match=r"unet \(UNet2DConditionModel\) has no enable_cache, eager or compiled"):
        sdxl.unet.enable_cache(FirstBlockCacheConfig(threshold=0.2))
