"""optimize.prepack: weights prepared for oneDNN at load from the bound weights, compared with the
eager pipeline given the same weights and calls (cpu-tiny-sdxl-prepack: tiny SDXL, float32, a
bucket and a dynamic model)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import aotbuild
from aotbuild.builder import build
from aotbuild.builder.targets import ShapeBucket
from aotbuild.cli import main
from aotbuild.errors import CorruptArtifactError, SourceError
from aotbuild.generation.backends import prepare as prepare_backend
from aotbuild.runtime.prepared import OPERATORS, PreparedConstants, prepare, resolve, sources
from aotbuild.spec.private_apis import onednn_runs

from .conftest import TARGETS, eager_pipeline, generate, make_lora

BUCKET = ShapeBucket(1, 64, 64)
DYNAMIC = ShapeBucket(2, 48, 80)
ATOL = 1e-4  # float32: measured ~2e-6 on [0, 1] images
BF16_ATOL = 0.05  # bfloat16 against the same recipe run eager: measured 0.020 (0.014 against eager float32)
# Inductor packs bf16 weights for oneDNN only where oneDNN computes bf16 (AVX-512, AMX); on an AVX2
# CPU the packing tests take float32, which it packs on any x86.
BF16_PACKED = onednn_runs("bfloat16")
PACKED_DTYPE = torch.bfloat16 if BF16_PACKED else torch.float32


@pytest.fixture
def built_packed(request):
    """The bf16 recipe's build where this CPU packs bf16 weights, else the float32 one."""
    return request.getfixturevalue("built_bf16_prepack" if BF16_PACKED else "built_prepack")


@pytest.fixture(scope="module")
def loras(tmp_path_factory, prepack_target):
    folder = tmp_path_factory.mktemp("loras")
    pipe = eager_pipeline(prepack_target)
    return {"A": make_lora(pipe, folder / "A", seed=1), "B": make_lora(pipe, folder / "B", seed=2, rank=8, alpha=4)}


def _load_a_and_b(pipes, loras) -> None:
    for pipe in pipes:
        pipe.load_lora_weights(loras["A"], adapter_name="A")
        pipe.load_lora_weights(loras["B"], adapter_name="B")
        pipe.set_adapters(["A", "B"], adapter_weights=[0.7, 0.4])


def _switches_back_exactly(compiled, only_a, base, while_b=contextlib.nullcontext) -> None:
    """A -> B -> A gives A's image (`only_a`), and unloading the LoRAs the base image, bit for bit."""
    compiled.set_adapters("B")
    with while_b():
        generate(compiled, BUCKET)
    compiled.set_adapters("A")
    assert np.array_equal(generate(compiled, BUCKET), only_a)
    compiled.unload_lora_weights()
    assert np.array_equal(generate(compiled, BUCKET), base)


def _ops(recipe) -> set[str]:
    if isinstance(recipe, list):
        return set().union(*map(_ops, recipe)) if recipe else set()
    if not isinstance(recipe, dict):
        return set()
    return ({recipe["op"]} if "op" in recipe else set()) | _ops(list(recipe.values()))


