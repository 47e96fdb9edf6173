"""The CLI on the session artifact: inspect, verify, run; errors are one line and an exit code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from PIL import Image

from aotbuild.cli import main

from .conftest import ROOT, TARGETS, build_once, eager_pipeline
from .test_targets import GOOD, write_target

pytestmark = pytest.mark.slow
TINY = str(TARGETS / "cpu-tiny-sdxl.toml")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_inspect_shows_variants_files_and_numerics(built):
    result = invoke("inspect", str(built.folder))
    assert result.exit_code == 0
    for text in ("cpu-tiny-sdxl", "StableDiffusionXLPipeline", "random:tiny-sdxl seed=0", "b1_64x64",
                 "64x96 px, 1-2 images, with and without guidance", "32-96x32-96 px (multiples of 4), 1-3 images",
                 "args[0]=[B, 4, H/2, W/2]", "rel.err", "unet.pt2", "vae_encoder.safetensors", "compile"):
        assert text in result.output
    as_json = invoke("inspect", "--json", str(built.folder))
    assert '"target_hash"' in as_json.output


def test_verify_passes_then_fails_on_a_damaged_file(artifact_copy):
    assert invoke("verify", str(artifact_copy)).exit_code == 0
    with open(artifact_copy / "vae_decoder.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    result = invoke("verify", str(artifact_copy))
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and "vae_decoder.safetensors: sha256" in result.output
    assert "Traceback" not in result.output


def test_verify_on_a_folder_without_manifest(tmp_path):
    result = invoke("verify", str(tmp_path))
    assert result.exit_code == 1 and "manifest.json is missing" in result.output
    assert "hint: build it first" in result.output


@pytest.mark.parametrize("backend", ["aot", "eager"])
def test_run_writes_images_and_prints_timings(built, tmp_path, backend):
    out = tmp_path / "fox.png"
    result = invoke("run", "--target", TINY, "--artifacts", str(built.artifacts), "--backend", backend,
                    "--prompt", "a red fox", "--steps", "2", "--batch", "2", "--height", "64", "--width", "96",
                    "--output", str(out))
    assert result.exit_code == 0, result.output
    assert f"backend={backend} guidance_scale=5 load=" in result.output and "first_step=" in result.output
    for i in range(2):
        image = Image.open(tmp_path / f"fox-{i}.png")
        assert image.size == (96, 64)


def test_run_passes_the_arguments_the_target_builds_with(tmp_path):
    """A target's `call` (here SDXL's guidance_rescale) reaches every call `aotbuild run` makes, as
    it reached the build's captures: the image is the pipeline's with it, not without it."""
    import numpy as np

    from aotbuild.builder.targets import load_target
    from aotbuild.generation.backends import generate

    path = write_target(tmp_path, GOOD + "[call]\nguidance_rescale = 1.0\n")
    out = tmp_path / "fox.png"
    result = invoke("run", "--target", str(path), "--artifacts", str(tmp_path), "--backend", "eager",
                    "--prompt", "a red fox", "--steps", "2", "--output", str(out))
    assert result.exit_code == 0, result.output
    target = load_target(path)
    pipe = eager_pipeline(target)
    pipe.set_progress_bar_config(disable=True)

    def made(**built_with) -> np.ndarray:
        return np.asarray(generate(pipe, "a red fox", steps=2, seed=0, height=64, width=64,
                                   guidance_scale=target.guidance_scale, built_with=built_with).images[0], np.int16)

    rescaled, plain = made(guidance_rescale=1.0), made()
    cli = np.asarray(Image.open(out), np.int16)
    assert np.abs(cli - rescaled).max() <= 1 < np.abs(cli - plain).max()  # made with the argument, not without


def test_run_without_artifact_says_how_to_build(tmp_path):
    result = CliRunner().invoke(main, ["run", "--target", TINY, "--artifacts", str(tmp_path), "--prompt", "x"])
    assert result.exit_code == 1
    assert "no artifact at" in result.output and "hint: build it first: aotbuild build --target cpu-tiny-sdxl" \
        in result.output


def test_a_missing_artifact_folder_says_what_to_give_and_tracebacks_show_the_hint(tmp_path):
    """A Hub id without hf:// or a folder that does not exist: named as such, not as a corrupt
    artifact; in Python, `str(error)` (what a traceback prints) carries the hint too."""
    import aotbuild
    from aotbuild.errors import ArtifactError

    with pytest.raises(ArtifactError) as raised:
        aotbuild.load_pipeline("stabilityai/sdxl-turbo")
    assert raised.value.message == "no artifact at stabilityai/sdxl-turbo: no such folder"
    assert str(raised.value) == (f"{raised.value.message}\nhint: an artifact on the Hub is named "
                                 f"hf://stabilityai/sdxl-turbo (a diffusers model's repo is a target's source: build "
                                 f"it first)")
    result = CliRunner().invoke(main, ["run", "--artifact", str(tmp_path / "nowhere"), "--prompt", "x"])
    assert result.exit_code == 1 and result.output.splitlines() == [
        f"error: no artifact at {tmp_path / 'nowhere'}: no such folder",
        "hint: give an artifact's folder: artifacts/NAME after `aotbuild build --target NAME`, or hf://org/name"]


def test_run_at_an_uncovered_shape_is_one_line(built):
    result = CliRunner().invoke(main, ["run", "--target", TINY, "--artifacts", str(built.artifacts),
                                       "--prompt", "x", "--steps", "1", "--height", "128", "--width", "128"])
    assert result.exit_code == 1
    assert ("covers: 64x64 px, 1 image, with and without guidance; 64x96 px, 1-2 images, with and without "
            "guidance; 32-96x32-96 px (multiples of 4), 1-3 images, with and without guidance") in result.output
    assert "hint: cover this call in the target (a [[shapes]] bucket, or a wider [dynamic] range) and rebuild" \
        in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["run", "--artifact", str(built.folder), "--prompt", "x", "--steps", "1",
                                       "--height", "100", "--width", "64"])  # diffusers' own check: one line
    assert result.exit_code == 1 and result.output.splitlines() == [
        "error: StableDiffusionXLPipeline refuses this call (height=100, width=64): `height` and `width` have to be "
        "divisible by 8 but are 100 and 64.", "hint: change the option it names"]


def test_cache_shows_and_clears_extracted_packages(built, tmp_path, monkeypatch):
    from aotbuild.runtime import load_components

    monkeypatch.setenv("AOTBUILD_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "packages"
    load_components(built.folder)  # extracts the three packages
    (root / ".0123abcd-xyz").mkdir()  # another process's extraction in progress: not the clear's to delete
    shown = invoke("cache")
    assert shown.exit_code == 0 and f"{root}: 3 extracted package(s)" in shown.output
    cleared = invoke("cache", "--clear")
    assert "cleared" in cleared.output and [p.name for p in root.iterdir()] == [".0123abcd-xyz"]
    # A folder under a package's name without the completion mark was never renamed into place
    # whole: the next load replaces it instead of trusting it.
    (root / built.manifest["files"]["unet.pt2"]["sha256"]).mkdir()
    _, modules = load_components(built.folder)
    assert ": 3 extracted package(s)" in invoke("cache").output and modules["unet"].variants


def test_run_an_artifact_img2img_without_guidance_prints_only_its_result(tmp_path_factory, tmp_path):
    """`run --artifact` with --image/--strength/--guidance-scale/--negative-prompt, in a fresh
    process: stdout has the result line, stderr only the note that a negative prompt does nothing
    without guidance (no library warnings on load), and the image is eager img2img's with the same
    arguments; without --output, a note says nothing was saved."""
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    from aotbuild.builder.targets import load_target
    from aotbuild.generation.backends import generate

    target = load_target(TARGETS / "cpu-tiny-sd15.toml")
    built = build_once(tmp_path_factory, target)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8)).save(tmp_path / "in.png")
    args = ["run", "--artifact", str(built.folder), "--prompt", "a red fox", "--image", str(tmp_path / "in.png"),
            "--strength", "0.5", "--guidance-scale", "1", "--negative-prompt", "blurry", "--steps", "4",
            "--output", str(tmp_path / "out.png")]
    result = subprocess.run([str(Path(sys.executable).parent / "aotbuild"), *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ("note: --negative-prompt has no effect at guidance_scale 1: there is no unconditional "
                             "pass for it to steer (diffusers ignores it too); raise --guidance-scale above 1\n")
    lines = result.stdout.splitlines()
    assert lines[0] == f"wrote {tmp_path / 'out.png'}" and lines[1].startswith("backend=aot img2img guidance_scale=1 ")
    want = generate(eager_pipeline(target), "a red fox", steps=4, seed=0, height=64, width=64, guidance_scale=1.0,
                    negative_prompt="blurry", image=Image.open(tmp_path / "in.png").convert("RGB"), strength=0.5)
    got = np.asarray(Image.open(tmp_path / "out.png"), dtype=np.int16)
    assert got.shape == (64, 64, 3) and np.abs(got - np.asarray(want.images[0], dtype=np.int16)).max() <= 1
    result = CliRunner().invoke(main, ["run", "--artifact", str(built.folder), "--prompt", "a red fox", "--steps", "1"])
    assert result.exit_code == 0 and "note: the images were not saved: give --output FILE.png" in result.output


def test_run_needs_one_of_target_or_artifact():
    result = CliRunner().invoke(main, ["run", "--prompt", "x"])
    assert result.exit_code == 1 and "give --target NAME or --artifact FOLDER|hf://org/name[@revision]" in result.output
    result = CliRunner().invoke(main, ["run", "--target", "cpu-tiny-sdxl", "--artifact", "x", "--prompt", "x"])
    assert result.exit_code == 1 and "give --target or --artifact, not both: --target cpu-tiny-sdxl runs the " \
        "target's artifact in --artifacts" in result.output
    result = CliRunner().invoke(main, ["run", "--artifact", "cpu-tiny-sdxl", "--prompt", "x"])  # a target's name
    assert result.exit_code == 1 and result.output.splitlines() == [
        "error: --artifact cpu-tiny-sdxl: no such folder; cpu-tiny-sdxl is a target",
        "hint: give --target cpu-tiny-sdxl (it runs artifacts/cpu-tiny-sdxl), or --artifact artifacts/cpu-tiny-sdxl"]
    result = CliRunner().invoke(main, ["run", "--target", TINY, "--prompt", "x", "--strength", "0.5"])
    assert result.exit_code == 1 and "--strength applies to img2img: give --image too" in result.output
    result = CliRunner().invoke(main, ["run", "--target", TINY, "--prompt", "x", "--height", "63"])
    assert result.exit_code == 2 and result.output.splitlines() == [  # a usage error, before anything loads
        "error: --height 63 px is not a multiple of 4, the pixel stride of cpu-tiny-sdxl's model",
        "hint: give --height 60 or 64"]


def test_the_command_line_spins_openmp_threads_briefly_unless_told(tmp_path):
    """libgomp reads how long to spin when torch loads it: a command sets the short spin in its
    environment before any import of torch (its bench workers and replicas inherit it), and leaves
    a user's own setting alone."""
    probe = ("import os, sys; from aotbuild.cli import main; sys.argv = ['aotbuild', 'targets']\n"
             "imported = 'torch' in sys.modules\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), imported)")

    def spin(**env):
        clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        result = subprocess.run([sys.executable, "-c", probe], env={**clean, **env}, capture_output=True, text=True,
                                cwd=ROOT, check=True)
        return result.stdout.split("\n")[-2]

    assert spin() == "10000 None False"  # torch not loaded before the command sets it
    assert spin(OMP_WAIT_POLICY="PASSIVE") == "None PASSIVE False"
    assert spin(GOMP_SPINCOUNT="0") == "0 None False"


