"""Video (Wan, LTX-Video, CogVideoX, built by capture): frames are a shape. A bucket names its frame count, the
transformer is compiled per bucket, the video VAE runs eager with its reason and measured share in
the manifest. Compiled == eager with the same seeds at every bucket, with guidance on and off; Wan
2.2's two experts each compiled on their own weights and switched at the boundary as eager switches
them, LoRAs per expert through diffusers' API; calls outside what was compiled are refused in the
call's terms; `aotbuild run` writes an MP4."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import aotbuild
from aotbuild.builder import build
from aotbuild.builder.targets import ShapeBucket, load_target
from aotbuild.cli import main
from aotbuild.errors import BuildError, ShapeNotSupportedError, TargetError
from aotbuild.spec.pipelines import seeded_image

from .conftest import TARGETS, build_once, eager_pipeline, make_lora, same_as_eager
from .test_targets import write_target

pytestmark = pytest.mark.slow
ATOL = 1e-4  # frames in [0, 1]; float32 compiled vs eager differ by ~1e-6
PROMPT = "a red fox running in the snow"


def _built(tmp_path_factory, name):
    """(target, build, compiled pipeline, eager pipeline)."""
    target = load_target(TARGETS / f"{name}.toml")
    built = build_once(tmp_path_factory, target)
    return target, built, aotbuild.load_pipeline(built.folder), eager_pipeline(target)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return _built(tmp_path_factory, "cpu-tiny-wan")


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    return _built(tmp_path_factory, "cpu-tiny-wan22")


def run(pipe, **call):
    """9 frames at 32x48 px (the first bucket) unless the call says otherwise."""
    call = {"height": 32, "width": 48, "num_frames": 9, "num_inference_steps": 2, "output_type": "np", **call}
    return pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), **call).frames


def both(compiled, eager, **call):
    return same_as_eager(run, compiled, eager, ATOL, **call)


def test_buckets_name_their_frames_and_the_vae_says_why_it_is_eager(wan):
    _, built, _, _ = wan
    variants = {v["name"]: aotbuild.runtime.variant_coverage(v)
                for v in built.manifest["components"]["transformer"]["variants"]}
    assert variants == {"b1_32x48_9f": "9 frames at 32x48 px, 1 video, text length 512",
                        "b1_32x32_5f": "5 frames at 32x32 px, 1 video, text length 512"}
    vae = built.manifest["eager"]["vae"]
    assert vae["class"] == "AutoencoderKLWan" and "not one of the VAEs whose decoder and encoder aotbuild compiles " \
        "(AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage)" in vae["reason"]
    for bucket in variants:  # measured at the build: the decode against 50 eager denoising steps (seconds to 1 us)
        share = vae["share"][bucket]
        assert share["steps"] == 50 and share["decode_s"] > 0 and share["denoiser_step_s"] > 0
        assert share["dtype"] == "float32"  # the target's: timed in the reference capture
        assert share["share"] == pytest.approx(share["decode_s"] / (share["decode_s"] + 50 * share["denoiser_step_s"]),
                                               abs=2e-4)
    assert built.manifest["validation"]["loop"]["steps"] == 1  # the target's validation_steps
    result = CliRunner().invoke(main, ["inspect", str(built.folder)])
    assert "loop       1 step at b1_32x48_9f, compiled vs eager float32" in result.output
    assert "eager      vae (AutoencoderKLWan) runs eager: AutoencoderKLWan is not one of the VAEs" in result.output
    assert "; measured eager float32 at build: " in result.output


def test_the_capture_decodes_only_where_it_times_the_decode(wan):
    """An eager VAE's decode is timed at each bucket's first capture (its share of a generation,
    above); another capture would stop at the latents (a video VAE's float32 decode takes minutes
    at real size: Wan 2.1 1.3B's at 480x832 px, 9 frames, ~4 min), and the unguided ones here do
    not run at all: Wan calls its transformer at the images' batch under guidance too, so they are
    the guided run's calls."""
    from aotbuild.builder.capturing import capture_all, eager_vae_record
    from aotbuild.builder.plan import plan_target
    from aotbuild.spec.pipelines import frames_step, pipeline_spec

    target = wan[0]
    pipe = eager_pipeline(target)
    spec = pipeline_spec(target.pipeline)
    specs = [spec.component(name) for name in target.components]
    points, plans = plan_target(target, spec, specs, pipe.vae, frames_step(pipe))
    decoded = []
    pipe.vae.decode = lambda latents, *args, decode=pipe.vae.decode, **kwargs: (
        decoded.append(tuple(latents.shape)), decode(latents, *args, **kwargs))[1]
    timed = eager_vae_record(pipe, spec, specs)["timed"]
    first = [plan.points[0] for plan in plans["transformer"]]
    _, _, seconds = capture_all(pipe, spec, specs, target, points, torch.device("cpu"), lambda stage, message: None,
                                timed=timed, timed_points=first)
    assert sorted(points) == ["b1_32x32_5f", "b1_32x32_5f:unguided", "b1_32x48_9f", "b1_32x48_9f:unguided"]
    assert decoded == [(1, 4, 5, 8, 12), (1, 4, 3, 8, 8)]  # the buckets' first points alone
    assert all(seconds[p]["decode"] > 0 for p in first)
    assert all(p not in seconds for p in points if p not in first)  # not run


@pytest.mark.parametrize("reference", ["float32", "bfloat16"])
def test_a_bf16_build_times_the_eager_vae_in_bf16_not_beside_the_float32_reference(tmp_path, monkeypatch, reference):
    """The eager VAE's share is timed in the target's dtype, as it decodes at generation: in the
    capture of the bf16 pipeline's example inputs, not in the float32 reference, which does not
    decode at all (at real size a video VAE's float32 decode sat beside the float32 pipeline: Wan
    2.1 1.3B's build peaked at 5.6x its weights). Its validation loads the artifact once, for the
    single calls and the loop alike: torch keeps a load's packed constants till the process ends.
    With `reference_dtype = "bfloat16"` no model is ever float32: the reference is the eager
    pipeline in bf16, which the compiled one is validated against and which times the decode."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from aotbuild.runtime.variant import CompiledVariant

    target = load_target(TARGETS / "cpu-tiny-wan.toml")
    target = dataclasses.replace(target, name="wan-bf16", dtype="bfloat16", shapes=target.shapes[1:],
                                 reference_dtype=reference)
    decoded, called = [], set()
    decode, forward = AutoencoderKLWan.decode, WanTransformer3DModel.forward
    monkeypatch.setattr(AutoencoderKLWan, "decode", lambda vae, latents, *args, **kwargs: (
        decoded.append((vae.dtype, tuple(latents.shape))), decode(vae, latents, *args, **kwargs))[1])
    monkeypatch.setattr(WanTransformer3DModel, "forward", lambda model, *args, **kwargs: (
        called.add(model.dtype), forward(model, *args, **kwargs))[1])
    opened = []
    open_variant = CompiledVariant.__init__
    monkeypatch.setattr(CompiledVariant, "__init__", lambda variant, package, entry, *args: (
        opened.append((package.name, entry["name"])), open_variant(variant, package, entry, *args))[1])
    built = build(target, tmp_path)
    assert decoded == [(torch.bfloat16, (1, 4, 3, 8, 8))]  # the bucket's first point, once
    assert opened == [("transformer.pt2", "b1_32x32_5f")]
    share = built.manifest["eager"]["vae"]["share"]["b1_32x32_5f"]
    assert share["dtype"] == "bfloat16" and share["decode_s"] > 0 and share["denoiser_step_s"] > 0
    assert called == {torch.bfloat16} if reference == "bfloat16" else {torch.float32, torch.bfloat16}
    numerics = built.manifest["components"]["transformer"]["variants"][0]["numerics"]
    assert numerics["reference"] == f"eager {reference}, unoptimized, every output"
    assert numerics["max_rel_error"] < (1e-2 if reference == "bfloat16" else 5e-2)
    assert built.manifest["validation"]["loop"]["reference"] == f"eager {reference}, unoptimized"
    assert ("reference_dtype" in built.manifest["target"]) == (reference == "bfloat16")
    result = CliRunner().invoke(main, ["inspect", str(built.folder)])
    assert "; measured eager bfloat16 at build: " in result.output, result.output
    assert f"compiled vs eager {reference}: final latents" in result.output, result.output
    assert (" (tol 0.05) vs eager bfloat16" in result.output) == (reference == "bfloat16"), result.output


def test_a_peer_that_cannot_convert_the_model_is_skipped_saying_why(wan, tmp_path):
    """OpenVINO has no rule for an operator Wan's transformer exports (`aten.empty_permuted`, from
    its rotary embedding's `empty_like`): the component bench times the rest and says why OpenVINO
    is not in it (the real-size Wan's bench stopped there on a bare traceback; OpenVINO is pinned in
    constraints.txt)."""
    _, built, _, _ = wan
    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.folder, artifacts / built.folder.name)

    def bench(cases):
        return CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-wan.toml"), "--artifacts",
                                         str(artifacts), "--component", "transformer", "--cases", cases,
                                         "--rounds", "1"])

    result = bench("aot,openvino,openvino-f32")
    assert result.exit_code == 0, result.output
    document = json.loads((artifacts / built.folder.name / "bench-transformer.json").read_text())
    reason = "openvino could not convert transformer: No conversion rule found for operations: aten.empty_permuted"
    assert list(document["runtimes"]) == ["aot"] and document["runtimes"]["aot"]["call_s"] > 0
    assert list(document["skipped"]) == ["openvino", "openvino-f32"]
    assert all(why.startswith(reason) for why in document["skipped"].values())
    assert f"openvino-f32: skipped, {reason}" in result.output
    result = bench("openvino")
    assert result.exit_code == 1 and f"error: nothing left to time: openvino: {reason}" in result.output
    assert "add case aot (or eager) to --cases" in result.output


@pytest.mark.parametrize(("call", "variant"), [
    ({}, "b1_32x48_9f"),
    ({"height": 32, "width": 32, "num_frames": 5}, "b1_32x32_5f"),
    ({"guidance_scale": 1.0}, "b1_32x48_9f"),  # no unconditional call
    ({"negative_prompt": "blurry", "num_inference_steps": 3}, "b1_32x48_9f"),
])
def test_compiled_videos_match_eager(wan, call, variant):
    _, _, compiled, eager = wan
    frames = both(compiled, eager, **call)
    assert frames.shape == (1, call.get("num_frames", 9), call.get("height", 32), call.get("width", 48), 3)
    assert compiled.transformer.last_variant == variant


def test_frames_or_videos_outside_the_buckets_are_refused_naming_them(wan):
    _, _, compiled, _ = wan
    covered = "this artifact covers: 9 frames at 32x48 px, 1 video, text length 512; 5 frames at 32x32 px"
    with pytest.raises(ShapeNotSupportedError, match=r"transformer: no compiled variant for this call "
                       r"\(WanPipeline\(height=32, width=48, num_frames=7, num_videos_per_prompt=1, .*" + covered):
        run(compiled, num_frames=7)
    with pytest.raises(ShapeNotSupportedError, match=r"num_frames=9, num_videos_per_prompt=2, .*\): 2 videos of 9 "
                                                     r"frames at 32x48 px, text length 512; none compiled for 2 "
                                                     r"videos per call; " + covered):
        run(compiled, num_videos_per_prompt=2)
    with pytest.raises(ShapeNotSupportedError, match=r"^transformer: text length 226 \(max_sequence_length=226\) in "
                                                     r"this call; compiled: 512; " + covered):
        run(compiled, max_sequence_length=226)  # CogVideoX's length: named as the call's


def test_wan22_experts_are_compiled_apart_and_switch_at_the_boundary_as_eager(wan22):
    """transformer (t >= boundary_ratio x 1000) and transformer_2 (the steps after), each its own
    weights; the same steps go to the same expert as in eager, at guidance on, off and a second
    guidance scale for the low-noise expert."""
    _, built, compiled, eager = wan22
    files = built.manifest["files"]
    assert files["transformer.safetensors"]["sha256"] != files["transformer_2.safetensors"]["sha256"]
    counts = {}
    for label, pipe in (("compiled", compiled), ("eager", eager)):
        for expert in ("transformer", "transformer_2"):
            counts[label, expert] = 0

            def count(module, args, kwargs, key=(label, expert)):
                counts[key] += 1
            getattr(pipe, expert).register_forward_pre_hook(count, with_kwargs=True)
    call = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 6}
    for extra in ({}, {"guidance_scale": 1.0, "guidance_scale_2": 1.0}, {"guidance_scale_2": 2.0}):
        both(compiled, eager, **call, **extra)
    assert counts["compiled", "transformer"] == counts["eager", "transformer"] > 0
    assert counts["compiled", "transformer_2"] == counts["eager", "transformer_2"] > 0
    assert compiled.transformer.last_variant == compiled.transformer_2.last_variant == "b1_32x32_5f"


def test_wan22_loras_per_expert_through_diffusers_api(wan22, tmp_path):
    """A LoRA into each expert (`load_into_transformer_2=True` for the low-noise one), as most Wan
    2.2 users run distillation LoRAs: compiled == eager, and each changes the video."""
    target, built, _, _ = wan22
    call = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 6}
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(target)
    plain = run(eager, **call)
    lora = make_lora(eager, tmp_path, seed=1, alpha=64, targets=("to_q", "to_k", "to_v", "to_out.0"))
    for pipe in (compiled, eager):
        pipe.load_lora_weights(lora, adapter_name="high")
    high = both(compiled, eager, **call)
    for pipe in (compiled, eager):
        pipe.load_lora_weights(lora, adapter_name="low", load_into_transformer_2=True)
    low = both(compiled, eager, **call)
    assert np.abs(high - plain).max() > 1e-3 and np.abs(low - high).max() > 1e-3


def test_wan22_other_checkpoints_bind_to_each_expert(wan22, tmp_path):
    """Another Wan 2.2 checkpoint (a fine-tune: other weights in both experts) by `weights=` and by
    `apply`: each expert binds its own weights from it, and the videos are that checkpoint's."""
    target, built, _, eager = wan22
    call = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 6}
    finetuned = eager_pipeline(target, seed=7)
    expected = run(finetuned, **call)
    assert np.abs(expected - run(eager, **call)).max() > 1e-3  # the fine-tune makes another video
    finetuned.save_pretrained(tmp_path / "finetune")
    loaded = aotbuild.load_pipeline(built.folder, weights=tmp_path / "finetune")
    aotbuild.apply(finetuned, built.folder)
    for pipe in (loaded, finetuned):
        np.testing.assert_allclose(run(pipe, **call), expected, atol=ATOL, rtol=0)
        assert pipe.transformer.last_variant == pipe.transformer_2.last_variant == "b1_32x32_5f"  # both compiled


