"""The load path at size: what is hashed on every load and what is trusted, what is stored, the
layouts weights are bound with, where packages are loaded from, and artifacts that stand alone."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import aotbuild
from aotbuild.builder.targets import ShapeBucket
from aotbuild.errors import AotbuildError, CorruptArtifactError, SourceError
from aotbuild.runtime import CompiledVariant, check_artifact_files, extracted_package, load_components, load_weights
from aotbuild.runtime.variant import LoadContext
from aotbuild.spec.manifest import read_manifest

from .conftest import eager_pipeline, generate

pytestmark = pytest.mark.slow
IMAGE_ATOL = 1e-4


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("AOTBUILD_CACHE", str(cache))
    return cache


def test_weights_are_hashed_once_per_file_packages_every_load(artifact_copy, private_cache):
    manifest = read_manifest(artifact_copy)
    weights = {"unet.safetensors", "vae_decoder.safetensors", "vae_encoder.safetensors"}
    packages = {"unet.pt2", "vae_decoder.pt2", "vae_encoder.pt2"}
    first = check_artifact_files(artifact_copy, manifest)
    assert weights | packages <= set(first)
    second = check_artifact_files(artifact_copy, manifest)
    assert packages <= set(second) and not weights & set(second)  # trusted by its record
    assert len(list((private_cache / "verified").iterdir())) == 3

    # Rewritten in place with the same size: a new identity, so it is hashed again and refused.
    path = artifact_copy / "unet.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptArtifactError, match=r"unet.safetensors: sha256 is [0-9a-f]{64}, the manifest says"):
        check_artifact_files(artifact_copy, manifest)
    with pytest.raises(CorruptArtifactError, match="unet.safetensors: sha256"):
        aotbuild.load_pipeline(artifact_copy)


def test_a_copied_artifact_is_hashed_again_then_trusted(artifact_copy, private_cache, tmp_path):
    manifest = read_manifest(artifact_copy)
    check_artifact_files(artifact_copy, manifest)
    copy = Path(shutil.copytree(artifact_copy, tmp_path / "copy"))
    assert "unet.safetensors" in check_artifact_files(copy, manifest)  # another file: no record yet
    assert "unet.safetensors" not in check_artifact_files(copy, manifest)


def test_only_the_constants_some_variant_binds_are_stored(built, built_int8):
    for artifact in (built, built_int8):
        for name, entry in artifact.manifest["components"].items():
            stored = load_file(artifact.folder / entry["weights"])
            weights = load_weights(artifact.folder / entry["weights"], torch.device("cpu"),
                                   entry["constants"]["layouts"])
            sha = artifact.manifest["files"][entry["package"]]["sha256"]
            bound = set()
            for variant in entry["variants"]:
                bound |= set(CompiledVariant(artifact.folder / entry["package"], variant, weights, sha,
                                             entry["constants"]["layouts"], LoadContext("cpu")).constant_fqns)
            assert set(stored) == bound, name
            assert entry["constants"]["count"] == len(stored)
            assert entry["constants"]["bytes"] == sum(t.nbytes for t in stored.values())
    unet = load_file(built_int8.folder / "unet.safetensors")
    assert any(".attn1.to_qkv." in k for k in unet)  # fuse_qkv: the fused projection only
    assert not [k for k in unet if ".attn1.to_q." in k or ".attn1.to_k." in k or ".attn1.to_v." in k]


def test_channels_last_weights_are_bound_with_the_compiled_strides(built_int8):
    entry = built_int8.manifest["components"]["unet"]
    layouts = entry["constants"]["layouts"]
    convs = [fqn for fqn, layout in layouts.items() if len(layout["shape"]) == 4]
    assert convs and "conv_in.weight" in convs
    _, modules = load_components(built_int8.folder)
    bound = modules["unet"]._weights
    for fqn, layout in layouts.items():
        assert list(bound[fqn].shape) == layout["shape"] and list(bound[fqn].stride()) == layout["stride"]
    for fqn in convs:
        assert bound[fqn].is_contiguous(memory_format=torch.channels_last) and not bound[fqn].is_contiguous()

    # A contiguous copy where the code reads NHWC is refused at bind time, naming the constant.
    wrong = {**bound, "conv_in.weight": bound["conv_in.weight"].contiguous()}
    sha = built_int8.manifest["files"][entry["package"]]["sha256"]
    with pytest.raises(CorruptArtifactError, match=r"constant 'conv_in.weight' has strides \[\d+, 9, 3, 1\]; "
                                                   r"the compiled code reads it with strides \[\d+, 1, \d+, \d+\]"):
        CompiledVariant(built_int8.folder / entry["package"], entry["variants"][0], wrong, sha, layouts,
                        LoadContext("cpu"))


@pytest.mark.parametrize(("key", "path"), [("files", "../outside.bin"), ("package", "/etc/passwd"),
                                           ("weights", "source/../../unet.safetensors"), ("files", "./unet.pt2")])
def test_manifest_paths_outside_the_artifact_are_refused(artifact_copy, key, path):
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    if key == "files":
        manifest["files"][path] = {"bytes": 1, "sha256": "0" * 64}
    else:
        manifest["components"]["unet"][key] = path
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptArtifactError, match=f"names a file outside its folder: {re.escape(repr(path))}"):
        aotbuild.load_pipeline(artifact_copy)


def test_a_cache_others_can_write_into_is_refused(built, private_cache):
    package, sha = built.folder / "unet.pt2", built.manifest["files"]["unet.pt2"]["sha256"]
    extracted_package(package, sha)
    packages = private_cache / "packages"
    packages.chmod(0o777)
    with pytest.raises(AotbuildError, match=f"cache folder {packages} can be written by other users"):
        extracted_package(package, sha)
    packages.chmod(0o755)
    private_cache.chmod(0o777)
    with pytest.raises(AotbuildError, match=f"cache folder {private_cache} can be written by other users"):
        extracted_package(package, sha)
    private_cache.chmod(0o1777)  # shared with the sticky bit, like /tmp: no one else can replace our folder
    assert extracted_package(package, sha) == packages / sha


def test_unwritable_cache_extracts_once_per_process_and_cleans_up(built, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would be")
    script = ("import sys; from pathlib import Path; from aotbuild.runtime import extracted_package; "
              "a = extracted_package(Path(sys.argv[1]), sys.argv[2]); b = extracted_package(Path(sys.argv[1]), "
              "sys.argv[2]); assert a == b and list(a.glob('*/data/aotinductor/b1_64x64/*.so')); print(a)")
    result = subprocess.run([sys.executable, "-c", script, str(built.folder / "unet.pt2"),
                             built.manifest["files"]["unet.pt2"]["sha256"]], capture_output=True, text=True,
                            env={**os.environ, "AOTBUILD_CACHE": str(blocker / "cache")})
    assert result.returncode == 0, result.stderr[-2000:]
    assert not Path(result.stdout.strip()).exists()  # deleted at exit


def test_no_process_extracts_into_the_temporary_folder(built, private_cache, tmp_path):
    """Packages load in place from the cache (AOTInductor's own loader would extract each one into
    $TMPDIR in every process, and fails where that is mounted noexec)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = ("import sys, aotbuild, torch; p = aotbuild.load_pipeline(sys.argv[1]); "
              "p('a fox', num_inference_steps=1, height=64, width=64, generator=torch.Generator().manual_seed(0))")
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", script, str(built.folder)], capture_output=True, text=True,
                                env={**os.environ, "TMPDIR": str(tmp)})
        assert result.returncode == 0, result.stderr[-2000:]
        assert list(tmp.iterdir()) == []
    assert len(list((private_cache / "packages").iterdir())) == 3  # unet, vae_decoder, vae_encoder: once each


