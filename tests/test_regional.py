"""Regional AOT: each repeated block compiled once and bound to every instance's own weights, the
code between blocks eager. Regional artifacts of every tiny pipeline against eager diffusers with the
same seeds, at every bucket and (SDXL's, FLUX.2 [klein]'s) the dynamic range's corners; weights
swapped between two blocks; LoRAs; and the refusals."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import aotbuild
from aotbuild.builder import regions
from aotbuild.builder.targets import Target, load_target
from aotbuild.errors import AotbuildError, TargetError

from .conftest import ROOT, TARGETS, build_once, eager_pipeline, make_lora

ATOL = 1e-4  # images in [0, 1]; float32 regional vs eager measured ~2e-6
PROMPT = "a red fox in the snow"
REGIONAL = {  # target -> (its whole-model sibling, the blocks its denoiser has, regions expected)
    "cpu-tiny-sdxl-regional": ("cpu-tiny-sdxl", 4, 1),
    "cpu-tiny-sd3-regional": ("cpu-tiny-sd3", 2, 2),  # the last joint block drops the text stream's output
    "cpu-tiny-flux-regional": ("cpu-tiny-flux", 2, 2),  # one double-stream, one single-stream block
    "cpu-tiny-flux2-klein-regional": ("cpu-tiny-flux2-klein", 2, 2),  # built by capture: no aotbuild entry
}


def run(pipe, **call):
    call = {"num_inference_steps": 2, "output_type": "np", **call}
    return pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), **call).images  # Klein: image first


def denoiser(pipe):
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


@pytest.fixture(scope="module", params=list(REGIONAL))
def regional(request, tmp_path_factory):
    """(target, build, compiled pipeline, eager pipeline) of one regional target."""
    target = load_target(TARGETS / f"{request.param}.toml")
    built = build_once(tmp_path_factory, target)
    return target, built, aotbuild.load_pipeline(built.folder), eager_pipeline(target)


@pytest.mark.slow
def test_every_bucket_and_the_dynamic_range_match_eager(regional):
    target, built, compiled, eager = regional
    manifest = built.manifest
    entry = manifest["components"][target.components[0]]
    assert manifest["schema"] == 4 and entry["mode"] == "regional"
    instances = [fqn for region in entry["regions"] for fqn in region["instances"]]
    model = denoiser(eager)
    assert sorted(instances) == sorted(regions.block_instances(model, target.components[0]))
    _, blocks, expected_regions = REGIONAL[target.name]
    if blocks is not None:
        assert (len(instances), len(entry["regions"])) == (blocks, expected_regions)
    for variant in entry["variants"]:  # the build checked each variant at every point it serves
        assert 0 < variant["numerics"]["max_rel_error"] < 2e-5, variant["name"]  # float32: rounding alone
    # A size off the range's corners; diffusers' SD pipelines also want multiples of 8 px.
    bucket, dynamic, stride = target.shapes[0], target.dynamic, math.lcm(target.stride, 16)
    calls = {"b2_64x64": [dict(num_images_per_prompt=bucket.batch), dict(num_images_per_prompt=1)]}
    if dynamic:  # SDXL's and FLUX.2 [klein]'s: one UNet and one double/single-stream transformer, by capture
        calls["dynamic"] = [dict(height=dynamic["height"][1], width=dynamic["width"][1],
                                 num_images_per_prompt=dynamic["batch"][1]),
                            dict(height=dynamic["height"][0], width=dynamic["width"][0] + stride,
                                 num_images_per_prompt=1)]
    if target.pipeline != "FluxPipeline":  # guidance off halves the denoiser's batch
        calls["b2_64x64"].append(dict(num_images_per_prompt=bucket.batch, guidance_scale=1.0))
    for variant, variant_calls in calls.items():
        for call in variant_calls:
            call = {"height": bucket.height, "width": bucket.width, **call}
            np.testing.assert_allclose(run(compiled, **call), run(eager, **call), atol=ATOL, rtol=0, err_msg=str(call))
            assert denoiser(compiled).last_variant == variant
    with pytest.raises(AotbuildError, match="no compiled variant for this call"):
        run(compiled, height=bucket.height, width=bucket.width,
            num_images_per_prompt=(dynamic["batch"][1] if dynamic else bucket.batch) + 1)


@pytest.mark.slow
def test_a_user_pipeline_takes_the_regional_model_with_its_own_schedulers_and_img2img(regional):
    """aotbuild.apply on a pipeline the user made, then calls the user makes: another scheduler,
    img2img through from_pipe (its VAE eager, the denoiser regional)."""
    import diffusers

    target, built, _, eager = regional
    if target.pipeline != "StableDiffusionXLPipeline":
        pytest.skip("one family is enough for the pipeline-level calls; the others are checked above")
    mine = aotbuild.apply(copy.deepcopy(eager), built.folder)
    for pipe in (mine, eager):
        pipe.scheduler = diffusers.DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    np.testing.assert_allclose(run(mine, height=64, width=64), run(eager, height=64, width=64), atol=ATOL, rtol=0)
    image = run(eager, height=64, width=64, num_images_per_prompt=1, output_type="pil")[0]
    got, want = (run(diffusers.StableDiffusionXLImg2ImgPipeline.from_pipe(p), image=image, strength=0.6,
                     num_inference_steps=4) for p in (mine, eager))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_each_block_binds_its_own_weights(tmp_path_factory):
    """Two blocks of one region swap weights in the eager pipeline: the regional artifact applied to
    that pipeline gives what eager gives, and not the unswapped image."""
    target = load_target(TARGETS / "cpu-tiny-sdxl-regional.toml")
    built = build_once(tmp_path_factory, target)
    region = built.manifest["components"]["unet"]["regions"][0]
    first, last = region["instances"][0], region["instances"][-1]
    eager = eager_pipeline(target)
    before = run(eager, height=64, width=64)
    a, b = eager.unet.get_submodule(first), eager.unet.get_submodule(last)
    state_a = copy.deepcopy(a.state_dict())
    a.load_state_dict(b.state_dict())
    b.load_state_dict(state_a)
    want = run(eager, height=64, width=64)
    assert np.abs(want - before).max() > 1e-2  # the swap changes the image
    got = run(aotbuild.apply(copy.deepcopy(eager), built.folder), height=64, width=64)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu-tiny-sdxl-regional", "cpu-tiny-flux-regional"])
def test_lora_on_a_regional_artifact_matches_eager(tmp_path_factory, tmp_path, name):
    """A LoRA on attention projections (in the blocks) and, on the UNet, the transformers' proj_in and
    proj_out (the eager code between blocks): loaded, scaled, unloaded, as on eager."""
    target = load_target(TARGETS / f"{name}.toml")
    built = build_once(tmp_path_factory, target)
    eager, compiled = eager_pipeline(target), aotbuild.load_pipeline(built.folder)
    targets = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out") if hasattr(eager, "unet") else None
    lora = make_lora(eager, tmp_path, seed=1, targets=targets)
    base = run(compiled, height=64, width=64)
    kwargs = "cross_attention_kwargs" if hasattr(eager, "unet") else "joint_attention_kwargs"
    for pipe in (eager, compiled):
        pipe.load_lora_weights(lora, adapter_name="style")
    for scale in (1.0, 0.5):
        want = run(eager, height=64, width=64, **{kwargs: {"scale": scale}})
        np.testing.assert_allclose(run(compiled, height=64, width=64, **{kwargs: {"scale": scale}}), want,
                                   atol=ATOL, rtol=0)
    assert np.abs(want - base).max() > 1e-3
    compiled.unload_lora_weights()
    np.testing.assert_array_equal(run(compiled, height=64, width=64), base)  # merged from the base, bit-exact


@pytest.mark.slow
def test_inspect_shows_the_regions(tmp_path_factory):
    built = build_once(tmp_path_factory, load_target(TARGETS / "cpu-tiny-flux-regional.toml"))
    result = subprocess.run([sys.executable, "-m", "aotbuild.cli", "inspect", str(built.folder)], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "regional: 2 blocks in 2 regions, each compiled once per variant" in result.stdout
    assert "r0_FluxTransformerBlock" in result.stdout and "r1_FluxSingleTransformerBlock" in result.stdout
    manifest = json.loads((built.folder / "manifest.json").read_text())
    assert manifest["components"]["transformer"]["eager"]["parameters"] > 0


def test_blocks_are_grouped_by_what_their_code_depends_on():
    """The real tiny pipelines' blocks, recorded in a real call: SD3's last joint block (no text
    output) is its own region, SDXL's four blocks of one width and level share one."""
    counts = {}
    for name in ("cpu-tiny-sdxl", "cpu-tiny-sd3"):
        target = load_target(TARGETS / f"{name}.toml")
        pipe = eager_pipeline(target)
        model = denoiser(pipe)
        instances = regions.block_instances(model, name)
        with regions.recording(instances) as calls, torch.no_grad():
            pipe(PROMPT, num_inference_steps=1, height=64, width=64, output_type="np")
        found = regions.group(instances, {"point": calls})
        assert len(calls.calls) == len(found)  # one recorded example per distinct block call, not per block
        counts[name] = [len(r.instances) for r in found]
    assert counts == {"cpu-tiny-sdxl": [4], "cpu-tiny-sd3": [1, 1]}


