"""Pipelines aotbuild has no entry for, built by capture (`pipelines.derived_spec`): PixArt-Sigma,
AuraFlow, Chroma, Flux.2 Klein (Qwen3 text encoder, its own VAE eager), FLUX.2 [dev] (Mistral 3
text encoder, embedded guidance), Z-Image (its transformer
takes a list per image and the prompt's real token count), Qwen-Image (the real token count,
true CFG) and Qwen-Image-Edit (the edited image's tokens before the prompt's), each compiled against
eager with the same seeds at every bucket and across its dynamic range (text lengths included),
guided and not, with the default call and LoRAs; what is not curated is said in the manifest, by
`inspect` and at load; and the shape relations export assumed are checked."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import diffusers
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

import aotbuild
from aotbuild.builder import build
from aotbuild.builder.capture import capture_prompt
from aotbuild.builder.targets import ShapeBucket, load_target
from aotbuild.cli import main
from aotbuild.errors import AotbuildError, BuildError, ShapeNotSupportedError, UnsupportedCallError
from aotbuild.generation.backends import generate
from aotbuild.runtime.load import UncuratedPipelineWarning
from aotbuild.spec.pipelines import UNCURATED, seeded_image

from .conftest import ROOT, TARGETS, TRANSFORMER_LORA_TARGETS, build_once, eager_pipeline, make_lora

pytestmark = pytest.mark.slow
ATOL = 1e-4  # images in [0, 1]; float32 compiled vs eager differ by ~1e-6
PROMPT = "a red fox in the snow"
FAMILIES = ("cpu-tiny-pixart-sigma", "cpu-tiny-auraflow", "cpu-tiny-chroma", "cpu-tiny-flux2-klein",
            "cpu-tiny-flux2-dev")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(target, build, compiled pipeline, eager pipeline), once per family."""
    target = load_target(TARGETS / f"{request.param}.toml")
    built = build_once(tmp_path_factory, target)
    with pytest.warns(UncuratedPipelineWarning, match=f"{target.pipeline} was built by capture"):
        compiled = aotbuild.load_pipeline(built.folder)
    return target, built, compiled, eager_pipeline(target)


def run(pipe, **call):
    call = {"num_inference_steps": 2, "output_type": "np", **call}
    return pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), **call).images  # Klein: image first


def both(family, **call):
    _, _, compiled, eager = family
    got, want = run(compiled, **call), run(eager, **call)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    return got


def test_compiled_matches_eager_at_every_bucket_and_across_the_range(family):
    """Guided and unguided, one image and the most each variant serves, at each bucket, at the
    dynamic range's corners and at a size inside it of another aspect."""
    target, _, compiled, _ = family
    sizes = [(b.batch, b.height, b.width, {}, f"b{b.batch}_{b.height}x{b.width}") for b in target.shapes]
    if target.dynamic:
        d, stride = target.dynamic, target.stride
        texts = d.get("max_sequence_length", [None, None])
        sizes += [(d["batch"][1], d["height"][0], d["width"][1], {"max_sequence_length": texts[0]}, "dynamic"),
                  (d["batch"][0], d["height"][1] - stride, d["width"][0] + stride,
                   {"max_sequence_length": texts[1]}, "dynamic")]
    for images, height, width, text, variant in sizes:
        text = {k: v for k, v in text.items() if v is not None}
        for guidance_scale in (target.guidance_scale, 1.0):
            for count in sorted({1, images}):
                both(family, height=height, width=width, num_images_per_prompt=count, guidance_scale=guidance_scale,
                     **text)
                assert compiled.transformer.last_variant == variant
                if "vae_decoder" in target.components:
                    assert compiled.vae.last_variant == variant


def test_what_is_not_curated_is_said(family):
    """The manifest, `aotbuild inspect` and the load (an `UncuratedPipelineWarning`, checked by the
    fixture) say the artifact was built by capture and what that did not test."""
    from .test_cli import invoke

    _, built, _, _ = family
    assert built.manifest["pipeline"] == {"curated": False, "note": UNCURATED}
    assert f"pipeline   {UNCURATED}\n" in invoke("inspect", str(built.folder)).output


def test_the_default_call(family):
    """`pipe(prompt)` makes the size the build recorded as served, as eager makes it at that size;
    where the call's signature fixes a size no variant covers (AuraFlow's 1024), it is refused."""
    _, built, compiled, eager = family
    sizes = built.manifest["runtime"]["default_pixels"]
    if sizes["served"] is None:
        with pytest.raises(ShapeNotSupportedError, match=rf"\(height={sizes['native']}, width={sizes['native']}, "):
            run(compiled)
        return
    got = run(compiled)
    want = run(eager, height=sizes["served"], width=sizes["served"])
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_aotbuild_run_and_bench_call_with_the_pipelines_own_defaults(family):
    """`aotbuild run` and `bench` (backends.generate) pass only the options given (PixArt-Sigma's
    negative prompt defaults to "" and crashed on the None they passed), and time every step
    (PixArt's call takes the older `callback`; its **kwargs swallowed `callback_on_step_end`)."""
    target, _, compiled, _ = family
    bucket = target.shapes[0]
    made = generate(compiled, PROMPT, steps=2, seed=0, height=bucket.height, width=bucket.width,
                    guidance_scale=target.guidance_scale)
    assert len(made.images) == 1 and made.images[0].size == (bucket.width, bucket.height)
    assert len(made.step_durations_s) == 2 and made.first_step_s < made.total_s


