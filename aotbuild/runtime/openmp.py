"""How long OpenMP threads spin before they sleep, in aotbuild's own processes: the command line,
its bench workers, the Ray Serve replicas.

libgomp's threads spin at each barrier for GOMP_SPINCOUNT iterations (300,000 by default) before
they sleep. When processes share cores, a spinning thread burns the time slice the thread it
waits for needs; never spinning (OMP_WAIT_POLICY=PASSIVE) pays a wake-up at every barrier, which
short parallel regions feel. Measured with `bench --component unet` (2 cores; medians; two busy
processes beside for "shared"):

| spin before sleeping | tiny SDXL, free | tiny SDXL, shared | cpu-sdxl-mid, free | cpu-sdxl-mid, shared |
| 300,000 (default) | 16.0 ms | 100 ms | 1.36 s | 3.59 s |
| 0 (PASSIVE) | 30.6 ms | 52-56 ms | 1.36 s | 2.96-3.06 s |
| 10,000 | 16.2 ms | 38-46 ms | 1.33 s | 2.86 s |

So 10,000. libgomp reads it once, when torch loads it: it is set in the environment before torch
is imported, and never where the user set either variable: by the command line, in every process
it starts, and by `import aotbuild` in a process of the user's that has not imported torch yet
(after torch, only the environment the process started with can set it).

How many threads: libgomp starts one per CPU of the process's affinity, which a container's CPU
limit (a cgroup quota: `docker --cpus 2`, a Kubernetes CPU limit) does not narrow. On a node of 64
CPUs limited to 2, 64 threads would share 2 CPUs' time, and every barrier would wait on threads the
quota has paused. So OMP_NUM_THREADS is the quota, rounded up, where it is below the affinity and
the user set no thread count.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

SPIN_COUNT = "GOMP_SPINCOUNT"
WAIT_POLICY = "OMP_WAIT_POLICY"
DEFAULT_SPIN_COUNT = "10000"


def spin_env() -> dict[str, str]:
    """What a process started from this one (a Ray Serve replica) is given: the user's settings
    where there are any, else the short spin."""
    given = {name: os.environ[name] for name in (SPIN_COUNT, WAIT_POLICY) if name in os.environ}
    return given or {SPIN_COUNT: DEFAULT_SPIN_COUNT}


def spin_before_torch() -> None:
    """The short spin for this process, where torch (and with it libgomp) is not loaded yet and
    the user set neither variable: what `import aotbuild` does."""
    if "torch" not in sys.modules:
        os.environ.update(spin_env())


THREADS = "OMP_NUM_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def use_openmp_settings() -> None:
    """The short spin and a thread count within the CPU quota for this process (if torch is not
    loaded yet) and its children, where the user set neither."""
    os.environ.update(spin_env())
    if THREADS not in os.environ and (quota := quota_cpus()) is not None and quota < len(os.sched_getaffinity(0)):
        os.environ[THREADS] = str(quota)


def quota_cpus(root: Path | None = None, membership: str | None = None) -> int | None:
    """The CPUs this process's cgroup CPU quota allows, rounded up (None: no quota). The tightest
    quota of its cgroup and every cgroup above it, v2 (`cpu.max`: "200000 100000") or v1
    (`cpu.cfs_quota_us` / `cpu.cfs_period_us`). `membership`: /proc/self/cgroup's text."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    root = root or CGROUP_ROOT
    quotas = []
    for line in membership.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, read = root, _v2_quota
        elif "cpu" in controllers.split(","):
            base, read = root / controllers, _v1_quota
        else:
            continue
        folder = base / path.lstrip("/")
        while True:
            if (quota := read(folder)) is not None:
                quotas.append(quota)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return max(1, math.ceil(min(quotas))) if quotas else None


def _v2_quota(folder: Path) -> float | None:
    try:
        limit, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        limit = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if limit <= 0 else limit / period


def spin_setting() -> str:
    """How this process's OpenMP threads wait, as the environment says (for bench documents)."""
    given = [f"{name}={os.environ[name]}" for name in (WAIT_POLICY, SPIN_COUNT) if name in os.environ]
    return ", ".join(given) or "libgomp's default"