@pytest.mark.slow
def test_packed_constants_are_recipes_made_from_stored_weights(built_prepack, prepack_target):
    manifest = json.loads((built_prepack.folder / "manifest.json").read_text())
    assert manifest["optimizations"]["passes"]["prepack"] == {"enabled": True}
    assert manifest["optimizations"]["inductor"]["freezing"] is True
    for name, component in manifest["components"].items():
        with safe_open(built_prepack.folder / component["weights"], "pt") as stored:
            keys = set(stored.keys())
        assert not any(key.startswith("_frozen_param") for key in keys)  # made at load, never stored
        for variant in component["variants"]:
            recipes = variant["prepared"]
            assert recipes, f"{name} {variant['name']} prepared nothing"
            assert all(sources(recipe) <= keys for recipe in recipes.values())
    ops = set().union(*(_ops(v["prepared"]) for c in manifest["components"].values() for v in c["variants"]))
    assert {"mkldnn._reorder_convolution_weight", "mkldnn._reorder_linear_weight"} <= ops
    shown = CliRunner().invoke(main, ["inspect", str(built_prepack.folder)], catch_exceptions=False).output
    count = len(manifest["components"]["unet"]["variants"][0]["prepared"])
    assert "b1_64x64     64x64 px" in shown and f"{count} constants prepared at load" in shown

    compiled, eager = aotbuild.load_pipeline(built_prepack.folder), eager_pipeline(prepack_target)
    # Every convolution's weight is packed in every model, the dynamic-size ones too (the bucket's
    # batch moves with guidance): inductor packs only at static sizes, aotbuild at the export size.
    for name, component in manifest["components"].items():
        with safe_open(built_prepack.folder / component["weights"], "pt") as stored:
            keys = set(stored.keys())
        convolutions = {f"{n}.weight" for n, m in getattr(eager, component["attribute"]).named_modules()
                        if isinstance(m, torch.nn.Conv2d)} & keys
        for variant in component["variants"]:
            packed_from = set().union(*(sources(r) for r in variant["prepared"].values()
                                        if "mkldnn._reorder_convolution_weight" in _ops(r)))
            assert convolutions and convolutions <= packed_from, \
                f"{name} {variant['name']}: {convolutions - packed_from} plain"
    packed = [t for v in compiled.unet.variants for t in v._prepared.tensors.values()]
    assert packed and any(t.is_mkldnn for t in packed)
    for bucket in (BUCKET, DYNAMIC):  # the bucket's model, then the dynamic one
        np.testing.assert_allclose(generate(compiled, bucket), generate(eager, bucket), atol=ATOL, rtol=0)
    assert compiled.unet.last_variant != compiled.unet.variants[0].name
    # Without guidance the bucket's UNet sees half the batch it was packed for.
    unguided = [pipe("a red fox in the snow", num_inference_steps=2, height=BUCKET.height, width=BUCKET.width,
                     guidance_scale=1.0, output_type="np", generator=torch.Generator("cpu").manual_seed(0)).images
                for pipe in (compiled, eager)]
    assert compiled.unet.last_variant == compiled.unet.variants[0].name
    np.testing.assert_allclose(*unguided, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_loras_switch_exactly_on_packed_weights(built_prepack, prepack_target, loras):
    compiled, eager = aotbuild.load_pipeline(built_prepack.folder), eager_pipeline(prepack_target)
    base = generate(compiled, BUCKET)
    _load_a_and_b((compiled, eager), loras)
    with torch.inference_mode():  # the first merge, into buffers made in inference mode
        both = generate(compiled, BUCKET)
    assert not any(buffer.is_inference() for buffer in compiled.unet._lora._buffers.values())
    assert np.abs(both - base).max() > 0.05  # the LoRAs reach the packed weights
    np.testing.assert_allclose(both, generate(eager, BUCKET), atol=ATOL, rtol=0)
    for pipe in (compiled, eager):
        pipe.set_adapters("A")
    only_a = generate(compiled, BUCKET)
    np.testing.assert_allclose(only_a, generate(eager, BUCKET), atol=ATOL, rtol=0)
    # B merged in inference mode: the packing sees it all the same
    _switches_back_exactly(compiled, only_a, base, while_b=torch.inference_mode)


@pytest.mark.slow
def test_the_bf16_recipe_matches_its_eager_recipe_and_switches_loras_exactly(built_bf16_prepack, bf16_prepack_target,
                                                                             loras):
    """The CPU recipe for AMX: bf16 weights packed for oneDNN at load, channels_last, fused QKV.
    Compared with the same recipe run eager without the fusion (diffusers' fused attention ignores
    LoRA layers on q, k and v; aotbuild merges them into the fused weight), and LoRAs through the
    packing."""
    compiled = aotbuild.load_pipeline(built_bf16_prepack.folder)
    unfused = {k: v for k, v in bf16_prepack_target.optimize.items() if k != "fuse_qkv"}
    eager = prepare_backend(dataclasses.replace(bf16_prepack_target, optimize=unfused), "eager", Path())
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # a CPU computing bf16 in oneDNN: its packed layout
        assert any(t.is_mkldnn and t.dtype == torch.bfloat16
                   for v in compiled.unet.variants for t in v._prepared.tensors.values())
    base = generate(compiled, BUCKET)
    np.testing.assert_allclose(base, generate(eager, BUCKET), atol=BF16_ATOL, rtol=0)
    _load_a_and_b((compiled, eager), loras)
    both = generate(compiled, BUCKET)
    assert np.abs(both - base).max() > 0.05  # the LoRAs reach the packed weights
    np.testing.assert_allclose(both, generate(eager, BUCKET), atol=BF16_ATOL, rtol=0)
    compiled.set_adapters("A")
    _switches_back_exactly(compiled, generate(compiled, BUCKET), base)


def test_bf16_on_a_cpu_without_bf16_kernels_is_said_to_be_slow(built_bf16_prepack, bf16_prepack_target, tmp_path,
                                                                monkeypatch):
    """Correct, but tens of times slower than float32 (an AVX2 EPYC: a 1024x1024 bf16 matmul at
    0.8 GFLOP/s, 68 in float32): said at load and at build, before anything is read; nothing on
    a CPU whose oneDNN computes bf16."""
    from aotbuild.runtime import load
    from aotbuild.runtime.load import SlowPrecisionWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotbuild.runtime.load_components(built_bf16_prepack.folder)
    said = [w for w in caught if issubclass(w.category, SlowPrecisionWarning)]
    assert len(said) == (0 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 1), [str(w.message) for w in said]
    monkeypatch.setattr(load, "onednn_runs", lambda dtype: dtype != "bfloat16")
    cpu = torch.backends.cpu.get_cpu_capability()
    with pytest.warns(SlowPrecisionWarning, match=re.escape(
            "aotbuild: this artifact runs bfloat16 on a CPU whose matrix products and convolutions have no bfloat16 "
            f"kernel (AVX-512 or AMX has them; this CPU: {cpu}): correct, but tens of times slower than float32 here. "
            "Build a float32 target for CPUs like this one")):
        aotbuild.runtime.load_components(built_bf16_prepack.folder)
    nowhere = dataclasses.replace(bf16_prepack_target, source=str(tmp_path / "nowhere"))
    with pytest.warns(SlowPrecisionWarning, match=f"target {nowhere.name} runs bfloat16 on a CPU whose"), \
            pytest.raises(SourceError):
        build(nowhere, tmp_path / "artifacts")


@pytest.mark.slow
def test_other_weights_and_writes_are_prepared_the_same_way(built_prepack, prepack_target, tmp_path):
    finetuned = eager_pipeline(prepack_target, seed=7)
    expected = generate(finetuned, BUCKET)
    finetuned.save_pretrained(tmp_path / "finetune")
    loaded = aotbuild.load_pipeline(built_prepack.folder, weights=tmp_path / "finetune")
    np.testing.assert_allclose(generate(loaded, BUCKET), expected, atol=ATOL, rtol=0)

    compiled, mixed = aotbuild.load_pipeline(built_prepack.folder), eager_pipeline(prepack_target)
    mixed.unet, mixed.vae = finetuned.unet, finetuned.vae
    compiled.unet.load_state_dict(finetuned.unet.state_dict())  # written into the bound weights in place
    compiled.vae.load_state_dict(finetuned.vae.state_dict())
    before = generate(mixed, BUCKET)
    np.testing.assert_allclose(generate(compiled, BUCKET), before, atol=ATOL, rtol=0)

    with torch.no_grad():  # a parameter handed out, written in place (its version counter moves)
        for pipe in (compiled, mixed):
            dict(pipe.unet.named_parameters())["conv_in.weight"].mul_(0.5)
            dict(pipe.vae.named_parameters())["decoder.conv_out.weight"].mul_(-1.0)
    written = generate(mixed, BUCKET)
    assert np.abs(written - before).max() > 0.05
    np.testing.assert_allclose(generate(compiled, BUCKET), written, atol=ATOL, rtol=0)
    np.testing.assert_allclose(generate(compiled, DYNAMIC), generate(mixed, DYNAMIC), atol=ATOL, rtol=0)


CONV_RECIPE = {"op": "mkldnn._reorder_convolution_weight",
               "args": [{"op": "aten.clone.default", "args": [{"weight": "conv.weight"}],
                         "kwargs": {"memory_format": {"memory_format": "channels_last"}}},
                        [1, 1], [1, 1], [1, 1], 1, [1, 8, 16, 16]]}


def test_a_recipe_makes_what_onednn_makes_and_follows_its_weights():
    weight = torch.randn(16, 8, 3, 3)
    made = prepare(CONV_RECIPE, {"conv.weight": weight})
    direct = torch.ops.mkldnn._reorder_convolution_weight(weight.contiguous(memory_format=torch.channels_last),
                                                          [1, 1], [1, 1], [1, 1], 1, [1, 8, 16, 16])
    assert made.is_mkldnn and torch.equal(made.to_dense(), direct.to_dense())
    assert sources(CONV_RECIPE) == {"conv.weight"}

    prepared = PreparedConstants({"_frozen_param0": CONV_RECIPE}, {"conv.weight": weight}, "p.pt2")
    packed = prepared.tensors["_frozen_param0"]
    pointer = torch.ops.mkldnn.data_ptr(packed)
    with torch.no_grad():
        weight.mul_(2)  # written in place: remade on refresh, in the same memory
    prepared.refresh()
    assert torch.equal(packed.to_dense(), weight) and torch.ops.mkldnn.data_ptr(packed) == pointer
    other = torch.randn(16, 8, 3, 3)
    assert prepared.rebind({"conv.weight": other, "elsewhere.weight": torch.zeros(1)}) == {}  # remade in place
    assert torch.equal(packed.to_dense(), other) and torch.ops.mkldnn.data_ptr(packed) == pointer


@pytest.mark.slow
def test_each_linear_weight_gets_the_packing_that_measures_faster(monkeypatch):
    """Of the packing inductor makes (for the rows at the export size) and the one for a single
    row, the build keeps the second only where it measures within the margin, by the times given
    here; the recipe records the choice, and the weight packed for one row computes the linear."""
    from aotbuild.builder import export
    from aotbuild.builder.optimize import inductor_flags

    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 96), torch.nn.Linear(96, 64)

        def forward(self, x):
            return self.b(torch.nn.functional.gelu(self.a(x)))

    torch.manual_seed(0)
    module = TwoLinears().to(PACKED_DTYPE).eval()
    inputs = torch.randn(2, 8, 64, dtype=PACKED_DTYPE)
    program = torch.export.export(module, (inputs,), dynamic_shapes=({0: torch.export.Dim("batch", max=4)},))
    asked = []

    def seconds(rows, columns, outputs, dtype, hint):  # a's one-row packing twice as fast, b's 5% faster
        asked.append((rows, columns, outputs, dtype, hint))
        return 1.0 if hint != 1 else {96: 0.5, 64: 0.95}[outputs]

    monkeypatch.setattr(export, "packed_linear_seconds", seconds)
    _, recipes, _ = export.compile_variant(program, export.inductor_options({}, inductor_flags({"prepack": True})))
    assert sorted(asked) == [(16, 64, 96, PACKED_DTYPE, 1), (16, 64, 96, PACKED_DTYPE, 16),
                             (16, 96, 64, PACKED_DTYPE, 1), (16, 96, 64, PACKED_DTYPE, 16)]
    packings = {next(iter(sources(recipe))): recipe for recipe in recipes.values()
                if recipe["op"] == "mkldnn._reorder_linear_weight"}
    assert {name: recipe["args"][1] for name, recipe in packings.items()} == {"a.weight": 1, "b.weight": 16}
    packed = prepare(packings["a.weight"], {"a.weight": module.a.weight})
    rows = inputs.reshape(16, 64)
    with torch.no_grad():
        made = torch.ops.mkldnn._linear_pointwise(rows, packed, module.a.bias, "none", [], "")
        expected = torch.nn.functional.linear(rows.float(), module.a.weight.float(), module.a.bias.float())
    torch.testing.assert_close(made.float(), expected, atol=2e-2, rtol=2e-2)  # bf16 rounding