# What a command answers from its arguments, a target file or a manifest alone: (arguments, exit
# code, the first line of stderr, the hint). Each is said before torch is imported (a fresh process
# importing torch and diffusers takes 5-7 s on 2 cores; these take a fraction of one).
ANSWERED_AT_ONCE = [
    (["targets"], 0, None, None),
    (["build", "--target", "cpu-tiny-sdx"], 2, "error: no target named 'cpu-tiny-sdx' in ",
     "hint: did you mean cpu-tiny-sdxl? aotbuild targets lists the "),
    (["run", "--target", "cpu-tiny-sdx", "--prompt", "x"], 2, "error: no target named 'cpu-tiny-sdx' in ",
     "hint: did you mean cpu-tiny-sdxl? "),
    (["run", "--target", "cpu-tiny-sdxl", "--prompt", "x", "--height", "63"], 2,
     "error: --height 63 px is not a multiple of 4, the pixel stride of cpu-tiny-sdxl's model",
     "hint: give --height 60 or 64"),
    (["run", "--target", "cpu-tiny-sdxl", "--prompt", "x", "--artifacts", "nowhere"], 1,
     "error: no artifact at nowhere/cpu-tiny-sdxl", "hint: build it first: aotbuild build --target cpu-tiny-sdxl"),
    (["build", "--target", "{tmp}/t.toml"], 2, "error: {tmp}/t.toml: unknown key 'dtyp'; allowed: name, ",
     "hint: did you mean 'dtype'?"),
    (["build", "--target", "{tmp}/h.toml"], 2,
     "error: {tmp}/h.toml: key 'shapes[0].height' = 63 is not a multiple of 4, the pixel stride", None),
    (["bench", "--target", "cpu-tiny-sdx"], 2, "error: no target named 'cpu-tiny-sdx' in ", "hint: did you mean "),
    (["push", "--target", "cpu-tiny-sdx", "--repo", "org/name"], 2, "error: no target named ", "hint: did you mean "),
    (["inspect", "nowhere"], 1, "error: no artifact at nowhere: no such folder", "hint: give an artifact's folder"),
    (["verify", "nowhere"], 1, "error: no artifact at nowhere: no such folder", "hint: give an artifact's folder"),
    (["pull", "org/name"], 1, "error: hf://org/name holds native code", "hint: "),
    (["cache"], 0, None, None),
]




