"""aotbuild's own attention kernel (`optimize.sdpa = "aotbuild"`): against ATen's on every shape it
takes, the graph rewrite that calls it, the targets that may ask for it, and a build whose
artifact carries it, loaded in a fresh process."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import aotbuild
from aotbuild.builder.attention import compiled_library, replace_attention
from aotbuild.builder.targets import ShapeBucket, load_target
from aotbuild.errors import CorruptArtifactError, TargetError
from aotbuild.generation.backends import prepare as prepare_backend
from aotbuild.runtime.attention import LIBRARY_FILE, load_library, missing_cpu_flags

from .conftest import ROOT, TARGETS, build_once, generate
from .test_targets import write_target

MISSING = missing_cpu_flags()
needs_flags = pytest.mark.skipif(bool(MISSING), reason=f"this CPU lacks {', '.join(MISSING)}: the kernel needs "
                                                        "AVX512-BF16")
BUCKET = ShapeBucket(1, 64, 64)
BF16_ATOL = 0.05  # bfloat16 against the same recipe run eager (test_prepack's): measured 0.016 with this kernel


@pytest.fixture(scope="module")
def kernel():
    load_library(compiled_library())
    return torch.ops.aotbuild.attention.default


def _diffusers_layout(batch: int, tokens: int, heads: int, head_size: int, seed: int) -> torch.Tensor:
    """[batch, heads, tokens, head size] as diffusers passes it: a transposed view."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, heads, head_size, generator=generator).to(torch.bfloat16).transpose(1, 2)


SHAPES = [
    (2, 10, 256, 256, 64),   # SDXL's heads
    (2, 8, 300, 300, 40),    # SD 1.5's, a length no block divides
    (1, 3, 77, 19, 64),      # cross-attention to a short text
    (2, 2, 5, 130, 128),     # Flux's and Wan's heads, fewer queries than a block of rows
    (1, 1, 200, 200, 512),   # a VAE's one head of 512 channels
    (3, 2, 64, 64, 8),       # the tiny models' heads
]


@needs_flags
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,heads,queries,keys,head_size", SHAPES + [(1, 2, 70, 33, 35)])  # odd: float32's
def test_the_kernel_matches_aten_on_every_shape_it_takes(kernel, dtype, batch, heads, queries, keys, head_size):
    if dtype == torch.bfloat16 and head_size % 2:
        pytest.skip("bf16 takes even head sizes (a dot product's pairs)")
    q = _diffusers_layout(batch, queries, heads, head_size, 0).to(dtype)
    k = _diffusers_layout(batch, keys, heads, head_size, 1).to(dtype)
    v = _diffusers_layout(batch, keys, heads, head_size, 2).to(dtype)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    aten = F.scaled_dot_product_attention(q, k, v)
    out = kernel(q, k, v, head_size ** -0.5)
    assert out.shape == (batch, queries, heads, head_size) and out.dtype == dtype

    def error(x: torch.Tensor) -> float:
        return ((x.double() - exact).norm() / exact.norm()).item()

    # bf16: its rounding of the output, ~2.3e-3 both; float32: ~1e-6 (ATen's 4e-7)
    assert error(out.transpose(1, 2)) <= 1.05 * error(aten) + (1e-4 if dtype == torch.bfloat16 else 2e-6)
    contiguous = kernel(q.contiguous(), k.contiguous(), v.contiguous(), head_size ** -0.5)
    assert torch.equal(contiguous, out)  # the layout it is given changes nothing


@needs_flags
def test_a_nan_stays_nan_and_no_keys_attend_to_nothing_as_in_aten(kernel):
    q, k, v = (_diffusers_layout(1, 8, 2, 16, seed) for seed in range(3))
    k[0, 1, 3, 5] = float("nan")  # head 1, key 3: every query of head 1 attends to it
    out = kernel(q, k, v, 0.25).transpose(1, 2)
    aten = F.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert torch.equal(out.isnan(), aten.isnan()) and out[:, 1].isnan().all() and not out[:, 0].isnan().any()
    empty = kernel(q, k[:, :, :0], v[:, :, :0], 0.25)
    assert torch.equal(empty.transpose(1, 2), F.scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0]))


@needs_flags
def test_the_kernel_says_what_it_does_not_take(kernel):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="aotbuild::attention takes bf16 or float32, the same for all three"):
        kernel(q.half(), q.half(), q.half(), 0.25)
    with pytest.raises(RuntimeError, match="aotbuild::attention takes bf16 or float32, the same for all three"):
        kernel(q, q.bfloat16(), q, 0.25)
    odd = torch.randn(1, 2, 8, 15).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"head size 15 \(at most 512, even in bf16"):
        kernel(odd, odd, odd, 0.25)


class _Attentions(torch.nn.Module):
    """Two attentions the kernel computes exactly and five it does not."""

    def forward(self, q, k, v, q32, odd, q16):
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        return (F.scaled_dot_product_attention(q, k, v, scale=0.3),
                F.scaled_dot_product_attention(q32, q32, q32),
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                F.scaled_dot_product_attention(q, k, v, is_causal=True),
                F.scaled_dot_product_attention(odd, odd, odd),
                F.scaled_dot_product_attention(q16, q16, q16),
                F.scaled_dot_product_attention(q, k[:1], v[:1]))  # a batch of 1 broadcast


