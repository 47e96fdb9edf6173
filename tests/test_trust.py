"""Never silently wrong, never stale, safe to expose. Every ordinary call on a compiled pipeline
either does what it does on the eager pipeline (checked against it with the same seeds) or refuses
in the user's terms before anything changes; inputs are never silently changed; a build is stale
when what it was built from moved; a load reads exactly what it checked; native code from the Hub
is loaded only on purpose; the process is left as it was found."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import aotbuild
from aotbuild.builder.targets import ShapeBucket, load_target
from aotbuild.errors import (
    BuildError,
    CorruptArtifactError,
    IncompatibleArtifactError,
    NoMatchingVariantError,
    ShapeNotSupportedError,
    SourceError,
    UnsupportedCallError,
    UntrustedCodeError,
    WeightsMismatchError,
)

from .conftest import ROOT, TARGETS, build_once, eager_pipeline, file_mappings, generate, make_lora

ATOL = 1e-4  # images in [0, 1]; float32 compiled vs eager differ by ~1e-6
FAMILIES = ("cpu-tiny-sdxl", "cpu-tiny-sd15", "cpu-tiny-sd3", "cpu-tiny-flux")
slow = pytest.mark.slow


def run(pipe, **call):
    call = {"num_inference_steps": 2, "height": 64, "width": 64, "output_type": "np", **call}
    return pipe("a red fox in the snow", generator=torch.Generator("cpu").manual_seed(0), **call).images


def denoiser(pipe):
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


def close(a, b) -> None:
    np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(target, artifact folder) of each tiny pipeline, built once per session."""
    target = load_target(TARGETS / f"{request.param}.toml")
    return target, build_once(tmp_path_factory, target).folder


# -- Calls that did nothing and said nothing ------------------------------------------------------

@slow
def test_load_state_dict_writes_the_bound_weights_as_eager_loads_them(family):
    target, folder = family
    compiled, eager = aotbuild.load_pipeline(folder), eager_pipeline(target)
    other = eager_pipeline(target, seed=1)
    before = run(compiled)
    partial = {k: v for k, v in denoiser(other).state_dict().items() if re.search(r"\.to_[qk]\.", k)}
    assert partial
    got, want = denoiser(compiled).load_state_dict(partial, strict=False), denoiser(eager).load_state_dict(
        partial, strict=False)
    assert (sorted(got.missing_keys), got.unexpected_keys) == (sorted(want.missing_keys), want.unexpected_keys)
    after = run(compiled)
    close(after, run(eager))
    assert np.abs(after - before).max() > 1e-3  # the weights really changed

    # Refused before anything changes: a strict load missing keys, a tensor of another shape.
    with pytest.raises(WeightsMismatchError, match=r"load_state_dict\(strict=True\): missing keys .* nothing was "
                                                   r"loaded"):
        denoiser(compiled).load_state_dict({k: v * 0 for k, v in partial.items()})
    first = next(iter(partial))
    with pytest.raises(WeightsMismatchError, match=rf"tensor '{re.escape(first)}' is \[3\]; the model's is"):
        denoiser(compiled).load_state_dict({first: torch.zeros(3)}, strict=False)
    np.testing.assert_array_equal(run(compiled), after)

    # A whole checkpoint, strict, the VAE's too: what eager computes with it.
    for module in (compiled, eager):
        denoiser(module).load_state_dict(denoiser(other).state_dict())
        module.vae.load_state_dict(other.vae.state_dict())
    close(run(compiled), run(eager))


@slow
def test_load_state_dict_goes_through_fused_int8_and_channels_last_weights(built_int8, int8_target):
    """Tensors named as the eager UNet names them land where fuse_qkv, int8 and channels_last put
    them: exactly the constants a whole checkpoint with those tensors makes (apply(weights=...))."""
    from aotbuild.runtime import load_weights
    from aotbuild.runtime.checkpoint import checkpoint_constants, module_tensors
    from aotbuild.spec.manifest import DTYPES

    pipe = aotbuild.load_pipeline(built_int8.folder)
    eager_unet = eager_pipeline(int8_target).unet
    partial = {k: v for k, v in eager_pipeline(int8_target, seed=1).unet.state_dict().items()
               if ".attn1.to_k." in k or k.startswith("conv_in.") or ".ff.net.2." in k}
    pipe.unet.load_state_dict(partial, strict=False)
    eager_unet.load_state_dict(partial, strict=False)
    entry = built_int8.manifest["components"]["unet"]
    stored = load_weights(built_int8.folder / entry["weights"], torch.device("cpu"), entry["constants"]["layouts"])
    expected = checkpoint_constants("unet", module_tensors(eager_unet), stored, DTYPES[entry["dtype"]],
                                    "int8_dynamic", torch.device("cpu"))
    changed = [fqn for fqn in expected if not torch.equal(stored[fqn], expected[fqn])]
    assert "conv_in.weight" in changed and any(".to_qkv." in f for f in changed)  # fused rows, NHWC conv
    assert any(".ff.net.2.parametrizations.weight.original0" in f for f in changed)  # int8 rows
    for fqn, tensor in expected.items():
        bound = pipe.unet.weights[fqn]
        assert torch.equal(bound, tensor) and bound.stride() == tensor.stride(), fqn


@slow
def test_parameters_are_the_eager_models_over_the_bound_weights(built, tiny_target):
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(tiny_target)
    first = next(compiled.unet.parameters())  # the idiom for a model's dtype and device
    assert (first.dtype, first.device.type) == (torch.float32, "cpu")
    for module in ("unet", "vae"):  # names, shapes, dtypes, counts: the eager model's
        ours, theirs = (dict(getattr(pipe, module).named_parameters()) for pipe in (compiled, eager))
        assert {n: (p.shape, p.dtype) for n, p in ours.items()} == {n: (p.shape, p.dtype) for n, p in theirs.items()}
        assert set(getattr(compiled, module).state_dict()) == set(getattr(eager, module).state_dict())
    params = dict(compiled.unet.named_parameters())
    assert all(p.data_ptr() == compiled.unet.weights[n].data_ptr() for n, p in params.items())  # the bound memory
    assert compiled.unet.num_parameters() == eager.unet.num_parameters()

    with torch.no_grad():  # a user's edit loop, in place
        for module in (compiled.unet, eager.unet, compiled.vae, eager.vae):
            for name, param in module.named_parameters():
                if name.endswith(("conv_in.weight", "attn2.to_out.0.weight")):
                    param.mul_(0.5)
    close(run(compiled), run(eager))

    new = torch.randn_like(compiled.unet.get_parameter("conv_out.weight"))  # `p.data = new`: bound anew
    compiled.unet.get_parameter("conv_out.weight").data = new.clone()
    dict(eager.unet.named_parameters())["conv_out.weight"].data = new.clone()
    close(run(compiled), run(eager))
    compiled.unet.get_parameter("conv_out.weight").data = new.double()
    with pytest.raises(UnsupportedCallError, match=r"parameter 'conv_out.weight' was replaced by a .* float64 "
                                                   r"tensor .*; the compiled code reads .* float32"):
        run(compiled)


