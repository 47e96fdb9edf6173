"""The `aotbuild` command. Argument handling and printing only; every AotbuildError becomes one
line on stderr (plus a hint) and a non-zero exit, with a traceback only under --debug.

One module for every command (over 500 lines): each command is its options and a call into the
package, and `--help`, the option checks done before torch is imported and the error handling are
shared; the work is in the layers below."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import click

from .benchmarking.harness import CACHE_THRESHOLD
from .errors import AotbuildError, ArgumentError

ARTIFACTS_HELP = "folder holding one artifact folder per target (env AOTBUILD_ARTIFACTS)"


def _warning_line(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> str:
    """aotbuild's own warnings as one line, like its errors (no source line of aotbuild's code)."""
    text = str(message)
    return f"warning: {text.removeprefix('aotbuild: ')}\n" if text.startswith("aotbuild: ") else \
        _FORMAT_WARNING(message, category, *args, **kwargs)


_FORMAT_WARNING = warnings.formatwarning

# What importing the libraries prints in every command, none of it actionable there (shown under
# --debug): torchao's kernels built for another Python, the checkpoint formats diffusers cannot
# register without them, torch's pytree deprecations, transformers' PIL fallback without
# torchvision (aotbuild never needs torchvision), and the libraries' FutureWarnings.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao", "transformers.utils.import_utils")


def _quiet_libraries() -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a CI timeout, `timeout`, a container stop) taken as Ctrl-C: every cleanup that
    runs on Ctrl-C runs (a build's staging folder and lock file removed), then exit 143."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        warnings.formatwarning = _warning_line
        if not ctx.params.get("debug"):
            _quiet_libraries()
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # not where the caller chose a handler
            signal.signal(signal.SIGTERM, _terminate)
        try:
            return super().invoke(ctx)
        except _Terminated:
            click.echo("error: stopped by SIGTERM; nothing was left half-written", err=True)
            ctx.exit(128 + signal.SIGTERM)
        except AotbuildError as exc:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {exc.message}", err=True)
            if exc.hint:
                click.echo(f"hint: {exc.hint}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
@click.version_option(package_name="aotbuild")
def main(debug: bool) -> None:
    """Build diffusers pipelines into ahead-of-time compiled artifacts, and run them."""
    from .runtime.openmp import use_openmp_settings

    if debug:
        os.environ.setdefault("RAY_LOGGER_LEVEL", "info")  # Ray's own lines, WARNING and up otherwise

    use_openmp_settings()  # before any command imports torch


@main.command()
@click.option("--dir", "targets_dir", type=click.Path(path_type=Path), help="targets folder (default: ./targets)")
@click.option("--check", is_flag=True, help="validate each target as a build does (reads the pipeline classes: "
                                            "seconds, not a blink)")
def targets(targets_dir: Path | None, check: bool) -> None:
    """List the targets, one line each, as their files say; exit 1 where one is invalid."""
    from .builder.targets import describe, load_target, target_files

    rows, invalid = [], []
    for path in target_files(targets_dir):
        try:
            row = describe(path)
            if check:
                load_target(path)
            rows.append(row)
        except AotbuildError as exc:
            invalid.append(exc)
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(4)]
    for row in rows:
        click.echo(" ".join(f"{field:<{width}}" for field, width in zip(row, widths, strict=False)) + f" {row[-1]}")
    for exc in invalid:
        click.echo(f"error: {exc.message}" + (f"\nhint: {exc.hint}" if exc.hint else ""), err=True)
    if invalid:
        raise SystemExit(1)


@main.command()
@click.option("--target", "target_names", multiple=True, required=True,
              help="target name in targets/ or path to a TOML file; repeat it to build several")
@click.option("--force", is_flag=True, help="rebuild even when the artifact is fresh")
@click.option("--allow-numerics-drift", is_flag=True, help="keep a build whose error exceeds its tolerance")
@click.option("--artifacts", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True,
              envvar="AOTBUILD_ARTIFACTS",
              help=ARTIFACTS_HELP + "; with --ray, storage every node shares (or give --push)")
@click.option("--ray", "use_ray", is_flag=True, help="build each target as a Ray task: CPU targets on CPUs, CUDA "
                                                     "targets on one GPU of their gpu.name kind")
@click.option("--address", help="with --ray: the Ray cluster to join (default: RAY_ADDRESS, else one `ray start` "
                                "began here, else a new local Ray)")
@click.option("--cpus", type=click.FloatRange(0, min_open=True), default=1, show_default=True,
              help="with --ray: CPUs each build reserves")
@click.option("--push", "push_repo", metavar="ORG/NAME[@BRANCH]",
              help="push each artifact to this Hub repo, from the machine that built it")
@click.option("--wait", type=click.FloatRange(0), metavar="SECONDS",
              help="how long to wait for another build of the same target to finish (default: as long as it takes)")
@click.pass_context
def build(ctx: click.Context, target_names: tuple[str, ...], force: bool, allow_numerics_drift: bool,
          artifacts: Path, use_ray: bool, address: str | None, cpus: float, push_repo: str | None,
          wait: float | None) -> None:
    """Build artifacts/<target>/ (skipped when already fresh). Several targets, --ray or --push:
    each target fails alone, a table sums them up, and the exit code is the number that failed."""
    from .builder.targets import load_target

    if (address or cpus != 1) and not use_ray:
        raise AotbuildError("--address and --cpus place builds on Ray: add --ray")
    if push_repo:
        from .runtime.hub import parse_repo

        parse_repo(push_repo)  # a malformed repo fails before any build
    targets = [load_target(name) for name in target_names]
    _say_where(target_names, artifacts)
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise AotbuildError(f"target {max(names, key=names.count)!r} is named twice")
    if len(targets) == 1 and not use_ray and not push_repo:
        from .builder.flow import build as run_build

        result = run_build(targets[0], artifacts, force=force, allow_numerics_drift=allow_numerics_drift, wait=wait)
        if result.skipped:
            click.echo(f"{result.folder}: fresh, nothing to do")
            return
        click.echo(_summary(result.folder, result.manifest))
        return
    from .fleet.matrix import format_rows, run_matrix

    rows = run_matrix(targets, artifacts, use_ray=use_ray, address=address, cpus=cpus, force=force,
                      allow_numerics_drift=allow_numerics_drift, push_repo=push_repo, wait=wait,
                      progress=lambda name, stage, msg: click.echo(f"[{name}] [{stage:>9}] {msg}", err=True))
    click.echo(format_rows(rows))
    ctx.exit(min(sum(row.failed for row in rows), 125))


@main.command()
@click.option("--target", "target_name", help="target name in targets/ or path to a TOML file")
@click.option("--artifact", help="instead of --target: an artifact folder or hf://org/name[@revision] (aot)")
@click.option("--prompt", required=True)
@click.option("--negative-prompt", help="what to steer away from (needs guidance)")
@click.option("--backend", type=click.Choice(["aot", "eager", "compile"]), default="aot", show_default=True)
@click.option("--steps", type=click.IntRange(1), default=4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--guidance-scale", type=click.FloatRange(0), help="classifier-free guidance; 1 turns it off "
                                                                 "(default: the target's)")
@click.option("--height", type=click.IntRange(1), help="pixels (default: the target's first bucket)")
@click.option("--width", type=click.IntRange(1), help="pixels (default: the target's first bucket)")
@click.option("--batch", type=click.IntRange(1), help="images per prompt (default: the target's first bucket; "
                                                      "1 with --image)")
@click.option("--frames", type=click.IntRange(1), help="a video's frames (default: the target's first bucket's)")
@click.option("--image", "images", type=click.Path(exists=True, dir_okay=False, path_type=Path), multiple=True,
              help="img2img: start from this image, or edit it (Flux Kontext, FLUX.2, Qwen-Image-Edit), or make a "
                   "video from it (Wan's image-to-video); resized to the height and width (Qwen-Image-Edit: not "
                   "resized, the pipeline sizes its call from its aspect ratio; needs the artifact's vae_encoder, "
                   "where the VAE is compiled); repeat it to edit several images together "
                   "(QwenImageEditPlusPipeline), in order")
@click.option("--strength", type=click.FloatRange(0, 1, min_open=True),
              help="img2img: how much of --image to repaint (default: the pipeline's)")
@click.option("--mask", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="inpainting: repaint --image where this mask is white, keep it where black (resized like --image); "
                   "SD3's inpainting ControlNet pipeline repaints --control-image")
@click.option("--control-image", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a ControlNet pipeline's control image (edges, depth, pose...), resized to the height and width")
@click.option("--control-mode", type=click.IntRange(min=0),
              help="a ControlNet-Union's mode for --control-image (canny, depth...: the number its model card gives)")
@click.option("--ip-adapter-image", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="the image prompt of an artifact built with an IP-Adapter (its target's ip_adapter)")
@click.option("--output", type=click.Path(path_type=Path), help="save the image (PNG, JPEG, WebP) or the video "
                                                             "(MP4); several get -0, -1 ...")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="aot on CUDA: replay static buckets as CUDA graphs (default: the target's cuda_graphs)")
@click.option("--weights", help="aot: another checkpoint of the artifact's architecture (diffusers folder or Hub "
                                "id[@revision]) to run instead of the artifact's weights")
@click.option("--lora", "loras", multiple=True, metavar="PATH[:SCALE]",
              help="aot: a LoRA (file, folder or Hub id) to apply with its weight (default 1.0); repeatable")
@click.option("--variant", help="with an hf:// repo holding several targets: the target (or variant path) to run")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              help="aot: the dtype the artifact computes, named: refuses an artifact of another, and accepts "
                   "--weights stored in another dtype running in this one (refused without it)")
@click.option("--trust-remote-code", is_flag=True, help="load an hf:// artifact's native code (compiled libraries "
                                                     "run in this process); local folders need no flag")
@click.option("--artifacts", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True,
              envvar="AOTBUILD_ARTIFACTS",
              help=ARTIFACTS_HELP)
def run(target_name: str | None, artifact: str | None, prompt: str, negative_prompt: str | None, backend: str,
        steps: int, seed: int, guidance_scale: float | None, height: int | None, width: int | None,
        batch: int | None, frames: int | None, images: tuple[Path, ...], strength: float | None,
        mask: Path | None, control_image: Path | None, control_mode: int | None, ip_adapter_image: Path | None,
        output: Path | None,
        cuda_graphs: bool | None, weights: str | None, loras: tuple[str, ...], variant: str | None,
        dtype: str | None, trust_remote_code: bool, artifacts: Path) -> None:
    """Generate an image (a video, for a video pipeline) with the artifact (aot) or the eager /
    torch.compile pipeline; with --image, img2img from it, or an edit of it where the pipeline edits
    images (Flux Kontext); with --mask too, inpainting; a ControlNet pipeline steered by
    --control-image (a ControlNet-Union's mode, --control-mode; SD3's inpainting ControlNet
    pipeline repaints it where --mask is white); an IP-Adapter's image prompt, --ip-adapter-image."""
    from .generation.media import check_video_writer, video_fps, write_video

    if target_name is not None and artifact is not None:
        raise AotbuildError(f"give --target or --artifact, not both: --target {target_name} runs the target's "
                            f"artifact in --artifacts (or its pipeline, with --backend eager|compile); --artifact "
                            f"{artifact} runs that artifact")
    if target_name is None and artifact is None:
        raise AotbuildError("give --target NAME or --artifact FOLDER|hf://org/name[@revision]")
    if artifact is not None:
        _check_artifact_argument(artifact)
    if artifact is not None and backend != "aot":
        raise AotbuildError(f"--artifact runs the artifact; --backend {backend} runs a target's pipeline: "
                            f"give --target")
    if strength is not None and not images:
        raise AotbuildError("--strength applies to img2img: give --image too")
    if mask is not None and len(images) != 1 and not (control_image and not images):
        raise AotbuildError("--mask inpaints one image: give --image once (or --control-image alone, for SD3's "
                            "inpainting ControlNet pipeline)")
    if output is not None and output.suffix.lower() not in (*IMAGE_SUFFIXES, VIDEO_SUFFIX):
        raise AotbuildError(f"--output {output}: use a .png, .jpg or .webp file name (.mp4 for a video)")
    if output is not None and not output.parent.is_dir():
        raise AotbuildError(f"--output {output}: folder {output.parent} does not exist")
    if output is not None and output.suffix.lower() == VIDEO_SUFFIX:
        check_video_writer()  # before the load and the video, not after
    if cuda_graphs is not None and backend != "aot":
        raise AotbuildError(f"--cuda-graphs/--no-cuda-graphs apply to --backend aot, not {backend}")
    if dtype is not None and backend != "aot":
        raise AotbuildError(f"--dtype names the artifact's dtype (--backend aot); --backend {backend} runs the "
                            f"target's pipeline in the target's dtype")
    if target_name is not None:  # a mistyped name or a size the model cannot make, said before torch is imported
        from .builder.targets import load_target, read_target_file, stride_of, target_file

        path = target_file(target_name)
        _say_where((target_name,), artifacts)
        raw = read_target_file(path)
        if isinstance(raw.get("shapes"), list) and raw["shapes"] and isinstance(raw["shapes"][0], dict):
            _check_made({"pipeline": raw.get("pipeline"), "shapes": raw["shapes"]}, frames, output)
        stride = stride_of(raw, path.parent) or load_target(path).stride
        for name, value in (("--height", height), ("--width", width)):
            if value is not None and value % stride:
                below = value - value % stride
                nearest = " or ".join(str(v) for v in (below, below + stride) if v > 0)
                raise ArgumentError(f"{name} {value} px is not a multiple of {stride}, the pixel stride of "
                                    f"{path.stem}'s model", hint=f"give {name} {nearest}")
        if backend == "aot":
            from .runtime.artifacts import built_artifact

            built_artifact(path.stem, artifacts)  # a target never built
    from .generation.backends import call_defaults, generate, parse_lora, prepare, prepare_artifact
    from .runtime.load import UncuratedPipelineWarning

    # Said once, by the build and `inspect`: not at every run of a pipeline built by capture.
    warnings.filterwarnings("ignore", category=UncuratedPipelineWarning)
    start = time.perf_counter()
    adapters = [parse_lora(text) for text in loras]
    if artifact is not None:
        pipe, recorded = prepare_artifact(artifact, cuda_graphs=cuda_graphs, weights=weights, loras=adapters,
                                          trust_remote_code=trust_remote_code, variant=variant, dtype=dtype)
        _check_made(recorded, frames, output)  # its manifest says what it makes
    else:
        target = load_target(path)
        recorded = target.to_dict()
        pipe = prepare(target, backend, artifacts, cuda_graphs=cuda_graphs, weights=weights, loras=adapters,
                       dtype=dtype)
    load_s = time.perf_counter() - start
    defaults = call_defaults(recorded)
    video = defaults["frames"] is not None
    if guidance_scale is None:
        guidance_scale = defaults["guidance_scale"]
    if negative_prompt is not None and guidance_scale <= 1:
        click.echo(f"note: --negative-prompt has no effect at guidance_scale {guidance_scale:g}: there is no "
                   f"unconditional pass for it to steer (diffusers ignores it too); raise --guidance-scale above 1",
                   err=True)
    gen = generate(pipe, prompt, steps=steps, seed=seed, height=height or defaults["height"],
                   width=width or defaults["width"], batch=batch or (1 if images else defaults["batch"]),
                   guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                   image=_read_images(images), strength=strength,
                   frames=frames or defaults["frames"], text=defaults["text"], built_with=defaults["call"],
                   mask=_read_picture(mask, "--mask", "L") if mask is not None else None,
                   control=_read_picture(control_image, "--control-image", "RGB") if control_image else None,
                   control_mode=control_mode,
                   image_prompt=_read_picture(ip_adapter_image, "--ip-adapter-image", "RGB") if ip_adapter_image
                   else None)
    if output:
        for i, picture in enumerate(gen.images):
            path = output if len(gen.images) == 1 else output.with_name(f"{output.stem}-{i}{output.suffix}")
            if video:
                write_video(picture, path, video_fps(type(pipe)))
            else:
                picture.save(path)
            click.echo(f"wrote {path}")
    else:
        click.echo(f"note: the {'video' if video else 'image'}s were not saved: give --output FILE."
                   f"{'mp4' if video else 'png'}", err=True)
    applied = f" loras={','.join(f'lora{i}:{scale}' for i, (_, scale) in enumerate(adapters))}" if adapters else ""
    from .spec.pipelines import edits_image

    mode = (" image-to-video" if video else " edit" if edits_image(type(pipe)) else
            " inpainting" if mask is not None else " img2img") if images else " inpainting" if mask else ""
    made = f"{len(gen.images)} video(s) of {len(gen.images[0])} frames" if video else f"{len(gen.images)} image(s)"
    click.echo(f"backend={backend}{mode}{applied} guidance_scale={guidance_scale:g} load={load_s:.2f}s "
               f"first_step={gen.first_step_s:.2f}s total={gen.total_s:.2f}s ({steps} steps, {made})")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIX = ".mp4"


