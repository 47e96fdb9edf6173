"""Flux Kontext (curated: FluxPipeline's components, a call that edits an image): the edited
image's tokens join the output's in the transformer's sequence, so a bucket names the image's size
(`image = [height, width]`) and a dynamic model serves edits whose tokens together fit its range.
Compiled == eager with the same seeds for edits at the bucket and in the range, text-to-image calls,
Kontext's true CFG, LoRAs, `from_pipe` to FluxPipeline, Flux.1 weights; calls outside what was
compiled are refused in the call's terms."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch

import aotbuild
from aotbuild.builder.targets import load_target
from aotbuild.errors import ShapeNotSupportedError
from aotbuild.spec.pipelines import exact_size, seeded_image

from .conftest import TARGETS, TRANSFORMER_LORA_TARGETS, build_once, eager_pipeline, make_lora, same_as_eager

pytestmark = pytest.mark.slow
ATOL = 1e-4  # images in [0, 1]; float32 compiled vs eager differ by ~1e-6
PROMPT = "make the fox red"


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    """(target, build, compiled pipeline, eager pipeline)."""
    target = load_target(TARGETS / "cpu-tiny-flux-kontext.toml")
    built = build_once(tmp_path_factory, target)
    return target, built, aotbuild.load_pipeline(built.folder), eager_pipeline(target)


def run(pipe, **call):
    """64 x 64 px, editing the image at its size (Kontext's max_area and _auto_resize would make
    1024 x 1024 px and resize the image), unless the call says otherwise."""
    call = {"num_inference_steps": 2, "output_type": "np", **exact_size(type(pipe), 64, 64, editing=True), **call}
    return pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), **call).images  # image is first


def both(compiled, eager, **call):
    return same_as_eager(run, compiled, eager, ATOL, **call)


def test_the_bucket_names_the_edited_image(kontext):
    _, built, _, _ = kontext
    variants = {v["name"]: aotbuild.runtime.variant_coverage(v)
                for v in built.manifest["components"]["transformer"]["variants"]}
    assert variants["b1_64x64_image48x80"] == "64x64 px editing a 48x80 px image, 1 image, text length 512"
    encoder = [v["name"] for v in built.manifest["components"]["vae_encoder"]["variants"]]
    assert encoder == ["b1_48x80", "dynamic"]  # the encoder encodes the edited image, at its size
    decoder = [v["name"] for v in built.manifest["components"]["vae_decoder"]["variants"]]
    assert decoder == ["b1_64x64", "dynamic"]  # the decoder decodes the output: the image is not its shape


@pytest.mark.parametrize(("call", "transformer", "encoder"), [
    ({"image": (48, 80)}, "b1_64x64_image48x80", "b1_48x80"),
    ({"image": (64, 64)}, "dynamic", "dynamic"),  # 256 + 256 tokens: in the range's 64-576
    ({"image": (48, 80), "num_images_per_prompt": 2}, "dynamic", "b1_48x80"),
    ({"image": (48, 80), "guidance_scale": 1.0}, "b1_64x64_image48x80", "b1_48x80"),
    ({"image": (48, 80), "negative_prompt": "blur", "true_cfg_scale": 3.0}, "b1_64x64_image48x80", "b1_48x80"),
    ({"image": (32, 48), "height": 48, "width": 80, "max_area": 48 * 80}, "dynamic", "dynamic"),
    ({}, "dynamic", None),  # text to image
])
def test_compiled_edits_match_eager(kontext, call, transformer, encoder):
    _, _, compiled, eager = kontext
    if "image" in call:
        call = {**call, "image": seeded_image(*call["image"])}
    both(compiled, eager, **call)
    assert compiled.transformer.last_variant == transformer
    if encoder:
        assert compiled.vae.parts["encoder"].last_variant == encoder


def test_edits_outside_what_was_compiled_are_refused_in_the_calls_terms(kontext):
    _, _, compiled, _ = kontext
    with pytest.raises(ShapeNotSupportedError, match=r"transformer: no compiled variant for this call "
                       r"\(FluxKontextPipeline\(height=96, width=96, .*image_height=96, image_width=96, "
                       r"_auto_resize=False\)\).*hidden_states \[1, 1152, 16\].*an edited image of 96x96 px adds "
                       r"its tokens to the output's: a dynamic model serves edits whose tokens together fit its "
                       r"range"):
        run(compiled, image=seeded_image(96, 96), height=96, width=96, max_area=96 * 96)
    # Kontext's own sizing: 1024 x 1024 and the image resized to a size Kontext was trained at
    with pytest.raises(ShapeNotSupportedError, match=r"vae_encoder: no compiled variant for this call "
                       r"\(FluxKontextPipeline\(height=1024, width=1024, .*max_area=1048576, image_height=1024, "
                       r"image_width=1024, _auto_resize=True\)\)"):
        compiled(prompt=PROMPT, image=seeded_image(48, 48), num_inference_steps=1)


def test_flux1_checkpoints_run_in_a_kontext_artifact(kontext, tmp_path):
    """Kontext's transformer is Flux.1's architecture (FluxTransformer2DModel, one config): a
    FluxPipeline checkpoint's weights run in the Kontext artifact (weights=) as eager runs them."""
    target, built, _, _ = kontext
    flux = diffusers.FluxPipeline(**eager_pipeline(target, seed=7).components)
    flux.save_pretrained(tmp_path / "flux1")
    loaded = aotbuild.load_pipeline(built.folder, weights=tmp_path / "flux1")
    expected = diffusers.FluxKontextPipeline(**flux.components)
    both(loaded, expected, image=seeded_image(48, 80))


def test_from_pipe_and_loras_through_diffusers_api(kontext, tmp_path):
    """FluxPipeline.from_pipe keeps the compiled models (text to image on the dynamic model); a
    LoRA loaded through diffusers' API edits as eager's does with the same LoRA."""
    target, built, compiled, eager = kontext
    both(diffusers.FluxPipeline.from_pipe(compiled), diffusers.FluxPipeline.from_pipe(eager))
    assert compiled.transformer.last_variant == "dynamic"
    compiled, eager, plain = aotbuild.load_pipeline(built.folder), eager_pipeline(target), eager_pipeline(target)
    lora = make_lora(eager, tmp_path, seed=1, alpha=64, targets=TRANSFORMER_LORA_TARGETS)
    for pipe in (compiled, eager):
        pipe.load_lora_weights(lora, adapter_name="made")
    got = both(compiled, eager, image=seeded_image(48, 80))
    assert np.abs(got - run(plain, image=seeded_image(48, 80))).max() > 1e-3  # the LoRA changes the image
