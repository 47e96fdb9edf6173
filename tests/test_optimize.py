"""Each optimization pass, on the tiny models, for its observable effect; impossible passes are
refused when the target is read, before any model loads."""

from __future__ import annotations

import collections
import dataclasses
import re

import pytest
import torch

from aotbuild.builder.capture import capture_inputs
from aotbuild.builder.capturing import optimize_pipeline
from aotbuild.builder.export import export_variant, inductor_options
from aotbuild.builder.optimize import PASSES, adapt_example_inputs
from aotbuild.builder.targets import load_target
from aotbuild.errors import TargetError
from aotbuild.spec.pipelines import pipeline_spec

from .conftest import TARGETS, eager_pipeline
from .test_targets import GOOD, write_target


def optimized(tiny_target, **changes):
    """A tiny pipeline with the target's passes applied as the builder applies them."""
    target = dataclasses.replace(tiny_target, **changes)
    pipe = eager_pipeline(target)
    spec = pipeline_spec(target.pipeline)
    specs = [spec.component("unet"), spec.component("vae_decoder")]
    modules, records = optimize_pipeline(pipe, specs, target)
    return pipe, modules, records, specs


def op_counts(module, call) -> collections.Counter:
    program = export_variant(module, call.args, call.kwargs)
    return collections.Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")


def test_every_pass_is_documented():
    assert list(PASSES) == ["tf32", "sdpa", "fuse_qkv", "channels_last", "quantize", "prepack"]
    assert all(len(p.doc) > 40 for p in PASSES.values())


def test_dtype_casts_modules_and_keeps_upcast_vae_in_float32(tiny_target):
    _, modules, records, _ = optimized(tiny_target, dtype="bfloat16")
    assert records["dtype"] == {"unet": "bfloat16", "vae_decoder": "bfloat16"}
    assert modules["unet"].conv_in.weight.dtype == torch.bfloat16
    _, modules, records, _ = optimized(tiny_target, dtype="float16")
    assert records["dtype"] == {"unet": "float16", "vae_decoder": "float32"}  # SDXL VAE: force_upcast
    assert modules["vae_decoder"].decoder.conv_out.weight.dtype == torch.float32


def test_bf16_pipeline_feeds_bf16_inputs(tiny_target):
    pipe, _, _, specs = optimized(tiny_target, dtype="bfloat16")
    call = capture_inputs(pipe, specs, batch=1, height=64, width=64, guidance_scale=5.0)["unet"]
    assert call.args[0].dtype == torch.bfloat16 and call.output.dtype == torch.bfloat16


def test_tf32_is_a_recorded_no_op_on_cpu(tiny_target):
    _, _, records, _ = optimized(tiny_target, optimize={"tf32": True})
    assert records["passes"]["tf32"] == {"enabled": False, "reason": "TF32 exists on CUDA only"}


def test_fuse_qkv_leaves_fewer_linears_in_the_exported_graph(tiny_target):
    pipe, _, _, specs = optimized(tiny_target)
    call = capture_inputs(pipe, specs, batch=1, height=64, width=64, guidance_scale=5.0)["unet"]
    before = op_counts(pipe.unet, call)["aten.linear.default"]
    fused, _, records, _ = optimized(tiny_target, optimize={"fuse_qkv": True})
    after = op_counts(fused.unet, call)["aten.linear.default"]
    assert records["passes"]["fuse_qkv"] == {"enabled": True, "components": ["unet", "vae_decoder"]}
    # self-attention q,k,v -> one linear; cross-attention k,v -> one linear
    assert 0 < after < before
    torch.testing.assert_close(fused.unet(*call.args, **call.kwargs)[0], call.output, atol=1e-5, rtol=1e-4)


def tiny_config(config_set: str, part: str) -> dict:
    """A model's config from one of the shipped config sets."""
    import json

    return json.loads((TARGETS / "configs" / config_set / part / "config.json").read_text())