def _read_images(paths: tuple[Path, ...]) -> Any:
    """--image as the call's `image`: None, one RGB image, or the list of those edited together."""
    pictures = [_read_picture(path, "--image") for path in paths]
    return pictures if len(pictures) > 1 else pictures[0] if pictures else None


def _read_picture(path: Path, option: str, mode: str = "RGB") -> Any:
    from .generation.media import read_picture

    return read_picture(path.read_bytes(), f"{option} {path}", mode)


@main.command()
@click.argument("artifact")
@click.option("--json", "as_json", is_flag=True, help="print the manifest as JSON")
def inspect(artifact: str, as_json: bool) -> None:
    """Show an artifact's manifest (a folder or hf://org/name[@revision])."""
    from .runtime import artifact_folder
    from .spec.manifest import read_manifest

    folder, found = artifact_folder(artifact, manifest_only=True)
    manifest = read_manifest(folder)
    if as_json:
        click.echo(json.dumps(manifest, indent=2))
    elif found is None:
        click.echo(_summary(folder, manifest))
    else:
        click.echo(_summary(folder, manifest) + f"\nhub        {found.repo_id}@{found.commit} "
                   f"(asked: {found.revision or 'main'}), variant {found.variant}")


@main.command()
@click.argument("artifact")
def verify(artifact: str) -> None:
    """Check hashes and fit to this machine; exits non-zero on any problem."""
    from .runtime import artifact_folder
    from .spec.manifest import read_manifest, verify_files

    folder, _ = artifact_folder(artifact)
    from .runtime import check_fit

    manifest = read_manifest(folder)
    verify_files(folder, manifest)
    check_fit(manifest)
    click.echo(f"{artifact}: ok ({len(manifest['files'])} files verified, fits this machine)")


