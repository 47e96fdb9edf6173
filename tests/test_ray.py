"""Scale-out on a real local Ray (started once for the session, the machine's 2 CPUs): the build
matrix as Ray tasks into a shared folder and pushed to the test Hub, and Ray Serve replicas of the
tiny SDXL artifact answering HTTP requests with the images `aotbuild run` makes."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import save_file

from aotbuild.builder.targets import load_target
from aotbuild.cli import main
from aotbuild.errors import AotbuildError, RequestError, UntrustedCodeError
from aotbuild.serving.client import request
from aotbuild.serving.schema import REQUEST_FIELDS, parse_request

from .conftest import ROOT, TARGETS, build_once, eager_pipeline, make_lora
from .hubserver import FakeHub

TOKEN = "hf_aotbuildRayTestToken42"
DEFAULTS = {"steps": 4, "seed": 0, "height": 64, "width": 64, "batch": 2, "guidance_scale": 5.0}
LATENCIES: dict[str, list[float]] = {}  # request kind -> seconds, printed at the end of the module


# --- requests, checked without Ray ---------------------------------------------------------------

def test_request_defaults_and_fields():
    import base64

    from aotbuild.generation.media import png_bytes

    call = parse_request({"prompt": "a fox"}, DEFAULTS)
    assert call == {"prompt": "a fox", "negative_prompt": None, "steps": 4, "guidance_scale": 5.0, "height": 64,
                    "width": 64, "seed": 0, "images": 1, "frames": None, "output": "png", "lora": None,
                    "lora_scale": None, "image": None, "mask": None, "strength": None, "weights": None,
                    "ip_adapter_image": None}
    prompted = {**DEFAULTS, "image_prompt": True}  # an artifact built with an IP-Adapter
    picture = base64.b64encode(png_bytes(Image.new("RGB", (8, 8), "red"))).decode()
    assert parse_request({"prompt": "a fox", "ip_adapter_image": picture}, prompted)["ip_adapter_image"].size == (8, 8)
    for body, defaults, words in (({"prompt": "a fox"}, prompted, "field 'ip_adapter_image' is required: this "
                                   "artifact is built with an IP-Adapter"),
                                  ({"prompt": "a fox", "ip_adapter_image": picture}, DEFAULTS,
                                   "field 'ip_adapter_image': this artifact is built without an IP-Adapter")):
        with pytest.raises(RequestError, match=words):
            parse_request(body, defaults)
    adapters = {"ink": 0.8}  # the LoRAs the server was started with, and their default weights
    assert {k: parse_request({"prompt": "a fox", "lora": "ink"}, DEFAULTS, adapters=adapters)[k]
            for k in ("lora", "lora_scale")} == {"lora": "ink", "lora_scale": 0.8}
    assert parse_request({"prompt": "a fox", "lora": "ink", "lora_scale": -1}, DEFAULTS,
                         adapters=adapters)["lora_scale"] == -1.0
    call = parse_request({"prompt": "a fox", "images": 3, "output": "json", "guidance_scale": 1}, {**DEFAULTS})
    assert (call["images"], call["output"], call["guidance_scale"]) == (3, "json", 1.0)
    video = {**DEFAULTS, "frames": 9}  # an artifact that makes videos: its first bucket's frames, one MP4
    assert {k: parse_request({"prompt": "a fox"}, video)[k] for k in ("frames", "output")} == {"frames": 9,
                                                                                              "output": "mp4"}
    assert parse_request({"prompt": "a fox", "frames": 5, "images": 2, "output": "json"}, video)["frames"] == 5
    for body, words in (({"prompt": "a fox", "output": "png"}, 'field \'output\' is "mp4" or "json", got "png"'),
                        ({"prompt": "a fox", "images": 2}, '"output": "mp4" returns one video; ask "output": "json"'),
                        ({"prompt": "a fox", "frames": 0}, "field 'frames' is 0; this server takes at least 1")):
        with pytest.raises(RequestError, match=re.escape(words)):
            parse_request(body, video)


@pytest.mark.parametrize("body, status, words", [
    ([], 400, "must be a JSON object"),
    ({"prompt": "a fox", "num_inference_steps": 4}, 400, "unknown field 'num_inference_steps'; the fields are: "
                                                          + ", ".join(REQUEST_FIELDS)),
    ({"steps": 2}, 400, "field 'prompt' is required"),
    ({"prompt": "a fox", "steps": 500}, 400, "field 'steps' is 500; this server takes 1 to 50"),
    ({"prompt": "a fox", "steps": "4"}, 400, "field 'steps' must be an integer, got \"4\""),
    ({"prompt": "a fox", "height": True}, 400, "field 'height' must be an integer, got true"),
    ({"prompt": "a fox", "images": 9}, 400, "field 'images' is 9; this server takes 1 to 4"),
    ({"prompt": "a fox", "images": 2}, 400, '"output": "png" returns one image; ask "output": "json" for 2'),
    ({"prompt": "a fox", "guidance_scale": -1}, 400, "field 'guidance_scale' must be a finite number >= 0"),
    ({"prompt": "a fox", "output": "gif"}, 400, "field 'output' is \"png\" or \"json\""),
    ({"prompt": "a fox", "frames": 9}, 400, "field 'frames': this artifact makes images, not videos"),
])
def test_bad_requests_are_named(body, status, words):
    with pytest.raises(RequestError) as info:
        parse_request(body, DEFAULTS)
    assert info.value.status == status
    assert words in str(info.value)


def test_openai_requests_become_the_servers_own():
    from aotbuild.serving.openai_api import openai_request

    body = {"model": "dall-e-3", "prompt": "a fox", "n": 2, "size": "96x64", "response_format": "b64_json",
            "user": "u1", "seed": 3, "lora": "ink"}
    request, names = openai_request(body)
    assert request == {"prompt": "a fox", "images": 2, "width": 96, "height": 64, "seed": 3, "lora": "ink",
                       "output": "json"}
    with pytest.raises(RequestError, match="field 'n' is 9; this server takes 1 to 4"):
        parse_request({**request, "images": 9}, DEFAULTS, names=names, adapters={"ink": 1.0})
    with pytest.raises(RequestError, match="field 'size' is height 0; this server takes at least 1"):
        parse_request({**request, "height": 0}, DEFAULTS, names=names, adapters={"ink": 1.0})
    for asked, words in (({"prompt": "a fox", "size": "96 x 64"}, 'field \'size\' is "96 x 64"; give "WIDTHxHEIGHT"'),
                         ({"prompt": "a fox", "response_format": "url"}, "returns images in the response only"),
                         ({"prompt": "a fox", "model": 3}, "field 'model' must be a string"),
                         ({"prompt": "a fox", "image": "..."}, "/v1/images/generations makes images from text")):
        with pytest.raises(RequestError, match=re.escape(words)):
            openai_request(asked)
    with pytest.raises(RequestError, match="field 'image' is required at /v1/images/edits"):
        openai_request({"prompt": "a fox"}, edits=True)


def test_serve_loras_are_named_and_found_before_anything_starts(tmp_path):
    from aotbuild.serving.slots import parse_adapters

    lora = tmp_path / "ink.safetensors"
    save_file({"unet.down_blocks.0.attentions.0.to_q.lora_A.weight": torch.zeros(2, 8)}, lora)
    assert parse_adapters([f"ink={lora}:0.7", "oil=org/oil-lora"]) == {"ink": (str(lora), 0.7),
                                                                      "oil": ("org/oil-lora", 1.0)}
    for given, words in (([f"{lora}"], f"--lora '{lora}': give NAME=PATH-OR-HUB-ID[:WEIGHT]"),
                         ([f"ink={lora}", f"ink={lora}"], "--lora: the name 'ink' is given twice"),
                         (["ink=/no/such/ink.safetensors"], "--lora /no/such/ink.safetensors: no such file")):
        result = CliRunner().invoke(main, ["serve", "--artifact", str(tmp_path), *[f"--lora={g}" for g in given]])
        assert result.exit_code == 1 and words in result.output, result.output
    (tmp_path / "finetune").mkdir()
    for given, words in ((f"anime={tmp_path / 'finetune'}", "finetune: not a diffusers checkpoint (no model_index"),
                         ("anime=./no/such", "--weights ./no/such: not a diffusers checkpoint")):
        result = CliRunner().invoke(main, ["serve", "--artifact", str(tmp_path), "--weights", given])
        assert result.exit_code == 1 and words in result.output, result.output


def test_the_load_bench_options_are_checked_before_anything_starts():
    for args, words in ((["--load", "4"], "--load '4': give CLIENTSxREQUESTS, e.g. 4x8"),
                        (["--lora", "ink=ink.safetensors"], "--lora and --max-batch go with --load"),
                        (["--load", "2x2", "--serve"], "--load benches a served artifact; it takes --steps")):
        result = CliRunner().invoke(main, ["bench", "--target", "cpu-tiny-sdxl", *args])
        assert result.exit_code == 1 and words in result.output, result.output


def test_an_eager_video_server_is_held_to_the_largest_video_its_target_makes():
    """The eager and compile backends have no variants to check a request against: a video's frames
    count with its pixels, so 10,000 frames are refused before any latents are allocated."""
    from aotbuild.serving.schema import covered

    from .conftest import eager_pipeline

    target = load_target(TARGETS / "cpu-tiny-wan.toml")  # 9 frames at 32x48 px, 5 at 32x32
    pipe, recorded = eager_pipeline(target), target.to_dict()
    call = {"images": 1, "height": 32, "width": 48, "guidance_scale": 5.0, "frames": 9}
    assert covered(pipe, recorded, call) is None
    assert covered(pipe, recorded, {**call, "frames": 10_000}) == (
        "1 video(s) of 10000 frames at 32x48 px is more than this server makes at once (13824 pixels)")


def test_build_options_need_ray():
    result = CliRunner().invoke(main, ["build", "--target", "cpu-tiny-sd15", "--address", "127.0.0.1:6379"])
    assert result.exit_code == 1
    assert "--address and --cpus place builds on Ray: add --ray" in result.output


def test_serve_on_a_port_another_program_holds_says_so_before_ray_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--artifact", str(tmp_path), "--port", str(port)])
    assert result.exit_code == 1 and result.output.splitlines()[0] == (
        f"error: port {port} on 127.0.0.1 is in use by another program")
    assert re.fullmatch(rf"hint: give --port \d+ \(free now\), or stop what listens on {port}",
                        result.output.splitlines()[1])


def test_serve_refuses_a_folder_that_is_no_artifact(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--artifact", str(tmp_path)])
    assert result.exit_code == 1
    assert f"{tmp_path.resolve()} is not an artifact: manifest.json is missing" in result.output
    result = CliRunner().invoke(main, ["serve", "--artifact", str(tmp_path), "--replicas", "2", "--autoscale", "1:2"])
    assert "give --replicas or --autoscale, not both" in result.output


# --- one Ray for the session ---------------------------------------------------------------------

@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray of this machine's 2 CPUs; yields its address for other processes to join."""
    import ray

    ray.init(num_cpus=2, object_store_memory=256 * 2**20, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def matrix_targets(tmp_path_factory) -> dict[str, Path]:
    """Two tiny CPU targets (a VAE decoder each, a build of ~30 s) and one whose model config is
    broken, so its build fails in its worker; target files of their own, beside the config sets."""
    folder = tmp_path_factory.mktemp("matrix-targets")
    (folder / "configs").symlink_to(TARGETS / "configs")
    broken = folder / "broken"
    shutil.copytree(TARGETS / "configs" / "tiny-sd15", broken / "configs" / "tiny-sd15")
    vae = broken / "configs" / "tiny-sd15" / "vae" / "config.json"
    config = json.loads(vae.read_text())
    config["up_block_types"][0] = "NoSuchBlock2D"
    vae.write_text(json.dumps(config))
    files = {}
    for name, place, height in (("ray-a", folder, 64), ("ray-b", folder, 32), ("ray-broken", broken, 64)):
        files[name] = place / f"{name}.toml"
        files[name].write_text(f'name = "{name}"\ndescription = "matrix test"\npipeline = "StableDiffusionPipeline"\n'
                               f'source = "random:tiny-sd15"\nseed = 0\ndevice = "cpu"\ndtype = "float32"\n\n'
                               f'[[shapes]]\nbatch = 1\nheight = {height}\nwidth = 64\n\n'
                               f'[components]\nvae_decoder = {{}}\n')
    return files


def _rows(stdout: str) -> dict[str, list[str]]:
    """The summary table's rows by target."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("target "))
    return {line.split()[0]: line.split() for line in lines[start + 1:] if " of " not in line and line[:1] != " "}


def test_several_targets_build_here_one_after_another_each_failing_alone(matrix_targets, tmp_path):
    broken = str(matrix_targets["ray-broken"])
    result = CliRunner().invoke(main, ["build", "--artifacts", str(tmp_path), "--target", broken,
                                       "--target", "h100-sdxl"])
    assert result.exit_code == 2, result.output
    rows = _rows(result.stdout)
    assert rows["ray-broken"][1:3] == [socket.gethostname(), "failed"]
    assert "ray-broken: ValueError: NoSuchBlock2D does not exist." in result.stdout
    assert "h100-sdxl: target h100-sdxl is for cuda, and this machine has no CUDA device" in result.stdout
    assert "0 of 2 targets ok, 2 failed:" in result.stdout
    twice = CliRunner().invoke(main, ["build", "--target", broken, "--target", broken])
    assert twice.exit_code == 1 and "target 'ray-broken' is named twice" in twice.output


@pytest.fixture(scope="module")
def matrix_run(ray_cluster, matrix_targets, tmp_path_factory):
    """`aotbuild build --ray` of the two targets, the broken one and an H100 target (no such GPU
    here) into one shared folder."""
    shared = tmp_path_factory.mktemp("shared") / "artifacts"
    args = ["build", "--ray", "--artifacts", str(shared), "--target", str(matrix_targets["ray-a"]),
            "--target", str(matrix_targets["ray-b"]), "--target", str(matrix_targets["ray-broken"]),
            "--target", "h100-sdxl"]
    start = time.perf_counter()
    result = CliRunner().invoke(main, args)
    print(f"\nmatrix run ({time.perf_counter() - start:.1f} s):\n{result.stdout}")
    return shared, result


@pytest.mark.slow
def test_matrix_builds_each_target_on_ray_and_fails_them_alone(matrix_run, ray_cluster):
    import ray

    shared, result = matrix_run
    assert result.exit_code == 2, result.output  # the number of failed targets
    rows = _rows(result.stdout)
    node = f"({ray.util.get_node_ip_address()})"
    for name in ("ray-a", "ray-b"):
        assert rows[name][2:4] == [node, "built"], rows[name]
        verified = CliRunner().invoke(main, ["verify", str(shared / name)])
        assert verified.exit_code == 0, verified.output
        manifest = json.loads((shared / name / "manifest.json").read_text())
        assert manifest["components"]["vae_decoder"]["variants"][0]["numerics"]["max_rel_error"] < 1e-3
    assert rows["ray-broken"][3] == "failed"
    assert "ray-broken: ValueError: NoSuchBlock2D does not exist." in result.stdout
    assert rows["h100-sdxl"][1:3] == ["-", "failed"]
    assert ("h100-sdxl: not scheduled: no node of this Ray cluster has a GPU of kind H100 "
            "(resource accelerator_type:H100); GPU kinds here: none") in result.stdout
    assert "2 of 4 targets ok, 2 failed:" in result.stdout
    # Progress per target reached the driver as the builds went.
    for line in ("[ray-a] [  compile] vae_decoder b1_64x64", "[ray-b] [  compile] vae_decoder b1_32x64",
                 "[ray-a] [    built] on "):
        assert line in result.stderr
    assert not (shared / "ray-broken").exists()  # nothing half-written


@pytest.mark.slow
def test_matrix_pushes_from_the_workers_to_one_repo(matrix_run, matrix_targets, monkeypatch):
    from aotbuild.runtime.hub import variant_id
    from aotbuild.spec.manifest import environment

    shared, _ = matrix_run
    with FakeHub(token=TOKEN) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)  # the workers get it from the driver
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        result = CliRunner().invoke(main, ["build", "--ray", "--artifacts", str(shared), "--push", "team/matrix",
                                           "--target", str(matrix_targets["ray-a"]),
                                           "--target", str(matrix_targets["ray-b"])])
        print(result.stdout)
        assert result.exit_code == 0, result.output
        rows = _rows(result.stdout)
        commits = {rows[name][-1] for name in ("ray-a", "ray-b")}
        assert rows["ray-a"][3] == rows["ray-b"][3] == "fresh"  # built by the run above, pushed now
        assert len(commits) == 2 and "-" not in commits
        from huggingface_hub import HfApi

        api = HfApi(endpoint=hub.url, token=TOKEN)
        index = json.loads(Path(api.hf_hub_download("team/matrix", "index.json")).read_text())
        here = variant_id(environment("cpu"))
        assert [v["path"] for v in index["variants"]] == [f"ray-a/{here}", f"ray-b/{here}"]
        assert commits <= {commit["oid"][:12] for commit in hub.commits("team/matrix")}


# --- Ray Serve -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http_port(ray_cluster) -> int:
    """Serve's HTTP port for the session's Ray (one per cluster), started here."""
    from ray import serve

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Its controller and proxy log as `aotbuild serve` would have started them (WARNING): a cluster
    # joined logs as its owner configured it, which the command leaves as it is.
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    return port


@pytest.fixture(scope="module")
def loras(tmp_path_factory, tiny_target) -> dict[str, Path]:
    """Two random LoRAs of the tiny SDXL UNet."""
    folder = tmp_path_factory.mktemp("serve-loras")
    pipe = eager_pipeline(tiny_target)
    return {"ink": make_lora(pipe, folder / "ink", seed=1), "oil": make_lora(pipe, folder / "oil", seed=2, rank=8)}


@pytest.fixture(scope="module")
def finetune(tmp_path_factory, tiny_target) -> Path:
    """Another checkpoint of the tiny SDXL architecture (other random weights, and another VAE
    scaling factor, which the pipeline reads from the config), as a diffusers folder."""
    folder = tmp_path_factory.mktemp("finetune") / "seed7"
    pipe = eager_pipeline(tiny_target, seed=7)
    pipe.vae.register_to_config(scaling_factor=0.3)
    pipe.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_checkpoint_whose_compiled_config_differs_is_refused_before_replicas_start(built, tiny_target, tmp_path):
    from aotbuild.serving.application import app

    pipe = eager_pipeline(tiny_target, seed=7)
    pipe.unet.register_to_config(norm_eps=1e-3)
    pipe.save_pretrained(tmp_path / "other")
    with pytest.raises(AotbuildError, match=r"^--weights other: unet: the weights' config differs from the "
                                            r"artifact's in 'norm_eps' \(0.001 in the weights, 1e-05 in the artifact"):
        app(str(built.folder), checkpoints={"other": str(tmp_path / "other")})


# One slot: a second adapter unloads the first. /health with what a replica serves and its counts.
SERVED = {"cpus": 0.5, "lora_slots": 1, "batch_wait_s": 0.3, "health_details": True}


@pytest.fixture(scope="module")
def served(built, http_port, loras, finetune):
    """The tiny SDXL artifact on one replica at /test, serving the LoRAs ink (weight 0.8) and oil,
    and the checkpoint seed7 beside the artifact's own weights."""
    from ray import serve

    from aotbuild.serving.application import app, deploy

    start = time.perf_counter()
    adapters = {"ink": (str(loras["ink"]), 0.8), "oil": (str(loras["oil"]), 1.0)}
    deploy(app(str(built.folder), loras=adapters, checkpoints={"seed7": str(finetune)}, **SERVED), "test", "/test")
    LATENCIES["deploy to ready, 1 replica"] = [time.perf_counter() - start]
    yield f"http://127.0.0.1:{http_port}/test"
    serve.delete("test")


def _post(url: str, body: dict, kind: str) -> tuple[int, dict, bytes]:
    start = time.perf_counter()
    answer = request(url, body)
    LATENCIES.setdefault(kind, []).append(time.perf_counter() - start)
    return answer


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


@pytest.mark.slow
@pytest.mark.parametrize("body, args", [
    ({"prompt": "a red fox in the snow", "steps": 2, "seed": 3, "images": 1}, ["--batch", "1"]),
    ({"prompt": "a lighthouse", "negative_prompt": "blurry", "steps": 3, "seed": 7, "images": 1, "height": 64,
      "width": 96, "guidance_scale": 1.0}, ["--negative-prompt", "blurry", "--batch", "1", "--height", "64",
                                            "--width", "96", "--guidance-scale", "1"]),
])
def test_served_image_equals_aotbuild_run(served, built, tmp_path, body, args):
    import torch

    status, headers, png = _post(served, body, f"{body['steps']}-step image")
    assert status == 200, png[:500]
    assert headers["content-type"] == "image/png"
    out = tmp_path / "run.png"
    # The replica's thread count: a reduction split over other threads rounds otherwise.
    threads, torch_threads = json.loads(request(served + "/health")[2])["threads"], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = CliRunner().invoke(main, ["run", "--artifact", str(built.folder), "--prompt", body["prompt"],
                                           "--steps", str(body["steps"]), "--seed", str(body["seed"]), "--output",
                                           str(out), *args])
    finally:
        torch.set_num_threads(torch_threads)
    assert result.exit_code == 0, result.output
    expected = _pixels(out.read_bytes())
    served_pixels = _pixels(png)
    assert served_pixels.shape == expected.shape == (body.get("height", 64), body.get("width", 64), 3)
    assert np.abs(served_pixels - expected).max() == 0  # the same compiled code, threads, seeds, PNG encoder
    assert served_pixels.std() > 1  # an image, not a blank


@pytest.mark.slow
def test_a_replica_starts_from_a_hub_artifact(served, built, http_port, monkeypatch):
    """hf://org/name@rev: the replica downloads the variant fitting its machine (the driver's Hub
    settings passed on) and serves the image the local folder serves."""
    from ray import serve

    from aotbuild.runtime.hub import push
    from aotbuild.serving.application import app, deploy

    body = {"prompt": "a red fox in the snow", "steps": 2, "seed": 11}
    with FakeHub(token=TOKEN) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        commit = push(built.folder, "team/tiny-sdxl-aot").commit
        with pytest.raises(UntrustedCodeError, match="hf://team/tiny-sdxl-aot holds native code"):
            app("hf://team/tiny-sdxl-aot", cpus=0.5)
        start = time.perf_counter()
        # The branch is resolved by the driver: every replica loads that commit.
        deploy(app("hf://team/tiny-sdxl-aot", cpus=0.5, trust_remote_code=True, health_details=True), "hub", "/hub")
        url = f"http://127.0.0.1:{http_port}/hub"
        status, _, png = _post(url, body, "2-step image")
        LATENCIES["hf:// deploy to first image (download, load, generate)"] = [time.perf_counter() - start]
        health = json.loads(request(url + "/health")[2])
        serve.delete("hub")
    assert status == 200, png[:300]
    assert health["artifact"] == f"hf://team/tiny-sdxl-aot@{commit}"
    local = _post(served, body, "2-step image")[2]
    assert np.array_equal(_pixels(png), _pixels(local))


@pytest.mark.slow
def test_bad_requests_get_4xx_and_the_replica_keeps_serving(served):
    status, _, body = request(served + "/health")
    health = json.loads(body)
    assert (status, health["status"], health["target"], health["backend"]) == (200, "ready", "cpu-tiny-sdxl", "aot")
    replica = health["replica"]
    cases = [
        ({"prompt": "a fox", "num_inference_steps": 2}, 400, "unknown field 'num_inference_steps'"),
        ({"prompt": "a fox", "steps": 500}, 400, "field 'steps' is 500; this server takes 1 to 50"),
        ({"prompt": "a fox", "steps": 1, "height": 256, "width": 256}, 422,
         "no compiled variant makes 1 image(s) at 256x256 px with guidance; this artifact covers: 64x64 px"),
    ]
    for body, status, words in cases:
        code, _, answer = _post(served, body, "refused")
        assert code == status, answer
        error = json.loads(answer)
        assert words in error["error"] and error["replica"] == replica
    raw = urllib_post_raw(served, b"{not json")
    assert raw[0] == 400 and "the body is not JSON" in json.loads(raw[1])["error"]
    code, headers, answer = _post(served, {"prompt": "a fox", "steps": 1, "images": 2, "output": "json"},
                                  "1-step, 2 images")
    assert code == 200 and headers["x-aotbuild-replica"] == replica
    assert len(json.loads(answer)["images"]) == 2


def urllib_post_raw(url: str, data: bytes) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.slow
def test_a_served_video_is_the_mp4_aotbuild_run_writes(tmp_path_factory, http_port, tmp_path):
    """A Wan artifact served: the body is an MP4 of the requested frames, the video `aotbuild run`
    writes for the same arguments; frames outside the buckets get a 422 naming them."""
    import torch
    from ray import serve

    from aotbuild.serving.application import app, deploy

    imageio = pytest.importorskip("imageio.v3")
    built = build_once(tmp_path_factory, load_target(TARGETS / "cpu-tiny-wan.toml"))
    deploy(app(str(built.folder), cpus=0.5, health_details=True), "video", "/video")
    url = f"http://127.0.0.1:{http_port}/video"
    try:
        body = {"prompt": "a red fox running", "steps": 2, "seed": 3, "frames": 5, "height": 32, "width": 32}
        status, headers, mp4 = _post(url, body, "2-step video")
        refused = _post(url, {**body, "frames": 7}, "refused")
        threads = json.loads(request(url + "/health")[2])["threads"]
    finally:
        serve.delete("video")
    assert status == 200 and headers["content-type"] == "video/mp4", mp4[:300]
    assert refused[0] == 422 and "no compiled variant makes 1 video(s) of 7 frames at 32x32 px with guidance; " \
        "this artifact covers: 9 frames at 32x48 px" in json.loads(refused[2])["error"]
    (tmp_path / "served.mp4").write_bytes(mp4)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = CliRunner().invoke(main, ["run", "--artifact", str(built.folder), "--prompt", body["prompt"],
                                           "--steps", "2", "--seed", "3", "--frames", "5", "--height", "32",
                                           "--width", "32", "--output", str(tmp_path / "run.mp4")])
    finally:
        torch.set_num_threads(torch_threads)
    assert result.exit_code == 0, result.output
    served, ran = imageio.imread(tmp_path / "served.mp4"), imageio.imread(tmp_path / "run.mp4")
    assert served.shape == ran.shape == (5, 32, 32, 3)
    assert np.array_equal(served, ran) and served.std() > 1  # the same frames through the same encoder


@pytest.mark.slow
def test_a_served_ip_adapter_artifact_takes_image_prompts(tmp_path_factory, http_port, tmp_path):
    """An artifact built with an IP-Adapter served: a request's image prompt (base64 JSON, or a
    multipart file) gives the image `aotbuild run --ip-adapter-image` makes; one without gets a 400."""
    import base64

    from ray import serve

    from aotbuild.generation.media import png_bytes
    from aotbuild.serving.application import app, deploy
    from aotbuild.spec.pipelines import seeded_image

    built = build_once(tmp_path_factory, load_target(TARGETS / "cpu-tiny-sdxl-ip-adapter.toml"))
    deploy(app(str(built.folder), cpus=0.5, health_details=True), "prompted", "/prompted")
    url = f"http://127.0.0.1:{http_port}/prompted"
    picture = png_bytes(seeded_image(48, 40))
    (tmp_path / "prompt.png").write_bytes(picture)
    body = {"prompt": "a red fox in the snow", "steps": 3, "seed": 2}
    try:
        threads = _health(url)["threads"]
        status, _, png = _post(url, {**body, "ip_adapter_image": base64.b64encode(picture).decode()}, "prompted")
        form_status, form_png = _post_form(url, {k: str(v) for k, v in body.items()}, {"ip_adapter_image": picture})
        refused = _post(url, body, "refused")
    finally:
        serve.delete("prompted")
    assert status == 200 and form_status == 200, (png[:300], form_png[:300])
    expected = _run_png(built, tmp_path, body, threads, "--ip-adapter-image", str(tmp_path / "prompt.png"))
    assert np.abs(_pixels(png) - expected).max() == 0 and np.abs(_pixels(form_png) - expected).max() == 0
    assert refused[0] == 400 and "field 'ip_adapter_image' is required" in json.loads(refused[2])["error"]


def _health(url: str) -> dict:
    status, _, body = request(url + "/health")
    assert status == 200, body
    return json.loads(body)


def _run_png(built, tmp_path, body: dict, threads: int, *extra: str) -> np.ndarray:
    """`aotbuild run`'s image for a served request's fields, at the replica's thread count."""
    import torch

    out = tmp_path / f"run-{len(list(tmp_path.iterdir()))}.png"
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = CliRunner().invoke(main, ["run", "--artifact", str(built.folder), "--prompt", body["prompt"],
                                           "--steps", str(body["steps"]), "--seed", str(body["seed"]),
                                           "--batch", "1", "--output", str(out), *extra])
    finally:
        torch.set_num_threads(torch_threads)
    assert result.exit_code == 0, result.output
    return _pixels(out.read_bytes())


@pytest.mark.slow
def test_per_request_loras_equal_aotbuild_run_with_that_lora(served, built, loras, tmp_path):
    """A request names an adapter the server was started with (and a weight); with one slot, each
    switch to the other adapter unloads the first, and every image equals `aotbuild run --lora`."""
    body = {"prompt": "a red fox in the snow", "steps": 2, "seed": 3, "images": 1}
    before = _health(served)
    assert before["loras"] == ["ink", "oil"] and before["lora_slots"] == 1
    images = {}
    for lora, scale, weight in (("ink", None, 0.8), ("oil", 0.5, 0.5), (None, None, None), ("ink", None, 0.8)):
        asked = {**body, **({"lora": lora} if lora else {}), **({"lora_scale": scale} if scale is not None else {})}
        status, headers, png = _post(served, asked, "2-step image, a LoRA")
        assert status == 200, png[:300]
        extra = ("--lora", f"{loras[lora]}:{weight}") if lora else ()
        expected = _run_png(built, tmp_path, body, before["threads"], *extra)
        assert np.abs(_pixels(png) - expected).max() == 0, (lora, scale)  # the same merged weights, bit for bit
        images.setdefault(lora, []).append(_pixels(png))
    assert np.abs(images["ink"][0] - images[None][0]).max() > 10  # the adapters change the image
    assert np.abs(images["ink"][0] - images["oil"][0]).max() > 10
    after = _health(served)["served"]
    # ink, oil (ink unloaded), none, ink again (oil unloaded): 3 loads, 4 switches.
    assert after["adapter_loads"] - before["served"]["adapter_loads"] == 3
    assert after["adapter_unloads"] - before["served"]["adapter_unloads"] == 2
    assert after["adapter_switches"] - before["served"]["adapter_switches"] == 4
    assert after["adapters_loaded"] == ["ink"]
    unknown = 'field \'lora\' is "watercolor"; this server serves: ink, oil'
    for asked, words in (({**body, "lora": "watercolor"}, unknown),
                         ({**body, "lora_scale": 0.5}, "field 'lora_scale' goes with field 'lora'"),
                         ({**body, "lora": "ink", "lora_scale": "strong"}, "field 'lora_scale' must be a finite")):
        status, _, answer = _post(served, asked, "refused")
        assert status == 400 and words in json.loads(answer)["error"], answer


@pytest.mark.slow
def test_per_request_checkpoints_equal_aotbuild_run_with_those_weights(served, built, loras, finetune, tmp_path):
    """A request names another checkpoint the server was started with (and a LoRA on it): the
    image is `aotbuild run --weights` (and --lora)'s; the artifact's own weights stay held."""
    body = {"prompt": "a red fox in the snow", "steps": 2, "seed": 3, "images": 1}
    threads = _health(served)["threads"]
    own = _post(served, body, "2-step image")[2]
    for asked, extra in (({"weights": "seed7"}, ("--weights", str(finetune))),
                         ({"weights": "seed7", "lora": "ink"}, ("--weights", str(finetune), "--lora",
                                                                f"{loras['ink']}:0.8"))):
        status, _, png = _post(served, {**body, **asked}, "2-step image, another checkpoint")
        assert status == 200, png[:300]
        assert np.abs(_pixels(png) - _run_png(built, tmp_path, body, threads, *extra)).max() == 0, asked
        assert np.abs(_pixels(png) - _pixels(own)).max() > 10  # other weights, another image
    assert np.array_equal(_pixels(_post(served, body, "2-step image")[2]), _pixels(own))  # own weights, as before
    served_counts = _health(served)["served"]
    assert served_counts["checkpoint_loads"] == 1 and served_counts["checkpoints_loaded"] == {"seed7": ["ink"]}
    status, _, answer = _post(served, {**body, "weights": "seed8"}, "refused")
    assert status == 400 and 'field \'weights\' is "seed8"; this server serves: seed7' in json.loads(answer)["error"]


@pytest.mark.slow
def test_requests_arriving_together_run_as_one_batch(served):
    """Three requests of one call shape sent at once are made in one pipeline call, each with its
    own prompt and seed, and each image is the one the request makes alone."""

    bodies = [{"prompt": prompt, "steps": 2, "seed": seed, "images": 1}
              for prompt, seed in (("a red fox", 1), ("a lighthouse at dusk", 2), ("a cat", 3))]
    alone = []
    for body in bodies:
        status, headers, png = _post(served, body, "2-step image")
        assert status == 200 and headers["x-aotbuild-batch"] == "1"
        alone.append(_pixels(png))
    together: dict[int, tuple[int, dict, bytes]] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, _post(served, bodies[i], "batched")))
               for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(together[i][0] == 200 for i in range(3))
    assert max(int(together[i][1]["x-aotbuild-batch"]) for i in range(3)) >= 2  # sent at once: made together
    for i in range(3):
        # Another compiled variant (batch 2-3) rounds differently: within 1 level of 255.
        assert np.abs(_pixels(together[i][2]) - alone[i]).max() <= 1, i
    assert np.abs(alone[0] - alone[1]).max() > 10
    assert _health(served)["served"]["largest_batch"] >= 2


