"""IP-Adapters on compiled UNets (SDXL, SD 1.5): an artifact built with an adapter (a target's
`ip_adapter`) compiles its layers in and takes any adapter of that form as data: diffusers'
`load_ip_adapter`, `set_ip_adapter_scale` (a float, per-block dicts), `ip_adapter_image` and
`ip_adapter_image_embeds`, `unload_ip_adapter`. Compiled == eager with the same seeds for each,
guidance off, a LoRA beside the adapter, apply() on a pipeline holding one, SD 1.5 over a dynamic
range with a ControlNet in the same call; other forms, masks and artifacts built without an
adapter are refused in the user's terms."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

import aotbuild
from aotbuild.builder.targets import load_target, parse_target, read_target_file
from aotbuild.errors import (
    MissingAttributeError,
    ShapeNotSupportedError,
    SourceError,
    TargetError,
    UnsupportedCallError,
    WeightsMismatchError,
)
from aotbuild.runtime.sources import random_ip_adapter
from aotbuild.spec.pipelines import seeded_image

from .conftest import TARGETS, build_once, eager_pipeline, make_lora, same_as_eager

ATOL = 1e-4  # images in [0, 1]; float32 compiled vs eager differ by ~2e-6
IMAGE = seeded_image(40, 48)  # the image prompt (the feature extractor resizes it)


def run(pipe, height: int = 64, width: int = 64, **call):
    call = {"num_inference_steps": 3, "output_type": "np", "height": height, "width": width, **call}
    return pipe("a red fox in the snow", generator=torch.Generator("cpu").manual_seed(0), **call).images


def both(compiled, eager, **call):
    return same_as_eager(run, compiled, eager, ATOL, **call)


def on_both(pipes, method: str, *args, **kwargs) -> None:
    for pipe in pipes:
        getattr(pipe, method)(*args, **kwargs)


def adapter(pipe, seed: int, width: int = 32) -> dict:
    """A seeded IP-Adapter of the plain form for the pipeline's UNet (image embeddings `width` wide)."""
    return random_ip_adapter(pipe.unet, width, seed)


@functools.cache
def _target(name: str):
    return load_target(TARGETS / f"{name}.toml")


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """(build, target) of the tiny SDXL artifact built with an IP-Adapter."""
    target = _target("cpu-tiny-sdxl-ip-adapter")
    return build_once(tmp_path_factory, target), target