@main.command()
@click.option("--target", "target_name", required=True, help="target name in targets/ or path to a TOML file")
@click.option("--repo", "repo_id", required=True, help="Hub repo, org/name (created if missing)")
@click.option("--revision", help="branch to commit to (created if missing)")
@click.option("--private", is_flag=True, help="create the repo private")
@click.option("--create-pr", is_flag=True, help="open a pull request instead of committing to the branch")
@click.option("--dry-run", is_flag=True, help="list the operations of the commit, upload nothing")
@click.option("--artifacts", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True,
              envvar="AOTBUILD_ARTIFACTS",
              help=ARTIFACTS_HELP)
def push(target_name: str, repo_id: str, revision: str | None, private: bool, create_pr: bool, dry_run: bool,
         artifacts: Path) -> None:
    """Upload artifacts/<target>/ to the Hub as one variant, in one commit (index and card included)."""
    from .builder.targets import load_target
    from .runtime.hub import parse_repo
    from .runtime.hub import push as run_push

    target = load_target(target_name)
    repo_id, repo_revision = parse_repo(repo_id)
    if repo_revision and revision and repo_revision != revision:
        raise AotbuildError(f"--repo names revision {repo_revision!r} and --revision {revision!r}: give one")
    revision = revision or repo_revision
    result = run_push(artifacts / target.name, repo_id, revision=revision, private=private, create_pr=create_pr,
                      dry_run=dry_run)
    for operation in [] if result.unchanged else result.operations:
        click.echo(f"  {operation}")
    if dry_run:
        click.echo(f"dry run: {len(result.operations)} operations for {repo_id}/{result.path}, nothing uploaded")
        if result.unreachable:
            click.echo(f"note: the Hub cannot be reached ({result.unreachable}): listed as for a new repo; a push "
                       f"merges index.json with the variants the repo already holds", err=True)
    else:
        click.echo(f"nothing changed: {repo_id}@{result.commit} already holds {result.path} as it is here"
                   if result.unchanged else f"pushed {result.path} to {repo_id}: {result.pr_url or result.commit_url}")