def test_regional_mode_compiles_the_video_transformers_block_once(tmp_path_factory):
    """Wan's transformer regionally: its WanTransformerBlocks are one region compiled once (Wan 14B
    has 40 of them), the code between blocks eager; videos == eager, guided and not."""
    target, built, compiled, eager = _built(tmp_path_factory, "cpu-tiny-wan-regional")
    entry = built.manifest["components"]["transformer"]
    assert entry["mode"] == "regional"
    assert [(r["name"], len(r["instances"])) for r in entry["regions"]] == [("r0_WanTransformerBlock", 2)]
    for call in ({}, {"guidance_scale": 1.0}):
        both(compiled, eager, **call)
        assert compiled.transformer.last_variant == "b1_32x48_9f"


@pytest.mark.parametrize(("name", "size", "calls"), [
    ("cpu-tiny-ltx", {"height": 32, "width": 64, "num_frames": 9},
     ({}, {"guidance_scale": 1.0}, {"decode_timestep": 0.05, "decode_noise_scale": 0.025})),
    ("cpu-tiny-cogvideox", {"height": 32, "width": 32, "num_frames": 9},  # rotary position embeddings (5B's)
     ({}, {"guidance_scale": 1.0}, {"use_dynamic_cfg": True})),
])
def test_ltx_video_and_cogvideox_match_eager(tmp_path_factory, name, size, calls):
    """LTXPipeline and CogVideoXPipeline by capture, each batching the guided call: compiled ==
    eager with guidance on and off and each pipeline's own options. The stand-in returns what the
    transformer returns (a tuple without return_dict: the pipelines index it; LTX-Video's and Wan's
    forwards are annotated as returning a tensor)."""
    _, built, compiled, eager = _built(tmp_path_factory, name)
    variant = built.manifest["components"]["transformer"]["variants"][0]["name"]  # the bucket
    for call in calls:
        frames = both(compiled, eager, **size, max_sequence_length=16, **call)
        assert frames.shape == (1, size["num_frames"], size["height"], size["width"], 3)
        assert compiled.transformer.last_variant == variant
    seen = []
    handle = eager.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k), with_kwargs=True)
    run(eager, **size, max_sequence_length=16)
    handle.remove()
    inputs = {k: v for k, v in seen[0].items() if k != "return_dict"}
    for return_dict in (False, True):
        got = compiled.transformer(**inputs, return_dict=return_dict)
        want = eager.transformer(**inputs, return_dict=return_dict)
        assert type(got) is type(want)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)


