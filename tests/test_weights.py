"""Weights are data: other checkpoints and diffusers' LoRA API on a compiled pipeline, compared with
the eager pipeline given the same weights and calls (tiny SDXL, float32 recipe)."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest
import torch

import aotbuild
from aotbuild.builder.targets import ShapeBucket
from aotbuild.errors import AotbuildError, IncompatibleArtifactError, SourceError

from .conftest import eager_pipeline, generate, make_lora

pytestmark = pytest.mark.slow
BUCKET = ShapeBucket(1, 64, 64)
ATOL = 1e-4  # float32 recipe: compiled vs eager measured ~3e-6 on [0, 1] images, with or without LoRAs


@pytest.fixture(scope="module")
def loras(tmp_path_factory, tiny_target):
    folder = tmp_path_factory.mktemp("loras")
    pipe = eager_pipeline(tiny_target)
    return {"A": make_lora(pipe, folder / "A", seed=1), "A2": make_lora(pipe, folder / "A2", seed=3),
            "B": make_lora(pipe, folder / "B", seed=2, rank=8, alpha=4)}


def _both(compiled, eager, action):
    action(compiled)
    action(eager)
    return generate(compiled, BUCKET), generate(eager, BUCKET)


def test_diffusers_lora_api_on_a_compiled_pipeline_matches_eager(built, tiny_target, loras):
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(tiny_target)
    base = generate(compiled, BUCKET)

    def load(pipe):
        pipe.load_lora_weights(loras["A"], adapter_name="A")
        pipe.load_lora_weights(loras["B"], adapter_name="B")
        pipe.set_adapters(["A", "B"], adapter_weights=[0.7, 0.4])

    got, want = _both(compiled, eager, load)
    assert np.abs(want - base).max() > 0.05  # the LoRAs change the image
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert compiled.get_list_adapters() == eager.get_list_adapters() == {"unet": ["A", "B"]}
    assert compiled.get_active_adapters() == ["A", "B"]

    only_a, want = _both(compiled, eager, lambda p: p.set_adapters("A"))
    np.testing.assert_allclose(only_a, want, atol=ATOL, rtol=0)
    compiled.set_adapters("B")
    generate(compiled, BUCKET)
    compiled.set_adapters("A")
    assert np.array_equal(generate(compiled, BUCKET), only_a)  # A -> B -> A: bit for bit

    def scaled(pipe):
        return pipe("a red fox in the snow", num_inference_steps=2, height=64, width=64, guidance_scale=5.0,
                    output_type="np", cross_attention_kwargs={"scale": 0.3},
                    generator=torch.Generator("cpu").manual_seed(0)).images

    np.testing.assert_allclose(scaled(compiled), scaled(eager), atol=ATOL, rtol=0)
    assert np.array_equal(generate(compiled, BUCKET), only_a)  # the per-call scale did not stick

    disabled, _ = _both(compiled, eager, lambda p: p.disable_lora())
    assert np.array_equal(disabled, base)
    got, want = _both(compiled, eager, lambda p: (p.enable_lora(), p.fuse_lora(lora_scale=0.8)))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    got, want = _both(compiled, eager, lambda p: p.unfuse_lora(components=["unet"]))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    got, want = _both(compiled, eager, lambda p: p.delete_adapters("B"))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    compiled.unload_lora_weights()
    assert np.array_equal(generate(compiled, BUCKET), base)  # base -> LoRAs -> base: bit for bit
    assert compiled.get_list_adapters() == {}


def test_merges_touch_only_what_a_lora_touches(built, loras):
    pipe = aotbuild.load_pipeline(built.folder)
    unet = pipe.unet
    base = dict(unet.weights)
    pipe.load_lora_weights(loras["A"], adapter_name="A")
    unet.update_weights()
    merged = unet._lora._merged
    assert merged and all(".to_q." in f or ".to_k." in f or ".to_v." in f or ".to_out.0." in f for f in merged)
    assert all(unet.weights[f] is base[f] for f in base)  # the base is kept once, never written
    buffers = {f: unet._lora._buffers[f].data_ptr() for f in merged}
    pipe.load_lora_weights(loras["B"], adapter_name="B")
    pipe.set_adapters("B")
    unet.update_weights()
    assert {f: unet._lora._buffers[f].data_ptr() for f in merged} == buffers  # switched in place, no new copy


def test_lora_in_kohya_format_through_diffusers_converters(built, tiny_target, loras, tmp_path):
    from safetensors.torch import load_file, save_file

    peft_format = load_file(loras["B"])  # rank 8, alpha 4: kohya stores the alpha per module
    kohya = {}
    for key, value in peft_format.items():
        module = key.removeprefix("unet.").rsplit(".lora_", 1)[0].replace(".", "_")
        kind = "lora_down" if ".lora_A." in key else "lora_up"
        kohya[f"lora_unet_{module}.{kind}.weight"] = value
        kohya[f"lora_unet_{module}.alpha"] = torch.tensor(4.0)
    save_file(kohya, tmp_path / "kohya.safetensors")
    got, want = _both(aotbuild.load_pipeline(built.folder), eager_pipeline(tiny_target),
                      lambda p: p.load_lora_weights(tmp_path / "kohya.safetensors", adapter_name="k"))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    reference = eager_pipeline(tiny_target)
    reference.load_lora_weights(loras["B"], adapter_name="B")
    np.testing.assert_allclose(got, generate(reference, BUCKET), atol=ATOL, rtol=0)  # the same LoRA


def test_dora_is_refused_and_nothing_stays_loaded(built, tiny_target, tmp_path):
    dora = make_lora(eager_pipeline(tiny_target), tmp_path / "dora", seed=3, use_dora=True)
    pipe = aotbuild.load_pipeline(built.folder)
    base = generate(pipe, BUCKET)
    with pytest.raises(AotbuildError, match=r"LoRA d cannot be applied to the compiled model: DoRA"):
        pipe.load_lora_weights(dora, adapter_name="d")
    assert pipe.get_list_adapters() == {}
    assert np.array_equal(generate(pipe, BUCKET), base)


def test_hotswap_replaces_an_adapter_in_place(built, tiny_target, loras):
    """diffusers' fast switch: B's matrices copied into adapter "style" (same rank and targets)
    give B's image; the switch back gives A's bit for bit."""
    compiled = aotbuild.load_pipeline(built.folder)
    compiled.load_lora_weights(loras["A"], adapter_name="style")
    with_a = generate(compiled, BUCKET)
    compiled.load_lora_weights(loras["A2"], adapter_name="style", hotswap=True)
    eager = eager_pipeline(tiny_target)
    eager.load_lora_weights(loras["A2"], adapter_name="style")
    np.testing.assert_allclose(generate(compiled, BUCKET), generate(eager, BUCKET), atol=ATOL, rtol=0)
    compiled.load_lora_weights(loras["A"], adapter_name="style", hotswap=True)
    assert np.array_equal(generate(compiled, BUCKET), with_a)


def test_a_switch_waits_for_the_running_call(built, tiny_target, loras):
    """A LoRA switch from another thread waits for the denoiser call in flight; that call finishes
    on the weights it started with, the next one runs on the new ones."""
    from aotbuild.builder.capture import capture_inputs
    from aotbuild.spec.pipelines import pipeline_spec

    pipe = aotbuild.load_pipeline(built.folder)
    unet = pipe.unet
    call = capture_inputs(eager_pipeline(tiny_target), [pipeline_spec(tiny_target.pipeline).component("unet")],
                          batch=1, height=64, width=64, guidance_scale=5.0)["unet"]
    args, kwargs = call.args, {**call.kwargs, "return_dict": False}
    before = unet(*args, **kwargs)[0]
    variant = next(v for v in unet.variants if v.name == unet.last_variant)
    pipe.load_lora_weights(loras["A"], adapter_name="A")
    pipe.disable_lora()
    started, release, results = threading.Event(), threading.Event(), {}
    run = variant._run

    def paused_run(tensors):  # holds the call in flight until the switch is under way
        started.set()
        release.wait(10)
        return run(tensors)

    variant._run = paused_run
    call = threading.Thread(target=lambda: results.setdefault("in flight", unet(*args, **kwargs)[0]))
    call.start()
    assert started.wait(10)
    switch = threading.Thread(target=pipe.enable_lora)
    switch.start()
    switch.join(0.5)
    assert switch.is_alive()  # waiting for the call
    release.set()
    call.join(10)
    switch.join(10)
    variant._run = run
    assert torch.equal(results["in flight"], before)
    assert (unet(*args, **kwargs)[0] - before).abs().max() > 1e-3


def test_finetuned_weights_through_apply_and_load_pipeline(built, tiny_target, tmp_path):
    finetuned = eager_pipeline(tiny_target, seed=7)
    expected = generate(finetuned, BUCKET)
    finetuned.save_pretrained(tmp_path / "finetune")
    conv_in = finetuned.unet.conv_in.weight
    aotbuild.apply(finetuned, built.folder)
    np.testing.assert_allclose(generate(finetuned, BUCKET), expected, atol=ATOL, rtol=0)
    # same dtype and layout: the pipeline's own tensor is bound, no copy
    assert finetuned.unet.weights["conv_in.weight"].data_ptr() == conv_in.data_ptr()

    loaded = aotbuild.load_pipeline(built.folder, weights=tmp_path / "finetune")
    np.testing.assert_allclose(generate(loaded, BUCKET), expected, atol=ATOL, rtol=0)

    # the compiled components from the fine-tune, the others from another source (the seed-0 pipeline)
    original = eager_pipeline(tiny_target)
    original.save_pretrained(tmp_path / "original")
    original.unet, original.vae = eager_pipeline(tiny_target, seed=7).unet, eager_pipeline(tiny_target, seed=7).vae
    mixed = aotbuild.load_pipeline(built.folder, weights=tmp_path / "finetune", source=tmp_path / "original")
    np.testing.assert_allclose(generate(mixed, BUCKET), generate(original, BUCKET), atol=ATOL, rtol=0)

    index = json.loads((tmp_path / "original" / "model_index.json").read_text())
    (tmp_path / "original" / "model_index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "vae"}))
    shutil.rmtree(tmp_path / "original" / "vae")
    with pytest.raises(SourceError, match=r"weights '.*original' have no vae, which this artifact compiles"):
        aotbuild.load_pipeline(built.folder, weights=tmp_path / "original")
    single = tmp_path / "finetune" / "unet" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(SourceError, match=r"is a single file; weights= takes a diffusers folder or a Hub id"):
        aotbuild.load_pipeline(built.folder, weights=single)

    # weights="artifact": the artifact's (seed 0) whatever the pipeline's compiled modules hold
    pipe = eager_pipeline(tiny_target)
    expected = generate(pipe, BUCKET)
    other = eager_pipeline(tiny_target, seed=7)
    pipe.unet, pipe.vae = other.unet, other.vae
    aotbuild.apply(pipe, built.folder, weights="artifact")
    np.testing.assert_allclose(generate(pipe, BUCKET), expected, atol=ATOL, rtol=0)


def test_lora_fused_before_apply_counts_and_unfused_is_refused(built, tiny_target, loras):
    pipe = eager_pipeline(tiny_target)
    pipe.load_lora_weights(loras["A"], adapter_name="A")
    with pytest.raises(AotbuildError, match=r"pipe.unet has LoRA adapters that are not fused into its weights \(A\)"):
        aotbuild.apply(pipe, built.folder)
    pipe.fuse_lora()
    expected = generate(pipe, BUCKET)
    with pytest.warns(UserWarning, match=r"fused into pipe.unet \(A\) are part of the compiled weights"):
        aotbuild.apply(pipe, built.folder)
    np.testing.assert_allclose(generate(pipe, BUCKET), expected, atol=ATOL, rtol=0)


def test_another_architecture_is_refused_naming_the_tensor(built, tiny_target):
    from diffusers import UNet2DConditionModel

    pipe = eager_pipeline(tiny_target)
    config = dict(pipe.unet.config)
    # Told by the config first (before any tensor is read); the tensors' own checks are test_checkpoint's.
    pipe.unet = UNet2DConditionModel.from_config({**config, "norm_num_groups": 16, "block_out_channels": [48, 64]})
    with pytest.raises(IncompatibleArtifactError, match=r"unet: the weights' config differs from the artifact's in "
                       r"'block_out_channels' \(\[48, 64\] in the weights, \[32, 64\] in the artifact\), "
                       r"'norm_num_groups' \(16 in the weights, 8 in the artifact\)"):
        aotbuild.apply(pipe, built.folder)
    pipe.unet = UNet2DConditionModel.from_config({**config, "transformer_layers_per_block": [1, 2]})
    with pytest.raises(IncompatibleArtifactError, match=r"unet: the weights' config differs from the artifact's in "
                       r"'transformer_layers_per_block' \(\[1, 2\] in the weights, \[1, 1\] in the artifact\)"):
        aotbuild.apply(pipe, built.folder)
    with pytest.raises(AotbuildError, match=r"weights='other'; choose from 'pipeline', 'artifact'"):
        aotbuild.apply(eager_pipeline(tiny_target), built.folder, weights="other")


def test_run_with_weights_and_loras(built, tiny_target, loras, tmp_path):
    from click.testing import CliRunner

    from aotbuild.cli import main

    eager_pipeline(tiny_target, seed=7).save_pretrained(tmp_path / "finetune")
    result = CliRunner().invoke(main, ["run", "--target", "cpu-tiny-sdxl", "--prompt", "a red fox in the snow",
                                       "--steps", "2", "--height", "64", "--width", "64", "--batch", "1",
                                       "--weights", str(tmp_path / "finetune"), "--lora", f"{loras['A']}:0.6",
                                       "--lora", str(loras["B"]), "--output", str(tmp_path / "out.png"),
                                       "--artifacts", str(built.artifacts)])
    assert result.exit_code == 0, result.output
    assert "loras=lora0:0.6,lora1:1.0" in result.output
    expected = eager_pipeline(tiny_target, seed=7)
    expected.load_lora_weights(loras["A"], adapter_name="a")
    expected.load_lora_weights(loras["B"], adapter_name="b")
    expected.set_adapters(["a", "b"], adapter_weights=[0.6, 1.0])
    image = expected("a red fox in the snow", num_inference_steps=2, height=64, width=64, guidance_scale=5.0,
                     generator=torch.Generator("cpu").manual_seed(0)).images[0]
    from PIL import Image

    written = np.asarray(Image.open(tmp_path / "out.png"), dtype=np.int16)
    assert np.abs(written - np.asarray(image, dtype=np.int16)).max() <= 1  # 8-bit rounding
    result = CliRunner().invoke(main, ["run", "--target", "cpu-tiny-sdxl", "--prompt", "x", "--backend", "eager",
                                       "--lora", str(loras["A"]), "--artifacts", str(built.artifacts)])
    assert result.exit_code != 0 and "--weights and --lora run the artifact (--backend aot)" in result.output