@main.command()
@click.argument("repo")
@click.option("--variant", help="a target of the repo, or a variant path (target/torchX.Y-...), instead of the "
                                "one fitting this machine")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), help="device type to fit (default: this machine's)")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), help="only a variant of this dtype")
@click.option("--trust-remote-code", is_flag=True, help="you trust the repo's native code (compiled libraries that "
                                                        "loading the artifact runs); required")
def pull(repo: str, variant: str | None, device: str | None, dtype: str | None, trust_remote_code: bool) -> None:
    """Download the variant of REPO (org/name[@revision]) that fits this machine into the HF cache."""
    from .runtime.hub import HF_PREFIX, check_trusted, resolve

    check_trusted(repo if repo.startswith(HF_PREFIX) else HF_PREFIX + repo, trust_remote_code)
    found = resolve(repo, variant=variant, device=device, dtype=dtype)
    click.echo(f"{found.repo_id}@{found.commit} {found.variant}: {found.folder}")


@main.command()
@click.option("--target", "target_name", required=True, help="target name in targets/ or path to a TOML file")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="fresh processes per case")
@click.option("--steps", type=click.IntRange(2), default=4, show_default=True, help="denoising steps per image")
@click.option("--steady", type=click.IntRange(1), default=3, show_default=True, help="steady images per process")
@click.option("--cases", help="comma-separated cases (default: eager,compile,compile-cached,aot); on request: "
                              "aot-dynamic (the dynamic model at the first bucket's shape), aot-cuda-graphs and "
                              "aot-no-cuda-graphs (CUDA targets: graphs forced on / off), aot-lora (LoRA switches), "
                              "aot-tiling (the first bucket decoded whole and by tiles), aot-regional (the target "
                              "built with [compile] mode = \"regional\"; both builds are timed afresh first), "
                              "aot-cache (First-Block Cache on the regional denoiser against uncached; a whole-model "
                              "target's regional build is made first), openvino, openvino-f32, onnxruntime (the "
                              "whole pipeline with the peer's conversion of the float32 denoiser; pip install "
                              "'aotbuild[peers]'); with "
                              "--serve: backends (default: aot,eager,compile)")
@click.option("--quick", is_flag=True, help="a first look in a few minutes: eager and aot only (unless --cases), "
                                            "1 repetition, 2 steps, 1 steady image (an option given as well wins)")
@click.option("--serve", "serve_bench", is_flag=True, help="instead: Ray Serve replica cold start, deploy to first "
                                                        "image, per backend; writes serve-bench.json")
@click.option("--load", metavar="CLIENTSxREQUESTS", help="instead: the artifact on one local Ray Serve replica "
                                                       "under this load (e.g. 4x8): unbatched, batched, LoRA churn "
                                                       "(--lora), a replica killed mid-load; writes serve-load.json")
