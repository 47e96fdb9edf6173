"""Build -> package -> load -> generate on the tiny SDXL target, for real (AOTInductor on CPU)."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
import zipfile

import numpy as np
import pytest
import torch

import aotbuild
from aotbuild.builder import build, is_fresh
from aotbuild.builder.targets import ShapeBucket
from aotbuild.errors import CorruptArtifactError, IncompatibleArtifactError, ShapeNotSupportedError
from aotbuild.runtime import CompiledComponent, load_components
from aotbuild.runtime.autoencoder import CompiledAutoencoderBase
from aotbuild.spec.manifest import read_manifest, sha256_file, verify_files

from .conftest import ROOT, TARGETS, eager_pipeline, generate, mapped_from

pytestmark = pytest.mark.slow

IMAGE_ATOL = 1e-4  # images are in [0, 1]; fp32 compiled vs eager differ by ~1e-6


def test_build_writes_complete_artifact(built, tiny_target):
    names = sorted(p.name for p in built.folder.iterdir())
    assert names == ["manifest.json", "source", "unet.pt2", "unet.safetensors",
                     "vae_decoder.pt2", "vae_decoder.safetensors", "vae_encoder.pt2", "vae_encoder.safetensors"]
    m = read_manifest(built.folder)
    assert m["target"] == tiny_target.to_dict() and m["target_hash"] == tiny_target.content_hash()
    assert m["source"] == {"id": "random:tiny-sdxl", "revision": None, "seed": 0}
    assert m["runtime"] == {"cuda_graphs": False, "scheduler": "EulerDiscreteScheduler", "sigmas_device": "cpu",
                            "default_pixels": {"native": 64, "served": 64}}
    env = m["environment"]
    assert env["torch"] == torch.__version__ and env["torch_git"] == torch.version.git_version
    assert env["cpu_isa"] == torch.backends.cpu.get_cpu_capability() and env["device_type"] == "cpu"
    for stage in ("load", "capture", "optimize", "export", "compile", "package", "validate"):
        assert m["timings"][stage] >= 0
        assert any(s == stage for s, _ in built.progress)
    checked = {"unet": [["1x64x64", "1x64x64 unguided"],
                        ["2x64x96", "1x64x96", "2x64x96 unguided", "1x64x96 unguided"],
                        ["2x64x64", "1x32x32", "3x96x96", "1x32x32 unguided"]],
               "vae_decoder": [["1x64x64"], ["2x64x96", "1x64x96"], ["2x64x64", "1x32x32", "3x96x96"]]}
    checked["vae_encoder"] = checked["vae_decoder"]
    calls = {"unet": [[1, 2], [1, 4], [1, 6]], "vae_decoder": [None, [1, 2], [1, 3]]}
    calls["vae_encoder"] = calls["vae_decoder"]
    for name in ("unet", "vae_decoder", "vae_encoder"):
        entry = m["components"][name]
        assert [v["name"] for v in entry["variants"]] == ["b1_64x64", "b2_64x96", "dynamic"]
        assert [v["numerics"]["checked_at"] for v in entry["variants"]] == checked[name]
        assert [v.get("call_batch") for v in entry["variants"]] == calls[name]
        for variant in entry["variants"]:
            # float32 compiled vs eager differ by rounding alone (~1e-6), far inside the tolerance; 0 would
            # mean nothing was compared
            assert variant["numerics"]["tolerance"] == 1e-3 and 0 < variant["numerics"]["max_rel_error"] < 2e-5
            assert all("shape" in i or "dims" in i or "value" in i for i in variant["inputs"])
        assert entry["constants"]["count"] > 0
    unet_inputs = {i["path"]: i for i in m["components"]["unet"]["variants"][1]["inputs"]}
    assert unet_inputs["args[0]"]["shape"] == [4, 4, 32, 48]
    assert unet_inputs["added_cond_kwargs.time_ids"]["shape"] == [4, 6]
    for rel, entry in m["files"].items():
        assert sha256_file(built.folder / rel) == entry["sha256"]


def test_packages_hold_no_weights(built):
    from safetensors.torch import load_file

    for name in ("unet", "vae_decoder"):
        weights = load_file(built.folder / f"{name}.safetensors")
        archive = zipfile.ZipFile(built.folder / f"{name}.pt2")
        package = b"".join(archive.read(member) for member in archive.namelist())
        largest = max(weights.values(), key=lambda t: t.numel())
        assert largest.numpy().tobytes()[:256] not in package
        assert not any("constants" in n or n.endswith(".bin") for n in archive.namelist())


@pytest.mark.parametrize("bucket", [ShapeBucket(1, 64, 64), ShapeBucket(2, 64, 96)], ids=str)
def test_compiled_pipeline_matches_eager(built, tiny_target, bucket):
    expected = generate(eager_pipeline(tiny_target), bucket)
    pipe = aotbuild.load_pipeline(built.folder)
    images = generate(pipe, bucket)
    assert pipe.unet.last_variant == pipe.vae.last_variant == f"b{bucket.batch}_{bucket.height}x{bucket.width}"
    assert images.shape == (bucket.batch, bucket.height, bucket.width, 3)
    np.testing.assert_allclose(images, expected, atol=IMAGE_ATOL, rtol=0)


def test_load_pipeline_never_materialises_compiled_weights(built):
    pipe = aotbuild.load_pipeline(built.folder)
    assert isinstance(pipe.unet, CompiledComponent) and isinstance(pipe.vae, CompiledAutoencoderBase)
    assert all(isinstance(part, CompiledComponent) for part in (pipe.vae.decoder, pipe.vae.encoder))
    # Their parameters are the artifact's weights, mapped from its weights files: the original
    # modules' weights were never made.
    for module, files in ((pipe.unet, ["unet"]), (pipe.vae, ["vae_decoder", "vae_encoder"])):
        assert mapped_from(list(module.parameters()), [built.folder / f"{name}.safetensors" for name in files])
        assert list(module.buffers()) == []
    # what StableDiffusionXLPipeline reads from them
    assert pipe.unet.config.in_channels == 4 and pipe.unet.config.sample_size == 32
    assert pipe.unet.config.time_cond_proj_dim is None and pipe.unet.config.addition_time_embed_dim == 8
    assert pipe.unet.add_embedding.linear_1.in_features == 80
    assert pipe.vae.config.scaling_factor == 0.13025 and pipe.vae.config.force_upcast is True
    assert pipe.vae_scale_factor == 2
    assert pipe.unet.dtype == pipe.vae.dtype == torch.float32 and pipe.device.type == "cpu"


@pytest.mark.parametrize("weights", ["artifact", "pipeline"])
def test_apply_swaps_in_compiled_modules_and_frees_originals(built, tiny_target, weights):
    """weights="artifact" frees the original modules with their weights; the default binds the
    pipeline's tensors themselves (no copy when dtype and layout already fit) and frees the rest."""
    pipe = eager_pipeline(tiny_target)
    bucket = ShapeBucket(1, 64, 64)
    expected = generate(pipe, bucket)
    unet_ref = weakref.ref(pipe.unet)
    weight_ref = weakref.ref(pipe.unet.conv_in.weight)
    storage = pipe.unet.conv_in.weight.data_ptr()
    aotbuild.apply(pipe, built.folder, weights=weights)
    gc.collect()
    assert unet_ref() is None and weight_ref() is None
    assert (pipe.unet.weights["conv_in.weight"].data_ptr() == storage) == (weights == "pipeline")
    assert isinstance(pipe.unet, CompiledComponent) and isinstance(pipe.vae, CompiledAutoencoderBase)
    np.testing.assert_allclose(generate(pipe, bucket), expected, atol=IMAGE_ATOL, rtol=0)


