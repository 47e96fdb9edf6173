"""The runtime's on-disk cache, private to this user ($AOTBUILD_CACHE, else ~/.cache/aotbuild):

- `packages/<sha256>/`: each package extracted once and loaded in place by every later process;
- `verified/<sha256>-<identity>`: weights files whose sha256 was checked, by the file's identity,
  so a later load trusts the same unchanged file without reading it again;
- `hashes/<identity>`: the sha256 of a source folder's file, for a build's freshness check.

And the check of an artifact's files before anything of it is loaded (`open_artifact_files`),
which decides what is hashed on every load and what is trusted, and why.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import os
import re
import shutil
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from ..errors import AotbuildError, CorruptArtifactError
from ..spec.manifest import check_file, sha256_file

SHA256 = re.compile(r"[0-9a-f]{64}")
COMPLETE = ".complete"  # written last into an extraction: an entry without it is not trusted
# A package unpacks to at most this many times its bytes (AOTInductor stores its files uncompressed),
# and never needs refusing below the floor: a crafted archive cannot fill the disk.
MAX_UNPACKED_RATIO = 4
MAX_UNPACKED_FLOOR = 64 * 2**20
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
        if folder.is_dir():
            # An extraction is renamed into place whole, marker included: seen now, it arrived
            # since the first look (another process finished first) and is complete.
            if (folder / COMPLETE).is_file():
                return folder
            _remove_entry(folder)  # unmarked: never renamed into place by an extraction, so not trusted
        staging = Path(tempfile.mkdtemp(prefix=f".{sha256[:16]}-", dir=root))
    except OSError:  # read-only home in a container
        return _private_extraction(package, sha256)
    try:
        _extract(package, sha256, staging)
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
        _extract(package, sha256, folder)
        _PRIVATE_EXTRACTIONS[sha256] = folder
    return _PRIVATE_EXTRACTIONS[sha256]


def _extract(package: Path, sha256: str, into: Path) -> None:
    """Extract the very bytes that hash to `sha256`: the package is read once, hashed and unpacked
    from memory, so a file replaced after its check (a rebuild renaming a new artifact into place)
    can never fill the cache entry of another hash. The files it unpacks to are capped in total."""
    data = package.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CorruptArtifactError(f"{package} changed while it was loaded (its sha256 is no longer the one checked)",
                                   hint="load it again once the artifact is no longer being rebuilt or copied")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            unpacked = sum(member.file_size for member in archive.infolist())
            if unpacked > max(MAX_UNPACKED_RATIO * len(data), MAX_UNPACKED_FLOOR):
                raise CorruptArtifactError(f"{package} would unpack to {unpacked} bytes from {len(data)}: more than "
                                           f"a package of compiled code holds; it is not extracted")
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
    of verified weights and source files (each is hashed again when next needed); returns the
    bytes freed. Each
    package is renamed aside before it is deleted, so a loader sees it whole or not at all;
    processes that already loaded one keep their mapped libraries."""
    for records in ("verified", "hashes"):
        shutil.rmtree(cache_root() / records, ignore_errors=True)
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


def _identity(info: os.stat_result) -> str:
    """What changes when the file does: a rewrite, a replacement or a copy changes one of these
    (the change time cannot be set back by a user, unlike the modification time)."""
    return f"{info.st_dev}-{info.st_ino}-{info.st_size}-{info.st_mtime_ns}-{info.st_ctime_ns}"


def _verified_record(info: os.stat_result, sha256: str) -> Path:
    return cache_root() / "verified" / f"{sha256}-{_identity(info)}"


def is_verified(info: os.stat_result, sha256: str) -> bool:
    """Whether the file `info` describes was hashed to `sha256` before (and the record is ours alone)."""
    record = _verified_record(info, sha256)
    return record.is_file() and not _writable_by_others(record.parent)


def mark_verified(path: Path, sha256: str, info: os.stat_result | None = None) -> None:
    """Record that `path` (`info`: as fstat saw it), as it is now, hashed to `sha256` (best effort:
    a read-only cache only means hashing again next time)."""
    with contextlib.suppress(OSError, AotbuildError):
        private_dir(cache_root() / "verified")
        _verified_record(info or path.stat(), sha256).touch()