def test_loading_imports_no_pipeline_the_user_did_not_and_from_pipe_still_keeps_the_default(built):
    """diffusers' Auto pipelines import every pipeline it has (0.36 s of a 0.78 s load, measured: an
    artifact started slower than eager diffusers): they are patched when the user imports them."""
    script = """if True:
        import sys, aotbuild
        pipe = aotbuild.load_pipeline(sys.argv[1])
        assert "diffusers.pipelines.auto_pipeline" not in sys.modules
        pipe.default_sample_size = 4  # as a served default other than the config's is kept
        from diffusers import AutoPipelineForText2Image
        made = AutoPipelineForText2Image.from_pipe(pipe)
        print(made.default_sample_size, pipe.unet.config.sample_size)
    """
    result = subprocess.run([sys.executable, "-c", script, str(built.folder)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["4", "32"]


def test_artifact_of_a_local_source_records_no_path_and_asks_for_it(artifact_copy, tiny_target, tmp_path):
    """An artifact built from a local folder names it only; loading it elsewhere takes `source=`."""
    from aotbuild.runtime.sources import recorded_source

    folder = tmp_path / "machine" / "my-sdxl"
    eager = eager_pipeline(tiny_target)
    eager.save_pretrained(folder)
    assert recorded_source(str(folder), tmp_path) == "local:my-sdxl"
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    manifest["source"] = {"id": "local:my-sdxl", "revision": None, "seed": None}
    manifest["target"]["source"] = "local:my-sdxl"
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    assert str(tmp_path) not in (artifact_copy / "manifest.json").read_text()
    with pytest.raises(SourceError, match=r"from a local folder \('my-sdxl'\), which it does not include") as info:
        aotbuild.load_pipeline(artifact_copy)
    assert info.value.hint == "aotbuild.load_pipeline(artifact, source='/path/to/my-sdxl')"
    pipe = aotbuild.load_pipeline(artifact_copy, source=folder)
    bucket = ShapeBucket(1, 64, 64)
    np.testing.assert_allclose(generate(pipe, bucket), generate(eager, bucket), atol=IMAGE_ATOL, rtol=0)


def test_cuda_host_code_targets_a_portable_baseline():
    from torch._inductor import config as inductor_config

    from aotbuild.builder.export import MARCH_OPTION, inductor_options
    from aotbuild.errors import BuildError

    assert MARCH_OPTION in inductor_config.get_config_copy()
    assert inductor_options({}, device="cuda")[MARCH_OPTION] == ""  # no -march flag: the compiler's baseline
    assert MARCH_OPTION not in inductor_options({}, device="cpu")  # CPU kernels: -march=native, flags checked
    with pytest.raises(BuildError, match="'cpp.march' is set by aotbuild"):
        inductor_options({"cpp.march": "native"}, device="cuda")


@pytest.fixture(scope="module")
def built_baseline(tmp_path_factory):
    """cpu-tiny-sdxl-x86-64-v3: (its target, its build)."""
    from aotbuild.builder.targets import load_target

    from .conftest import TARGETS, build_once

    target = load_target(TARGETS / "cpu-tiny-sdxl-x86-64-v3.toml")
    return target, build_once(tmp_path_factory, target)


# An x86-64-v3 server CPU (Haswell), as `manifest.environment` describes a machine.
HASWELL_FLAGS = ["abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "popcnt", "sse", "sse2", "sse4_1",
                 "sse4_2", "ssse3"]


def test_a_cpu_baseline_build_runs_on_the_fleet_s_oldest_cpu_and_gives_eager_s_images(built_baseline, built):
    """cpu = { baseline = "x86-64-v3" }: AVX2 code built on a newer CPU; the manifest says the
    baseline, so loading accepts any CPU with its flags (a -march=native build is refused on one
    where the build machine had more), and the images are eager's."""
    from aotbuild.errors import IncompatibleArtifactError
    from aotbuild.spec.manifest import check_compatible, environment

    target, baseline = built_baseline
    manifest = read_manifest(baseline.folder)
    env = manifest["environment"]
    assert (env["cpu_baseline"], env["cpu_isa"], env["cpu_flags"]) == ("x86-64-v3", "AVX2", HASWELL_FLAGS)
    haswell = {**environment("cpu"), "cpu_isa": "AVX2", "cpu_flags": HASWELL_FLAGS}
    check_compatible(manifest, here=haswell)
    native = read_manifest(built.folder)
    if set(native["environment"]["cpu_flags"]) - set(HASWELL_FLAGS):  # this machine has more than Haswell
        with pytest.raises(IncompatibleArtifactError, match="cpu_"):
            check_compatible(native, here=haswell)
    pipe = aotbuild.load_pipeline(baseline.folder)
    eager = eager_pipeline(target)
    bucket = ShapeBucket(1, 64, 64)
    np.testing.assert_allclose(generate(pipe, bucket), generate(eager, bucket), atol=IMAGE_ATOL, rtol=0)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="reads the compiled code's instructions with objdump")
def test_a_cpu_baseline_build_holds_no_instruction_above_it(built_baseline, tmp_path):
    """The x86-64-v3 build's kernels use 256-bit registers (ymm) and no AVX-512 one (zmm)."""
    import zipfile

    with zipfile.ZipFile(built_baseline[1].folder / "unet.pt2") as package:
        libraries = [name for name in package.namelist() if name.endswith(".so")]
        package.extractall(tmp_path, libraries)
    code = "".join(subprocess.run(["objdump", "-d", str(tmp_path / name)], capture_output=True, text=True,
                                  check=True).stdout for name in libraries)
    assert libraries and "%ymm" in code and "%zmm" not in code


def test_private_dir_mode(tmp_path):
    from aotbuild.runtime.cache import private_dir

    folder = private_dir(tmp_path / "a" / "b")
    assert not stat.S_IMODE(folder.stat().st_mode) & 0o077