@slow
@pytest.mark.parametrize("recipe", ["built_int8", "built_bf16_prepack"])
def test_fused_and_int8_weights_are_the_eager_models_parameters_and_take_their_edits(recipe, request, tiny_target):
    """fuse_qkv binds one to_qkv per attention, int8 a data and a scale per linear: parameters()
    are still the eager UNet's (to_q's rows of to_qkv, a view; an int8 weight's float values, a
    copy), and an edit in place of either reaches the next call as load_state_dict with the same
    tensors does (a copy's values written back through the recorded passes)."""
    built = request.getfixturevalue(recipe)
    pipe, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(tiny_target).unet
    dtype = pipe.unet.dtype
    ours, theirs = dict(pipe.unet.named_parameters()), dict(eager.named_parameters())
    assert {n: (p.shape, p.dtype) for n, p in ours.items()} == {n: (p.shape, dtype) for n, p in theirs.items()}
    q = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    assert q not in pipe.unet.weights  # fused in the code
    fused = pipe.unet.weights.get(q.replace("to_q.", "to_qkv."))
    if fused is not None:  # bfloat16, fused: to_q is its rows
        assert ours[q].untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    else:  # int8: its float values
        assert ours[q].dtype == torch.float32 and ours[q].untyped_storage().data_ptr() not in {
            t.untyped_storage().data_ptr() for t in pipe.unet.weights.values()}

    other = aotbuild.load_pipeline(built.folder)
    ff = next(n for n in ours if ".ff.net.2.weight" in n)
    edited = {name: ours[name].detach() * 0.5 for name in (q, ff, "conv_in.weight")}
    other.unet.load_state_dict(edited, strict=False)
    with torch.no_grad():
        for name in edited:
            ours[name].mul_(0.5)  # the user's edit loop: in place
    np.testing.assert_array_equal(run(pipe), run(other))
    assert np.abs(run(pipe) - run(aotbuild.load_pipeline(built.folder))).max() > 1e-3  # it changed


@slow
def test_another_dtype_device_or_autocast_is_refused_before_anything_changes(built):
    pipe = aotbuild.load_pipeline(built.folder)
    before = run(pipe)
    with pytest.raises(UnsupportedCallError, match="compiled by aotbuild for float32 and cannot run bfloat16") as info:
        pipe.to(torch.bfloat16)
    assert info.value.hint == 'build a target with dtype = "bfloat16"'
    assert pipe.text_encoder.dtype == pipe.text_encoder_2.dtype == torch.float32  # nothing was converted
    for call in (pipe.unet.half, pipe.unet.bfloat16, lambda: pipe.vae.to(torch.float16),
                 lambda: pipe.to("cpu", torch.float16)):
        with pytest.raises(UnsupportedCallError, match="compiled by aotbuild for float32"):
            call()
    with pytest.raises(UnsupportedCallError, match="compiled by aotbuild for cpu and cannot move to meta"):
        pipe.unet.to("meta")
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            UnsupportedCallError, match=r'unet is called under torch.autocast\("cpu", dtype=torch.bfloat16\); it is '
                                        r"compiled by aotbuild for float32 and cannot follow autocast"):
        run(pipe)
    pipe.to("cpu")  # what the artifact runs: exactly nothing changes
    pipe.to(torch.float32)
    pipe.unet.float()
    pipe.vae.cpu()
    np.testing.assert_array_equal(run(pipe), before)


@slow
def test_model_methods_it_cannot_honour_are_refused_naming_the_way(built, tmp_path):
    pipe = aotbuild.load_pipeline(built.folder)
    unet, vae = pipe.unet, pipe.vae
    refused = {
        "enable_layerwise_casting": lambda: unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn),
        "enable_group_offload": lambda: unet.enable_group_offload(torch.device("cpu")),
        "set_attention_backend": lambda: unet.set_attention_backend("native"),
        "enable_xformers_memory_efficient_attention": unet.enable_xformers_memory_efficient_attention,
        "compile_repeated_blocks": unet.compile_repeated_blocks,
        "enable_gradient_checkpointing": unet.enable_gradient_checkpointing,
        "save_pretrained": lambda: unet.save_pretrained(tmp_path / "unet"),
        "compile": unet.compile,
        "apply": lambda: vae.apply(lambda module: None),
    }
    for method, call in refused.items():
        with pytest.raises(UnsupportedCallError, match=rf"\.{method}\(\) .*; the (unet|vae) is compiled by aotbuild"):
            call()
    for call in (unet.train, lambda: vae.requires_grad_(True)):
        with pytest.raises(UnsupportedCallError, match="computes no gradients"):
            call()
    assert not (tmp_path / "unet").exists()
    unet.disable_xformers_memory_efficient_attention()  # turning off what the compiled code never had
    unet.eval()
    unet.requires_grad_(False)

    config = dict(pipe.config)
    with pytest.raises(UnsupportedCallError, match=r"save_pretrained\(\): (vae, unet|unet, vae) are compiled by "
                                                   r"aotbuild.*nothing was written") as info:
        pipe.save_pretrained(tmp_path / "saved")
    assert "aotbuild push" in info.value.hint
    assert not (tmp_path / "saved").exists() and dict(pipe.config) == config and pipe.config.vae != (None, None)