def _replace_weights(folder, pipe):
    """Write `pipe`'s weights into the artifact under the exported FQNs."""
    from safetensors.torch import save_file

    from aotbuild.spec.vae_parts import VaeDecoderModule

    save_file({k: v.contiguous() for k, v in pipe.unet.state_dict().items()}, folder / "unet.safetensors")
    save_file({k: v.contiguous() for k, v in VaeDecoderModule(pipe.vae).state_dict().items()},
              folder / "vae_decoder.safetensors")


def test_weights_are_really_bound_at_load(artifact_copy, tiny_target):
    """Other-seed weights in the same package reproduce the other seed's eager output."""
    from aotbuild.builder.capture import capture_inputs, decode_pending
    from aotbuild.spec.pipelines import pipeline_spec

    other = eager_pipeline(tiny_target, seed=1)
    original = eager_pipeline(tiny_target)
    _replace_weights(artifact_copy, other)
    _, modules = load_components(artifact_copy, verify=False)
    specs = [pipeline_spec(tiny_target.pipeline).component(n) for n in ("unet", "vae_decoder")]
    calls = capture_inputs(other, specs, batch=1, height=64, width=64, guidance_scale=5.0)
    decode_pending({"b1_64x64": calls}, specs[1], other.vae)  # the decoder's call, recorded undecoded
    for spec in specs:
        call = calls[spec.name]
        compiled = modules[spec.attribute]
        if spec.name == "unet":
            out = compiled(*call.args, **call.kwargs)[0]
            theirs = original.unet(*call.args, **call.kwargs)[0]
        else:
            out = compiled.decode(*call.args, return_dict=False)[0]
            theirs = original.vae.decode(*call.args, return_dict=False)[0]
        torch.testing.assert_close(out, call.output, atol=1e-4, rtol=1e-4)
        assert (out - theirs).abs().max() > 1e-2  # the seed-0 weights would give something else