def test_a_prepared_view_of_a_weight_is_made_anew_never_written_through():
    """Freezing also folds reshapes of biases: a view of the weight. Remade in place, it would
    write the new weight's values into the old weight's memory (a LoRA's base, a user's tensor)."""
    recipe = {"op": "aten.reshape.default", "args": [{"weight": "norm.bias"}, [1, 4]]}
    old = torch.arange(4.0)
    prepared = PreparedConstants({"_frozen_param1": recipe}, {"norm.bias": old}, "p.pt2")
    new = torch.ones(4)
    anew = prepared.rebind({"norm.bias": new})
    assert torch.equal(old, torch.arange(4.0))  # untouched
    assert list(anew) == ["_frozen_param1"] and anew["_frozen_param1"].data_ptr() == new.data_ptr()
    with torch.no_grad():
        new.mul_(3)  # written in place: seen through the view, which needs no remaking
    assert prepared.refresh() == {} and torch.equal(anew["_frozen_param1"], torch.full((1, 4), 3.0))
    with torch.inference_mode():
        inference = torch.zeros(4)  # keeps no version counter: a view of it needs none either
    prepared.rebind({"norm.bias": inference})
    assert prepared.refresh() == {}

    strided = torch.arange(4.0).reshape(2, 2).t()  # reshaped, a copy: watched, made again when written
    made = prepared.rebind({"norm.bias": strided})["_frozen_param1"]
    assert made.untyped_storage().data_ptr() != strided.untyped_storage().data_ptr()
    with torch.no_grad():
        strided.add_(1)
    assert torch.equal(prepared.refresh()["_frozen_param1"], torch.tensor([[1.0, 3.0, 2.0, 4.0]]))
    assert prepared.refresh() == {}  # nothing written since
    with torch.inference_mode():
        strided = torch.arange(4.0).reshape(2, 2).t()  # no version counter, a copy: made again at every look
    prepared.rebind({"norm.bias": strided})
    assert list(prepared.refresh()) == list(prepared.refresh()) == ["_frozen_param1"]