@slow
def test_the_plain_diffusers_call_of_a_denoiser_takes_its_defaults(tmp_path_factory):
    """`pipe.unet(sample, t, encoder_hidden_states=..., added_cond_kwargs=...)` leaves out what the
    pipeline passes (timestep_cond, cross_attention_kwargs): the eager forward's defaults. A dict's
    keys in another order are the same inputs."""
    from aotbuild.builder import capture
    from aotbuild.spec.pipelines import pipeline_spec

    for name, left_out in (("cpu-tiny-sdxl", ("timestep_cond", "cross_attention_kwargs")),
                           ("cpu-tiny-flux", ("joint_attention_kwargs",))):
        target = load_target(TARGETS / f"{name}.toml")
        compiled = aotbuild.load_pipeline(build_once(tmp_path_factory, target).folder)
        eager = eager_pipeline(target)
        spec = pipeline_spec(target.pipeline)
        call = capture.capture_inputs(eager, [spec.components["unet" if "unet" in spec.components else
                                                              "transformer"]], batch=1, height=64, width=64,
                                      guidance_scale=5.0)
        call = next(iter(call.values()))
        kwargs = {k: v for k, v in call.kwargs.items() if k not in (*left_out, "return_dict")}
        with torch.no_grad():
            want = denoiser(eager)(*call.args, **kwargs).sample
            got = denoiser(compiled)(*call.args, **kwargs).sample
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            if "added_cond_kwargs" in kwargs:
                added = dict(reversed(kwargs["added_cond_kwargs"].items()))
                got = denoiser(compiled)(*call.args, **{**kwargs, "added_cond_kwargs": added}).sample
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            with pytest.raises(TypeError, match="forward\\(\\): got an unexpected keyword argument 'foo'"):
                denoiser(compiled)(*call.args, **kwargs, foo=1)


@slow
def test_the_eager_fallback_follows_the_weights_or_refuses(built, tiny_target):
    pipe = aotbuild.apply(eager_pipeline(tiny_target), built.folder, eager_fallback=True)
    reference = eager_pipeline(tiny_target)
    partial = {k: v for k, v in eager_pipeline(tiny_target, seed=1).unet.state_dict().items() if ".attn1." in k}
    for module in (pipe, reference):
        module.unet.load_state_dict(partial, strict=False)
    large = ShapeBucket(1, 128, 128)
    with pytest.warns(UserWarning, match="running eager"):
        np.testing.assert_allclose(generate(pipe, large), generate(reference, large), atol=ATOL, rtol=0)
    param = pipe.unet.get_parameter("conv_in.weight")
    param.data = param.data.clone()  # the compiled code reads the new tensor; the eager module cannot
    generate(pipe, ShapeBucket(1, 64, 64))
    with pytest.raises(ShapeNotSupportedError, match=r"the eager fallback cannot run this unet's weights: parameter "
                                                     r"'conv_in.weight' was replaced"):
        generate(pipe, large)


# -- Inputs silently changed ----------------------------------------------------------------------

@slow
def test_a_unet_captured_with_integer_timesteps_takes_every_schedulers(tmp_path_factory, tmp_path):
    """SD 1.5 ships PNDM (int64 timesteps): its UNet is exported with a float timestep, so Euler's
    fractional Karras timesteps and DPM-Solver's reach it unchanged, as eager takes them."""
    from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler

    from aotbuild.errors import LossyInputError

    target = load_target(TARGETS / "cpu-tiny-sd15-pndm.toml")
    built = build_once(tmp_path_factory, target)
    inputs = {i["path"]: i for i in built.manifest["components"]["unet"]["variants"][0]["inputs"]}
    assert inputs["args[1]"]["dtype"] == "float32"
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(target)
    assert type(compiled.scheduler).__name__ == "PNDMScheduler"
    schedulers = {"PNDM": None, "Euler": (EulerDiscreteScheduler, {}),
                  "Euler Karras": (EulerDiscreteScheduler, {"use_karras_sigmas": True}),
                  "DPM-Solver": (DPMSolverMultistepScheduler, {})}
    for name, scheduler in schedulers.items():
        if scheduler is not None:
            for pipe in (compiled, eager):
                pipe.scheduler = scheduler[0].from_config(pipe.scheduler.config, **scheduler[1])
        for guidance in (5.0, 1.0):
            np.testing.assert_allclose(run(compiled, num_inference_steps=3, guidance_scale=guidance),
                                       run(eager, num_inference_steps=3, guidance_scale=guidance),
                                       atol=ATOL, rtol=0, err_msg=name)
        fractional = bool((compiled.scheduler.timesteps % 1).any())
        assert fractional == name.startswith("Euler"), name  # PNDM's and DPM-Solver's are integers

    # An artifact that recorded integer timesteps refuses a fractional one rather than round it.
    old = Path(shutil.copytree(built.folder, tmp_path / "old"))
    manifest = json.loads((old / "manifest.json").read_text())
    for variant in manifest["components"]["unet"]["variants"]:
        next(i for i in variant["inputs"] if i["path"] == "args[1]")["dtype"] = "int64"
    (old / "manifest.json").write_text(json.dumps(manifest))
    pipe = aotbuild.load_pipeline(old)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)
    with pytest.raises(LossyInputError, match=r"input args\[1\] is \d+\.\d+ \(float32\) in this call; the compiled "
                                              r"model takes int64, which would make it \d+") as info:
        run(pipe, num_inference_steps=3)
    assert "rebuild the artifact" in info.value.hint


# -- Stale or ambiguous artifacts -----------------------------------------------------------------

@slow
def test_a_local_source_resaved_with_other_weights_is_not_fresh(artifact_copy, tiny_target, tmp_path):
    """A target whose source is a local folder records the folder's fingerprint: re-saved with
    other weights, the artifact is stale (build rebuilds); as it was, fresh."""
    import dataclasses

    from aotbuild.builder import is_fresh
    from aotbuild.builder.record import source_record

    folder = tmp_path / "my-sdxl"
    eager_pipeline(tiny_target).save_pretrained(folder)
    local = dataclasses.replace(tiny_target, source=str(folder), seed=0)
    record = source_record(local)
    assert record["id"] == "local:my-sdxl" and re.fullmatch(r"[0-9a-f]{64}", record["fingerprint"])
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    manifest.update(source=record, target_hash=local.content_hash())  # as if built from that folder
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    assert is_fresh(artifact_copy, local)
    eager_pipeline(tiny_target, seed=1).save_pretrained(folder)  # the same names and shapes, other weights
    assert not is_fresh(artifact_copy, local)