def test_uncovered_shape_is_a_clear_error(built):
    pipe = aotbuild.load_pipeline(built.folder)
    with pytest.raises(ShapeNotSupportedError, match=r"unet: no compiled variant for this call \("
                       r"StableDiffusionXLPipeline\(height=128, width=128, num_images_per_prompt=1, "
                       r"guidance_scale=5.0\)\): 1 image at 128x128 px with guidance; none compiled for 128x128 px; "
                       r"this artifact covers: 64x64 px, 1 image, with and without guidance; 64x96 px, "
                       r"1-2 images, with and without guidance; 32-96x32-96 px \(multiples of 4\), 1-3 images"):
        generate(pipe, ShapeBucket(1, 128, 128))


def test_eager_fallback_only_when_asked(built, tiny_target):
    pipe = aotbuild.apply(eager_pipeline(tiny_target), built.folder, eager_fallback=True)
    expected = generate(eager_pipeline(tiny_target), ShapeBucket(1, 128, 128))
    with pytest.warns(UserWarning, match="no compiled variant.*running eager"):
        images = generate(pipe, ShapeBucket(1, 128, 128))
    assert pipe.unet.last_variant == "eager"
    np.testing.assert_allclose(images, expected, atol=IMAGE_ATOL, rtol=0)


def test_flipped_byte_is_refused(artifact_copy):
    path = artifact_copy / "unet.pt2"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptArtifactError, match=r"unet.pt2: sha256 is [0-9a-f]{64}, the manifest says"):
        aotbuild.load_pipeline(artifact_copy)


def test_missing_file_is_refused(artifact_copy):
    (artifact_copy / "vae_decoder.safetensors").unlink()
    with pytest.raises(CorruptArtifactError, match="vae_decoder.safetensors is missing"):
        verify_files(artifact_copy, read_manifest(artifact_copy))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("torch", "2.99.0+cu999", rf"torch is '2.99.0\+cu999' in the artifact, '{re.escape(torch.__version__)}' here"),
    ("device_type", "cuda", r"device_type is 'cuda' in the artifact"),
    ("platform", "linux-aarch64", r"platform is 'linux-aarch64' in the artifact"),
    ("cpu_isa", "AMX", r"cpu_isa is 'AMX' in the artifact"),
])
def test_incompatible_environment_is_refused(artifact_copy, field, value, message):
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    manifest["environment"][field] = value
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleArtifactError, match=message) as info:
        aotbuild.load_pipeline(artifact_copy)
    assert info.value.field == field