def test_more_images_than_compiled_are_refused_in_the_calls_terms(family):
    target, _, compiled, _ = family
    most = max([b.batch for b in target.shapes] + ([target.dynamic["batch"][1]] if target.dynamic else []))
    bucket = target.shapes[0]
    with pytest.raises(ShapeNotSupportedError, match=rf"num_images_per_prompt={most + 1}.*this artifact covers: "
                                                     rf"{bucket.height}x{bucket.width} px"):
        run(compiled, height=bucket.height, width=bucket.width, num_images_per_prompt=most + 1)


def loaded(tmp_path_factory, name: str):
    """(target, build, compiled pipeline, eager pipeline) of a tiny target built by capture."""
    target = load_target(TARGETS / f"{name}.toml")
    built = build_once(tmp_path_factory, target)
    with pytest.warns(UncuratedPipelineWarning):
        return target, built, aotbuild.load_pipeline(built.folder), eager_pipeline(target)


@pytest.fixture(scope="module")
def chroma(tmp_path_factory):
    target, _, compiled, eager = loaded(tmp_path_factory, "cpu-tiny-chroma")
    return target, compiled, eager


def test_a_call_breaking_a_relation_export_assumed_is_refused(chroma):
    """Chroma's attention mask spans the text and the image tokens: the dynamic model was exported
    assuming mask length = image tokens + 512 ("s0 + 512" in its entry), which the compiled code
    never checks. A direct call whose mask does not span both is refused, not run."""
    _, compiled, _ = chroma
    entry = next(v.entry for v in compiled.transformer.variants if v.entry["name"] == "dynamic")
    mask = next(leaf for leaf in entry["inputs"] if leaf["path"] == "attention_mask")
    tokens = next(leaf for leaf in entry["inputs"] if leaf["path"] == "hidden_states")
    assert mask["dims"][1]["expr"] == f"{tokens['dims'][1]['expr']} + 512"
    image_tokens = 144  # 48 x 48 px
    call = {"hidden_states": torch.randn(1, image_tokens, 16), "timestep": torch.tensor([0.5]),
            "encoder_hidden_states": torch.randn(1, 512, 32), "txt_ids": torch.zeros(512, 3),
            "img_ids": torch.zeros(image_tokens, 3), "return_dict": False}
    compiled.transformer(**call, attention_mask=torch.ones(1, 512 + image_tokens))  # consistent: runs
    with pytest.raises(ShapeNotSupportedError, match="no compiled variant for this call"):
        compiled.transformer(**call, attention_mask=torch.ones(1, 512 + image_tokens + 16))


def test_a_guidance_that_keeps_the_batch_is_captured_once(tmp_path_factory, chroma):
    """Chroma calls its transformer twice a step under guidance, at the images' batch: the build
    takes the guided run's calls for its unguided twin instead of running the pipeline again, and
    the artifact serves a call without guidance as eager does."""
    target, compiled, eager = chroma
    progress = [message for stage, message in build_once(tmp_path_factory, target).progress if stage == "capture"]
    taken = [m for m in progress if m.endswith("the guided run's calls (guidance did not double the batch)")]
    assert taken and all("unguided" in m for m in taken)
    assert not [m for m in progress if "unguided (batch x height x width)" in m]  # none ran
    np.testing.assert_allclose(run(compiled, guidance_scale=1.0, height=64, width=64),
                               run(eager, guidance_scale=1.0, height=64, width=64), atol=ATOL, rtol=0)


def test_chroma_img2img_through_from_pipe(chroma):
    """ChromaImg2ImgPipeline.from_pipe keeps the compiled transformer and VAE (derived too)."""
    target, compiled, eager = chroma
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    call = {"image": diffusers.utils.numpy_to_pil(image / 255.0)[0], "strength": 0.6, "height": 64, "width": 64}
    got = run(diffusers.ChromaImg2ImgPipeline.from_pipe(compiled), **call)
    want = run(diffusers.ChromaImg2ImgPipeline.from_pipe(eager), **call)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


@pytest.mark.early
def test_a_size_export_fixed_fails_the_build_naming_the_call(tmp_path):
    """ChromaTransformer2DModel makes torch.tensor([0] * batch): export turns it into a constant
    of the example's batch while calling the batch dynamic. A bucket of 2 images (one model for 1
    and 2) is refused at build, naming the call it cannot run, before any code is compiled."""
    target = load_target(TARGETS / "cpu-tiny-chroma.toml")
    target = dataclasses.replace(target, name="chroma-two", shapes=(ShapeBucket(2, 64, 64),), dynamic=None,
                                 components=("transformer",))
    with pytest.raises(BuildError, match=r"transformer b2_64x64: the exported program cannot run the call at "
                                         r"b2_64x64:one .*torch.export fixed a size that this call changes"):
        build(target, tmp_path)
    assert not any((tmp_path / "chroma-two").glob("*"))
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("name", ["cpu-tiny-auraflow", "cpu-tiny-chroma", "cpu-tiny-flux2-klein", "cpu-tiny-flux2-dev"])
def test_loras_through_diffusers_api(name, tmp_path, tmp_path_factory):
    """`pipe.load_lora_weights` (AuraFlow's, Flux's and Flux.2's LoRA mixins) on the compiled transformer of a
    pipeline built by capture: the image it makes is eager's with the same LoRA."""
    target = load_target(TARGETS / f"{name}.toml")
    with pytest.warns(UncuratedPipelineWarning):
        compiled = aotbuild.load_pipeline(build_once(tmp_path_factory, target).folder)
    eager, plain = eager_pipeline(target), eager_pipeline(target)
    lora = make_lora(eager, tmp_path, seed=1, alpha=64, targets=TRANSFORMER_LORA_TARGETS)
    for pipe in (compiled, eager):
        pipe.load_lora_weights(lora, adapter_name="made")
    got = both((target, None, compiled, eager), height=64, width=64)
    assert np.abs(got - run(plain, height=64, width=64)).max() > 1e-3  # the LoRA changes the image


