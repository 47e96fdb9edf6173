"""push / pull against a local Hub-compatible server (tests/hubserver.py), with the real client."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import aotbuild
from aotbuild.cli import main
from aotbuild.errors import CorruptArtifactError, HubError, NoMatchingVariantError
from aotbuild.runtime.hub import model_card, parse_repo, push, resolve, variant_id
from aotbuild.spec.manifest import environment

from .conftest import ROOT, TARGETS
from .hubserver import FakeHub

pytestmark = pytest.mark.slow
TOKEN = "hf_aotbuildSecretTestToken123"
REPO = "aotbuild-test/tiny-sdxl"
HERE = variant_id(environment("cpu"))  # this machine's variant
OTHER = variant_id({**environment("cpu"), "torch": "2.12.0+cpu"})  # the same machine, another torch


@pytest.fixture
def hub(monkeypatch):
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, as a fleet machine would run it."""
    return subprocess.run([sys.executable, "-m", "aotbuild.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def other_torch_copy(built, tmp_path) -> Path:
    """The artifact as if built with another torch: a second variant for the same target."""
    folder = Path(shutil.copytree(built.folder, tmp_path / "other" / built.folder.name))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["environment"]["torch"] = "2.12.0+cpu"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_parse_repo_and_variant_names():
    assert parse_repo("hf://org/name@v1") == ("org/name", "v1") and parse_repo("org/name") == ("org/name", None)
    with pytest.raises(aotbuild.AotbuildError, match="expected org/name"):
        parse_repo("justname")
    assert variant_id({"torch": "2.13.0+cpu", "device_type": "cpu", "platform": "linux-x86_64",
                       "cpu_isa": "AVX512"}) == "torch2.13.0-cpu-x86_64-avx512"
    assert variant_id({"torch": "2.13.0+cu128", "device_type": "cuda", "cuda": "12.8",
                       "gpu_capability": "9.0"}) == "torch2.13.0-cu128-sm90"
    assert variant_id({"torch": "2.13.0+cu128", "device_type": "cuda", "cuda": "12.8", "gpu_capability": "8.0",
                       "gpu_multi_arch": True}) == "torch2.13.0-cu128-sm80-ptx"


def test_push_is_one_commit_with_lfs_index_and_card(hub, built):
    result = CliRunner().invoke(main, ["push", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"), "--repo", REPO,
                                       "--artifacts", str(built.artifacts)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert TOKEN not in result.output
    commits = hub.commits(REPO)
    assert len(commits) == 2  # the repo's initial commit, then exactly one push
    files = commits[-1]["files"]
    prefix = f"cpu-tiny-sdxl/{HERE}"
    assert {f"{prefix}/manifest.json", f"{prefix}/unet.pt2", f"{prefix}/unet.safetensors", "index.json",
            "README.md"} <= set(files)
    uploads = [r for r in hub.requests if r["method"] == "PUT"]
    assert len(uploads) >= 4  # packages and weights went through LFS
    commit_requests = [r for r in hub.requests if "/commit/" in r["path"]]
    assert len(commit_requests) == 1 and commit_requests[0]["headers"]["authorization"] == f"Bearer {TOKEN}"
    index = json.loads(files["index.json"])
    assert [v["path"] for v in index["variants"]] == [prefix]
    card = files["README.md"].decode()
    assert card.startswith("---\nlibrary_name: aotbuild\ntags:") and f"| `{prefix}` |" in card
    # The card shows what works: its commands run as written (the code refuses a Hub artifact's native
    # code without trust_remote_code).
    assert f'load_pipeline("hf://{REPO}", trust_remote_code=True)' in card
    pull = re.search(r"`(aotbuild pull [^`]+)`", card)[1]
    pulled = CliRunner().invoke(main, pull.split()[1:], catch_exceptions=False)
    assert pulled.exit_code == 0 and f" cpu-tiny-sdxl/{HERE}: " in pulled.output, pulled.output
    folder = Path(pulled.output.strip().rsplit(": ", 1)[1])
    shutil.rmtree(next(p for p in folder.parents if p.name.startswith("models--")))  # the cache as it was
    again = CliRunner().invoke(main, ["push", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"), "--repo", REPO,
                                      "--artifacts", str(built.artifacts)], catch_exceptions=False)
    assert again.exit_code == 0 and (f"nothing changed: {REPO}@{commits[-1]['oid']} already holds {prefix} as it is "
                                     f"here\n") in again.output and "pushed" not in again.output
    assert len(hub.commits(REPO)) == 2  # no empty commit


def test_hub_failures_say_what_to_check(hub, built):
    """A token the Hub refuses, a repo that is not there: each one line, with the token or the
    repo id as what to check (an unreachable Hub: the network and HF_HUB_OFFLINE)."""
    from aotbuild.runtime.hub import push

    hub.token = TOKEN  # the Hub checks tokens: another is refused (401)
    with pytest.raises(HubError, match=f"push to {REPO} failed") as raised:
        push(built.folder, REPO, token="hf_notAValidToken")
    assert raised.value.hint.startswith("check the token: `hf auth login` or HF_TOKEN")
    assert "hf_notAValidToken" not in str(raised.value)
    result = CliRunner().invoke(main, ["pull", "aotbuild-test/no-such-repo", "--trust-remote-code"])
    assert result.exit_code == 1 and "hint: check the repo id and revision for a typo" in result.output


def test_dry_run_lists_operations_and_uploads_nothing(hub, built):
    result = CliRunner().invoke(main, ["push", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"), "--repo", REPO,
                                       "--artifacts", str(built.artifacts), "--dry-run"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"add cpu-tiny-sdxl/{HERE}/unet.pt2" in result.output and "add index.json" in result.output
    assert not [r for r in hub.requests if r["method"] in ("PUT", "POST") and "/commit/" in r["path"]]


def test_the_documented_local_hub_serves_a_push_pull_run_round_trip(built, tmp_path):
    """`python -m tests.hubserver` as the Hub guide runs it: the variables it prints make push,
    then run from hf://, work with no account and no network."""
    server = subprocess.Popen([sys.executable, "-m", "tests.hubserver", "--port", "0"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE)
    try:
        url = re.search(r"a local Hub at (http://127\.0\.0\.1:\d+)", server.stdout.readline())[1]
        exports = server.stdout.readline()
        env = dict(re.findall(r"(HF_\w+)=(\S+)", exports))
        assert env == {"HF_ENDPOINT": url, "HF_TOKEN": "hf_local", "HF_HUB_DISABLE_XET": "1"}
        pushed = run_cli("push", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"), "--repo", "me/tiny-sdxl",
                         "--artifacts", str(built.artifacts), env=env)
        assert pushed.returncode == 0 and "pushed cpu-tiny-sdxl/" in pushed.stdout, pushed.stderr
        ran = run_cli("run", "--artifact", "hf://me/tiny-sdxl", "--trust-remote-code", "--prompt", "a red fox",
                      "--steps", "2", "--output", str(tmp_path / "fox.png"), env=env)
        assert ran.returncode == 0 and (tmp_path / "fox.png").is_file(), ran.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_inspect_fetches_the_manifest_alone_and_a_dry_run_needs_no_hub(hub, built):
    push(built.folder, REPO)
    hub.requests.clear()
    result = CliRunner().invoke(main, ["inspect", f"hf://{REPO}"], catch_exceptions=False)
    assert result.exit_code == 0 and f"hub        {REPO}@" in result.output, result.output
    fetched = {r["path"].rsplit("/", 1)[1] for r in hub.requests if r["method"] == "GET" and "/resolve/" in r["path"]}
    assert "manifest.json" in fetched and fetched <= {"index.json", "manifest.json"}  # no weights, no package
    # (index.json's content may be cached already: the client then only asks whether it moved)
    hub.stop()
    result = CliRunner().invoke(main, ["push", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"), "--repo", REPO,
                                       "--artifacts", str(built.artifacts), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"add cpu-tiny-sdxl/{HERE}/unet.pt2" in result.output and "dry run: " in result.output
    assert "note: the Hub cannot be reached (127.0.0.1:" in result.output
    assert "listed as for a new repo" in result.output


def test_pull_in_a_fresh_process_then_offline_from_cache(hub, built, tiny_target):
    from .conftest import generate

    push(built.folder, REPO)
    start = time.perf_counter()
    refused = run_cli("pull", REPO)
    assert refused.returncode == 1 and f"hf://{REPO} holds native code" in refused.stderr
    assert "--trust-remote-code" in refused.stderr
    pulled = run_cli("pull", REPO, "--trust-remote-code")
    assert pulled.returncode == 0, pulled.stderr
    folder = Path(pulled.stdout.strip().rsplit(": ", 1)[1])
    assert folder.name == HERE and (folder / "unet.pt2").is_file()
    script = ("import aotbuild, numpy, torch, sys; p = aotbuild.load_pipeline(sys.argv[1], trust_remote_code=True); "
              "numpy.save(sys.argv[2], p('a red fox in the snow', num_inference_steps=2, height=64, width=64, "
              "guidance_scale=5.0, output_type='np', generator=torch.Generator('cpu').manual_seed(0)).images)")
    out = folder.parent.parent.parent / "image.npy"
    image = subprocess.run([sys.executable, "-c", script, f"hf://{REPO}", str(out)], capture_output=True, text=True)
    assert image.returncode == 0, image.stderr[-2000:]
    print(f"pull + first image in fresh processes: {time.perf_counter() - start:.1f}s")
    local = generate(aotbuild.load_pipeline(built.folder), tiny_target.shapes[0])
    np.testing.assert_array_equal(np.load(out), local)
    downloaded = {r["path"] for r in hub.requests if r["method"] == "GET" and "/resolve/" in r["path"]}
    assert all(f"/{HERE}/" in p or p.endswith("index.json") for p in downloaded)  # only this variant
    hub.stop()
    offline = run_cli("pull", REPO, "--trust-remote-code", env={"HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr
    assert TOKEN not in pulled.stdout + pulled.stderr + offline.stdout + offline.stderr
    # The Hub gone without HF_HUB_OFFLINE: the cache at once (no retries of the network), and a repo
    # never fetched fails saying so, with what to check.
    unreachable = run_cli("pull", REPO, "--trust-remote-code")
    assert unreachable.returncode == 0 and unreachable.stdout == pulled.stdout, unreachable.stderr
    never = run_cli("pull", "aotbuild-test/never-fetched", "--trust-remote-code")
    port = hub.url.rsplit(":", 1)[1]
    assert never.returncode == 1 and never.stderr.splitlines() == [
        f"error: fetching aotbuild-test/never-fetched@main failed: the Hub cannot be reached from here (127.0.0.1:"
        f"{port}: Connection refused) and the cache holds no copy of it",
        "hint: check the network, or HF_ENDPOINT for a mirror; once fetched, a variant loads from the cache with no "
        "network (HF_HUB_OFFLINE=1 skips trying)"]


def test_right_variant_chosen_among_two_and_none_matching(hub, built, tmp_path):
    push(other_torch_copy(built, tmp_path), REPO)
    with pytest.raises(NoMatchingVariantError, match=rf"no variant fits this machine \({re.escape(HERE)}.*"
                                                    rf"the repo has: cpu-tiny-sdxl/{re.escape(OTHER)}"):
        resolve(REPO)
    push(built.folder, REPO)
    found = resolve(REPO)
    assert found.variant == f"cpu-tiny-sdxl/{HERE}"
    index = json.loads((found.folder.parent.parent / "index.json").read_text())  # the same commit's index
    assert len(hub.commits(REPO)) == 3 and len(index["variants"]) == 2


def test_concurrent_pushes_both_stay_in_the_index(hub, built, tmp_path):
    other = other_torch_copy(built, tmp_path)
    hub.before_next_commit = lambda: push(other, REPO)  # lands after this push read index.json
    push(built.folder, REPO)
    commits = hub.commits(REPO)
    assert len(commits) == 3
    index = json.loads(commits[-1]["files"]["index.json"])
    assert [v["path"] for v in index["variants"]] == [f"cpu-tiny-sdxl/{OTHER}", f"cpu-tiny-sdxl/{HERE}"]
    refused = [r for r in hub.requests if "/commit/" in r["path"] and r["status"] == 412]
    assert len(refused) == 1  # the first try was refused, not merged blindly


def test_corrupted_download_is_refused(hub, built, tmp_path):
    push(built.folder, REPO)
    cache = tmp_path / "hf-cache"  # a private cache: the damaged blob must not leak into other tests
    found = resolve(REPO, cache_dir=cache)
    blob = (found.folder / "vae_decoder.pt2").resolve()
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CorruptArtifactError, match="vae_decoder.pt2: sha256") as info:
        resolve(REPO, cache_dir=cache)
    assert "Hugging Face cache" in info.value.hint


def test_server_error_mid_push_leaves_no_commit(hub, built, tmp_path):
    push(built.folder, REPO)
    hub.fail_next = {"commit": 500}
    with pytest.raises(HubError, match=f"push to {REPO} failed: .*500"):
        push(other_torch_copy(built, tmp_path), REPO)  # new content: an identical push makes no commit at all
    assert len(hub.commits(REPO)) == 2


def test_revision_is_pinned_and_shown(hub, built):
    push(built.folder, REPO, revision="v1")
    assert len(hub.commits(REPO, "v1")) == 2
    result = CliRunner().invoke(main, ["inspect", f"hf://{REPO}@v1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    commit = hub.commits(REPO, "v1")[-1]["oid"]
    assert f"hub        {REPO}@{commit} (asked: v1), variant cpu-tiny-sdxl/{HERE}" in result.output


def test_model_card_lists_bench_figures():
    entry = {"path": "t/v", "pipeline": "FluxPipeline", "dtype": "bfloat16", "shapes": ["1x1024x1024"],
             "dynamic": None, "recipe": ["fuse_qkv"], "max_rel_error": 0.01, "source": {"id": "org/model"},
             "environment": {"device_type": "cuda", "gpu_name": "H100", "gpu_capability": "9.0", "torch": "2.13.0"},
             "bench": {"first_image_s": 1.5, "steady_step_s": 0.05}}
    card = model_card("org/x", {"variants": [entry]})
    assert "base_model:\n- org/model" in card and "| H100 sm9.0 |" in card and "| 1.5 | 0.05 |" in card


HUB_SOURCE_TARGET = """
name = "cpu-hub-source"
pipeline = "StableDiffusionXLPipeline"
source = "{repo}"
revision = "{revision}"
device = "cpu"
dtype = "bfloat16"
guidance_scale = 5.0

[[shapes]]
batch = 1
height = 64
width = 64

[components]
vae_decoder = {{}}
"""
# The compiled bfloat16 decoder against eager bfloat16, both from the same fp16 files: measured 7.8e-3
# on [0, 1] images (2**-7: bfloat16 rounding).
BF16_IMAGE_ATOL = 2e-2


@pytest.mark.early
def test_build_from_a_hub_source_then_load_it_online_and_offline(hub, tiny_target, tmp_path):
    """The path a user takes: the pipeline is a Hub repo pinned to a revision. A bfloat16 target
    downloads the repo's fp16 variant files only; loading the artifact fetches the components it did
    not compile from that same revision (never the compiled one's weights), then works offline."""
    import torch
    from diffusers import StableDiffusionXLPipeline
    from huggingface_hub import HfApi

    from aotbuild.builder import build
    from aotbuild.builder.targets import load_target

    from .conftest import eager_pipeline

    repo, folder = "aotbuild-test/tiny-sdxl-pipeline", tmp_path / "pipeline"
    eager = eager_pipeline(tiny_target)
    eager.save_pretrained(folder)
    eager.to(torch.float16).save_pretrained(folder, variant="fp16")  # as SDXL's repo has both
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(repo)
    revision = api.upload_folder(repo_id=repo, folder_path=folder).oid
    api.upload_file(path_or_fileobj=b"later", path_in_repo="LATER.md", repo_id=repo)  # main moves on
    target_file = tmp_path / "cpu-hub-source.toml"
    target_file.write_text(HUB_SOURCE_TARGET.format(repo=repo, revision=revision))

    result = build(load_target(target_file), tmp_path / "artifacts", progress=lambda stage, message: None)
    weights = {r["path"].split(f"/resolve/{revision}/", 1)[-1] for r in hub.requests
               if r["method"] == "GET" and r["path"].endswith(".safetensors")}
    assert weights and all(".fp16." in path for path in weights), weights  # half the bytes of the full files
    assert {"unet/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_pytorch_model.fp16.safetensors"} <= weights
    assert result.manifest["source"] == {"id": repo, "revision": revision, "seed": None, "commit": revision}
    manifest_text = (result.folder / "manifest.json").read_text()
    assert os.environ["HF_HOME"] not in manifest_text and str(tmp_path) not in manifest_text  # no machine paths

    hub.requests.clear()
    out = tmp_path / "image.npy"
    script = ("import sys, numpy, torch, aotbuild; p = aotbuild.load_pipeline(sys.argv[1]); "
              "numpy.save(sys.argv[2], p('a red fox in the snow', num_inference_steps=2, height=64, width=64, "
              "guidance_scale=5.0, output_type='np', generator=torch.Generator('cpu').manual_seed(0)).images)")
    env = {**os.environ, "HF_HOME": str(tmp_path / "fleet-hf-home")}  # a fresh machine's empty HF cache
    loaded = subprocess.run([sys.executable, "-c", script, str(result.folder), str(out)], capture_output=True,
                            text=True, env=env)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    fetched = [r["path"] for r in hub.requests if r["method"] == "GET" and r["path"].endswith(".safetensors")]
    assert fetched and all(f"/resolve/{revision}/" in p and ".fp16." in p for p in fetched)
    assert not [p for p in fetched if "/vae/" in p]  # the compiled component's weights are never downloaded

    reference = StableDiffusionXLPipeline.from_pretrained(folder, variant="fp16", torch_dtype=torch.bfloat16)
    reference.set_progress_bar_config(disable=True)
    expected = reference("a red fox in the snow", num_inference_steps=2, height=64, width=64, guidance_scale=5.0,
                         output_type="np", generator=torch.Generator("cpu").manual_seed(0)).images
    online = np.load(out)
    np.testing.assert_allclose(online, expected, atol=BF16_IMAGE_ATOL, rtol=0)

    # Another checkpoint of the architecture on the Hub: its weights go through the bfloat16 recipe.
    import aotbuild

    finetune, finetune_folder = "aotbuild-test/tiny-sdxl-finetune", tmp_path / "finetune"
    eager_pipeline(tiny_target, seed=7).save_pretrained(finetune_folder)
    api.create_repo(finetune)
    finetune_revision = api.upload_folder(repo_id=finetune, folder_path=finetune_folder).oid
    with pytest.raises(aotbuild.PrecisionError, match=r"tiny-sdxl-finetune@\w+'s vae is float32 and this artifact "
                                                      r"computes bfloat16"):  # stored float32: said, not cast
        aotbuild.load_pipeline(result.folder, weights=f"{finetune}@{finetune_revision}")
    pipe = aotbuild.load_pipeline(result.folder, weights=f"{finetune}@{finetune_revision}", dtype="bfloat16")
    assert pipe.vae.decoder.weights["decoder.conv_in.weight"].dtype == torch.bfloat16
    reference = StableDiffusionXLPipeline.from_pretrained(finetune_folder, torch_dtype=torch.bfloat16)
    reference.set_progress_bar_config(disable=True)
    images = [p("a red fox in the snow", num_inference_steps=2, height=64, width=64, guidance_scale=5.0,
                output_type="np", generator=torch.Generator("cpu").manual_seed(0)).images for p in (pipe, reference)]
    np.testing.assert_allclose(images[0], images[1], atol=BF16_IMAGE_ATOL, rtol=0)
    assert np.abs(images[0] - online).max() > 0.05  # not the artifact's weights

    # A target naming a branch records the commit it resolved to: when the branch moves on, the artifact
    # is stale, and loading it fetches that commit's files, not the branch's.
    import dataclasses

    from aotbuild.builder import is_fresh
    from aotbuild.builder.record import source_record

    on_main = dataclasses.replace(load_target(target_file), revision="main")
    head = api.repo_info(repo).sha
    record = source_record(on_main)
    assert record == {"id": repo, "revision": "main", "seed": None, "commit": head}
    branch_built = Path(shutil.copytree(result.folder, tmp_path / "on-main" / on_main.name))
    manifest = json.loads((branch_built / "manifest.json").read_text())
    manifest.update(source=record, target_hash=on_main.content_hash(),
                    target={**manifest["target"], "revision": "main"})
    (branch_built / "manifest.json").write_text(json.dumps(manifest))
    assert is_fresh(branch_built, on_main)
    hub.requests.clear()
    aotbuild.load_pipeline(branch_built)
    resolved = {r["path"] for r in hub.requests if "/resolve/" in r["path"]}
    assert resolved and all(f"/resolve/{head}/" in p for p in resolved), resolved
    api.upload_file(path_or_fileobj=b"moved", path_in_repo="MOVED.md", repo_id=repo)  # main moves on
    assert not is_fresh(branch_built, on_main)

    hub.stop()
    offline = subprocess.run([sys.executable, "-c", script, str(result.folder), str(out)], capture_output=True,
                             text=True, env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr[-3000:]
    np.testing.assert_array_equal(np.load(out), online)


def test_hub_weights_are_trusted_by_their_blob_name(hub, built):
    from aotbuild.runtime import check_artifact_files
    from aotbuild.spec.manifest import read_manifest

    push(built.folder, REPO)
    found = resolve(REPO, verify=False)
    sha = built.manifest["files"]["unet.safetensors"]["sha256"]
    assert (found.folder / "unet.safetensors").resolve().name == sha  # huggingface_hub's blob naming
    hashed = check_artifact_files(found.folder, read_manifest(found.folder))
    assert {"unet.pt2", "vae_decoder.pt2"} <= set(hashed)  # native code: hashed on every load
    assert not {"unet.safetensors", "vae_decoder.safetensors"} & set(hashed)


def test_index_paths_outside_the_repo_are_refused_before_any_download(hub, built):
    from huggingface_hub import HfApi

    push(built.folder, REPO)
    api = HfApi(endpoint=hub.url, token=TOKEN)
    index = json.loads(Path(api.hf_hub_download(REPO, "index.json")).read_text())
    index["variants"][0]["path"] = "../cpu-tiny-sdxl"
    api.upload_file(path_or_fileobj=json.dumps(index).encode(), path_in_repo="index.json", repo_id=REPO)
    hub.requests.clear()
    with pytest.raises(HubError, match=r"index.json names an invalid variant path '\.\./cpu-tiny-sdxl'"):
        resolve(REPO)
    assert {r["path"].rsplit("/", 1)[-1] for r in hub.requests if "/resolve/" in r["path"]} == {"index.json"}


@pytest.mark.parametrize("damage, problem", [
    (lambda index: index["variants"].__setitem__(0, 7), "its variant 0 is not a JSON object"),
    (lambda index: index["variants"][0].pop("environment"), "its variant 0 lacks 'environment'"),
    (lambda index: index["variants"][0]["environment"].pop("device_type"),
     "its variant 0 has an environment that lacks 'device_type'"),
    (lambda index: index.pop("variants"), "not an aotbuild index"),
], ids=["entry", "key", "environment", "variants"])
def test_a_malformed_index_is_said_to_be_not_a_failed_fetch(hub, built, damage, problem):
    """A hand-edited or damaged index.json was reported as a failed fetch, with a network hint."""
    from huggingface_hub import HfApi

    push(built.folder, REPO)
    api = HfApi(endpoint=hub.url, token=TOKEN)
    index = json.loads(Path(api.hf_hub_download(REPO, "index.json")).read_text())
    damage(index)
    api.upload_file(path_or_fileobj=json.dumps(index).encode(), path_in_repo="index.json", repo_id=REPO)
    with pytest.raises(HubError, match=rf"^index.json of this repo .*{problem}") as info:
        resolve(REPO)
    assert "fetching" not in info.value.message and "network" not in (info.value.hint or "")