def test_cpu_without_the_build_machines_instructions_is_refused(artifact_copy):
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    manifest["environment"]["cpu_flags"] = [*manifest["environment"]["cpu_flags"], "avx10_9"]  # no CPU has it
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleArtifactError, match=r"cpu_flags is .*, 'a CPU without avx10_9' here"):
        aotbuild.load_pipeline(artifact_copy)


def test_wrong_dtype_or_device_is_refused(built):
    """Each with what to do instead (rebuilding on this machine would build the same artifact)."""
    with pytest.raises(IncompatibleArtifactError, match="dtype is 'float32' in the artifact, 'bfloat16' here") as info:
        aotbuild.load_pipeline(built.folder, dtype="bfloat16")
    assert info.value.hint == 'load it without dtype= (it runs float32), or build a target with dtype = "bfloat16"'
    with pytest.raises(IncompatibleArtifactError, match="device_type is 'cpu' in the artifact, 'cuda' here") as info:
        load_components(built.folder, device="cuda")
    assert info.value.hint == ("load it with device='cpu', or build a target for cuda (a copy of its target with "
                               'device = "cuda")')


def test_second_build_is_skipped_and_a_changed_target_is_not_fresh(built, tiny_target):
    import dataclasses

    before = sha256_file(built.folder / "manifest.json")
    messages = []
    result = build(tiny_target, built.artifacts, progress=lambda s, m: messages.append(s))
    assert result.skipped and messages == ["fresh"]
    assert sha256_file(built.folder / "manifest.json") == before
    assert not is_fresh(built.folder, dataclasses.replace(tiny_target, guidance_scale=7.0))


