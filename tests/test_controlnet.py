"""ControlNet pipelines (SDXL's and SD 1.5's, text-to-image, img2img, inpainting): the ControlNet is
a compiled component called each step beside the UNet, compiled at conditioning scale 1 with guess
mode off and scaled as diffusers' forward scales, so every scale, guidance window and guess mode is
one model; the UNet takes its residuals, and serves calls with no ControlNet (from_pipe to the
plain pipeline) with zeros for them. Compiled == eager with the same seeds for each of those calls,
guidance off, a LoRA, another ControlNet of the same architecture (weights as data), two
ControlNets; another architecture and uncovered sizes are refused in the user's terms."""

from __future__ import annotations

import copy
import functools

import diffusers
import numpy as np
import PIL.Image
import pytest
import torch

import aotbuild
from aotbuild.builder.targets import load_target
from aotbuild.errors import ShapeNotSupportedError, UnsupportedCallError, WeightsMismatchError
from aotbuild.runtime.component import CompiledComponent
from aotbuild.spec.pipelines import PIPELINES, _inpaint_extras, repaint_mask, seeded_image

from .conftest import TARGETS, build_once, eager_pipeline, make_lora, same_as_eager

ATOL = 1e-4  # images in [0, 1]; float32 compiled vs eager differ by ~2e-6
PROMPT = "a red fox in the snow"


def run(pipe, height: int = 64, width: int = 64, **call):
    call = {"num_inference_steps": 3, "output_type": "np", "height": height, "width": width, **call}
    return pipe(PROMPT, generator=torch.Generator("cpu").manual_seed(0), **call).images


def both(compiled, eager, **call):
    return same_as_eager(run, compiled, eager, ATOL, **call)


def test_controlnet_scaling_is_diffusers_own():
    """The stand-in's scaling of residuals made at scale 1 (guess mode off) gives what the eager
    forward gives at each scale and guess mode, bit for bit (fails by name if diffusers changes it)."""
    config = load_target(TARGETS / "cpu-tiny-sdxl-controlnet.toml")
    controlnet = eager_pipeline(config).controlnet
    generator = torch.Generator("cpu").manual_seed(0)
    call = {"sample": torch.randn(2, 4, 32, 32, generator=generator), "timestep": torch.tensor(500.0),
            "encoder_hidden_states": torch.randn(2, 77, 64, generator=generator),
            "controlnet_cond": torch.rand(2, 3, 64, 64, generator=generator),
            "added_cond_kwargs": {"text_embeds": torch.randn(2, 32, generator=generator),
                                  "time_ids": torch.randn(2, 6, generator=generator)}}
    spec = PIPELINES["StableDiffusionXLControlNetPipeline"].components["controlnet"]
    with torch.no_grad():
        args, kwargs = spec.call_inputs((), call)
        raw = controlnet(*args, **kwargs)
        for scale, guess_mode in ((1.0, False), (0.35, False), (0.0, False), (0.7, True)):
            want = controlnet(**call, conditioning_scale=scale, guess_mode=guess_mode, return_dict=False)
            got = spec.finish(controlnet.config, raw, {"conditioning_scale": scale, "guess_mode": guess_mode})
            for g, w in zip([*got[0], got[1]], [*want[0], want[1]], strict=True):
                assert torch.equal(g, w), (scale, guess_mode)


def loaded(tmp_path_factory, name: str):
    """(target, build, compiled pipeline, eager pipeline)."""
    target = load_target(TARGETS / f"{name}.toml")
    built = build_once(tmp_path_factory, target)
    return target, built, aotbuild.load_pipeline(built.folder), eager_pipeline(target)


def test_a_targets_controlnet_comes_from_its_own_source(tmp_path):
    """`controlnet = FOLDER` (or a Hub model repo): the ControlNet the build captures, beside the
    base checkpoint's components; the key is refused on a pipeline that takes no ControlNet."""
    import dataclasses

    from aotbuild.builder.capturing import load_source_pipeline
    from aotbuild.builder.targets import parse_target, read_target_file
    from aotbuild.errors import TargetError

    target = load_target(TARGETS / "cpu-tiny-sdxl-controlnet.toml")
    saved = _other_model(eager_pipeline(target).controlnet, 5)
    saved.save_pretrained(tmp_path / "canny")
    pipe = load_source_pipeline(dataclasses.replace(target, controlnet=str(tmp_path / "canny")),
                                PIPELINES[target.pipeline], torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(pipe.controlnet.state_dict().values(),
                                                 saved.state_dict().values(), strict=True))
    assert dataclasses.replace(target, controlnet="org/canny").content_hash() != target.content_hash()
    raw = {**read_target_file(TARGETS / "cpu-tiny-sdxl.toml"), "controlnet": "org/canny"}
    with pytest.raises(TargetError, match="key 'controlnet': StableDiffusionXLPipeline takes no ControlNet"):
        parse_target(raw, origin="t.toml", base_dir=TARGETS)
    raw = read_target_file(TARGETS / "cpu-tiny-sdxl-controlnet.toml")
    raw = {**raw, "controlnet": "org/canny", "components": {"unet": {}}}
    with pytest.raises(TargetError, match="key 'controlnet' names a ControlNet that \\[components\\] does not compile"):
        parse_target(raw, origin="t.toml", base_dir=TARGETS)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    return loaded(tmp_path_factory, "cpu-tiny-sdxl-controlnet")


@pytest.mark.slow
@pytest.mark.parametrize("call", [
    {}, {"controlnet_conditioning_scale": 0.5}, {"control_guidance_start": 0.4, "control_guidance_end": 0.8},
    {"guess_mode": True}, {"guess_mode": True, "controlnet_conditioning_scale": 0.7}, {"guidance_scale": 1.0},
    {"image_size": (40, 40)},  # a control image of another size: the pipeline resizes it
], ids=["default", "scale", "window", "guess", "guess-scale", "unguided", "resized"])
def test_controlnet_calls_match_eager(sdxl, call):
    _, built, compiled, eager = sdxl
    image = seeded_image(*call.pop("image_size", (64, 64)))
    both(compiled, eager, image=image, **call)
    assert (compiled.controlnet.last_variant, compiled.unet.last_variant) == ("b1_64x64", "b1_64x64")
    assert isinstance(compiled.controlnet, diffusers.ControlNetModel)  # what the pipeline asserts
    assert isinstance(compiled.controlnet, CompiledComponent)
    assert built.manifest["components"]["controlnet"]["variants"][0]["guidance"] == ["guided", "unguided"]