def test_a_recipe_calls_the_operators_aotbuild_records_only():
    """Not any aten or mkldnn operator a manifest names: an in-place write, an allocation of a size
    the manifest chooses, a file read are refused before anything is called."""
    for op in ("builtins.eval.default", "os.system", "aten.clone.default.extra", "aten.copy_.default",
               "aten.fill_.Scalar", "aten.empty.memory_format", "aten.from_file.default",
               "mkldnn._convolution_pointwise"):
        with pytest.raises(CorruptArtifactError, match=rf"calls '{re.escape(op)}', not one of the operators aotbuild "
                                                       rf"records \(aten\._to_copy\.default, "):
            resolve(op)
    assert all(callable(resolve(op)) for op in OPERATORS)  # each there in this torch
    with pytest.raises(CorruptArtifactError, match=r"the weights file lacks 'conv.weight'"):
        PreparedConstants({"_frozen_param0": CONV_RECIPE}, {}, "p.pt2")


def test_a_packed_constant_is_bound_through_a_view_that_owns_nothing():
    from aotbuild.runtime.weights import Lender
    from aotbuild.spec.private_apis import borrowed_mkldnn, mkldnn_memory

    weight = torch.randn(16, 8, 3, 3)
    packed = prepare(CONV_RECIPE, {"conv.weight": weight})
    lender = Lender()
    view = lender.views({"w": packed})["w"]
    assert view.is_mkldnn and mkldnn_memory(view) == mkldnn_memory(packed)
    assert lender.views({"again": packed})["again"] is view  # one view per constant, shared
    packed.copy_(prepare(CONV_RECIPE, {"conv.weight": -weight}))  # remade in place: the view reads it
    assert torch.equal(view.to_dense(), -weight)
    with pytest.raises(RuntimeError, match=r"a torch.uint8 oneDNN tensor: only torch.float32, torch.bfloat16"):
        borrowed_mkldnn(torch.ones(4, 4, dtype=torch.uint8).to_mkldnn())


