"""Dynamic shapes: dims inferred from real captures, one dynamic model per component serving a
range, dispatch bucket-first, and clear refusals outside the range."""

from __future__ import annotations

import numpy as np
import pytest

import aotbuild
from aotbuild.builder.targets import ShapeBucket, load_target
from aotbuild.errors import ShapeNotSupportedError, TargetError
from aotbuild.spec.shapes import (
    classify,
    failed_guard,
    infer_size,
    polynomial,
    probe_points,
    relations_hold,
    solve,
    uncheckable_guard,
)

from .conftest import TARGETS, build_once, eager_pipeline, generate
from .test_targets import GOOD, write_target

RANGES = {"batch": [1, 3], "height": [32, 96], "width": [32, 96]}
UNET_DIMS = [[{"axis": "batch", "factor": 2}, 4, {"axis": "height", "pixels": 2, "multiple": 2},
              {"axis": "width", "pixels": 2, "multiple": 2}], []]


def test_probe_points_avoid_size_one_and_move_one_axis_each():
    points = probe_points(RANGES, 4)
    b0, h0, w0 = points["base"]
    assert b0 == 2 and 32 < h0 < 96 and h0 % 4 == 0
    assert points["batch"][1:] == (h0, w0) and points["batch"][0] != b0
    assert points["height"][0::2] == (b0, w0) and points["height"][1] != h0
    assert points["width"][:2] == (b0, h0) and points["width"][2] != w0


