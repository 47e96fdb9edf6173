"""Target parsing and validation: every kind of bad input is a TargetError naming file and key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from aotbuild.builder.targets import Target, list_targets, load_target
from aotbuild.cli import main
from aotbuild.errors import AotbuildError, TargetError

from .conftest import TARGETS

GOOD = """
name = "t"
pipeline = "StableDiffusionXLPipeline"
source = "random:tiny-sdxl"
device = "cpu"
[[shapes]]
batch = 1
height = 64
width = 64
[components]
unet = {}
"""


def write_target(tmp_path: Path, text: str, name: str = "t") -> Path:
    (tmp_path / "configs").mkdir(exist_ok=True)
    link = tmp_path / "configs" / "tiny-sdxl"
    if not link.exists():
        link.symlink_to(TARGETS / "configs" / "tiny-sdxl")
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def test_shipped_targets_parse_and_list():
    targets = {t.name: t for t in list_targets(TARGETS)}
    assert {"cpu-tiny-sdxl", "h100-sdxl", "a100-sdxl", "h100-sdxl-fp8", "h100-flux-dev", "h100-sd3-medium",
            "a100-sd15", "cpu-tiny-sd15", "cpu-tiny-sd3", "cpu-tiny-flux"} <= set(targets)
    assert targets["h100-flux-dev"].pipeline == "FluxPipeline" and targets["h100-flux-dev"].dynamic["height"] == [
        512, 1536]
    assert targets["a100-sd15"].dtype == "float16" and targets["h100-sd3-medium"].components[0] == "transformer"
    h100 = targets["h100-sdxl"]
    assert h100.device == "cuda" and h100.gpu.capability == "9.0" and h100.dtype == "bfloat16"
    assert len(h100.revision) == 40 and int(h100.revision, 16) >= 0
    assert [str(s) for s in h100.shapes] == ["1x1024x1024", "1x768x1344"]
    tiny = targets["cpu-tiny-sdxl"]
    assert len(tiny.shapes) >= 2 and tiny.components == ("unet", "vae_decoder", "vae_encoder")
    assert tiny.guidance == "both" and targets["cpu-tiny-sdxl-int8"].guidance == "guided"
    assert targets["cpu-tiny-sd15"].tiling == ("vae_decoder", "vae_encoder")


def test_every_shipped_target_serves_the_pipelines_default_call():
    """`pipe(prompt)` works as shipped: a bucket (or the dynamic range) covers the size the pipeline
    makes by default, or there is a square bucket the compiled pipeline defaults to instead."""
    import inspect

    import diffusers

    from aotbuild.runtime.sources import local_folder, read_configs
    from aotbuild.spec.pipelines import pipeline_spec

    hub_defaults = {"StableDiffusionPipeline": 512}  # SD 1.5 base; SDXL, SD3 and Flux make 1024 px
    # CogVideoX's call defaults to its transformer's sample size: the 5B's 60x90 latents x 8, 13 x 4 + 1 frames.
    video_defaults = {"CogVideoXPipeline": (480, 720, 49)}
    for target in list_targets(TARGETS):
        if target.shapes[0].frames:  # a video: the call's own default (Wan: 81 frames at 480x832 px)
            defaults = inspect.signature(getattr(diffusers, target.pipeline).__call__).parameters
            native = video_defaults.get(target.pipeline) or tuple(
                defaults[a].default for a in ("height", "width", "num_frames"))
            # A tiny CPU video target cannot afford Wan's default (131k tokens): its refusal names it; a
            # random-weight device check (h200-wan-random) times a shorter clip within the device's budget.
            assert target.device == "cpu" or target.source.startswith("random:") or any(
                (b.height, b.width, b.frames) == native for b in target.shapes), target.name
            continue
        folder = local_folder(target.source, target.base_dir)
        read_default = pipeline_spec(target.pipeline).default_pixels  # None: read from the pipeline at build
        native = (read_default(read_configs(folder)) if read_default else None) if folder else \
            hub_defaults.get(target.pipeline, 1024)
        covered = any(b.height == b.width == native for b in target.shapes) or bool(
            native and target.dynamic and all(target.dynamic[a][0] <= native <= target.dynamic[a][1]
                                              for a in ("height", "width")))
        assert covered or any(b.height == b.width for b in target.shapes), target.name


@pytest.mark.parametrize("name", ["h100-sdxl", "cpu-tiny-sd15", "cpu-tiny-sdxl-int8", "cpu-tiny-wan"])
def test_round_trip_through_dict(name):
    target = load_target(TARGETS / f"{name}.toml")
    again = Target.from_dict(target.to_dict(), base_dir=target.base_dir)
    assert again == target and again.content_hash() == target.content_hash()


def test_lookup_by_name_lists_known(tmp_path):
    write_target(tmp_path, GOOD)
    assert load_target("t", targets_dir=tmp_path).name == "t"
    with pytest.raises(TargetError, match=r"no target named 'nope' in ") as refused:
        load_target("nope", targets_dir=tmp_path)
    assert refused.value.hint == "aotbuild targets lists the 1 there; or give the path of a target's TOML file"
    with pytest.raises(TargetError) as refused:
        load_target("cpu-tiny-sdx")
    assert refused.value.hint.startswith("did you mean cpu-tiny-sdxl? aotbuild targets lists the ")


BAD = [
    ('validation_steps = 0\n' + GOOD, r"'validation_steps' = 0: the build's denoising loop takes at least 1 step"),
    ('validation_steps = 1.5\n' + GOOD, r"'validation_steps' must be a whole number of denoising steps"),
    ('reference_dtype = "bfloat16"\n' + GOOD, r"'reference_dtype' = 'bfloat16': the build compares the compiled "
     r"pipeline with the eager one in float32, or in bfloat16 for a bfloat16 target"),
    ('dtype = "float16"\nreference_dtype = "float16"\n' + GOOD,
     r"'reference_dtype' = 'float16': the build compares"),
    ('colour = "red"\n' + GOOD, r"unknown key 'colour'; allowed: name, description"),
    (GOOD.replace('pipeline = "StableDiffusionXLPipeline"\n', ""), r"missing required key 'pipeline'"),
    (GOOD.replace("height = 64", "height = 66"), r"'shapes\[0\].height' = 66 is not a multiple of 4"),
    (GOOD.replace("height = 64", "height = 0"), r"'shapes\[0\].height' must be positive"),
    (GOOD.replace("unet = {}", "text_encoder = {}"), r"components.text_encoder.*allowed: unet, vae_decoder"),
    (GOOD.replace("StableDiffusionXLPipeline", "FooPipeline"),
     r"'FooPipeline' is neither one aotbuild knows \(Stable.*nor a diffusers pipeline"),
    (GOOD.replace('device = "cpu"', 'device = "cpu"\ngpu = { name = "H100", capability = "9.0" }'),
     r"'gpu' is only allowed with device = \"cuda\""),
    (GOOD.replace('device = "cpu"', 'device = "cuda"'), r"needs key 'gpu'"),
    (GOOD.replace('device = "cpu"', 'device = "tpu"'), r"'device' is 'tpu'; allowed: cpu, cuda"),
    (GOOD.replace('device = "cpu"', 'device = "cuda"\ngpu = { name = "A100", capability = "8.0", ptx = true }'),
     r"'gpu' needs name and capability \(and optionally multi_arch\), got \['capability', 'name', 'ptx'\]"),
    (GOOD.replace('device = "cpu"', 'device = "cuda"\ngpu = { name = "A100", capability = "8.0", multi_arch = 1 }'),
     r"'gpu.multi_arch' must be true or false, got 1"),
    (GOOD.replace('device = "cpu"', 'device = "cpu"\ncuda_graphs = true'),
     r"'cuda_graphs' is only allowed with device = \"cuda\""),
    (GOOD.replace('device = "cpu"',
                  'device = "cuda"\ngpu = { name = "H100", capability = "9.0" }\ncuda_graphs = "yes"'),
     r"'cuda_graphs' must be true or false, got 'yes'"),
    (GOOD.replace('device = "cpu"', 'device = "cpu"\ndtype = "int3"'), r"'dtype' is 'int3'; allowed: float32"),
    (GOOD + "[optimize]\nturbo = true\n", r"unknown key 'optimize.turbo'; known passes: tf32, sdpa, fuse_qkv"),
    (GOOD + '[optimize]\nsdpa = "flash"\n', r"optimize.sdpa = 'flash' needs CUDA"),
    (GOOD + "[optimize]\nfuse_qkv = 1\n", r"optimize.fuse_qkv must be true or false"),
    (GOOD.replace('device = "cpu"', 'device = "cuda"\ngpu = { name = "H100", capability = "9.0" }')
     + "[optimize]\nprepack = true\n", r"optimize.prepack is for CPU targets"),
    (GOOD + '[optimize]\nprepack = true\nquantize = "int8_dynamic"\n',
     r"optimize.prepack does not combine with optimize.quantize"),
    (GOOD + '[optimize]\nprepack = true\n[compile]\nmode = "regional"\n',
     r"'compile.mode' = \"regional\" does not combine with optimize.prepack"),
    (GOOD + "[inductor]\nfreezing = true\n", r"\[inductor\] key 'freezing' is set by aotbuild"),
    (GOOD + '[optimize]\nprepack = true\n[inductor]\nprofile = "max-autotune"\n',
     r"\[inductor\] max_autotune on a CPU target: inductor's CPU GEMM templates pack the weights"),
    (GOOD + "[inductor]\nmax_autotune_gemm = true\n", r"max_autotune on a CPU target"),
    (GOOD.replace('source = "random:tiny-sdxl"', 'source = "random:nothing"'),
     r"key 'source': random source 'random:nothing': no config set at .*nothing"),
    (GOOD + "[[shapes]]\nbatch = 1\nheight = 64\nwidth = 64\n", r"'shapes\[1\]' repeats bucket 1x64x64"),
    (GOOD.replace('name = "t"', 'name = "other"'), r"key 'name' is 'other' but the file is named 't'"),
    ("name = [", r"not valid TOML"),
    (GOOD.replace('device = "cpu"', 'device = "cpu"\nguidance = "sometimes"'),
     r"'guidance' is 'sometimes'; allowed: both, guided, unguided"),
    (GOOD.replace('device = "cpu"', 'device = "cpu"\nguidance_scale = 1.0'),
     r"'guidance_scale' = 1 turns guidance off, and guidance = 'both' builds guided variants"),
    (GOOD.replace("unet = {}", "unet = { tiling = true }"), r"'components.unet.tiling': only the VAE's parts"),
    (GOOD.replace("unet = {}", "vae_decoder = { tiles = true }"),
     r"'components.vae_decoder.tiles' is not an option; allowed: tiling"),
    (GOOD.replace("unet = {}", "vae_decoder = { tiling = 1 }"),
     r"'components.vae_decoder.tiling' must be true or false"),
]


def test_an_edited_image_is_a_bucket_shape(tmp_path):
    """Flux Kontext's buckets name the edited image's size; other pipelines' cannot, and a bad
    size is a TargetError naming the key."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-flux").symlink_to(TARGETS / "configs" / "tiny-flux")
    kontext = (GOOD.replace("StableDiffusionXLPipeline", "FluxKontextPipeline").replace("tiny-sdxl", "tiny-flux")
               .replace("unet = {}", "transformer = {}"))
    path = write_target(tmp_path, kontext.replace("width = 64\n", "width = 64\nimage = [48, 80]\n"))
    bucket = load_target(path).shapes[0]
    assert (bucket.image, str(bucket)) == ((48, 80), "1x64x64/image48x80")
    data = load_target(path).to_dict()
    assert data["shapes"] == [{"batch": 1, "height": 64, "width": 64, "image": [48, 80]}]
    assert Target.from_dict(data, base_dir=tmp_path).shapes[0] == bucket
    for image, message in (("[48]", r"'shapes\[0\].image' must be \[height, width\] in pixels, got \[48\]"),
                           ("[48, 82]", r"'shapes\[0\].image' = \[48, 82\]: 82 is not a multiple of 4"),
                           ("[48, 0]", r"must be \[height, width\] in pixels, got \[48, 0\]")):
        with pytest.raises(TargetError, match=message):
            load_target(write_target(tmp_path, kontext.replace("width = 64\n", f"width = 64\nimage = {image}\n")))
    with pytest.raises(TargetError, match=r"'shapes\[0\].image': StableDiffusionXLPipeline edits no image"):
        load_target(write_target(tmp_path, GOOD.replace("width = 64\n", "width = 64\nimage = [64, 64]\n")))