@pytest.mark.slow
def test_the_control_image_steers_the_image(sdxl):
    """A random ControlNet's zero convolutions are seeded too: without that the test above could not fail."""
    _, _, compiled, _ = sdxl
    image = seeded_image(64, 64)
    without = run(compiled, image=image, controlnet_conditioning_scale=0.0)
    assert np.abs(run(compiled, image=image) - without).max() > 0.05


@pytest.mark.slow
def test_the_plain_pipeline_runs_the_same_unet_without_residuals(sdxl):
    """from_pipe to StableDiffusionXLPipeline: the UNet compiled with residual inputs is given zeros
    for them, and computes what the eager UNet computes without them."""
    _, _, compiled, eager = sdxl
    plain, reference = (diffusers.StableDiffusionXLPipeline.from_pipe(p) for p in (compiled, eager))
    both(plain, reference)
    both(plain, reference, guidance_scale=1.0)
    assert plain.unet.last_variant == "b1_64x64"


@pytest.mark.slow
def test_a_lora_on_the_unet_with_a_controlnet(sdxl, tmp_path):
    target, built, _, _ = sdxl
    compiled, eager, plain = aotbuild.load_pipeline(built.folder), eager_pipeline(target), eager_pipeline(target)
    lora = make_lora(eager, tmp_path, seed=1)
    for pipe in (compiled, eager):
        pipe.load_lora_weights(lora, adapter_name="made")
    got = both(compiled, eager, image=seeded_image(64, 64))
    assert np.abs(got - run(plain, image=seeded_image(64, 64))).max() > 1e-3  # the LoRA changes the image


def _other_model(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A model of `model`'s class and architecture (a ControlNet, a transformer), with seeded weights
    of its own."""
    torch.manual_seed(seed)
    other = type(model).from_config(model.config)
    for parameter in other.parameters():
        parameter.data.normal_(0.0, 0.05)
    return other


@pytest.mark.slow
def test_another_controlnet_and_two_controlnets_run_as_data(sdxl):
    """apply() binds the pipeline's own ControlNet (another checkpoint of the artifact's
    architecture), and each of a MultiControlNetModel's two, with their own scales and windows."""
    target, built, _, _ = sdxl
    controlnet = eager_pipeline(target).controlnet
    other, second = _other_model(controlnet, 7), _other_model(controlnet, 8)

    def pipeline(controlnet):
        pipe = eager_pipeline(target)
        return diffusers.StableDiffusionXLControlNetPipeline(**{**pipe.components, "controlnet": controlnet})

    one = aotbuild.apply(pipeline(copy.deepcopy(other)), built.folder)
    both(one, pipeline(other), image=seeded_image(64, 64))
    two = aotbuild.apply(pipeline([copy.deepcopy(other), copy.deepcopy(second)]), built.folder)
    assert [type(net) for net in two.controlnet.nets] == [CompiledComponent, CompiledComponent]
    eager = pipeline([other, second])
    images = [seeded_image(64, 64), seeded_image(32, 48)]
    both(two, eager, image=images)
    both(two, eager, image=images, controlnet_conditioning_scale=[0.3, 0.9], control_guidance_start=[0.0, 0.3],
         control_guidance_end=[0.5, 1.0])


@pytest.mark.slow
def test_a_controlnet_of_another_architecture_is_refused(sdxl):
    target, built, _, _ = sdxl
    pipe = eager_pipeline(target)
    pipe.controlnet = diffusers.ControlNetModel.from_config(
        {**pipe.controlnet.config, "conditioning_embedding_out_channels": (8, 32)})
    with pytest.raises(WeightsMismatchError, match=r"controlnet: the weights' config differs from the artifact's in "
                                                   r"'conditioning_embedding_out_channels' \(\[8, 32\] in the weights, "
                                                   r"\[16, 32\] in the artifact\)"):
        aotbuild.apply(pipe, built.folder)


@pytest.mark.slow
def test_a_size_not_compiled_is_refused_in_pixels(sdxl):
    _, _, compiled, _ = sdxl
    with pytest.raises(ShapeNotSupportedError, match=r"controlnet: no compiled variant for this call .*1 image at "
                                                     r"96x96 px with guidance; none compiled for 96x96 px"):
        run(compiled, 96, 96, image=seeded_image(96, 96))


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    """Its target builds an IP-Adapter in too (test_ip_adapter makes calls with both): these are without one."""
    target, built, _, eager = loaded(tmp_path_factory, "cpu-tiny-sd15-controlnet")
    eager.unload_ip_adapter()
    return target, built, aotbuild.load_pipeline(built.folder, ip_adapter=False), eager


@pytest.mark.slow
@pytest.mark.parametrize(("size", "call", "variant"), [
    ((64, 64), {}, "b1_64x64"),
    ((96, 32), {"num_images_per_prompt": 2}, "dynamic"),
    ((48, 80), {"guess_mode": True}, "dynamic"),
])
def test_sd15_controlnet_over_a_dynamic_range(sd15, size, call, variant):
    """The control image follows the output's size: the dynamic model's ControlNet takes it at every size."""
    _, _, compiled, eager = sd15
    both(compiled, eager, height=size[0], width=size[1], image=seeded_image(*size), **call)
    assert (compiled.controlnet.last_variant, compiled.unet.last_variant) == (variant, variant)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["StableDiffusionControlNetImg2ImgPipeline",
                                      "StableDiffusionControlNetInpaintPipeline"])
def test_sd15_controlnet_img2img_and_inpainting_through_from_pipe(sd15, pipeline):
    _, _, compiled, eager = sd15
    cls = getattr(diffusers, pipeline)
    extras = _inpaint_extras(1, 64, 64) if "Inpaint" in pipeline else {"image": seeded_image(64, 64), "strength": 0.7}
    both(cls.from_pipe(compiled), cls.from_pipe(eager), control_image=seeded_image(64, 64), **extras)