def _hold_lock(lock: os.PathLike) -> subprocess.Popen:
    """Another process holding a build lock (as a build in progress does) until it is killed."""
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)",
                               str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_killed_build_leaves_previous_artifact(built, tmp_path):
    import fcntl

    from aotbuild.builder.transaction import STAGING_DIRNAME, recover_stale_staging, target_lock

    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.folder, artifacts / built.folder.name)
    manifest = read_manifest(artifacts / built.folder.name)
    process = subprocess.Popen(
        [sys.executable, "-m", "aotbuild.cli", "build", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"),
         "--artifacts", str(artifacts), "--force"],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    for line in process.stderr:  # kill it mid-build (capturing), after it has written into its staging folder
        if "[  capture]" in line or time.monotonic() > deadline:
            break
    staging_root = artifacts / STAGING_DIRNAME  # inside artifacts/: the final rename never crosses filesystems
    lock = staging_root / f"{built.folder.name}.lock"
    with open(lock) as f, pytest.raises(BlockingIOError):  # the building process holds its target's lock
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    time.sleep(2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert sorted(p.name for p in artifacts.iterdir()) == [STAGING_DIRNAME, built.folder.name]
    verify_files(artifacts / built.folder.name, manifest)
    staging = staging_root / built.folder.name
    assert [p.name.split("-")[0] for p in staging.iterdir()] == ["build"]
    # The kernel dropped the dead build's lock, whatever its PID is now; whoever takes it owns the
    # folder, so everything in it is stale (the next build does this first).
    with target_lock(staging_root, built.folder.name) as staging_dir:
        recover_stale_staging(staging_dir, artifacts / built.folder.name)
        assert list(staging.iterdir()) == []
    assert not staging_root.exists()  # the lock file, the staging folders: nothing is left behind
    verify_files(artifacts / built.folder.name, manifest)


def test_a_build_stopped_by_sigterm_leaves_nothing_behind(tmp_path):
    """SIGTERM (a CI timeout, `timeout`, a container stop) is Ctrl-C: the staging folder and the
    lock file go, the exit code says the signal."""
    from aotbuild.builder.transaction import STAGING_DIRNAME

    artifacts = tmp_path / "artifacts"
    process = subprocess.Popen(
        [sys.executable, "-m", "aotbuild.cli", "build", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"),
         "--artifacts", str(artifacts)],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    for line in process.stderr:  # mid-build, after it has written into its staging folder
        if "[  capture]" in line or time.monotonic() > deadline:
            break
    assert (artifacts / STAGING_DIRNAME).is_dir()
    process.send_signal(signal.SIGTERM)
    rest = process.stderr.read()
    assert process.wait() == 143
    assert "error: stopped by SIGTERM" in rest and "Traceback" not in rest
    assert list(artifacts.iterdir()) == []


def test_build_killed_between_renames_gets_its_previous_artifact_back(built, tmp_path):
    from aotbuild.builder.transaction import STAGING_DIRNAME, recover_stale_staging, target_lock

    artifacts = tmp_path / "artifacts"
    parked = artifacts / STAGING_DIRNAME / built.folder.name / "old-x1y2" / "artifact"
    shutil.copytree(built.folder, parked)
    with target_lock(artifacts / STAGING_DIRNAME, built.folder.name) as staging_dir:
        recover_stale_staging(staging_dir, artifacts / built.folder.name)
    verify_files(artifacts / built.folder.name, read_manifest(artifacts / built.folder.name))
    assert list(artifacts.iterdir()) == [artifacts / built.folder.name]


def test_build_locks_stay_exclusive_while_finished_builds_remove_them(tmp_path):
    """Each build removes its lock file and staging folders when it ends; builds waiting meanwhile
    still take turns (one that locks a removed file opens the path again), and none is left."""
    import threading

    from aotbuild.builder.transaction import target_lock

    staging_root, inside, overlaps, done = tmp_path / ".staging", [], [], []

    def one_build(i: int) -> None:
        for _ in range(5):
            with target_lock(staging_root, "t", None, lambda stage, message: None) as staging_dir:
                inside.append(i)
                overlaps.extend([list(inside)] if len(inside) > 1 else [])
                (staging_dir / f"build-{i}").mkdir()
                time.sleep(0.01)
                (staging_dir / f"build-{i}").rmdir()
                inside.remove(i)
                done.append(i)

    threads = [threading.Thread(target=one_build, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [] and not staging_root.exists()
    assert sorted(done) == sorted(list(range(6)) * 5)  # no build failed to take its turn


def test_build_waiting_for_the_lock_checks_freshness_again(built, tiny_target, tmp_path):
    """A second build of a target waits for the first; when that one has made the artifact fresh,
    the second does nothing (freshness is checked again under the lock)."""
    import threading

    from aotbuild.builder.transaction import STAGING_DIRNAME

    artifacts = tmp_path / "artifacts"
    (artifacts / STAGING_DIRNAME).mkdir(parents=True)
    holder = _hold_lock(artifacts / STAGING_DIRNAME / f"{built.folder.name}.lock")  # a build in progress
    messages: list[tuple[str, str]] = []
    result = []
    waiting = threading.Thread(target=lambda: result.append(
        build(tiny_target, artifacts, progress=lambda stage, message: messages.append((stage, message)))))
    waiting.start()
    time.sleep(3)
    assert waiting.is_alive()  # not fresh before the lock; waiting for it, and saying so
    assert messages == [("wait", "another build of cpu-tiny-sdxl is running (a build that has not said who it "
                                 "is); waiting for it to finish")]
    shutil.copytree(built.folder, artifacts / built.folder.name)  # what the other build wrote
    holder.kill()
    holder.wait()
    waiting.join(timeout=120)
    assert result and result[0].skipped
    assert messages[1:] == [("fresh", f"{artifacts / built.folder.name} was just built by another process")]


def test_drift_beyond_tolerance_fails_with_figures_unless_allowed(artifact_copy, tiny_target):
    from aotbuild.builder.capture import decode_pending
    from aotbuild.builder.capturing import capture_all
    from aotbuild.builder.plan import plan_target
    from aotbuild.builder.validate import load_artifact, validate_artifact
    from aotbuild.errors import NumericsError
    from aotbuild.spec.pipelines import pipeline_spec

    spec = pipeline_spec(tiny_target.pipeline)
    specs = [spec.component(n) for n in tiny_target.components]
    pipe = eager_pipeline(tiny_target)
    points, plans = plan_target(tiny_target, spec, specs, pipe.vae, 1)
    reference, _, _ = capture_all(pipe, spec, specs, tiny_target, points, torch.device("cpu"), lambda stage, msg: None)
    decode_pending(reference, spec.component("vae_decoder"), pipe.vae)  # as the build does, after its cast
    for calls in reference.values():
        for call in calls.values():
            call.output.mul_(1.5)  # as if the compiled models had drifted by a third
    manifest = read_manifest(artifact_copy)
    loaded = load_artifact(artifact_copy, manifest, torch.device("cpu"))
    with pytest.raises(NumericsError, match=r"unet b1_64x64: relative error 0\.333 > 0\.001") as info:
        validate_artifact(artifact_copy, manifest, loaded, reference, points, plans, allow_drift=False)
    assert "--allow-numerics-drift" in info.value.hint
    validate_artifact(artifact_copy, manifest, loaded, reference, points, plans, allow_drift=True)
    assert manifest["components"]["vae_decoder"]["variants"][2]["numerics"]["max_rel_error"] > 0.3


def test_a_denoising_loop_that_drifts_fails_the_build_though_each_call_is_within_tolerance(artifact_copy,
                                                                                          tiny_target):
    """Each variant is checked on single calls; the build also runs a short denoising loop, eager
    float32 at capture and compiled at the end (the artifact loaded as a load loads it), and holds
    its final latents to the same tolerance: an error that grows over the steps fails the build."""
    from aotbuild.builder.capturing import Loop, capture_all
    from aotbuild.builder.plan import plan_target
    from aotbuild.builder.targets import LOOP_STEPS
    from aotbuild.builder.validate import load_artifact, validate_loop
    from aotbuild.errors import NumericsError
    from aotbuild.spec.pipelines import pipeline_spec

    built = read_manifest(artifact_copy)
    assert built["validation"]["loop"]["steps"] == LOOP_STEPS and built["validation"]["loop"]["compared"] == \
        "final latents"
    assert built["validation"]["loop"]["rel_l2_error"] < 1e-4  # float32: rounding alone
    spec = pipeline_spec(tiny_target.pipeline)
    specs = [spec.component(n) for n in tiny_target.components]
    pipe = eager_pipeline(tiny_target)
    points, plans = plan_target(tiny_target, spec, specs, pipe.vae, 1)
    loop = Loop(plans["unet"][0].points[0], LOOP_STEPS)
    capture_all(pipe, spec, specs, tiny_target, {loop.point: points[loop.point]}, torch.device("cpu"),
                lambda stage, msg: None, loop=loop)
    for s in specs:
        setattr(pipe, s.attribute, None)
    manifest = read_manifest(artifact_copy)
    loaded = load_artifact(artifact_copy, manifest, torch.device("cpu"))
    figures = validate_loop(manifest, loaded, pipe, spec, loop, torch.device("cpu"), allow_drift=False)
    assert figures["rel_l2_error"] < 1e-4 and figures["at"] == "b1_64x64"
    loop.latents = loop.latents * 1.01  # as if the steps had carried an error forward
    with pytest.raises(NumericsError, match=r"a 3-step denoising loop at b1_64x64 drifts from eager float32: its "
                                            r"final latents' relative error 0\.0099\d* > 0\.001 \(every single call "
                                            r"was within it"):
        validate_loop(manifest, loaded, pipe, spec, loop, torch.device("cpu"), allow_drift=False)
    assert validate_loop(manifest, loaded, pipe, spec, loop, torch.device("cpu"),
                         allow_drift=True)["max_rel_error"] > 1e-3

