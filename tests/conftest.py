"""Shared fixtures. The tiny SDXL target is built once per test session (AOTInductor on 2 cores takes
a minute or two) into a temporary folder; tests that need a modified artifact copy it."""

from __future__ import annotations

import os

# Builds here compile test-sized models: their AOTInductor wrapper's C++ at -O0 compiles ~14% faster
# (the kernels keep -O3; the numbers are the same). Set before torch reads its inductor config, and
# inherited by the background builders.
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "targets"
# Caches go to throwaway folders, not the user's ~/.cache (subprocesses inherit these). Set before
# huggingface_hub is imported: it reads HF_HOME once. Xet is off: the test Hub speaks plain LFS.
os.environ["AOTBUILD_CACHE"] = tempfile.mkdtemp(prefix="aotbuild-test-cache-")
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="aotbuild-test-hf-")
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
# AOTInductor's host wrapper (calls, not arithmetic: no result changes) compiled at -O0, not -O1:
# cpu-tiny-sd15's build 249 -> 225 s on 2 quiet cores. Read when inductor's config is first imported.
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")


@pytest.fixture(scope="session")
def tiny_target():
    from aotbuild.builder.targets import load_target

    return load_target(TARGETS / "cpu-tiny-sdxl.toml")


def eager_pipeline(target, seed: int | None = None):
    """The target's pipeline, uncompiled, float32 (optionally from another seed)."""
    import dataclasses

    from aotbuild.builder.capturing import load_source_pipeline
    from aotbuild.spec.pipelines import pipeline_spec

    if seed is not None:
        target = dataclasses.replace(target, seed=seed)
    return load_source_pipeline(target, pipeline_spec(target.pipeline), torch.device("cpu"))


def same_as_eager(run, compiled, eager, atol: float, **call):
    """`run(compiled, **call)`, checked against `run(eager, **call)` within `atol`: the compiled output."""
    import numpy as np

    got = run(compiled, **call)
    np.testing.assert_allclose(got, run(eager, **call), atol=atol, rtol=0)
    return got


def generate(pipe, bucket, steps: int = 2, seed: int = 0, **call):
    return pipe("a red fox in the snow", num_inference_steps=steps, height=bucket.height, width=bucket.width,
                num_images_per_prompt=bucket.batch, guidance_scale=5.0, output_type="np",
                generator=torch.Generator("cpu").manual_seed(seed), **call).images


_BUILT: dict[str, SimpleNamespace] = {}  # target hash -> build: each target compiles once per session
# The shipped tiny targets the slow tests build, split over two background builders started with
# the session: a build is one Python thread or one g++ at a time, so two cores build two targets.
# Each list is in the order the tests first need them; `build_once` waits on a target's build
# lock, then finds it fresh (or builds it itself, if its builder has not reached it yet).
PREBUILDS = (("cpu-tiny-ltx", "cpu-tiny-sdxl", "cpu-tiny-sd3", "cpu-tiny-sd15-inpaint", "cpu-tiny-sdxl-regional",
              "cpu-tiny-sd3-regional", "cpu-tiny-sd15-pndm", "cpu-tiny-pixart-sigma", "cpu-tiny-chroma",
              "cpu-tiny-z-image", "cpu-tiny-qwen-image-edit", "cpu-tiny-qwen-image-edit-plus",
              "cpu-tiny-flux-kontext", "cpu-tiny-sdxl-prepack", "cpu-tiny-sdxl-bf16-prepack",
              "cpu-tiny-sdxl-controlnet", "cpu-tiny-sdxl-controlnet-union", "cpu-tiny-sdxl-ip-adapter",
              "cpu-tiny-sd3-controlnet", "cpu-tiny-sd3-controlnet-inpaint", "cpu-tiny-sd35-large-controlnet",
              "cpu-tiny-sdxl-img2img"),
             ("cpu-tiny-sdxl-int8", "cpu-tiny-sd15", "cpu-tiny-flux", "cpu-tiny-flux-regional",
              "cpu-tiny-auraflow", "cpu-tiny-flux2-klein",
              "cpu-tiny-flux2-klein-regional", "cpu-tiny-qwen-image", "cpu-tiny-flux2-dev", "cpu-tiny-wan22",
              "cpu-tiny-wan-i2v", "cpu-tiny-cogvideox", "cpu-tiny-wan", "cpu-tiny-wan-regional",
              "cpu-tiny-sdxl-x86-64-v3", "cpu-tiny-sd15-controlnet", "cpu-tiny-flux-controlnet",
              "cpu-tiny-flux-controlnet-union", "cpu-tiny-flux-ip-adapter"))
