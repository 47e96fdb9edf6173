"""Capture records what the real pipeline passes and leaves the modules exactly as it found them."""

from __future__ import annotations

import functools
import inspect

import diffusers
import pytest
import torch

from aotbuild.builder.capture import PendingOutput, capture_inputs, decode_pending, encode_prompt, recording
from aotbuild.builder.targets import load_target
from aotbuild.spec.pipelines import pipeline_spec, seeded_image

from .conftest import TARGETS, eager_pipeline


@pytest.fixture(scope="module")
def pipe(tiny_target):
    return eager_pipeline(tiny_target)


@pytest.fixture(scope="module")
def specs():
    spec = pipeline_spec("StableDiffusionXLPipeline")
    return [spec.component("unet"), spec.component("vae_decoder")]


def test_records_real_calls_with_guidance_doubling_batch(pipe, specs):
    calls = capture_inputs(pipe, specs, batch=2, height=64, width=96, guidance_scale=5.0)
    unet = calls["unet"]
    sample, timestep = unet.args[:2]
    assert sample.shape == (4, 4, 32, 48)  # 2 images x classifier-free guidance, latents = pixels / 2
    assert timestep.ndim == 0
    assert set(unet.kwargs["added_cond_kwargs"]) == {"text_embeds", "time_ids"}
    assert unet.kwargs["added_cond_kwargs"]["time_ids"].shape == (4, 6)
    assert unet.kwargs["return_dict"] is False
    assert unet.output.shape == sample.shape
    vae = calls["vae_decoder"]
    assert vae.kwargs == {} and vae.args[0].shape == (2, 4, 32, 48)
    assert isinstance(vae.output, PendingOutput)  # decoded later (below)


def test_the_decoders_call_is_recorded_undecoded_then_decoded_as_the_pipeline_would(pipe, specs, monkeypatch):
    """The VAE decoder's call, the last the capture records, is not decoded in the run: the pipeline
    goes on with zeros of its shape, worked out on fake tensors; its output is decoded later
    (`decode_pending`, by the build once its float32 denoiser is cast: SDXL at 1024x1024 px decoded
    4 GiB of float32 activations beside a 10 GiB float32 UNet), exactly as the call would have
    decoded it, once for the points sharing the run."""
    decoded = []
    decode = pipe.vae.decode
    monkeypatch.setattr(pipe.vae, "decode", lambda latents, *args, **kwargs: (
        decoded.append(type(latents).__name__), decode(latents, *args, **kwargs))[1])
    calls = capture_inputs(pipe, specs, batch=1, height=64, width=96, guidance_scale=5.0)
    assert decoded == ["FakeTensor"] and "unet" in calls
    reference = {"b1_64x96": calls, "b1_64x96:one": dict(calls)}
    decode_pending(reference, specs[1], pipe.vae)
    assert decoded == ["FakeTensor", "Tensor"]
    latents = calls["vae_decoder"].args[0]
    expected = decode(latents, return_dict=False)[0]
    for point in reference.values():
        assert point["vae_decoder"].output.shape == (1, 3, 64, 96)
        assert torch.equal(point["vae_decoder"].output, expected)


def test_without_guidance_batch_is_not_doubled(pipe, specs):
    calls = capture_inputs(pipe, specs, batch=1, height=64, width=64, guidance_scale=1.0)
    assert calls["unet"].args[0].shape[0] == 1


def test_recording_restores_modules_even_on_error(pipe, specs):
    before = inspect.signature(pipe.unet.forward)
    with pytest.raises(RuntimeError, match="boom"), recording(pipe, specs):
        assert "forward" in vars(pipe.unet) and "decode" in vars(pipe.vae)
        assert inspect.signature(pipe.unet.forward) == before  # wraps keep the signature
        raise RuntimeError("boom")
    assert "forward" not in vars(pipe.unet) and "decode" not in vars(pipe.vae)
    assert inspect.signature(pipe.unet.forward) == before


def test_captured_tensors_are_copies(pipe, specs):
    calls = capture_inputs(pipe, specs, batch=1, height=64, width=64, guidance_scale=5.0)
    sample = calls["unet"].args[0]
    assert not sample.requires_grad and sample.is_contiguous() and sample.dtype == torch.float32