@pytest.mark.slow
def test_load_pipeline_takes_the_controlnet_to_run(sdxl, tmp_path):
    """load_pipeline(controlnet=...) as diffusers' from_pretrained takes it: one model, or a list."""
    target, built, _, _ = sdxl
    controlnet = eager_pipeline(target).controlnet
    other, second = _other_model(controlnet, 7), _other_model(controlnet, 8)
    eager = eager_pipeline(target)
    eager.controlnet = other
    both(aotbuild.load_pipeline(built.folder, controlnet=copy.deepcopy(other)), eager, image=seeded_image(64, 64))
    two = aotbuild.load_pipeline(built.folder, controlnet=[copy.deepcopy(other), copy.deepcopy(second)])
    reference = diffusers.StableDiffusionXLControlNetPipeline(**{**eager.components, "controlnet": [other, second]})
    both(two, reference, image=[seeded_image(64, 64), seeded_image(64, 64)], controlnet_conditioning_scale=[0.5, 1.0])
    with pytest.raises(aotbuild.AotbuildError, match=r"controlnet=\[\]: give a ControlNet model, or a list of them"):
        aotbuild.load_pipeline(built.folder, controlnet=[])
    # The compiled ControlNets alone in an eager pipeline: .to() asks each of them first, nothing is converted.
    mixed = diffusers.StableDiffusionXLControlNetPipeline(**{**eager_pipeline(target).components,
                                                            "controlnet": two.controlnet})
    with pytest.raises(UnsupportedCallError, match="controlnet is compiled by aotbuild for float32"):
        mixed.to(torch.bfloat16)
    assert mixed.text_encoder.dtype == mixed.unet.dtype == torch.float32
    with pytest.raises(UnsupportedCallError, match="save_pretrained\\(\\): controlnet is compiled"):
        mixed.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    with pytest.raises(aotbuild.AotbuildError, match="the pipeline holds 2 ControlNets and weights='artifact'"):
        aotbuild.apply(diffusers.StableDiffusionXLControlNetPipeline(**{**eager_pipeline(target).components,
                                                                       "controlnet": [other, second]}),
                       built.folder, weights="artifact")
    # A fine-tuned base checkpoint (no ControlNet in it) with a ControlNet of the user's.
    base = eager_pipeline(target, seed=3).components
    finetune = diffusers.StableDiffusionXLPipeline(**{k: v for k, v in base.items() if k != "controlnet"})
    finetune.save_pretrained(tmp_path / "finetune")
    assert not (tmp_path / "finetune" / "controlnet").exists()
    reference = eager_pipeline(target, seed=3)
    reference.controlnet = other
    both(aotbuild.load_pipeline(built.folder, weights=tmp_path / "finetune", controlnet=copy.deepcopy(other)),
         reference, image=seeded_image(64, 64))


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return loaded(tmp_path_factory, "cpu-tiny-flux-controlnet")