def test_classify_finds_guidance_batch_latent_dims_and_token_sequences():
    points = {"base": (2, 64, 64), "batch": (3, 64, 64), "height": (2, 32, 64), "width": (2, 64, 96)}

    def shapes(b, h, w):  # a UNet sample, a 0-d timestep, and Flux-like packed tokens
        return [[2 * b, 4, h // 2, w // 2], [], [b, (h // 4) * (w // 4), 16]]

    probes = {name: shapes(*p) for name, p in points.items()}
    corners = {"min": shapes(1, 32, 32), "max": shapes(3, 96, 96)}
    dims = classify(probes, corners, points, stride=4)
    assert dims[:2] == UNET_DIMS
    assert dims[2] == [{"axis": "batch", "factor": 1}, {"axis": "tokens", "min": 64, "max": 576}, 16]


@pytest.mark.parametrize(("shape", "expected"), [
    ([2, 4, 16, 16], {"batch": 1, "height": 32, "width": 32}),
    ([6, 4, 48, 48], {"batch": 3, "height": 96, "width": 96}),
    ([4, 4, 18, 30], {"batch": 2, "height": 36, "width": 60}),
    ([8, 4, 16, 16], None),   # batch 4 > 3
    ([3, 4, 16, 16], None),   # odd: not 2 x images
    ([2, 4, 50, 16], None),   # 100 px > 96
    ([2, 4, 17, 16], None),   # 34 px: not a multiple of the 4 px stride
    ([2, 4, 16], None),       # wrong rank
])
def test_runtime_size_check(shape, expected):
    assert infer_size(UNET_DIMS, [shape, []], RANGES, 4) == expected


@pytest.mark.parametrize(("extra", "message"), [
    ("[dynamic]\nbatch = [1, 2]\nheight = [32, 66]\nwidth = [32, 64]\n",
     r"'dynamic.height' bound 66 is not a multiple of 4"),
    ("[dynamic]\nbatch = [3, 2]\nheight = [32, 64]\nwidth = [32, 64]\n",
     r"'dynamic.batch' = \[3, 2\] needs 1 <= min <= max"),
    ("[dynamic]\nbatch = [1, 40]\nheight = [32, 64]\nwidth = [32, 64]\n", r"denoiser batch of 80.*<= 63"),
    ("[dynamic]\nbatch = [1, 2]\nheight = [32, 64]\n", r"'dynamic' needs batch, height, width \(and optionally "
     r"max_sequence_length\)"),
    ("[dynamic]\nbatch = [1, 2]\nheight = [32, 64]\nwidth = [32, 64]\nmax_sequence_length = [77, 77]\n",
     r"'dynamic.max_sequence_length': StableDiffusionXLPipeline's call takes no max_sequence_length"),
    ("[dynamic]\nbatch = 2\nheight = [32, 64]\nwidth = [32, 64]\n", r"'dynamic.batch' must be \[min, max\]"),
])
def test_invalid_ranges_are_target_errors(tmp_path, extra, message):
    with pytest.raises(TargetError, match=message):
        load_target(write_target(tmp_path, GOOD + extra))


@pytest.mark.slow
@pytest.mark.parametrize("bucket", [ShapeBucket(1, 32, 32), ShapeBucket(3, 96, 96), ShapeBucket(2, 48, 80)], ids=str)
def test_dynamic_model_serves_range_edges_and_inside(built, tiny_target, bucket):
    pipe = aotbuild.load_pipeline(built.folder)
    images = generate(pipe, bucket)
    assert pipe.unet.last_variant == pipe.vae.last_variant == "dynamic"
    np.testing.assert_allclose(images, generate(eager_pipeline(tiny_target), bucket), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_bucket_wins_over_dynamic_when_both_cover(built):
    pipe = aotbuild.load_pipeline(built.folder)
    generate(pipe, ShapeBucket(2, 64, 96))  # also inside the dynamic range
    assert pipe.unet.last_variant == "b2_64x96"


@pytest.mark.slow
@pytest.mark.parametrize("bucket", [ShapeBucket(4, 64, 64), ShapeBucket(1, 104, 64), ShapeBucket(1, 64, 24)], ids=str)
def test_just_outside_the_range_is_refused(built, bucket):
    pipe = aotbuild.load_pipeline(built.folder)
    with pytest.raises(ShapeNotSupportedError, match=r"32-96x32-96 px \(multiples of 4\), 1-3 images"):
        generate(pipe, bucket)


def test_flux_target_declares_a_dynamic_range():
    target = load_target(TARGETS / "cpu-tiny-flux.toml")
    assert target.dynamic == {"batch": [1, 2], "height": [32, 96], "width": [32, 96],
                              "max_sequence_length": [128, 512]} and target.stride == 4


def test_text_length_classifies_as_its_own_sequence_and_joins_image_tokens():
    """A dim that follows the text length alone is a text sequence (Flux's T5 tokens); one that
    follows it and the size is one sequence of both (Chroma's attention mask)."""
    ranges = {**RANGES, "max_sequence_length": [128, 512]}
    points = probe_points(ranges, 4)
    assert points["max_sequence_length"][:3] == points["base"][:3] != points["max_sequence_length"]

    def shapes(b, h, w, text):  # T5 tokens, text ids, a mask over text + image tokens
        return [[b, text, 32], [text, 3], [b, text + (h // 4) * (w // 4)]]

    probes = {name: shapes(*p) for name, p in points.items()}
    corners = {"min": shapes(1, 32, 32, 128), "max": shapes(3, 96, 96, 512)}
    dims = classify(probes, corners, points, stride=4)
    text = {"axis": "max_sequence_length", "min": 128, "max": 512}
    assert dims == [[{"axis": "batch", "factor": 1}, text, 32], [text, 3],
                    [{"axis": "batch", "factor": 1}, {"axis": "tokens", "min": 128 + 64, "max": 512 + 576}]]


@pytest.mark.parametrize(("sizes", "holds"), [
    ([[2, 100], [2, 100 + 512], [4, 3]], True),
    ([[2, 100], [2, 100 + 511], [4, 3]], False),   # a mask that is not image tokens + 512
    ([[2, 100], [3, 100 + 512], [4, 3]], False),   # two batches where the program has one
    ([[2, 100], [2, 100 + 512], [6, 3]], True),    # 2*s2: s2 = 3
    ([[2, 100], [2, 100 + 512], [5, 3]], False),   # odd: not 2*s2
])
def test_relations_the_exported_program_assumes_are_checked(sizes, holds):
    dims = [[{"axis": "batch", "factor": 1, "expr": "s0"}, {"axis": "tokens", "min": 64, "max": 576, "expr": "s1"}],
            [{"axis": "batch", "factor": 1, "expr": "s0"}, {"axis": "tokens", "min": 576, "max": 1088,
                                                            "expr": "s1 + 512"}],
            [{"axis": "batch", "factor": 2, "expr": "2*s2"}, 3]]
    assert relations_hold(dims, sizes) is holds


def test_relations_aotbuild_cannot_check_are_refused():
    assert polynomial("((s0//2))") is None
    assert not relations_hold([[{"axis": "tokens", "min": 1, "max": 9, "expr": "s0 + s1"}]], [[5]])


# Z-Image pads its caption (s0 tokens) to a multiple of 32 only when it is not one, and its image
# tokens (s1 x s2) likewise: export keeps the branch the example took as guards on the sizes.
Z_IMAGE_GUARDS = ["(((-1)*s0) % 32) >= 2", "(((-1)*s1*s2) % 32) <= 0", "max(32, s0 + (((-1)*s0) % 32)) != 32"]


@pytest.mark.parametrize(("text", "latent", "holds"), [
    (264, 32, True),     # caption padded by 24, 16 x 16 image tokens: no image padding
    (100, 16, True),
    (256, 32, False),    # a caption that needs no padding: the other branch
    (287, 32, False),    # padded by 1: a size export specializes
    (264, 24, False),    # 12 x 12 image tokens need padding
])
def test_guards_export_took_are_checked(text, latent, holds):
    dims = [[4, {"axis": "height", "pixels": 2, "multiple": 2, "expr": "2*s1"},
             {"axis": "width", "pixels": 2, "multiple": 2, "expr": "2*s2"}],
            [{"axis": "max_sequence_length", "min": 40, "max": 500, "expr": "s0"}, 32]]
    sizes = [[4, latent, latent], [text, 32]]
    assert relations_hold(dims, sizes) is True
    assert relations_hold(dims, sizes, Z_IMAGE_GUARDS) is holds
    assert (failed_guard(Z_IMAGE_GUARDS, solve(dims, sizes)) is None) is holds


@pytest.mark.parametrize("guard", ["__import__('os').system('true')", "s0.bit_length() > 1", "s0 ** 2 > 1",
                                   "'a' < 'b'", "(lambda: 1)()"])
def test_a_guard_that_is_not_integer_arithmetic_is_refused_unrun(guard):
    """The manifest is data: a guard other than integer arithmetic on sizes is never evaluated.
    It is found before any call (a build refuses to record it, a load refuses an artifact that does)."""
    assert uncheckable_guard(["s0 % 32 > 0", guard]) == guard and uncheckable_guard(["s0 % 32 > 0"]) is None
    with pytest.raises(ValueError, match="a shape guard aotbuild cannot check"):
        failed_guard([guard], {"s0": 3})


@pytest.mark.slow
def test_text_length_is_a_shape(tmp_path_factory):
    """cpu-tiny-flux's dynamic model spans max_sequence_length 128-512 (its bucket: the default
    512): Schnell's 256 and any length inside run compiled == eager; one outside is refused,
    naming the text length and what was compiled."""
    target = load_target(TARGETS / "cpu-tiny-flux.toml")
    pipe = aotbuild.load_pipeline(build_once(tmp_path_factory, target).folder)
    eager = eager_pipeline(target)
    for bucket, text, variant in ((ShapeBucket(2, 64, 64), 256, "dynamic"), (ShapeBucket(1, 48, 80), 128, "dynamic"),
                                  (ShapeBucket(1, 32, 96), 300, "dynamic"), (ShapeBucket(2, 64, 64), 512, "b2_64x64")):
        images = generate(pipe, bucket, max_sequence_length=text)
        assert pipe.transformer.last_variant == variant
        np.testing.assert_allclose(images, generate(eager, bucket, max_sequence_length=text), atol=1e-4, rtol=0)
    with pytest.raises(ShapeNotSupportedError, match=r"transformer: text length 100 \(max_sequence_length=100\) in "
                                                     r"this call; compiled: 128-512, 512; this artifact covers: 64x64 "
                                                     r"px, 1-2 images, text length 512; "):
        generate(pipe, ShapeBucket(1, 64, 64), max_sequence_length=100)
    # The server's check before it allocates anything decides the same, from the same coverage.
    from aotbuild.serving.schema import covered

    call = {"images": 1, "height": 32, "width": 96, "guidance_scale": 3.5, "frames": None}
    assert covered(pipe, target.to_dict(), call, text=300) is None
    assert covered(pipe, target.to_dict(), {**call, "height": 64, "width": 64}, text=100).startswith(
        "no compiled variant makes 1 image(s) at 64x64 px with guidance at text length 100; this artifact covers: ")


def test_probe_moves_batch_even_when_the_only_other_value_is_one():
    points = probe_points({"batch": [1, 2], "height": [32, 32], "width": [32, 96]}, 4)
    assert points["base"][0] == 2 and points["batch"][0] == 1
    assert points["height"][1] == points["base"][1] == 32  # a fixed axis stays put


def test_inputs_one_dim_spans_share_one_symbol_for_inductor():
    """torch.export gives every input dim its own symbol, even where one Dim spans several inputs;
    inductor then lowers each attention's view(batch, -1, heads, dim) to floor(s1 * n / s2) and
    nests it at the next one (a real SDXL UNet's compile did not finish in 30 minutes). After
    `unify_input_sizes` the batch of every input is one symbol and those sizes simplify."""
    import sympy
    import torch
    from diffusers import UNet2DConditionModel
    from torch.utils._sympy.functions import FloorDiv

    from aotbuild.builder import export
    from aotbuild.spec.private_apis import shape_env
    from aotbuild.spec.shapes import export_dynamic_shapes

    folder = TARGETS / "configs" / "tiny-sdxl" / "unet"
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder)).eval()
    config = unet.config
    text = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    args = (torch.randn(2, 4, 8, 8), torch.tensor(10.0))
    kwargs = {"encoder_hidden_states": torch.randn(2, 77, config.cross_attention_dim),
              "added_cond_kwargs": {"text_embeds": torch.randn(2, text), "time_ids": torch.randn(2, 6)}}
    batch = {"axis": "batch", "factor": 1}
    dims = [[batch, 4, 8, 8], [], [batch, 77, config.cross_attention_dim], [batch, text], [batch, 6]]
    dynamic = export_dynamic_shapes(unet, args, kwargs, dims, {"batch": [1, 2]}, 8)
    program = export.export_variant(unet, args, kwargs, None, dynamic)
    sizes = [shape[0].node.expr for shape in export._input_shapes(program) if shape]
    assert len(set(sizes)) == 4  # what export gives: a symbol per input
    env = shape_env(program)
    assert env.simplify(FloorDiv(sizes[0] * 7, sizes[1])) != 7

    export.unify_input_sizes(program, dims)
    assert len({env.replace(size) for size in sizes}) == 1
    assert env.simplify(FloorDiv(sizes[0] * 7, sizes[1])) == 7
    assert isinstance(env.replace(sizes[0]), sympy.Symbol)