@pytest.mark.parametrize("name", ["cpu-tiny-flux2-klein", "cpu-tiny-flux2-dev"])
def test_flux2_reference_images_are_served_where_their_tokens_fit(name, tmp_path_factory):
    """FLUX.2 edits reference images by joining their tokens to the output's in one sequence: the
    dynamic model, captured from text-to-image calls, serves edits with one or two references
    (FLUX.2 takes 64 px a side or more) whose tokens together fit its range (64-576) == eager; an
    edit beyond it is refused saying so."""
    _, _, compiled, eager = loaded(tmp_path_factory, name)
    for references, size in (([seeded_image(64, 64)], 64), ([seeded_image(64, 64), seeded_image(64, 64)], 32)):
        call = {"image": references, "height": size, "width": size}
        np.testing.assert_allclose(run(compiled, **call), run(eager, **call), atol=ATOL, rtol=0)
        assert compiled.transformer.last_variant == "dynamic"
    with pytest.raises(ShapeNotSupportedError, match=r"hidden_states \[1, 1152, 16\].*an edited image of 96x96 px "
                                                     r"adds its tokens to the output's"):
        run(compiled, image=[seeded_image(96, 96)], height=96, width=96)


def test_aotbuild_run_on_a_pipeline_built_by_capture(tmp_path, tmp_path_factory):
    """`aotbuild run` calls the pipeline by keyword (FLUX.2's call takes an image first), says the
    load's warnings in one line each, but not that the pipeline was built by capture (the build and
    `inspect` say it, once), and refuses an option the pipeline's call does not take."""
    from .test_cli import invoke

    folder = build_once(tmp_path_factory, load_target(TARGETS / "cpu-tiny-flux2-klein.toml")).folder
    common = ("run", "--artifact", str(folder), "--prompt", PROMPT, "--steps", "1", "--height", "64", "--width", "64",
              "--batch", "1", "--output", str(tmp_path / "fox.png"))
    result = subprocess.run([sys.executable, "-m", "aotbuild.cli", *common], capture_output=True, text=True,
                            cwd=ROOT)  # a process of its own: pytest would capture the warnings
    assert result.returncode == 0 and (tmp_path / "fox.png").is_file(), result.stderr
    assert "\nwarning: this artifact does not cover Flux2KleinPipeline's own default size" in "\n" + result.stderr
    assert "built by capture" not in result.stderr
    refused = invoke(*common, "--negative-prompt", "blur")
    assert refused.exit_code != 0
    assert "error: Flux2KleinPipeline takes no negative_prompt" in refused.output


@pytest.fixture(scope="module")
def z_image(tmp_path_factory):
    return loaded(tmp_path_factory, "cpu-tiny-z-image")[1:]


def tokens(pipe, prompt: str) -> int:
    """The prompt's real token count as Z-Image gives it to the transformer (chat template included)."""
    text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=True)
    return len(pipe.tokenizer(text).input_ids)


def test_z_image_text_length_is_the_prompts_real_token_count(z_image):
    """ZImagePipeline hands its transformer a list of per-image latents and each prompt's real tokens
    (no padding), a length that changes with every prompt: the dynamic model serves any length in
    its range (the range's ends reached by truncating a long prompt at max_sequence_length, and a
    prompt as written, a few words the most common of all), == eager, at sizes of either aspect."""
    _, compiled, eager = z_image
    fox = "a red fox in the snow " * 8
    assert 16 < tokens(eager, fox) < 500 and tokens(eager, "a red fox") == 14
    for size, prompt, text in [(64, fox * 20, 2), (64, fox * 20, 500), (32, fox, 512), (96, fox, 512),
                               (64, "a red fox", 512)]:
        call = {"height": size, "width": size, "guidance_scale": 0.0, "max_sequence_length": text}
        got = run_prompt(compiled, prompt, **call)
        np.testing.assert_allclose(got, run_prompt(eager, prompt, **call), atol=ATOL, rtol=0)
        assert compiled.transformer.last_variant == "dynamic"


def run_prompt(pipe, prompt, **call):
    return pipe(prompt=prompt, num_inference_steps=2, output_type="np",
                generator=torch.Generator("cpu").manual_seed(0), **call).images


