"""The build's filesystem transaction: one build of a target at a time (a lock), a staging folder,
the swap into place, recovery of a swap a killed build left half done."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import BuildError
from .context import Progress, print_progress

STAGING_DIRNAME = ".staging"  # inside the artifacts folder: builds in progress, one folder per target


@contextlib.contextmanager
def target_lock(staging_root: Path, name: str, wait: float | None = None,
                 progress: Progress = print_progress) -> Iterator[Path]:
    """One build of a target at a time: an flock on `<staging>/<name>.lock`, held by the building
    process until it ends (the kernel drops it when the process dies, whatever its PID becomes).
    The holder writes who it is into the file, for a waiting build to say; a build waits `wait`
    seconds at most (None: as long as it takes). Yields the target's staging folder: whoever holds
    the lock owns everything in it, so what it finds there was left by a build that died.

    A build that ends leaves nothing behind: it removes its staging folder, then the lock file
    while it holds it, then `<staging>` if no other build uses it. A build that then locks the file
    just removed finds it is no longer the one at the path and opens the path again."""
    import json
    import socket

    path = staging_root / f"{name}.lock"
    waited_since, holder = None, ""
    while True:
        lock = _open_lock(staging_root, path)
        held = _try_lock(lock)
        if held and _is_current(lock, path):
            break
        lock.close()
        if held:  # a file a finished build removed: take the one at the path now
            continue
        if waited_since is None:
            holder = _lock_holder(path)
            limit = "" if wait is None else f" (up to {wait:g} s)"
            progress("wait", f"another build of {name} is running ({holder}); waiting for it to finish{limit}")
            waited_since = time.monotonic()
        elif wait is not None and time.monotonic() - waited_since >= wait:
            raise BuildError(f"another build of {name} is still running ({holder}) after {wait:g} s",
                             hint="let it finish, or wait longer: aotbuild build --wait SECONDS")
        time.sleep(0.25)
    staging_dir = staging_root / name
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}))
        lock.flush()
        staging_dir.mkdir(exist_ok=True)
        yield staging_dir
    finally:
        for remove in (staging_dir.rmdir, path.unlink, staging_root.rmdir):  # rmdir: only when empty
            with contextlib.suppress(OSError):
                remove()
        lock.close()


def _open_lock(staging_root: Path, path: Path) -> Any:
    """The lock file, opened for appending (never truncated before it is held: the holder's record
    stays readable); `staging_root` is made again when a finishing build removed it meanwhile."""
    while True:
        # exist_ok does not cover a folder removed between mkdir's own two checks: open then retries
        with contextlib.suppress(FileExistsError):
            staging_root.mkdir(parents=True, exist_ok=True)
        try:
            return open(path, "a+")
        except FileNotFoundError:
            continue


def _is_current(lock: Any, path: Path) -> bool:
    """Whether the open lock file is still the file at `path` (not one a finished build removed)."""
    try:
        return os.path.samestat(os.fstat(lock.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _try_lock(lock: Any) -> bool:
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_holder(path: Path) -> str:
    """Who holds a target's build lock, as its holder wrote it: "pid 123 on host-a since ...Z"."""
    import json

    try:
        record = json.loads(path.read_text())
        return f"pid {record['pid']} on {record['host']} since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a build that has not said who it is"


def replace_folder(new: Path, folder: Path, staging_dir: Path) -> None:
    """Move the complete `new` folder to `folder`, replacing what was there. The previous artifact
    is parked as `old-*/artifact` in the target's staging folder for the instant between the two
    renames; a build killed right there gets it back from `recover_stale_staging`, and one whose
    second rename fails puts it back at once (then raises the failure)."""
    old = None
    if folder.exists():
        old = Path(tempfile.mkdtemp(prefix="old-", dir=staging_dir))
        os.rename(folder, old / "artifact")
    try:
        os.rename(new, folder)
    except BaseException:
        if old is not None and not folder.exists():
            os.rename(old / "artifact", folder)
            old.rmdir()
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_stale_staging(staging_dir: Path, folder: Path) -> None:
    """Clean up after killed builds of this target (called under its lock, so every entry is from
    a build that died): put back a parked previous artifact whose replacement never arrived,
    delete partial staging folders."""
    for path in staging_dir.iterdir():
        parked = path / "artifact"
        if path.name.startswith("old-") and parked.is_dir() and not folder.exists():
            os.rename(parked, folder)
        shutil.rmtree(path, ignore_errors=True)