@pytest.mark.parametrize("change, refused", [
    ({}, None),
    ({"qk_norm": "rms_norm"}, "transformer_blocks.0.attn normalizes its queries and keys"),
    ({"dual_attention_layers": [0]}, "transformer_blocks.0.attn2 attends to the image alone (SD3.5 Medium's dual "
                                     "attention)"),
], ids=["sd3", "sd35-qk-norm", "sd35-medium-dual"])
def test_fuse_qkv_is_refused_where_diffusers_fused_sd3_attention_computes_another_thing(change, refused):
    """diffusers' fused SD3 attention skips q/k normalization (SD3.5's qk_norm: the output changes)
    and takes no image-only attention (SD3.5 Medium's attn2: the call fails): such a transformer is
    refused by the pass's check, which runs before the build captures anything; SD3's own is fused
    exactly."""

    import diffusers

    from aotbuild.builder.optimize import check_passes

    config = tiny_config("tiny-sd3", "transformer")
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel.from_config({**config, **change}).eval()
    generator = torch.Generator().manual_seed(1)
    call = {"hidden_states": torch.randn(1, 4, 16, 16, generator=generator),
            "encoder_hidden_states": torch.randn(1, 8, 32, generator=generator),
            "pooled_projections": torch.randn(1, 64, generator=generator), "timestep": torch.tensor([500.0])}
    with torch.no_grad():
        want = model(**call).sample
        if refused is None:
            check_passes({"transformer": model}, {"fuse_qkv": True})
        else:
            with pytest.raises(TargetError, match=re.escape(f"optimize.fuse_qkv: transformer's attention {refused}")):
                check_passes({"transformer": model}, {"fuse_qkv": True})
        check_passes({"transformer": model}, {"fuse_qkv": False})
        model.fuse_qkv_projections()
        try:
            got = model(**call).sample
        except AttributeError:  # the image-only attention: diffusers' fused processor wants a text stream
            assert "dual_attention_layers" in change
            return
    if refused is None:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    else:
        assert (got - want).abs().max() > 1e-3


def test_fuse_qkv_is_refused_where_it_would_replace_another_attention_processor():
    """Fusing puts the fused SD3 processor on every attention: one that runs another (PAG's joint
    attention) would lose it; an SD3 ControlNet of the plain form fuses."""

    import diffusers

    from aotbuild.builder.optimize import check_passes

    config = tiny_config("tiny-sd3", "transformer")
    model = diffusers.SD3Transformer2DModel.from_config(config)
    model.set_attn_processor(diffusers.models.attention_processor.PAGJointAttnProcessor2_0())
    with pytest.raises(TargetError, match="transformer_blocks.0.attn runs PAGJointAttnProcessor2_0, which fusing "
                                          "would replace"):
        check_passes({"transformer": model}, {"fuse_qkv": True})
    controlnet = tiny_config("tiny-sd3-controlnet", "controlnet")
    check_passes({"controlnet": diffusers.SD3ControlNetModel.from_config(controlnet)}, {"fuse_qkv": True})


def test_a_build_refuses_fuse_qkv_on_sd35_before_it_captures(tmp_path):
    """The build checks the passes against the loaded models before its float32 reference (minutes
    at real size): nothing is captured, nothing is left in the artifacts folder."""
    import json
    import shutil

    from aotbuild.builder import build

    configs = tmp_path / "tiny-sd35"
    shutil.copytree(TARGETS / "configs" / "tiny-sd3", configs)
    transformer = configs / "transformer" / "config.json"
    transformer.write_text(json.dumps({**json.loads(transformer.read_text()), "qk_norm": "rms_norm"}))
    target = dataclasses.replace(load_target(TARGETS / "cpu-tiny-sd3.toml"), name="tiny-sd35",
                                 source=f"random:{configs}", optimize={"fuse_qkv": True})
    stages = []
    with pytest.raises(TargetError, match=re.escape("optimize.fuse_qkv: transformer's attention "
                                                    "transformer_blocks.0.attn normalizes its queries and keys")):
        build(target, tmp_path / "artifacts", progress=lambda stage, message: stages.append(stage))
    assert "load" in stages and "capture" not in stages
    assert not any((tmp_path / "artifacts").glob("*/manifest.json"))