def test_z_image_refusals_name_the_prompts_tokens_and_the_branch_export_took(z_image):
    """A text longer than the range is refused by its token count. Z-Image pads its image tokens
    to a multiple of 32 only when they are not one: the model was exported at a size that needs no
    padding, and export kept that branch as a guard on the sizes (recorded in the manifest,
    checked at every call): a size in the range that needs padding is refused naming it, never
    run on code that skips the padding."""
    built, compiled, eager = z_image
    dynamic = next(v for v in built.manifest["components"]["transformer"]["variants"] if v["name"] == "dynamic")
    assert any("% 32" in guard for guard in dynamic["guards"])
    long = "a red fox in the snow " * 82  # 504 tokens
    assert 500 < tokens(eager, long) < 512
    with pytest.raises(ShapeNotSupportedError, match=rf"transformer: text length {tokens(eager, long)} \(the "
                                                     r"prompt's tokens; max_sequence_length=512\) in this call; "
                                                     r"compiled: 2-500"):
        run_prompt(compiled, long, height=64, width=64, guidance_scale=0.0)
    # Images and guidance as the call asks for them (they were "args[0] key '1' is not an input").
    covered = r"this artifact covers: 64x64 px, 1 image, text length 512, without guidance only; 32-96x32-96 px"
    with pytest.raises(ShapeNotSupportedError, match=r"^transformer: no compiled variant for this call \(ZImagePipeline"
                                                     r"\(.*num_images_per_prompt=2.*\)\): 2 images at 64x64 px without "
                                                     r"guidance; none compiled for 2 images per call; " + covered):
        run_prompt(compiled, "a red fox", height=64, width=64, guidance_scale=0.0, num_images_per_prompt=2)
    with pytest.raises(ShapeNotSupportedError, match=r"^transformer: guidance_scale=4 needs the guided variants, which "
                                                     r"this artifact was built without"):
        run_prompt(compiled, "a red fox", height=64, width=64, guidance_scale=4.0)  # Z-Image guides above 0
    with pytest.raises(ShapeNotSupportedError, match=r"are in the range compiled, but break what the compiled code "
                                                     r"assumes of them: .*% 32.*, with s\d+ = height / 4 px and "
                                                     r"s\d+ = width / 4 px"):
        run_prompt(compiled, "a red fox in the snow " * 8, height=48, width=80, guidance_scale=0.0)


@pytest.mark.early
def test_guided_and_unguided_calls_of_other_structures_fail_the_build_naming_them(tmp_path):
    """Z-Image passes its transformer a list with an entry per image and guidance branch: one model
    cannot take its guided and unguided calls, and a target asking for both fails before export,
    naming the inputs and the way (not a bare traceback)."""
    target = load_target(TARGETS / "cpu-tiny-z-image.toml")
    target = dataclasses.replace(target, name="z-image-both", guidance="both", guidance_scale=4.0, dynamic=None,
                                 components=("transformer",))
    with pytest.raises(BuildError, match=r"transformer b1_64x64: the call at b1_64x64:unguided passes other inputs "
                                         r"than the example \(args\[0\]\.1, args\[2\]\.1\)") as raised:
        build(target, tmp_path)
    assert 'guidance = "guided" or "unguided"' in raised.value.hint


@pytest.mark.early
def test_constants_two_programs_name_alike_are_named_apart(tmp_path):
    """Each export names the tensors a forward makes from Python data from 0 (lifted_tensor_0, ...).
    Guided Z-Image's bucket (traced in Python) lifts its RoPE tables under those names, its dynamic
    model (traced again by TorchDynamo) boolean scalars under the same ones: one weights file bound
    the first program's tables into the second's code, which computed wrong images (relative error
    0.43). The build now names the second program's constants apart before compiling: guided
    Z-Image (base Z-Image's recipe, classifier-free guidance) == eager across its range."""
    target = load_target(TARGETS / "cpu-tiny-z-image.toml")
    target = dataclasses.replace(target, name="z-image-guided", guidance="guided", guidance_scale=4.0,
                                 dynamic={**target.dynamic, "max_sequence_length": [40, 500]},
                                 components=("transformer",))
    build(target, tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "z-image-guided" / "transformer.safetensors", "pt") as stored:
        assert {"lifted_tensor_0", "dynamic__lifted_tensor_0"} <= set(stored.keys())
    with pytest.warns(UncuratedPipelineWarning):
        compiled = aotbuild.load_pipeline(tmp_path / "z-image-guided")
    eager = eager_pipeline(target)
    fox = "a red fox in the snow " * 8
    for size, prompt, text in [(64, fox, 512), (32, fox * 20, 40), (96, fox * 20, 500)]:
        call = {"height": size, "width": size, "guidance_scale": 4.0, "max_sequence_length": text}
        np.testing.assert_allclose(run_prompt(compiled, prompt, **call), run_prompt(eager, prompt, **call),
                                   atol=ATOL, rtol=0)
        assert compiled.transformer.last_variant == "dynamic"
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.early
def test_a_range_whose_probes_break_a_branch_fails_the_build_naming_it(tmp_path):
    """Z-Image pads a caption of 512 tokens (a multiple of 32) by nothing, another branch than the
    example's (264, padded to 288): a range reaching it fails the build before compiling, naming
    the assumption and the call."""
    target = load_target(TARGETS / "cpu-tiny-z-image.toml")
    target = dataclasses.replace(target, name="z-image-short", components=("transformer",),
                                 dynamic={**target.dynamic, "max_sequence_length": [16, 512]})
    with pytest.raises(BuildError, match=r"transformer dynamic: the exported program assumes .* of its input sizes "
                                         r"\(a branch the model's code took at the example's sizes\), which the call "
                                         r"at dynamic:max breaks"):
        build(target, tmp_path)
    assert list(tmp_path.iterdir()) == []  # no artifact, no staging folder, no lock file


@pytest.fixture(scope="module")
def qwen_image(tmp_path_factory):
    return loaded(tmp_path_factory, "cpu-tiny-qwen-image")[2:]


