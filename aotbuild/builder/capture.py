"""Record the real calls a pipeline makes to its components, so export sees exactly what the
pipeline passes (dict inputs such as SDXL's `added_cond_kwargs` included), at each shape bucket."""

from __future__ import annotations

import contextlib
import functools
import inspect
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import BuildError
from ..spec.pipelines import FRAMES, TEXT, ComponentSpec, PipelineSpec, exact_size, per_prompt, seeded_image
from ..spec.private_apis import fake_tensor_mode, pytree


@dataclass
class CapturedCall:
    """The first call a component received: inputs as the exported module takes them, and the
    tensor it returned (the eager reference for numerics; Z-Image's transformer returns a list,
    one per image)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any

    def to(self, device: str | torch.device) -> CapturedCall:
        """The same call with every tensor on `device` (the build parks references on the host)."""
        args, kwargs, output = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device),
                                                    (self.args, self.kwargs, self.output))
        return CapturedCall(args, kwargs, output)


@dataclass
class PendingOutput:
    """A VAE decoder's output not computed yet: the call as the pipeline made it, for
    `decode_pending` (a leaf to `CapturedCall.to`: its tensors stay where the capture ran)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def tensor_shapes(call: CapturedCall) -> list[list[int]]:
    return [list(leaf.shape) for leaf in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(leaf, torch.Tensor)]


def call_batch(call: CapturedCall) -> int:
    """The batch of a call: the first dim of its first tensor (latents, images)."""
    return tensor_shapes(call)[0][0]


def detached(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def _zeros_like_call(method: Callable, args: tuple, kwargs: dict) -> Any:
    """What `method(*args, **kwargs)` returns, its structure, shapes, dtypes and devices, in zeros:
    worked out on fake tensors (no data, no arithmetic, no memory)."""
    with fake_tensor_mode() as mode:
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        fake = method(*fake_args, **fake_kwargs)
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=t.device), fake)


def _recorded_output(spec: ComponentSpec, output: Any) -> Any:
    """What a call of `spec`'s method returned, as the exported module returns it."""
    if len(spec.output_fields) > 1:  # every output (a ControlNet's residuals, at the call's scale 1)
        return tuple(output) if isinstance(output, tuple) else output.to_tuple()
    return output[0] if isinstance(output, tuple) else getattr(output, "sample", output)


@contextlib.contextmanager
def patched_methods(methods: dict[str, tuple[Any, str]],
                    wrapper: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """Within the block, each named module method is `wrapper(name, original)`, set on the instance
    with `functools.wraps` so signatures stay intact; the instance attributes are removed
    afterwards: each module is left exactly as it was found."""
    patched = []
    try:
        for name, (module, method) in methods.items():
            original = getattr(module, method)
            patched.append((module, method, method in vars(module), original))
            setattr(module, method, functools.wraps(original)(wrapper(name, original)))
        yield
    finally:
        for module, method, had_instance_attr, original in reversed(patched):
            if had_instance_attr:
                setattr(module, method, original)
            else:
                delattr(module, method)


@dataclass
class Calls:
    """How a run called a component: how many times, and the first two calls' inputs' structure
    (their tensors' shapes, the other values' types)."""

    count: int = 0
    first_two: list = field(default_factory=list)


def _structure(args: tuple, kwargs: dict) -> tuple:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return str(spec), tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in leaves)


@contextlib.contextmanager
def recording(pipe: Any, specs: list[ComponentSpec],
              counted: dict[str, Calls] | None = None) -> Iterator[dict[str, CapturedCall]]:
    """Within the block, the first call of each spec's method on the pipeline is recorded, and
    every call counted in `counted` (by spec name) when given. A VAE
    decoder's call, once every other spec's is recorded, is recorded without running, its output a
    `PendingOutput`, decoded later by `decode_pending` where the float32 denoiser no longer sits
    beside the float32 decode's activations (SDXL at 1024x1024 px: 4 GiB of them beside a 10 GiB
    UNet); the pipeline gets zeros of the decode's shape and goes on to its end (what it does after
    the decode, e.g. a PAG pipeline putting its attention processors back, still runs)."""
    calls: dict[str, CapturedCall] = {}
    by_name = {spec.name: spec for spec in specs}

    def recorder(name: str, original: Callable) -> Callable:
        spec = by_name[name]

        def record(*args: Any, **kwargs: Any) -> Any:
            if counted is not None:
                seen = counted.setdefault(name, Calls())
                seen.count += 1
                if len(seen.first_two) < 2:
                    seen.first_two.append(_structure(args, kwargs))
            last = spec.part == "decoder" and name not in calls and calls.keys() >= by_name.keys() - {name}
            # The call as made, in containers of its own: a model may empty a list it is given (the
            # UNet pops a T2I-Adapter's `down_intrablock_additional_residuals` block by block).
            args_made, kwargs_made = _containers_copied((args, kwargs))
            output = _zeros_like_call(original, args, kwargs) if last else original(*args, **kwargs)
            args, kwargs = args_made, kwargs_made
            if name not in calls:
                call_args, call_kwargs = spec.call_inputs(args, kwargs)
                reference = output
                if not last and spec.finish is not None and _plain(call_kwargs) != _plain(kwargs):
                    # The model is compiled for another call than this one (a ControlNet at conditioning
                    # scale 1, the call at img2img's 0.8; the stand-in scales after it): its reference
                    # is that call's output.
                    with torch.no_grad():
                        again_args, again_kwargs = _containers_copied((call_args, call_kwargs))
                        reference = original(*again_args, **again_kwargs)
                sample = (PendingOutput(*detached((args, kwargs))) if last
                          else detached(_recorded_output(spec, reference)))
                calls[name] = CapturedCall(tuple(detached(call_args)), dict(detached(call_kwargs)), sample)
            return output

        return record

    with patched_methods({spec.name: (getattr(pipe, spec.attribute), spec.method) for spec in specs}, recorder):
        yield calls