def test_the_images_a_call_edits_together_are_a_shape(tmp_path):
    """QwenImageEditPlusPipeline's buckets and [dynamic] name the images a call edits together,
    kept through the target's dict (and its hash); another pipeline's cannot, and a bad list is a
    TargetError naming the key."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-qwen-image-edit").symlink_to(TARGETS / "configs" / "tiny-qwen-image-edit")
    shipped = (TARGETS / "cpu-tiny-qwen-image-edit-plus.toml").read_text().replace("cpu-tiny-qwen-image-edit-plus", "t")
    target = load_target(write_target(tmp_path, shipped))
    assert target.shapes[0].images == ((64, 128),) and str(target.shapes[0]) == "1x64x64/images64x128"
    assert target.dynamic_images == ((64, 64), (64, 128)) and "images" not in target.dynamic
    data = target.to_dict()
    assert data["dynamic"]["images"] == [[64, 64], [64, 128]] and data["shapes"][0]["images"] == [[64, 128]]
    assert Target.from_dict(data, base_dir=tmp_path) == target
    other = load_target(write_target(tmp_path, shipped.replace("images = [[64, 64], [64, 128]]\n", "")))
    assert other.dynamic_images is None and other.content_hash() != target.content_hash()
    for text, message in (("images = [64, 128]", r"'shapes\[0\].images' must be a list of \[height, width\] in "
                                                 r"pixels, one per image a call edits, got \[64, 128\]"),
                          ("images = []", r"'shapes\[0\].images' must be a list"),
                          ("images = [[64, 0]]", r"got \[\[64, 0\]\]")):
        with pytest.raises(TargetError, match=message):
            load_target(write_target(tmp_path, shipped.replace("images = [[64, 128]]", text)))
    edit = shipped.replace("QwenImageEditPlusPipeline", "QwenImageEditPipeline")
    with pytest.raises(TargetError, match=r"'shapes\[0\].images': QwenImageEditPipeline's call edits no list of "
                                          r"images together"):
        load_target(write_target(tmp_path, edit))
    with pytest.raises(TargetError, match=r"'dynamic.images': QwenImageEditPipeline's call edits no list"):
        load_target(write_target(tmp_path, edit.replace("images = [[64, 128]]\n", "")))


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m.split("'")[1] if "'" in m else m[:20] for _, m in BAD])
def test_bad_target_is_target_error(tmp_path, text, message):
    path = write_target(tmp_path, text)
    with pytest.raises(TargetError, match=message) as info:
        load_target(path)
    assert str(path) in str(info.value)


def test_max_autotune_without_cpu_gemm_templates_is_a_cpu_target(tmp_path):
    """The refusal above is of the CPU GEMM templates, not of the flag: ATen's GEMMs bind weights."""
    text = GOOD + '[inductor]\nmax_autotune = true\nmax_autotune_gemm_backends = "ATEN"\n'
    assert load_target(write_target(tmp_path, text)).inductor["max_autotune"] is True


