"""The runtime's on-disk cache, private to this user ($AOTBUILD_CACHE, else ~/.cache/aotbuild):

- `packages/<sha256>/`: each package extracted once and loaded in place by every later process;
- `verified/<sha256>-<identity>`: weights files whose sha256 was checked, by the file's identity,
  so a later load trusts the same unchanged file without reading it again.

And the check of an artifact's files before anything of it is loaded (`check_artifact_files`),
which decides what is hashed on every load and what is trusted, and why.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from ..errors import AotbuildError, CorruptArtifactError
from ..manifest import check_file

SHA256 = re.compile(r"[0-9a-f]{64}")
COMPLETE = ".complete"  # written last into an extraction: an entry without it is not trusted
# Extractions of this process where the cache cannot be written, by sha256; deleted at exit.
_PRIVATE_EXTRACTIONS: dict[str, Path] = {}


def cache_root() -> Path:
    return Path(os.environ.get("AOTBUILD_CACHE", Path.home() / ".cache" / "aotbuild"))


def package_cache_dir() -> Path:
    """Where extracted packages live: $AOTBUILD_CACHE/packages, else ~/.cache/aotbuild/packages."""
    return cache_root() / "packages"


def _writable_by_others(path: Path) -> bool:
    info = path.stat()
    return info.st_uid != os.getuid() or bool(info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def private_dir(folder: Path) -> Path:
    """`folder` (created if missing), refused when another user could put files in it: what is
    loaded from the cache is native code and trusted weights. Its parent may be shared only
    with the sticky bit (like /tmp), where no one else can replace our folder.

    Raises:
        AotbuildError: the folder or its parent is writable by other users.
        OSError: the folder cannot be created (a read-only home).
    """
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    parent = folder.parent
    unsafe = folder if _writable_by_others(folder) else None
    if unsafe is None and _writable_by_others(parent) and not parent.stat().st_mode & stat.S_ISVTX:
        unsafe = parent
    if unsafe is not None:
        raise AotbuildError(f"the aotbuild cache folder {unsafe} can be written by other users, and native code "
                            f"is loaded from it", hint=f"chmod go-w {unsafe}, or set AOTBUILD_CACHE to a folder "
                                                       f"only you can write")
    return folder


def extracted_package(package: Path, sha256: str) -> Path:
    """The package's files, extracted once per content hash and reused by every later process.

    `sha256` must be the hash of `package` as checked by the caller (never a manifest's claim):
    the cache is trusted by name. Extraction goes to a private temporary folder renamed into place
    when complete, so concurrent processes never see a partial folder; the loser of a rename race
    drops its copy. A cache that cannot be written falls back to one private extraction per
    package in this process, deleted at exit.
    """
    try:
        root = private_dir(package_cache_dir())
        folder = root / sha256
        if (folder / COMPLETE).is_file():
            return folder
        if folder.is_dir():  # unmarked: never renamed into place by an extraction, so not trusted
            _remove_entry(folder)
        staging = Path(tempfile.mkdtemp(prefix=f".{sha256[:16]}-", dir=root))
    except OSError:  # read-only home in a container
        return _private_extraction(package, sha256)
    try:
        _extract(package, staging)
        os.rename(staging, folder)
    except OSError:
        if not (folder / COMPLETE).is_file():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _private_extraction(package: Path, sha256: str) -> Path:
    if sha256 not in _PRIVATE_EXTRACTIONS:
        folder = Path(tempfile.mkdtemp(prefix=f"aotbuild-{sha256[:16]}-"))
        atexit.register(shutil.rmtree, folder, True)  # loaded libraries stay mapped after the unlink
        _extract(package, folder)
        _PRIVATE_EXTRACTIONS[sha256] = folder
    return _PRIVATE_EXTRACTIONS[sha256]


def _extract(package: Path, into: Path) -> None:
    try:
        with zipfile.ZipFile(package) as archive:
            archive.extractall(into)  # zipfile drops absolute and '..' member paths
    except zipfile.BadZipFile:
        raise CorruptArtifactError(f"{package} is not a valid package archive") from None
    (into / COMPLETE).touch()


def _cache_entries(root: Path) -> list[Path]:
    """The extracted packages (named by their sha256; extractions in progress are dot-named)."""
    return [p for p in root.iterdir() if SHA256.fullmatch(p.name)] if root.is_dir() else []


def _bytes_under(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # removed by a concurrent clear
            total += path.stat().st_size if path.is_file() else 0
    return total


def package_cache_usage() -> tuple[Path, int, int]:
    """(cache folder, extracted packages in it, their bytes)."""
    root = package_cache_dir()
    entries = _cache_entries(root)
    return root, len(entries), sum(_bytes_under(entry) for entry in entries)


def clear_package_cache() -> int:
    """Delete every extracted package (each is extracted again at its next load) and every record
    of verified weights (each file is hashed again at its next load); returns the bytes freed. Each
    package is renamed aside before it is deleted, so a loader sees it whole or not at all;
    processes that already loaded one keep their mapped libraries."""
    shutil.rmtree(cache_root() / "verified", ignore_errors=True)
    return sum(_remove_entry(entry) for entry in _cache_entries(package_cache_dir()))


def _remove_entry(entry: Path) -> int:
    """Rename a cache entry aside (a dot-name no loader looks at), then delete it; its bytes, or 0
    when it was gone already or not ours to move."""
    doomed = entry.parent / f".deleting-{entry.name}-{os.getpid()}"
    try:
        os.rename(entry, doomed)
    except OSError:
        return 0
    size = _bytes_under(doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return size


def _identity(path: Path) -> str:
    """What changes when the file does: a rewrite, a replacement or a copy changes one of these
    (the change time cannot be set back by a user, unlike the modification time)."""
    info = path.stat()
    return f"{info.st_dev}-{info.st_ino}-{info.st_size}-{info.st_mtime_ns}-{info.st_ctime_ns}"


def _verified_record(path: Path, sha256: str) -> Path:
    return cache_root() / "verified" / f"{sha256}-{_identity(path)}"


def is_verified(path: Path, sha256: str) -> bool:
    """Whether this very file was hashed to `sha256` before (and the record is ours alone)."""
    record = _verified_record(path, sha256)
    return record.is_file() and not _writable_by_others(record.parent)


def mark_verified(path: Path, sha256: str) -> None:
    """Record that `path`, as it is now, hashed to `sha256` (best effort: a read-only cache only
    means hashing again next time)."""
    with contextlib.suppress(OSError, AotbuildError):
        private_dir(cache_root() / "verified")
        _verified_record(path, sha256).touch()


def hub_blob_sha256(path: Path) -> str | None:
    """The sha256 a Hugging Face cache file is stored under: huggingface_hub names each LFS blob
    by the sha256 the Hub reported for it, and reuses blobs by that name. None elsewhere."""
    real = path.resolve()
    return real.name if real.parent.name == "blobs" and SHA256.fullmatch(real.name) else None


def check_artifact_files(folder: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """Check the artifact's files before anything of it is loaded, at a cost that does not grow
    with the weights; returns {file: sha256} of the files hashed now (the packages among them).

    What is trusted, and why:
    - packages hold native code: hashed on every load (they hold code only, a few MB);
    - weights are data the code reads: hashed once, then trusted while the same file (device,
      inode, size, modification and change times) is unchanged, by a record in this user's
      private cache; a file of the Hugging Face cache is trusted when its blob's name is the
      expected sha256, as huggingface_hub itself trusts its blobs;
    - every other file (a random source's configs) is small: hashed.
    Sizes are always checked. `aotbuild verify` hashes every file.

    Raises:
        CorruptArtifactError: a file is missing, or its size or hash differs from the manifest.
    """
    weights = {entry["weights"] for entry in manifest["components"].values()}
    hashed = {}
    for name, record in manifest["files"].items():
        path = folder / name
        check_file(path, record, hash=False)
        if name in weights and (hub_blob_sha256(path) == record["sha256"] or is_verified(path, record["sha256"])):
            continue
        check_file(path, record, hash=True)
        if name in weights:
            mark_verified(path, record["sha256"])
        hashed[name] = record["sha256"]
    return hashed
