"""GPU identity, multi-arch fit and the CUDA-graph runtime. The rules are checked everywhere; the
CUDA-only tests build a tiny SDXL for this machine's GPU and compare graph replay with plain runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from aotbuild.cli import main
from aotbuild.errors import AotbuildError, IncompatibleArtifactError, NoMatchingVariantError
from aotbuild.runtime import load_components
from aotbuild.runtime.hub import choose_variant
from aotbuild.spec.manifest import check_compatible, cuda_driver_version, environment, gpu_fits

from .conftest import build_once, generate

CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: this machine has no CUDA device")


def CUDA(test):  # noqa: N802  (a marker: CUDA-only, and it builds)
    return pytest.mark.slow(CUDA_ONLY(test))


A100, L4, H100, RTX = ("8.0", 166912), ("8.9", 101376), ("9.0", 232448), ("12.0", 101376)  # (cc, shared/block)


@pytest.mark.parametrize(("built_on", "runs_on", "multi_arch", "fits"), [
    (H100, H100, False, True),
    (A100, H100, False, False),   # SASS runs on its own capability only
    (A100, H100, True, True),     # PTX for compute_80 is JIT-compiled for later GPUs
    (A100, L4, True, False),      # ... that have as much shared memory per block
    (L4, RTX, True, True),
    (L4, A100, True, False),      # never for an older one
    (H100, ("10.0", 232448), True, False),  # sm_90a PTX is arch-specific
])
def test_which_gpus_an_artifact_fits(built_on, runs_on, multi_arch, fits):
    def env(gpu, **extra):
        return {"gpu_capability": gpu[0], "gpu_shared_memory_per_block": gpu[1], **extra}

    assert gpu_fits(env(built_on, gpu_multi_arch=multi_arch), env(runs_on)) is fits
    assert gpu_fits(env(built_on), {}) is False  # no GPU here


def _cuda_environment(capability: str, **extra) -> dict:
    return {**environment("cpu"), "device_type": "cuda", "cuda": "12.8", "gpu_name": "GPU",
            "gpu_capability": capability, **extra}


def _variant(path: str, capability: str, multi_arch: bool = False) -> dict:
    return {"path": path, "pipeline": "StableDiffusionXLPipeline", "dtype": "bfloat16",
            "environment": _cuda_environment(capability, gpu_multi_arch=multi_arch)}


def test_an_h100_takes_its_own_variant_then_portable_ptx_never_plain_sm80():
    h100 = _cuda_environment("9.0")
    sm90, sm80_ptx, sm80 = _variant("t/sm90", "9.0"), _variant("t/sm80-ptx", "8.0", True), _variant("t/sm80", "8.0")
    assert choose_variant({"variants": [sm80_ptx, sm90]}, device="cuda", here=h100)["path"] == "t/sm90"
    assert choose_variant({"variants": [sm80, sm80_ptx]}, device="cuda", here=h100)["path"] == "t/sm80-ptx"
    with pytest.raises(NoMatchingVariantError, match=r"no variant fits this machine.*the repo has: t/sm80 "):
        choose_variant({"variants": [sm80]}, device="cuda", here=h100)
    manifest = {"environment": sm80["environment"], "target": {"dtype": "bfloat16"}}
    with pytest.raises(IncompatibleArtifactError, match="gpu_capability is '8.0' in the artifact, '9.0' here") as info:
        check_compatible(manifest, here=h100)
    assert "multi_arch = true" in info.value.hint


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA driver")
def test_no_driver_means_no_gpu_fields():
    assert cuda_driver_version() is None
    assert "gpu_name" not in environment("cuda") and "cuda_driver" not in environment("cpu")


@pytest.mark.slow
def test_cuda_graphs_need_a_cuda_device(built):
    with pytest.raises(AotbuildError, match="CUDA graphs need a CUDA device; this artifact runs on cpu"):
        load_components(built.folder, cuda_graphs=True)
    result = CliRunner().invoke(main, ["run", "--target", "cpu-tiny-sdxl", "--prompt", "x", "--backend", "eager",
                                       "--cuda-graphs"])
    assert result.exit_code == 1 and "apply to --backend aot, not eager" in result.output
    result = CliRunner().invoke(main, ["bench", "--target", "cpu-tiny-sdxl", "--cases", "aot,aot-cuda-graphs",
                                       "--artifacts", str(built.artifacts)])
    assert result.exit_code == 1 and "case aot-cuda-graphs needs a CUDA target" in result.output


@pytest.fixture(scope="module")
def cuda_built(tmp_path_factory, tiny_target):
    """The tiny SDXL for this GPU in bfloat16 with fused QKV and TF32, graphs on (built and graph-checked once)."""
    from aotbuild.builder.targets import GpuSpec

    capability = "{}.{}".format(*torch.cuda.get_device_capability())
    target = dataclasses.replace(tiny_target, name="cuda-tiny-sdxl", device="cuda", dtype="bfloat16",
                                 gpu=GpuSpec(torch.cuda.get_device_name(), capability), dynamic=None,
                                 optimize={"fuse_qkv": True, "tf32": True}, cuda_graphs=True)
    return build_once(tmp_path_factory, target), target


@CUDA
def test_cuda_build_records_gpu_identity_memory_and_graph_check(cuda_built):
    built, _ = cuda_built
    m = built.manifest
    env = m["environment"]
    assert env["gpu_capability"] == "{}.{}".format(*torch.cuda.get_device_capability())
    assert env["cuda_driver"] and env["triton"] and env["gpu_multi_arch"] is False
    assert env["host_march"] == ""  # host code for the compiler's portable baseline, not -march=native
    assert m["runtime"]["cuda_graphs"] is True
    assert set(m["peak_gpu_mib"]) >= {"load", "capture", "compile", "validate"}
    for component in m["components"].values():
        for variant in component["variants"]:  # graph replay against plain runs, on the captured and new inputs
            assert variant["numerics"]["cuda_graph_rel_diff"] <= variant["numerics"]["tolerance"]


@CUDA
def test_graph_replay_equals_plain_runs_on_new_inputs(cuda_built):
    built, _ = cuda_built
    _, graphed = load_components(built.folder, cuda_graphs=True)
    _, plain = load_components(built.folder, cuda_graphs=False)
    graph_model, plain_model = (next(v for v in c["unet"].variants if v.name == "b1_64x64") for c in (graphed, plain))
    assert graph_model.graph_pool is not None and plain_model.graph_pool is None
    generator = torch.Generator("cuda").manual_seed(0)
    outputs = []
    for _ in range(3):  # capture, then replays on fresh inputs: the static buffers really are refilled
        leaves = [(i["path"], torch.randn(i["shape"], device="cuda", generator=generator).to(getattr(torch, i["dtype"]))
                   if "shape" in i else None) for i in graph_model.inputs]
        got, want = graph_model.run(leaves), plain_model.run(leaves)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        outputs.append(got[0] if isinstance(got, (tuple, list)) else got)
    assert not torch.equal(outputs[0], outputs[1])


@CUDA
def test_tf32_is_on_only_inside_the_artifacts_calls(cuda_built, monkeypatch):
    """Neither the build nor a load leaves TF32 set for the process (other models in it keep their
    precision); each call of the artifact turns it on for itself and back."""
    from aotbuild.runtime import load_pipeline
    from aotbuild.runtime.variant import CompiledVariant

    built, target = cuda_built
    defaults = (False, True)  # torch's own: matmul off, cuDNN on
    assert built.manifest["optimizations"]["passes"]["tf32"] == {"enabled": True}
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == defaults
    pipe = load_pipeline(built.folder)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == defaults
    inside = []
    original = CompiledVariant._run_unlocked

    def spy(self, leaves):
        inside.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        return original(self, leaves)

    monkeypatch.setattr(CompiledVariant, "_run_unlocked", spy)
    generate(pipe, target.shapes[0])
    assert inside and set(inside) == {(True, True)}
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == defaults


@CUDA
def test_concurrent_unet_and_vae_calls_share_the_graph_pool_safely(cuda_built):
    """With graphs on, every component of a load captures into one pool: calls from several threads
    (the UNet of one request, the VAE of another) take turns and give what they give alone."""
    import threading

    from aotbuild.runtime import load_pipeline

    built, target = cuda_built
    pipe = load_pipeline(built.folder)
    assert pipe.unet._lock is pipe.vae.decoder._lock
    generator = torch.Generator("cuda").manual_seed(0)
    latents = torch.randn(1, 4, 32, 32, device="cuda", dtype=torch.bfloat16, generator=generator)  # 64 px
    alone_image = generate(pipe, target.shapes[0])
    alone_decode = pipe.vae.decode(latents).sample
    results, errors = [], []

    def work(kind: str) -> None:
        try:
            for _ in range(5):
                if kind == "image":
                    results.append(("image", generate(pipe, target.shapes[0])))
                else:
                    results.append(("decode", pipe.vae.decode(latents).sample))
        except Exception as exc:  # reported below, with the thread's kind
            errors.append(f"{kind}: {exc!r}")

    threads = [threading.Thread(target=work, args=(kind,)) for kind in ("image", "decode", "decode")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for kind, value in results:
        if kind == "image":
            np.testing.assert_array_equal(value, alone_image)
        else:
            torch.testing.assert_close(value, alone_decode, rtol=0, atol=0)


@CUDA
def test_pipeline_images_match_with_and_without_graphs(cuda_built):
    from aotbuild.runtime import load_pipeline

    built, target = cuda_built
    bucket = target.shapes[0]
    with_graphs = generate(load_pipeline(built.folder), bucket, steps=3)
    without = generate(load_pipeline(built.folder, cuda_graphs=False), bucket, steps=3)
    assert abs(with_graphs - without).max() <= 1 / 255


@CUDA
def test_cuda_variants_load_in_place_from_the_package_cache(cuda_built, tmp_path):
    """No archive is extracted into $TMPDIR (AOTInductor's package loader would, per process)."""
    import os
    import subprocess
    import sys

    built, _ = cuda_built
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = "import sys; from aotbuild.runtime import load_components; load_components(sys.argv[1])"
    result = subprocess.run([sys.executable, "-c", script, str(built.folder)], capture_output=True, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert list(tmp.iterdir()) == []


@CUDA
def test_lora_switches_with_cuda_graphs_match_plain_runs(cuda_built, tmp_path):
    """bfloat16, fused QKV, CUDA graphs: a LoRA binds new pointers (graphs captured again), later
    switches write in place (graphs replayed as they are); both agree with plain runs."""
    from aotbuild.runtime import load_pipeline

    from .conftest import eager_pipeline, make_lora

    built, target = cuda_built
    bucket = target.shapes[0]
    files = [make_lora(eager_pipeline(target), tmp_path / name, seed=seed) for name, seed in (("A", 1), ("B", 2))]
    images = {}
    for graphs in (True, False):
        pipe = load_pipeline(built.folder, cuda_graphs=graphs)
        base = generate(pipe, bucket)
        pipe.load_lora_weights(files[0], adapter_name="A")
        pipe.load_lora_weights(files[1], adapter_name="B")
        pipe.set_adapters("A")
        with_a = generate(pipe, bucket)
        pipe.set_adapters("B")
        images[graphs] = (with_a, generate(pipe, bucket))
        pipe.set_adapters("A")
        assert np.array_equal(generate(pipe, bucket), with_a)
        pipe.unload_lora_weights()
        assert np.array_equal(generate(pipe, bucket), base)
    for graphed, plain in zip(images[True], images[False], strict=True):
        assert abs(graphed - plain).max() <= 1 / 255