def test_a_range_of_frames_and_sizes_matches_eager_and_says_what_it_covers(tmp_path_factory, tmp_path):
    """cpu-tiny-cogvideox's [dynamic] model: the latent frames, height, width and the rotary
    tables' length follow the call. Compiled == eager at the range's corners and inside it, with
    guidance (2 x 1 video) and without (1): guidance alone moves its batch. Outside the range, the
    refusal names frames; `inspect` shows the latent frames' dim. A LoRA through diffusers' API
    reaches the bucket and the range alike."""
    target, built, compiled, eager = _built(tmp_path_factory, "cpu-tiny-cogvideox")
    entry = built.manifest["components"]["transformer"]["variants"][1]
    assert aotbuild.runtime.variant_coverage(entry) == (
        "5-13 frames (1 + multiples of 4) at 32-64x32-64 px (multiples of 16), 1 video, text length 16, "
        "with and without guidance")
    batch, frames = ({k: v for k, v in dim.items() if k != "expr"} for dim in entry["inputs"][0]["dims"][:2])
    assert (batch, frames) == ({"axis": "batch", "factor": 1}, {"axis": "frames", "per": 4})  # hidden_states
    for height, width, frames in [(32, 32, 5), (64, 64, 13), (48, 32, 9), (32, 64, 13)]:
        for guidance_scale in (target.guidance_scale, 1.0):
            both(compiled, eager, height=height, width=width, num_frames=frames, guidance_scale=guidance_scale,
                 max_sequence_length=16)
            assert compiled.transformer.last_variant == "dynamic"
    with pytest.raises(ShapeNotSupportedError, match=r"num_frames=17, .*this artifact covers: 9 frames at 32x32 px, "
                                                     r".*; 5-13 frames \(1 \+ multiples of 4\) at 32-64x32-64 px"):
        run(compiled, height=32, width=32, num_frames=17, max_sequence_length=16)
    result = CliRunner().invoke(main, ["inspect", str(built.folder)])
    assert "hidden_states=[B, (F-1)/4+1, 4, H/8, W/8]" in result.output
    plain = run(eager, height=48, width=64, num_frames=13, max_sequence_length=16)
    lora = make_lora(eager, tmp_path, seed=3, targets=("to_q", "to_k", "to_v", "to_out.0"))
    for pipe in (compiled, eager):
        pipe.load_lora_weights(lora)
    for height, width, frames, variant in [(48, 64, 13, "dynamic"), (32, 32, 9, "b1_32x32_9f_text16")]:
        both(compiled, eager, height=height, width=width, num_frames=frames, max_sequence_length=16)
        assert compiled.transformer.last_variant == variant
    assert np.abs(run(compiled, height=48, width=64, num_frames=13, max_sequence_length=16) - plain).max() > 1e-2


