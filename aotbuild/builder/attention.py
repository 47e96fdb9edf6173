"""aotbuild's attention kernel at build (`optimize.sdpa = "aotbuild"`): `aotbuild::attention`,
flash attention for x86 CPUs with AVX512-BF16 (`attention_cpu.cpp`), in bf16 and float32. ATen's
CPU flash attention, which compiled code otherwise calls, runs at a third of the GEMM's speed at
1,000-4,000 tokens (125-145 GFLOP/s in bf16 on an AVX512-BF16 EPYC, against ~400 for a large
GEMM); this one runs the same shapes 1.5-2.3x faster in bf16, with the same error.

The build compiles the source once per torch build into this user's cache (`compiled_library`),
calls it from the exported graph in place of each attention it computes exactly
(`replace_attention`), and puts the library in the artifact (`runtime.attention.LIBRARY_FILE`),
which a load registers from there (`runtime/attention.py`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import BuildError

SOURCE = Path(__file__).with_name("attention_cpu.cpp")
MACHINE_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")  # runtime.attention.CPU_FLAGS
MAX_HEAD_SIZE = 512  # a VAE's one head of 512 channels


def _compile_command(output: Path) -> list[str]:
    from torch.utils import cpp_extension

    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise BuildError("optimize.sdpa = \"aotbuild\" compiles its attention kernel with a C++ compiler, and none "
                         "was found", hint="install g++ (AOTInductor needs it too), or set CXX")
    abi = int(torch.compiled_with_cxx11_abi())
    return [compiler, "-O3", "-shared", "-fPIC", "-std=c++17", "-fopenmp", *MACHINE_FLAGS,
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths()),
            os.fspath(SOURCE), "-o", os.fspath(output),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]


@functools.cache  # asked by the sdpa pass and again when packaging: the compiler's version once
def compiled_library() -> Path:
    """The attention kernel compiled for this torch build: once per source and torch, in this
    user's cache ($AOTBUILD_CACHE/kernels), renamed into place whole.

    Raises:
        BuildError: no compiler, or the compile failed (its output said).
    """
    from ..runtime.cache import cache_root, private_dir

    command = _compile_command(Path("{output}"))  # what makes the library: the source, the compiler and its flags
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(),
                                     (torch.version.git_version or "").encode(), version.encode(),
                                     " ".join(command).encode()]))
    library = private_dir(cache_root() / "kernels") / f"attention_cpu-{key.hexdigest()[:16]}.so"
    if library.is_file():
        return library
    with tempfile.TemporaryDirectory(dir=library.parent) as staging:
        built = Path(staging) / library.name
        result = subprocess.run([os.fspath(built) if arg == "{output}" else arg for arg in command],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"compiling aotbuild's attention kernel failed:\n{result.stderr[-4000:]}")
        os.replace(built, library)
    return library


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """An `aten.scaled_dot_product_attention` node's arguments by name (scale and enable_gqa are
    keyword-only)."""
    return dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), node.args, strict=False)) \
        | node.kwargs


def _takes(node: torch.fx.Node) -> bool:
    """Whether `aotbuild::attention` computes this `aten.scaled_dot_product_attention` exactly:
    query, key and value of one dtype, bf16 or float32, of [batch, heads, tokens, head size], one
    head count, a head size of at most 512 (even in bf16), no mask, no dropout, not causal."""
    args = _arguments(node)
    values = [arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
              for arg in (args.get("query"), args.get("key"), args.get("value"))]
    if not all(isinstance(v, torch.Tensor) and v.dtype == values[0].dtype and v.ndim == 4 for v in values) or \
            values[0].dtype not in (torch.bfloat16, torch.float32):
        return False
    query, key, value = values
    head_size = query.shape[-1]
    return (args.get("attn_mask") is None and not args.get("dropout_p") and not args.get("is_causal")
            and not args.get("enable_gqa") and isinstance(head_size, int)
            and (head_size % 2 == 0 or query.dtype == torch.float32)
            and head_size <= MAX_HEAD_SIZE and key.shape[-1] == head_size and value.shape[-1] == head_size
            and query.shape[0] == key.shape[0] == value.shape[0]  # ATen broadcasts a batch of 1; the kernel not
            and query.shape[1] == key.shape[1] == value.shape[1] and key.shape[2] == value.shape[2])


def replace_attention(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """Call `aotbuild::attention` for each attention of the graph it computes exactly (`_takes`),
    transposed back to ATen's [batch, heads, tokens, head size]; the rest stay ATen's. Returns
    (replaced, attentions)."""
    attentions = [node for node in gm.graph.nodes
                  if node.op == "call_function" and node.target is torch.ops.aten.scaled_dot_product_attention.default]
    replaced = 0
    for node in attentions:
        if not _takes(node):
            continue
        args = _arguments(node)
        query, key, value, scale = args["query"], args["key"], args["value"], args.get("scale")
        if scale is None:  # ATen's default
            scale = query.meta["val"].shape[-1] ** -0.5
        with gm.graph.inserting_before(node):
            out = gm.graph.call_function(torch.ops.aotbuild.attention.default, (query, key, value, float(scale)))
            swapped = gm.graph.call_function(torch.ops.aten.transpose.int, (out, 1, 2))
        node.replace_all_uses_with(swapped)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced, len(attentions)