_SESSION: dict[str, Path] = {}  # "artifacts": the session's artifacts folder, "logs": the builders' logs
PROGRESS_LINE = re.compile(r"^\[\s*([a-z]+)\] (.*)$")


def build_once(tmp_path_factory, target) -> SimpleNamespace:
    """Build `target` once per session into the session's artifacts folder (every test module
    asking for it gets that build); AOTBUILD_TEST_ARTIFACTS names a folder to keep builds in
    across sessions instead (a fresh artifact there is reused, for development;
    test_build_writes_complete_artifact then fails: no build ran, so no build progress was seen)."""
    key = target.content_hash()
    if key not in _BUILT:
        _BUILT[key] = _build(tmp_path_factory, target)
    return _BUILT[key]


def _artifacts(tmp_path_factory) -> Path:
    if "artifacts" not in _SESSION:
        kept = os.environ.get("AOTBUILD_TEST_ARTIFACTS")
        _SESSION["artifacts"] = Path(kept) if kept else tmp_path_factory.mktemp("session") / "artifacts"
        _SESSION["logs"] = tmp_path_factory.mktemp("build-logs")
    return _SESSION["artifacts"]


def _build(tmp_path_factory, target) -> SimpleNamespace:
    """The build's progress messages are its own, or, when a background builder made the
    artifact, read back from that builder's log."""
    from aotbuild.builder import build

    artifacts = _artifacts(tmp_path_factory)
    messages: list[tuple[str, str]] = []
    result = build(target, artifacts, progress=lambda stage, msg: messages.append((stage, msg)))
    log = _SESSION["logs"] / f"{target.name}.log"
    if result.skipped and log.is_file():
        messages = [m.groups() for line in log.read_text().splitlines() if (m := PROGRESS_LINE.match(line))]
    return SimpleNamespace(folder=result.folder, artifacts=artifacts, manifest=result.manifest, progress=messages)


class _Builder(threading.Thread):
    """Builds targets one after another in one `tests.prebuild` process (each build logging to its
    own file, as `aotbuild build` does) and says on the terminal when each is done (`say`): the
    first tests wait minutes for them."""

    def __init__(self, names: tuple[str, ...], artifacts: Path, logs: Path, say=lambda line: None) -> None:
        super().__init__(daemon=True)
        self.names, self.artifacts, self.logs, self.say = names, artifacts, logs, say
        self.process: subprocess.Popen | None = None
        self.stopped = False

    def run(self) -> None:
        with open(self.logs / f"builder-{self.names[0]}.log", "w") as errors:  # what escaped the builds' logs
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.prebuild", str(self.artifacts), str(self.logs),
                 *(str(TARGETS / f"{name}.toml") for name in self.names)],
                stdout=subprocess.PIPE, stderr=errors, text=True, cwd=ROOT)
            if self.stopped:  # the session ended before the process started
                self.process.terminate()
            for i, line in enumerate(self.process.stdout, 1):
                if not self.stopped:
                    self.say(f"[prebuild] {line.rstrip()} ({i}/{len(self.names)})")
            code = self.process.wait()
        if code != 0 and not self.stopped:
            self.say(f"[prebuild] the builder of {', '.join(self.names)} exited with {code} (see {errors.name})")

    def stop(self) -> None:
        self.stopped = True
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
        self.join()


_SAID: list[str] = []  # what the builders say, printed between tests (output is captured during them)


def pytest_collection_modifyitems(items: list) -> None:
    """Tests marked `early` first (in their order): they build artifacts of their own, so they keep
    this process busy while the background builders make the targets the others wait for, instead
    of running alone on one of the two cores after the builders are done."""
    items.sort(key=lambda item: item.get_closest_marker("early") is None)


def pytest_runtest_logreport(report) -> None:
    reporter = _SESSION.get("reporter")
    while _SAID and reporter is not None:
        reporter.write_line(_SAID.pop(0))