@pytest.mark.slow
def test_scales_images_and_embeddings_match_eager(sdxl):
    """The adapter the target names, loaded by load_pipeline as the build loaded it: the default
    call, a scale, per-block scales, scale 0, guidance off, embeddings given instead of an image;
    the adapter changes the image (the test would see one that did nothing)."""
    built, target = sdxl
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(target)
    pipes = (compiled, eager)
    with_image = both(compiled, eager, ip_adapter_image=IMAGE)
    on_both(pipes, "set_ip_adapter_scale", 0.5)
    both(compiled, eager, ip_adapter_image=IMAGE)
    on_both(pipes, "set_ip_adapter_scale", {"up": {"block_0": [0.0, 1.0]}})  # one layer of one block
    both(compiled, eager, ip_adapter_image=IMAGE)
    on_both(pipes, "set_ip_adapter_scale", 0.0)
    without = both(compiled, eager, ip_adapter_image=IMAGE)
    assert np.abs(with_image - without).max() > 0.05  # the adapter steers the image
    on_both(pipes, "set_ip_adapter_scale", 1.0)
    both(compiled, eager, ip_adapter_image=IMAGE, guidance_scale=1.0)
    embeds = eager.prepare_ip_adapter_image_embeds(IMAGE, None, "cpu", 1, True)
    np.testing.assert_allclose(both(compiled, eager, ip_adapter_image_embeds=embeds), with_image, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_unload_another_adapter_and_none(sdxl):
    """`unload_ip_adapter()` gives the base UNet's images exactly as eager does; another adapter
    of the same form loads as data (no compile); `load_pipeline(ip_adapter=False)` starts with none,
    and a pipeline with an adapter loaded refuses a call without its image as eager does."""
    built, target = sdxl
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(target)
    pipes = (compiled, eager)
    with pytest.raises(ValueError, match="requires the keyword argument `image_embeds`"):
        run(eager)
    with pytest.raises(ValueError, match=r"unet: an IP-Adapter is loaded and this call gives it no image "
                                         r"\(ip_adapter_image or ip_adapter_image_embeds\)"):
        run(compiled)
    on_both(pipes, "unload_ip_adapter")
    assert compiled.unet.encoder_hid_proj is None and compiled.image_encoder is None
    base = both(compiled, eager)
    np.testing.assert_allclose(run(aotbuild.load_pipeline(built.folder, ip_adapter=False)), base, atol=ATOL, rtol=0)
    encoder = eager_pipeline(target).image_encoder
    for pipe in pipes:
        pipe.register_modules(image_encoder=encoder)
        pipe.load_ip_adapter(adapter(eager, 7), subfolder="", weight_name="")
    other = both(compiled, eager, ip_adapter_image=IMAGE)
    assert np.abs(other - base).max() > 0.05


@pytest.mark.slow
def test_other_forms_and_masks_are_refused(sdxl):
    """An adapter taking wider image embeddings, or two adapters, on a one-adapter artifact: refused
    naming both forms, the loaded adapter kept; IP-Adapter masks are refused by name."""
    built, target = sdxl
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(target)
    before = run(compiled, ip_adapter_image=IMAGE)
    with pytest.raises(WeightsMismatchError, match=r"this artifact takes 1 IP-Adapter: ImageProjection \(4 image "
                       r"tokens from 32-wide image embeddings\); the IP-Adapter given is 1 IP-Adapter: "
                       r"ImageProjection \(4 image tokens from 48-wide image embeddings\).*the unet keeps the "
                       r"adapter it had"):
        compiled.load_ip_adapter(adapter(eager, 3, width=48), subfolder="", weight_name="")
    with pytest.raises(WeightsMismatchError, match="the IP-Adapter given is 2 IP-Adapters"):
        compiled.load_ip_adapter([adapter(eager, 3), adapter(eager, 4)], subfolder=["", ""], weight_name=["", ""])
    np.testing.assert_array_equal(run(compiled, ip_adapter_image=IMAGE), before)
    with pytest.raises(UnsupportedCallError, match="IP-Adapter 0 is given 2 images in this call; this artifact "
                                                   "takes 1 per IP-Adapter"):
        run(compiled, ip_adapter_image=[[IMAGE, IMAGE]])
    with pytest.raises(UnsupportedCallError, match=r"set_attn_processor\(\): the compiled attention"):
        compiled.unet.set_attn_processor(eager.unet.attn_processors)
    np.testing.assert_array_equal(run(compiled, ip_adapter_image=IMAGE), before)
    mask = torch.ones(1, 1, 64, 64)
    with pytest.raises(ShapeNotSupportedError, match=r"ip_adapter_masks.0. is not an input of the compiled unet "
                                                     r"\(IP-Adapter masks is not compiled\)"):
        run(compiled, ip_adapter_image=IMAGE, cross_attention_kwargs={"ip_adapter_masks": [mask]})


@pytest.mark.slow
def test_apply_takes_the_pipelines_adapter_and_a_lora_beside_it(sdxl, tmp_path):
    """apply() on a pipeline holding an IP-Adapter at a scale: its weights and scale, bound; a LoRA
    loaded beside the adapter: both as eager has them."""
    built, target = sdxl
    eager = eager_pipeline(target)
    eager.unload_ip_adapter()
    eager.register_modules(image_encoder=eager_pipeline(target).image_encoder)
    eager.load_ip_adapter(adapter(eager, 11), subfolder="", weight_name="")
    eager.set_ip_adapter_scale(0.6)
    want = run(eager, ip_adapter_image=IMAGE)
    pipe = eager_pipeline(target)
    pipe.unload_ip_adapter()
    pipe.register_modules(image_encoder=eager.image_encoder)
    pipe.load_ip_adapter(adapter(eager, 11), subfolder="", weight_name="")
    pipe.set_ip_adapter_scale(0.6)
    aotbuild.apply(pipe, built.folder)
    np.testing.assert_allclose(run(pipe, ip_adapter_image=IMAGE), want, atol=ATOL, rtol=0)
    lora = make_lora(eager, tmp_path, seed=5)
    on_both((pipe, eager), "load_lora_weights", lora, adapter_name="style")
    both(pipe, eager, ip_adapter_image=IMAGE)


@pytest.mark.slow
def test_the_eager_fallback_and_a_changed_adapter_are_refused(sdxl):
    """With an adapter loaded, a call no variant covers is refused rather than run by the eager module
    (which does not follow the compiled adapter state); the adapter a target names, holding other
    weights than the artifact was built with, is refused at load and left unloaded."""
    from aotbuild.runtime.load import load_built_ip_adapter

    built, target = sdxl
    pipe = eager_pipeline(target)
    aotbuild.apply(pipe, built.folder, eager_fallback=True)
    with pytest.raises(ShapeNotSupportedError, match="the eager fallback cannot run this unet's weights: the "
                                                     "IP-Adapter state is the compiled model's"):
        run(pipe, height=96, width=96, ip_adapter_image=IMAGE)
    compiled = aotbuild.load_pipeline(built.folder, ip_adapter=False)
    compiled.register_modules(image_encoder=pipe.image_encoder)
    with pytest.raises(SourceError, match="holds other weights now than this artifact was built with"):
        load_built_ip_adapter(compiled, {**target.to_dict(), "seed": 5}, TARGETS)
    assert compiled.unet.encoder_hid_proj is None


@pytest.mark.slow
def test_sd15_with_a_controlnet_over_its_dynamic_range(tmp_path_factory):
    """SD 1.5's ControlNet pipeline built with an IP-Adapter: an image prompt and a control image
    in one call, at sizes and batches of the dynamic range; the plain pipeline (from_pipe) with the
    adapter and without a ControlNet."""
    import diffusers

    target = _target("cpu-tiny-sd15-controlnet")
    built = build_once(tmp_path_factory, target)
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(target)
    both(compiled, eager, height=96, width=32, num_images_per_prompt=2, ip_adapter_image=IMAGE,
         image=seeded_image(96, 32))
    on_both((compiled, eager), "set_ip_adapter_scale", 0.3)
    both(compiled, eager, height=48, width=80, ip_adapter_image=IMAGE, image=seeded_image(48, 80))
    plain = [diffusers.StableDiffusionPipeline.from_pipe(p) for p in (compiled, eager)]
    both(*plain, ip_adapter_image=IMAGE)


@pytest.mark.slow
def test_artifacts_without_an_adapter_refuse_one(tmp_path_factory):
    """`load_ip_adapter` on an artifact built without an IP-Adapter names the target key to build with."""
    target = _target("cpu-tiny-sdxl-controlnet")
    compiled = aotbuild.load_pipeline(build_once(tmp_path_factory, target).folder)
    with pytest.raises(MissingAttributeError, match="(?s)this artifact takes no IP-Adapter.*ip_adapter = "):
        compiled.load_ip_adapter(adapter(eager_pipeline(_target("cpu-tiny-sdxl-ip-adapter")), 1),
                                 subfolder="", weight_name="", image_encoder_folder=None)


@pytest.mark.parametrize(("change", "message"), [
    ({"pipeline": "StableDiffusion3Pipeline", "source": "random:tiny-sd3", "components": {"transformer": {}}},
     "StableDiffusion3Pipeline is not a pipeline whose IP-Adapter aotbuild compiles"),
    ({"pipeline": "FluxControlNetPipeline", "source": "random:tiny-flux-controlnet",
      "components": {"transformer": {}, "controlnet": {}}}, "passes the image embeddings to its ControlNet too"),
    ({"optimize": {"fuse_qkv": True}}, "not compiled with the fuse_qkv pass"),
    ({"compile": {"mode": "regional"}}, "not compiled with regional compilation"),
])
def test_targets_refuse_what_an_adapter_cannot_be_built_with(change, message):
    path = TARGETS / "cpu-tiny-sdxl-ip-adapter.toml"
    raw = {**read_target_file(path), **change}
    with pytest.raises(TargetError, match=message):
        parse_target(raw, str(path), TARGETS)


def test_a_hub_adapter_is_named_as_load_ip_adapter_takes_it(tmp_path):
    from aotbuild.errors import SourceError
    from aotbuild.runtime.sources import ip_adapter_arguments

    assert ip_adapter_arguments("h94/IP-Adapter/sdxl_models/ip-adapter_sdxl.safetensors@v1", tmp_path) == {
        "pretrained_model_name_or_path_or_dict": "h94/IP-Adapter", "subfolder": "sdxl_models",
        "weight_name": "ip-adapter_sdxl.safetensors", "revision": "v1"}
    (tmp_path / "mine.safetensors").write_bytes(b"")
    assert ip_adapter_arguments("mine.safetensors", tmp_path)["weight_name"] == "mine.safetensors"
    with pytest.raises(SourceError, match="neither a weights file on this machine nor one in a Hub repo"):
        ip_adapter_arguments("h94/IP-Adapter", tmp_path)
    assert dataclasses.replace(_target("cpu-tiny-sdxl-ip-adapter")).to_dict()["ip_adapter"] == "random"


@pytest.mark.slow
def test_flux_adapter_calls_match_eager(tmp_path_factory):
    """Flux's IP-Adapter (XLabs' form: to_k_ip/to_v_ip with biases in each double-stream block): the
    default call, a scale per layer, true CFG with a negative image prompt, a call without an image
    refused (eager fails it), unloading, another adapter as data, another form refused."""
    target = _target("cpu-tiny-flux-ip-adapter")
    built = build_once(tmp_path_factory, target)
    compiled, eager = aotbuild.load_pipeline(built.folder), eager_pipeline(target)
    pipes = (compiled, eager)
    with_image = both(compiled, eager, ip_adapter_image=IMAGE)
    with pytest.raises(TypeError):  # eager's processors, given no image tokens
        run(eager)
    with pytest.raises(ValueError, match="transformer: an IP-Adapter is loaded and this call gives it no image"):
        run(compiled)
    on_both(pipes, "set_ip_adapter_scale", [[0.4]])  # one scale per double-stream layer (the tiny model has one)
    both(compiled, eager, ip_adapter_image=IMAGE)
    both(compiled, eager, ip_adapter_image=IMAGE, negative_ip_adapter_image=seeded_image(32, 32),
         negative_prompt="blurry", true_cfg_scale=2.0)
    on_both(pipes, "unload_ip_adapter")
    base = both(compiled, eager)
    assert np.abs(with_image - base).max() > 0.05
    encoder = eager_pipeline(target).image_encoder
    for pipe in pipes:
        pipe.register_modules(image_encoder=encoder)
        pipe.load_ip_adapter(random_ip_adapter(eager.transformer, 32, 9), weight_name="")
    both(compiled, eager, ip_adapter_image=IMAGE)
    with pytest.raises(WeightsMismatchError, match="the IP-Adapter given is 1 IP-Adapter: ImageProjection "
                                                   r"\(4 image tokens from 48-wide image embeddings\)"):
        compiled.load_ip_adapter(random_ip_adapter(eager.transformer, 48, 9), weight_name="")


def test_a_targets_image_encoder_comes_from_its_own_source(tmp_path):
    """`image_encoder = FOLDER` (or a Hub repo): the encoder an adapter's repo lacks (XLabs' Flux one),
    loaded beside a source whose pipeline has none; the key needs an ip_adapter."""
    from aotbuild.builder.capturing import load_source_pipeline
    from aotbuild.spec.pipelines import pipeline_spec

    eager_pipeline(_target("cpu-tiny-sdxl-ip-adapter")).image_encoder.save_pretrained(tmp_path / "clip")
    path = TARGETS / "cpu-tiny-sdxl-ip-adapter.toml"
    raw = {**read_target_file(path), "source": "random:tiny-sdxl", "image_encoder": str(tmp_path / "clip")}
    target = parse_target(raw, str(path), TARGETS)
    pipe = load_source_pipeline(target, pipeline_spec(target.pipeline), torch.device("cpu"))
    assert type(pipe.image_encoder).__name__ == "CLIPVisionModelWithProjection"
    assert len(pipe.unet.encoder_hid_proj.image_projection_layers) == 1
    with pytest.raises(TargetError, match="key 'image_encoder' is the IP-Adapter's, and the target names none"):
        parse_target({k: v for k, v in raw.items() if k != "ip_adapter"}, str(path), TARGETS)


@pytest.mark.slow
def test_another_checkpoint_takes_the_targets_adapter(sdxl, tmp_path):
    """load_pipeline(weights=<a fine-tune holding no adapter>): the fine-tune's UNet with the adapter
    the target names (the adapter's constants are not looked for in the checkpoint)."""
    built, target = sdxl
    reference = eager_pipeline(target, seed=3)
    encoder, extractor = reference.image_encoder, reference.feature_extractor
    reference.unload_ip_adapter()
    reference.register_modules(image_encoder=encoder, feature_extractor=extractor)
    reference.save_pretrained(tmp_path / "finetune")
    reference.load_ip_adapter(adapter(reference, target.seed), subfolder="", weight_name="")
    both(aotbuild.load_pipeline(built.folder, weights=tmp_path / "finetune"), reference, ip_adapter_image=IMAGE)