@pytest.mark.slow
def test_openai_images_endpoint(served):
    """POST /v1/images/generations as OpenAI's client sends it: `n`, `size`, `response_format`,
    `model`, a bearer token; aotbuild's own fields beside them. The images are the JSON endpoint's."""
    import base64
    import urllib.request

    url = served + "/v1/images/generations"
    body = {"model": "cpu-tiny-sdxl", "prompt": "a red fox", "n": 2, "size": "96x64", "response_format": "b64_json",
            "seed": 4, "steps": 2}
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-unused", "User-Agent": "OpenAI/Python"}
    with urllib.request.urlopen(urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers),
                                timeout=300) as response:
        answer = json.loads(response.read())
    assert set(answer) == {"created", "data"} and abs(answer["created"] - time.time()) < 300
    images = [_pixels(base64.b64decode(item["b64_json"])) for item in answer["data"]]
    assert [image.shape for image in images] == [(64, 96, 3)] * 2
    status, _, own = _post(served, {"prompt": "a red fox", "images": 2, "width": 96, "height": 64, "seed": 4,
                                    "steps": 2, "output": "json"}, "2-step, 2 images")
    assert status == 200
    assert all(np.array_equal(_pixels(base64.b64decode(png)), image)
               for png, image in zip(json.loads(own)["images"], images, strict=True))
    import openai  # OpenAI's own client, pointed at the server

    client = openai.OpenAI(base_url=served + "/v1", api_key="sk-unused", max_retries=0, timeout=300)
    made = client.images.generate(prompt="a red fox", n=2, size="96x64", response_format="b64_json",
                                  extra_body={"seed": 4, "steps": 2})
    assert all(np.array_equal(_pixels(base64.b64decode(item.b64_json)), image)
               for item, image in zip(made.data, images, strict=True))
    with pytest.raises(openai.BadRequestError, match="field 'n' is 9; this server takes 1 to 4"):
        client.images.generate(prompt="a fox", n=9)
    for asked, words in (({"prompt": "a fox", "size": "big"}, 'field \'size\' is "big"; give "WIDTHxHEIGHT"'),
                         ({"prompt": "a fox", "n": 9}, "field 'n' is 9; this server takes 1 to 4"),
                         ({"prompt": "a fox", "size": "4096x64"}, "no compiled variant makes 1 image(s) at 64x4096"),
                         ({"prompt": "a fox", "response_format": "url"}, 'this server returns images in the response'),
                         ({"prompt": "a fox", "images": 2}, "this endpoint takes OpenAI's n and size")):
        status, _, answer = request(url, asked)
        error = json.loads(answer)["error"]
        assert status in (400, 422) and words in error["message"] and error["type"] == "invalid_request_error", error