def test_ltx_video_runs_at_its_buckets_text_length_and_refuses_another_frame_rate(tmp_path_factory, tmp_path):
    """`aotbuild run` calls the pipeline at the bucket's text length (16, not LTXPipeline's 128).
    LTX-Video's frame_rate sets the transformer's rope scale, a constant of the compiled code:
    another frame rate is refused in the call's terms, not computed at the built one."""
    _, built, compiled, _ = _built(tmp_path_factory, "cpu-tiny-ltx")
    result = CliRunner().invoke(main, ["run", "--artifact", str(built.folder), "--prompt", PROMPT, "--steps", "2",
                                       "--output", str(tmp_path / "fox.mp4")])
    assert result.exit_code == 0, result.output
    assert "1 video(s) of 9 frames" in result.output and (tmp_path / "fox.mp4").stat().st_size > 0
    with pytest.raises(ShapeNotSupportedError, match=r"transformer: LTXPipeline's frame_rate=24 sets "
                       r"rope_interpolation_scale key '0' to 0.0833\d*, compiled at 0.08; this artifact serves the "
                       r"frame_rate it was built at \(the call's default\)"):
        run(compiled, height=32, width=64, max_sequence_length=16, frame_rate=24)
    # Frames and pixels as the call asks for them (they were said in latent units: "'num_frames' is 9 in
    # this call and 5 in the compiled transformer", "'height' is 16 ... and 8").
    covered = r"this artifact covers: 9 frames at 32x64 px, 1 video, text length 16, with and without guidance"
    for call, asked in [({"num_frames": 17}, r"1 video of 17 frames at 32x64 px with guidance, text length 16; "
                                             r"none compiled for 17 frames"),
                        ({"height": 64}, r"1 video of 9 frames at 64x64 px with guidance, text length 16; none "
                                         r"compiled for 64x64 px")]:
        with pytest.raises(ShapeNotSupportedError, match=r"^transformer: no compiled variant for this call "
                                                         rf"\(LTXPipeline\(.*\)\): {asked}; {covered}\n"):
            run(compiled, **{"height": 32, "width": 64, "max_sequence_length": 16, **call})