@needs_flags
def test_only_the_attentions_the_kernel_computes_exactly_call_it(kernel):
    q, k, v = (_diffusers_layout(2, 16, 2, 8, seed) for seed in range(3))
    inputs = (q, k, v, torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 7).to(torch.bfloat16),
              torch.randn(1, 2, 16, 8).half())
    graph = torch.export.export(_Attentions(), inputs).module(check_guards=False)
    expected = graph(*inputs)
    assert replace_attention(graph) == (2, 7)
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.aotbuild.attention.default) == 2
    assert calls.count(torch.ops.aten.scaled_dot_product_attention.default) == 5
    got = graph(*inputs)
    torch.testing.assert_close(got[0], expected[0], atol=1e-2, rtol=0)  # the scale the model passes, kept
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=0)
    for left, right in zip(got[2:], expected[2:], strict=True):
        assert torch.equal(left, right)


def test_only_a_bf16_cpu_target_of_this_machine_asks_for_the_kernel(tmp_path):
    recipe = (TARGETS / "cpu-tiny-sdxl-bf16-prepack.toml").read_text().replace('name = "cpu-tiny-sdxl-bf16-prepack"',
                                                                              'name = "t"')
    recipe += 'sdpa = "aotbuild"\n'
    assert load_target(write_target(tmp_path, recipe)).optimize["sdpa"] == "aotbuild"
    assert load_target(write_target(tmp_path, recipe.replace('dtype = "bfloat16"', 'dtype = "float32"')))
    with pytest.raises(TargetError, match=r'optimize.sdpa = "aotbuild" is aotbuild\'s bf16 and float32 attention .* '
                                          r"and this target is float16"):
        load_target(write_target(tmp_path, recipe.replace('dtype = "bfloat16"', 'dtype = "float16"')))
    with pytest.raises(TargetError, match=r"and this target runs on any x86-64-v3 CPU"):
        portable = recipe.replace('device = "cpu"', 'device = "cpu"\ncpu = { baseline = "x86-64-v3" }')
        load_target(write_target(tmp_path, portable))
    cuda = recipe.split("[optimize]")[0].replace('device = "cpu"', 'device = "cuda"\ngpu = { name = "H100", '
                                                   'capability = "9.0" }') + '[optimize]\nsdpa = "aotbuild"\n'
    with pytest.raises(TargetError, match=r'optimize.sdpa = "aotbuild" is aotbuild\'s attention for CPUs; on cuda'):
        load_target(write_target(tmp_path, cuda))


LOAD_AND_GENERATE = """
import sys, numpy as np, torch, aotbuild
from aotbuild.builder.targets import ShapeBucket
from tests.conftest import generate
before = hasattr(torch.ops.aotbuild, "attention")
pipe = aotbuild.load_pipeline(sys.argv[1])
assert not before and hasattr(torch.ops.aotbuild, "attention")  # the artifact's library, loaded by the load
np.save(sys.argv[2], generate(pipe, ShapeBucket(1, 64, 64)))
"""


@needs_flags
@pytest.mark.slow
def test_a_build_calls_the_kernel_and_its_artifact_carries_it(tmp_path_factory, tmp_path):
    """The CPU recipe with aotbuild's attention: every attention of the tiny UNet calls it, the
    artifact holds its library (hashed like any file), and a fresh process loads it from there and
    generates what the same recipe run eager does."""
    recipe = load_target(TARGETS / "cpu-tiny-sdxl-bf16-prepack.toml")
    target = dataclasses.replace(recipe, name="cpu-tiny-sdxl-attention", optimize={**recipe.optimize,
                                                                                   "sdpa": "aotbuild"})
    built = build_once(tmp_path_factory, target)
    manifest = json.loads((built.folder / "manifest.json").read_text())
    assert LIBRARY_FILE in manifest["files"]
    assert manifest["components"]["unet"]["custom_ops"] == ["aotbuild"]
    recorded = manifest["optimizations"]["passes"]["sdpa"]
    assert (recorded["backend"], recorded["library"]) == ("aotbuild", LIBRARY_FILE)
    assert ("note" in recorded) == ("amx_bf16" in manifest["environment"]["cpu_flags"])  # AMX: compare with ATen's
    said = [message for stage, message in built.progress if "aotbuild's kernel" in message]
    assert said and all(re.fullmatch(r"unet \S+: (\d+) of \1 attentions call aotbuild's kernel", m) for m in said)

    images = tmp_path / "images.npy"
    subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, str(built.folder), str(images)], cwd=ROOT, check=True)
    unfused = {k: v for k, v in target.optimize.items() if k != "fuse_qkv"}  # as test_prepack's eager recipe
    eager = prepare_backend(dataclasses.replace(target, optimize=unfused), "eager", Path())
    np.testing.assert_allclose(np.load(images), generate(eager, BUCKET), atol=BF16_ATOL, rtol=0)

    copy = tmp_path / "copy"
    shutil.copytree(built.folder, copy)
    library = copy / LIBRARY_FILE
    library.chmod(0o644)
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    library.write_bytes(bytes(data))
    with pytest.raises(CorruptArtifactError, match="attention_cpu.so"):
        aotbuild.load_pipeline(copy)