def file_sha256(path: Path) -> str:
    """The sha256 of a file, hashed once per file identity (the record is kept in this user's
    private cache), so an unchanged source folder is fingerprinted at the cost of its stat calls."""
    info = path.stat()
    record = cache_root() / "hashes" / _identity(info)
    with contextlib.suppress(OSError):
        if not _writable_by_others(record.parent):
            known = record.read_text().strip()
            if SHA256.fullmatch(known):
                return known
    digest = sha256_file(path)
    with contextlib.suppress(OSError, AotbuildError):
        private_dir(record.parent)
        record.write_text(digest)
    return digest


def hub_blob_sha256(real: Path) -> str | None:
    """The sha256 a Hugging Face cache file is stored under, from its real path: huggingface_hub
    names each LFS blob by the sha256 the Hub reported for it, and reuses blobs by that name. None
    elsewhere."""
    return real.name if real.parent.name == "blobs" and SHA256.fullmatch(real.name) else None


class ArtifactFiles:
    """An artifact's files as checked, each held open: what a load reads afterwards is the very
    file that was checked, even where the folder is replaced meanwhile (a rebuild renames a new
    artifact into place). `path(name)` names the open file (/proc/self/fd/N on Linux), `sha256`
    holds the hashes computed by the check (every package among them). Close it when loaded."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.sha256: dict[str, str] = {}
        self._open: dict[str, Any] = {}

    def hold(self, name: str) -> Any:
        """Open the artifact's file `name` and hold it open; a missing one is a CorruptArtifactError."""
        try:
            handle = self._open[name] = open(self.folder / name, "rb")
        except FileNotFoundError:
            raise CorruptArtifactError(f"{self.folder / name} is missing from the artifact") from None
        return handle

    def path(self, name: str) -> Path:
        handle = self._open.get(name)
        if handle is not None and os.path.isdir("/proc/self/fd"):
            return Path(f"/proc/self/fd/{handle.fileno()}")
        return self.folder / name

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()

    def __enter__(self) -> ArtifactFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_artifact_files(folder: Path, manifest: dict[str, Any], *, verify: bool = True) -> ArtifactFiles:
    """Open and check the artifact's files before anything of it is loaded, at a cost that does
    not grow with the weights.

    What is trusted, and why:
    - packages hold native code: hashed on every load (they hold code only, a few MB), and the
      extracted-package cache they are loaded from is keyed by that hash;
    - weights are data the code reads: hashed once, then trusted while the same file (device,
      inode, size, modification and change times) is unchanged, by a record in this user's
      private cache; a file of the Hugging Face cache is trusted when its blob's name is the
      expected sha256, as huggingface_hub itself trusts its blobs;
    - every other file (a random source's configs) is small: hashed.
    Sizes are always checked; each file is checked through the handle it is then read by.
    `aotbuild verify` hashes every file. `verify=False` opens the files unchecked (tests that
    alter an artifact on purpose).

    Raises:
        CorruptArtifactError: a file is missing, or its size or hash differs from the manifest.
    """
    weights = {entry["weights"] for entry in manifest["components"].values()}
    files = ArtifactFiles(folder)
    try:
        for name, record in manifest["files"].items():
            path, handle = folder / name, files.hold(name)
            if not verify:
                continue
            check_file(path, record, hash=False, handle=handle)
            info = os.fstat(handle.fileno())
            real = Path(os.path.realpath(files.path(name)))
            if name in weights and (hub_blob_sha256(real) == record["sha256"] or is_verified(info, record["sha256"])):
                continue
            check_file(path, record, handle=handle)
            if name in weights:
                mark_verified(path, record["sha256"], info)
            files.sha256[name] = record["sha256"]
    except BaseException:
        files.close()
        raise
    return files


def check_artifact_files(folder: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """`open_artifact_files`, closed again: {file: sha256} of the files hashed now.

    Raises:
        CorruptArtifactError: a file is missing, or its size or hash differs from the manifest.
    """
    with open_artifact_files(folder, manifest) as files:
        return files.sha256