def test_qwen_image_serves_prompts_as_written_and_true_cfg(qwen_image):
    """QwenImagePipeline trims each prompt to its real tokens (after dropping its template's): one
    dynamic model serves prompts as written, the range's ends (a long prompt truncated at
    max_sequence_length), and Qwen-Image's own guidance (true_cfg_scale with a negative prompt: a
    second transformer call of the negative's length), == eager; a shorter text is refused."""
    compiled, eager = qwen_image
    fox = "a red fox in the snow "
    for prompt, call in [(fox, {}), (fox * 40, {"max_sequence_length": 2}), (fox * 40, {"max_sequence_length": 500}),
                         (fox, {"true_cfg_scale": 4.0, "negative_prompt": "blurry"})]:
        call = {"height": 64, "width": 64, **call}
        np.testing.assert_allclose(run_prompt(compiled, prompt, **call), run_prompt(eager, prompt, **call),
                                   atol=ATOL, rtol=0)
        assert compiled.transformer.last_variant == "dynamic"
        assert compiled.vae.last_variant == "b1_64x64"  # the causal VAE's decoder, compiled for one frame
    with pytest.raises(ShapeNotSupportedError, match=r"transformer: text length 1 \(max_sequence_length=1\) in "
                                                     r"this call; compiled: 2-500, 512"):
        run_prompt(compiled, fox * 40, height=64, width=64, max_sequence_length=1)
    with pytest.raises(UnsupportedCallError, match=r"vae.decode\(\): 2 frames in this call; this artifact's "
                                                   r"vae_decoder is compiled for images \(one frame"):
        compiled.vae.decode(torch.zeros(1, 4, 2, 32, 32))
    with pytest.raises(AotbuildError, match=r"vae.enable_tiling\(\): aotbuild does not build tiles of "
                                            r"AutoencoderKLQwenImage"):
        compiled.vae.enable_tiling()


def test_qwen_image_edit_serves_prompts_as_written_and_refuses_other_sizes_in_their_terms(tmp_path_factory):
    """QwenImageEditPipeline (Qwen2.5-VL reads the image to edit; no torchvision here: the config
    set's processor is its image part and tokenizer): the edited image, resized to ~1 MP, adds its
    tokens to the output's, and the prompt's real tokens follow the image's in the text sequence,
    so the text range is recorded with that offset and one dynamic model serves prompts as
    written, guided by true CFG and not, == eager, and so does Qwen-Image-Edit-2509/2511's pipeline
    through from_pipe. An image of another aspect ratio, two images, the default (1 MP) output and
    a text shorter than the range are refused in the call's terms."""
    target, built, compiled, eager = loaded(tmp_path_factory, "cpu-tiny-qwen-image-edit")
    inputs = built.manifest["components"]["transformer"]["variants"][1]["inputs"]
    text = next(i["dims"][1] for i in inputs if i["path"] == "encoder_hidden_states")
    assert text["axis"] == "max_sequence_length" and text["offset"] > 100  # the template's and the image's tokens
    latents = next(i["dims"] for i in inputs if i["path"] == "hidden_states")
    assert latents == [1, 4 + 1024, 16]  # the output's 2x2 patches, then the image's, resized to 1024x1024 px
    square, fox = seeded_image(64, 64), "a red fox in the snow "
    for prompt, call in [("a fox", {}), (fox * 40, {}), (fox, {"true_cfg_scale": 4.0, "negative_prompt": "blurry"})]:
        call = {"image": square, "height": 64, "width": 64, **call}
        got = run_prompt(compiled, prompt, **call)
        np.testing.assert_allclose(got, run_prompt(eager, prompt, **call), atol=ATOL, rtol=0)
        assert compiled.transformer.last_variant == "dynamic"
    assert (compiled.vae.parts["encoder"].last_variant, compiled.vae.last_variant) == ("b1_1024x1024", "b1_64x64")
    # A 2:1 image: the encoder, compiled at the 1 MP the pipeline resizes a square image to, refuses
    # first; with the VAE eager, the transformer refuses the sizes it holds as constants.
    with pytest.raises(ShapeNotSupportedError, match=r"vae_encoder: no compiled variant for this call "
                                                     r"\(QwenImageEditPipeline\(height=64, width=64, .*\): args\[0\] "
                                                     r"\[1, 3, 1, 736, 1440\]; this artifact covers: 1024x1024 px, 1 "
                                                     r"image; QwenImageEditPipeline resizes the image to edit to "
                                                     r"~1024x1024 px at its own aspect ratio"):
        run_prompt(compiled, fox, image=seeded_image(64, 128), height=64, width=64)
    compiled_vae, compiled.vae = compiled.vae, eager.vae
    with pytest.raises(ShapeNotSupportedError, match=r"img_shapes .* is \(1, 2, 2\), \(1, 23, 45\) in this call "
                                                     r"\(QwenImageEditPipeline\(height=64, width=64\)\), compiled "
                                                     r"\(1, 2, 2\), \(1, 32, 32\).* resizes the image to edit to "
                                                     r"~1024x1024 px at its own aspect ratio"):
        run_prompt(compiled, fox, image=seeded_image(64, 128), height=64, width=64)
    compiled.vae = compiled_vae
    with pytest.raises(ShapeNotSupportedError, match=r"is \(1, 32, 32\), \(1, 32, 32\) in this call "
                                                     r"\(QwenImageEditPipeline\(height=1024, width=1024\)\)"):
        run_prompt(compiled, fox, image=square)
    with pytest.raises(ShapeNotSupportedError, match=r"text length 1 \(the prompt's tokens; max_sequence_length=512\) "
                                                     r"in this call; compiled: 2-500, 512"):
        run_prompt(compiled, "a", image=square, height=64, width=64)
    # Qwen-Image-Edit-2509/2511's pipeline (the same models; the text encoder sees the image at
    # 384x384 px, a list of images edited together) through from_pipe: one image as eager, two refused.
    plus, plus_eager = (diffusers.QwenImageEditPlusPipeline.from_pipe(p) for p in (compiled, eager))
    call = {"image": [square], "height": 64, "width": 64, "true_cfg_scale": 4.0, "negative_prompt": "blurry"}
    np.testing.assert_allclose(run_prompt(plus, fox, **call), run_prompt(plus_eager, fox, **call), atol=ATOL, rtol=0)
    assert plus.vae.parts["encoder"].last_variant == "b1_1024x1024"  # its VAE image: 1 MP too
    with pytest.raises(ShapeNotSupportedError, match=r"is \(1, 2, 2\), \(1, 32, 32\), \(1, 32, 32\) in this call "
                                                     r"\(QwenImageEditPlusPipeline\(height=64, width=64\)\), compiled "
                                                     r"\(1, 2, 2\), \(1, 32, 32\).* edits the images its target "
                                                     r"names \(a bucket's or \[dynamic\]'s `images`"):
        run_prompt(plus, fox, image=[square, square], height=64, width=64)


