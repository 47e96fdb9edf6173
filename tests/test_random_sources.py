"""Full-size random sources (random:sdxl, random:flux-dev, random:sd3-medium, random:wan-14b, and the real-size
CPU targets' sd15, wan-1.3b, sd35-medium, flux2-klein) and the GPU device check: what can be checked without
building is checked here (architectures and sizes on the meta device, targets, the script's refusal without
CUDA). The real-size builds themselves take many minutes each: they are benchmarks (docs/real-size.md)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from aotbuild.builder.targets import load_target

from .conftest import ROOT, TARGETS


@pytest.mark.parametrize(("config_set", "component", "params"), [
    ("sdxl", "unet", 2.567e9), ("flux-dev", "transformer", 11.90e9), ("sd3-medium", "transformer", 2.028e9),
    ("wan-14b", "transformer", 14.29e9),
])
def test_full_size_architectures(config_set, component, params):
    import diffusers

    folder = TARGETS / "configs" / config_set
    index = json.loads((folder / "model_index.json").read_text())
    cls = getattr(diffusers, index[component][1])
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(folder / component))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.01)


# Each real-size CPU target's compiled components and VAE at the published architecture: their
# parameter counts (SDXL's and SD 1.5's UNet and VAE as published to the parameter; SD3.5 Medium's
# 2.24B parameters hold 0.23B more values in its position-embedding buffer: 2.47B in the checkpoint).
REAL_SIZE = {
    "cpu-sdxl-256": {"unet": 2_567_463_684, "vae": 83_653_863},  # 256 and 768: the UNet's growth, UNet alone
    "cpu-sdxl-512": {"unet": 2_567_463_684, "vae": 83_653_863},
    "cpu-sdxl-768": {"unet": 2_567_463_684, "vae": 83_653_863},
    "cpu-sdxl-1024": {"unet": 2_567_463_684, "vae": 83_653_863},
    "cpu-sd15": {"unet": 859_520_964, "vae": 83_653_863},
    "cpu-sd15-bf16": {"unet": 859_520_964, "vae": 83_653_863},
    "cpu-wan21-1.3b": {"transformer": 1_418_996_800, "vae": 126_892_531},
    "cpu-sd35-medium": {"transformer": 2_243_171_520, "vae": 83_819_683},  # SD3's VAE: 16 latent channels
    "cpu-flux2-klein": {"transformer": 3_875_544_576, "vae": 84_046_115},
}


@pytest.mark.parametrize("name", sorted(REAL_SIZE))
def test_real_size_targets_are_the_published_architectures(name):
    import diffusers

    target = load_target(TARGETS / f"{name}.toml")
    assert target.device == "cpu" and target.source.startswith("random:")
    folder = TARGETS / "configs" / target.source.removeprefix("random:")
    index = json.loads((folder / "model_index.json").read_text())
    for component, params in REAL_SIZE[name].items():
        cls = getattr(diffusers, index[component][1])
        with torch.device("meta"):
            model = cls.from_config(cls.load_config(folder / component))
        assert sum(p.numel() for p in model.parameters()) == params, component
    denoiser = next(c for c in REAL_SIZE[name] if c != "vae")
    assert denoiser in target.components


@pytest.mark.parametrize("name", ["h200-sdxl-random", "h200-flux-random", "h200-wan-random"])
def test_gpu_random_targets_validate(name):
    target = load_target(TARGETS / f"{name}.toml")
    assert target.device == "cuda" and target.gpu.capability == "9.0" and target.source.startswith("random:")
    assert target.stride == (32 if "sdxl" in name else 16)  # read from the full-size configs
    assert "max_autotune" not in target.inductor


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_script_refuses_without_cuda(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], capture_output=True, text=True,
                            env={"PATH": f"{ROOT / '.venv/bin'}:/usr/bin:/bin", "OUT": str(tmp_path)})
    assert result.returncode != 0 and "no CUDA device" in result.stderr


def test_a_model_index_lists_its_components_not_its_config_values(tmp_path):
    """model_index.json holds components (`[library, class]`, `[null, null]` for none) beside the
    pipeline's own config values, a list too (Krea 2's `text_encoder_select_layers`); a pipeline
    module's own component names the module (`["stable_diffusion", "StableUnCLIPImageNormalizer"]`)."""
    import diffusers
    from diffusers.pipelines.stable_diffusion import StableUnCLIPImageNormalizer

    from aotbuild.runtime.sources import component_classes

    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "StableUnCLIPPipeline", "vae": ["diffusers", "AutoencoderKL"],
        "safety_checker": [None, None], "image_normalizer": ["stable_diffusion", "StableUnCLIPImageNormalizer"],
        "text_encoder_select_layers": [0, 1, 2],
    }))
    assert component_classes(tmp_path) == {"vae": diffusers.AutoencoderKL,
                                           "image_normalizer": StableUnCLIPImageNormalizer}