def _containers_copied(tree: Any) -> Any:
    """`tree` in new lists, tuples and dicts, the same tensors and values in them."""
    return pytree.tree_map(lambda leaf: leaf, tree)


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's keyword arguments that hold no tensor: its Python values."""
    return {key: value for key, value in kwargs.items()
            if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))}


@contextlib.contextmanager
def timed(methods: dict[str, tuple[torch.nn.Module, str]]) -> Iterator[dict[str, float]]:
    """Within the block, the seconds spent in each named module method, summed over its calls
    (the device synchronized around each)."""
    import time

    seconds = dict.fromkeys(methods, 0.0)
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)

    def timer(name: str, original: Callable) -> Callable:
        def timing(*args: Any, **kwargs: Any) -> Any:
            sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sync()
                seconds[name] += time.perf_counter() - start

        return timing

    with patched_methods(methods, timer):
        yield seconds


PROMPT = "a photo of a red fox in the snow"
# Denoising steps a capture runs: one, unless a model is first called later (Wan 2.2's low-noise
# expert takes over from the high-noise one at boundary_ratio of the schedule).
CAPTURE_STEPS = (1, 2, 4, 8, 16)


def capture_prompt(text: int | None) -> str:
    """The prompt captures use: at a text length, `text` words, each a token or more, so that the
    prompt fills `max_sequence_length` tokens also where the pipeline hands the denoiser only the
    prompt's real tokens (Qwen-Image, Z-Image: trimmed to `text`), and where it trims nothing
    (Qwen-Image-Edit: the prompt's tokens follow the edited image's) the sequence moves one token
    per word, so that its offset from the text length is found."""
    if text is None:
        return PROMPT
    words = PROMPT.split()
    return " ".join((words * (text // len(words) + 1))[:text])


@contextlib.contextmanager
def _quiet_truncation() -> Iterator[None]:
    """diffusers warns of every truncated prompt (CLIP's 77 tokens): capture prompts are meant to be."""
    from diffusers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def encode_prompt(pipe: Any, pipeline: PipelineSpec, *, batch: int, guidance_scale: float,
                  device: torch.device, text: int | None = None) -> dict[str, torch.Tensor | None]:
    """The pipeline's text encoding of the capture prompt for `batch` images (padded to `text`
    tokens: `max_sequence_length`), as the keyword arguments its call takes instead of the
    prompt (so the text encoders can leave the device)."""
    parameters = inspect.signature(pipe.encode_prompt).parameters
    kwargs = {"prompt": capture_prompt(text), "device": device, per_prompt(pipe.encode_prompt): batch}
    if text is not None:
        kwargs[TEXT] = text
    kwargs |= {name: None for name in ("prompt_2", "prompt_3") if name in parameters}
    if "do_classifier_free_guidance" in parameters:
        kwargs["do_classifier_free_guidance"] = guidance_scale > 1
    with torch.no_grad(), _quiet_truncation():
        outputs = pipe.encode_prompt(**kwargs)
    return {name: value for name, value in zip(pipeline.prompt_embeds, outputs, strict=True) if name}


def capture_inputs(
    pipe: Any, specs: list[ComponentSpec], *, batch: int, height: int, width: int, guidance_scale: float,
    text: int | None = None, prompt_embeds: dict[str, torch.Tensor | None] | None = None,
    extras: dict[str, Any] | None = None, image: tuple[int, int] | None = None, frames: int | None = None,
    timed_methods: dict[str, tuple[torch.nn.Module, str]] | None = None, timings: dict[str, float] | None = None,
    per_step: dict[str, tuple[float, bool]] | None = None,
) -> dict[str, CapturedCall]:
    """Run the pipeline once (one denoising step) at this shape (`text`: its `max_sequence_length`;
    `image`: the size of the image an editing call takes; `frames`: a video's) and return the inputs of each component
    it calls (`ComponentSpec.recorded`); from `prompt_embeds` (made by `encode_prompt` for `batch`
    images) when given; `extras` are further arguments of the call (an inpainting pipeline's image
    and mask). `timings`, when given, receives the seconds spent in each of `timed_methods` during
    the run whose calls are returned, and that run's `steps`; `per_step`, how many times a step
    called each component (Wan's transformer: twice under guidance) and whether its first two calls
    were alike in structure and shapes. The run goes on past its latents only
    where it records a VAE decoder's call (not decoded there: `recording`) or times methods (an
    eager VAE's decode); else it stops at the latents where the pipeline can return them: a video
    VAE's float32 decode takes minutes at real size."""
    specs = [s for s in specs if s.recorded]
    output_type = "np" if timed_methods or any(s.part == "decoder" for s in specs) else "latent"
    arguments = call_arguments(pipe, batch=batch, height=height, width=width, guidance_scale=guidance_scale,
                               text=text, prompt_embeds=prompt_embeds, extras=extras, image=image, frames=frames)
    # A scheduler stretched to a terminal sigma (LTX-Video's shift_terminal) has no 1-step schedule.
    first = 2 if getattr(pipe.scheduler, "config", {}).get("shift_terminal") else 1
    for steps in (s for s in CAPTURE_STEPS if s >= first):
        counted: dict[str, Calls] = {}
        try:
            with recording(pipe, specs, counted) as calls, timed(timed_methods or {}) as seconds:
                run_pipeline_to(pipe, arguments, steps, output_type)
        except BuildError:
            if steps != 1 or counted:  # refused before any model was called, at 1 step: a schedule with no
                raise  # 1-step form (Mochi's divides by zero) runs at 2
            continue
        missing = [s.name for s in specs if s.name not in calls]
        if not missing:
            break
    if missing:
        raise BuildError(f"the pipeline never called {', '.join(missing)} during capture "
                         f"(runs of up to {CAPTURE_STEPS[-1]} steps)")
    if timings is not None:
        timings.update(seconds, steps=steps)
    if per_step is not None:
        per_step.update({name: (seen.count / steps, len(set(seen.first_two)) == 1) for name, seen in counted.items()})
    return calls


def decode_pending(calls: dict[str, dict[str, CapturedCall]], spec: ComponentSpec, module: torch.nn.Module) -> None:
    """Compute, with `module` (the VAE as it was captured), the outputs `recording` left pending for
    `spec` (a VAE decoder) in `calls` ({point: {component: CapturedCall}}), in place: each on the
    device of the module, then where its call's inputs wait. Points sharing a run share a decode."""
    device = next(module.parameters()).device
    done: dict[int, Any] = {}
    for point_calls in calls.values():
        call = point_calls.get(spec.name)
        if call is None or not isinstance(call.output, PendingOutput):
            continue
        where = next(t.device for t in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(t, torch.Tensor))
        if id(call.output) not in done:
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device),
                                                (call.output.args, call.output.kwargs))
            with torch.no_grad():
                output = _recorded_output(spec, getattr(module, spec.method)(*args, **kwargs))
            done[id(call.output)] = detached(output).to(where)
        point_calls[spec.name] = CapturedCall(call.args, call.kwargs, done[id(call.output)])


def call_arguments(pipe: Any, *, batch: int, height: int, width: int, guidance_scale: float,
                   text: int | None = None, prompt_embeds: dict[str, torch.Tensor | None] | None = None,
                   extras: dict[str, Any] | None = None, image: tuple[int, int] | None = None,
                   frames: int | None = None) -> dict[str, Any]:
    """The pipeline call a capture makes at this shape (see `capture_inputs`), but its steps and
    output type."""
    count = per_prompt(type(pipe).__call__)
    parameters = inspect.signature(type(pipe).__call__).parameters
    prompt: dict[str, Any] = {"prompt": capture_prompt(text), count: batch}
    if count not in parameters:  # one image per prompt
        prompt = {"prompt": [capture_prompt(text)] * batch}
    if prompt_embeds is not None:
        prompt = {**prompt_embeds, count: 1}
    if text is not None:
        prompt[TEXT] = text
    size = exact_size(type(pipe), height, width, editing=image is not None, frames=frames)
    guidance = {"guidance_scale": guidance_scale} if "guidance_scale" in parameters else {}  # FLUX.2 [klein] KV: none
    return {**prompt, **size, **({"image": seeded_image(*image)} if image else {}), **guidance, **(extras or {})}


def run_pipeline(pipe: Any, arguments: dict[str, Any], steps: int, output_type: str) -> Any:
    """The pipeline called with `call_arguments` for `steps` steps, seeded: its images (videos),
    or its final latents for `output_type="latent"`. torch's global generator is seeded too (and
    restored after): diffusers draws from it where it passes no generator (SD3's ControlNet
    pipeline samples its control image's latents so)."""
    device = getattr(pipe, "device", torch.device("cpu"))
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.no_grad(), _quiet_truncation(), torch.random.fork_rng(devices=cuda):
        torch.manual_seed(0)
        try:
            result = pipe(**arguments, num_inference_steps=steps, output_type=output_type,
                          generator=torch.Generator("cpu").manual_seed(0))
        except REFUSALS as error:  # the pipeline's own input checks (e.g. LTX-Video: sizes in 32s;
            # AnimateDiff's ControlNet pipeline: its conditioning frames, which a capture does not pass),
            # or its code failing on the call (Mochi's schedule divides by zero at 1 step). Not torch's
            # errors (a RuntimeError: a placement, a dtype, memory): those are defects, with their traceback
            if not (isinstance(error, ValueError) or _raised_by(type(pipe), error)):
                raise  # not the pipeline's refusal: a defect, with its traceback
            size = {k: v for k, v in arguments.items() if k in ("height", "width", FRAMES)}
            said = str(error) if isinstance(error, (ValueError, TypeError)) else f"{type(error).__name__}: {error}"
            raise BuildError(f"{type(pipe).__name__} refuses the call the target asks for "
                             f"({', '.join(f'{k}={v}' for k, v in size.items())}): {said}") from error
    return result.frames if hasattr(result, "frames") else result.images


# What a pipeline's own code raises on a call it does not take.
REFUSALS = (ValueError, TypeError, ArithmeticError, LookupError, AttributeError)


def _raised_by(pipeline_class: type, error: BaseException) -> bool:
    """Whether the pipeline's own code raised `error`, or binding its call's arguments did."""
    frames = traceback.extract_tb(error.__traceback__)
    return len(frames) == 1 or frames[-1].filename == inspect.getfile(pipeline_class)


def run_pipeline_to(pipe: Any, arguments: dict[str, Any], steps: int, output_type: str) -> tuple[Any, str]:
    """`run_pipeline` for `output_type`, or for images ("np") where the pipeline cannot return its
    latents: (what it returned, the output type that ran)."""
    try:
        return run_pipeline(pipe, arguments, steps, output_type), output_type
    except (BuildError, TypeError, AttributeError, KeyError):
        if output_type != "latent":
            raise
        return run_pipeline(pipe, arguments, steps, "np"), "np"


def random_call(pipe: Any, spec: ComponentSpec, batch: int, height: int, width: int,
                device: torch.device) -> CapturedCall:
    """A call the text-to-image pipeline does not make (the VAE encoder, a tile), on random
    inputs of this size in the module's dtype, seeded by the size, with the module's output."""
    module = getattr(pipe, spec.attribute)
    generator = torch.Generator("cpu").manual_seed(batch * 1_000_003 + height * 1009 + width)
    args, kwargs = spec.random_call(module, batch, height, width, generator)
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device=device, dtype=module.dtype),
                                        (args, kwargs))
    with torch.no_grad():
        output = spec.export_module(module)(*args, **kwargs)
    return CapturedCall(tuple(args), dict(kwargs), output.detach().clone())



def float_timestep(call: CapturedCall, module: torch.nn.Module) -> CapturedCall:
    """The call with an integer `timestep` made float32 (exact for any scheduler's timesteps, which
    stay far below 2**24): a model exported with integer timesteps could only take another
    scheduler's float ones by rounding them, and the runtime refuses a cast that changes a value.
    The build checks the compiled model on the reference's own timesteps, so a model that does
    not take float ones fails its numerics instead of drifting silently."""
    parameters = list(inspect.signature(module.forward).parameters)
    if "timestep" not in parameters:
        return call
    position = parameters.index("timestep")
    args, kwargs = list(call.args), dict(call.kwargs)
    if position < len(args):
        args[position] = _as_float(args[position])
    elif "timestep" in kwargs:
        kwargs["timestep"] = _as_float(kwargs["timestep"])
    return CapturedCall(tuple(args), kwargs, call.output)


def _as_float(value: Any) -> Any:
    is_integer = isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()
    return value.to(torch.float32) if is_integer else value