run_flux = functools.partial(run, num_inference_steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("call", [
    {}, {"controlnet_conditioning_scale": 0.6}, {"control_guidance_start": 0.5}, {"guidance_scale": 7.0},
    {"image_size": (48, 40)},
], ids=["default", "scale", "window", "guidance", "resized"])
def test_flux_controlnet_calls_match_eager(flux, call):
    """Flux's ControlNet takes the control image's latents (the compiled VAE encoder makes them)."""
    _, _, compiled, eager = flux
    image = seeded_image(*call.pop("image_size", (64, 64)))
    same_as_eager(run_flux, compiled, eager, ATOL, control_image=image, **call)
    assert (compiled.controlnet.last_variant, compiled.transformer.last_variant) == ("b1_64x64", "b1_64x64")
    assert isinstance(compiled.controlnet, diffusers.FluxControlNetModel)
    without = run_flux(compiled, control_image=image, controlnet_conditioning_scale=0.0)
    assert np.abs(run_flux(compiled, control_image=image) - without).max() > 0.05


@pytest.mark.slow
def test_flux_without_its_controlnet_runs_the_same_transformer(flux):
    _, built, compiled, eager = flux
    same_as_eager(run_flux, *(diffusers.FluxPipeline.from_pipe(p) for p in (compiled, eager)), ATOL)
    assert compiled.transformer.last_variant == "b1_64x64"


@pytest.mark.slow
def test_two_flux_controlnets_run_as_data(flux):
    """FluxMultiControlNetModel: each ControlNet compiled, with its own weights, scale and window;
    the mode it passes every ControlNet (-1 for one without modes, which ignores it) is dropped."""
    _, built, _, eager = flux
    other, second = (_other_model(eager.controlnet, seed) for seed in (7, 8))
    compiled = aotbuild.load_pipeline(built.folder, controlnet=[copy.deepcopy(other), copy.deepcopy(second)])
    assert [type(net) for net in compiled.controlnet.nets] == [CompiledComponent, CompiledComponent]
    assert isinstance(compiled.controlnet, diffusers.FluxMultiControlNetModel)
    reference = diffusers.FluxControlNetPipeline.from_pipe(eager, controlnet=[other, second])
    images = [seeded_image(64, 64), seeded_image(32, 48)]
    same_as_eager(run_flux, compiled, reference, ATOL, control_image=images,
                  controlnet_conditioning_scale=[0.4, 0.9], control_guidance_end=[0.5, 1.0])


@pytest.fixture(scope="module")
def union(tmp_path_factory):
    return loaded(tmp_path_factory, "cpu-tiny-flux-controlnet-union")


@pytest.mark.slow
@pytest.mark.parametrize("call", [{"control_mode": 0}, {"control_mode": 3, "controlnet_conditioning_scale": 0.6}],
                         ids=["mode0", "mode3-scale"])
def test_flux_controlnet_union_calls_match_eager(union, call):
    """A ControlNet-Union (InstantX's form, `num_mode`) takes the call's control mode as an input of
    its compiled code: every mode is one model."""
    _, _, compiled, eager = union
    image = seeded_image(64, 64)
    same_as_eager(run_flux, compiled, eager, ATOL, control_image=image, **call)
    # Another mode makes another image, beyond the compiled-vs-eager tolerance (the mode is one token of
    # the 513 the ControlNet attends to: ~7e-4 here): a mode frozen into the code would fail the match above.
    other = {**call, "control_mode": 1}
    assert np.abs(run_flux(compiled, control_image=image, **call) - run_flux(compiled, control_image=image,
                                                                             **other)).max() > 3 * ATOL


@pytest.mark.slow
def test_flux_controlnet_union_takes_several_conditions_and_refuses_a_mode_it_lacks(union):
    """One ControlNet-Union over several control images, each with its mode (diffusers'
    FluxMultiControlNetModel of one net, called once per image), and in the img2img sibling; a mode
    the model lacks, or none, is refused in the call's terms (eager: an IndexError, a ValueError);
    a ControlNet without modes is another architecture."""
    _, built, compiled, eager = union
    several = aotbuild.load_pipeline(built.folder, controlnet=[copy.deepcopy(eager.controlnet)])
    reference = diffusers.FluxControlNetPipeline.from_pipe(eager, controlnet=[eager.controlnet])
    same_as_eager(run_flux, several, reference, ATOL, control_image=[seeded_image(64, 64), seeded_image(48, 48)],
                  control_mode=[0, 2], controlnet_conditioning_scale=[0.5, 0.8])
    with pytest.raises(ValueError, match=r"control_mode \[7\]: this ControlNet-Union has modes 0 to 3"):
        run_flux(compiled, control_image=seeded_image(64, 64), control_mode=7)
    image = seeded_image(64, 64)
    same_as_eager(run_flux, *(diffusers.FluxControlNetImg2ImgPipeline.from_pipe(p) for p in (compiled, eager)), ATOL,
                  image=image, control_image=seeded_image(48, 48), control_mode=2, strength=0.7)
    # FluxMultiControlNetModel passes -1 for "no mode"; diffusers takes its images and scales as lists
    for pipe, call in ((compiled, {"control_image": image}),
                       (several, {"control_image": [image], "controlnet_conditioning_scale": [1.0]})):
        with pytest.raises(ValueError, match="this ControlNet-Union takes a control mode in every call: "
                                             "control_mode=0 to 3"):
            run_flux(pipe, **call)
    plain = _other_model(diffusers.FluxControlNetModel.from_config({**eager.controlnet.config, "num_mode": None}),
                              5)
    with pytest.raises(WeightsMismatchError, match=r"controlnet: the weights' config differs from the artifact's in "
                                                   r"'num_mode' \(null in the weights, 4 in the artifact\)"):
        aotbuild.load_pipeline(built.folder, controlnet=plain)


def test_several_controlnets_of_a_kind_aotbuild_does_not_compile_are_refused():
    from aotbuild.runtime.load import _several_controlnets

    with pytest.raises(aotbuild.AotbuildError, match="QwenImageMultiControlNetModel: several ControlNets of this kind "
                                                     "are not compiled by aotbuild yet"):
        _several_controlnets(diffusers.QwenImageMultiControlNetModel([torch.nn.Linear(1, 1)]))


@pytest.mark.slow
def test_run_bench_and_serve_take_the_control_image(sd15):
    """generate (what `run`, `bench` and `serve` call): the control image resized to the call's size,
    == the pipeline called with it; --image with it is the ControlNet img2img sibling; a missing or
    misplaced control image, and `serve` (no control images yet), are refused in those terms."""
    from click.testing import CliRunner

    from aotbuild.cli import main
    from aotbuild.generation.backends import generate

    _, built, compiled, eager = sd15
    control, start = seeded_image(40, 56), seeded_image(64, 64)
    made = generate(compiled, PROMPT, steps=3, seed=0, height=64, width=64, control=control)
    want = eager(PROMPT, image=control.resize((64, 64)), num_inference_steps=3, height=64, width=64, guidance_scale=5.0,
                 generator=torch.Generator("cpu").manual_seed(0), output_type="np").images
    np.testing.assert_allclose(np.asarray(made.images[0]) / 255, want[0], atol=1 / 255 + ATOL, rtol=0)
    img2img = generate(compiled, PROMPT, steps=3, seed=0, height=64, width=64, control=control, image=start,
                       strength=0.6)
    assert img2img.images[0].size == (64, 64)
    with pytest.raises(aotbuild.AotbuildError, match="StableDiffusionControlNetPipeline needs a control image"):
        generate(compiled, PROMPT, steps=2, seed=0, height=64, width=64)
    plain = diffusers.StableDiffusionPipeline.from_pipe(compiled)
    with pytest.raises(aotbuild.AotbuildError, match="StableDiffusionPipeline takes no control image"):
        generate(plain, PROMPT, steps=2, seed=0, height=64, width=64, control=control)
    result = CliRunner().invoke(main, ["serve", "--artifact", str(built.folder)])
    assert result.exit_code != 0 and "needs a control image in every call, and aotbuild serve takes none yet" in \
        result.output


@pytest.mark.slow
def test_run_takes_a_control_mode_for_a_controlnet_union(union, flux, tmp_path):
    """generate (what `run` and `bench` call) passes a ControlNet-Union its mode, == the pipeline
    called with it; a mode missing there, given to a ControlNet without modes, or one the union
    lacks, is refused in --control-mode's terms."""
    from click.testing import CliRunner

    from aotbuild.cli import main
    from aotbuild.generation.backends import generate

    _, built, compiled, eager = union
    control = seeded_image(64, 64)
    made = generate(compiled, PROMPT, steps=2, seed=0, height=64, width=64, guidance_scale=3.5, control=control,
                    control_mode=2)
    want = run_flux(eager, control_image=control, control_mode=2, guidance_scale=3.5)
    np.testing.assert_allclose(np.asarray(made.images[0]) / 255, want[0], atol=1 / 255 + ATOL, rtol=0)
    with pytest.raises(aotbuild.AotbuildError, match=r"ControlNet is a ControlNet-Union: give the control image's "
                                                     r"mode \(--control-mode 0 to 3"):
        generate(compiled, PROMPT, steps=2, seed=0, height=64, width=64, control=control)
    with pytest.raises(aotbuild.AotbuildError, match="control mode 4: this ControlNet-Union has modes 0 to 3"):
        generate(compiled, PROMPT, steps=2, seed=0, height=64, width=64, control=control, control_mode=4)
    with pytest.raises(aotbuild.AotbuildError, match="FluxControlNetPipeline's ControlNet takes no control mode: it is "
                                                     "not a ControlNet-Union"):
        generate(flux[2], PROMPT, steps=2, seed=0, height=64, width=64, control=control, control_mode=0)
    control.save(tmp_path / "edges.png")
    result = CliRunner().invoke(main, ["run", "--artifact", str(built.folder), "--prompt", PROMPT, "--control-image",
                                       str(tmp_path / "edges.png"), "--control-mode", "2", "--steps", "2",
                                       "--height", "64", "--width", "64", "--output", str(tmp_path / "out.png")])
    assert result.exit_code == 0, result.output
    assert np.abs(np.asarray(PIL.Image.open(tmp_path / "out.png"), dtype=np.float32) / 255 - want[0]).max() \
        <= 1 / 255 + ATOL


@pytest.mark.parametrize("target_name, model, change, refusal", [
    ("cpu-tiny-flux-controlnet", "FluxControlNetModel", {"conditioning_embedding_channels": 16},
     r"the ControlNet takes the control image's pixels through an input_hint_block \(XLabs' Flux ControlNets\)"),
    ("cpu-tiny-sd3-controlnet", "SD3ControlNetModel", {"extra_conditioning_channels": 1},
     r"the ControlNet inpaints: it takes a mask beside the image \(extra_conditioning_channels = 1\), which "
     r"StableDiffusion3ControlNetPipeline does not give it"),
    ("cpu-tiny-sd3-controlnet-inpaint", "SD3ControlNetModel", {"use_pos_embed": False},
     r"the ControlNet takes the transformer's position embedding \(use_pos_embed = false\), which "
     r"StableDiffusion3ControlNetInpaintingPipeline does not hand it"),
    ("cpu-tiny-sd3-controlnet-inpaint", "SD3ControlNetModel", {"extra_conditioning_channels": 0},
     r"the ControlNet takes 0 channels beside the image \(extra_conditioning_channels = 0\), and "
     r"StableDiffusion3ControlNetInpaintingPipeline gives its ControlNet the masked image with one: the mask"),
], ids=["xlabs", "inpainting-in-sd3", "sd35-large-in-sd3-inpainting", "plain-in-sd3-inpainting"])
def test_a_controlnet_of_a_form_not_compiled_is_refused_before_capture(tmp_path, target_name, model, change, refusal):
    """XLabs' Flux ControlNets (an input_hint_block module), an SD3 ControlNet in the SD3 pipeline
    that gives it another input (a mask, or none), and one without a position embedding of its own
    in the inpainting pipeline, which hands it none, are refused by a build before it captures
    anything."""
    import dataclasses
    import json

    from aotbuild.builder.capturing import load_source_pipeline
    from aotbuild.errors import BuildError

    target = load_target(TARGETS / f"{target_name}.toml")
    config = json.loads((TARGETS / "configs" / target.source.split(":")[1] / "controlnet" / "config.json").read_text())
    getattr(diffusers, model).from_config({**config, **change}).save_pretrained(tmp_path / "cn")
    with pytest.raises(BuildError, match=refusal):
        load_source_pipeline(dataclasses.replace(target, controlnet=str(tmp_path / "cn")), PIPELINES[target.pipeline],
                             torch.device("cpu"))


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    return loaded(tmp_path_factory, "cpu-tiny-sd3-controlnet")


def run_sd3(pipe, **call):
    """SD3's ControlNet pipeline samples the control image's latents from torch's global generator
    (diffusers passes it none): seeded here, as a user seeds it for a repeatable image."""
    torch.manual_seed(0)
    return run(pipe, **call)


@pytest.mark.slow
@pytest.mark.parametrize("call", [
    {}, {"controlnet_conditioning_scale": 0.5}, {"control_guidance_start": 0.4, "control_guidance_end": 0.8},
    {"guidance_scale": 1.0}, {"num_images_per_prompt": 2}, {"image_size": (40, 48)},
    {"height": 48, "width": 80, "num_images_per_prompt": 2}, {"height": 96, "width": 32, "guidance_scale": 1.0},
], ids=["default", "scale", "window", "unguided", "two-images", "resized", "dynamic", "dynamic-unguided"])
def test_sd3_controlnet_calls_match_eager(sd3, call):
    """SD3's ControlNet takes the control image's latents, which the compiled VAE encoder makes at
    twice the images under guidance (one per guidance half) and at the images without, in the
    bucket and over the dynamic range; the transformer adds its block samples to its blocks' tokens."""
    _, _, compiled, eager = sd3
    image = seeded_image(*call.pop("image_size", (64, 64)))
    same_as_eager(run_sd3, compiled, eager, ATOL, control_image=image, **call)
    assert isinstance(compiled.controlnet, diffusers.SD3ControlNetModel)
    variant = "b2_64x64" if call.get("height", 64) == 64 else "dynamic"
    assert {compiled.controlnet.last_variant, compiled.transformer.last_variant, compiled.vae.encoder.last_variant} \
        == {variant}
    without = run_sd3(compiled, control_image=image, controlnet_conditioning_scale=0.0)
    assert np.abs(run_sd3(compiled, control_image=image) - without).max() > 0.05


@pytest.mark.slow
def test_sd3_without_its_controlnet_and_two_controlnets(sd3):
    """The plain pipeline through from_pipe runs the same transformer, given zero block samples
    (tokens at the call's size); its img2img sibling the same VAE encoder at the images' batch; two
    ControlNets (SD3MultiControlNetModel) are each compiled, with their own weights and scales; one
    of another architecture is refused naming what differs."""
    _, built, compiled, eager = sd3
    for size in ({}, {"height": 48, "width": 80}):  # zero tokens for the call's area, in the bucket and the range
        same_as_eager(run_sd3, *(diffusers.StableDiffusion3Pipeline.from_pipe(p) for p in (compiled, eager)), ATOL,
                      **size)
    same_as_eager(run_sd3, *(diffusers.StableDiffusion3Img2ImgPipeline.from_pipe(p) for p in (compiled, eager)), ATOL,
                  image=seeded_image(64, 64), strength=0.6)
    other, second = (_other_model(eager.controlnet, seed) for seed in (7, 8))
    two = aotbuild.load_pipeline(built.folder, controlnet=[copy.deepcopy(other), copy.deepcopy(second)])
    assert [type(net) for net in two.controlnet.nets] == [CompiledComponent, CompiledComponent]
    reference = diffusers.StableDiffusion3ControlNetPipeline.from_pipe(eager, controlnet=[other, second])
    same_as_eager(run_sd3, two, reference, ATOL, control_image=[seeded_image(64, 64), seeded_image(32, 48)],
                  controlnet_conditioning_scale=[0.4, 0.9], control_guidance_end=[0.5, 1.0])
    wider = diffusers.SD3ControlNetModel.from_config({**eager.controlnet.config, "num_layers": 2})
    with pytest.raises(WeightsMismatchError, match=r"controlnet: the weights' config differs from the artifact's in "
                                                   r"'num_layers' \(2 in the weights, 1 in the artifact\)"):
        aotbuild.load_pipeline(built.folder, controlnet=wider)
    # Put into the pipeline past those checks, eager: its samples are refused by count, naming the ControlNet.
    with pytest.raises(ShapeNotSupportedError, match="the ControlNet gives 2 block_controlnet_hidden_states in this "
                                                     "call, the compiled transformer takes 1: a ControlNet of another "
                                                     "architecture than this artifact's"):
        run_sd3(diffusers.StableDiffusion3ControlNetPipeline.from_pipe(compiled, controlnet=wider),
                control_image=seeded_image(64, 64))


@pytest.mark.slow
def test_run_seeds_what_sd3s_controlnet_pipeline_draws_unseeded(sd3):
    """generate (what `run` and `bench` call) seeds torch's global generator with the call's seed
    too: SD3's ControlNet pipeline samples the control image's latents from it. An image and a mask
    beside the control image are refused by name: diffusers' inpainting sibling needs another
    ControlNet."""
    from aotbuild.generation.backends import generate

    _, _, compiled, eager = sd3
    control = seeded_image(64, 64)
    made = [generate(compiled, PROMPT, steps=3, seed=0, height=64, width=64, guidance_scale=7.0, control=control)
            for _ in range(2)]
    want = run_sd3(eager, control_image=control, guidance_scale=7.0)
    for generation in made:
        np.testing.assert_allclose(np.asarray(generation.images[0]) / 255, want[0], atol=1 / 255 + ATOL, rtol=0)
    # diffusers' inpainting sibling of this pipeline takes an inpainting ControlNet, which this is not
    with pytest.raises(aotbuild.AotbuildError, match="StableDiffusion3ControlNetPipeline has no inpainting sibling "
                                                     "for its ControlNet"):
        generate(compiled, PROMPT, steps=2, seed=0, height=64, width=64, control=control, image=control,
                 mask=repaint_mask(64, 64))


@pytest.fixture(scope="module")
def sd35_large(tmp_path_factory):
    return loaded(tmp_path_factory, "cpu-tiny-sd35-large-controlnet")


@pytest.mark.slow
@pytest.mark.parametrize("call", [{}, {"controlnet_conditioning_scale": 0.5}, {"guidance_scale": 1.0},
                                  {"num_images_per_prompt": 2}], ids=["default", "scale", "unguided", "two-images"])
def test_sd35_large_controlnet_calls_match_eager(sd35_large, call):
    """SD3.5 Large's ControlNets (`use_pos_embed = false`: single-stream blocks, no text stream, no
    position embedding of their own) are compiled with the copy of the transformer's position
    embedding the pipeline hands them when it is made."""
    _, _, compiled, eager = sd35_large
    image = seeded_image(64, 64)
    same_as_eager(run_sd3, compiled, eager, ATOL, control_image=image, **call)
    without = run_sd3(compiled, control_image=image, controlnet_conditioning_scale=0.0)
    assert np.abs(run_sd3(compiled, control_image=image) - without).max() > 0.05


@pytest.mark.slow
def test_sd35_large_controlnet_takes_the_position_embedding_of_the_pipelines_transformer(sd35_large):
    """Every pipeline made with the compiled ControlNet hands it the position embedding of its
    transformer, as diffusers hands an eager one: another transformer's (from_pipe), which the
    compiled code then computes with, and the artifact's transformer's again; a ControlNet read from its
    checkpoint alone (which holds none) gets the compiled transformer's, and so does an eager one
    (read off the compiled transformer), one and two of them, all == eager."""
    _, built, compiled, eager = sd35_large
    cls = diffusers.StableDiffusion3ControlNetPipeline
    image = seeded_image(64, 64)
    transformer = _other_model(eager.transformer, 9)
    moved = cls.from_pipe(compiled, transformer=copy.deepcopy(transformer))
    assert torch.equal(moved.controlnet.state_dict()["pos_embed.proj.weight"], transformer.pos_embed.proj.weight)
    same_as_eager(run_sd3, moved, cls.from_pipe(eager, transformer=copy.deepcopy(transformer)), ATOL,
                  control_image=image)
    # diffusers' from_pipe shares the ControlNet: the first pipeline's now computes with the other
    # transformer's position embedding too, compiled as eager, until a pipeline hands it its own again
    same_as_eager(run_sd3, compiled, eager, ATOL, control_image=image)
    for pipe in (compiled, eager):
        cls.from_pipe(pipe)
    assert torch.equal(compiled.controlnet.state_dict()["pos_embed.proj.weight"],
                       eager.transformer.pos_embed.proj.weight)
    same_as_eager(run_sd3, compiled, eager, ATOL, control_image=image)
    other, second = (_other_model(eager.controlnet, seed) for seed in (7, 8))
    assert other.pos_embed is None  # as read from its checkpoint
    for controlnet in (other, [other, second]):
        reference = cls.from_pipe(eager, controlnet=copy.deepcopy(controlnet))
        scale = {"controlnet_conditioning_scale": [0.4, 0.9]} if isinstance(controlnet, list) else {}
        for pipe in (aotbuild.load_pipeline(built.folder, controlnet=copy.deepcopy(controlnet)),
                     cls.from_pipe(compiled, controlnet=copy.deepcopy(controlnet))):
            same_as_eager(run_sd3, pipe, reference, ATOL, control_image=[image] * (len(scale) and 2) or image,
                          **scale)


@pytest.mark.slow
@pytest.mark.parametrize("fixture, control", [
    ("sd35_large", {"control_image": seeded_image(64, 64)}),
    ("sd3_inpaint", {"control_image": seeded_image(64, 64), "control_mask": repaint_mask(64, 64)}),
], ids=["sd35-large", "sd3-inpainting"])
def test_sd3_controlnets_on_a_fine_tuned_checkpoint_and_another_scheduler(request, fixture, control, tmp_path):
    """`weights=` a fine-tuned base checkpoint (which holds no ControlNet) with a ControlNet of the
    user's: the compiled transformer runs the checkpoint's weights (and an SD3.5 Large ControlNet
    its transformer's position embedding), as the eager pipeline made of them; then another
    scheduler, and `.to()` the dtype the artifact computes, all == eager."""
    target, built, _, _ = request.getfixturevalue(fixture)
    base = eager_pipeline(target, seed=3).components
    diffusers.StableDiffusion3Pipeline(**{k: v for k, v in base.items() if k != "controlnet"}).save_pretrained(
        tmp_path / "finetune")
    other = _other_model(base["controlnet"], 7)
    compiled = aotbuild.load_pipeline(built.folder, weights=tmp_path / "finetune", controlnet=copy.deepcopy(other))
    reference = getattr(diffusers, target.pipeline)(**{**eager_pipeline(target, seed=3).components,
                                                       "controlnet": copy.deepcopy(other)})
    if fixture == "sd35_large":
        assert torch.equal(compiled.controlnet.state_dict()["pos_embed.proj.weight"],
                           base["transformer"].pos_embed.proj.weight)
    same_as_eager(run_sd3, compiled, reference, ATOL, **control)
    if fixture == "sd35_large":  # two, each handed the checkpoint's; and apply() on the user's own pipeline
        nets = [other, _other_model(base["controlnet"], 8)]
        two = {"control_image": [control["control_image"]] * 2, "controlnet_conditioning_scale": [0.4, 0.9]}
        reference_two = getattr(diffusers, target.pipeline)(**{**eager_pipeline(target, seed=3).components,
                                                               "controlnet": copy.deepcopy(nets)})
        same_as_eager(run_sd3, aotbuild.load_pipeline(built.folder, weights=tmp_path / "finetune",
                                                      controlnet=copy.deepcopy(nets)), reference_two, ATOL, **two)
        users = getattr(diffusers, target.pipeline)(**{**eager_pipeline(target, seed=3).components,
                                                       "controlnet": copy.deepcopy(other)})
        same_as_eager(run_sd3, aotbuild.apply(users, built.folder), reference, ATOL, **control)
    for pipe in (compiled, reference):
        pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=1.5)
    same_as_eager(run_sd3, compiled.to(torch.float32), reference, ATOL, **control)


