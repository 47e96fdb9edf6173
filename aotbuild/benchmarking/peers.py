"""The runtimes users pick instead of aotbuild, run on the same graph: OpenVINO (at its default
inference precision, which it picks from the CPU, and forced to f32) and ONNX Runtime (CPU execution
provider). Each converts a `torch.export` program of the component's float32 model, with its
tensors as the only inputs and outputs, saves what it made (the files a user would deploy), loads it
back and runs it on torch tensors. The peers are an optional extra (`aotbuild[peers]`): a missing
one is skipped with the reason (`missing`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# torch is imported where it is used: `aotbuild bench` lists these peers' names before the command
# sets OpenMP's spin (runtime/openmp.py), which torch reads when it loads.
Runner = Callable[[list[Any]], list[Any]]  # torch tensors in, torch tensors out
_GIVEN = object()  # a tensor leaf's place: the call gives it


@functools.cache
def _tensor_call_class() -> type:
    import torch

    from ..spec.private_apis import pytree

    class TensorCall(torch.nn.Module):
        """`module(*args, **kwargs)` as a function of the call's tensors alone (its other leaves,
        such as `return_dict=False`, fixed as recorded), returning the output's tensors: the form a
        converter takes, each input a tensor."""

        def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            super().__init__()
            self.module = module
            leaves, self._spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
            self._fixed = [_GIVEN if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

        def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            given = iter(tensors)
            leaves = [next(given) if fixed is _GIVEN else fixed for fixed in self._fixed]
            args, kwargs = pytree.tree_unflatten(leaves, self._spec)
            output = self.module(*args, **kwargs)
            return tuple(leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor))

    return TensorCall


def call_tensors(args: tuple, kwargs: dict) -> list[Any]:
    """The call's tensors, in the order `tensor_program`'s module takes them."""
    import torch

    from ..spec.private_apis import pytree

    return [leaf for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(leaf, torch.Tensor)]


def tensor_program(module: Any, args: tuple, kwargs: dict) -> Any:
    """torch.export (static, non-strict, as aotbuild's build exports) of the module as a function
    of the call's tensors alone, at this call: an `ExportedProgram`."""
    import torch

    with torch.no_grad():
        return torch.export.export(_tensor_call_class()(module, args, kwargs).eval(),
                                   tuple(call_tensors(args, kwargs)), strict=False)


@dataclass(frozen=True)
class Peer:
    """One runtime: its package (`module`), how it converts an exported program into files in a
    folder, and how it loads them into a runner of torch tensors."""

    name: str
    module: str  # the Python package it needs
    convert: Callable[[Any, Path], None]  # an ExportedProgram saved into a folder
    load: Callable[[Path], tuple[Runner, dict[str, Any]]]  # (runner, what it chose: precision, threads)
    about: str

    def missing(self) -> str | None:
        """Why this peer cannot run here, or None."""
        if importlib.util.find_spec(self.module) is None:
            return f"{self.module} is not installed (pip install 'aotbuild[peers]')"
        return None


def _openvino_convert(program: Any, folder: Path) -> None:
    import openvino as ov

    # Weights as they are: OpenVINO's save compresses them to float16 unless told not to.
    ov.save_model(ov.convert_model(program), folder / "model.xml", compress_to_fp16=False)


def _openvino_loader(precision: str | None) -> Callable[[Path], tuple[Runner, dict[str, Any]]]:
    def load(folder: Path) -> tuple[Runner, dict[str, Any]]:
        import openvino as ov
        import torch

        config = {"INFERENCE_PRECISION_HINT": precision} if precision else {}
        compiled = ov.Core().compile_model(folder / "model.xml", "CPU", config)
        request = compiled.create_infer_request()

        def run(tensors: list[Any]) -> list[Any]:
            results = request.infer([t.contiguous().numpy() for t in tensors])
            return [torch.from_numpy(results[output].copy()) for output in compiled.outputs]

        chose = {"precision": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),
                 "threads": int(compiled.get_property("INFERENCE_NUM_THREADS"))}
        return run, chose

    return load


def _onnx_convert(program: Any, folder: Path) -> None:
    import torch

    # Weights beside the graph: one ONNX file holds at most 2 GB.
    torch.onnx.export(program, (), dynamo=True, verbose=False).save(folder / "model.onnx", external_data=True)


def _onnx_load(folder: Path) -> tuple[Runner, dict[str, Any]]:
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(folder / "model.onnx", providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(tensors: list[Any]) -> list[Any]:
        outputs = session.run(None, {name: t.contiguous().numpy() for name, t in zip(names, tensors, strict=True)})
        return [torch.from_numpy(output) for output in outputs]

    return run, {"precision": "f32", "threads": session.get_session_options().intra_op_num_threads or "default"}


PEERS = {peer.name: peer for peer in (
    Peer("openvino", "openvino", _openvino_convert, _openvino_loader(None),
         "OpenVINO at the inference precision it picks for this CPU (bf16 where the CPU has AMX or AVX512-BF16)"),
    Peer("openvino-f32", "openvino", _openvino_convert, _openvino_loader("f32"),
         "OpenVINO with INFERENCE_PRECISION_HINT=f32"),
    Peer("onnxruntime", "onnxruntime", _onnx_convert, _onnx_load,
         "ONNX Runtime, CPU execution provider, from torch.onnx.export(dynamo=True)"),
)}


def reference_call(target: Any, spec: Any) -> tuple[Any, Any, Any]:
    """The float32 pipeline, its component's module (unoptimized, as the build's reference) and the
    call the pipeline makes to it at the first bucket, with its output."""
    import torch

    from ..builder import capture
    from ..builder.capturing import call_extras, load_source_pipeline
    from ..spec.pipelines import UNGUIDED, pipeline_spec

    pipeline = pipeline_spec(target.pipeline)
    pipe = load_source_pipeline(dataclasses.replace(target, dtype="float32"), pipeline, torch.device("cpu"))
    bucket = target.shapes[0]
    if spec.recorded:
        extras = call_extras(pipe, pipeline, target, bucket.batch, bucket.height, bucket.width, bucket.images)
        calls = {"reference": capture.capture_inputs(
            pipe, [spec], batch=bucket.batch, height=bucket.height, width=bucket.width,
            guidance_scale=UNGUIDED if target.guidance == "unguided" else target.guidance_scale,
            text=bucket.max_sequence_length, image=bucket.image, frames=bucket.frames, extras=extras)}
        capture.decode_pending(calls, spec, getattr(pipe, spec.attribute))  # a VAE decoder's call, recorded undecoded
        call = calls["reference"][spec.name]
    else:
        call = capture.random_call(pipe, spec, bucket.batch, bucket.height, bucket.width, torch.device("cpu"))
    module = spec.export_module(getattr(pipe, spec.attribute)).eval()
    if spec.per_step:  # as the build: a denoiser (and a ControlNet) takes float timesteps
        call = capture.float_timestep(call, module)
    return pipe, module, call
