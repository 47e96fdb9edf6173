"""OpenMP's thread count within a container's CPU quota (cgroup v1 and v2 files, as the kernel
writes them, in a folder of their own)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aotbuild.runtime import openmp


def _cpu_max(folder: Path, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.max").write_text(text)


def test_the_tightest_quota_of_a_cgroup_and_its_parents_rounded_up(tmp_path):
    _cpu_max(tmp_path, "max 100000\n")
    _cpu_max(tmp_path / "kube" / "pod", "150000 100000\n")
    assert openmp.quota_cpus(tmp_path, "0::/kube/pod\n") == 2
    _cpu_max(tmp_path / "kube", "50000 100000\n")  # the parent's limit binds too
    assert openmp.quota_cpus(tmp_path, "0::/kube/pod\n") == 1
    assert openmp.quota_cpus(tmp_path, "0::/\n") is None  # "max": no quota
    assert openmp.quota_cpus(tmp_path, "0::/elsewhere/not-mounted\n") is None

    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "x").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "docker" / "x" / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu,cpuacct" / "docker" / "x" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    membership = "5:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n0::/\n"
    assert openmp.quota_cpus(v1, membership) == 3
    assert openmp.quota_cpus(v1, "4:cpu,cpuacct:/\n") is None  # -1: no quota


def test_a_quota_below_the_affinity_sets_the_thread_count_unless_the_user_did(tmp_path, monkeypatch):
    # This process's own cgroups, each given a quota of one CPU in a folder of our own.
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        base = tmp_path if controllers == "" else tmp_path / controllers
        folder = base / path.lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cpu.max").write_text("100000 100000\n")
        (folder / "cpu.cfs_quota_us").write_text("100000\n")
        (folder / "cpu.cfs_period_us").write_text("100000\n")
    monkeypatch.setattr(openmp, "CGROUP_ROOT", tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert openmp.quota_cpus() == 1
    openmp.use_openmp_settings()
    expected = "1" if len(os.sched_getaffinity(0)) > 1 else None
    assert os.environ.get("OMP_NUM_THREADS") == expected
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    openmp.use_openmp_settings()
    assert os.environ["OMP_NUM_THREADS"] == "7"  # the user's own count stays


@pytest.fixture(autouse=True)
def _own_environment(monkeypatch):
    """use_openmp_settings writes the environment: a copy of it here, the real one after."""
    monkeypatch.setattr(os, "environ", dict(os.environ))


def test_import_aotbuild_before_torch_gives_the_process_the_short_spin_unless_the_user_set_one():
    import subprocess
    import sys

    def spin(code: str, **given: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in (openmp.SPIN_COUNT, openmp.WAIT_POLICY)} | given
        return subprocess.run([sys.executable, "-c", f"{code}; import os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                              env=env, capture_output=True, text=True, check=True).stdout.strip()

    assert spin("import aotbuild") == openmp.DEFAULT_SPIN_COUNT
    assert spin("import torch; import aotbuild") == "None"  # libgomp has read it already: nothing to set
    assert spin("import aotbuild", OMP_WAIT_POLICY="PASSIVE") == "None"
    assert spin("import aotbuild", GOMP_SPINCOUNT="5") == "5"