@pytest.mark.parametrize(("args", "code", "error", "hint"), ANSWERED_AT_ONCE, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_what_the_arguments_decide_is_said_without_importing_torch(args, code, error, hint, tmp_path):
    write_target(tmp_path, GOOD.replace('device = "cpu"', 'device = "cpu"\ndtyp = "float32"'))
    write_target(tmp_path, GOOD.replace('"t"', '"h"').replace("height = 64", "height = 63"), name="h")
    args, error = [arg.replace("{tmp}", str(tmp_path)) for arg in args], error and error.replace("{tmp}", str(tmp_path))
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('torch imported' * ('torch' in sys.modules), file=sys.stderr))\n"
             "from aotbuild.cli import main\nmain(sys.argv[1:], prog_name='aotbuild')")
    result = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "AOTBUILD_CACHE": str(tmp_path)}, timeout=120)
    lines = result.stderr.splitlines()
    assert result.returncode == code and "torch imported" not in lines and "Traceback" not in result.stderr, \
        result.stderr
    if error:
        assert lines[0].startswith(error) and (hint is None or lines[1].startswith(hint)), lines


def test_inspect_reads_a_manifest_without_importing_torch(built):
    probe = ("import sys\nfrom aotbuild.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
             "    print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe, "inspect", str(built.folder)], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert result.stdout.splitlines()[-1] == "False" and "32-96x32-96 px (multiples of 4), 1-3 images" in result.stdout