def test_a_block_setting_without_its_own_tensor_splits_regions():
    """Two attention blocks of equal weight shapes and different head counts compute differently: the
    fingerprint tells them apart, so they never share compiled code."""
    from diffusers.models.attention import BasicTransformerBlock

    a = BasicTransformerBlock(32, num_attention_heads=2, attention_head_dim=16)
    b = BasicTransformerBlock(32, num_attention_heads=4, attention_head_dim=8)
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]
    assert regions.fingerprint(a) != regions.fingerprint(b)
    assert regions.fingerprint(a) == regions.fingerprint(BasicTransformerBlock(32, num_attention_heads=2,
                                                                               attention_head_dim=16))


def test_compile_mode_is_read_and_refused_where_it_cannot_apply(tmp_path):
    base = load_target(TARGETS / "cpu-tiny-sdxl.toml").to_dict()
    assert "compile_mode" not in base  # whole-model targets keep the hashes they had
    regional = Target.from_dict({**base, "compile_mode": "regional"}, base_dir=TARGETS)
    assert regional.compile_mode == "regional" and regional.to_dict()["compile_mode"] == "regional"
    assert regional.content_hash() != load_target(TARGETS / "cpu-tiny-sdxl.toml").content_hash()
    with pytest.raises(TargetError, match="'compile.mode' is 'pieces'; allowed: whole, regional"):
        Target.from_dict({**base, "compile_mode": "pieces"}, base_dir=TARGETS)
    with pytest.raises(TargetError, match="does not combine with optimize.quantize"):
        Target.from_dict({**base, "compile_mode": "regional", "optimize": {"quantize": "int8_dynamic"}},
                         base_dir=TARGETS)
    with pytest.raises(TargetError, match=r"\[components\] has no denoiser \(unet\)"):
        Target.from_dict({**base, "compile_mode": "regional", "components": ["vae_decoder"]}, base_dir=TARGETS)
    text = (TARGETS / "cpu-tiny-sdxl.toml").read_text().replace('name = "cpu-tiny-sdxl"', 'name = "t"')
    (tmp_path / "t.toml").write_text(text + '\n[compile]\nmode = "regional"\nlevel = 2\n')
    (tmp_path / "configs").symlink_to(TARGETS / "configs")
    with pytest.raises(TargetError, match="unknown key 'compile.level'; allowed: mode"):
        load_target(tmp_path / "t.toml")


