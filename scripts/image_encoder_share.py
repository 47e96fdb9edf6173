"""The IP-Adapter image encoder's share of a generation: the CLIP image encoders IP-Adapters use, at
their published sizes (seeded random weights, no download), timed eager in bf16 on this machine for
one image prompt, beside a compiled denoiser's step time read from `aotbuild bench --component`
results of the same machine. The encoder runs once per call (eager: aotbuild does not compile it),
the denoiser once per step.

    python scripts/image_encoder_share.py artifacts/cpu-sdxl-1024/bench-unet.json:bigG \
        artifacts/cpu-sd15-bf16/bench-unet.json:H --steps 50 --out image-encoder-share.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

# The image encoders of the IP-Adapters people load: h94/IP-Adapter's sdxl_models/image_encoder
# (OpenCLIP ViT-bigG/14), its models/image_encoder (ViT-H/14, SD 1.5's and the SDXL vit-h adapters'),
# and openai/clip-vit-large-patch14 (XLabs' Flux adapter).
ENCODERS = {
    "bigG": {"hidden_size": 1664, "intermediate_size": 8192, "num_hidden_layers": 48, "num_attention_heads": 16,
             "projection_dim": 1280, "hidden_act": "gelu"},
    "H": {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
          "projection_dim": 1024, "hidden_act": "gelu"},
    "L": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
          "projection_dim": 768, "hidden_act": "quick_gelu"},
}


def encoder_seconds(name: str, rounds: int) -> float:
    """The median of `rounds` timed encodes of one 224x224 image (after one untimed)."""
    config = CLIPVisionConfig(image_size=224, patch_size=14, **ENCODERS[name])
    torch.manual_seed(0)
    model = CLIPVisionModelWithProjection(config).to(torch.bfloat16).eval()
    image = torch.randn(1, 3, 224, 224, dtype=torch.bfloat16)
    times = []
    with torch.no_grad():
        for i in range(rounds + 1):
            start = time.perf_counter()
            model(image).image_embeds.sum().item()
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pairs", nargs="+", metavar="BENCH_JSON:ENCODER",
                        help=f"a component bench's results and the encoder its adapters use ({', '.join(ENCODERS)})")
    parser.add_argument("--steps", type=int, default=50, help="denoising steps per generation")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for pair in args.pairs:
        path, _, encoder = pair.rpartition(":")
        bench = json.loads(Path(path).read_text())
        step = bench["runtimes"]["aot"]["call_s"]
        encode = encoder_seconds(encoder, args.rounds)
        rows.append({"target": bench["meta"]["target"], "shape": bench["meta"]["shape"], "encoder": encoder,
                     "encode_s": round(encode, 3), "step_s": round(step, 3), "steps": args.steps,
                     "share": round(encode / (encode + args.steps * step), 5)})
        print(f"{rows[-1]['target']:16s} {rows[-1]['shape']:12s} ViT-{encoder:5s} encode {encode:7.3f} s  "
              f"step {step:7.3f} s  x{args.steps}  share {100 * rows[-1]['share']:.2f}%")
    if args.out:
        args.out.write_text(json.dumps({"cpus": torch.get_num_threads(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