def test_cli_reports_target_error_in_one_line(tmp_path):
    path = write_target(tmp_path, 'colour = "red"\n' + GOOD)
    result = CliRunner().invoke(main, ["build", "--target", str(path)])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and "unknown key 'colour'" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_an_inductor_typo_is_refused_when_the_target_is_read_with_the_closest_option(tmp_path):
    path = write_target(tmp_path, GOOD + '\n[inductor]\n"coordinate_descent_tunning" = true\n')
    result = CliRunner().invoke(main, ["build", "--target", str(path)])
    assert result.exit_code == 2 and [line for line in result.output.splitlines() if "Traceback" in line
                                      or line.startswith(("error:", "hint:"))] == [
        f"error: {path}: [inductor] key 'coordinate_descent_tunning' is not an inductor config option of torch "
        f"{torch.__version__}", "hint: did you mean 'coordinate_descent_tuning'?"]


def test_commands_print_nothing_the_libraries_say_on_import(tmp_path):
    """A fresh `aotbuild targets --check` process imports diffusers, transformers and torchao: their
    import-time notes (torchao's kernels for another Python, torch's pytree deprecations,
    transformers' PIL fallback without torchvision) look like a broken install; none is printed."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "aotbuild.cli", "targets", "--check", "--dir", str(TARGETS)],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and "cpu-tiny-sdxl" in result.stdout
    assert result.stderr == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_gpu_target_on_a_cpu_machine_says_where_to_build_it(tmp_path, monkeypatch):
    """Run from another folder: the command says which targets it read and where artifacts go."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["build", "--target", "h100-sdxl"])
    assert result.output.startswith(f"note: targets from {TARGETS} (no ./targets here); artifacts in "
                                    f"{tmp_path / 'artifacts'}\n")
    assert result.exit_code == 1 and "error: target h100-sdxl is for cuda, and this machine has no CUDA device" \
        in result.output
    assert "hint: build it on a machine with its GPU (or through Ray" in result.output and "cpu-*" in result.output
    assert list(tmp_path.iterdir()) == []


