"""`aotbuild bench --component NAME`: one component of a target called directly, every runtime in
this one process, round-robin and paired per round, so drift and load fall on all of them alike:

- `aot`: the artifact's compiled component through its stand-in, called as the pipeline calls it;
- `aot-model`: the compiled model the stand-in picked, alone, on inputs prepared once (the
  stand-in's own cost per call, dispatch, flattening, checks, lock, is timed after the rounds by
  calling it with the model's run taken out);
- `eager`: the target's recipe uncompiled (its dtype and passes); `compile`: torch.compile of it,
  on request (its first call compiles);
- the peers (`peers.PEERS`), each converted from the component's float32 model;
- `aot:<target>`, on request (`against`): the stand-in of another build of the same component
  (another recipe: `optimize.prepack`, channels_last), paired with aot's round by round.

Every runtime gets the call the pipeline makes at the target's first bucket, recorded from the
float32 pipeline, and its output is compared with that eager float32 output (the build's
reference). `busy` spinning processes beside the timed rounds stand for replicas sharing the cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import AotbuildError
from ..runtime.openmp import spin_setting
from ..runtime.weights import dtype_name
from ..spec.private_apis import attention_flop_formulas, fake_tensor_mode, onednn_runs, pytree
from .peers import PEERS, call_tensors, reference_call, tensor_program
from .stats import quartiles

COMPONENT_CASES = ("aot", "aot-model", "eager", "compile", *PEERS)
DEFAULT_COMPONENT_CASES = tuple(case for case in COMPONENT_CASES if case != "compile")
COMPONENT_FIGURES = {
    "call_s": "one call, the median over the timed rounds",
    "ratio_to_aot": "call_s / aot's call_s, the median of the per-round ratios",
    "ratio_quartiles": "the first and third quartiles of those per-round ratios: the middle half of the rounds "
                       "lies between them, so a gap narrower than this spread is noise",
    "first_call_s": "the first call after preparing (compile: it compiles)",
    "prepare_s": "from files on disk (or the eager module) to ready: load and bind, or the runtime's own compile",
    "convert_s": "peers: torch.export of the float32 model and the runtime's conversion, saved",
    "disk_mib": "bytes of what the runtime loads: the artifact's package and weights, or the peer's saved model",
    "rss_added_mib": "resident memory the runtime added, prepared and called once (eager: none where it is the "
                     "float32 reference itself; made from it in place, what its dtype and passes added or freed)",
    "max_abs_error": "largest absolute difference from eager float32 on the recorded call",
    "max_rel_error": "max_abs_error / the largest absolute value of eager float32's output",
    "rel_l2_error": "the difference's L2 norm / eager float32's output's (every output)",
    "gflop_s": "the call's floating-point work (counted once, on fake tensors) / call_s, GFLOP/s",
    "of_peak": "gflop_s / the machine's peak for the target's dtype (meta.peak_gflop_s: the larger of a large "
               "GEMM's and a 3x3 convolution's, timed here)",
    "stand_in_us": "aot stand-ins: a call with its compiled model's run taken out (dispatch, flattening, checks, "
                   "prepared weights' versions, lock), microseconds, the median of 200 after the rounds",
}


def component_bench_name(component: str) -> str:
    return f"bench-{component}.json"


@dataclasses.dataclass
class _Runtime:
    call: Callable[[], Any]
    figures: dict[str, Any]
    stand_in: Any = None  # aot's: aot-model calls the model it picks
    measure_own_s: Callable[[], float] | None = None  # aot's: measures its own time per call, in seconds


class _StandInClock:
    """The stand-in's own time per call (dispatch, flattening, checks, a prepacked artifact's
    version check, the lock): its call with the compiled model's run taken out, the outputs of a
    real run handed back instead. A real call cannot time it: right after a model's run the first
    Python to execute finds its code and objects evicted (measured on cpu-sdxl-mid-bf16: 0.2-0.5 ms
    for a loop that takes 12 us 0.3 ms later), and the difference of two runtimes' medians is noise
    (milliseconds on a 20 ms call)."""

    CALLS = 200

    def __init__(self, stand_in: Any, call: Callable[[], Any]) -> None:
        self._call, self._outputs, self._replay = call, {}, False
        for variant in stand_in.variants:
            variant._run = self._run_or_replay(variant.name, variant._run)  # what `_run_direct` ends in

    def _run_or_replay(self, name: str, run: Callable[[list], list]) -> Callable[[list], list]:
        def run_or_replay(tensors: list) -> list:
            if self._replay:
                return list(self._outputs[name])
            outputs = self._outputs[name] = run(tensors)
            return outputs
        return run_or_replay

    def seconds(self) -> float:
        """Median seconds of the stand-in's call without the model's run."""
        self._call()
        self._replay, times = True, []
        try:
            for _ in range(self.CALLS):
                start = time.perf_counter()
                self._call()
                times.append(time.perf_counter() - start)
        finally:
            self._replay = False
        return statistics.median(times)


def run_component_bench(target_path: str, artifacts_dir: Path, component: str, *,
                        cases: tuple[str, ...] = DEFAULT_COMPONENT_CASES, rounds: int = 20, busy: int = 0,
                        against: tuple[str, ...] = (),
                        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Prepare each case, check its output, time `rounds` rounds; write and return the document
    (`bench-<component>.json` in the artifact). A peer that is not installed, or whose converter
    refuses the model, is skipped, saying why.
    `against`: other targets built from the same pipeline (another recipe of the component), each
    a case `aot:<target>` of its own artifact's stand-in, paired with the rest.

    Raises:
        AotbuildError: an unknown case or component, a GPU target, no artifact, aot-model
            without aot, or a target to compare against that is another pipeline or lacks the
            component.
    """
    from ..builder.capturing import free_memory
    from ..builder.targets import load_target
    from ..builder.validate import output_errors
    from ..runtime.artifacts import built_artifact
    from ..runtime.memory import rss_mib
    from ..spec.manifest import environment, read_manifest
    from ..spec.pipelines import pipeline_spec
    from .report import write_document

    say = progress or (lambda message: None)
    target = load_target(target_path)
    if unknown := [c for c in cases if c not in COMPONENT_CASES]:
        raise AotbuildError(f"unknown case {unknown[0]!r} for --component; known: {', '.join(COMPONENT_CASES)}")
    if "aot-model" in cases and "aot" not in cases:
        raise AotbuildError("case aot-model needs case aot: it calls the model aot's stand-in picks")
    if against and "aot" not in cases:
        raise AotbuildError("--against compares other builds with case aot: add it to --cases")
    if component not in target.components:
        raise AotbuildError(f"{target.name} compiles {', '.join(target.components)}; not {component!r}")
    if target.device != "cpu":  # the peers, the peak and the timing here are the CPU's
        raise AotbuildError(f"--component times CPU runtimes; {target.name} is a {target.device} target",
                            hint=f"aotbuild bench --target {target.name} times eager, torch.compile and aot on "
                                 f"its device")
    compared = list(map(load_target, against))
    for other in compared:
        if other.pipeline != target.pipeline or component not in other.components or other.name == target.name:
            raise AotbuildError(f"--against {other.name}: compared with {target.name}'s {component}, it must be "
                                f"another target of {target.pipeline} that compiles {component}")
    folder = built_artifact(target.name, artifacts_dir)
    others = {f"aot:{other.name}": built_artifact(other.name, artifacts_dir) for other in compared}
    spec = pipeline_spec(target.pipeline).component(component)
    cases = tuple(c for c in COMPONENT_CASES if c in cases)
    skipped = {case: reason for case in cases if case in PEERS and (reason := PEERS[case].missing())}
    if "aot-model" in cases and read_manifest(folder)["components"][component].get("mode") == "regional":
        skipped["aot-model"] = "a regional artifact's model is its blocks, run by the code between them"

    say(f"eager float32: the call {component} gets at {target.shapes[0]}, and its output")
    pipe, reference, call = reference_call(target, spec)
    flop = call_flop(reference, call)
    runtimes: dict[str, _Runtime] = {}
    converted: dict[Callable, tuple[Path, float]] = {}
    with tempfile.TemporaryDirectory(prefix="aotbuild-peers-") as work, torch.no_grad():
        order = []  # (name, case, artifact): the other builds' stand-ins right after aot's
        for case in (c for c in cases if c not in skipped):
            order += [(case, case, folder)] + ([(n, "aot", f) for n, f in others.items()] if case == "aot" else [])
        # At real size the runtimes do not fit beside the float32 reference (SDXL's UNet: 10.3 GB, and
        # each peer's conversion as much again): the peers convert from it first, the recipe is made
        # from it in place, and it is freed before anything is loaded.
        # openvino and openvino-f32 share one converter: converted once, or refused once for both.
        for case in (case for _, case, _ in order
                     if case in PEERS and case not in skipped and PEERS[case].convert not in converted):
            say(f"converting for {case}")
            start = time.perf_counter()
            saved = Path(work) / case
            saved.mkdir()
            program = tensor_program(reference, call.args, call.kwargs)  # torch.export's failure is aotbuild's
            try:
                PEERS[case].convert(program, saved)
                converted[PEERS[case].convert] = (saved, time.perf_counter() - start)
            except Exception as error:  # the peer's own converter refuses the model: timed without it
                reason = f"{PEERS[case].name} could not convert {component}: {_last_line(error)}"
                say(reason)
                skipped |= {c: reason for c in cases if c in PEERS and PEERS[c].convert is PEERS[case].convert}
            del program
            free_memory(torch.device("cpu"))
        order = [entry for entry in order if entry[1] not in skipped]
        if not order:
            raise AotbuildError("nothing left to time: " + "; ".join(f"{c}: {r}" for c, r in skipped.items()),
                                hint="add case aot (or eager) to --cases")
        before, start = rss_mib(), time.perf_counter()
        recipe = _recipe(target, spec, pipe, reference, call) if {"eager", "compile"} & set(cases) else None
        recipe_rss, recipe_s = rss_mib() - before, time.perf_counter() - start
        del pipe, reference
        free_memory(torch.device("cpu"))
        for name, case, artifact in order:
            say(f"preparing {name}")
            before = rss_mib()
            runtimes[name] = _prepare(case, target, spec, artifact, call, recipe, runtimes, converted)
            start = time.perf_counter()
            output = runtimes[name].call()
            runtimes[name].figures["first_call_s"] = time.perf_counter() - start
            runtimes[name].figures |= output_errors(output, call.output)
            runtimes[name].figures["rss_added_mib"] = rss_mib() - before + (recipe_rss if case == "eager" else 0)
            if case in ("eager", "compile"):  # both are made from the recipe
                runtimes[name].figures["prepare_s"] += recipe_s
        say(f"{rounds} rounds of {', '.join(runtimes)}" + (f", {busy} busy processes beside" if busy else ""))
        with _spinning(busy):
            times = _rounds(runtimes, rounds)
            own_us = {name: r.measure_own_s() * 1e6 for name, r in runtimes.items() if r.measure_own_s}
    say(f"the machine's peak in {target.dtype}")
    peak = machine_peak(getattr(torch, target.dtype))
    base = "aot" if "aot" in times else next(iter(times))
    for case, seconds in times.items():
        ratios = [s / a for s, a in zip(seconds, times[base], strict=True)]
        gflop_s = flop / statistics.median(seconds) / 1e9
        runtimes[case].figures |= {"call_s": statistics.median(seconds), "values": seconds,
                                   "ratio_to_aot": statistics.median(ratios), "ratio_quartiles": quartiles(ratios),
                                   "gflop_s": gflop_s, "of_peak": gflop_s / max(peak.values())}
        if case in own_us:
            runtimes[case].figures["stand_in_us"] = own_us[case]
    meta = {"target": target.name, "component": component, "shape": str(target.shapes[0]), "rounds": rounds,
            "busy": busy, "against": list(others), "cpus": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(),
            "openmp_wait": spin_setting(), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "gflop": flop / 1e9, "peak_gflop_s": peak, "ratio_base": base,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if "aot" in runtimes and "stand_in_us" in runtimes["aot"].figures:
        meta["stand_in_us"] = runtimes["aot"].figures["stand_in_us"]
    document = {"meta": meta, "environment": environment(target.device), "figures": COMPONENT_FIGURES,
                "runtimes": {case: r.figures for case, r in runtimes.items()}, "skipped": skipped}
    write_document(folder / component_bench_name(component), document)
    return document


def _last_line(error: BaseException) -> str:
    """What a peer's error says last (OpenVINO's ends with the operators it has no rule for)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1].removeprefix("-- ") if lines else type(error).__name__


def call_flop(module: torch.nn.Module, call: Any) -> float:
    """The floating-point operations of `module(*call.args, **call.kwargs)`, counted by torch's
    FlopCounterMode (matmuls, convolutions, attention) on fake tensors: no compute, no memory."""
    from torch.utils.flop_counter import FlopCounterMode

    with fake_tensor_mode() as fake, torch.no_grad():
        args, kwargs = pytree.tree_map_only(torch.Tensor, fake.from_tensor, (call.args, call.kwargs))
        with FlopCounterMode(display=False, custom_mapping=attention_flop_formulas()) as counter:
            module(*args, **kwargs)
    return float(counter.get_total_flops())


def machine_peak(dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of this process's threads on the two kernels a denoiser's work is mostly made of: a
    4096^3 GEMM and a 3x3 convolution of 640 channels at 64x64 (channels_last), each its best of
    `repeats` after a warm-up (oneDNN's kernels, the ceiling a compiled model can reach). Where
    oneDNN has no kernel in `dtype` (bf16 on an AVX2 CPU: under 1 GFLOP/s, 3 minutes a GEMM) a
    1024^3 GEMM and the convolution at 16x16, once each."""
    size, side = 4096, 64
    if not onednn_runs(dtype_name(dtype)):
        size, side, repeats = 1024, 16, 1
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    image = torch.randn(1, 640, side, side, dtype=dtype).to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(640, 640, 3, padding=1, bias=False).to(dtype).to(memory_format=torch.channels_last)
    kernels = {"linear": (lambda: a @ b, 2 * size**3), "conv3x3": (lambda: conv(image), 2 * 640 * 640 * 9 * side**2)}
    peak = {}
    with torch.no_grad():
        for name, (run, flop) in kernels.items():
            run()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
            peak[name] = flop / best / 1e9
    return peak


def _prepare(case: str, target: Any, spec: Any, folder: Path, call: Any, recipe: tuple | None,
             ready: dict[str, _Runtime], converted: dict[Callable, tuple[Path, float]]) -> _Runtime:
    """The case ready to call (`recipe`: eager's module and the call as it takes it; `ready`: the
    cases prepared before it; `converted`: the peers' saved conversions, by converter, with the
    seconds each took)."""
    start = time.perf_counter()
    if case == "aot":
        stand_in, entry = _stand_in(folder, spec.name)
        args, kwargs = _in_dtype(call, getattr(torch, target.dtype))
        disk = sum((folder / entry[f]).stat().st_size for f in ("package", "weights"))
        figures = {"prepare_s": time.perf_counter() - start, "disk_mib": disk / 2**20}

        def call_stand_in() -> Any:
            return stand_in(*args, **kwargs)

        if entry.get("mode") == "regional":  # its model is its blocks, run by the code between them
            return _Runtime(call_stand_in, figures, stand_in)
        return _Runtime(call_stand_in, figures, stand_in, _StandInClock(stand_in, call_stand_in).seconds)
    if case == "aot-model":
        stand_in = ready["aot"].stand_in
        args, kwargs = _in_dtype(call, getattr(torch, target.dtype))
        variant = next(v for v in stand_in.variants if v.name == stand_in.last_variant)
        return _Runtime(variant.bare_call(variant.flatten(args, kwargs)), {"variant": variant.name})
    if case in ("eager", "compile"):
        module, args, kwargs = recipe
        if case == "compile":
            from ..generation.backends import compile_options

            module = torch.compile(module, options=compile_options(target))
        return _Runtime(lambda: module(*args, **kwargs), {"prepare_s": time.perf_counter() - start})
    saved, convert_s = converted[PEERS[case].convert]  # OpenVINO at two precisions: one conversion, loaded twice
    runner, chose = PEERS[case].load(saved)
    tensors = call_tensors(call.args, call.kwargs)
    return _Runtime(lambda: runner(tensors), {
        "convert_s": convert_s, "prepare_s": time.perf_counter() - start, "about": PEERS[case].about,
        "disk_mib": sum(p.stat().st_size for p in saved.iterdir()) / 2**20, **chose})


def _stand_in(folder: Path, component: str) -> tuple[Any, dict[str, Any]]:
    """The artifact's stand-in for `component` (for a VAE part, the part), loaded as the runtime
    loads it, and its manifest entry."""
    from ..runtime import CompiledComponent
    from ..runtime.load import load_components

    manifest, modules = load_components(folder)
    stand_in = next(m for module in modules.values() for m in module.modules()
                    if isinstance(m, CompiledComponent) and m.component_name == component)
    return stand_in, manifest["components"][component]


def _recipe(target: Any, spec: Any, pipe: Any, reference: torch.nn.Module,
            call: Any) -> tuple[torch.nn.Module, tuple, dict]:
    """The target's recipe, uncompiled, made from the float32 pipeline in place (its dtype and
    passes, as the build applies them), and the call as it takes it: float32 without passes is the
    reference module itself."""
    if target.dtype == "float32" and not target.optimize:
        return reference, call.args, call.kwargs
    from ..builder import optimize
    from ..builder.capturing import optimize_pipeline
    from ..builder.flow import check_device

    check_device(target)
    optimize_pipeline(pipe, [spec], target)
    module = spec.export_module(getattr(pipe, spec.attribute)).eval()
    args, kwargs = optimize.adapt_example_inputs(target.optimize, _in_dtype(call, getattr(torch, target.dtype)))
    return module, args, kwargs


def _in_dtype(call: Any, dtype: torch.dtype) -> tuple[tuple, dict]:
    """The call with its floating-point tensors in `dtype` (what a pipeline of that dtype passes)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
                                (call.args, call.kwargs))


# A pause before each timed call: each runtime's worker threads spin-wait for a while after a call
# (ONNX Runtime's, OpenMP's), and would take the cores from the runtime timed next.
SETTLE_S = 0.05


def _rounds(runtimes: dict[str, _Runtime], rounds: int) -> dict[str, list[float]]:
    """Seconds of each runtime's call per round, after one untimed call each; the order rotates
    every round, so no runtime always follows the same one."""
    names = list(runtimes)
    for name in names:
        runtimes[name].call()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            runtimes[name].call()
            times[name].append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def _spinning(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU for the duration of the block."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