def _multipart(fields: dict[str, str], files: dict[str, bytes]) -> tuple[bytes, str]:
    """A multipart/form-data body, as browsers and OpenAI's client send uploads, and its content type."""
    boundary = "aotbuild-test-boundary-7f3a"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields.items()]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}.png"\r\n'
              f'Content-Type: image/png\r\n\r\n'.encode() + data + b"\r\n" for name, data in files.items()]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _post_form(url: str, fields: dict[str, str], files: dict[str, bytes]) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    data, kind = _multipart(fields, files)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers={"Content-Type": kind}),
                                    timeout=300) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.slow
def test_img2img_and_inpainting_requests_equal_aotbuild_run(served, built, tmp_path):
    """An image in base64 JSON (img2img), an image and a mask as multipart uploads (inpainting), and
    OpenAI's edits request (repaint where the mask is transparent): each image is `aotbuild run`'s
    with --image (and --mask) for the same fields."""
    import base64

    from aotbuild.generation.media import png_bytes
    from aotbuild.spec.pipelines import seeded_image

    threads = _health(served)["threads"]
    picture, mask = seeded_image(64, 64), Image.new("L", (64, 64))
    mask.paste(255, (32, 0, 64, 64))  # repaint the right half
    (tmp_path / "in.png").write_bytes(png_bytes(picture))
    (tmp_path / "mask.png").write_bytes(png_bytes(mask))
    body = {"prompt": "a red fox in the snow", "steps": 5, "seed": 2}

    status, _, png = _post(served, {**body, "image": base64.b64encode(png_bytes(picture)).decode(), "strength": 0.6},
                           "img2img")
    assert status == 200, png[:300]
    expected = _run_png(built, tmp_path, body, threads, "--image", str(tmp_path / "in.png"), "--strength", "0.6")
    assert np.abs(_pixels(png) - expected).max() == 0
    assert np.abs(_pixels(png) - np.asarray(picture, dtype=np.int16)).mean() > 5  # repainted, not returned

    fields = {name: str(value) for name, value in body.items()}
    status, inpainted = _post_form(served, fields, {"image": png_bytes(picture), "mask": png_bytes(mask)})
    assert status == 200, inpainted[:300]
    expected = _run_png(built, tmp_path, body, threads, "--image", str(tmp_path / "in.png"), "--mask",
                        str(tmp_path / "mask.png"))
    assert np.abs(_pixels(inpainted) - expected).max() == 0
    kept = np.abs(_pixels(inpainted)[:, :24] - np.asarray(picture, dtype=np.int16)[:, :24]).mean()
    assert kept < np.abs(_pixels(inpainted)[:, 40:] - np.asarray(picture, dtype=np.int16)[:, 40:]).mean()

    transparent = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    transparent.paste((0, 0, 0, 0), (32, 0, 64, 64))  # OpenAI: repaint where the mask is transparent
    status, answer = _post_form(served + "/v1/images/edits", {**fields, "size": "64x64", "n": "1"},
                                {"image": png_bytes(picture), "mask": png_bytes(transparent)})
    assert status == 200, answer[:300]
    edited = _pixels(base64.b64decode(json.loads(answer)["data"][0]["b64_json"]))
    assert np.array_equal(edited, _pixels(inpainted))

    cases = [({**body, "image": "not base64!"}, "field 'image' must be a picture in base64"),
             ({**body, "image": base64.b64encode(b"GIF89a nonsense").decode()}, "field 'image' is not an image PIL"),
             ({**body, "mask": base64.b64encode(png_bytes(mask)).decode()}, "field 'mask' goes with field 'image'"),
             ({**body, "image": base64.b64encode(png_bytes(picture)).decode(), "strength": 2},
              "field 'strength' must be a number above 0 and at most 1")]
    for asked, words in cases:
        status, _, answer = _post(served, asked, "refused")
        assert status == 400 and words in json.loads(answer)["error"], answer
    status, answer = _post_form(served, {**fields, "steps": "many"}, {"image": png_bytes(picture)})
    assert status == 400 and "field 'steps' must be a number, got 'many'" in json.loads(answer)["error"]
    status, answer = _post_form(served + "/v1/images/edits", fields, {"image": png_bytes(picture),
                                                                      "mask": png_bytes(mask)})
    assert status == 400 and "field 'mask' has no transparent pixels" in json.loads(answer)["error"]["message"]