@pytest.fixture(scope="session", autouse=True)
def _prebuilt(request, tmp_path_factory):
    """Start the background builders when the session runs slow tests (they build the targets);
    AOTBUILD_TEST_PREBUILD=0 leaves them off (a few tests, each building what it needs)."""
    artifacts = _artifacts(tmp_path_factory)
    _SESSION["reporter"] = request.config.pluginmanager.get_plugin("terminalreporter")
    builders = []
    if os.environ.get("AOTBUILD_TEST_PREBUILD") != "0" and any(item.get_closest_marker("slow")
                                                                for item in request.session.items):
        _SAID.append(f"[prebuild] building {sum(map(len, PREBUILDS))} tiny targets in {len(PREBUILDS)} background "
                     f"builders (logs: {_SESSION['logs']}); the first tests wait for the targets they need")
        builders = [_Builder(names, artifacts, _SESSION["logs"], _SAID.append) for names in PREBUILDS]
        for builder in builders:
            builder.start()
    yield
    for builder in builders:
        builder.stop()


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny_target):
    """The tiny target built once: folder, manifest and the progress messages of the build."""
    return build_once(tmp_path_factory, tiny_target)


@pytest.fixture(scope="session")
def int8_target():
    from aotbuild.builder.targets import load_target

    return load_target(TARGETS / "cpu-tiny-sdxl-int8.toml")


@pytest.fixture(scope="session")
def built_int8(tmp_path_factory, int8_target):
    """cpu-tiny-sdxl-int8 (fused QKV + channels_last + int8 dynamic) built once."""
    return build_once(tmp_path_factory, int8_target)


@pytest.fixture(scope="session")
def prepack_target():
    from aotbuild.builder.targets import load_target

    return load_target(TARGETS / "cpu-tiny-sdxl-prepack.toml")


@pytest.fixture(scope="session")
def built_prepack(tmp_path_factory, prepack_target):
    """cpu-tiny-sdxl-prepack (oneDNN's packed weights made at load) built once."""
    return build_once(tmp_path_factory, prepack_target)


@pytest.fixture(scope="session")
def bf16_prepack_target():
    from aotbuild.builder.targets import load_target

    return load_target(TARGETS / "cpu-tiny-sdxl-bf16-prepack.toml")


@pytest.fixture(scope="session")
def built_bf16_prepack(tmp_path_factory, bf16_prepack_target):
    """cpu-tiny-sdxl-bf16-prepack (the AMX recipe: bf16, packed, channels_last) built once."""
    return build_once(tmp_path_factory, bf16_prepack_target)


@pytest.fixture
def artifact_copy(built, tmp_path) -> Path:
    """A private copy of the session artifact, free to damage."""
    return Path(shutil.copytree(built.folder, tmp_path / built.folder.name))


# What a typical LoRA trains: every attention projection (SD3/Flux add the context stream's).
UNET_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
TRANSFORMER_LORA_TARGETS = (*UNET_LORA_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def make_lora(pipe, folder: Path, seed: int, *, rank: int = 4, alpha: int = 8, targets=None,
              use_dora: bool = False) -> Path:
    """A random LoRA for the pipeline's denoiser, made with peft (seeded) on a copy of it and saved
    with diffusers' `save_lora_weights` (PEFT format, alpha in the metadata). Returns the file."""
    import copy

    from peft import LoraConfig, get_peft_model_state_dict

    attribute = "unet" if hasattr(pipe, "unet") else "transformer"
    denoiser = copy.deepcopy(getattr(pipe, attribute))
    targets = targets or (UNET_LORA_TARGETS if attribute == "unet" else TRANSFORMER_LORA_TARGETS)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_dora=use_dora)
    torch.manual_seed(seed)
    denoiser.add_adapter(config, adapter_name="made")
    if use_dora:  # a magnitude that differs from the weight norm, so DoRA changes the output
        for name, param in denoiser.named_parameters():
            if "lora_magnitude_vector" in name:
                param.data.mul_(1.5)
    layers = get_peft_model_state_dict(denoiser, adapter_name="made")
    metadata = {"r": rank, "lora_alpha": alpha, "target_modules": list(targets), "use_dora": use_dora}
    type(pipe).save_lora_weights(folder, **{f"{attribute}_lora_layers": layers,
                                            f"{attribute}_lora_adapter_metadata": metadata})
    return folder / "pytorch_lora_weights.safetensors"


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps `path`'s file."""
    inode = str(Path(path).stat().st_ino)
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) > 5 and fields[4] == inode:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def mapped_from(tensors, paths) -> bool:
    """Whether every tensor's memory lies in a mapping of one of these files (read from them, not
    copied or made anew)."""
    ranges = [r for path in paths for r in file_mappings(path)]
    return all(any(start <= t.data_ptr() < end for start, end in ranges) for t in tensors)