@pytest.mark.slow
def test_the_component_bench_pairs_the_prepacked_build_with_the_plain_one(built_prepack, built, tmp_path):
    """`bench --component unet --against cpu-tiny-sdxl`: both builds' stand-ins in one process,
    round by round, each checked against eager float32 (how docs/bench.md's 0.99x was measured)."""
    import shutil

    for folder in (built_prepack.folder, built.folder):
        shutil.copytree(folder, tmp_path / folder.name)
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sdxl-prepack.toml"),
                                       "--artifacts", str(tmp_path), "--component", "unet", "--rounds", "3",
                                       "--cases", "aot,aot-model", "--against", str(TARGETS / "cpu-tiny-sdxl.toml")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / built_prepack.folder.name / "bench-unet.json").read_text())
    assert list(document["runtimes"]) == ["aot", "aot:cpu-tiny-sdxl", "aot-model"]
    assert document["meta"]["against"] == ["aot:cpu-tiny-sdxl"]
    for figures in document["runtimes"].values():
        assert figures["max_rel_error"] < 1e-4 and len(figures["values"]) == 3 and figures["ratio_to_aot"] > 0
    assert "aot:cpu-tiny-sdxl" in result.output


@pytest.mark.slow
def test_the_component_bench_makes_the_eager_recipe_from_the_float32_reference(built_bf16_prepack, tmp_path):
    """`bench --component unet --cases aot,eager` of the bf16 recipe: eager is the reference made
    bf16, packed and channels_last in place (at real size a second pipeline does not fit), so its
    error is bf16's, as aot's is; what each runtime added to the process's memory is recorded."""
    import shutil

    shutil.copytree(built_bf16_prepack.folder, tmp_path / built_bf16_prepack.folder.name)
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sdxl-bf16-prepack.toml"),
                                       "--artifacts", str(tmp_path), "--component", "unet", "--rounds", "2",
                                       "--cases", "aot,eager"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / built_bf16_prepack.folder.name / "bench-unet.json").read_text())
    runtimes = document["runtimes"]
    assert list(runtimes) == ["aot", "eager"]
    for figures in runtimes.values():
        assert 1e-4 < figures["max_rel_error"] < 5e-2  # bf16's rounding, not float32's
        assert isinstance(figures["rss_added_mib"], float) and figures["prepare_s"] > 0
    assert runtimes["aot"]["rss_added_mib"] > 0
    assert document["meta"]["peak_rss_mib"] > runtimes["aot"]["rss_added_mib"]