def test_a_copied_target_says_how_it_is_found_and_where_its_configs_are(tmp_path):
    text = (TARGETS / "cpu-tiny-sdxl.toml").read_text()
    (tmp_path / "mine.toml").write_text(text)
    with pytest.raises(TargetError, match=r"no config set at .*configs/tiny-sdxl") as raised:
        load_target(tmp_path / "mine.toml")
    assert raised.value.hint.startswith("random: config sets are looked up in configs/ beside the target file")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-sdxl").symlink_to(TARGETS / "configs" / "tiny-sdxl")
    with pytest.raises(TargetError, match=r"key 'name' is 'cpu-tiny-sdxl' but the file is named 'mine'") as raised:
        load_target(tmp_path / "mine.toml")
    assert raised.value.hint == ("a target is found by its file name: rename the file to cpu-tiny-sdxl.toml or set "
                                 "name = 'mine'")


def test_cli_targets_lists_one_line_each():
    result = CliRunner().invoke(main, ["targets", "--dir", str(TARGETS)])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines()}
    assert "shapes=1x64x64,2x64x96,1-3x32-96x32-96" in lines["cpu-tiny-sdxl"]
    assert "components=unet,vae_decoder,vae_encoder" in lines["cpu-tiny-sdxl"]
    assert "components=unet,vae_decoder[tiling],vae_encoder[tiling]" in lines["cpu-tiny-sd15"]
    assert lines["cpu-tiny-sdxl-int8"].endswith(" guidance=guided")
    assert lines["h100-sdxl"].split()[1:3] == ["cuda", "bfloat16"]
    assert lines["h200-sdxl-random"].endswith(" cuda_graphs") and lines["a100-sdxl"].endswith(" multi_arch")
    assert not lines["cpu-tiny-sdxl"].endswith(("cuda_graphs", "multi_arch"))


