"""The CLI on the session artifact: inspect, verify, run; errors are one line and an exit code."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from PIL import Image

from aotbuild.cli import main

from .conftest import TARGETS

pytestmark = pytest.mark.slow
TINY = str(TARGETS / "cpu-tiny-sdxl.toml")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_inspect_shows_variants_files_and_numerics(built):
    result = invoke("inspect", str(built.folder))
    assert result.exit_code == 0
    for text in ("cpu-tiny-sdxl", "StableDiffusionXLPipeline", "random:tiny-sdxl seed=0", "b1_64x64",
                 "2x64x96", "1-3x32-96x32-96 (dynamic", "args[0]=[2*B, 4, H/2, W/2]", "rel.err", "unet.pt2",
                 "vae_decoder.safetensors", "compile"):
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
    assert f"backend={backend} load=" in result.output and "first_step=" in result.output
    for i in range(2):
        image = Image.open(tmp_path / f"fox-{i}.png")
        assert image.size == (96, 64)


def test_run_without_artifact_says_how_to_build(tmp_path):
    result = CliRunner().invoke(main, ["run", "--target", TINY, "--artifacts", str(tmp_path), "--prompt", "x"])
    assert result.exit_code == 1
    assert "no artifact at" in result.output and "hint: build it first: aotbuild build --target cpu-tiny-sdxl" \
        in result.output


def test_run_at_an_uncovered_shape_is_one_line(built):
    result = CliRunner().invoke(main, ["run", "--target", TINY, "--artifacts", str(built.artifacts),
                                       "--prompt", "x", "--steps", "1", "--height", "128", "--width", "128"])
    assert result.exit_code == 1
    assert "covers (batch x height x width): 1x64x64; 2x64x96; 1-3x32-96x32-96 (dynamic" in result.output
    assert "Traceback" not in result.output


def test_cache_shows_and_clears_extracted_packages(built, tmp_path, monkeypatch):
    from aotbuild.runtime import load_components

    monkeypatch.setenv("AOTBUILD_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "packages"
    load_components(built.folder)  # extracts both packages
    (root / ".0123abcd-xyz").mkdir()  # another process's extraction in progress: not the clear's to delete
    shown = invoke("cache")
    assert shown.exit_code == 0 and f"{root}: 2 extracted package(s)" in shown.output
    cleared = invoke("cache", "--clear")
    assert "cleared" in cleared.output and [p.name for p in root.iterdir()] == [".0123abcd-xyz"]
    # A folder under a package's name without the completion mark was never renamed into place
    # whole: the next load replaces it instead of trusting it.
    (root / built.manifest["files"]["unet.pt2"]["sha256"]).mkdir()
    _, modules = load_components(built.folder)
    assert ": 2 extracted package(s)" in invoke("cache").output and modules["unet"].variants