@click.option("--lora", "loras", multiple=True, metavar="NAME=PATH[:WEIGHT]",
              help="with --load: LoRAs the requests cycle over; repeatable")
@click.option("--max-batch", type=click.IntRange(2), default=4, show_default=True,
              help="with --load: requests made together in the batched phases")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
              help="with --serve or --load")
@click.option("--component", metavar="NAME", help="instead: this component (unet, transformer, vae_decoder...) called "
                                                  "directly, every runtime in one process, round-robin: aot, the model "
                                                  "alone (aot-model), eager, and the peers openvino, openvino-f32, "
                                                  "onnxruntime (pip install 'aotbuild[peers]'); compile on request")
@click.option("--rounds", type=click.IntRange(1), default=20, show_default=True, help="with --component: timed rounds")
@click.option("--against", multiple=True, metavar="TARGET",
              help="with --component: another target of the same pipeline (another recipe of the component), "
                   "timed as case aot:TARGET beside aot; repeatable")
@click.option("--growth", metavar="TARGET,...", help="with --component: instead of timing, how cost grows from "
              "--target through these larger targets (comma-separated), read from their artifacts (their manifests and "
              "bench-<component>.json): the call's time against its work, the build's time and memory against its "
              "parameters; writes growth-<component>.json under --artifacts (--plot draws it)")
@click.option("--busy", type=click.IntRange(0), default=0, show_default=True,
              help="with --component: processes spinning on the CPU beside the timed rounds (replicas sharing cores)")
@click.option("--cache-threshold", type=click.FloatRange(0, min_open=True), default=CACHE_THRESHOLD, show_default=True,
              help="with case aot-cache: First-Block Cache's threshold (higher skips more)")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="also draw a bar chart (needs matplotlib)")
@click.option("--artifacts", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True,
              envvar="AOTBUILD_ARTIFACTS",
              help=ARTIFACTS_HELP)
def bench(target_name: str, repeats: int, steps: int, steady: int, cases: str | None, quick: bool, serve_bench: bool,
          load: str | None, loras: tuple[str, ...], max_batch: int, port: int, component: str | None, rounds: int,
          against: tuple[str, ...], growth: str | None, busy: int, cache_threshold: float, plot_path: Path | None,
          artifacts: Path) -> None:
    """Cold start, steady state and memory of each backend, side by side; writes bench.json after
    each repetition. The default (4 cases x 3 repetitions) takes 15 minutes or more on a small CPU
    target, most of it torch.compile; --quick is a first look. With --component: one component
    against the peers in one process (bench-<component>.json), --quick 5 rounds."""
    from .benchmarking.harness import BENCH_NAME, CASES, REGIONAL_CASE, plot, run_bench
    from .benchmarking.report import DEFAULT_RATIOS, REGIONAL_RATIOS, format_table
    from .builder.targets import load_target

    given = {name for name in ("repeats", "steps", "steady", "cases", "rounds", "cache_threshold", "max_batch")
             if click.get_current_context().get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE}
    if growth is not None:
        from .benchmarking.growth import growth_name, measure_growth, plot_growth
        from .benchmarking.report import format_growth_table

        if component is None or given or serve_bench or load or loras or busy or against:
            raise AotbuildError("--growth reads what was measured: it takes --target, --component, --plot and "
                                "--artifacts")
        document = measure_growth([target_name, *(_listed(growth) or ())], artifacts, component)
        click.echo(format_growth_table(document))
        click.echo(f"wrote {artifacts / growth_name(component)}")
        if plot_path:
            plot_growth(document, plot_path)
            click.echo(f"wrote {plot_path}")
        return
    if (loras or "max_batch" in given) and load is None:
        raise AotbuildError("--lora and --max-batch go with --load")
    if load is not None:
        from .benchmarking.load import SERVE_LOAD_NAME, bench_load
        from .benchmarking.report import format_load_table
        from .serving.slots import parse_adapters

        shape = re.fullmatch(r"([1-9]\d{0,3})x([1-9]\d{0,4})", load)
        if shape is None:
            raise AotbuildError(f"--load {load!r}: give CLIENTSxREQUESTS, e.g. 4x8 (4 clients, 8 requests each)")
        if serve_bench or component or plot_path or given - {"steps", "max_batch"}:
            raise AotbuildError("--load benches a served artifact; it takes --steps, --lora, --max-batch and --port")
        document = bench_load(target_name, artifacts, clients=int(shape[1]), requests=int(shape[2]),
                              steps=steps if "steps" in given else 2, max_batch=max_batch, port=port,
                              loras=parse_adapters(loras), progress=lambda msg: click.echo(f"[bench] {msg}", err=True))
        click.echo(format_load_table(document))
        click.echo(f"wrote {artifacts / document['meta']['target'] / SERVE_LOAD_NAME}")
        return
    if "cache_threshold" in given and "aot-cache" not in (_listed(cases) or ()):
        raise AotbuildError("--cache-threshold goes with case aot-cache (--cases ...,aot-cache)")
    if component is not None:
        from .benchmarking.component import component_bench_name, run_component_bench
        from .benchmarking.report import format_component_table

        if serve_bench or plot_path:
            raise AotbuildError("--component times one component; --serve and --plot bench whole pipelines")
        if given & {"repeats", "steps", "steady"}:
            raise AotbuildError("--repeats, --steps and --steady bench whole pipelines; --component takes --rounds")
        chosen = _listed(cases)
        document = run_component_bench(
            target_name, artifacts, component, rounds=5 if quick and "rounds" not in given else rounds, busy=busy,
            against=against, progress=lambda msg: click.echo(f"[bench] {msg}", err=True),
            **({"cases": chosen} if chosen else {}))
        click.echo(format_component_table(document))
        click.echo(f"wrote {artifacts / document['meta']['target'] / component_bench_name(component)}")
        return
    if busy or against or "rounds" in given:
        raise AotbuildError("--rounds, --busy and --against go with --component")
    if quick:  # what the user gave explicitly still holds
        repeats = repeats if "repeats" in given else 1
        steps = steps if "steps" in given else 2
        steady = steady if "steady" in given else 1
        cases = cases if "cases" in given else "eager,aot"

    target = load_target(target_name)
    progress = lambda msg: click.echo(f"[bench] {msg}", err=True)  # noqa: E731
    chosen = _listed(cases)
    if serve_bench:
        from .benchmarking.replicas import SERVE_BENCH_NAME, SERVE_BENCH_RATIOS, bench_replicas
        from .generation.backends import BACKENDS

        if plot_path:
            raise AotbuildError("--plot draws `aotbuild bench`, not --serve")
        document = bench_replicas(target_name, artifacts, cases=chosen or BACKENDS, repeats=repeats, steps=steps,
                                  steady=steady, port=port, progress=progress)
        click.echo(format_table(document, SERVE_BENCH_RATIOS))
        click.echo(f"wrote {artifacts / target.name / SERVE_BENCH_NAME}")
        return
    document = run_bench(target_name, artifacts, repeats=repeats, steps=steps, steady=steady, cases=chosen or CASES,
                         progress=progress, cache_threshold=cache_threshold)
    click.echo(format_table(document, REGIONAL_RATIOS if REGIONAL_CASE in document["runs"] else DEFAULT_RATIOS))
    click.echo(f"wrote {artifacts / document['meta']['target'] / BENCH_NAME}")
    if plot_path:
        plot(document, plot_path)
        click.echo(f"wrote {plot_path}")


