"""The recorded passes replayed on other weights (no compile): fused QKV rows, layouts, dtypes and
torchao's int8 scheme re-implemented bit for bit; the small parsers of the LoRA path."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from safetensors.torch import save_file

from aotbuild.errors import AotbuildError, IncompatibleArtifactError
from aotbuild.generation.backends import parse_lora
from aotbuild.runtime.checkpoint import checkpoint_constants, module_tensors
from aotbuild.runtime.lora import pop_scale
from aotbuild.spec.recipes import FUSED_PROJECTIONS, dequantize_int8, int8_per_row

from .conftest import ROOT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_scheme_is_torchaos_bit_for_bit(dtype):
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    weight = torch.randn(96, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    weight[3] = 0  # the eps floor of an all-zero row
    weight[5, 7] = 1e4  # one outlier sets its row's scale
    reference = Int8Tensor.from_hp(weight, granularity=PerRow())
    data, scale = int8_per_row(weight)
    assert torch.equal(data, reference.qdata) and torch.equal(scale, reference.scale)
    assert data.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (96, 1)
    back = dequantize_int8(data, scale, torch.float32)
    assert ((back - weight.float()).abs() <= scale * 0.501).all()  # half a step (a clamped 127.5: exactly half)


def _attention():
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    return Attention(query_dim=16, heads=2, dim_head=8, bias=True).eval()


def test_fused_rows_layouts_and_dtypes_from_unfused_weights():
    attention = _attention()
    fused = copy.deepcopy(attention)
    fused.fuse_projections()
    fused.to(torch.bfloat16)
    expected = {k: v for k, v in module_tensors(fused).items() if ".to_q." not in f".{k}" and ".to_k." not in f".{k}"
                and ".to_v." not in f".{k}"}
    assert "to_qkv.weight" in expected and "to_q.weight" not in expected
    got = checkpoint_constants("attn", module_tensors(attention), expected, torch.bfloat16, None, torch.device("cpu"))
    assert set(got) == set(expected)
    for fqn, tensor in expected.items():
        assert torch.equal(got[fqn], tensor) and got[fqn].dtype == torch.bfloat16, fqn

    conv = torch.nn.Conv2d(4, 8, 3)
    nhwc = {k: v.contiguous(memory_format=torch.channels_last) if v.ndim == 4 else v
            for k, v in module_tensors(conv).items()}
    got = checkpoint_constants("conv", module_tensors(conv), nhwc, torch.float32, None, torch.device("cpu"))
    assert got["weight"].stride() == nhwc["weight"].stride() and torch.equal(got["weight"], conv.weight)
    assert got["bias"].data_ptr() == conv.bias.data_ptr()  # nothing to change: bound as it is


def test_another_architecture_names_the_first_difference():
    attention, other = _attention(), _attention()
    other.to_out[0] = torch.nn.Linear(16, 12)
    expected = module_tensors(attention)
    with pytest.raises(IncompatibleArtifactError, match=r"attn: tensor 'to_out.0.weight' is \[12, 16\] float32 in "
                       r"the weights; the compiled code reads \[16, 16\] float32"):
        checkpoint_constants("attn", module_tensors(other), expected, torch.float32, None, torch.device("cpu"))
    with pytest.raises(IncompatibleArtifactError, match=r"attn: the weights have no tensor 'to_q.weight'"):
        checkpoint_constants("attn", {k: v for k, v in expected.items() if k != "to_q.weight"}, expected,
                             torch.float32, None, torch.device("cpu"))


def test_a_config_key_is_compiled_unless_decided_otherwise():
    """A checkpoint's config: keys no compiled code reads are the checkpoint's; any other key,
    undecided ones included, must hold the artifact's value; what a config says of itself (its
    diffusers version, its folder) is never compared; a key one side lacks is the class default."""
    import diffusers

    from aotbuild.runtime.checkpoint import checkpoint_config
    from aotbuild.spec.pipelines import COMPILED_AT_DTYPE, COMPILED_VAES, VAE_DECODER, runtime_config_keys

    keys = {k for name in COMPILED_VAES for k in inspect.signature(getattr(diffusers, name).__init__).parameters}
    assert set(VAE_DECODER.runtime_config) <= keys  # every decided key is one a compiled VAE has
    vae = diffusers.AutoencoderKL
    recorded = {"_class_name": "AutoencoderKL", "block_out_channels": [32, 64],
                "scaling_factor": 0.13025, "_diffusers_version": "0.41.0"}
    given = {"block_out_channels": (32, 64), "scaling_factor": 0.3, "_diffusers_version": "0.42.1",
             "_name_or_path": "/data/finetune/vae", "act_fn": "silu"}  # act_fn: the class default, absent above
    runtime = runtime_config_keys(VAE_DECODER, "bfloat16")
    assert checkpoint_config("vae_decoder", recorded, given, vae, runtime)["scaling_factor"] == 0.3
    with pytest.raises(IncompatibleArtifactError, match=r"^vae_decoder: the weights' config differs from the "
                       r"artifact's in 'norm_num_groups' \(16 in the weights, 32 in the artifact\)"):
        checkpoint_config("vae_decoder", recorded, {**given, "norm_num_groups": 16}, vae, runtime)
    with pytest.raises(IncompatibleArtifactError, match=r"in '_class_name' \(\"AutoencoderKLFlux2\" in the weights"):
        checkpoint_config("vae_decoder", recorded, given, diffusers.AutoencoderKLFlux2, runtime)
    assert "force_upcast" in COMPILED_AT_DTYPE["float16"] and "force_upcast" not in runtime_config_keys(
        VAE_DECODER, "float16")  # a float16 target keeps such a VAE in float32: compiled
    with pytest.raises(IncompatibleArtifactError, match=r"in 'force_upcast' \(false in the weights, true"):
        checkpoint_config("vae_decoder", {**recorded, "force_upcast": True}, {**given, "force_upcast": False}, vae,
                          runtime_config_keys(VAE_DECODER, "float16"))


def test_parse_lora_and_the_per_call_scale(tmp_path, monkeypatch):
    ink = tmp_path / "styles" / "ink.safetensors"
    ink.parent.mkdir()
    save_file({"unet.down_blocks.0.attentions.0.to_q.lora_A.weight": torch.zeros(2, 8)}, ink)
    assert parse_lora(str(ink)) == (str(ink), 1.0)
    assert parse_lora(f"{ink}:0.6") == (str(ink), 0.6)
    assert parse_lora("org/lora-repo:1.5") == ("org/lora-repo", 1.5)  # a Hub id: diffusers resolves it
    monkeypatch.setenv("HOME", str(tmp_path))  # `~` is expanded for diffusers, which would take it for a Hub id
    assert parse_lora("~/styles/ink.safetensors:0.5") == (str(ink), 0.5)
    with pytest.raises(AotbuildError, match=r"--lora .*ink.safetensors:abc: the adapter weight 'abc' after ':' is "
                                            r"not a number") as raised:
        parse_lora(f"{ink}:abc")
    assert raised.value.hint == "give PATH or PATH:WEIGHT, e.g. ink.safetensors:0.7"
    for missing in ("ink.safetensors:0.7", "org/ink.safetensors", "./styles/ink", str(tmp_path / "none")):
        with pytest.raises(AotbuildError, match=r"--lora .*: no such file or folder"):  # before any network
            parse_lora(missing)
    kwargs = {"cross_attention_kwargs": {"scale": 0.3}, "joint_attention_kwargs": {"scale": 0.5, "other": 1}}
    assert pop_scale(kwargs, traced={"cross_attention_kwargs"}) == 0.5
    assert kwargs == {"cross_attention_kwargs": None, "joint_attention_kwargs": {"other": 1}}
    kwargs = {"joint_attention_kwargs": {"scale": 0.2}}
    assert pop_scale(kwargs, traced=set()) == 0.2 and kwargs == {"joint_attention_kwargs": {}}  # Flux passes {}


def test_a_file_that_is_not_a_lora_is_named_for_what_it_is(tmp_path):
    """A UNet's weights, a picture or an empty file given as --lora: said in words before anything
    loads, with what a LoRA file looks like; LoRAs of each naming pass."""
    from PIL import Image

    unet = tmp_path / "unet.safetensors"
    save_file({"down_blocks.0.resnets.0.conv1.weight": torch.zeros(2, 2), "conv_in.weight": torch.zeros(2)}, unet)
    Image.new("RGB", (32, 16)).save(tmp_path / "fox.png")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "notes.safetensors").write_text("not tensors")
    for name, words in (("unet.safetensors", "it holds a model's own weights (2 tensors such as 'conv_in.weight'), "
                                             "not low-rank pairs; a fine-tuned checkpoint goes to --weights"),
                        ("fox.png", "a PNG 32x16 image"), ("empty.safetensors", "an empty file"),
                        ("notes.safetensors", "not a safetensors file (no safetensors header at its start)")):
        with pytest.raises(AotbuildError) as raised:
            parse_lora(str(tmp_path / name))
        assert raised.value.message.startswith(f"--lora {tmp_path / name}: not a LoRA: {words}")
        assert raised.value.hint.startswith("a LoRA is a .safetensors file of low-rank weight pairs")
    for key in ("lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight", "transformer.x.lora_B.weight",
                "lycoris_unet_x.hada_w1_a"):
        save_file({key: torch.zeros(2, 2)}, tmp_path / "style.safetensors")
        assert parse_lora(str(tmp_path / "style.safetensors")) == (str(tmp_path / "style.safetensors"), 1.0)


def test_quantized_constants_are_made_with_the_recipes_scheme():
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    data, scale = int8_per_row(weight)
    expected = {"proj.parametrizations.weight.original0": data, "proj.parametrizations.weight.original1": scale}
    got = checkpoint_constants("unet", {"proj.weight": weight}, expected, torch.float32, "int8_dynamic",
                               torch.device("cpu"))
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    with pytest.raises(AotbuildError, match=r"unet: this artifact's weights are quantized with the 'float8_dynamic' "
                       r"recipe, which aotbuild can only build, not redo at load"):
        checkpoint_constants("unet", {"proj.weight": weight}, expected, torch.float32, "float8_dynamic",
                             torch.device("cpu"))


def test_the_runtime_imports_no_lora_or_build_code():
    import subprocess
    import sys

    code = ("import sys, aotbuild.runtime as r; [getattr(r, name) for name in r.__all__]; print(sorted(m for m in "
            "('peft', 'diffusers', 'torchao', 'aotbuild.builder', 'torch._dynamo') if m in sys.modules), "
            "'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout == "[] True\n"


# aotbuild/ has a folder per layer and per tool; each imports only from the folders below it,
# anywhere in a file (lazy imports inside functions too): what the runtime imports decides cold
# start and what a serving machine installs, and serving carries no benchmark. `aotbuild` itself
# (the package root: errors and `__version__`) is below everything.
LAYERS = {
    "errors": set(),
    "spec": {"errors"},
    "runtime": {"errors", "spec"},
    "builder": {"errors", "spec", "runtime"},
    "generation": {"errors", "spec", "runtime", "builder"},
    "fleet": {"errors", "spec", "runtime", "builder"},
    "serving": {"errors", "spec", "runtime", "builder", "generation", "fleet"},
    "benchmarking": {"errors", "spec", "runtime", "builder", "generation", "fleet", "serving"},
    "cli": {"errors", "spec", "runtime", "builder", "generation", "fleet", "serving", "benchmarking"},
}


def _layer(module: str) -> str:
    """The layer of `aotbuild.x.y` (a folder, or one of the top-level modules `errors` and `cli`)."""
    return module.split(".")[1] if module.count(".") else "root"


def _is_module(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _from_imports(path):
    """(line, module, names) of each `from aotbuild... import names` in a source file, anywhere in
    it (top level or inside functions), relative imports resolved."""
    import ast

    package = path.parent.relative_to(ROOT).parts  # ("aotbuild",) or ("aotbuild", "runtime")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("aotbuild")):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, *(node.module.split(".") if node.module else ())))
            yield node.lineno, module, [alias.name for alias in node.names]


def _imported(path) -> set[str]:
    """The aotbuild modules a source file imports anywhere in it (top level or inside functions)."""
    import ast

    found = set()
    for _, module, names in _from_imports(path):
        # `from . import capture` imports a module; `from .. import __version__` a name: count its package
        found |= {f"{module}.{name}" if _is_module(f"{module}.{name}") else module for name in names}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("aotbuild")}
    return found


def test_each_layer_imports_only_from_the_layers_below_it():
    files = sorted((ROOT / "aotbuild").rglob("*.py"))
    modules = {path: ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for path in files}
    unplaced = {str(path.relative_to(ROOT)) for path, module in modules.items()
                if _layer(module) not in LAYERS and module != "aotbuild"}
    assert unplaced == set(), "a new folder or top-level module needs its row in LAYERS"
    crossing = {f"{path.relative_to(ROOT)} imports {imported}" for path, module in modules.items()
                if module != "aotbuild" for imported in _imported(path)
                if _layer(imported) not in {*LAYERS[_layer(module)], _layer(module), "root"}}
    assert crossing == set()
    assert "aotbuild.spec.recipes" in _imported(ROOT / "aotbuild" / "runtime" / "checkpoint.py")  # it sees imports
    assert {_layer(module) for module in modules.values()} == {*LAYERS, "root"}  # every folder is read


def test_every_import_of_an_aotbuild_name_resolves():
    """An import inside a function runs only when the function does: one naming a module or a name
    that is not there (left behind by a move) fails here, not in a user's call."""
    import importlib
    import importlib.util

    missing = []
    for path in sorted((ROOT / "aotbuild").rglob("*.py")):
        for line, module, names in _from_imports(path):
            try:
                found = importlib.import_module(module)
            except ImportError as exc:
                missing.append(f"{path.relative_to(ROOT)}:{line} {module}: {exc}")
                continue
            missing += [f"{path.relative_to(ROOT)}:{line} {module}.{name}" for name in names
                        if not hasattr(found, name) and importlib.util.find_spec(f"{module}.{name}") is None]
    assert missing == []


