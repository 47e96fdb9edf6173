"""The calls diffusers users make, on every tiny pipeline, compiled against eager with the same
seeds: guidance on and off at every bucket, the pipeline's default call, img2img and inpainting
through `from_pipe` and `(**pipe.components)`, VAE slicing and tiling, and the refusals, whose
text is checked. The artifacts are the ones the suite builds anyway (`build_once`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import aotbuild
from aotbuild.builder.targets import load_target
from aotbuild.errors import AotbuildError, ShapeNotSupportedError
from aotbuild.spec.pipelines import repaint_mask

from .conftest import TARGETS, build_once, eager_pipeline

pytestmark = pytest.mark.slow
ATOL = 1e-4  # images in [0, 1]; float32 compiled vs eager differ by ~1e-6
PROMPT = "a red fox in the snow"
FAMILIES = {  # target -> (img2img pipeline, inpainting pipeline, attention kwargs)
    "cpu-tiny-sdxl": ("StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline", "cross_attention_kwargs"),
    "cpu-tiny-sd15": ("StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline", "cross_attention_kwargs"),
    "cpu-tiny-sd3": ("StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline", "joint_attention_kwargs"),
    "cpu-tiny-flux": ("FluxImg2ImgPipeline", "FluxInpaintPipeline", "joint_attention_kwargs"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pipes(request, tmp_path_factory):
    """(target, compiled pipeline, eager pipeline), loaded once per family."""
    target = load_target(TARGETS / f"{request.param}.toml")
    built = build_once(tmp_path_factory, target)
    return target, aotbuild.load_pipeline(built.folder), eager_pipeline(target)


def run(pipe, **call):
    call = {"num_inference_steps": 2, "output_type": "np", **call}
    return pipe(PROMPT, generator=torch.Generator("cpu").manual_seed(0), **call).images


def both(pipes_, **call):
    """The compiled and the eager images of one call, checked equal within ATOL."""
    _, compiled, eager = pipes_
    got, want = run(compiled, **call), run(eager, **call)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    return got


def denoiser(pipe):
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


def picture(size: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_guidance_on_and_off_at_every_bucket(pipes):
    """One variant per bucket serves 1 to its batch of images, guided (2 x images at the denoiser)
    and unguided (guidance_scale 1: 1 x images); Flux's batch is the same either way."""
    target, compiled, _ = pipes
    for bucket in target.shapes:
        for guidance_scale in (5.0, 1.0):
            for images in sorted({1, bucket.batch}):
                both(pipes, height=bucket.height, width=bucket.width, num_images_per_prompt=images,
                     guidance_scale=guidance_scale)
                assert denoiser(compiled).last_variant == compiled.vae.last_variant == \
                    f"b{bucket.batch}_{bucket.height}x{bucket.width}"
    entry = denoiser(compiled).variants[0].entry
    assert entry.get("guidance") == (None if target.pipeline == "FluxPipeline" else ["guided", "unguided"])


def test_true_cfg_and_negative_prompts(pipes):
    """Flux's true CFG calls the transformer twice per step at the same batch; the others take a
    negative prompt in their guided batch."""
    target, _, _ = pipes
    bucket = target.shapes[0]
    extra = {"true_cfg_scale": 2.0} if target.pipeline == "FluxPipeline" else {}
    both(pipes, height=bucket.height, width=bucket.width, negative_prompt="blurry", **extra)


