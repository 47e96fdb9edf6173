"""SD 1.5, SD3 and Flux through the same build -> load -> generate path as SDXL, compiled vs eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aotbuild
from aotbuild.builder.targets import ShapeBucket, load_target
from aotbuild.errors import ShapeNotSupportedError
from aotbuild.runtime import CompiledComponent

from .conftest import TARGETS, build_once, eager_pipeline, generate, make_lora, mapped_from

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
    assert isinstance(denoiser, CompiledComponent)
    # Its parameters are the artifact's weights, mapped from its weights file: nothing else made.
    assert mapped_from(list(denoiser.parameters()), [built.folder / f"{DENOISER[target.name]}.safetensors"])
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
    assert [{k: v for k, v in d.items() if k != "expr"} if isinstance(d, dict) else d for d in tokens["dims"]] == \
        [{"axis": "batch", "factor": 1}, {"axis": "tokens", "min": 64, "max": 576}, 16]
    pipe = aotbuild.load_pipeline(built.folder)
    eager = eager_pipeline(target)
    for bucket in (ShapeBucket(1, 32, 32), ShapeBucket(2, 96, 96), ShapeBucket(1, 48, 80)):
        images = generate(pipe, bucket)
        assert pipe.transformer.last_variant == "dynamic"
        np.testing.assert_allclose(images, generate(eager, bucket), atol=1e-4, rtol=0)
    with pytest.raises(ShapeNotSupportedError, match="transformer: no compiled variant"):
        generate(pipe, ShapeBucket(1, 112, 96))


def test_loras_and_other_weights_match_eager(built_pipeline, tmp_path):
    """diffusers' LoRA API on the compiled denoiser (two adapters with weights, the per-call scale,
    A -> B -> A, unload) and another seed's weights through apply(), each against eager."""
    target, built = built_pipeline
    bucket = target.shapes[0]
    eager, compiled = eager_pipeline(target), aotbuild.load_pipeline(built.folder)
    base = generate(compiled, bucket)
    files = {name: make_lora(eager, tmp_path / name, seed=seed) for name, seed in (("A", 1), ("B", 2))}
    for pipe in (eager, compiled):
        pipe.load_lora_weights(files["A"], adapter_name="A")
        pipe.load_lora_weights(files["B"], adapter_name="B")
        pipe.set_adapters(["A", "B"], adapter_weights=[0.7, 0.4])
    want = generate(eager, bucket)
    assert np.abs(want - base).max() > 0.01
    np.testing.assert_allclose(generate(compiled, bucket), want, atol=1e-4, rtol=0)
    key = "cross_attention_kwargs" if hasattr(eager, "unet") else "joint_attention_kwargs"
    scaled = [pipe("a red fox in the snow", num_inference_steps=2, height=bucket.height, width=bucket.width,
                   num_images_per_prompt=bucket.batch, guidance_scale=5.0, output_type="np", **{key: {"scale": 0.3}},
                   generator=torch.Generator("cpu").manual_seed(0)).images for pipe in (eager, compiled)]
    np.testing.assert_allclose(scaled[1], scaled[0], atol=1e-4, rtol=0)
    compiled.set_adapters("A")
    only_a = generate(compiled, bucket)
    compiled.set_adapters("B")
    generate(compiled, bucket)
    compiled.set_adapters("A")
    assert np.array_equal(generate(compiled, bucket), only_a)
    compiled.unload_lora_weights()
    assert np.array_equal(generate(compiled, bucket), base)

    finetuned = eager_pipeline(target, seed=7)
    expected = generate(finetuned, bucket)
    aotbuild.apply(finetuned, built.folder)
    np.testing.assert_allclose(generate(finetuned, bucket), expected, atol=1e-4, rtol=0)


def test_the_blocks_a_pipeline_counts_are_kept_as_their_number():
    """Bria FIBO sizes its text layers by `len(transformer.transformer_blocks) + len(...)`: the
    manifest keeps each list of blocks the pipeline reads by its number, and the stand-in answers
    `len` with it; reaching a block says it is compiled in."""
    import dataclasses

    from aotbuild.builder.packaging import _block_counts
    from aotbuild.errors import MissingAttributeError
    from aotbuild.runtime.component import CompiledBlocks
    from aotbuild.spec.pipelines import TRANSFORMER

    spec = dataclasses.replace(TRANSFORMER, read_attributes=("inner_dim", "single_transformer_blocks",
                                                             "transformer_blocks"))
    model = torch.nn.Module()
    model.inner_dim = 8
    model.transformer_blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
    model.single_transformer_blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(5))
    counts = _block_counts(spec, model)
    assert counts == {"single_transformer_blocks": 5, "transformer_blocks": 3}
    blocks = CompiledBlocks("transformer", "transformer_blocks", counts["transformer_blocks"])
    assert len(blocks) == 3 and bool(blocks)
    for reach in (lambda: blocks[0], lambda: list(blocks)):
        with pytest.raises(MissingAttributeError, match=r"^transformer is compiled by aotbuild: its "
                                                        r"transformer_blocks are in the compiled code, and the "
                                                        r"stand-in keeps only their number \(3\)"):
            reach()
