"""A background builder's process: `python -m tests.prebuild ARTIFACTS LOGS TARGET.toml...` builds the
targets one after another in this one process (one interpreter start and one warmed-up inductor
instead of one of each per target: ~9 s a target on a quiet machine), each build's output in
LOGS/<name>.log as `aotbuild build` writes it, and prints one line per target as it ends."""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from pathlib import Path


def main(artifacts: str, logs: str, *paths: str) -> None:
    from aotbuild.builder import build
    from aotbuild.builder.targets import load_target

    for path in paths:
        target = load_target(path)
        start = time.monotonic()
        with open(Path(logs) / f"{target.name}.log", "w") as log, contextlib.redirect_stderr(log):
            try:
                build(target, artifacts)  # progress lines on stderr: the log
                outcome = "built"
            except Exception:  # noqa: BLE001 - the test that needs the target builds it again, and says why
                traceback.print_exc()
                outcome = "failed (the test that needs it builds it again)"
        print(f"{target.name} {outcome} in {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