def _listed(cases: str | None) -> tuple[str, ...] | None:
    """--cases as a tuple of names (None when not given)."""
    return tuple(c.strip() for c in cases.split(",") if c.strip()) if cases else None


@main.command()
@click.option("--artifact", required=True, help="an artifact folder or hf://org/name[@revision]")
@click.option("--replicas", type=click.IntRange(1), help="replicas to run (default 1)")
@click.option("--autoscale", metavar="MIN:MAX", help="instead of --replicas: scale between MIN and MAX replicas "
                                                     "by ongoing requests")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (0.0.0.0: every one)")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--address", help="the Ray cluster to join (default: RAY_ADDRESS, else one `ray start` began here, "
                                "else a new local Ray)")
@click.option("--cpus", type=click.FloatRange(0), default=1, show_default=True, help="CPUs each replica reserves")
@click.option("--gpus", type=click.FloatRange(0), help="GPUs each replica reserves (default: 1 for a CUDA "
                                                        "artifact folder, else 0)")
@click.option("--gpu-type", help="the GPU kind replicas need, Ray's accelerator type (default: a CUDA artifact "
                                 "folder's gpu.name)")
@click.option("--max-steps", type=click.IntRange(1), default=50, show_default=True, help="most steps a request may ask")
@click.option("--max-images", type=click.IntRange(1), default=4, show_default=True,
              help="most images a request may ask")
@click.option("--variant", help="with an hf:// repo holding several targets: the target (or variant path) to serve")
@click.option("--lora", "loras", multiple=True, metavar="NAME=PATH[:WEIGHT]",
              help="a LoRA requests may name (\"lora\": NAME): a file or folder here, or a Hub repo org/name; "
                   "WEIGHT its default weight (1); repeatable")
@click.option("--lora-slots", type=click.IntRange(1), default=4, show_default=True,
              help="LoRAs each replica keeps loaded; requests for one go to a replica holding it")
@click.option("--weights", "checkpoints", multiple=True, metavar="NAME=FOLDER-OR-HUB-ID",
              help="another checkpoint of the artifact's architecture requests may name (\"weights\": NAME); "
                   "repeatable")
@click.option("--weights-slots", type=click.IntRange(1), default=1, show_default=True,
              help="other checkpoints each replica keeps loaded beside the artifact's own weights (each is a "
                   "model's weights in memory)")
@click.option("--max-batch", type=click.IntRange(1), default=4, show_default=True,
              help="requests of one call shape made together at most (1: no batching)")
@click.option("--batch-wait-ms", type=click.FloatRange(0), default=10, show_default=True,
              help="how long a request waits for others to batch with")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              help="the dtype the artifact computes, named: refuses an artifact of another, and accepts "
                   "--weights stored in another dtype running in this one (refused without it)")
@click.option("--health-details", is_flag=True, help="GET /health also says what each replica serves, its pid, "
                                                      "memory, load times and counts (for your monitoring; off: "
                                                      "status and replica id only)")
@click.option("--trust-remote-code", is_flag=True, help="load an hf:// artifact's native code (compiled libraries "
                                                     "run in this process); local folders need no flag")