def test_qwen_image_edit_plus_edits_the_images_its_target_names(tmp_path_factory, tmp_path):
    """QwenImageEditPlusPipeline (Qwen-Image-Edit-2509/2511) edits a list of images together, each
    resized to ~1 MP at its own aspect ratio, their tokens in order after the output's: a bucket's
    or [dynamic]'s `images` names them. The dynamic model serves prompts as written editing a
    square and a 2:1 image together, with true CFG and without; the bucket edits one 2:1 image
    into a square output; the VAE encoder is compiled at each size an image is resized to; all ==
    eager, and so is `aotbuild run` given --image twice. Another order, count or aspect ratio is
    refused naming the sizes asked for and what the artifact covers."""
    target, built, compiled, eager = loaded(tmp_path_factory, "cpu-tiny-qwen-image-edit-plus")
    variants = {v["name"]: v for v in built.manifest["components"]["transformer"]["variants"]}
    assert set(variants) == {"b1_64x64_images64x128", "dynamic"}
    assert variants["dynamic"]["dynamic"]["images"] == [[64, 64], [64, 128]]
    latents = next(i["dims"] for i in variants["dynamic"]["inputs"] if i["path"] == "hidden_states")
    assert latents == [1, 4 + 32 * 32 + 23 * 45, 16]  # the output's 2x2 patches, then each image's at ~1 MP
    encoders = built.manifest["components"]["vae_encoder"]["variants"]
    assert sorted(v["name"] for v in encoders) == ["b1_1024x1024", "b1_736x1440"]
    square, wide, fox = seeded_image(64, 64), seeded_image(64, 128), "a red fox in the snow "
    for prompt, call in [("a fox", {}), (fox * 40, {}), (fox, {"true_cfg_scale": 4.0, "negative_prompt": "blurry"})]:
        call = {"image": [square, wide], "height": 64, "width": 64, **call}
        np.testing.assert_allclose(run_prompt(compiled, prompt, **call), run_prompt(eager, prompt, **call),
                                   atol=ATOL, rtol=0)
        assert compiled.transformer.last_variant == "dynamic"
    assert compiled.vae.parts["encoder"].last_variant == "b1_736x1440"  # the last image encoded: the 2:1 one
    # The bucket: the pipeline does not cut prompts, so it serves the token count it was captured at.
    call, captured = {"image": [wide], "height": 64, "width": 64}, capture_prompt(512)
    np.testing.assert_allclose(run_prompt(compiled, captured, **call), run_prompt(eager, captured, **call),
                               atol=ATOL, rtol=0)
    assert compiled.transformer.last_variant == "b1_64x64_images64x128"
    covers = (r"this artifact covers: 64x64 px editing a 64x128 px image, 1 image, text length 512; 64x64 px "
              r"editing 64x64 \+ 64x128 px images together, 1 image, text length 2-500")
    for images, asked in (([wide, square], r"\(1, 2, 2\), \(1, 23, 45\), \(1, 32, 32\)"),
                          ([square, wide, wide], r"\(1, 2, 2\), \(1, 32, 32\), \(1, 23, 45\), \(1, 23, 45\)"),
                          ([square], r"\(1, 2, 2\), \(1, 32, 32\)")):
        with pytest.raises(ShapeNotSupportedError, match=rf"img_shapes .* is {asked} in this call "
                                                         rf"\(QwenImageEditPlusPipeline\(height=64, width=64\)\), "
                                                         rf"compiled .* {covers}"):
            run_prompt(compiled, fox, image=images, height=64, width=64)
    # The images as compiled and a prompt beyond the range: refused for its text length, not its images.
    with pytest.raises(ShapeNotSupportedError, match=r"transformer: text length 601 \(the prompt's tokens; "
                                                     r"max_sequence_length=512\) in this call; compiled: 2-500, 512"):
        run_prompt(compiled, fox * 100, image=[square, wide], height=64, width=64)
    # The command line: --image twice edits both, in order.
    for i, picture in enumerate((square, wide)):
        picture.save(tmp_path / f"{i}.png")
    result = CliRunner().invoke(main, ["run", "--artifact", str(built.folder), "--prompt", fox, "--steps", "2",
                                       "--height", "64", "--width", "64", "--image", str(tmp_path / "0.png"),
                                       "--image", str(tmp_path / "1.png"), "--output", str(tmp_path / "out.png")])
    assert result.exit_code == 0, result.output
    want = generate(eager, fox, steps=2, seed=0, height=64, width=64, image=[square, wide],
                    guidance_scale=target.guidance_scale)
    got = np.asarray(Image.open(tmp_path / "out.png"), dtype=np.int16)
    assert np.abs(got - np.asarray(want.images[0], dtype=np.int16)).max() <= 1