def test_the_default_call_works_as_shipped(pipes):
    """`pipe(prompt)` with no size: the model's native size where a variant covers it, else the
    first square bucket, which the compiled pipeline makes its default (tiny Flux: 256 -> 64)."""
    target, compiled, eager = pipes
    served = next(b for b in target.shapes if b.height == b.width).height
    got = run(compiled)
    np.testing.assert_allclose(got, run(eager, height=served, width=served), atol=ATOL, rtol=0)
    assert got.shape[1:3] == (served, served)
    # The img2img sibling from_pipe makes keeps that default (diffusers' Flux resets it to 256).
    import diffusers

    image = picture(served, seed=2)
    compiled, eager = (diffusers.AutoPipelineForImage2Image.from_pipe(p) for p in (compiled, eager))
    got = run(compiled, image=image, strength=0.6, num_inference_steps=4)
    want = run(eager, image=image, strength=0.6, num_inference_steps=4, height=served, width=served)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_img2img_and_inpainting_share_the_compiled_models(pipes):
    """AutoPipelineForImage2Image / ForInpainting.from_pipe and the family's classes built from
    `pipe.components` run the compiled encoder, denoiser and decoder."""
    import diffusers

    target, compiled, eager = pipes
    img2img, inpaint, _ = FAMILIES[target.name]
    bucket = target.shapes[0]
    image = picture(bucket.height, seed=1)
    mask = repaint_mask(bucket.height, bucket.width)
    call = {"image": image, "strength": 0.6, "num_inference_steps": 4, "height": bucket.height, "width": bucket.width}
    if "XL" in img2img or img2img == "StableDiffusionImg2ImgPipeline":
        call.pop("height"), call.pop("width")  # these take the image's size
    for make in (diffusers.AutoPipelineForImage2Image.from_pipe, getattr(diffusers, img2img).from_pipe):
        got = run(make(compiled), **call)
        np.testing.assert_allclose(got, run(make(eager), **call), atol=ATOL, rtol=0)
        assert compiled.vae.encoder.last_variant == f"b{bucket.batch}_{bucket.height}x{bucket.width}"
    call = {**call, "image": image, "mask_image": mask, "height": bucket.height, "width": bucket.width}
    for make in (diffusers.AutoPipelineForInpainting.from_pipe, lambda p: getattr(diffusers, inpaint)(**p.components)):
        if target.pipeline == "StableDiffusion3Pipeline":  # SD3 inpainting takes SD3's 16 latent channels, not 4
            for pipe in (compiled, eager):
                with pytest.raises(ValueError, match="should have 16 input channels or 33 input channels, not 4"):
                    run(make(pipe), **call)
            continue
        np.testing.assert_allclose(run(make(compiled), **call), run(make(eager), **call), atol=ATOL, rtol=0)


def test_vae_slicing_decodes_one_image_at_a_time(pipes):
    target, compiled, eager = pipes
    bucket = max(target.shapes, key=lambda b: b.batch)
    for pipe in (compiled, eager):
        pipe.vae.enable_slicing()
    try:
        both(pipes, height=bucket.height, width=bucket.width, num_images_per_prompt=bucket.batch)
    finally:
        for pipe in (compiled, eager):
            pipe.vae.disable_slicing()