def test_the_bench_compares_a_whole_target_with_its_regional_build():
    from aotbuild.benchmarking.harness import regional_target

    target = regional_target(load_target(TARGETS / "cpu-deep-flux.toml"))
    assert (target.name, target.compile_mode) == ("cpu-deep-flux-regional", "regional")
    with pytest.raises(AotbuildError, match="is regional already"):
        regional_target(target)
    with pytest.raises(TargetError, match="does not combine with optimize.quantize"):
        regional_target(load_target(TARGETS / "cpu-tiny-sdxl-int8.toml"))


@pytest.mark.slow
def test_a_regional_artifact_travels_through_the_hub(monkeypatch, tmp_path_factory):
    """Pushed as one variant, resolved for this machine, loaded from hf://: the same image."""
    from aotbuild.runtime.hub import push

    from .hubserver import FakeHub

    built = build_once(tmp_path_factory, load_target(TARGETS / "cpu-tiny-flux-regional.toml"))
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", "hf_aotbuildRegionalTestToken")
        push(built.folder, "aotbuild-test/regional")
        pulled = aotbuild.load_pipeline("hf://aotbuild-test/regional", trust_remote_code=True)
    assert type(denoiser(pulled)).__name__ == "RegionalComponent"
    np.testing.assert_array_equal(run(pulled, height=64, width=64),
                                  run(aotbuild.load_pipeline(built.folder), height=64, width=64))