def serve(artifact: str, replicas: int | None, autoscale: str | None, host: str, port: int, address: str | None,
          cpus: float, gpus: float | None, gpu_type: str | None, max_steps: int, max_images: int,
          variant: str | None, loras: tuple[str, ...], lora_slots: int, checkpoints: tuple[str, ...],
          weights_slots: int, max_batch: int, batch_wait_ms: float, dtype: str | None, health_details: bool,
          trust_remote_code: bool) -> None:
    """Serve text-to-image (text-to-video) over HTTP on Ray Serve: each replica loads the artifact
    once; POST JSON (prompt, negative_prompt, steps, guidance_scale, height, width, seed, images,
    frames, output, image, mask, strength, lora, lora_scale, weights) to the URL, or multipart with
    image and mask files: a PNG (an MP4), or JSON; or OpenAI's images requests to
    /v1/images/generations and /v1/images/edits."""
    from .runtime.hub import check_trusted
    from .serving.application import check_port, parse_autoscale, run_server
    from .serving.slots import parse_adapters, parse_checkpoints

    if replicas is not None and autoscale is not None:
        raise AotbuildError("give --replicas or --autoscale, not both")
    check_port(host, port)
    check_trusted(artifact, trust_remote_code)
    bounds = parse_autoscale(autoscale) if autoscale else None
    adapters = parse_adapters(loras)  # a missing LoRA file fails here, not in every replica
    others = parse_checkpoints(checkpoints)
    if not artifact.startswith("hf://"):
        from .spec.manifest import read_manifest

        artifact = str(Path(artifact).resolve())  # replicas may start in another folder
        target = read_manifest(Path(artifact))["target"]  # a wrong folder fails here, not in every replica
        import diffusers

        from .spec.pipelines import control_image_argument, requires_image

        if control_image_argument(getattr(diffusers, target["pipeline"])):
            raise AotbuildError(f"{target['pipeline']} needs a control image in every call, and aotbuild serve takes "
                                f"none yet", hint="aotbuild run --control-image makes its images; in Python, "
                                                  "aotbuild.load_pipeline(artifact) takes every ControlNet call")
        if requires_image(getattr(diffusers, target["pipeline"])):
            raise AotbuildError(f"{target['pipeline']} needs an image in every call, and aotbuild serve serves "
                                f"text-to-image and text-to-video artifacts (with img2img and inpainting from "
                                f"their images)",
                                hint="aotbuild run --image makes this one's images or videos")
        if target["device"] == "cuda":
            gpus = 1 if gpus is None else gpus
            gpu_type = gpu_type or target["gpu"]["name"]
    run_server(artifact, host=host, port=port, address=address, echo=click.echo, replicas=replicas or 1,
               autoscale=bounds, cpus=cpus, gpus=gpus or 0, gpu_type=gpu_type, max_steps=max_steps,
               max_images=max_images, trust_remote_code=trust_remote_code, variant=variant, loras=adapters,
               lora_slots=lora_slots, checkpoints=others, weights_slots=weights_slots, max_batch=max_batch,
               batch_wait_s=batch_wait_ms / 1000, dtype=dtype, health_details=health_details)


@main.command()
@click.option("--clear", is_flag=True, help="delete them all (each package is extracted, and each weights file "
                                            "hashed, again at its next load)")
def cache(clear: bool) -> None:
    """Show the cache of extracted packages the runtime loads from ($AOTBUILD_CACHE/packages)."""
    from .runtime import clear_package_cache, package_cache_usage

    root, count, size = package_cache_usage()
    click.echo(f"{root}: {count} extracted package(s), {_mib(size)}")
    if clear and count:
        click.echo(f"cleared {_mib(clear_package_cache())}")


def _say_where(target_names: tuple[str, ...], artifacts: Path) -> None:
    """Where targets given by name came from and where artifacts go, when not ./targets."""
    from .builder.targets import is_target_name, targets_dir_note

    note = targets_dir_note() if any(map(is_target_name, target_names)) else None
    if note:
        click.echo(f"note: {note}; artifacts in {artifacts.resolve()}", err=True)


def _check_artifact_argument(artifact: str) -> None:
    """`--artifact NAME` where NAME is no folder but a target's name: say what to pass instead."""
    from .builder.targets import default_targets_dir

    if not artifact.startswith("hf://") and not Path(artifact).exists() \
            and (default_targets_dir() / f"{artifact}.toml").is_file():
        raise AotbuildError(f"--artifact {artifact}: no such folder; {artifact} is a target",
                            hint=f"give --target {artifact} (it runs artifacts/{artifact}), or --artifact "
                                 f"artifacts/{artifact}")


def _check_made(recorded: dict[str, Any], frames: int | None, output: Path | None) -> None:
    """`--frames` and `--output`'s suffix against what the target or artifact makes: images or videos
    (its first bucket has frames, as `backends.call_defaults` reads it)."""
    video = recorded["shapes"][0].get("frames") is not None
    if frames is not None and not video:
        raise AotbuildError(f"--frames: {recorded['pipeline']} makes images, not videos")
    if output is not None and video != (output.suffix.lower() == VIDEO_SUFFIX):
        wanted = "videos: use a .mp4 file name" if video else "images: use a .png, .jpg or .webp file name"
        raise AotbuildError(f"--output {output}: {recorded['pipeline']} makes {wanted}")


def _dim_text(dim: Any) -> str:
    """A dim of a variant's signature: 4, 2*B, H/8, (F-1)/4+1 (a video's latent frames),
    T[16..256] (image tokens), L[128..512] (text), L[2..500]+205 (text after 205 other tokens)."""
    from .spec.pipelines import TEXT

    if isinstance(dim, int):
        return str(dim)
    if dim["axis"] == "batch":
        return "B" if dim["factor"] == 1 else f"{dim['factor']}*B"
    if dim["axis"] == "tokens":
        return f"T[{dim['min']}..{dim['max']}]"
    if dim["axis"] == TEXT:
        offset = dim.get("offset", 0)
        return f"L[{dim['min'] - offset}..{dim['max'] - offset}]" + (f"+{offset}" if offset else "")
    if dim["axis"] == "frames":
        return f"(F-1)/{dim['per']}+1"
    return f"{dim['axis'][0].upper()}/{dim['pixels']}"


def _inputs_text(inputs: list[dict[str, Any]]) -> str:
    return " ".join(f"{i['path']}=[{', '.join(map(_dim_text, i['shape'] if 'shape' in i else i['dims']))}]"
                    for i in inputs if "shape" in i or "dims" in i)