@slow
def test_other_libraries_make_an_artifact_stale_and_a_regional_one_refused(built, tiny_target, tmp_path,
                                                                           tmp_path_factory):
    from aotbuild.builder import is_fresh

    assert is_fresh(built.folder, tiny_target)
    stale = Path(shutil.copytree(built.folder, tmp_path / "stale" / built.folder.name))
    manifest = json.loads((stale / "manifest.json").read_text())
    manifest["environment"]["libraries"]["transformers"] = "4.0.0"
    (stale / "manifest.json").write_text(json.dumps(manifest))
    assert not is_fresh(stale, tiny_target)

    regional = build_once(tmp_path_factory, load_target(TARGETS / "cpu-tiny-sdxl-regional.toml")).folder
    other = Path(shutil.copytree(regional, tmp_path / "regional"))
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["environment"]["libraries"]["diffusers"] = "0.30.0"
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleArtifactError, match=r"diffusers is '0.30.0' in the artifact, '[\d.]+' here") \
            as info:
        aotbuild.load_pipeline(other)
    assert "install diffusers==0.30.0, or rebuild it" in info.value.hint


def _swap_when_hashed(monkeypatch, digest: str, swap) -> list:
    """Run `swap` once, right after anything in this process computes the sha256 `digest`."""
    done = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def update(self, data):
            self.inner.update(data)

        def hexdigest(self):
            value = self.inner.hexdigest()
            if value == digest and not done:
                done.append(swap())
            return value

        def __getattr__(self, name):
            return getattr(self.inner, name)

    real_sha256, real_new = hashlib.sha256, hashlib.new
    monkeypatch.setattr(hashlib, "sha256", lambda *a, **k: Spy(real_sha256(*a, **k)))
    monkeypatch.setattr(hashlib, "new", lambda name, *a, **k: Spy(real_new(name, *a, **k)) if name == "sha256"
                        else real_new(name, *a, **k))
    return done


def _swapped_twin(folder: Path, tmp_path: Path, change) -> callable:
    """A copy of the artifact changed by `change`, and the function swapping it into the folder's place."""
    twin = Path(shutil.copytree(folder, tmp_path / "twin"))
    change(twin)

    def swap():
        os.rename(folder, tmp_path / "aside")
        os.rename(twin, folder)
        return True

    return swap