@pytest.fixture(scope="module")
def sd3_inpaint(tmp_path_factory):
    return loaded(tmp_path_factory, "cpu-tiny-sd3-controlnet-inpaint")


@pytest.mark.slow
@pytest.mark.parametrize("call", [
    {}, {"controlnet_conditioning_scale": 0.5}, {"guidance_scale": 1.0}, {"num_images_per_prompt": 2},
    {"image_size": (40, 48)},
], ids=["default", "scale", "unguided", "two-images", "resized"])  # (the window: SD3's ControlNet test)
def test_sd3_inpainting_controlnet_calls_match_eager(sd3_inpaint, call):
    """SD3's inpainting ControlNet pipeline (Alimama's): the compiled VAE encoder encodes the masked
    image once per image (the pipeline repeats its latents for guidance), and the compiled
    ControlNet takes them with the mask; another mask repaints another image."""
    _, _, compiled, eager = sd3_inpaint
    call = dict(call)
    size = call.pop("image_size", (64, 64))
    got = same_as_eager(run_sd3, compiled, eager, ATOL, control_image=seeded_image(*size),
                        control_mask=repaint_mask(*size), **call)
    assert {compiled.controlnet.last_variant, compiled.transformer.last_variant, compiled.vae.encoder.last_variant} \
        == {"b2_64x64"}
    if not call and size == (64, 64):
        flipped = PIL.Image.fromarray(255 - np.asarray(repaint_mask(*size)))
        assert np.abs(run_sd3(compiled, control_image=seeded_image(*size), control_mask=flipped) - got).max() > 0.05