def _mapped(path: Path) -> dict[str, int]:
    """This process's mappings of `path` (matched by inode, /proc/self/smaps): address range -> bytes resident."""
    inode, found, current = path.stat().st_ino, {}, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):
            current = fields[0] if len(fields) >= 6 and fields[4] == str(inode) else None
        elif current and fields[0] == "Rss:":
            found[current] = int(fields[1]) * 1024
    return found


@pytest.mark.slow
def test_weights_read_only_to_be_packed_leave_memory_after_load(built_packed):
    """The packed recipe's weights are read once at load, to pack them: their pages leave this
    process's memory then (the file's mapping keeps only what the code reads by pointer), and come
    back from the file when read again: a LoRA merged from them, a write in place."""
    path = built_packed.folder / "unet.safetensors"
    before = _mapped(path)
    compiled = aotbuild.load_pipeline(built_packed.folder)
    base = generate(compiled, BUCKET)  # the code has read every weight it binds by pointer
    (mapping, resident), = ((k, v) for k, v in _mapped(path).items() if k not in before)
    reads = [v.weight_reads() for v in compiled.unet.variants]
    once = set().union(*(c for c, _ in reads)) - set().union(*(r for _, r in reads))
    once_bytes = sum(compiled.unet.weights[fqn].nbytes for fqn in once)
    assert once_bytes > 0.8 * path.stat().st_size  # the convolutions' and linears' weights: most of them
    # Each of those keeps at most the two pages it shares with its neighbours.
    assert resident <= path.stat().st_size - once_bytes + 2 * 4096 * len(once)
    parameters = dict(compiled.unet.named_parameters())
    largest = parameters[max(once & set(parameters), key=lambda fqn: parameters[fqn].nbytes)]
    with torch.no_grad():  # read again from the file, and written: the packed copy follows
        largest.mul_(-1.0)
    assert np.abs(generate(compiled, BUCKET) - base).max() > 0.05
    with torch.no_grad():
        largest.mul_(-1.0)
    np.testing.assert_array_equal(generate(compiled, BUCKET), base)


