"""What a replica may load beyond its artifact, and what it holds: the LoRAs (`--lora NAME=...`)
and other checkpoints (`--weights NAME=...`) requests may name, parsed and checked at start, and
the adapter slots of one pipeline (least recently used unloaded first)."""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import AotbuildError

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,63}")

LORA_SLOTS = 4  # adapters a replica keeps loaded (each is its LoRA matrices: megabytes)

WEIGHTS_SLOTS = 1  # other checkpoints a replica keeps loaded (each is a model's weights: gigabytes)

UNSET = ("", 0.0)  # an adapter state no request asks for: the pipeline's is unknown


class AdapterSlots:
    """The LoRAs a replica may serve (`--lora NAME=SOURCE[:WEIGHT]`) and the ones loaded into its
    pipeline: at most `slots`, the least recently used unloaded first. The caller holds the
    pipeline's lock: loads and switches change what the next call computes. `counts`, the
    replica's, gets the adapter loads, unloads and switches."""

    def __init__(self, pipe: Any, allowed: dict[str, tuple[str, float]], slots: int,
                 counts: dict[str, int]) -> None:
        self.pipe, self.allowed, self.slots, self.counts = pipe, allowed, slots, counts
        self.loaded: OrderedDict[str, None] = OrderedDict()
        self.active: tuple[str, float] | None = None  # what the pipeline's adapters are set to; None: off

    def activate(self, name: str | None, scale: float | None) -> None:
        """Set the pipeline to this adapter at this weight (None: no adapter), loading it first
        when it is not loaded: the fast path, a rebind of the merged weights."""
        from ..runtime.load import quiet_libraries

        wanted = None if name is None else (name, scale)
        if wanted == self.active:
            if name is not None:
                self.loaded.move_to_end(name)
            return
        self.active = UNSET  # until the pipeline is set: a failure half-way leaves it unknown
        if name is None:
            if self.loaded:
                self.pipe.disable_lora()
        else:
            if name not in self.loaded:
                if len(self.loaded) >= self.slots:
                    evicted, _ = self.loaded.popitem(last=False)
                    self.pipe.delete_adapters(evicted)
                    self.counts["adapter_unloads"] += 1
                source, _ = self.allowed[name]
                try:
                    # diffusers' and peft's notes on every load (no text encoder keys; several adapters in
                    # one model, which is what slots are) are noise here.
                    with quiet_libraries(), warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                        self.pipe.load_lora_weights(source, adapter_name=name)
                except (OSError, ValueError) as exc:  # diffusers' words for a missing or malformed LoRA
                    raise AotbuildError(f"LoRA {name!r} could not be loaded: {exc}") from None
                self.loaded[name] = None
                self.counts["adapter_loads"] += 1
            self.loaded.move_to_end(name)
            self.pipe.enable_lora()
            self.pipe.set_adapters([name], adapter_weights=[scale])
        self.active = wanted
        self.counts["adapter_switches"] += 1


def parse_adapters(texts: list[str] | tuple[str, ...]) -> dict[str, tuple[str, float]]:
    """`--lora NAME=SOURCE[:WEIGHT]` options as {name: (source, default weight)}: SOURCE a LoRA
    file or folder on this machine (it must be there) or a Hub repo `org/name`.

    Raises:
        AotbuildError: a malformed option, a name given twice, a local LoRA that is not there.
    """
    from ..generation.backends import parse_lora

    return _named_options(texts, "--lora", "PATH-OR-HUB-ID[:WEIGHT]", "lora", parse_lora)


def parse_checkpoints(texts: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`--weights NAME=SOURCE` options as {name: source}: SOURCE another checkpoint of the
    artifact's architecture, a diffusers folder on this machine (it must be one) or a Hub id
    `org/name[@revision]`.

    Raises:
        AotbuildError: a malformed option, a name given twice, a local folder that is not a checkpoint.
    """
    from ..runtime.sources import hub_id_form

    def checkpoint(source: str) -> str:
        local = Path(source).expanduser()
        if local.exists() or not hub_id_form(source):
            if not (local / "model_index.json").is_file():
                raise AotbuildError(f"--weights {source}: not a diffusers checkpoint (no model_index.json there)")
            return str(local.resolve())  # replicas may start in another folder
        return source

    return _named_options(texts, "--weights", "FOLDER-OR-HUB-ID[@REVISION]", "weights", checkpoint)


def _named_options(texts: list[str] | tuple[str, ...], option: str, form: str, field: str,
                   parse: Callable[[str], Any]) -> dict[str, Any]:
    """NAME=SOURCE options as {name: parse(SOURCE)}: the names requests send as `field`."""
    named: dict[str, Any] = {}
    for text in texts:
        name, sep, source = text.partition("=")
        if not sep or not ADAPTER_NAME.fullmatch(name) or not source:
            raise AotbuildError(f"{option} {text!r}: give NAME={form}, NAME of letters, digits, '.', '_' or '-' "
                                f"(what requests send as \"{field}\")")
        if name in named:
            raise AotbuildError(f"{option}: the name {name!r} is given twice")
        named[name] = parse(source)
    return named


def check_checkpoints(artifact: Path, checkpoints: dict[str, str], dtype: str | None) -> None:
    """Each local checkpoint a server may load fits the artifact's compiled code, by its configs
    and stored dtype (`runtime.load.check_checkpoint`), before any replica starts; a Hub one is
    checked when a request first asks for it."""
    from ..runtime.load import check_checkpoint
    from ..spec.manifest import read_manifest

    manifest = read_manifest(artifact)
    for name, source in checkpoints.items():
        if Path(source).is_dir():
            try:
                check_checkpoint(manifest, Path(source), source, dtype)
            except AotbuildError as exc:
                raise AotbuildError(f"--weights {name}: {exc.message}", hint=exc.hint) from None