@pytest.mark.parametrize(("name", "img2img", "call"), [
    ("cpu-tiny-z-image", "ZImageImg2ImgPipeline", {"guidance_scale": 0.0}),
    ("cpu-tiny-qwen-image", "QwenImageImg2ImgPipeline", {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}),
])
def test_z_image_and_qwen_image_as_diffusers_users_call_them(name, img2img, call, tmp_path, tmp_path_factory):
    """Another scheduler (shift 2), img2img through `from_pipe`, and a LoRA through diffusers' API on
    every attention projection, == eager. Qwen-Image's last block computes a text stream nothing
    reads: its to_add_out and txt_mlp are dead, so no compiled code binds them (the manifest's
    `unread`), and a LoRA on them changes nothing, as in eager (it was refused before)."""
    target, built, compiled, eager = loaded(tmp_path_factory, name)
    prompt, call = "a red fox in the snow " * 4, {"height": 64, "width": 64, **call}

    def same(compiled, eager, **more):
        got = run_prompt(compiled, prompt, **call, **more)
        np.testing.assert_allclose(got, run_prompt(eager, prompt, **call, **more), atol=ATOL, rtol=0)
        assert compiled.transformer.last_variant == "dynamic"
        return got

    for pipe in (compiled, eager):
        pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=2.0)
    same(compiled, eager)
    cls = getattr(diffusers, img2img)
    image = diffusers.utils.numpy_to_pil(np.random.default_rng(0).random((64, 64, 3)))[0]
    same(cls.from_pipe(compiled), cls.from_pipe(eager), image=image, strength=0.6)
    if "vae_encoder" in built.manifest["components"]:  # Qwen-Image's: the image is encoded compiled
        assert compiled.vae.parts["encoder"].last_variant == "b1_64x64"

    with pytest.warns(UncuratedPipelineWarning):
        compiled = aotbuild.load_pipeline(built.folder)
    eager, plain = eager_pipeline(target), eager_pipeline(target)
    lora = make_lora(eager, tmp_path, seed=1, alpha=64, targets=TRANSFORMER_LORA_TARGETS)
    for pipe in (compiled, eager):
        pipe.load_lora_weights(lora, adapter_name="made")
    got = same(compiled, eager)
    assert np.abs(got - run_prompt(plain, prompt, **call)).max() > 1e-3  # the LoRA changes the image
    unread = built.manifest["components"]["transformer"].get("unread", [])
    assert ("transformer_blocks.1.attn.to_add_out.weight" in unread) == (name == "cpu-tiny-qwen-image")


def test_checkpoints_with_weights_no_compiled_code_reads_bind(tmp_path, tmp_path_factory):
    """Every Qwen-Image checkpoint holds its last block's dead text stream, which no compiled code
    reads: `apply` (the pipeline's own weights), `weights=` and `load_state_dict` take such a
    checkpoint as eager does (they refused it as "another architecture" before). The fine-tune's
    VAE differs too: its weights run in the compiled AutoencoderKLQwenImage parts."""
    target, built, _, eager = loaded(tmp_path_factory, "cpu-tiny-qwen-image")
    call = {"height": 64, "width": 64}
    finetuned = eager_pipeline(target, seed=7)
    assert not all(torch.equal(a, b) for a, b in zip(finetuned.vae.decoder.state_dict().values(),
                                                     eager.vae.decoder.state_dict().values(), strict=True))
    expected = run_prompt(finetuned, PROMPT, **call)
    finetuned.save_pretrained(tmp_path / "finetune")
    with pytest.warns(UncuratedPipelineWarning):
        loaded_with = aotbuild.load_pipeline(built.folder, weights=tmp_path / "finetune")
    np.testing.assert_allclose(run_prompt(loaded_with, PROMPT, **call), expected, atol=ATOL, rtol=0)
    assert loaded_with.vae.last_variant == "b1_64x64"  # decoded by the compiled part
    with pytest.warns(UncuratedPipelineWarning):
        aotbuild.apply(finetuned, built.folder)
    np.testing.assert_allclose(run_prompt(finetuned, PROMPT, **call), expected, atol=ATOL, rtol=0)
    with pytest.warns(UncuratedPipelineWarning):
        compiled = aotbuild.load_pipeline(built.folder)
    eager, other = eager_pipeline(target), eager_pipeline(target, seed=7)
    state = other.transformer.state_dict()
    assert "transformer_blocks.1.attn.to_add_out.weight" in state
    for pipe in (compiled, eager):
        pipe.transformer.load_state_dict(state)
        pipe.vae.load_state_dict(other.vae.state_dict())
    np.testing.assert_allclose(run_prompt(compiled, PROMPT, **call), run_prompt(eager, PROMPT, **call), atol=ATOL,
                               rtol=0)