def _regions_text(component: dict[str, Any]) -> list[str]:
    """A regional component's regions: instances each serves, and each variant's block signature."""
    regions = component["regions"]
    blocks = sum(len(r["instances"]) for r in regions)
    lines = [f"    regional: {blocks} blocks in {len(regions)} regions, each compiled once per variant; the code "
             f"between blocks runs eager ({component['eager']['share']:.1%} of the parameters)"]
    for region in regions:
        instances = region["instances"]
        shown = instances[0] if len(instances) == 1 else f"{instances[0]} ... {instances[-1]}"
        lines.append(f"      {region['name']:<30} x{len(instances):<3} {shown}")
        for v in region["variants"]:
            lines.append(f"        {v['name']:<12} {_inputs_text(v['inputs'])}")
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _summary(folder: Path, m: dict[str, Any]) -> str:
    from .runtime import variant_coverage
    from .spec.manifest import reference_dtype
    from .spec.pipelines import size_arguments

    t, env = m["target"], m["environment"]
    lines = [
        f"artifact   {folder}",
        f"target     {t['name']}  ({t['pipeline']}, {t['device']}, {t['dtype']})",
        *([f"pipeline   {m['pipeline']['note']}"] if not m.get("pipeline", {}).get("curated", True) else []),
        *_eager_text(m.get("eager", {})),
        f"source     {m['source']['id']}" + (f"@{m['source']['revision']}" if m['source'].get('revision') else "")
        + (f" seed={m['source']['seed']}" if m['source'].get('seed') is not None else ""),
        f"built      {m['created']} by aotbuild {m['aotbuild']}, torch {env['torch']}, {env['platform']}, "
        f"cpu {env['cpu_isa']}" + (f", {_gpu_text(env)}" if env.get("gpu_name") else ""),
        f"passes     dtype={m['optimizations']['dtype']} "
        + " ".join(f"{k}={v}" for k, v in m["optimizations"]["passes"].items()),
        "components",
    ]
    compared = reference_dtype(m)
    reference = f" vs eager {compared}" if compared != "float32" else ""
    for name, c in m["components"].items():
        layouts = len(c["constants"].get("layouts", {}))
        lines.append(f"  {name:<12} {c['package']} + {c['weights']} ({c['constants']['count']} constants, "
                     f"{_mib(c['constants']['bytes'])}, {c['dtype']}"
                     + (f", {layouts} stored in memory order" if layouts else "") + ")")
        for v in c["variants"]:
            num = v.get("numerics", {})
            error = (f"rel.err {num.get('max_rel_error', float('nan')):.2e}"
                     + (f" L2 {num['rel_l2_error']:.2e}" if "rel_l2_error" in num else "")
                     + f" (tol {num.get('tolerance', '?')})" + reference)
            prepared = f"   {len(v['prepared'])} constants prepared at load" if v.get("prepared") else ""
            lines.append(f"    {v['name']:<12} {variant_coverage(v)}   {error}{prepared}   {_inputs_text(v['inputs'])}")
        if c.get("mode") == "regional":
            lines += _regions_text(c)
    lines.append("files")
    for name, f in m["files"].items():
        if "/" not in name or name.startswith("kernels/"):  # not the source's configs
            lines.append(f"  {name:<26} {_mib(f['bytes']):>10}  sha256 {f['sha256'][:16]}")
    total = sum(f["bytes"] for f in m["files"].values())
    lines.append(f"  {'total':<26} {_mib(total):>10}")
    if loop := m.get("validation", {}).get("loop"):
        steps = f"{loop['steps']} step{'s' * (loop['steps'] != 1)}"
        against = loop["reference"].split(",")[0]  # "eager float32", or the target's reference_dtype
        lines.append(f"loop       {steps} at {loop['at']}, compiled vs {against}: {loop['compared']} "
                     f"rel.err {loop['max_rel_error']:.2e} L2 {loop['rel_l2_error']:.2e} (tol {loop['tolerance']})")
    lines.append("timings    " + "  ".join(f"{k} {v:.1f}s" for k, v in m["timings"].items()))
    if m.get("peak_rss_mib"):
        lines.append("peak RSS   " + "  ".join(f"{k} {v / 1024:.1f} GiB" for k, v in m["peak_rss_mib"].items()))
    if m.get("peak_gpu_mib"):
        lines.append("peak GPU   " + "  ".join(f"{k} {v / 1024:.1f} GiB" for k, v in m["peak_gpu_mib"].items()))
    if m.get("runtime", {}).get("cuda_graphs"):
        lines.append("runtime    static buckets replay as CUDA graphs")
    sizes = m.get("runtime", {}).get("default_pixels") or {}
    if sizes.get("served") != sizes.get("native"):
        served = (f"{sizes['served']}x{sizes['served']} px" if sizes.get("served")
                  else f"nothing: pass {size_arguments(t['pipeline'])}")
        lines.append(f"default    pipe(prompt) without a size makes {served}: no variant covers the pipeline's own "
                     f"{sizes['native']}x{sizes['native']} px")
    return "\n".join(lines)


def _eager_text(eager: dict[str, Any]) -> list[str]:
    """eager      vae (AutoencoderKLWan) runs eager: why; measured eager float32 at build: 0.19 s decode = 24%
    of a 50-step generation at b1_32x48_9f"""
    lines = []
    for name, part in eager.items():
        shares = part.get("share", {})
        timed = ", ".join(f"{s['decode_s']:.2f} s decode = {s['share']:.0%} of a {s['steps']}-step generation at "
                          f"{bucket}" for bucket, s in shares.items())
        # artifacts built before 2026-12-07 timed it in float32, whatever the target's dtype
        dtype = next((s.get("dtype", "float32") for s in shares.values()), "")
        lines.append(f"eager      {name} ({part['class']}) runs eager: {part['reason']}"
                     + (f"; measured eager {dtype} at build: {timed}" if timed else ""))
    return lines


def _gpu_text(env: dict[str, Any]) -> str:
    """H200 sm9.0 (multi-arch), CUDA 12.8, driver 12.9, Triton 3.5, host code for any CPU of its kind."""
    text = f"{env['gpu_name']} sm{env['gpu_capability']}" + (" (multi-arch)" if env.get("gpu_multi_arch") else "")
    text += f", CUDA {env.get('cuda')}, driver {env.get('cuda_driver')}, Triton {env.get('triton')}"
    if "host_march" in env:
        text += ", host code for " + (f"-march={env['host_march']}" if env["host_march"] else "any CPU of its kind")
    return text


if __name__ == "__main__":
    sys.exit(main())
