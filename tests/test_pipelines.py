"""SD 1.5, SD3 and Flux through the same build -> load -> generate path as SDXL, compiled vs eager."""

from __future__ import annotations

import numpy as np
import pytest

import aotbuild
from aotbuild.errors import ShapeNotSupportedError
from aotbuild.runtime import CompiledComponent
from aotbuild.targets import ShapeBucket, load_target

from .conftest import TARGETS, build_once, eager_pipeline, generate

pytestmark = pytest.mark.slow
DENOISER = {"cpu-tiny-sd15": "unet", "cpu-tiny-sd3": "transformer", "cpu-tiny-flux": "transformer"}


@pytest.fixture(scope="module", params=list(DENOISER))
def built_pipeline(request, tmp_path_factory):
    target = load_target(TARGETS / f"{request.param}.toml")
    return target, build_once(tmp_path_factory, target)


def test_compiled_matches_eager(built_pipeline):
    target, built = built_pipeline
    bucket = target.shapes[0]
    pipe = aotbuild.load_pipeline(built.folder)
    denoiser = getattr(pipe, DENOISER[target.name])
    assert isinstance(denoiser, CompiledComponent) and list(denoiser.parameters()) == []
    images = generate(pipe, bucket)
    assert denoiser.last_variant == pipe.vae.last_variant == "b2_64x64"
    np.testing.assert_allclose(images, generate(eager_pipeline(target), bucket), atol=1e-4, rtol=0)
    for entry in built.manifest["components"].values():
        assert all(v["numerics"]["max_rel_error"] < 1e-3 for v in entry["variants"])


def test_flux_dynamic_sequence_model(built_pipeline):
    target, built = built_pipeline
    if target.name != "cpu-tiny-flux":
        pytest.skip("only the Flux target declares [dynamic]")
    tokens = next(i for i in built.manifest["components"]["transformer"]["variants"][-1]["inputs"]
                  if i["path"] == "hidden_states")
    assert tokens["dims"] == [{"axis": "batch", "factor": 1}, {"axis": "tokens", "min": 64, "max": 576}, 16]
    pipe = aotbuild.load_pipeline(built.folder)
    eager = eager_pipeline(target)
    for bucket in (ShapeBucket(1, 32, 32), ShapeBucket(2, 96, 96), ShapeBucket(1, 48, 80)):
        images = generate(pipe, bucket)
        assert pipe.transformer.last_variant == "dynamic"
        np.testing.assert_allclose(images, generate(eager, bucket), atol=1e-4, rtol=0)
    with pytest.raises(ShapeNotSupportedError, match="transformer: no compiled variant"):
        generate(pipe, ShapeBucket(1, 112, 96))