@pytest.mark.slow
def test_load_with_adapter_churn_and_a_replica_killed_mid_load(served, built, loras):
    """4 clients x 3 requests over three adapter states with one slot: every answer is the image
    its adapter makes alone, none lost, no 5xx, memory flat. Then the replica is killed mid-load:
    its requests are retried on the replica Serve starts in its place, none hangs, and the
    deployment serves again."""
    from aotbuild.benchmarking.load import run_load

    body = {"prompt": "a red fox in the snow", "steps": 2, "seed": 3, "images": 1}
    bodies = [body, {**body, "lora": "ink"}, {**body, "lora": "oil"}]
    expected = {}
    for asked in bodies:
        status, _, png = _post(served, asked, "2-step image, a LoRA")
        assert status == 200
        expected[asked.get("lora")] = _pixels(png)

    def check(asked, status, headers, content):
        difference = np.abs(_pixels(content) - expected[asked.get("lora")]).max()
        assert difference <= 1, f"lora {asked.get('lora')}: {difference} levels from its image"  # batched: rounding

    before = _health(served)
    figures = run_load(served, bodies, clients=4, requests=3, timeout=300, check=check)
    after = _health(served)
    print(f"\nload, 4 clients x 3 requests, 3 adapter states, 1 slot: {json.dumps(figures)}")
    assert (figures["answered_ok"], figures["lost"], figures["server_errors"], figures["wrong"]) == (12, 0, 0, [])
    assert 0 < figures["p50_s"] <= figures["p95_s"] <= figures["p99_s"]
    assert after["served"]["adapter_loads"] > before["served"]["adapter_loads"]  # the adapters churned
    assert after["rss_mib"] - before["rss_mib"] < 64, (before["rss_mib"], after["rss_mib"])

    killed, killing = [], threading.Lock()

    def kill_once(answered):  # called by each client after each answer: once, by one of them
        with killing:
            if answered >= 2 and not killed:
                killed.append(_health(served)["pid"])
                os.kill(killed[0], signal.SIGKILL)

    start = time.perf_counter()
    faulted = run_load(served, bodies, clients=3, requests=3, timeout=300, during=kill_once, check=check)
    print(f"load with the replica killed after 2 answers ({time.perf_counter() - start:.1f} s): "
          f"{json.dumps(faulted)}")
    assert killed and (faulted["lost"], faulted["wrong"], faulted["fault_errors"]) == (0, [], [])
    assert faulted["answered_ok"] + faulted["statuses"].get("503", 0) == 9
    # Each request is answered: made (retried on the new replica), or a 503 saying the replica stopped.
    assert set(faulted["statuses"]) <= {"200", "503"}, faulted
    assert all("stopped before it answered" in error for error in faulted["errors"]), faulted["errors"]
    recovered = _health(served)
    assert recovered["pid"] != killed[0] and recovered["status"] == "ready"
    assert _post(served, body, "2-step image")[0] == 200


