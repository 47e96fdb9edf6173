"""Where an artifact is: a local folder, or an `hf://` repo resolved to the variant that fits this
machine. No torch: commands that only read a manifest (`inspect`) and a missing folder answer at
once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import AotbuildError, ArtifactError


def artifact_folder(artifact: str | os.PathLike, *, device: str | None = None, dtype: str | None = None,
                    pipeline: str | None = None, verify: bool = False, variant: str | None = None,
                    manifest_only: bool = False) -> tuple[Path, Any]:
    """(local folder, `hub.Resolved` or None for a local folder). `hf://org/name[@revision]` is
    resolved to one commit, then to the variant fitting this machine (and `pipeline`, and
    `variant`: a target name or a variant path) in the HF cache, downloading only that variant
    (`manifest_only`: its manifest); `verify` hashes its every file (loading checks them its own way)."""
    if isinstance(artifact, str) and artifact.startswith("hf://"):
        from .hub import resolve

        resolved = resolve(artifact, device=device, dtype=dtype, pipeline=pipeline, verify=verify, variant=variant,
                           manifest_only=manifest_only)
        return resolved.folder, resolved
    folder = Path(artifact)
    if not folder.exists():
        from .sources import hub_id_form

        text = os.fspath(artifact)
        hub_like = hub_id_form(text)
        raise ArtifactError(f"no artifact at {text}: no such folder", hint=(
            f"an artifact on the Hub is named hf://{text} (a diffusers model's repo is a target's source: build "
            f"it first)" if hub_like else
            "give an artifact's folder: artifacts/NAME after `aotbuild build --target NAME`, or hf://org/name"))
    return folder, None


def built_artifact(name: str, artifacts_dir: Path) -> Path:
    """The artifact folder of the target `name` in `artifacts_dir`; an error saying how to build it
    when there is none (read before anything is imported or loaded)."""
    from ..spec.manifest import MANIFEST_NAME

    folder = artifacts_dir / name
    if not (folder / MANIFEST_NAME).is_file():
        raise AotbuildError(f"no artifact at {folder}", hint=f"build it first: aotbuild build --target {name}")
    return folder