@pytest.mark.slow
def test_run_inpaints_through_sd3s_controlnet(sd3_inpaint, tmp_path):
    """`generate` (what `run` and `bench` call) gives the mask as the pipeline's control_mask, ==
    the pipeline called with it; a control image without a mask, or another image beside it, is
    refused in the call's terms; `aotbuild run --control-image --mask` makes the same image."""
    from click.testing import CliRunner

    from aotbuild.cli import main
    from aotbuild.generation.backends import generate

    _, built, compiled, eager = sd3_inpaint
    control, mask = seeded_image(64, 64), repaint_mask(64, 64)
    made = generate(compiled, PROMPT, steps=3, seed=0, height=64, width=64, guidance_scale=7.0, control=control,
                    mask=mask)
    want = run_sd3(eager, control_image=control, control_mask=mask, guidance_scale=7.0)
    np.testing.assert_allclose(np.asarray(made.images[0]) / 255, want[0], atol=1 / 255 + ATOL, rtol=0)
    with pytest.raises(aotbuild.AotbuildError, match="StableDiffusion3ControlNetInpaintingPipeline inpaints its "
                                                     "control image: give the mask of what it repaints"):
        generate(compiled, PROMPT, steps=2, seed=0, height=64, width=64, control=control)
    with pytest.raises(aotbuild.AotbuildError, match="inpaints its control image: it takes no other image"):
        generate(compiled, PROMPT, steps=2, seed=0, height=64, width=64, control=control, mask=mask, image=control)
    control.save(tmp_path / "photo.png")
    mask.save(tmp_path / "mask.png")
    result = CliRunner().invoke(main, ["run", "--artifact", str(built.folder), "--prompt", PROMPT, "--control-image",
                                       str(tmp_path / "photo.png"), "--mask", str(tmp_path / "mask.png"),
                                       "--guidance-scale", "7", "--steps", "3", "--height", "64", "--width", "64",
                                       "--batch", "1", "--output", str(tmp_path / "out.png")])
    assert result.exit_code == 0, result.output
    assert "inpainting" in result.output
    assert np.abs(np.asarray(PIL.Image.open(tmp_path / "out.png"), dtype=np.float32) / 255 - want[0]).max() \
        <= 1 / 255 + ATOL