def test_a_size_the_pipeline_refuses_fails_the_build_in_its_words(tmp_path):
    """LTXPipeline takes sizes in 32s whatever its VAE: a bucket of 32x48 fails at capture with
    the pipeline's own reason and the call, and leaves nothing behind."""
    target = load_target(TARGETS / "cpu-tiny-ltx.toml")
    bucket = ShapeBucket(1, 32, 48, max_sequence_length=16, frames=9)
    target = dataclasses.replace(target, name="ltx-48", shapes=(bucket,))
    with pytest.raises(BuildError, match=r"LTXPipeline refuses the call the target asks for \(height=32, width=48, "
                                         r"num_frames=9\): `height` and `width` have to be divisible by 32"):
        build(target, tmp_path)
    assert not any((tmp_path / "ltx-48").glob("*"))


def test_run_writes_an_mp4_of_the_buckets_frames(wan, tmp_path):
    _, built, _, _ = wan
    imageio = pytest.importorskip("imageio.v3")
    artifacts = built.folder.parent
    out = tmp_path / "fox.mp4"
    result = CliRunner().invoke(main, ["run", "--target", str(TARGETS / "cpu-tiny-wan.toml"), "--artifacts",
                                       str(artifacts), "--prompt", PROMPT, "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 video(s) of 9 frames" in result.output
    assert imageio.imread(out).shape == (9, 32, 48, 3)  # frames, height, width, RGB: read back
    result = CliRunner().invoke(main, ["run", "--target", str(TARGETS / "cpu-tiny-wan.toml"), "--artifacts",
                                       str(artifacts), "--prompt", PROMPT, "--frames", "8"])
    assert result.exit_code == 1 and "WanPipeline makes 1 + a multiple of 2 frames (its VAE's temporal " \
        "compression), not 8" in result.output and "ask for 7 or 9 frames" in result.output
    result = CliRunner().invoke(main, ["run", "--target", str(TARGETS / "cpu-tiny-wan.toml"), "--artifacts",
                                       str(tmp_path / "no-artifacts"), "--prompt", PROMPT, "--output",
                                       str(tmp_path / "fox.png")])  # refused before anything loads
    assert result.exit_code == 1 and "WanPipeline makes videos: use a .mp4 file name" in result.output
    assert not (tmp_path / "fox.png").exists()


def test_image_to_video_matches_eager_from_any_image_size(tmp_path_factory, tmp_path):
    """WanImageToVideoPipeline by capture (captured with a seeded image): the image is resized to
    the call's size and its latents join the transformer's input on the channels, its CLIP
    embeddings (cropped to the encoder's size) are attended to, so one bucket serves images of
    every size; compiled == eager, guided and not. `aotbuild run --image` makes an MP4 from it,
    and without an image says it needs one."""
    target, built, compiled, eager = _built(tmp_path_factory, "cpu-tiny-wan-i2v")
    inputs = [leaf["path"] for leaf in built.manifest["components"]["transformer"]["variants"][0]["inputs"]]
    assert "encoder_hidden_states_image" in inputs  # Wan 2.1's form: the CLIP image embeddings
    for image, extra in ((seeded_image(32, 48), {}), (seeded_image(40, 24), {}), (seeded_image(32, 48),
                                                                                   {"guidance_scale": 1.0})):
        both(compiled, eager, image=image, **extra)
        assert compiled.transformer.last_variant == "b1_32x48_9f"
    seeded_image(64, 64).save(tmp_path / "first.png")
    command = ["run", "--target", str(TARGETS / "cpu-tiny-wan-i2v.toml"), "--artifacts", str(built.folder.parent),
               "--prompt", PROMPT]
    result = CliRunner().invoke(main, [*command, "--image", str(tmp_path / "first.png"),
                                       "--output", str(tmp_path / "fox.mp4")])
    assert result.exit_code == 0, result.output
    assert "image-to-video" in result.output and "1 video(s) of 9 frames" in result.output
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 1
    assert "WanImageToVideoPipeline needs an image: give one (--image), it makes a video from it" in result.output
    result = CliRunner().invoke(main, ["serve", "--artifact", str(built.folder)])  # refused before Ray starts
    assert result.exit_code == 1
    assert "WanImageToVideoPipeline needs an image in every call, and aotbuild serve serves" in result.output


def test_frames_in_targets_are_checked(tmp_path):
    (tmp_path / "configs").mkdir()
    for name in ("tiny-wan", "tiny-sdxl"):
        (tmp_path / "configs" / name).symlink_to(TARGETS / "configs" / name)
    text = (TARGETS / "cpu-tiny-wan.toml").read_text().replace('name = "cpu-tiny-wan"', 'name = "t"')
    path = write_target(tmp_path, text.replace("frames = 9", "frames = 8"))
    with pytest.raises(TargetError, match=r"'shapes\[0\].frames' = 8: WanPipeline makes 1 \+ a multiple of 2 frames "
                                          r"\(its VAE's temporal compression\); 7 or 9 would be built"):
        load_target(path)
    with pytest.raises(TargetError, match=r"'shapes\[1\]': WanPipeline makes videos: give its frames"):
        load_target(write_target(tmp_path, text.replace("frames = 5\n", "")))
    wan22 = (TARGETS / "cpu-tiny-wan22.toml").read_text().replace('name = "cpu-tiny-wan22"', 'name = "t"')
    (tmp_path / "configs" / "tiny-wan22").symlink_to(TARGETS / "configs" / "tiny-wan22")
    with pytest.raises(TargetError, match=r"'compile.mode' = \"regional\" compiles the blocks of one denoiser, and "
                                          r"\[components\] has 2 \(transformer, transformer_2: Wan 2.2's experts\)"):
        load_target(write_target(tmp_path, wan22 + '\n[compile]\nmode = "regional"\n'))
    ranged = text + "\n[dynamic]\nbatch = [1, 1]\nheight = [32, 64]\nwidth = [32, 64]\n"
    with pytest.raises(TargetError, match=r"'dynamic' needs batch, height, width, frames \(and optionally") as raised:
        load_target(write_target(tmp_path, ranged))
    assert raised.value.hint == "WanPipeline makes videos: give the range of its frames (the call's num_frames)"
    with pytest.raises(TargetError, match=r"'dynamic.frames bound 8' = 8: WanPipeline makes 1 \+ a multiple of 2"):
        load_target(write_target(tmp_path, ranged + "frames = [5, 8]\n"))
    assert load_target(write_target(tmp_path, ranged + "frames = [5, 9]\n")).dynamic["frames"] == [5, 9]
    with pytest.raises(TargetError, match=r"height' = 40 is not a multiple of 16, .*and the multiple "
                                          r"WanPipeline checks"):  # its own check: 16, above the tiny model's 8
        load_target(write_target(tmp_path, text.replace("height = 32\nwidth = 48", "height = 40\nwidth = 48")))
    sdxl = (TARGETS / "cpu-tiny-sdxl.toml").read_text().replace('name = "cpu-tiny-sdxl"', 'name = "t"')
    sdxl = sdxl.replace("width = 64\n", "width = 64\nframes = 9\n", 1)
    with pytest.raises(TargetError, match=r"'shapes\[0\].frames': StableDiffusionXLPipeline makes images"):
        load_target(write_target(tmp_path, sdxl))
    sdxl = sdxl.replace("width = 64\nframes = 9\n", "width = 64\n", 1)
    sdxl = sdxl.replace("batch = [1, 3]", "batch = [1, 3]\nframes = [5, 9]")
    with pytest.raises(TargetError, match=r"'dynamic.frames': StableDiffusionXLPipeline makes images"):
        load_target(write_target(tmp_path, sdxl))
    bucket = load_target(write_target(tmp_path, text)).shapes[0]
    assert (bucket.frames, str(bucket)) == (9, "1x32x48/9frames")
    assert json.loads(json.dumps(load_target(write_target(tmp_path, text)).to_dict()))["shapes"][0]["frames"] == 9


def test_a_component_the_source_does_not_hold_is_refused_before_the_capture(tmp_path):
    """Wan 2.2's pipeline class takes a second expert; a Wan 2.1 source holds none (None in its
    model_index.json): a target naming it is refused by name, before anything runs."""
    target = load_target(TARGETS / "cpu-tiny-wan.toml")
    target = dataclasses.replace(target, components=(*target.components, "transformer_2"))
    with pytest.raises(BuildError, match=r"components.transformer_2: random:tiny-wan has no transformer_2 \(its "
                                         r"model_index.json holds none\)"):
        build(target, tmp_path)
    assert not (tmp_path / target.name).exists()