@pytest.mark.early
def test_flux2_vae_compiled_with_the_latent_statistics_of_each_checkpoint(tmp_path):
    """FLUX.2's AutoencoderKLFlux2 is AutoencoderKL's code plus a BatchNorm whose running statistics
    the pipeline reads to (de)normalize latents: its decoder is compiled, and the statistics are
    weights kept with it. A checkpoint with other statistics (a fine-tune) by `weights=` and by
    `apply` makes that checkpoint's images. (The encoder compiles the same way: `vae_encoder`.)"""
    from safetensors import safe_open

    target = load_target(TARGETS / "cpu-tiny-flux2-dev.toml")  # the decoder alone, at one bucket: the suite's time
    target = dataclasses.replace(target, name="flux2-vae", components=("vae_decoder",), dynamic=None)
    folder = build(target, tmp_path / "artifacts").folder
    with safe_open(folder / "vae_decoder.safetensors", "pt") as stored:
        assert {"bn.running_mean", "bn.running_var"} <= set(stored.keys())
    finetuned = eager_pipeline(target, seed=7)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        finetuned.vae.bn.running_mean.normal_(generator=generator)
        finetuned.vae.bn.running_var.uniform_(0.5, 2.0, generator=generator)
    call = {"height": 64, "width": 64, "num_images_per_prompt": 2}
    expected, statistics = run_prompt(finetuned, PROMPT, **call), finetuned.vae.bn.running_var.clone()
    finetuned.save_pretrained(tmp_path / "finetune")
    with pytest.warns(UncuratedPipelineWarning):
        with_weights = aotbuild.load_pipeline(folder, weights=tmp_path / "finetune")
    with pytest.warns(UncuratedPipelineWarning):
        aotbuild.apply(finetuned, folder)
    for pipe in (with_weights, finetuned):
        assert torch.equal(pipe.vae.bn.running_var, statistics)
        np.testing.assert_allclose(run_prompt(pipe, PROMPT, **call), expected, atol=ATOL, rtol=0)
        assert pipe.vae.last_variant == "b2_64x64"


@pytest.mark.early
def test_a_python_value_following_the_size_fails_a_range_naming_it(tmp_path):
    """QwenImageTransformer2DModel takes the image's size as a Python list (img_shapes): a range
    over sizes fails the build naming that input, before anything is exported."""
    target = load_target(TARGETS / "cpu-tiny-qwen-image.toml")
    target = dataclasses.replace(target, name="qwen-sizes", dynamic={**target.dynamic, "height": [32, 96]})
    with pytest.raises(BuildError, match=r"transformer dynamic: input img_shapes\.0\.0\.1 is 8 at dynamic:min and 16 "
                                         r"at the example: a Python value that follows the call's size"):
        build(target, tmp_path)


@pytest.mark.parametrize("name", ["cpu-tiny-qwen-image", "cpu-tiny-z-image", "cpu-tiny-chroma", "cpu-tiny-wan"])
def test_a_stand_ins_parameters_are_the_eager_models(name, tmp_path_factory):
    """By capture, the compiled code binds lifted constants too (rotary tables in complex64,
    Chroma's int64 indices) and no weight export dropped as dead (Qwen-Image's last text
    stream): parameters() and buffers() are still the eager model's, so code that takes a model's
    dtype or size from them gets the eager answer (it got complex64, and 145,456 parameters for
    89,328). A dead weight holds no values here: it is on the meta device."""
    target, built, compiled, eager = loaded(tmp_path_factory, name)
    ours, theirs = compiled.transformer, eager.transformer
    assert next(ours.parameters()).dtype == next(theirs.parameters()).dtype == torch.float32
    for named in ("named_parameters", "named_buffers"):
        got, want = (dict(getattr(model, named)()) for model in (ours, theirs))
        assert {n: (t.shape, t.dtype) for n, t in got.items()} == {n: (t.shape, t.dtype) for n, t in want.items()}
    assert ours.num_parameters() == theirs.num_parameters()
    unread = set(built.manifest["components"]["transformer"].get("unread", ()))
    assert {n for n, p in ours.named_parameters() if p.is_meta} == unread
    assert set(ours.state_dict()) == set(theirs.state_dict())


def test_an_img2img_pipeline_builds_by_capture_from_its_class(tmp_path_factory):
    """SDXL's img2img pipeline as a target of its own (`derived_spec`): captured starting from a
    seeded image at strength 1; its call reads `unet.add_embedding.linear_1.in_features`, kept on
    the stand-in. The compiled pipeline matches eager on img2img calls of other strengths, guided
    and not, and on another image."""
    target = load_target(TARGETS / "cpu-tiny-sdxl-img2img.toml")
    with pytest.warns(UncuratedPipelineWarning):
        compiled = aotbuild.load_pipeline(build_once(tmp_path_factory, target).folder)
    eager = eager_pipeline(target)
    assert compiled.unet.add_embedding.linear_1.in_features == eager.unet.add_embedding.linear_1.in_features
    for image, strength, guidance_scale in ((seeded_image(64, 64), 0.6, 5.0), (seeded_image(32, 96), 1.0, 1.0)):
        call = {"image": image.resize((64, 64)), "strength": strength, "guidance_scale": guidance_scale,
                "num_inference_steps": 3}
        np.testing.assert_allclose(run(compiled, **call), run(eager, **call), atol=ATOL, rtol=0)
