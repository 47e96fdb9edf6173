"""The manifest: schema version, environment fingerprint, file hashes, and the checks that decide
whether an artifact fits this machine. Imported by the runtime and by commands that only read an
artifact (`inspect`): torch is imported where a check computes with it, not at import."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import CorruptArtifactError, IncompatibleArtifactError

if TYPE_CHECKING:
    import torch

MANIFEST_NAME = "manifest.json"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes a target names; `DTYPES` maps them to torch's
SCHEMA_VERSION = 3  # 2: only bound constants are stored, non-contiguous ones in memory order (constants.layouts);
# 3: batch dims in units of the call's batch over `call_batch` (guided and unguided calls), VAE parts
# 4: a regional component (compiled regions + eager code between them), or a dynamic input laid out as
# a permutation (`layout`: its dims in memory order); written only for such artifacts, so the others stay
# schema 3, readable by older runtimes, and this one reads both.
REGIONAL_SCHEMA = 4
READABLE_SCHEMAS = (SCHEMA_VERSION, REGIONAL_SCHEMA)
# x86 CPU capabilities torch reports, weakest first: code built for one runs on any later one.
CPU_ISA_ORDER = ("DEFAULT", "AVX2", "AVX512")
# Inductor compiles CPU code with -march=native: these instruction-set flags of the build machine
# must all exist where the code runs (AVX512 on Skylake-X lacks Sapphire Rapids' AMX and FP16).
ISA_FLAG_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "bmi", "amx", "popcnt", "movbe", "vnni", "sha_ni", "vaes",
                     "vpclmul", "gfni", "adx", "lzcnt", "abm")


def cpu_isa_flags() -> list[str]:
    """The instruction-set flags of this CPU (Linux x86; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return []
    return sorted({flag for flag in line.split(":", 1)[-1].split() if flag.startswith(ISA_FLAG_PREFIXES)})


def cuda_driver_version() -> str | None:
    """The CUDA version the installed NVIDIA driver supports ("12.8"); None without a driver."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def gpu_fits(built: dict[str, Any], here: dict[str, Any]) -> bool:
    """Whether kernels built on the GPU of environment `built` run on the GPU of `here`.

    SASS runs only on its own compute capability. Multi-arch kernels also carry PTX, which the
    driver JITs for any later GPU, unless the PTX is arch-specific: from 9.0 on, Triton and
    AOTInductor emit sm_90a-style PTX, so those artifacts still need their own capability. Kernels
    tuned on the build GPU may use all of its shared memory per block: the later GPU needs as much
    (an A100's 163 KiB is more than an L4's or RTX's 99 KiB).
    """
    built_cc, here_cc = built.get("gpu_capability"), here.get("gpu_capability")
    if built_cc is None or here_cc is None:
        return False
    if here_cc == built_cc:
        return True
    built_version, here_version = (tuple(int(part) for part in c.split(".")) for c in (built_cc, here_cc))
    shared = built.get("gpu_shared_memory_per_block"), here.get("gpu_shared_memory_per_block")
    enough_shared = None in shared or shared[1] >= shared[0]
    return bool(built.get("gpu_multi_arch")) and built_version < (9, 0) and here_version > built_version \
        and enough_shared


# The libraries whose code a build bakes in (diffusers' forward is traced, and a regional artifact
# runs today's forward around blocks compiled from the build's), by distribution name.
LIBRARIES = ("diffusers", "transformers", "torchao", "peft")


def library_versions() -> dict[str, str | None]:
    """The installed version of each of `LIBRARIES` (None: not installed); read from the
    installed distributions' metadata, nothing is imported."""
    from importlib import metadata

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def check_libraries(manifest: dict[str, Any]) -> None:
    """Refuse a regional artifact under another diffusers than it was built with: the code
    between its compiled blocks is diffusers' forward as installed now, and its blocks were
    compiled from the build's. A whole-model artifact holds all its compiled code itself.

    Raises:
        IncompatibleArtifactError: naming both versions.
    """
    if not any(entry.get("mode") == "regional" for entry in manifest["components"].values()):
        return
    built = (manifest["environment"].get("libraries") or {}).get("diffusers")
    here = library_versions()["diffusers"]
    if built is not None and built != here:
        raise IncompatibleArtifactError(
            "diffusers", here, built, hint=f"a regional artifact runs diffusers' own forward between its compiled "
                                           f"blocks: install diffusers=={built}, or rebuild it with this diffusers")


def reference_dtype(manifest: dict[str, Any]) -> str:
    """The dtype of the eager pipeline the build compared the artifact with: float32 unless the
    target said its own (`reference_dtype`)."""
    return manifest["target"].get("reference_dtype", "float32")


def validated_with_tf32(manifest: dict[str, Any]) -> bool:
    """Whether the artifact's CUDA code was compiled and checked with TF32 matmuls (its calls turn
    them on for their own duration, see `runtime.variant.tf32`)."""
    return manifest["environment"]["device_type"] == "cuda" and bool(
        manifest["optimizations"]["passes"].get("tf32", {}).get("enabled"))


def aotbuild_version() -> str:
    from .. import __version__

    return __version__


def environment(device: str, index: int | None = None) -> dict[str, Any]:
    """What decides whether compiled code runs here: torch build, accelerator, CPU, Python. On
    CUDA, the GPU numbered `index` (default: the current one), the one the caller will run on."""
    import torch

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "python": platform.python_version(),
        "platform": f"{sys.platform}-{platform.machine()}",
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_isa_flags(),
        "device_type": device,
        "cuda": torch.version.cuda,  # the CUDA runtime torch ships with
        "hip": getattr(torch.version, "hip", None),
        "libraries": library_versions(),
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
        env["gpu_name"] = props.name
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_memory_mib"] = props.total_memory // 2**20
        env["gpu_shared_memory_per_block"] = getattr(props, "shared_memory_per_block_optin", None)
        env["cuda_driver"] = cuda_driver_version()
    return env


def sha256_file(file: Path | BinaryIO) -> str:
    """The sha256 of a file, by its path or through a binary handle open on it (read from its start)."""
    if not hasattr(file, "read"):
        with open(file, "rb") as handle:
            return sha256_file(handle)
    file.seek(0)
    return hashlib.file_digest(file, "sha256").hexdigest()


def read_manifest(folder: Path) -> dict[str, Any]:
    """The parsed manifest of an artifact folder."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise CorruptArtifactError(f"{folder} is not an artifact: {MANIFEST_NAME} is missing",
                                   hint="build it first: aotbuild build --target NAME")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptArtifactError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CorruptArtifactError(f"{path} is not an aotbuild manifest (not a JSON object)")
    if manifest.get("schema") not in READABLE_SCHEMAS:
        raise IncompatibleArtifactError("schema", " or ".join(map(str, READABLE_SCHEMAS)), manifest.get("schema"))
    if problem := manifest_problem(manifest):
        raise CorruptArtifactError(f"{path} is damaged: {problem}",
                                   hint="rebuild the artifact (aotbuild build --force), or pull it again")
    for relative in manifest["files"]:
        check_relative_path(relative, f"{path} names a file")
    for name, entry in manifest["components"].items():
        for key in ("package", "weights"):
            check_relative_path(entry[key], f"{path} names a file")
            if entry[key] not in manifest["files"]:  # a file with no recorded hash would be trusted unchecked
                raise CorruptArtifactError(f"{path} is damaged: component {name}'s {key} {entry[key]!r} is not among "
                                           f"its files", hint="rebuild the artifact, or pull it again")
    return manifest


# What the runtime and the commands read of a manifest, by section, with its JSON type: checked
# when it is read, so a damaged or hand-edited manifest is named (the section, the key), never a
# KeyError deep inside a load or `aotbuild verify`.
MANIFEST_FIELDS: dict[str, dict[str, type]] = {
    "": {"target": dict, "source": dict, "environment": dict, "optimizations": dict, "components": dict,
         "runtime": dict, "files": dict},
    "target": {"name": str, "pipeline": str, "device": str, "dtype": str, "shapes": list, "optimize": dict},
    "source": {"id": str},
    "environment": {"torch": str, "platform": str, "cpu_isa": str, "device_type": str},
    "optimizations": {"passes": dict},
    "component": {"attribute": str, "package": str, "weights": str, "dtype": str, "config": dict, "constants": dict,
                  "variants": list},
    "variant": {"name": str, "inputs": list},
    "file": {"bytes": int, "sha256": str},
}


def missing_field(record: Any, fields: dict[str, type]) -> str | None:
    """The first of `fields` that `record` (a parsed JSON object) lacks or holds as another JSON
    type, said as "lacks 'key'" or "'key' is not a list"; None when all are there."""
    if not isinstance(record, dict):
        return "is not a JSON object"
    for key, kind in fields.items():
        if key not in record:
            return f"lacks {key!r}"
        if not isinstance(record[key], kind) or (kind is int and isinstance(record[key], bool)):
            return f"has {key!r} that is not {JSON_KINDS[kind]}"
    return None


JSON_KINDS = {dict: "an object", list: "a list", str: "a string", int: "an integer"}


def manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is missing or malformed in a manifest's structure (`MANIFEST_FIELDS`), or None."""
    if problem := missing_field(manifest, MANIFEST_FIELDS[""]):
        return f"the manifest {problem}"
    for section in ("target", "source", "environment", "optimizations"):
        if problem := missing_field(manifest[section], MANIFEST_FIELDS[section]):
            return f"its {section} {problem}"
    for name, record in manifest["files"].items():
        if problem := missing_field(record, MANIFEST_FIELDS["file"]):
            return f"file {name!r} {problem}"
    for name, entry in manifest["components"].items():
        if problem := missing_field(entry, MANIFEST_FIELDS["component"]):
            return f"component {name!r} {problem}"
        for variant in entry["variants"]:
            if problem := missing_field(variant, MANIFEST_FIELDS["variant"]):
                return f"a variant of component {name!r} {problem}"
            if not isinstance(variant.get("guards", []), list):
                return f"variant {variant['name']!r} of component {name!r} has guards that are not a list"
    return None


def check_relative_path(relative: Any, what: str) -> str:
    """`relative` when it is a plain path inside a folder: no absolute path, no empty, '.' or '..'
    component, no backslash. Every path an artifact or a Hub index names goes through here before
    it is joined to a folder or downloaded."""
    parts = relative.split("/") if isinstance(relative, str) else [""]
    if any(part in ("", ".", "..") for part in parts) or "\\" in relative:
        raise CorruptArtifactError(f"{what} outside its folder: {relative!r}")
    return relative


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    (Path(folder) / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def check_file(path: Path, record: dict[str, Any], *, hash: bool = True, handle: BinaryIO | None = None) -> None:
    """The file exists with the size the manifest records and, if `hash`, its sha256; through
    `handle` when it is open already (the very file then read), else by its path."""
    if handle is None and not path.is_file():
        raise CorruptArtifactError(f"{path} is missing from the artifact")
    size = os.fstat(handle.fileno()).st_size if handle is not None else path.stat().st_size
    if size != record["bytes"]:
        raise CorruptArtifactError(f"{path}: size is {size} bytes, the manifest says {record['bytes']}")
    if hash and (actual := sha256_file(handle if handle is not None else path)) != record["sha256"]:
        raise CorruptArtifactError(f"{path}: sha256 is {actual}, the manifest says {record['sha256']}",
                                   hint="the file was changed or damaged; rebuild or pull it again")


def verify_files(folder: Path, manifest: dict[str, Any]) -> None:
    """Every file listed in the manifest exists with its recorded size and sha256 (all hashed)."""
    for name, record in manifest["files"].items():
        check_file(Path(folder) / name, record)


def _capability_hint(built: dict[str, Any]) -> str:
    if built.get("gpu_multi_arch"):
        return ("its multi-arch kernels run only on later GPUs with as much shared memory per block, "
                "and only when built before compute capability 9.0")
    return "rebuild on this GPU, or build with gpu = { ..., multi_arch = true } on an older one"


CPU_HINT = ("rebuild it on this CPU (aotbuild build --target NAME --force), or build its target for the oldest "
            "CPU it must run on: cpu = { baseline = \"x86-64-v3\" } (every AVX2 CPU)")


def _isa_rank(isa: str) -> int:
    return CPU_ISA_ORDER.index(isa) if isa in CPU_ISA_ORDER else -1


def check_compatible(manifest: dict[str, Any], *, device: str | torch.device | None = None,
                     dtype: str | None = None, here: dict[str, Any] | None = None) -> None:
    """Refuse an artifact that cannot run here, naming the field and both values.

    Args:
        manifest: a parsed manifest.
        device: the device the caller will run on ("cpu", "cuda", "cuda:1"); defaults to the
            artifact's device type (and on CUDA the current GPU).
        dtype: the dtype the caller wants; defaults to the artifact's.
        here: the machine to check against, as `environment` describes it; defaults to this one.

    Raises:
        IncompatibleArtifactError: torch version, device type, GPU capability, CPU ISA or dtype differ.
    """
    import torch

    built = manifest["environment"]
    wanted = torch.device(device) if device is not None else None
    if here is None:
        here = environment(built["device_type"], wanted.index if wanted is not None else None)
    device = wanted.type if wanted is not None else None
    if here["torch"] != built["torch"]:
        raise IncompatibleArtifactError("torch", here["torch"], built["torch"],
                                        hint="compiled code is tied to the torch build; rebuild with this torch")
    if device is not None and device != built["device_type"]:
        raise IncompatibleArtifactError("device_type", device, built["device_type"],
                                        hint=f"load it with device={built['device_type']!r}, or build a target for "
                                             f"{device} (a copy of its target with device = \"{device}\")")
    if built["platform"] != here["platform"]:
        raise IncompatibleArtifactError("platform", here["platform"], built["platform"])
    if built["device_type"] == "cuda":
        if "gpu_capability" not in here:
            raise IncompatibleArtifactError("device_type", "cpu (no CUDA device)", "cuda",
                                            hint="run it on a machine with the GPU it was built for, or build a CPU "
                                                 "target for this machine (aotbuild targets lists the cpu-* ones)")
        if not gpu_fits(built, here):
            raise IncompatibleArtifactError("gpu_capability", here.get("gpu_capability"), built.get("gpu_capability"),
                                            hint=_capability_hint(built))
    else:
        if _isa_rank(here["cpu_isa"]) < _isa_rank(built["cpu_isa"]) or (
            _isa_rank(built["cpu_isa"]) < 0 and here["cpu_isa"] != built["cpu_isa"]
        ):
            raise IncompatibleArtifactError("cpu_isa", here["cpu_isa"], built["cpu_isa"], hint=CPU_HINT)
        missing = sorted(set(built.get("cpu_flags", [])) - set(here["cpu_flags"]))
        if missing:
            raise IncompatibleArtifactError("cpu_flags", f"a CPU without {', '.join(missing)}",
                                            "built for a CPU with them", hint=CPU_HINT)
    if dtype is not None and dtype != manifest["target"]["dtype"]:
        raise IncompatibleArtifactError("dtype", dtype, manifest["target"]["dtype"],
                                        hint=f"load it without dtype= (it runs {manifest['target']['dtype']}), or "
                                             f"build a target with dtype = \"{dtype}\"")


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # {name: torch dtype}, made on first use: reading a manifest needs no torch
        import torch

        return {dtype: getattr(torch, dtype) for dtype in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