def test_cli_targets_lists_files_as_written_and_check_says_which_are_invalid(tmp_path):
    """The listing reads each file without validating it (no torch); --check validates each as a
    build does. An invalid file never hides the others: it is named on stderr, and the exit is 1."""
    write_target(tmp_path, GOOD)
    (tmp_path / "broken.toml").write_text("name = [")
    (tmp_path / "half.toml").write_text('name = "half"\npipeline = "StableDiffusionXLPipeline"\n')
    (tmp_path / "wrong.toml").write_text(GOOD.replace('name = "t"', 'name = "wrong"').replace("height = 64",
                                                                                           "height = 63"))
    result = CliRunner().invoke(main, ["targets", "--dir", str(tmp_path)])
    listed = [line.split()[0] for line in result.stdout.splitlines()]
    assert result.exit_code == 1 and listed == ["t", "wrong"]
    assert result.stderr.splitlines() == [
        f"error: {tmp_path / 'broken.toml'}: not valid TOML: Invalid value (at end of document)",
        f"error: {tmp_path / 'half.toml'}: not laid out as a target",
        f"hint: aotbuild build --target {tmp_path / 'half.toml'} says which key is wrong"]
    result = CliRunner().invoke(main, ["targets", "--check", "--dir", str(tmp_path)])
    assert result.exit_code == 1 and [line.split()[0] for line in result.stdout.splitlines()] == ["t"]
    assert f"error: {tmp_path / 'wrong.toml'}: key 'shapes[0].height' = 63 is not a multiple of 4" in result.stderr


def test_what_an_entry_says_of_its_pipeline_class_is_what_the_class_says():
    """A curated entry says whether its pipeline makes videos without importing diffusers (a target
    is read at once); the class's own call says the same, and a derived spec reads it there."""
    import inspect

    import diffusers

    from aotbuild.spec.pipelines import FRAMES, PIPELINES, derived_spec

    for name, spec in PIPELINES.items():
        assert spec.makes_video == (FRAMES in inspect.signature(getattr(diffusers, name).__call__).parameters), name
    assert derived_spec("WanPipeline").makes_video and not derived_spec("PixArtSigmaPipeline").makes_video


