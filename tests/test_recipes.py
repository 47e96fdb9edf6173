"""The int8 recipe (fused QKV + channels_last + int8 dynamic) built, validated and run for real."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import aotbuild
from aotbuild.capture import capture_inputs
from aotbuild.pipelines import pipeline_spec
from aotbuild.runtime import load_components
from aotbuild.targets import ShapeBucket

from .conftest import eager_pipeline, generate

pytestmark = pytest.mark.slow
INT8_IMAGE_ATOL = 0.05  # measured ~0.011 vs eager float32 on [0, 1] images


def test_manifest_records_recipe_and_numerics(built_int8):
    m = built_int8.manifest
    passes = m["optimizations"]["passes"]
    assert passes["quantize"]["recipe"] == "int8_dynamic" and passes["quantize"]["layers"]["unet"] > 0
    assert passes["fuse_qkv"]["enabled"] and passes["channels_last"]["enabled"]
    assert m["optimizations"]["inductor"]["force_fuse_int_mm_with_mul"] is True
    for entry in m["components"].values():
        assert entry["custom_ops"] == []  # torchao's quant ops are decomposed: no torchao at runtime
        for variant in entry["variants"]:
            numerics = variant["numerics"]
            assert numerics["tolerance"] == 0.1 and 0 < numerics["max_rel_error"] <= 0.1
    sample = next(i for i in m["components"]["unet"]["variants"][0]["inputs"] if i["path"] == "args[0]")
    assert sample["stride"] == [4096, 1, 128, 4]  # NHWC: what the compiled UNet expects


def test_weights_are_plain_int8_tensors(built_int8):
    weights = load_file(built_int8.folder / "unet.safetensors")
    int8 = [k for k, v in weights.items() if v.dtype == torch.int8]
    # Each quantized linear the compiled code uses: int8 data (original0) beside its scales (original1).
    # The pass also quantized the q/k/v projections fuse_qkv left unused, which are not stored.
    assert 0 < len(int8) <= built_int8.manifest["optimizations"]["passes"]["quantize"]["layers"]["unet"]
    assert all(k.endswith(".original0") and weights[k.replace(".original0", ".original1")].is_floating_point()
               for k in int8)


def test_int8_pipeline_close_to_eager_float32(built_int8, int8_target):
    bucket = ShapeBucket(1, 64, 64)
    expected = generate(eager_pipeline(int8_target), bucket)
    images = generate(aotbuild.load_pipeline(built_int8.folder), bucket)
    np.testing.assert_allclose(images, expected, atol=INT8_IMAGE_ATOL, rtol=0)


def test_contiguous_and_channels_last_inputs_give_the_same_result(built_int8, int8_target):
    pipe = eager_pipeline(int8_target)
    spec = pipeline_spec(int8_target.pipeline)
    call = capture_inputs(pipe, [spec.component("unet")], batch=1, height=64, width=64, guidance_scale=5.0)["unet"]
    _, modules = load_components(built_int8.folder)
    sample, *rest = call.args
    assert sample.is_contiguous()
    contiguous = modules["unet"](sample, *rest, **call.kwargs)[0]
    nhwc = modules["unet"](sample.contiguous(memory_format=torch.channels_last), *rest, **call.kwargs)[0]
    torch.testing.assert_close(contiguous, nhwc, atol=0, rtol=0)
    scale = call.output.abs().max()
    assert (contiguous - call.output).abs().max() / scale < 0.1