@pytest.mark.slow
@pytest.mark.parametrize("fixture, control", [
    ("sd3", {"control_image": seeded_image(64, 64)}),
    ("sd3_inpaint", {"control_image": seeded_image(64, 64), "control_mask": repaint_mask(64, 64)}),
    ("sdxl_union", {"control_image": seeded_image(64, 64), "control_mode": 2}),
    ("sd35_large", {"control_image": seeded_image(64, 64)}),
], ids=["sd3", "sd3-inpainting", "sdxl-union", "sd35-large"])
def test_a_lora_on_the_denoiser_beside_sd3s_controlnets_and_a_union(request, fixture, control, tmp_path):
    """A LoRA loaded into the compiled pipeline goes to its denoiser, beside SD3's ControlNets and
    SDXL's ControlNet-Union as beside a plain ControlNet: == eager with the same LoRA, and not the
    image without it."""
    target, built, _, _ = request.getfixturevalue(fixture)
    compiled, eager, plain = aotbuild.load_pipeline(built.folder), eager_pipeline(target), eager_pipeline(target)
    lora = make_lora(eager, tmp_path, seed=1)
    for pipe in (compiled, eager):
        pipe.load_lora_weights(lora, adapter_name="made")
    call = run_sd3 if fixture.startswith("sd3") else run  # SD3's draw the control latents from the global generator
    got = same_as_eager(call, compiled, eager, ATOL, **control)
    assert np.abs(got - call(plain, **control)).max() > 1e-3  # the LoRA changes the image