@pytest.mark.slow
def test_replica_metrics_reach_rays_prometheus_export(served):
    """The replicas' figures are exported with Ray's metrics (Prometheus text on each node's
    metrics port), tagged by deployment."""
    import ray

    assert _post(served, {"prompt": "a red fox", "steps": 1, "lora": "ink"}, "1-step image, a LoRA")[0] == 200
    port = next(node["MetricsExportPort"] for node in ray.nodes() if node["Alive"])
    wanted = ("aotbuild_request_seconds", "aotbuild_generate_seconds", "aotbuild_batch_requests",
              "aotbuild_queued_requests", "aotbuild_adapter_switches")
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline and not all(name in text for name in wanted):
        time.sleep(2)  # Ray exports metrics every few seconds
        text = request(f"http://127.0.0.1:{port}/metrics")[2].decode()
    missing = [name for name in wanted if name not in text]
    assert not missing, missing
    assert re.search(r'aotbuild_generate_seconds_count\{[^}]*deployment="ImageServer"', text)


@pytest.mark.slow
def test_requests_for_an_adapter_go_to_the_replica_holding_it(built, http_port, loras):
    """Two replicas, one slot each, two LoRAs: once each replica has loaded one, every request for
    an adapter is answered by the replica holding it, and no adapter is loaded again."""
    from ray import serve

    from aotbuild.serving.application import app, deploy

    adapters = {"ink": (str(loras["ink"]), 0.8), "oil": (str(loras["oil"]), 1.0)}
    deploy(app(str(built.folder), replicas=2, cpus=0.5, lora_slots=1, max_batch=1, loras=adapters), "routed",
           "/routed")
    url = f"http://127.0.0.1:{http_port}/routed"
    body = {"prompt": "a red fox", "steps": 1, "seed": 0}
    try:
        holders: dict[str, set[str]] = {"ink": set(), "oil": set()}
        for lora in ("ink", "oil"):  # each lands on some replica and is loaded there
            assert _post(url, {**body, "lora": lora}, "1-step image, a LoRA")[0] == 200
        time.sleep(2)  # the replicas report what they hold to Serve's routers
        for lora in ("ink", "oil") * 4:
            status, headers, _ = _post(url, {**body, "lora": lora}, "1-step image, a LoRA")
            assert status == 200
            holders[lora].add(headers["x-aotbuild-replica"])
    finally:
        serve.delete("routed")
    assert len(holders["ink"]) == len(holders["oil"]) == 1, holders  # always the same replica
    assert holders["ink"] != holders["oil"]  # one slot each: each holds one adapter