@pytest.mark.parametrize(("pipeline", "refusal"), [
    ("OnnxStableDiffusionPipeline", r"runs its unet outside torch \(OnnxRuntimeModel\): there is nothing for aotbuild "
                                    r"to compile; build the torch pipeline"),
    ("StableCascadeDecoderPipeline", r"denoises with a `decoder` and no `transformer` or `unet`, which aotbuild does "
                                     r"not compile"),
    ("KandinskyV22PriorPipeline", r"denoises with a `prior` and no `transformer` or `unet`"),
    ("StableAudioPipeline", r"makes audio, not images or videos"),
    ("LTX2Pipeline", r"makes a video with its sound: aotbuild compiles image and silent video pipelines"),
    ("IFPipeline", r"denoises pixels, with no `vae`: aotbuild sizes a pipeline it has no entry for by its VAE"),
    ("KandinskyV22CombinedPipeline", r"decodes its latents with a VQ model \(`movq`\), with no `vae`"),
    ("WanVideoToVideoPipeline", r"makes a video from the video it is given, as many frames as that video has"),
    ("LucyEditPipeline", r"makes a video from the video it is given"),
    ("SanaVideoPipeline", r"names its video's frame count `frames`: aotbuild captures a video pipeline's frames as "
                          r"`num_frames`"),  # it takes num_frames, and needs a video
    ("StableDiffusionXLPAGPipeline", r"guides with perturbed attention \(PAG\): its call swaps the denoiser's "
                                     r"attention for part of each batch"),
    ("Flux2KleinKVPipeline", r"sets its transformer's attention processors \(its own attention, in place of the "
                             r"model's\): a compiled transformer's attention is fixed when it is built"),  # a KV cache
    ("StableDiffusionSAGPipeline", r"sets its unet's attention processors"),
    ("KandinskyV22Pipeline", r"takes no `prompt` \(its call starts from `image_embeds`\)"),
    ("DiTPipeline", r"takes no `prompt` \(its call starts from `class_labels`\)"),
    ("StableDiffusionLatentUpscalePipeline", r"upscales the image it is given \(its output's pixels are a multiple "
                                             r"of the image's\)"),
])
def test_a_pipeline_aotbuild_cannot_capture_is_refused_by_what_it_makes_and_takes(tmp_path, pipeline, refusal):
    """Read before anything is loaded: the target names why, in what the pipeline makes and takes."""
    write_target(tmp_path, GOOD.replace("StableDiffusionXLPipeline", pipeline))
    with pytest.raises(TargetError, match=rf"key 'pipeline': pipeline '{pipeline}' {refusal}"):
        load_target(tmp_path / "t.toml")


def test_a_derived_pipeline_is_captured_with_the_pictures_its_call_takes():
    """img2img starts from an image (at strength 1: text-to-image's steps), inpainting adds a mask,
    a Control pipeline its control image; a text-to-image call takes none."""
    from PIL import Image

    from aotbuild.spec.pipelines import derived_spec

    def pictures(pipeline):
        extras = derived_spec(pipeline).call_extras(1, 32, 48) or {}
        return {name: value.size if isinstance(value, Image.Image) else value for name, value in extras.items()}

    assert pictures("FluxImg2ImgPipeline") == {"image": (48, 32), "strength": 1.0}
    assert pictures("FluxFillPipeline") == {"image": (48, 32), "mask_image": (48, 32), "strength": 1.0}
    assert pictures("FluxControlPipeline") == {"control_image": (48, 32)}
    assert pictures("StableDiffusionXLInstructPix2PixPipeline") == {"image": (48, 32)}
    assert pictures("LTXImageToVideoPipeline") == {"image": (48, 32)}  # its signature defaults it to None
    assert pictures("PixArtSigmaPipeline") == {} and pictures("Flux2Pipeline") == {}


def test_what_aotbuild_reads_of_diffusers_code_is_there_in_the_installed_diffusers():
    """Read as text (no public API says them; private_apis.py): the multiple a pipeline's input
    check holds sizes to, the model attributes a pipeline reads, a forward's output class. A
    diffusers release that writes these otherwise fails here, by name, not in a build."""
    import diffusers
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    from aotbuild.spec.private_apis import attributes_read, check_inputs_multiple, returned_classes

    assert {name: check_inputs_multiple(getattr(diffusers, name)) for name in
            ("WanPipeline", "LTXPipeline", "StableDiffusionXLPipeline")} == {
        "WanPipeline": 16, "LTXPipeline": 32, "StableDiffusionXLPipeline": 8}
    assert "in_channels" in attributes_read(diffusers.ZImagePipeline, "transformer")
    assert returned_classes(diffusers.WanTransformer3DModel.forward) == [Transformer2DModelOutput]


