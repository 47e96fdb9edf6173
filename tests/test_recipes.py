"""The int8 recipe (fused QKV + channels_last + int8 dynamic) built, validated and run for real."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import aotbuild
from aotbuild.builder.capture import capture_inputs
from aotbuild.builder.targets import ShapeBucket
from aotbuild.runtime import load_components
from aotbuild.spec.pipelines import pipeline_spec

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
            # int8 measured ~8e-3 (UNet) and ~2e-4 (VAE, float32 convolutions): well inside the recipe's 0.1
            assert numerics["tolerance"] == 0.1 and 0 < numerics["max_rel_error"] < 0.03
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


def test_lora_on_fused_qkv_channels_last_int8(built_int8, int8_target, tmp_path):
    """A LoRA on q/k/v (fused rows), the output projection and the resnets' convolutions (NHWC
    strides) of the int8 recipe: touched rows are dequantized, merged and quantized again, the
    others stay the build's bit for bit; compared with eager float32 running the same LoRA."""
    from aotbuild.spec.recipes import dequantize_int8, int8_per_row

    from .conftest import make_lora

    targets = ("to_q", "to_v", "to_out.0", "conv1")
    lora_a = make_lora(eager_pipeline(int8_target), tmp_path / "A", seed=1, targets=targets)
    lora_b = make_lora(eager_pipeline(int8_target), tmp_path / "B", seed=2, targets=targets)
    bucket = ShapeBucket(1, 64, 64)
    eager = eager_pipeline(int8_target)
    eager.load_lora_weights(lora_a, adapter_name="A")
    compiled = aotbuild.load_pipeline(built_int8.folder)
    base = generate(compiled, bucket)
    compiled.load_lora_weights(lora_a, adapter_name="A")
    with_a = generate(compiled, bucket)
    np.testing.assert_allclose(with_a, generate(eager, bucket), atol=INT8_IMAGE_ATOL, rtol=0)
    assert np.abs(with_a - base).max() > 2 * INT8_IMAGE_ATOL  # the LoRA is there, beyond int8 noise

    unet = compiled.unet
    fused = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_qkv.parametrizations.weight.original"
    data, scale = unet._lora._buffers[fused + "0"], unet._lora._buffers[fused + "1"]
    base_data, base_scale = unet.weights[fused + "0"], unet.weights[fused + "1"]
    width = base_data.shape[0] // 3
    assert torch.equal(data[width:2 * width], base_data[width:2 * width])  # to_k rows: untouched
    assert torch.equal(scale[width:2 * width], base_scale[width:2 * width])
    layer = unet.lora_shell.get_submodule("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
    expected = int8_per_row(dequantize_int8(base_data[:width], base_scale[:width], torch.float32)
                            + layer.get_delta_weight("A"))
    assert torch.equal(data[:width], expected[0]) and torch.equal(scale[:width], expected[1])
    conv = "down_blocks.0.resnets.0.conv1.weight"
    assert conv in unet._lora._merged and unet._lora._buffers[conv].stride() == unet.weights[conv].stride()

    compiled.load_lora_weights(lora_b, adapter_name="B")
    compiled.set_adapters("B")
    assert not np.array_equal(generate(compiled, bucket), with_a)
    compiled.set_adapters("A")
    assert np.array_equal(generate(compiled, bucket), with_a)  # A -> B -> A: bit for bit
    compiled.unload_lora_weights()
    assert np.array_equal(generate(compiled, bucket), base)


def test_other_weights_are_quantized_as_the_build_did(built_int8, int8_target):
    """apply() on another seed's float32 pipeline: fused, laid out NHWC and quantized at load the
    way the build quantizes; the same images as building from those weights would give."""
    from aotbuild.builder.capturing import optimize_pipeline
    from aotbuild.runtime.checkpoint import module_tensors

    finetuned = eager_pipeline(int8_target, seed=5)
    expected = generate(finetuned, ShapeBucket(1, 64, 64))
    aotbuild.apply(finetuned, built_int8.folder)
    np.testing.assert_allclose(generate(finetuned, ShapeBucket(1, 64, 64)), expected, atol=INT8_IMAGE_ATOL, rtol=0)
    built_way = eager_pipeline(int8_target, seed=5)  # through the build's own passes (torchao)
    modules, _ = optimize_pipeline(built_way, [pipeline_spec(int8_target.pipeline).component("unet")], int8_target)
    reference = module_tensors(modules["unet"])
    assert len(finetuned.unet.weights) > 100
    for fqn, tensor in finetuned.unet.weights.items():
        assert torch.equal(tensor, reference[fqn]), fqn
