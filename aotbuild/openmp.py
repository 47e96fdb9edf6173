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
is imported, and never where the user set either variable.
"""

from __future__ import annotations

import os

SPIN_COUNT = "GOMP_SPINCOUNT"
WAIT_POLICY = "OMP_WAIT_POLICY"
DEFAULT_SPIN_COUNT = "10000"


def spin_env() -> dict[str, str]:
    """What a process started from this one (a Ray Serve replica) is given: the user's settings
    where there are any, else the short spin."""
    given = {name: os.environ[name] for name in (SPIN_COUNT, WAIT_POLICY) if name in os.environ}
    return given or {SPIN_COUNT: DEFAULT_SPIN_COUNT}


def use_short_spin() -> None:
    """The short spin for this process (if torch is not loaded yet) and its children, unless the
    user set how OpenMP waits."""
    os.environ.update(spin_env())


def spin_setting() -> str:
    """How this process's OpenMP threads wait, as the environment says (for bench documents)."""
    given = [f"{name}={os.environ[name]}" for name in (WAIT_POLICY, SPIN_COUNT) if name in os.environ]
    return ", ".join(given) or "libgomp's default"