def test_the_pipeline_runs_to_its_end_past_the_undecoded_call(pipe, specs):
    """What a pipeline does after its decode still happens: SDXL's perturbed-attention guidance
    (PAG) pipeline swaps its UNet's attention processors for the loop and puts them back after the
    decode; a capture ending the run at the decode left them swapped, and the next run traced them."""
    from diffusers import StableDiffusionXLPAGPipeline

    pag = StableDiffusionXLPAGPipeline.from_pipe(pipe, pag_applied_layers=["mid"])
    before = {name: type(p) for name, p in pag.unet.attn_processors.items()}
    calls = capture_inputs(pag, specs, batch=1, height=64, width=64, guidance_scale=5.0)
    assert isinstance(calls["vae_decoder"].output, PendingOutput)
    assert {name: type(p) for name, p in pag.unet.attn_processors.items()} == before


@pytest.mark.parametrize("name", ["cpu-tiny-sdxl", "cpu-tiny-sd15", "cpu-tiny-sd3", "cpu-tiny-flux"])
def test_capture_from_prompt_embeddings_equals_capture_from_the_prompt(name):
    """The build encodes prompts first (text encoders then leave the device): the denoiser and VAE
    must see exactly what a prompt-driven call gives them."""
    target = load_target(TARGETS / f"{name}.toml")
    spec = pipeline_spec(target.pipeline)
    specs = [spec.component(c) for c in target.components]
    pipe = eager_pipeline(target)
    bucket = target.shapes[0]
    shape = dict(batch=bucket.batch, height=bucket.height, width=bucket.width, guidance_scale=target.guidance_scale)
    from_prompt = capture_inputs(pipe, specs, **shape)
    embeds = encode_prompt(pipe, spec, batch=bucket.batch, guidance_scale=target.guidance_scale,
                           device=torch.device("cpu"))
    from_embeds = capture_inputs(pipe, specs, **shape, prompt_embeds=embeds)
    for calls in (from_prompt, from_embeds):
        decode_pending({"bucket": calls}, spec.component("vae_decoder"), pipe.vae)
    assert set(from_prompt) == set(from_embeds) == set(target.components) - {"vae_encoder"}  # img2img's only
    for component in from_prompt:
        a, b = from_prompt[component], from_embeds[component]
        torch.testing.assert_close((a.args, a.kwargs, a.output), (b.args, b.kwargs, b.output), rtol=0, atol=0)


def test_a_controlnet_called_at_another_scale_is_recorded_at_the_scale_it_is_compiled_for():
    """A ControlNet is compiled at conditioning scale 1 (the stand-in scales after it), and img2img
    calls it at 0.8, inpainting at 0.5: its reference is its output at scale 1 on the same inputs,
    not the call's (which failed such builds' validation by 0.25 and 1.0)."""
    target = load_target(TARGETS / "cpu-tiny-sdxl-controlnet.toml")
    pipe = eager_pipeline(target)
    spec = pipeline_spec("StableDiffusionXLControlNetImg2ImgPipeline").component("controlnet")
    img2img = diffusers.StableDiffusionXLControlNetImg2ImgPipeline.from_pipe(pipe)
    image = seeded_image(64, 64)
    with recording(img2img, [spec]) as calls:
        img2img(prompt="a fox", image=image, control_image=image, num_inference_steps=2, output_type="latent",
                controlnet_conditioning_scale=0.8)
    call = calls["controlnet"]
    assert call.kwargs["conditioning_scale"] == 1.0
    with torch.no_grad():
        down, mid = pipe.controlnet(*call.args, **call.kwargs)
    assert all(torch.equal(got, want) for got, want in zip(call.output[0], down, strict=True))
    assert torch.equal(call.output[1], mid) and mid.abs().max() > 0


def test_a_targets_call_arguments_reach_every_capture():
    """PixArt bins a call's size to one its table holds (256 px sizes for this tiny model): a target
    at 64 px passes `use_resolution_binning = false` (`call`), and its captures run at 64 px."""
    import dataclasses

    from aotbuild.builder.capturing import call_extras

    target = load_target(TARGETS / "cpu-tiny-pixart-sigma.toml")
    spec = pipeline_spec(target.pipeline)
    pipe = eager_pipeline(target)
    transformer = [spec.component("transformer")]
    for call, latents in (({}, (32, 32)), ({"use_resolution_binning": False}, (8, 8))):
        extras = call_extras(pipe, spec, dataclasses.replace(target, call=call), 1, 64, 64)
        calls = capture_inputs(pipe, transformer, batch=1, height=64, width=64, guidance_scale=4.5, extras=extras)
        assert calls["transformer"].args[0].shape[-2:] == latents