@slow
def test_a_package_replaced_after_its_check_never_fills_the_cache(artifact_copy, tmp_path, monkeypatch):
    """A rebuild renaming a new folder into place between the check and the extraction: the cache
    entry named by the checked hash only ever holds the checked bytes."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("AOTBUILD_CACHE", str(cache))
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    sha = manifest["files"]["unet.pt2"]["sha256"]

    def plant(twin):
        with zipfile.ZipFile(twin / "unet.pt2", "a") as archive:
            archive.writestr("planted.txt", "not the package that was checked")

    done = _swap_when_hashed(monkeypatch, sha, _swapped_twin(artifact_copy, tmp_path, plant))
    try:
        aotbuild.load_pipeline(artifact_copy)
    except CorruptArtifactError as exc:
        assert "changed while it was loaded" in str(exc)
    assert done
    entry = cache / "packages" / sha
    assert not entry.exists() or not list(entry.rglob("planted.txt"))


def test_an_extraction_another_process_completes_between_two_looks_is_kept(tmp_path, monkeypatch):
    """Two replicas starting together on one node: this one finds no marker; the other renames its
    complete extraction into place; this one then finds the folder. It is the other's, whole: kept
    and used, never removed as unmarked (the other process would load from a removed folder)."""
    from aotbuild.runtime import cache

    monkeypatch.setenv("AOTBUILD_CACHE", str(tmp_path / "cache"))
    package = tmp_path / "model.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("model/data/aotinductor/b1/model.so", b"compiled")
    sha = hashlib.sha256(package.read_bytes()).hexdigest()
    root = cache.private_dir(cache.package_cache_dir())
    theirs = root / f".{sha[:16]}-theirs"
    theirs.mkdir()
    cache._extract(package, sha, theirs)
    (theirs / "extracted-by").write_text("the other process")
    folder, is_file = root / sha, Path.is_file

    def look(path):
        found = is_file(path)
        if path == folder / cache.COMPLETE and not folder.exists():  # the other process finishes now
            os.rename(theirs, folder)
        return found

    monkeypatch.setattr(Path, "is_file", look)
    assert cache.extracted_package(package, sha) == folder
    assert (folder / "extracted-by").read_text() == "the other process" and (folder / cache.COMPLETE).is_file()


@slow
def test_weights_replaced_after_their_check_are_not_the_ones_bound(artifact_copy, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("AOTBUILD_CACHE", str(tmp_path / "cache"))
    aotbuild.load_pipeline(artifact_copy)  # packages extracted; then the weights' records are forgotten
    shutil.rmtree(tmp_path / "cache" / "verified")
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    checked = load_file(artifact_copy / "unet.safetensors")

    def other_weights(twin):
        tensors = {k: v + 1 for k, v in checked.items()}
        save_file(tensors, twin / "unet.safetensors")

    done = _swap_when_hashed(monkeypatch, manifest["files"]["unet.safetensors"]["sha256"],
                             _swapped_twin(artifact_copy, tmp_path, other_weights))
    pipe = aotbuild.load_pipeline(artifact_copy)
    assert done
    assert all(torch.equal(pipe.unet.weights[name], tensor) for name, tensor in checked.items())


def _fake_variant(path: str, target_env: dict, pipeline: str = "StableDiffusionXLPipeline") -> dict:
    return {"path": path, "target": path.split("/")[0], "pipeline": pipeline, "dtype": "float32",
            "environment": target_env}


def test_several_fitting_targets_must_be_named_and_exact_kernels_beat_ptx():
    from aotbuild.runtime.hub import choose_variant
    from aotbuild.spec.manifest import environment

    here = environment("cpu")
    index = {"variants": [_fake_variant("sdxl-768/v", here), _fake_variant("sdxl-1024/v", here)]}
    with pytest.raises(NoMatchingVariantError, match="variants of 2 targets fit this machine: sdxl-1024, sdxl-768; "
                                                     "which one is meant is not guessed") as info:
        choose_variant(index, device="cpu", here=here)
    assert 'variant="NAME"' in info.value.hint
    assert choose_variant(index, device="cpu", here=here, variant="sdxl-768")["path"] == "sdxl-768/v"

    a100 = {**here, "device_type": "cuda", "cuda": "12.8", "gpu_capability": "8.0"}
    exact, ptx = (_fake_variant(p, {**a100, "gpu_multi_arch": m}) for p, m in (("t/sm80", False), ("t/sm80-ptx", True)))
    for order in ([exact, ptx], [ptx, exact]):
        assert choose_variant({"variants": order}, device="cuda", here=a100)["path"] == "t/sm80"


@slow
def test_a_hub_load_resolves_the_revision_once(built, monkeypatch):
    """The index and the variant's files come from the one commit the branch resolved to, even when
    a push lands between them."""
    from huggingface_hub import HfApi

    from aotbuild.runtime.hub import push, resolve

    from .hubserver import FakeHub

    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", "hf_aotbuildTrustTestToken")
        first = push(built.folder, "team/pinned").commit
        import huggingface_hub

        original = huggingface_hub.snapshot_download

        def late_push(*args, **kwargs):  # another push lands on main right after the index was read
            HfApi(endpoint=server.url, token="hf_aotbuildTrustTestToken").upload_file(
                path_or_fileobj=b"moved", path_in_repo="MOVED.md", repo_id="team/pinned")
            return original(*args, **kwargs)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", late_push)
        found = resolve("team/pinned")
        assert found.commit == first and found.folder.parent.parent.name == first
        assert server.commits("team/pinned")[-1]["oid"] != first  # main did move


# -- Trust ----------------------------------------------------------------------------------------

def _written_manifest(folder: Path, change=None) -> Path:
    """A manifest of the structure aotbuild writes (files present, hashed), changed by `change`."""
    from aotbuild.spec.manifest import environment, write_manifest

    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in ("unet.pt2", "unet.safetensors"):
        (folder / name).write_bytes(name.encode())
        files[name] = {"bytes": len(name), "sha256": hashlib.sha256(name.encode()).hexdigest()}
    manifest = {"schema": 3, "target": {"name": "t", "pipeline": "StableDiffusionXLPipeline", "device": "cpu",
                                        "dtype": "float32", "shapes": [], "optimize": {}},
                "source": {"id": "random:tiny-sdxl"}, "environment": environment("cpu"),
                "optimizations": {"passes": {}}, "runtime": {}, "files": files,
                "components": {"unet": {"attribute": "unet", "package": "unet.pt2", "weights": "unet.safetensors",
                                        "dtype": "float32", "config": {}, "constants": {},
                                        "variants": [{"name": "b1_64x64", "inputs": []}]}}}
    if change:
        change(manifest)
    write_manifest(folder, manifest)
    return folder


@pytest.mark.parametrize("change, problem", [
    (lambda m: m.pop("environment"), "the manifest lacks 'environment'"),
    (lambda m: m["environment"].pop("device_type"), "its environment lacks 'device_type'"),
    (lambda m: m["files"]["unet.pt2"].update(bytes="9"), "file 'unet.pt2' has 'bytes' that is not an integer"),
    (lambda m: m["components"]["unet"]["variants"].append({"inputs": []}),
     "a variant of component 'unet' lacks 'name'"),
    (lambda m: m["files"].pop("unet.pt2"), r"component unet's package 'unet.pt2' is not among its files"),
], ids=["section", "key", "type", "variant", "unhashed package"])
def test_a_damaged_manifest_is_named_by_load_and_verify(tmp_path, change, problem):
    """A manifest missing a section or a key, or holding another type, is one error naming it
    (a KeyError before); a package the manifest lists no hash for is refused, not hashed against
    itself and trusted."""
    from click.testing import CliRunner

    from aotbuild.cli import main

    folder = _written_manifest(tmp_path / "artifact", change)
    with pytest.raises(CorruptArtifactError, match=rf"manifest.json is damaged: {problem}"):
        aotbuild.load_pipeline(folder)
    result = CliRunner().invoke(main, ["verify", str(folder)])
    assert result.exit_code == 1, result.output
    assert re.search(rf"^error: .*is damaged: {problem}", result.output, re.M), result.output
    assert "Traceback" not in result.output


def test_weights_naming_a_folder_that_is_not_there_say_so(tmp_path):
    """`--weights /no/such/folder` was reported as a malformed Hub repo id; a path is a path. And
    every error a user can catch is importable from `aotbuild`."""
    folder = _written_manifest(tmp_path / "artifact")
    for missing in ("/no/such/folder", "./finetune", "~/nowhere/finetune", "runs/7/finetune"):
        with pytest.raises(SourceError, match=rf"^{re.escape(missing)}: no such folder") as info:
            aotbuild.load_pipeline(folder, weights=missing)
        assert "org/name[@revision]" in info.value.hint
    errors = [name for name in aotbuild.__all__ if isinstance(getattr(aotbuild, name), type)
              and issubclass(getattr(aotbuild, name), aotbuild.AotbuildError)]
    assert "MissingAttributeError" in errors and issubclass(aotbuild.MissingAttributeError, AttributeError)


def test_names_and_guards_a_manifest_gives_the_runtime_are_checked_before_use(tmp_path):
    """A variant's model name is a folder of the package, nothing more (`../x` or a pattern is
    refused before anything is extracted); a guard that is not integer arithmetic on sizes fails
    the load naming it, never a call (where it raised the build's error)."""
    from aotbuild.runtime import open_model
    from aotbuild.runtime.variant import CompiledVariant, LoadContext

    for name in ("../../etc", "*", "b1/../../x", ""):
        with pytest.raises(CorruptArtifactError, match=r"names a compiled model .*, not a plain folder name"):
            open_model(tmp_path / "unet.pt2", "0" * 64, name, torch.device("cpu"))  # no such file: never read
    for guard in ("__import__('os').system('true')", "s0 >", "s0.real > 1"):
        entry = {"name": "dynamic", "inputs": [], "guards": ["s0 % 32 > 0", guard]}
        with pytest.raises(CorruptArtifactError, match=r"variant dynamic: the manifest records a shape guard "
                                                       r"aotbuild cannot check"):
            CompiledVariant.__new__(CompiledVariant)._init_signature(entry, LoadContext("cpu"))


def test_native_code_from_the_hub_needs_trust_remote_code(tmp_path):
    """Refused before anything is downloaded (no Hub is reachable here), naming the repo and the flag."""
    for call in (lambda: aotbuild.load_pipeline("hf://someone/sdxl-aot"),
                 lambda: aotbuild.apply(object(), "hf://someone/sdxl-aot")):
        with pytest.raises(UntrustedCodeError, match="hf://someone/sdxl-aot holds native code") as info:
            call()
        assert "trust_remote_code=True" in info.value.hint and "--trust-remote-code" in info.value.hint
    from click.testing import CliRunner

    from aotbuild.cli import main

    for args in (["run", "--artifact", "hf://someone/sdxl-aot", "--prompt", "x"], ["pull", "someone/sdxl-aot"],
                 ["serve", "--artifact", "hf://someone/sdxl-aot"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and "holds native code" in result.output and "--trust-remote-code" in result.output


def test_a_package_that_would_unpack_past_its_cap_is_refused(tmp_path, monkeypatch):
    from aotbuild.runtime import extracted_package
    from aotbuild.runtime.cache import MAX_UNPACKED_FLOOR

    monkeypatch.setenv("AOTBUILD_CACHE", str(tmp_path / "cache"))
    package = tmp_path / "bomb.pt2"
    with zipfile.ZipFile(package, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("data/aotinductor/model/zeros.bin", bytes(MAX_UNPACKED_FLOOR + 1))
    with pytest.raises(CorruptArtifactError, match=r"would unpack to \d+ bytes from \d+: more than a package"):
        extracted_package(package, hashlib.sha256(package.read_bytes()).hexdigest())
    assert not list((tmp_path / "cache" / "packages").iterdir())


@slow
def test_the_server_checks_coverage_sizes_and_numbers_before_it_allocates(built, monkeypatch, caplog):
    """The HTTP handler in-process (as a replica runs it): every refusal is a 4xx with the reason and
    a request id, a failure is a 500 with the id and no exception text, and no response carries a
    machine path."""

    from aotbuild.serving import schema
    from aotbuild.serving.ingress import Ingress
    from aotbuild.serving.replica import ImageServer
    from aotbuild.serving.schema import MAX_BODY_BYTES

    server = ImageServer(str(built.folder))
    front = Ingress(LocalHandle(server))
    loop = asyncio.new_event_loop()  # one loop, as in a replica: the batch queue lives in it

    def call(method: str, path: str, body: bytes = b"", headers: dict | None = None):
        """The ingress's FastAPI app called as Ray Serve calls it (ASGI), the response collected."""
        sent, answered = [], []

        async def receive():
            if sent:
                return {"type": "http.disconnect"}
            sent.append(True)
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            answered.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
                 "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
                 "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1),
                 "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
        loop.run_until_complete(front.api(scope, receive, send))
        start = next(m for m in answered if m["type"] == "http.response.start")
        content = b"".join(m.get("body", b"") for m in answered if m["type"] == "http.response.body")
        return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, content

    status, headers, body = call("GET", "/health")
    assert status == 200 and set(json.loads(body)) == {"status", "replica"}  # no pid, memory, adapters by default
    server.health_details = True  # `aotbuild serve --health-details`
    status, headers, body = call("GET", "/health")
    health = json.loads(body)
    assert status == 200 and health["artifact"] == built.folder.name and str(built.folder) not in body.decode()
    assert {"pid", "rss_mib", "served"} <= set(health)
    assert call("GET", "/health/")[0] == 200  # a trailing slash is the route, not a redirect
    for method, path, status, words in [
            ("GET", "/healthz", 404, "no such route: GET /healthz"),
            ("GET", "/v1/images/generations/health", 404, "no such route: GET"),  # routed exactly, not by suffix
            ("POST", "/x/v1/images/generations", 404, "no such route: POST"),
            ("POST", "/health", 405, "POST /health: this route takes GET"), ("GET", "/", 405, "this route takes POST")]:
        answered = call(method, path)
        assert answered[0] == status and words in json.loads(answered[2])["error"], (method, path, answered)
    assert "answers POST /, POST /v1/images/generations, POST /v1/images/edits, GET /health, GET /docs" in json.loads(
        call("GET", "/nowhere")[2])["error"]
    # The OpenAPI page documents every route and the request's fields, from the model that validates them.
    status, _, body = call("GET", "/openapi.json")
    paths = json.loads(body)["paths"]
    assert status == 200 and set(paths) == {"/", "/v1/images/generations", "/v1/images/edits", "/health"}
    form = paths["/"]["post"]["requestBody"]["content"]
    assert list(form["application/json"]["schema"]["properties"]) == list(schema.REQUEST_FIELDS)
    assert form["multipart/form-data"]["schema"]["properties"]["image"]["format"] == "binary"
    assert call("GET", "/docs")[0] == 200
    for edit, field in [({"prompt": "a fox", "image": None}, "image"), ({"prompt": "a fox"}, "image")]:
        status, _, body = call("POST", "/v1/images/edits", json.dumps(edit).encode())
        assert status == 400 and f"field '{field}' is required" in json.loads(body)["error"]["message"]
    cases = [
        (json.dumps({"prompt": "a fox", "height": 65536, "width": 65536}).encode(), 422,
         "no compiled variant makes 1 image(s) at 65536x65536 px with guidance; this artifact covers: 64x64 px"),
        (b'{"prompt": "a fox", "guidance_scale": Infinity}', 400, "the body holds Infinity: numbers must be finite"),
        (b'{"prompt": "a fox", "guidance_scale": 1e999}', 400, "'guidance_scale' must be a finite number >= 0"),
        (json.dumps({"prompt": "x" * 5000}).encode(), 400, "field 'prompt' has 5000 characters"),
        (b"{" + b" " * MAX_BODY_BYTES + b"}", 413, f"this server takes {MAX_BODY_BYTES} at most"),
    ]
    for raw, expected_status, message in cases:
        start = time.perf_counter()
        status, headers, body = call("POST", "/", raw)
        answer = json.loads(body)
        assert (status, answer["request"]) == (expected_status, headers["x-aotbuild-request"]), answer
        assert message in answer["error"]
        assert time.perf_counter() - start < 2  # refused before anything was allocated or computed

    # The pipeline's own input checks refusing a call: 422 in its words. Any other ValueError inside the
    # call is the server's failure: 500, its traceback logged under the request id.
    async def batched(call):  # Ray Serve's batching needs a replica: here each request is a batch of one
        return (await server._made([call]))[0]

    monkeypatch.setattr(server, "_batched", batched)
    original = server.pipe.check_inputs

    def check_inputs(*args, **kwargs):  # diffusers' own check, of a size it refuses
        return original(*args[:2], 63, *args[3:], **kwargs)

    monkeypatch.setattr(server.pipe, "check_inputs", check_inputs)
    status, _, body = call("POST", "/", b'{"prompt": "a fox", "steps": 1}')
    assert status == 422 and "have to be divisible by 8 but are 63 and 64" in json.loads(body)["error"], body
    monkeypatch.setattr(server.pipe, "check_inputs", original)

    def internal(*args, **kwargs):
        raise ValueError("an internal shape bug")

    prepare_latents = server.pipe.prepare_latents
    monkeypatch.setattr(server.pipe, "prepare_latents", internal)
    with caplog.at_level(logging.ERROR, logger="aotbuild.serving"):
        status, headers, body = call("POST", "/", b'{"prompt": "a fox", "steps": 1}')
    assert status == 500 and "internal shape bug" not in body.decode(), body
    assert any(headers["x-aotbuild-request"] in r.getMessage() and "internal shape bug" in r.getMessage()
               for r in caplog.records)
    monkeypatch.setattr(server.pipe, "prepare_latents", prepare_latents)

    def broken(calls):
        raise RuntimeError(f"secret detail from {built.folder}")

    monkeypatch.setattr(server, "_generate", broken)
    status, headers, body = call("POST", "/", b'{"prompt": "a fox"}')
    answer = json.loads(body)
    assert status == 500 and answer["request"] == headers["x-aotbuild-request"] and answer["request"] in answer["error"]
    assert "secret" not in body.decode() and str(built.folder) not in body.decode()
    assert schema.scrubbed(f"no artifact at {built.folder}/x") == "no artifact at <path>"

    monkeypatch.setattr(server, "pipe", type("Pipe", (), {"device": torch.device("meta")})())
    status, _, body = call("GET", "/health")  # a device that computes nothing is a failed replica
    assert status == 503 and "failed its health check" in json.loads(body)["error"]
    loop.close()


class LocalHandle:
    """Ray Serve's handle to a deployment, over a replica object in this process: what `Ingress`
    calls (`options(...)`, `method.remote(...)`), so its HTTP handling runs here without Ray."""

    def __init__(self, server):
        self.server = server

    def options(self, **_):
        return self

    def __getattr__(self, name):
        method = getattr(self.server, name)

        async def remote(*args):
            made = method(*args)
            return await made if asyncio.iscoroutine(made) else made

        return type("Method", (), {"remote": staticmethod(remote)})


# -- Process state and concurrency ----------------------------------------------------------------

def test_every_output_is_compared_with_a_max_and_an_l2_error():
    """The build compared a variant's first output only, by its largest difference: a wrong second
    output, or an error spread thin over every value, passed."""
    from aotbuild.builder.validate import beyond_tolerance, output_errors

    sample, other = torch.ones(100), torch.linspace(-1, 1, 100)
    assert output_errors((sample, other), (sample, other))["max_rel_error"] == 0
    wrong_second = output_errors((sample, other * 1.01), (sample, other))
    assert 0.0099 < wrong_second["max_rel_error"] < 0.0101
    assert beyond_tolerance(wrong_second, 1e-3).startswith("relative error 0.01")
    peaked = torch.zeros(100)
    peaked[0] = 100.0  # one large value: the max error relative to it hides an error everywhere else
    spread = output_errors(peaked + torch.full((100,), 0.5), peaked)
    assert spread["max_rel_error"] == 0.005 and spread["rel_l2_error"] > 0.04
    assert beyond_tolerance(spread, 0.01).startswith("relative L2 error 0.05")
    assert output_errors((sample,), (sample, other))["max_rel_error"] != output_errors((sample,), (sample,))[
        "max_rel_error"]  # another number of outputs: NaN, which no tolerance passes


def test_export_context_is_entered_with_its_block():
    from aotbuild.builder import optimize

    context = optimize.export_context({"sdpa": "math"})
    assert torch.backends.cuda.flash_sdp_enabled()  # made, not entered: nothing changed yet
    with context:
        assert not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()


def test_tf32_is_set_for_a_block_and_restored():
    from aotbuild.builder.optimize import apply_tf32
    from aotbuild.runtime.variant import tf32

    assert apply_tf32({}, True, "cuda") == {"enabled": True} and not torch.backends.cuda.matmul.allow_tf32
    with tf32(True):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert not torch.backends.cuda.matmul.allow_tf32


def test_tf32_blocks_of_two_threads_closing_out_of_order_leave_the_flags_as_found():
    """Two loads' calls, each in its own thread with its own lock: entered A, B, closed A, B (each
    block saved and restored the flags itself: A restored off under B, B then restored A's on, for
    the rest of the process). And a build's float32 reference inside its TF32 block."""
    from aotbuild.runtime.variant import tf32

    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    before, steps, seen = flags(), [threading.Event() for _ in range(3)], {}
    assert not before[0]  # torch's default (cudnn's is on)

    def first():
        with tf32(True):
            steps[0].set()
            steps[1].wait(10)
        seen["after A closed"] = torch.backends.cuda.matmul.allow_tf32
        steps[2].set()

    def second():
        steps[0].wait(10)
        with tf32(True):
            steps[1].set()
            steps[2].wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {"after A closed": True}  # B's block is still open
    assert flags() == before
    with tf32(True):
        with tf32(False):
            assert flags() == (False, False)
        assert flags() == (True, True)
    assert flags() == before


def test_a_swap_whose_second_rename_fails_puts_the_previous_artifact_back(tmp_path, monkeypatch):
    """The previous artifact is parked, then the new one renamed into place: when that rename
    fails (a full disk, a permission), the previous one is back at once, not left parked under
    .staging/ with artifacts/<target> empty until the next build."""
    from aotbuild.builder import transaction

    folder, new, staging = tmp_path / "cpu-tiny-sdxl", tmp_path / "new", tmp_path / ".staging"
    for path, text in ((folder, "previous"), (new, "new")):
        path.mkdir()
        (path / "manifest.json").write_text(text)
    staging.mkdir()
    rename = os.rename

    def failing(source, destination):
        if Path(source) == new:
            raise OSError(28, "No space left on device")
        rename(source, destination)

    monkeypatch.setattr(transaction.os, "rename", failing)
    with pytest.raises(OSError, match="No space left"):
        transaction.replace_folder(new, folder, staging)
    assert (folder / "manifest.json").read_text() == "previous"
    assert list(staging.iterdir()) == []  # nothing parked


def test_a_random_source_leaves_the_callers_random_state(tiny_target):
    from aotbuild.runtime import sources

    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    sources.load_components(sources.config_set_dir(tiny_target.source, tiny_target.base_dir), seed=0, skip=set())
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


@slow
def test_a_load_keeps_quiet_only_on_its_own_thread(built):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    other = logging.getLogger("someone.else")
    other.addHandler(handler)
    stop = threading.Event()

    def chatter():
        while not stop.is_set():
            other.warning("a warning from another thread")
            time.sleep(0.001)

    thread = threading.Thread(target=chatter)
    thread.start()
    try:
        start = time.time()
        aotbuild.load_pipeline(built.folder)
        end = time.time()
    finally:
        stop.set()
        thread.join()
        other.removeHandler(handler)
    assert [r for r in records if start < r.created < end]  # seen while the load ran


def _hold_build_lock(staging_root: Path, name: str) -> subprocess.Popen:
    """Another process holding a target's build lock as a build does (its record written)."""
    script = ("import sys; from pathlib import Path; from aotbuild.builder.transaction import target_lock\n"
              "with target_lock(Path(sys.argv[1]), sys.argv[2], None, print):\n"
              "    print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", script, str(staging_root), name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_build_waiting_for_another_says_who_and_gives_up_after_wait(tiny_target, tmp_path):
    from aotbuild.builder import build
    from aotbuild.builder.transaction import STAGING_DIRNAME

    (tmp_path / STAGING_DIRNAME).mkdir()
    holder = _hold_build_lock(tmp_path / STAGING_DIRNAME, tiny_target.name)
    try:
        messages = []
        with pytest.raises(BuildError, match=rf"another build of cpu-tiny-sdxl is still running \(pid {holder.pid} "
                                             r"on .* since .*\) after 0.5 s") as info:
            build(tiny_target, tmp_path, wait=0.5, progress=lambda stage, message: messages.append((stage, message)))
        assert info.value.hint == "let it finish, or wait longer: aotbuild build --wait SECONDS"
        assert len(messages) == 1 and messages[0][0] == "wait"
        assert re.fullmatch(rf"another build of cpu-tiny-sdxl is running \(pid {holder.pid} on \S+ since \S+\); "
                            r"waiting for it to finish \(up to 0.5 s\)", messages[0][1]), messages
    finally:
        holder.communicate("")


def test_a_hung_bench_process_is_stopped():
    from aotbuild.benchmarking.harness import _run_child
    from aotbuild.errors import BenchError

    start = time.perf_counter()
    with pytest.raises(BenchError, match=r"bench case x did not finish in 0.5 s and was stopped"):
        _run_child([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), 0.5, "bench case x")
    assert time.perf_counter() - start < 10


@slow
def test_components_of_one_load_take_turns(built, monkeypatch):
    """The UNet of one request and the VAE of another never run at once: they share one CUDA graph
    pool where graphs are on, so one lock orders every model of a load."""
    from aotbuild.runtime.variant import CompiledVariant

    pipe = aotbuild.load_pipeline(built.folder)
    spans: list[tuple[float, float]] = []
    original = CompiledVariant._run_unlocked

    def timed(self, leaves):
        start = time.perf_counter()
        time.sleep(0.05)
        result = original(self, leaves)
        spans.append((start, time.perf_counter()))
        return result

    monkeypatch.setattr(CompiledVariant, "_run_unlocked", timed)
    latents = torch.randn(1, 4, 32, 32)  # a 64 px image's
    errors = []

    def calling(call):
        def guarded():
            try:
                call()
            except Exception as exc:  # reported below
                errors.append(repr(exc))

        return threading.Thread(target=guarded)

    threads = [calling(lambda: run(pipe, num_inference_steps=1)), *[calling(lambda: pipe.vae.decode(latents))
                                                                     for _ in range(3)]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    spans.sort()
    assert len(spans) >= 5 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@slow
def test_loads_and_lora_merges_give_their_memory_back(built, tiny_target, tmp_path):
    """torch keeps every tensor a compiled model binds: the runtime binds borrowed views, so a
    deleted pipeline's weights (their mapped files) go, 20 loads grow RSS by less than one
    pipeline's weights, and unload_lora_weights() frees the merge buffers."""
    import weakref

    weights = built.folder / "unet.safetensors"
    pipe = aotbuild.load_pipeline(built.folder)
    run(pipe, num_inference_steps=1)
    assert file_mappings(weights)
    del pipe
    gc.collect()
    assert not file_mappings(weights)

    artifact_bytes = sum(f["bytes"] for name, f in built.manifest["files"].items() if name.endswith(".safetensors"))
    for cycle in range(20):
        pipe = aotbuild.load_pipeline(built.folder)
        run(pipe, num_inference_steps=1)
        del pipe
        gc.collect()
        if cycle == 1:
            start = _rss_mib()
    growth = _rss_mib() - start
    print(f"RSS after 18 more load/del cycles: +{growth:.1f} MiB (one load's weights: {artifact_bytes / 2**20:.1f})")
    assert growth < artifact_bytes / 2**20

    pipe = aotbuild.load_pipeline(built.folder)
    base = run(pipe)
    pipe.load_lora_weights(make_lora(eager_pipeline(tiny_target), tmp_path / "lora", seed=1), adapter_name="A")
    assert np.abs(run(pipe) - base).max() > 1e-3
    buffers = [weakref.ref(buffer) for buffer in pipe.unet._lora._buffers.values()]
    assert buffers
    pipe.unload_lora_weights()
    gc.collect()
    assert not [ref for ref in buffers if ref() is not None] and not pipe.unet._lora._buffers
    np.testing.assert_array_equal(run(pipe), base)


# -- Small ----------------------------------------------------------------------------------------

@slow
def test_a_default_size_the_artifact_does_not_cover_is_said_once_per_load(tmp_path_factory):
    target = load_target(TARGETS / "cpu-tiny-flux.toml")
    folder = build_once(tmp_path_factory, target).folder
    with pytest.warns(UserWarning, match=r"does not cover FluxPipeline's own default size, 256x256 px; a call that "
                                         r"gives no height and width makes 64x64 px") as caught:
        pipe = aotbuild.load_pipeline(folder)
    assert len([w for w in caught if "default size" in str(w.message)]) == 1
    assert run(pipe, height=None, width=None).shape[1:3] == (64, 64)


def test_star_import_gives_every_name_it_lists():
    result = subprocess.run([sys.executable, "-c", "from aotbuild import *; import aotbuild; "
                             "print(all(n in globals() for n in aotbuild.__all__))"], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr


def test_gpu_check_fails_when_a_cuda_test_fails():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "|| true" not in script and 'exit "$tests_rc"' in script

