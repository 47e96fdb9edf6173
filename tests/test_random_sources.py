"""Full-size random sources (random:sdxl, random:flux-dev, random:sd3-medium, random:wan-14b) and the GPU device
check: what can be checked without a GPU is checked here (architectures and sizes on the meta
device, targets, the script's refusal without CUDA)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from aotbuild.targets import load_target

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