def test_gpu_options_parse_and_reach_the_compile_options(tmp_path):
    from aotbuild.builder.export import MULTI_ARCH_OPTION, inductor_options

    text = GOOD.replace('device = "cpu"', 'device = "cuda"\ngpu = { name = "A100", capability = "8.0", '
                                          'multi_arch = true }\ncuda_graphs = true')
    target = load_target(write_target(tmp_path, text))
    assert target.gpu.multi_arch and target.cuda_graphs
    assert Target.from_dict(target.to_dict(), target.base_dir) == target
    assert inductor_options(target.inductor, multi_arch=target.gpu.multi_arch)[MULTI_ARCH_OPTION] is True
    assert MULTI_ARCH_OPTION not in inductor_options({})
    with pytest.raises(AotbuildError, match="is set by aotbuild") as info:
        inductor_options({MULTI_ARCH_OPTION: True})
    assert "multi_arch = true" in info.value.hint


SD3 = """
name = "t"
pipeline = "StableDiffusion3Pipeline"
source = "random:tiny-sd3"
device = "cpu"
[[shapes]]
batch = 1
height = HEIGHT
width = 64
[components]
transformer = {}
"""


def test_sd3_sizes_beyond_its_position_embedding_are_refused(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-sd3").symlink_to(TARGETS / "configs" / "tiny-sd3")
    assert load_target(write_target(tmp_path, SD3.replace("HEIGHT", "256"))).shapes[0].height == 256
    with pytest.raises(TargetError, match=r"'shapes\[0\].height' = 272 is above 256, the largest size "
                                          r"StableDiffusion3Pipeline's position embedding covers"):
        load_target(write_target(tmp_path, SD3.replace("HEIGHT", "272")))
    dynamic = SD3.replace("HEIGHT", "64") + "[dynamic]\nbatch = [1, 1]\nheight = [64, 512]\nwidth = [64, 64]\n"
    with pytest.raises(TargetError, match=r"'dynamic.height' = 512 is above 256"):
        load_target(write_target(tmp_path, dynamic))


def test_guidance_choice_is_refused_where_the_batch_ignores_it(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-flux").symlink_to(TARGETS / "configs" / "tiny-flux")
    text = (GOOD.replace("StableDiffusionXLPipeline", "FluxPipeline").replace("tiny-sdxl", "tiny-flux")
            .replace("unet = {}", "transformer = {}").replace('device = "cpu"', 'device = "cpu"\nguidance = "guided"'))
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TargetError, match="FluxPipeline's denoiser batch is the same with and without guidance"):
        load_target(path)


def test_an_edited_images_encoder_is_exported_at_its_largest_call():
    """The VAE encoder of an editing pipeline gets a bucket per size its images are resized to;
    each is exported at the largest call it serves (its batch), as every bucket is."""
    from aotbuild.builder.plan import plan_target
    from aotbuild.spec.pipelines import pipeline_spec

    target = load_target(TARGETS / "cpu-tiny-qwen-image-edit-plus.toml")
    target = dataclasses.replace(target, dynamic={**target.dynamic, "batch": [1, 2]})
    spec = pipeline_spec(target.pipeline)
    points, plans = plan_target(target, spec, [spec.component(n) for n in target.components], None, 1)
    encoders = {plan.name: plan for plan in plans["vae_encoder"]}
    assert set(encoders) == {"b1_736x1440", "b2_1024x1024", "b2_736x1440"}
    for plan in encoders.values():
        assert points[plan.points[0]].batch == plan.bucket.batch
        assert {points[p].encoded for p in plan.points} == {(plan.bucket.height, plan.bucket.width)}


@pytest.mark.parametrize("guidance, dynamic_batch, doubled", [
    ("both", [1, 2], True), ("guided", [1, 1], True), ("unguided", [1, 2], False),
], ids=["both", "fixed-batch", "unguided"])
def test_sd3_controlnets_vae_encoder_spans_the_control_image_per_guidance_half(guidance, dynamic_batch, doubled):
    """SD3's ControlNet pipeline encodes its control image once per guidance half: its VAE encoder's
    bucket and dynamic models span twice the images (the bucket exported there; a fixed batch's
    twice its batch probe), besides the images an img2img call encodes; without guidance, not."""
    from aotbuild.builder.plan import plan_target
    from aotbuild.spec.pipelines import pipeline_spec

    target = load_target(TARGETS / "cpu-tiny-sd3-controlnet.toml")
    target = dataclasses.replace(target, guidance=guidance, dynamic={**target.dynamic, "batch": dynamic_batch})
    spec = pipeline_spec(target.pipeline)
    points, plans = plan_target(target, spec, [spec.component(n) for n in target.components], None, 1)
    bucket, dynamic = plans["vae_encoder"]
    batches = sorted(points[p].batch for p in bucket.points)
    assert batches == ([1, 2, 4] if doubled else [1, 2])
    assert points[bucket.points[0]].batch == max(batches)  # the export point
    control = [p for p in dynamic.points if p.endswith(":control")]
    assert control == ([f"dynamic:{'base' if dynamic_batch[0] == dynamic_batch[1] else 'max'}:control"] if doubled
                       else [])
    if doubled:
        assert points[control[0]].batch == 2 * dynamic_batch[1] and points[control[0]].alone == "vae_encoder"
    assert not any(p.endswith(":control") for name in ("transformer", "controlnet", "vae_decoder")
                   for plan in plans[name] for p in plan.points)


def test_sd3s_inpainting_controlnet_encodes_once_per_image():
    """SD3's inpainting ControlNet pipeline encodes the masked image once and repeats its latents for
    guidance: its VAE encoder spans the call's images, with no control point."""
    from aotbuild.builder.plan import plan_target
    from aotbuild.spec.pipelines import pipeline_spec

    target = load_target(TARGETS / "cpu-tiny-sd3-controlnet-inpaint.toml")
    spec = pipeline_spec(target.pipeline)
    points, plans = plan_target(target, spec, [spec.component(n) for n in target.components], None, 1)
    (bucket,) = plans["vae_encoder"]
    assert sorted(points[p].batch for p in bucket.points) == [1, 2]
    assert not any(":control" in p for plan in plans.values() for variant in plan for p in variant.points)


def test_a_targets_call_arguments_are_the_pipelines_and_none_the_build_sets(tmp_path):
    """`call`: plain arguments every capture passes (PixArt's `use_resolution_binning = false`),
    each checked against the pipeline's call; the size, guidance and pictures are the build's."""
    pixart = (GOOD.replace("StableDiffusionXLPipeline", "PixArtSigmaPipeline").replace("unet = {}", "transformer = {}")
              .replace("random:tiny-sdxl", "random:tiny-pixart-sigma"))
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-pixart-sigma").symlink_to(TARGETS / "configs" / "tiny-pixart-sigma")
    write_target(tmp_path, pixart + "[call]\nuse_resolution_binning = false\n")
    with_call = load_target(tmp_path / "t.toml")
    assert with_call.call == {"use_resolution_binning": False} and with_call.to_dict()["call"] == with_call.call
    assert Target.from_dict(with_call.to_dict(), tmp_path) == with_call
    # A target without one is the data it was before `call` existed: its artifacts stay fresh.
    assert "call" not in load_target(TARGETS / "cpu-tiny-sdxl.toml").to_dict()
    for table, refusal in (
        ("use_resolution_bining = false", r"key 'call.use_resolution_bining': PixArtSigmaPipeline's call takes no "
                                          r"'use_resolution_bining'"),
        ("height = 64", r"key 'call.height': the build sets it at each capture point"),
        ("num_frames = 5", r"key 'call.num_frames': the build sets it"),
        ("use_resolution_binning = { a = 1 }", r"key 'call.use_resolution_binning' must be a plain value \(true/false, "
                                               r"a number, a string, or an array of them\), got \{'a': 1\}"),
    ):
        write_target(tmp_path, pixart + f"[call]\n{table}\n")
        with pytest.raises(TargetError, match=refusal) as refused:
            load_target(tmp_path / "t.toml")
    assert refused.value.hint is None
    write_target(tmp_path, pixart + "[call]\nuse_resolution_bining = false\n")
    with pytest.raises(TargetError) as refused:
        load_target(tmp_path / "t.toml")
    assert refused.value.hint == "did you mean 'use_resolution_binning'?"