@pytest.mark.slow
def test_load_bench_runs_each_phase_and_writes_its_figures(built, http_port, loras):
    """`aotbuild bench --load` at small size: unbatched, batched, LoRA churn and a replica killed,
    each with no request lost, no wrong image, and the figures written."""
    from aotbuild.benchmarking.load import SERVE_LOAD_NAME, bench_load
    from aotbuild.benchmarking.report import format_load_table

    adapters = {"ink": (str(loras["ink"]), 0.8), "oil": (str(loras["oil"]), 1.0)}
    document = bench_load(str(TARGETS / "cpu-tiny-sdxl.toml"), built.artifacts, clients=3, requests=2, steps=2,
                          max_batch=3, port=http_port, cpus=0.5, loras=adapters)
    print("\n" + format_load_table(document))
    assert json.loads((built.folder / SERVE_LOAD_NAME).read_text()) == document
    phases = document["phases"]
    assert list(phases) == ["unbatched", "batched", "adapters", "replica_killed"]
    for name, figures in phases.items():
        assert (figures["lost"], figures["wrong"], figures["fault_errors"]) == (0, [], []), (name, figures)
        assert figures["answered_ok"] + figures["statuses"].get("503", 0) == 6, (name, figures)
    for name in ("unbatched", "batched", "adapters"):
        assert phases[name]["answered_ok"] == 6 and phases[name]["server_errors"] == 0, phases[name]
    assert phases["unbatched"]["largest_batch"] == 1
    assert phases["adapters"]["served"]["adapter_unloads"] >= 1  # 2 LoRAs in 1 slot
    assert phases["replica_killed"]["killed_pid"] is not None
    assert set(phases["replica_killed"]["statuses"]) <= {"200", "503"}
    from ray import serve

    assert "load" not in serve.status().applications  # removed