@pytest.mark.slow
def test_a_load_lets_each_weight_go_as_soon_as_it_is_packed(built_packed, monkeypatch):
    """The two forms of the weights are never all resident at once: each weight read only to be
    packed leaves memory once packed, not after the whole model is (Wan 2.1 1.3B's load peaked at
    2.2x its weights; now at what it keeps, 1.15x)."""
    from aotbuild.runtime import prepared

    path = built_packed.folder / "unet.safetensors"
    before, resident = _mapped(path), []
    prepare = prepared.prepare

    def watched(recipe, weights):  # the load's mapping of the file, as each constant is made
        made = prepare(recipe, weights)
        resident.append(sum(v for k, v in _mapped(path).items() if k not in before))
        return made

    monkeypatch.setattr(prepared, "prepare", watched)
    aotbuild.load_pipeline(built_packed.folder)
    # A tiny file is all resident at the first read (the kernel maps pages around each fault); by
    # the last constant, the weights packed before it are out (were they released after the whole
    # model, all of the file would still be there).
    assert len(resident) > 50 and resident[-1] < 0.25 * path.stat().st_size, (resident[-1], path.stat().st_size)


def test_a_frozen_compile_leaves_no_copy_of_the_weights_behind():
    """Inductor keeps the last graph it lowered alive after the compile (torch 2.13); the build
    drops its weights and frozen constants, or a UNet-only SDXL build's validation held the weights
    and their packed copies a second time (10 GiB)."""
    import gc

    from aotbuild.builder import export
    from aotbuild.builder.optimize import inductor_flags

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Flatten(),
                                 torch.nn.Linear(8 * 8 * 8, 16)).eval()
    program = torch.export.export(module, (torch.randn(1, 4, 8, 8),))
    _, recipes, _ = export.compile_variant(program, export.inductor_options({}, inductor_flags({"prepack": True})))
    assert recipes  # it froze, and packed
    gc.collect()
    graphs = [o for o in gc.get_objects() if isinstance(o, torch.fx.GraphModule)]
    assert [name for graph in graphs for name in graph._buffers if name.startswith("_frozen_param")] == []
    weights = {p.data_ptr() for p in module.parameters()}
    assert [name for graph in graphs for name, t in graph.state_dict().items() if t.data_ptr() in weights] == []