def _private_names(path) -> list[str]:
    """Private names of torch, Ray and diffusers a source file imports or reaches by attribute."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            names = [f"{getattr(root, 'id', '?')}...{node.attr}"]
        else:
            continue
        found += [name for name in names if name.split(".")[0] in ("torch", "ray", "diffusers", "DiffusionPipeline")
                  and any(part.startswith("_") and not part.startswith("__") for part in name.split("."))]
    return found


def test_private_apis_are_reached_from_one_module():
    """torch's, Ray's and diffusers' private names are used in `aotbuild/spec/private_apis.py` only."""
    reaching = {f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / "aotbuild").rglob("*.py"))
                if path.name != "private_apis.py" for name in _private_names(path)}
    assert reaching == set()
    assert "torch.utils._pytree" in _private_names(ROOT / "aotbuild" / "spec" / "private_apis.py")  # the walk sees them


@pytest.mark.parametrize(("target_name", "fused_kinds"), [
    ("cpu-tiny-sdxl", {"to_qkv", "to_kv"}),         # self-attention, and cross-attention's k/v
    ("cpu-tiny-sd3", {"to_qkv", "to_added_qkv"}),   # joint attention's context projections
])
def test_lora_rows_land_where_fuse_qkv_put_their_projections(target_name, fused_kinds, tmp_path):
    """The merge into fused projections (no compile): the LoRA state's bound constants equal eager
    diffusers' own result of fusing the LoRA, then fusing QKV."""
    from aotbuild.builder.targets import load_target
    from aotbuild.runtime.lora import LoraState

    from .conftest import TARGETS, eager_pipeline, make_lora

    pipe = eager_pipeline(load_target(TARGETS / f"{target_name}.toml"))
    attribute = "unet" if hasattr(pipe, "unet") else "transformer"
    model = getattr(pipe, attribute)
    lora = make_lora(pipe, tmp_path / "A", seed=1)
    fused = copy.deepcopy(model)
    fused.fuse_qkv_projections()
    base = module_tensors(fused)
    base = {k: v for k, v in base.items()  # what an artifact stores: the members fuse_qkv replaced are gone
            if not any(k.endswith(f".{m}.{kind}") and f"{k.rsplit('.', 2)[0]}.{fuse}.{kind}" in base
                       for fuse, members in FUSED_PROJECTIONS.items() for m in members for kind in ("weight", "bias"))}
    bound: dict[str, torch.Tensor] = {}
    state = LoraState(dict(model.config), torch.float32, torch.device("cpu"), base, bound.update)
    state.load(lora, prefix=attribute, adapter_name="A")
    state.sync(1.0)

    model.load_lora_adapter(lora, prefix=attribute, adapter_name="A")
    model.fuse_lora()
    model.unload_lora()
    model.fuse_qkv_projections()
    expected = module_tensors(model)
    assert {k.rsplit(".", 2)[1] for k in bound} >= fused_kinds
    for fqn, tensor in bound.items():
        torch.testing.assert_close(tensor, expected[fqn], atol=1e-6, rtol=1e-5, msg=fqn)
        assert not torch.equal(tensor, base[fqn]), fqn