@pytest.mark.slow
def test_autoscaling_from_one_replica_to_two_serves_from_both(served, built):
    """--autoscale 1:2: under a queue of requests Serve starts a second replica, and both answer
    with the same image for the same request."""

    from aotbuild.serving.application import app, deploy

    start = time.perf_counter()
    deploy(app(str(built.folder), autoscale=(1, 2), cpus=0.5), "test", "/test")
    body = {"prompt": "a red fox in the snow", "steps": 1, "seed": 5}
    assert _post(served, body, "1-step image")[0] == 200
    answers: list[tuple[int, dict, bytes]] = []
    stop = threading.Event()

    def client() -> None:  # four clients keep requests queued: more than one replica's worth
        while not stop.is_set() and len({h.get("x-aotbuild-replica") for _, h, _ in answers}) < 2:
            answers.append(_post(served, {**body, "steps": 4}, "4-step image, 4 clients"))

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    deadline = time.monotonic() + 240  # the clients end once both replicas answered; this bounds the wait
    for thread in clients:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stop.set()
    for thread in clients:
        thread.join()
    LATENCIES["1 -> 2 replicas under load, to the second replica's first answer"] = [time.perf_counter() - start]
    assert all(code == 200 for code, _, _ in answers)
    replicas = {h["x-aotbuild-replica"] for _, h, _ in answers}
    assert len(replicas) == 2, replicas
    reference = _pixels(answers[0][2])  # every answer is the same request
    # Requests a replica made together ran another compiled variant (batch 2-4): within 1 level.
    assert all(np.abs(_pixels(png) - reference).max() <= 1 for _, _, png in answers)