def test_a_cropped_table_is_a_recipe_too():
    """SD3's position embedding crops a stored table to the call's grid (a slice of a buffer), which
    freezing folds into a constant: its recipe slices the bound table (found building SD3.5 Medium
    at 512 px, whose compile stopped on the slice)."""
    from aotbuild.builder import export
    from aotbuild.builder.optimize import inductor_flags

    class Cropped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(1, 16, 8))
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x + self.table[:, 2:10].to(x.dtype))

    torch.manual_seed(0)
    module = Cropped().eval()
    program = torch.export.export(module, (torch.randn(1, 8, 8),))
    _, recipes, _ = export.compile_variant(program, export.inductor_options({}, inductor_flags({"prepack": True})))
    sliced = [r for r in recipes.values() if "aten.slice.Tensor" in json.dumps(r)]
    assert sliced and all(sources(r) == {"table"} for r in sliced)
    other = torch.randn(1, 16, 8)
    made = prepare(sliced[0], {"table": other})
    torch.testing.assert_close(made.reshape(-1), other[:, 2:10].reshape(-1))
    # A slice is a view at an offset of its table: made anew from a new table, never written through.
    prepared = PreparedConstants({"_frozen_param0": sliced[0]}, {"table": other}, "p.pt2")
    assert "table" in prepared.viewed
    new, before = torch.randn(1, 16, 8), other.clone()
    anew = prepared.rebind({"table": new})["_frozen_param0"]
    assert anew.untyped_storage().data_ptr() == new.untyped_storage().data_ptr() and anew.storage_offset() > 0
    torch.testing.assert_close(anew.reshape(-1), new[:, 2:10].reshape(-1))
    assert torch.equal(other, before)  # the first table untouched
    with torch.no_grad():
        new.mul_(2)  # written in place: seen through the view
    assert prepared.refresh() == {}
    torch.testing.assert_close(anew.reshape(-1), new[:, 2:10].reshape(-1))


def _rotary_grid(table: torch.Tensor) -> torch.Tensor:
    """Wan's rotary table for a grid of 2 x 3 x 4 positions, in miniature."""
    f, h, w = table.split([4, 4, 4], dim=1)
    return torch.cat([f[:2].view(2, 1, 1, -1).expand(2, 3, 4, -1), h[:3].view(1, 3, 1, -1).expand(2, 3, 4, -1),
                      w[:4].view(1, 1, 4, -1).expand(2, 3, 4, -1)], dim=-1).reshape(24, 12)


def test_a_rotary_table_split_and_concatenated_is_a_recipe_too():
    """Wan's rotary embedding splits its stored tables by axis (frames, height, width), takes each
    axis's first positions, broadcasts them over the grid and concatenates them: freezing folds it
    all into a constant, whose recipe does the same from the bound tables (found building Wan 2.1
    1.3B, whose compile stopped on the concatenation). A copy, not a view: an in-place write of a
    table remakes it."""
    from aotbuild.builder import export
    from aotbuild.builder.optimize import inductor_flags

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(16, 12))
            self.proj = torch.nn.Linear(12, 12)

        def forward(self, x):
            return self.proj(x * _rotary_grid(self.table))

    torch.manual_seed(0)
    program = torch.export.export(Rotary().eval(), (torch.randn(24, 12),))
    _, recipes, _ = export.compile_variant(program, export.inductor_options({}, inductor_flags({"prepack": True})))
    tables = [r for r in recipes.values() if sources(r) == {"table"}]
    assert len(tables) == 1 and {"aten.cat.default", "operator.getitem", "aten.expand.default"} <= \
        set(re.findall(r'"op": "([^"]+)"', json.dumps(tables[0])))
    other = torch.randn(16, 12)
    torch.testing.assert_close(prepare(tables[0], {"table": other}), _rotary_grid(other))
    prepared = PreparedConstants({"_frozen_param0": tables[0]}, {"table": other}, "p.pt2")
    assert "table" in prepared.copied
    with torch.no_grad():
        other.mul_(2)
    remade = prepared.refresh()
    assert list(remade) == ["_frozen_param0"]
    torch.testing.assert_close(remade["_frozen_param0"], _rotary_grid(other))