def test_a_schedule_with_no_1_step_form_is_captured_at_2_and_a_failing_call_is_refused_in_words(tiny_target, specs):
    """The capture runs 1 step where it can. Mochi's schedule divides by zero at 1 step (its
    `linear_quadratic_schedule`): the capture takes 2. A pipeline whose own code fails on every
    run is refused with its error, not a traceback."""
    from aotbuild.errors import BuildError

    base = type(eager_pipeline(tiny_target))

    class NoSingleStep(base):
        @functools.wraps(base.__call__)  # its signature: the capture passes what the pipeline takes
        def __call__(self, *args, num_inference_steps=50, **kwargs):
            if num_inference_steps == 1:
                return 1 / (num_inference_steps // 2)  # Mochi's linear steps: num_steps // 2
            return super().__call__(*args, num_inference_steps=num_inference_steps, **kwargs)

    class Failing(base):
        @functools.wraps(base.__call__)
        def __call__(self, *args, **kwargs):
            return ()[1]  # Krea 2's text layers past its text encoder's

    for cls in (NoSingleStep, Failing):
        pipe = eager_pipeline(tiny_target)
        pipe.__class__ = cls
        timings = {}
        if cls is NoSingleStep:
            calls = capture_inputs(pipe, specs[:1], batch=1, height=64, width=96, guidance_scale=5.0, timings=timings)
            assert timings["steps"] == 2 and calls["unet"].args[0].shape == (2, 4, 32, 48)
        else:
            with pytest.raises(BuildError, match=r"^Failing refuses the call the target asks for \(height=64, "
                                                 r"width=64\): IndexError: tuple index out of range$"):
                capture_inputs(pipe, specs[:1], batch=1, height=64, width=64, guidance_scale=5.0)


def test_a_list_the_model_empties_is_recorded_as_the_pipeline_made_it():
    """The UNet pops a T2I-Adapter's residuals off the list it is given, block by block: the capture
    records the list as the pipeline made it, so the compiled UNet adds them as eager does (the
    record was empty before, and the build's validation caught it: relative error 0.19)."""
    sd = eager_pipeline(load_target(TARGETS / "cpu-tiny-sd15.toml"))
    torch.manual_seed(0)
    adapter = diffusers.T2IAdapter(in_channels=3, channels=[32, 64], num_res_blocks=1, downscale_factor=2)
    unet = diffusers.UNet2DConditionModel(  # diffusers' adapter test's: its residuals fit these blocks
        block_out_channels=(32, 64), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8).eval()
    takes = inspect.signature(diffusers.StableDiffusionAdapterPipeline.__init__).parameters
    pipe = diffusers.StableDiffusionAdapterPipeline(adapter=adapter, **{k: v for k, v in sd.components.items()
                                                                        if k in takes} | {"unet": unet})
    pipe.set_progress_bar_config(disable=True)
    spec = pipeline_spec("StableDiffusionAdapterPipeline")
    calls = capture_inputs(pipe, [spec.component("unet")], batch=1, height=64, width=64, guidance_scale=5.0,
                           extras=spec.call_extras(1, 64, 64))
    call = calls["unet"]
    residuals = call.kwargs["down_intrablock_additional_residuals"]
    assert [tuple(r.shape) for r in residuals] == [(2, 32, 32, 32), (2, 64, 16, 16)]
    with torch.no_grad():
        again = unet(*call.args, **{**call.kwargs, "down_intrablock_additional_residuals": list(residuals)})
        without = unet(*call.args, **{k: v for k, v in call.kwargs.items()
                                      if k != "down_intrablock_additional_residuals"})
    torch.testing.assert_close(again[0], call.output, rtol=0, atol=0)
    assert not torch.allclose(without[0], call.output, atol=1e-3)  # the residuals count
    assert len(residuals) == 2  # the record is not the list the UNet emptied