@pytest.mark.slow
def test_serve_command_serves_until_ctrl_c(built, ray_cluster, http_port):
    """`aotbuild serve` joins the session's Ray, prints its URL, serves, and on Ctrl-C removes its
    application and exits 0; Ray's INFO lines (start-up, Serve's controller, proxy and replicas)
    are not passed through."""
    process = subprocess.Popen([sys.executable, "-m", "aotbuild.cli", "serve", "--artifact", str(built.folder),
                                "--address", ray_cluster, "--port", str(http_port), "--cpus", "0.5"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    import queue

    from ray import serve

    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        url, seen = None, []
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=5))
            except queue.Empty:
                continue
            if seen[-1].startswith("serving "):
                url = seen[-1].split(" at ")[1].split()[0]
        assert url == f"http://127.0.0.1:{http_port}/", "".join(seen)
        status, _, body = request(url + "health")
        assert status == 200 and set(json.loads(body)) == {"status", "replica"}  # no --health-details
        assert json.loads(body)["status"] == "ready"
        assert request(url + "v1/images/generations/health")[0] == 404  # routed exactly, not by suffix
        status, headers, png = _post(url, {"prompt": "a red fox", "steps": 1}, "1-step image")
        assert status == 200 and headers["content-type"] == "image/png"
        assert _pixels(png).shape == (64, 64, 3)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
        time.sleep(0.5)  # the reader's last lines
        rest = "".join(seen) + "".join(lines.queue)
        assert "stopping" in rest and "stopped" in rest, rest
        assert [line for line in rest.splitlines() if " INFO " in line] == []  # Ray's own, shown under --debug
        assert "aotbuild" not in serve.status().applications  # removed; the session's Serve goes on
    finally:
        if process.poll() is None:
            process.kill()
        if "aotbuild" in serve.status().applications:
            serve.delete("aotbuild")  # a failed run's replica would hold CPUs the next test needs


@pytest.mark.slow
def test_replica_cold_start_bench_writes_its_figures(built, http_port):
    """The serve bench, aot against eager (compile, minutes here, is left to `aotbuild bench --serve`)."""
    from aotbuild.benchmarking.replicas import SERVE_BENCH_NAME, SERVE_BENCH_RATIOS, bench_replicas
    from aotbuild.benchmarking.report import format_table

    document = bench_replicas(str(TARGETS / "cpu-tiny-sdxl.toml"), built.artifacts, cases=("aot", "eager"),
                              repeats=1, steps=2, steady=1, port=http_port, cpus=0.5)
    assert json.loads((built.folder / SERVE_BENCH_NAME).read_text()) == document
    for case in ("aot", "eager"):
        run = document["runs"][case][0]
        assert 0 < run["load_s"] < run["ready_s"] < run["first_response_s"], (case, run)
        assert run["steady_response_s"] > 0
    table = format_table(document, SERVE_BENCH_RATIOS)
    print("\n" + table)
    assert document["ratio_to_aot"]["aot"]["first_response_s"] == 1.0
    assert table.splitlines()[-3:][1].split() == ["first_response_s", "1.00x",
                                                  f"{document['ratio_to_aot']['eager']['first_response_s']:.2f}x"]
    from ray import serve

    assert not any(name.startswith("bench-") for name in serve.status().applications)  # each replica removed


def teardown_module(module):
    if LATENCIES:
        print("\nrequest latencies (s): " + "; ".join(f"{kind}: " + ", ".join(f"{s:.2f}" for s in values)
                                                     for kind, values in LATENCIES.items()))