def test_channels_last_changes_weights_and_example_inputs(tiny_target):
    _, modules, records, _ = optimized(tiny_target, optimize={"channels_last": True})
    weight = modules["unet"].conv_in.weight
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
    sample = torch.randn(2, 4, 32, 32)
    args, _ = adapt_example_inputs({"channels_last": True}, ((sample, torch.tensor(1.0)), {}))
    assert args[0].is_contiguous(memory_format=torch.channels_last) and args[1].ndim == 0


def test_int8_dynamic_stores_plain_int8_tensors(tiny_target):
    pipe, modules, records, specs = optimized(tiny_target, optimize={"quantize": "int8_dynamic"})
    assert records["passes"]["quantize"]["layers"]["unet"] > 0
    state = modules["unet"].state_dict()
    int8 = {k: v for k, v in state.items() if v.dtype == torch.int8}
    assert int8 and all(type(v) is torch.Tensor for v in state.values())
    assert all("parametrizations" in k for k in int8)
    assert inductor_options({}, {"force_fuse_int_mm_with_mul": True})["force_fuse_int_mm_with_mul"] is True


def test_inductor_profile_expands_and_explicit_keys_win():
    options = inductor_options({"profile": "max-autotune", "epilogue_fusion": True})
    assert options["max_autotune"] is True and options["conv_1x1_as_mm"] is True
    assert options["epilogue_fusion"] is True
    assert options["aot_inductor.package_constants_in_so"] is False


@pytest.mark.parametrize(("extra", "message"), [
    ('[optimize]\nquantize = "float8_dynamic"\n', r"'float8_dynamic' needs CUDA compute capability >= 8.9"),
    ('[optimize]\nquantize = "int4_weight_only"\n', r"'int4_weight_only' needs CUDA"),
    ('[optimize]\nquantize = "int2"\n', r"known recipes: int8_dynamic, int8_weight_only"),
    ('[optimize]\nsdpa = "cudnn"\n', r"optimize.sdpa = 'cudnn' needs CUDA"),
    ('[inductor]\nprofile = "fastest"\n', r"'inductor.profile' is 'fastest'; allowed: default, max-autotune"),
])
def test_impossible_pass_is_refused_before_loading(tmp_path, extra, message):
    with pytest.raises(TargetError, match=message):
        load_target(write_target(tmp_path, GOOD + extra))


def test_fp8_on_an_a100_target_is_refused(tmp_path):
    text = (TARGETS / "h100-sdxl-fp8.toml").read_text().replace('"9.0"', '"8.0"')
    with pytest.raises(TargetError, match=r"needs CUDA compute capability >= 8.9.*target has 8.0"):
        load_target(write_target(tmp_path, text, name="h100-sdxl-fp8"))


def test_full_recipes_parse():
    for name in ("h100-sdxl", "a100-sdxl"):
        target = load_target(TARGETS / f"{name}.toml")
        assert target.dtype == "bfloat16" and target.optimize["quantize"] == "int8_dynamic"
        assert target.optimize["fuse_qkv"] is True and target.inductor["profile"] == "max-autotune"
    assert load_target(TARGETS / "h100-sdxl-fp8.toml").optimize["quantize"] == "float8_dynamic"


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only pass: this machine has no CUDA device")


@CUDA
def test_tf32_enables_tf32_on_cuda(tiny_target):
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        _, _, records, _ = optimized(tiny_target, device="cuda", optimize={"tf32": True})
        assert records["passes"]["tf32"] == {"enabled": True}
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@CUDA
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 needs compute capability >= 8.9")
def test_float8_dynamic_stores_float8_weights_on_cuda(tiny_target):
    pipe = eager_pipeline(tiny_target).to("cuda")
    spec = pipeline_spec(tiny_target.pipeline)
    target = dataclasses.replace(tiny_target, device="cuda", dtype="bfloat16", optimize={"quantize": "float8_dynamic"})
    modules, records = optimize_pipeline(pipe, [spec.component("unet")], target)
    assert records["passes"]["quantize"]["layers"]["unet"] > 0
    assert any(v.dtype == torch.float8_e4m3fn for v in modules["unet"].state_dict().values())