def test_tiling_an_image_twice_the_largest_bucket(pipes):
    """`vae.enable_tiling()` runs diffusers' tiled decode and encode over the tile models; a target
    without them refuses tiling and says how to add it."""
    target, compiled, eager = pipes
    if not target.tiling:
        with pytest.raises(AotbuildError, match="vae.enable_tiling\\(\\): this artifact's vae_decoder has no tile "
                                                "variant") as info:
            compiled.vae.enable_tiling()
        assert "vae_decoder = { tiling = true }" in info.value.hint
        return
    side = 2 * max(max(b.height, b.width) for b in target.shapes)
    factor = 2 ** (len(eager.vae.config.block_out_channels) - 1)
    latents = torch.randn(1, eager.vae.config.latent_channels, side // factor, side // factor,
                          generator=torch.Generator().manual_seed(3))
    images = torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(4)) * 2 - 1
    for pipe in (compiled, eager):
        pipe.vae.enable_tiling()
    try:
        with torch.no_grad():
            decoded = [pipe.vae.decode(latents).sample for pipe in (compiled, eager)]
            assert compiled.vae.decoder.last_variant == "tile"
            encoded = [pipe.vae.encode(images).latent_dist.mean for pipe in (compiled, eager)]
            assert compiled.vae.encoder.last_variant == "tile"
    finally:
        for pipe in (compiled, eager):
            pipe.vae.disable_tiling()
    torch.testing.assert_close(decoded[0], decoded[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(encoded[0], encoded[1], atol=1e-4, rtol=0)


def test_refusals_name_the_cause(pipes):
    target, compiled, _ = pipes
    bucket = target.shapes[0]
    key = FAMILIES[target.name][2]
    name = "unet" if hasattr(compiled, "unet") else "transformer"
    size = {"height": bucket.height, "width": bucket.width}
    with pytest.raises(ShapeNotSupportedError, match=f"^{key} key 'ip_adapter_masks' is not an input of the "
                                                     f"compiled {name}"):
        run(compiled, **size, **{key: {"ip_adapter_masks": torch.ones(1)}})
    with pytest.raises(aotbuild.MissingAttributeError, match=f"^{name} is compiled by aotbuild and has no attribute "
                                                    f"'time_embedding'") as info:
        denoiser(compiled).time_embedding  # noqa: B018
    assert isinstance(info.value, AttributeError) and not hasattr(compiled.vae, "decoder_only_thing")
    with pytest.raises(ShapeNotSupportedError, match=f"{name}: no compiled variant for this call "
                                                     f"\\({target.pipeline}\\(height=512, width=512"):
        run(compiled, height=512, width=512)
    if target.pipeline == "StableDiffusion3Pipeline":
        with pytest.raises(ShapeNotSupportedError, match="^'skip_layers' is not an input of the compiled transformer "
                                                         "\\(SD3 skip-layer guidance \\(skip_guidance_layers=...\\)"):
            run(compiled, **size, skip_guidance_layers=[0], num_inference_steps=10)  # SLG: steps between 1 % and 20 %


def test_an_artifact_built_guided_only_without_encoder_or_tiles_says_so(built_int8):
    """cpu-tiny-sdxl-int8 opts out (guidance = "guided", no vae_encoder, no tiling)."""
    import diffusers

    pipe = aotbuild.load_pipeline(built_int8.folder)
    assert [v["guidance"] for v in built_int8.manifest["components"]["unet"]["variants"]] == [["guided"]]
    with pytest.raises(ShapeNotSupportedError, match="unet: guidance_scale=1 needs the unguided variants, which this "
                                                     "artifact was built without \\(rebuild it with guidance = "
                                                     "\"both\" in the target\\); it covers: 64x64 px, 1 image, "
                                                     "with guidance only"):
        run(pipe, height=64, width=64, guidance_scale=1.0)
    img2img = diffusers.AutoPipelineForImage2Image.from_pipe(pipe)
    with pytest.raises(AotbuildError, match="this artifact has no vae_encoder: img2img and inpainting encode images "
                                            "with it") as info:
        run(img2img, image=picture(64, seed=1))
    assert info.value.hint == "add `vae_encoder = {}` to [components] in the target and rebuild"


def test_an_inpainting_checkpoint_is_a_target_like_any_other(tmp_path_factory):
    """A UNet of 9 input channels (latents, mask, masked image latents): built from calls of the
    inpainting pipeline with an image and a mask, guided and unguided, against eager."""
    target = load_target(TARGETS / "cpu-tiny-sd15-inpaint.toml")
    built = build_once(tmp_path_factory, target)
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(target)
    assert type(compiled).__name__ == "StableDiffusionInpaintPipeline" and compiled.unet.config.in_channels == 9
    mask = Image.fromarray(np.tile((np.arange(64) >= 24).astype(np.uint8) * 255, (64, 1)))
    for guidance_scale in (5.0, 1.0):
        call = {"image": picture(64, seed=2), "mask_image": mask, "height": 64, "width": 64,
                "guidance_scale": guidance_scale, "num_inference_steps": 3}
        np.testing.assert_allclose(run(compiled, **call), run(eager, **call), atol=ATOL, rtol=0)
        assert compiled.unet.last_variant == "b1_64x64"
