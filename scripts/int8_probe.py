"""Post-training static int8 on SD 1.5's UNet at its real size (512x512 px, a guided call, batch 2),
measured, not assumed: torchao's X86InductorQuantizer (convolutions and linears, int8 activations
calibrated on 6 calls), compiled by inductor with freezing, against the same UNet in bf16
(channels_last, compiled the same way); each output's error against eager float32 on 3 held-out
calls, each time the median of 3 calls. Seeded random weights (`cpu-sd15-bf16`'s source). A probe,
not a recipe: `python scripts/int8_probe.py [int8] [bf16]`, ~10 min on 2 cores, ~10 GiB."""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

import aotbuild  # noqa: F401  (before torch: its OpenMP spin, as aotbuild's commands)
from aotbuild.builder.capturing import load_source_pipeline
from aotbuild.builder.targets import load_target
from aotbuild.spec.pipelines import pipeline_spec
from aotbuild.spec.private_apis import inductor_config


class Call(torch.nn.Module):
    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        return self.unet(sample, timestep, states, return_dict=False)[0]


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want| / max |want|, relative L2)"""
    got = got.float()
    return float((got - want).abs().max() / want.abs().max()), float((got - want).norm() / want.norm())


def seconds(model: torch.nn.Module, args: tuple) -> float:
    model(*args)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        model(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(cases: list[str]) -> None:
    inductor_config().freezing = True
    target = load_target(Path(__file__).resolve().parents[1] / "targets" / "cpu-sd15-bf16.toml")
    pipe = load_source_pipeline(target, pipeline_spec(target.pipeline), torch.device("cpu"))
    with torch.no_grad():
        positive, negative = pipe.encode_prompt("a photo of a red fox in the snow", "cpu", 1, True, "blurry")
    states, generator = torch.cat([negative, positive]), torch.Generator().manual_seed(0)

    def call(t: int) -> tuple:
        latents = torch.randn(1, 4, 64, 64, generator=generator)
        return torch.cat([latents, latents]), torch.tensor(t), states

    calibration = [call(t) for t in (999, 800, 600, 400, 200, 50)]
    held_out = [call(t) for t in (900, 500, 100)]
    model = Call(pipe.unet.eval())
    del pipe
    with torch.no_grad():
        references = [model(*c) for c in held_out]
        if "int8" in cases:
            import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86  # registers inductor's passes
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

            start = time.perf_counter()
            quantizer = x86.X86InductorQuantizer().set_global(x86.get_default_x86_inductor_quantization_config())
            prepared = prepare_pt2e(torch.export.export(model, calibration[0]).module(), quantizer)
            for c in calibration:
                prepared(*c)
            # float32 between the int8 ops: under bf16 autocast inductor fails on the float32
            # export's dtype assertions (torch 2.13, torchao 0.18)
            report("int8", torch.compile(convert_pt2e(prepared)), held_out, references, start)
        if "bf16" in cases:
            bf16 = copy.deepcopy(model).to(torch.bfloat16).to(memory_format=torch.channels_last)
            cast = [(c[0].bfloat16(), c[1], c[2].bfloat16()) for c in held_out]
            report("bf16", torch.compile(bf16), cast, references, time.perf_counter())


def report(name: str, compiled: torch.nn.Module, calls: list[tuple], references: list, start: float) -> None:
    compiled(*calls[0])
    print(f"{name}: prepared and compiled in {time.perf_counter() - start:.0f} s", flush=True)
    found = [errors(compiled(*c), r) for c, r in zip(calls, references, strict=True)]
    print(f"{name}: {seconds(compiled, calls[0]):.2f} s a call; rel. error (max, L2) per held-out call: "
          + ", ".join(f"{m:.2e} {l2:.2e}" for m, l2 in found), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["int8", "bf16"])
