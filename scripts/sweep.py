"""Every diffusers pipeline with a denoiser, built by capture from diffusers' own tiny components and
compared with eager on the call diffusers' tests make: the table in docs/pipeline-sweep.md.

    python scripts/sweep.py run --tests DIFFUSERS/tests [--only CLASS,...] [--out sweep]
    python scripts/sweep.py table [--out sweep]      # rewrites docs/pipeline-sweep.md

`--tests` is the `tests/` folder of diffusers' source at the installed release (`git clone`, or a
snapshot); its modules import `parameterized` and `requests-mock` (`pip install` them). For each
pipeline class the installed diffusers exports whose `__init__` takes a `unet`, `transformer`,
`prior` or `decoder`, in a fresh process (`one`):
0. a pipeline aotbuild refuses by name (`pipeline_spec`) is that row;
1. its fast test's `get_dummy_components()` builds the tiny components, offline: the Hub
   repos those tests read (`hf-internal-testing/tiny-random-t5`, ...) are stood in for by this
   repo's offline tokenizers and tiny text-encoder configs (`OFFLINE_REPOS`);
2. their configs are saved as a `random:` config set, and a target is written at the size,
   frames and text length the test's call (`get_dummy_inputs`) makes;
3. the target is read (a refusal there is the row's reason), built, and the compiled pipeline
   and the eager one (the same seeded weights) run the test's call; the outputs are compared.
A result per class goes to `OUT/results/CLASS.json`; `run` skips the classes done (`--redo` not).
`table` rewrites the table it is given (`--base`, docs/pipeline-sweep.md by default: the record of
the sweeps before), each result of OUT in its row, so that a sweep of a few classes (`--only`)
updates their rows and keeps the rest.
A benchmark-like job (about a minute per class on 2 cores), not part of `make test`.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "targets" / "configs"
DENOISERS = ("unet", "transformer", "prior", "decoder")
ATOL = 1e-4  # images in [0, 1]: float32 compiled vs eager differ by ~1e-6 (tests/test_families.py)

# The Hub repos diffusers' fast tests read, and this repo's offline stand-ins: (tokenizer or processor
# folder, text encoder config) under targets/configs/. Weights are random either way.
OFFLINE_REPOS = {
    "hf-internal-testing/tiny-random-clip": ("tiny-sd15/tokenizer", "tiny-sd15/text_encoder"),
    "hf-internal-testing/tiny-random-t5": ("tiny-pixart-sigma/tokenizer", "tiny-pixart-sigma/text_encoder"),
    "hf-internal-testing/tiny-random-T5Model": ("tiny-pixart-sigma/tokenizer", "tiny-pixart-sigma/text_encoder"),
    "hf-internal-testing/tiny-random-umt5": ("tiny-wan/tokenizer", "tiny-wan/text_encoder"),
    "hf-internal-testing/tiny-random-Qwen2VLForConditionalGeneration": ("tiny-qwen-image-edit/processor",
                                                                          "tiny-qwen-image/text_encoder"),
}

# What was found looking into a row, said beside its reason in the table.
FINDINGS = {
    "StableDiffusionInpaintPipeline": "the test's mask repaints everything, so the VAE encodes an all-zero image "
                                      "laid out channels last: there eager float32's encoder is 1.2 off eager float64, "
                                      "the compiled one 3.5e-5 (GroupNorm of near-constant maps); eager is the one off",
}

# Results, from best to worst: what the table says of each.
RESULTS = {
    "matches": "builds and matches eager",
    "refused": "refused when the target is read",
    "refused-at-call": "builds; the test's call is refused",
    "build-failed": "build fails",
    "differs": "builds; differs from eager",
    "untested": "no tiny components here",
    "error": "sweep error",
}


def pipeline_classes() -> dict[str, str]:
    """Every pipeline class the installed diffusers exports with a denoiser in its `__init__`,
    and its family (the `diffusers.pipelines` subpackage it lives in)."""
    import diffusers

    found = {}
    for name in sorted(dir(diffusers)):
        try:
            cls = getattr(diffusers, name)
        except Exception:  # an optional dependency missing: not this machine's to sweep
            continue
        if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
            continue
        if any(p in inspect.signature(cls.__init__).parameters for p in DENOISERS):
            found[name] = cls.__module__.split(".")[2] if cls.__module__.startswith("diffusers.pipelines.") else "-"
    return found


def test_modules(tests: Path, class_name: str) -> list[str]:
    """The test modules (dotted, under `tests`' parent) whose classes set `pipeline_class` to it."""
    modules = []
    for path in sorted((tests / "pipelines").rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if class_name not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pipeline_class" for t in node.targets)
                    and getattr(node.value, "id", None) == class_name):
                modules.append(".".join(path.relative_to(tests.parent).with_suffix("").parts))
                break
    return modules


class OfflineHub:
    """`from_pretrained` of the repos in `OFFLINE_REPOS` read from this repo's offline configs and
    tokenizers (models get random weights from the caller's seed); any other repo is recorded."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.missing = folder, []
        for repo, (tokenizer, encoder) in OFFLINE_REPOS.items():
            local = folder / repo
            shutil.rmtree(local, ignore_errors=True)
            shutil.copytree(CONFIGS / tokenizer, local)
            shutil.copy(CONFIGS / encoder / "config.json", local / "config.json")

    def install(self) -> None:
        import transformers
        from transformers.models.auto.auto_factory import _BaseAutoModelClass

        for owner in (transformers.PreTrainedTokenizerBase, transformers.AutoTokenizer, transformers.AutoConfig,
                      transformers.PretrainedConfig, transformers.ProcessorMixin, transformers.AutoProcessor):
            self._redirect(owner, model=False)
        for owner in (transformers.PreTrainedModel, _BaseAutoModelClass):
            self._redirect(owner, model=True)

    def _redirect(self, owner: type, model: bool) -> None:
        import transformers

        original = owner.__dict__["from_pretrained"].__func__
        hub = self

        def from_pretrained(cls: type, path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path) not in OFFLINE_REPOS:
                if not Path(str(path)).exists():
                    hub.missing.append(str(path))
                return original(cls, path, *args, **kwargs)
            local = hub.folder / str(path)
            if not model:
                from aotbuild.runtime.sources import weightless

                # A processor without torchvision: its image part and tokenizer, as a config set's is read.
                return weightless(cls, local) if issubclass(cls, transformers.ProcessorMixin) else original(
                    cls, local, *args, **kwargs)
            config = transformers.AutoConfig.from_pretrained(local)
            target = cls if issubclass(cls, transformers.PreTrainedModel) else cls._model_mapping[type(config)]
            return target(config)

        owner.from_pretrained = classmethod(from_pretrained)


def fast_test(tests: Path, class_name: str) -> Any:
    """An instance of the test case of `class_name` that builds tiny components, or None."""
    import diffusers
    import torch

    sys.path.insert(0, str(tests.parent))
    cls = getattr(diffusers, class_name)
    for module_name in test_modules(tests, class_name):
        module = importlib.import_module(module_name)
        torch.use_deterministic_algorithms(False)  # diffusers' tests turn it on at import
        for case in vars(module).values():
            if (isinstance(case, type) and case.__module__ == module_name  # not a class it imports
                    and getattr(case, "pipeline_class", None) is cls
                    and hasattr(case, "get_dummy_components") and hasattr(case, "get_dummy_inputs")
                    and _takes_no_arguments(case.get_dummy_components)):  # not a base its cases call with one
                return case()
    return None


def _takes_no_arguments(method: Any) -> bool:
    parameters = list(inspect.signature(method).parameters.values())[1:]  # self
    return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in parameters)


def dummy_inputs(case: Any) -> dict[str, Any]:
    """The test's call, the same each time: some tests draw its images from torch's global generator."""
    import torch

    torch.manual_seed(0)
    takes_device = "device" in inspect.signature(case.get_dummy_inputs).parameters  # unittest-style cases do
    return case.get_dummy_inputs("cpu") if takes_device else case.get_dummy_inputs()


def to_numpy(output: Any) -> Any:
    import numpy as np
    import torch

    value = output[0] if isinstance(output, tuple) else next(iter(output.values()))
    if isinstance(value, list):
        value = [np.asarray(v) if not isinstance(v, torch.Tensor) else v.float().numpy() for v in value]
        value = np.stack(value)
    if isinstance(value, torch.Tensor):
        value = value.float().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


def picture_size(picture: Any) -> tuple[int, int]:
    """(height, width) of a PIL image, an array or a tensor (channels last or first), or of a list's first."""
    if isinstance(picture, list):
        picture = picture[0]
    if hasattr(picture, "size") and not callable(picture.size):  # PIL
        return picture.size[1], picture.size[0]
    shape = tuple(picture.shape)
    return (shape[-3], shape[-2]) if shape[-1] in (1, 3, 4) and shape[-3] not in (1, 3, 4) else (shape[-2], shape[-1])


def save_config_set(pipe: Any, folder: Path) -> None:
    """The pipeline's configs and tokenizers, without weights: a `random:` source."""
    shutil.rmtree(folder, ignore_errors=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    for weights in [*folder.rglob("*.safetensors"), *folder.rglob("*.bin"), *folder.rglob("*.safetensors.index.json")]:
        weights.unlink()


def target_text(name: str, class_name: str, components: list[str], inputs: dict[str, Any], output: Any,
                video: bool, edits: bool) -> str:
    """A target at the size (and frames, text length, guidance, other plain arguments) the test's call made."""
    import diffusers

    from aotbuild.builder.targets import CAPTURE_SETS

    parameters = inspect.signature(getattr(diffusers, class_name).__call__).parameters
    shape = output.shape  # (batch, height, width, channels), or (batch, frames, height, width, channels)
    lines = [f'name = "{name}"', f'pipeline = "{class_name}"', f'source = "random:{class_name}"', "seed = 0",
             'device = "cpu"', 'dtype = "float32"']
    default = parameters["guidance_scale"].default if "guidance_scale" in parameters else None
    scale = inputs.get("guidance_scale", default)  # a test that passes none calls at the signature's default
    guided = isinstance(scale, (int, float)) and scale > 1  # built for the test's call: one denoiser batch
    lines += [f"guidance_scale = {float(scale)}", 'guidance = "guided"'] if guided else ['guidance = "unguided"']
    lines += ["", "[components]", *(f"{component} = {{}}" for component in components)]
    lines += ["", "[[shapes]]", f"batch = {shape[0]}"]
    height, width = (shape[2], shape[3]) if video else (shape[1], shape[2])
    if shape[-1] not in (1, 3, 4):  # channels first
        height, width = shape[-2], shape[-1]
    lines += [f"height = {height}", f"width = {width}"]
    if video:
        lines.append(f"frames = {shape[1]}")
    if edits and inputs.get("image") is not None:  # an editing pipeline's bucket names the edited image's pixels
        lines.append(f"image = {list(picture_size(inputs['image']))}")
    if "max_sequence_length" in inputs:
        lines.append(f"max_sequence_length = {int(inputs['max_sequence_length'])}")

    def plain(value: Any) -> bool:
        return isinstance(value, (bool, int, float, str)) or (
            isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value))

    call = {key: list(value) if isinstance(value, tuple) else value for key, value in inputs.items()
            if key in parameters and key not in CAPTURE_SETS and key not in ("max_sequence_length", "num_frames")
            and plain(value)}
    if call:  # the test's other plain arguments (PixArt's use_resolution_binning = false)
        lines += ["", "[call]", *(f"{key} = {json.dumps(value)}" for key, value in call.items())]
    return "\n".join(lines) + "\n"


def sweep_one(tests: Path, class_name: str, out: Path) -> dict[str, Any]:
    """Build one pipeline class by capture and compare it with eager: its result row."""
    import numpy as np

    from aotbuild.builder import build
    from aotbuild.builder.targets import load_target
    from aotbuild.errors import AotbuildError, TargetError
    from aotbuild.generation.backends import prepare
    from aotbuild.spec.pipelines import pipeline_spec

    hub = OfflineHub(out / "hub")
    hub.install()
    row: dict[str, Any] = {"pipeline": class_name}
    overrides: dict[str, Any] = {}
    try:
        spec = pipeline_spec(class_name)
    except TargetError as exc:
        return row | {"result": "refused", "reason": exc.message}
    try:
        case = fast_test(tests, class_name)
    except Exception as exc:  # a test module that does not import here
        return row | {"result": "untested", "reason": f"its test module does not import: {exc}"}
    if case is None:
        return row | {"result": "untested", "reason": "diffusers' tests build no tiny components for it"}
    row["test"] = f"{type(case).__module__.removeprefix('tests.')}.{type(case).__name__}"
    try:
        components = case.get_dummy_components()
        pipe = case.pipeline_class(**components)
        pipe.set_progress_bar_config(disable=True)
        output = to_numpy(pipe(**dummy_inputs(case)))
    except Exception as exc:
        reason = f"needs {hub.missing[-1]} from the Hub" if hub.missing else f"{type(exc).__name__}: {exc}"
        return row | {"result": "untested", "reason": f"its tiny components do not run here: {reason}"[:500]}
    inputs = dummy_inputs(case)
    video = output.ndim == 5
    if video and inputs.get("num_frames", output.shape[1]) != output.shape[1]:
        # The test asks for a count the pipeline rounds (Allegro: 8 -> 5); a target asks for one it makes.
        row["call"] = f"num_frames {inputs['num_frames']} -> {output.shape[1]}, the count it makes"
        overrides["num_frames"] = output.shape[1]
    targets = out / "targets"
    try:
        save_config_set(pipe, targets / "configs" / class_name)
    except Exception as exc:  # a component transformers cannot save (DreamLite's processor)
        return row | {"result": "untested", "reason": f"its tiny components do not save here: "
                                                      f"{type(exc).__name__}: {exc}"[:500]}
    target_name = "sweep-" + class_name.lower()
    held = [name for name, component in spec.components.items() if getattr(pipe, component.attribute, None) is not None]
    text = target_text(target_name, class_name, held, inputs, output, video, spec.edits)
    (targets / f"{target_name}.toml").write_text(text)
    try:
        target = load_target(targets / f"{target_name}.toml")
    except TargetError as exc:  # its key, not this machine's path
        return row | {"result": "refused", "reason": exc.message.removeprefix(f"{targets / target_name}.toml: ")}
    start = time.perf_counter()
    try:
        build(target, out / "artifacts", force=True, progress=lambda stage, message: None)
    except AotbuildError as exc:
        return row | {"result": "build-failed", "reason": str(exc)[:500],
                      "build_s": round(time.perf_counter() - start, 1)}
    row["build_s"] = round(time.perf_counter() - start, 1)
    outputs = {}
    for backend in ("eager", "aot"):
        runnable = prepare(target, backend, out / "artifacts")
        try:
            outputs[backend] = to_numpy(runnable(**dummy_inputs(case) | overrides))
        except AotbuildError as exc:
            return row | {"result": "refused-at-call", "reason": str(exc)[:500]}
        del runnable
    error = float(np.abs(outputs["aot"] - outputs["eager"]).max())
    row["max_abs_diff"] = error
    return row | ({"result": "matches"} if error <= ATOL else
                  {"result": "differs", "reason": f"max |aot - eager| {error:.2e} > {ATOL}"})


def run(args: argparse.Namespace) -> None:
    results = args.out / "results"
    results.mkdir(parents=True, exist_ok=True)
    classes = pipeline_classes()
    chosen = args.only.split(",") if args.only else list(classes)
    for index, class_name in enumerate(chosen):
        result = results / f"{class_name}.json"
        if result.exists() and not args.redo:
            continue
        start = time.perf_counter()
        command = [sys.executable, __file__, "one", "--tests", str(args.tests), "--out", str(args.out),
                   "--pipeline", class_name]
        log = args.out / "logs" / f"{class_name}.log"
        log.parent.mkdir(exist_ok=True)
        with log.open("w") as stream:  # a session of its own: a timeout stops its compiler workers too
            process = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = process.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                code = "timeout"
        if code == "timeout":
            result.write_text(json.dumps({"pipeline": class_name, "result": "error",
                                          "reason": f"the sweep's {args.timeout:.0f} s per class ran out"}))
        elif code != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            result.write_text(json.dumps({"pipeline": class_name, "result": "error",
                                          "reason": f"exit {code}: {tail[0][:300]}"}))
        row = json.loads(result.read_text())
        row |= {"family": classes.get(class_name, "-"), "seconds": round(time.perf_counter() - start, 1)}
        result.write_text(json.dumps(row, indent=1))
        print(f"[{index + 1}/{len(chosen)}] {class_name}: {row['result']} ({row['seconds']} s) "
              f"{row.get('reason', '')[:160]}", flush=True)


def one(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        row = sweep_one(args.tests, args.pipeline, args.out)
    except Exception as exc:  # a traceback in aotbuild: the row says where
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames) if "aotbuild" in f.filename), "")
        row = {"pipeline": args.pipeline, "result": "error", "reason": f"{type(exc).__name__} at {where}: {exc}"[:500]}
        traceback.print_exc()
    row["commit"] = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                   text=True).stdout.strip()
    (args.out / "results" / f"{args.pipeline}.json").write_text(json.dumps(row, indent=1))