@pytest.fixture(scope="module")
def sdxl_union(tmp_path_factory):
    return loaded(tmp_path_factory, "cpu-tiny-sdxl-controlnet-union")


@pytest.mark.slow
@pytest.mark.parametrize("call", [
    {"control_mode": 0}, {"control_mode": 3, "controlnet_conditioning_scale": 0.5},
    {"control_mode": [2], "control_guidance_start": 0.4}, {"control_mode": 1, "guidance_scale": 1.0},
    {"control_mode": 1, "guess_mode": True, "guidance_scale": 1.0},  # (with guidance diffusers' own call fails)
], ids=["mode0", "mode3-scale", "window", "unguided", "guess"])
def test_sdxl_controlnet_union_calls_match_eager(sdxl_union, call):
    """SDXL's ControlNet-Union (ControlNetUnionModel) with one control image: its control type's
    index is an input of the compiled code (every mode one model), scaled after as eager's."""
    _, _, compiled, eager = sdxl_union
    same_as_eager(run, compiled, eager, ATOL, control_image=seeded_image(64, 64), **call)
    assert isinstance(compiled.controlnet, diffusers.ControlNetUnionModel)


@pytest.mark.slow
def test_sdxl_controlnet_union_takes_the_mode_as_an_input(sdxl_union):
    """The ControlNet-Union's control type index reaches the compiled code: with everything else
    equal (the one-hot control_type too), each index gives eager's residuals, and another index
    other residuals; the img2img and inpainting siblings take the union as the text-to-image call."""
    _, _, compiled, eager = sdxl_union
    generator = torch.Generator("cpu").manual_seed(0)
    call = {"sample": torch.randn(2, 4, 32, 32, generator=generator), "timestep": torch.tensor(500.0),
            "encoder_hidden_states": torch.randn(2, 77, 64, generator=generator),
            "controlnet_cond": [torch.rand(2, 3, 64, 64, generator=generator)],
            "control_type": torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 2),
            "added_cond_kwargs": {"text_embeds": torch.randn(2, 32, generator=generator),
                                  "time_ids": torch.randn(2, 6, generator=generator)}, "return_dict": False}
    made = {}
    with torch.no_grad():
        for index in (0, 3):
            made[index] = compiled.controlnet(**call, control_type_idx=[index])
            want = eager.controlnet(**call, control_type_idx=[index])
            for got, expected in zip([*made[index][0], made[index][1]], [*want[0], want[1]], strict=True):
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (made[0][1] - made[3][1]).abs().max() > 1e-3
    for sibling, extras in ((diffusers.StableDiffusionXLControlNetUnionImg2ImgPipeline, {}),
                            (diffusers.StableDiffusionXLControlNetUnionInpaintPipeline,
                             {"mask_image": _inpaint_extras(1, 64, 64)["mask_image"]})):
        pipes = [sibling.from_pipe(p) for p in (compiled, eager)]
        same_as_eager(run, *pipes, ATOL, image=seeded_image(64, 64), control_image=seeded_image(64, 64),
                      control_mode=2, strength=0.8, **extras)


@pytest.mark.slow
def test_sdxl_controlnet_union_as_data_and_its_refusals(sdxl_union):
    """Another union of the architecture, and two in a MultiControlNetUnionModel (one image each),
    run as data; two control images for one union (weighed inside the model) are refused in the
    call's terms; the plain pipeline runs the UNet without residuals."""
    _, built, compiled, eager = sdxl_union
    other, second = (_other_model(eager.controlnet, seed) for seed in (7, 8))
    one = aotbuild.load_pipeline(built.folder, controlnet=copy.deepcopy(other))
    reference = diffusers.StableDiffusionXLControlNetUnionPipeline.from_pipe(eager, controlnet=other)
    same_as_eager(run, one, reference, ATOL, control_image=seeded_image(64, 64), control_mode=2)
    two = aotbuild.load_pipeline(built.folder, controlnet=[copy.deepcopy(other), copy.deepcopy(second)])
    assert isinstance(two.controlnet, diffusers.models.controlnets.MultiControlNetUnionModel)
    reference = diffusers.StableDiffusionXLControlNetUnionPipeline.from_pipe(eager, controlnet=[other, second])
    same_as_eager(run, two, reference, ATOL, control_image=[seeded_image(64, 64), seeded_image(48, 48)],
                  control_mode=[1, 3], controlnet_conditioning_scale=[0.6, 0.9])
    with pytest.raises(ValueError, match="this ControlNet-Union is compiled for one control image per call \\(with its "
                                         "control_mode\\); this call gives 2"):
        run(compiled, control_image=[seeded_image(64, 64), seeded_image(64, 64)], control_mode=[0, 2])
    with pytest.raises(ValueError, match="guess_mode with guidance: diffusers' ControlNet-Union pipeline gives the "
                                         "ControlNet the control types of both guidance halves"):
        run(compiled, control_image=seeded_image(64, 64), control_mode=1, guess_mode=True)
    same_as_eager(run, *(diffusers.StableDiffusionXLPipeline.from_pipe(p) for p in (compiled, eager)), ATOL)
    from aotbuild.generation.backends import generate  # what `run --control-mode` calls

    made = generate(compiled, PROMPT, steps=3, seed=0, height=64, width=64, guidance_scale=7.0,
                    control=seeded_image(64, 64), control_mode=3)
    want = run(eager, control_image=seeded_image(64, 64), control_mode=3, guidance_scale=7.0)
    np.testing.assert_allclose(np.asarray(made.images[0]) / 255, want[0], atol=1 / 255 + ATOL, rtol=0)
    with pytest.raises(aotbuild.AotbuildError, match="control mode 4: this ControlNet-Union has modes 0 to 3"):
        generate(compiled, PROMPT, steps=2, seed=0, height=64, width=64, control=seeded_image(64, 64), control_mode=4)
