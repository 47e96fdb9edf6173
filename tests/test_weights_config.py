"""A checkpoint's config is data too, and its precision is the user's. Another checkpoint's config
keys that no compiled code reads (the VAE's latent scaling and statistics: the pipeline reads them)
are that checkpoint's, and its images are the ones eager diffusers makes from it; a key compiled
into the code (an epsilon, a rotary layout) that differs is refused, naming the component, the key
and both values. Per family, through `load_pipeline(weights=)` and `apply()`. Weights in another
dtype than the artifact computes run only when the caller names it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aotbuild
from aotbuild.builder.targets import load_target
from aotbuild.errors import WeightsMismatchError

from .conftest import TARGETS, build_once, eager_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::aotbuild.runtime.load.UncuratedPipelineWarning")]
ATOL = 1e-4  # images in [0, 1]; float32 compiled vs eager differ by ~1e-6

# Per family: (module, key, value) read outside the compiled code, then one compiled into it.
CHANGES = {
    "cpu-tiny-sdxl": (("vae", "scaling_factor", 0.3), ("unet", "upcast_attention", True)),
    "cpu-tiny-flux": (("vae", "shift_factor", 0.4), ("transformer", "axes_dims_rope", [8, 4, 4])),
    # Qwen-Image's rotary tables are tensors the forward makes, lifted into the compiled model:
    # another layout of them was bound the artifact's, silently, like every key below.
    "cpu-tiny-qwen-image": (("vae", "latents_std", [2.0, 3.0, 4.0, 1.0]),
                            ("transformer", "axes_dims_rope", [6, 4, 6])),
    # Wan's VAE runs eager in this target: its config comes with the checkpoint's other components.
    "cpu-tiny-wan": (("vae", "latents_std", [2.0, 3.0, 4.0, 1.0]), ("transformer", "rope_max_seq_len", 64)),
}


def run(pipe, target):
    bucket = target.shapes[0]
    call = {"height": bucket.height, "width": bucket.width, "num_inference_steps": 2, "output_type": "np",
            "generator": torch.Generator("cpu").manual_seed(0)}
    if bucket.frames:
        call["num_frames"] = bucket.frames
    result = pipe("a red fox in the snow", **call)
    return result.frames if hasattr(result, "frames") else result.images


def checkpoint(target, folder, module: str, key: str, value):
    """A fine-tune (seed 7) whose `module` config holds `value` at `key`, saved as a diffusers
    folder, and the eager pipeline loaded back from it."""
    pipe = eager_pipeline(target, seed=7)
    getattr(pipe, module).register_to_config(**{key: value})
    pipe.save_pretrained(folder)
    return type(pipe).from_pretrained(folder)


@pytest.mark.parametrize("name", CHANGES)
def test_a_checkpoints_config_is_used_where_it_is_data_and_refused_where_it_is_compiled(name, tmp_path,
                                                                                         tmp_path_factory):
    target = load_target(TARGETS / f"{name}.toml")
    built = build_once(tmp_path_factory, target)
    (module, key, value), (compiled_module, compiled_key, compiled_value) = CHANGES[name]

    eager = checkpoint(target, tmp_path / "finetune", module, key, value)
    expected = run(eager, target)
    assert np.abs(expected - run(eager_pipeline(target, seed=7), target)).max() > 0.01  # the key changes images
    loaded = aotbuild.load_pipeline(built.folder, weights=tmp_path / "finetune")
    np.testing.assert_allclose(run(loaded, target), expected, atol=ATOL, rtol=0)
    assert getattr(loaded, module).config[key] == value
    aotbuild.apply(eager, built.folder)
    assert getattr(eager, module).config[key] == value
    np.testing.assert_allclose(run(eager, target), expected, atol=ATOL, rtol=0)

    other = checkpoint(target, tmp_path / "other", compiled_module, compiled_key, compiled_value)
    component = compiled_module if compiled_module != "vae" else "vae_decoder"
    refusal = (rf"^{component}: the weights' config differs from the artifact's in '{compiled_key}' \(.* in the "
               rf"weights, .* in the artifact\): the compiled code holds the artifact's")
    with pytest.raises(WeightsMismatchError, match=refusal) as info:
        aotbuild.load_pipeline(built.folder, weights=tmp_path / "other")
    assert "build a target from these weights" in info.value.hint
    with pytest.raises(WeightsMismatchError, match=refusal):
        aotbuild.apply(other, built.folder)


def test_precision_changes_only_when_asked(built_bf16_prepack, bf16_prepack_target, built, tiny_target, tmp_path):
    """A float32 pipeline given a bfloat16 artifact, or a checkpoint stored in float32 loaded into
    one, was cast silently: its images were no longer its eager ones. Refused naming both dtypes,
    unless the caller names the artifact's dtype; weights already in that dtype, or half-precision
    weights in a float32 artifact (every value exact), need nothing said."""
    from click.testing import CliRunner

    from aotbuild.cli import main
    from aotbuild.errors import PrecisionError

    folder = built_bf16_prepack.folder
    pipe = eager_pipeline(bf16_prepack_target)
    with pytest.raises(PrecisionError, match=r"^pipe.unet is float32 and this artifact computes bfloat16: its images "
                                             r"would not be the ones float32 weights make eager") as info:
        aotbuild.apply(pipe, folder)
    assert 'dtype="bfloat16"' in info.value.hint and "--dtype bfloat16" in info.value.hint
    assert pipe.unet.dtype == torch.float32  # refused before anything changed
    assert aotbuild.apply(pipe, folder, dtype="bfloat16").unet.dtype == torch.bfloat16
    aotbuild.apply(eager_pipeline(bf16_prepack_target).to(torch.bfloat16), folder)  # already bfloat16

    eager_pipeline(bf16_prepack_target, seed=7).save_pretrained(tmp_path / "float32")
    with pytest.raises(PrecisionError, match=r"float32's unet is float32 and this artifact computes bfloat16"):
        aotbuild.load_pipeline(folder, weights=tmp_path / "float32")
    aotbuild.load_pipeline(folder, weights=tmp_path / "float32", dtype="bfloat16")
    eager_pipeline(bf16_prepack_target, seed=7).to(torch.bfloat16).save_pretrained(tmp_path / "bfloat16")
    aotbuild.load_pipeline(folder, weights=tmp_path / "bfloat16")
    aotbuild.load_pipeline(built.folder, weights=tmp_path / "bfloat16")  # a float32 artifact: exact upcast

    run = ["run", "--artifact", str(folder), "--prompt", "a fox", "--steps", "1",
           "--weights", str(tmp_path / "float32")]
    refused = CliRunner().invoke(main, run)
    assert refused.exit_code == 1 and "error: " in refused.output and "hint: " in refused.output
    assert "is float32 and this artifact computes bfloat16" in refused.output and "--dtype bfloat16" in refused.output
    accepted = CliRunner().invoke(main, [*run, "--dtype", "bfloat16"])
    assert accepted.exit_code == 0, accepted.output
