"""This process's memory, as the bench workers and the serving replicas report it."""

from __future__ import annotations


def rss_mib() -> float:
    """This process's resident memory, MiB (NaN where /proc does not say)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