def table_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The rows of a table `table` printed, as results: {class: {"result", "reason", "build_s"}}
    (less the findings `table` adds to a reason), for the classes it says were swept."""
    keys = {text: key for key, text in RESULTS.items()}
    rows = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) != 5 or not cells[0].startswith("`") or cells[2] not in keys:
            continue
        class_name, reason = cells[0].strip("`"), cells[3].replace("\\|", "|")
        reason = reason.removesuffix(FINDINGS.get(class_name, "")).strip()
        rows[class_name] = {"result": keys[cells[2]], **({"reason": reason} if reason else {}),
                            **({"build_s": float(cells[4])} if cells[4] else {})}
    return rows


def table(args: argparse.Namespace) -> None:
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_table(args)
    args.base.write_text(printed.getvalue())


def print_table(args: argparse.Namespace) -> None:
    import diffusers

    classes = pipeline_classes()
    rows = table_rows(args.base) | {path.stem: json.loads(path.read_text())
                                    for path in (args.out / "results").glob("*.json")}
    counts = {key: sum(1 for c in classes if rows.get(c, {}).get("result") == key) for key in RESULTS}
    swept = sum(counts.values())
    print("# Every diffusers pipeline, built by capture\n")
    print("Generated by `python scripts/sweep.py table` from a sweep (`scripts/sweep.py run`): each pipeline class "
          "the installed diffusers exports whose `__init__` takes a `unet`, `transformer`, `prior` or `decoder`, "
          "built by capture from the tiny components of diffusers' own fast test (`get_dummy_components`, made "
          "offline) and compared with eager on that test's call (`get_dummy_inputs`), the same seeded weights "
          f"both ways, within {ATOL} (images in [0, 1]). How it is made and rerun: the script's docstring.\n")
    print("[Back to the README](../README.md) · related: [targets](targets.md#any-other-diffusers-pipeline-builds-"
          "by-capture).\n")
    print(f"diffusers {diffusers.__version__}: {len(classes)} pipeline classes with a denoiser; {swept} swept.\n")
    print("| result | pipelines |\n| --- | --- |")
    for key, text in RESULTS.items():
        print(f"| {text} | {counts[key]} |")
    print(f"| not swept yet | {len(classes) - swept} |\n")
    print("| pipeline | family | result | reason | build (s) |\n| --- | --- | --- | --- | --- |")
    for class_name, family in sorted(classes.items(), key=lambda item: (item[1], item[0])):
        row = rows.get(class_name, {})
        result = RESULTS.get(row.get("result"), "not swept yet")
        reason = " ".join(filter(None, (row.get("reason", ""), FINDINGS.get(class_name))))
        reason = reason.replace("|", "\\|").replace("\n", " ")
        print(f"| `{class_name}` | {family} | {result} | {reason} | {row.get('build_s', '')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "one", "table"):
        command = commands.add_parser(name)
        command.add_argument("--out", type=Path, default=Path("sweep"))
        if name != "table":
            command.add_argument("--tests", type=Path, required=True)
    commands.choices["run"].add_argument("--only", help="comma-separated pipeline classes (default: all)")
    commands.choices["run"].add_argument("--redo", action="store_true", help="sweep the classes done again")
    commands.choices["run"].add_argument("--timeout", type=float, default=1200, help="seconds per class")
    commands.choices["one"].add_argument("--pipeline", required=True)
    commands.choices["table"].add_argument("--base", type=Path, default=ROOT / "docs" / "pipeline-sweep.md",
                                           help="the table whose rows the results update (default: the docs')")
    args = parser.parse_args()
    {"run": run, "one": one, "table": table}[args.command](args)


if __name__ == "__main__":
    main()
