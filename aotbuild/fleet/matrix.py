"""Many targets in one command (`aotbuild build --target A --target B ...`): built one after
another on this machine, or as Ray tasks (`--ray`), each placed where it can build: a CPU target
on CPUs, a CUDA target on one GPU of its target's kind (Ray's `accelerator_type`), so an H100
target never lands on an A100 node. Each target fails alone, with its error, while the others
finish; `--push` publishes each artifact from the machine that built it.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..builder.targets import Target
from ..errors import AotbuildError

# (target name, stage, message): a build's progress, tagged with its target.
MatrixProgress = Callable[[str, str, str], None]


@dataclass
class MatrixRow:
    """How one target of a matrix ended."""

    target: str
    status: str  # "built", "fresh" (already built, nothing to do) or "failed"
    node: str = "-"
    build_s: float | None = None
    bytes: int | None = None
    max_rel_error: float | None = None
    tolerance: float | None = None
    commit: str | None = None  # the Hub commit of --push
    manifest_sha256: str | None = None  # of the manifest the node wrote, to find it again from the driver
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.status == "failed"


def build_one(target: Target, artifacts_dir: Path, *, force: bool = False, allow_numerics_drift: bool = False,
              push_repo: str | None = None, wait: float | None = None,
              progress: MatrixProgress | None = None) -> MatrixRow:
    """Build (or find fresh) one target and push it when asked; every failure is the row's error."""
    from ..builder.flow import build
    from ..runtime.hub import parse_repo, push
    from ..spec.manifest import MANIFEST_NAME, sha256_file

    node = socket.gethostname()
    start = time.perf_counter()
    try:
        result = build(target, artifacts_dir, force=force, allow_numerics_drift=allow_numerics_drift, wait=wait,
                       progress=lambda stage, message: progress and progress(target.name, stage, message))
        manifest = result.manifest
        numerics = [v["numerics"] for c in manifest["components"].values() for v in c["variants"] if "numerics" in v]
        worst = max(numerics, key=lambda n: n["max_rel_error"], default={})
        row = MatrixRow(target.name, "fresh" if result.skipped else "built", node,
                        build_s=time.perf_counter() - start, bytes=sum(f["bytes"] for f in manifest["files"].values()),
                        max_rel_error=worst.get("max_rel_error"), tolerance=worst.get("tolerance"),
                        manifest_sha256=sha256_file(result.folder / MANIFEST_NAME))
        if push_repo:
            if progress:
                progress(target.name, "push", f"to {push_repo}")
            repo_id, revision = parse_repo(push_repo)
            row.commit = push(result.folder, repo_id, revision=revision).commit
        return row
    except AotbuildError as exc:
        error = exc.message + (f" (hint: {exc.hint})" if exc.hint else "")
    except Exception as exc:  # a failed target fails alone; its error is reported, not raised
        error = f"{type(exc).__name__}: {exc}"
    return MatrixRow(target.name, "failed", node, build_s=time.perf_counter() - start, error=error)


def run_matrix(targets: list[Target], artifacts_dir: Path, *, use_ray: bool = False, address: str | None = None,
               cpus: float = 1, force: bool = False, allow_numerics_drift: bool = False, push_repo: str | None = None,
               wait: float | None = None, progress: MatrixProgress | None = None) -> list[MatrixRow]:
    """Build every target, here one after another or on Ray; one row per target, in their order."""
    artifacts_dir = Path(artifacts_dir).resolve()  # workers may start elsewhere
    options = {"force": force, "allow_numerics_drift": allow_numerics_drift, "push_repo": push_repo, "wait": wait}
    if not use_ray:
        return [build_one(t, artifacts_dir, progress=progress, **options) for t in targets]
    from .cluster import ray_session

    with ray_session(address):
        rows = _run_on_ray(targets, artifacts_dir, cpus, options, progress)
    return rows if push_repo else [_check_shared(row, artifacts_dir) for row in rows]


class _ProgressLog:
    """Progress lines from the builds, held for the driver to print (a Ray actor using no CPU)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, str]] = []

    def put(self, target: str, stage: str, message: str) -> None:
        self.lines.append((target, stage, message))

    def take(self) -> list[tuple[str, str, str]]:
        lines, self.lines = self.lines, []
        return lines


def _remote_build(target: Target, artifacts_dir: Path, log: Any, options: dict[str, Any]) -> MatrixRow:
    """A build task's body: progress goes to the driver's log actor; the row names this node."""
    import ray

    row = build_one(target, artifacts_dir, progress=lambda *line: log.put.remote(*line), **options)
    row.node = f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
    return row


def task_resources(target: Target, cpus: float) -> dict[str, Any]:
    """The Ray resources one build of `target` asks for: CPUs, and for a CUDA target one GPU of
    its kind."""
    if target.device == "cuda":
        return {"num_cpus": cpus, "num_gpus": 1, "accelerator_type": target.gpu.name}
    return {"num_cpus": cpus}


def _needs(resources: dict[str, Any]) -> dict[str, float]:
    """Task options as the node resources they take."""
    from .cluster import accelerator_resource

    needs = {"CPU": resources["num_cpus"]}
    if resources.get("num_gpus"):
        needs |= {"GPU": resources["num_gpus"], accelerator_resource(resources["accelerator_type"]): 0.001}
    return needs


def _run_on_ray(targets: list[Target], artifacts_dir: Path, cpus: float, options: dict[str, Any],
                progress: MatrixProgress | None) -> list[MatrixRow]:
    import ray

    from .cluster import forwarded_env, missing_resources

    log = ray.remote(num_cpus=0)(_ProgressLog).remote()
    task = ray.remote(_remote_build)
    env = {"env_vars": forwarded_env()}
    rows: dict[int, MatrixRow] = {}
    pending: dict[Any, int] = {}
    for i, target in enumerate(targets):
        resources = task_resources(target, cpus)
        if (missing := missing_resources(_needs(resources))) is not None:
            rows[i] = MatrixRow(target.name, "failed", error=f"not scheduled: {missing}")
            if progress:
                progress(target.name, "failed", rows[i].error)
            continue
        # A failed build is reported, not retried: it would fail the same way again.
        ref = task.options(**resources, max_retries=0, runtime_env=env).remote(target, artifacts_dir, log, options)
        pending[ref] = i
        if progress:
            progress(target.name, "queued", ", ".join(f"{k}={v}" for k, v in resources.items()))
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
        for line in ray.get(log.take.remote()):
            if progress:
                progress(*line)
        for ref in done:
            i = pending.pop(ref)
            try:
                rows[i] = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the worker died (out of memory, node lost)
                rows[i] = MatrixRow(targets[i].name, "failed", error=str(exc).strip().splitlines()[0])
            if progress:
                progress(targets[i].name, rows[i].status, rows[i].error or f"on {rows[i].node}")
    ray.kill(log)
    return [rows[i] for i in range(len(targets))]


def _check_shared(row: MatrixRow, artifacts_dir: Path) -> MatrixRow:
    """A row whose artifact this machine cannot see (another node's disk) fails: without --push
    the artifacts folder must be storage every node shares."""
    from ..spec.manifest import MANIFEST_NAME, sha256_file

    if row.failed:
        return row
    manifest = artifacts_dir / row.target / MANIFEST_NAME
    if manifest.is_file() and sha256_file(manifest) == row.manifest_sha256:
        return row
    return dataclasses.replace(row, status="failed", error=f"built on {row.node}, but {manifest.parent} here does "
                               f"not hold that build: --artifacts must be storage every node shares, or give --push")


def format_rows(rows: list[MatrixRow]) -> str:
    """The summary table: one line per target, each failure's error below the table."""
    header = f"{'target':<24} {'node':<28} {'result':<7} {'time':>8} {'size':>10}  {'numerics':<22} pushed"
    lines = [header]
    for row in rows:
        size = "-" if row.bytes is None else f"{row.bytes / 2**20:.1f} MiB"
        numerics = "-" if row.max_rel_error is None else f"{row.max_rel_error:.1e} (tol {row.tolerance:g})"
        seconds = "-" if row.build_s is None else f"{row.build_s:.1f}s"
        lines.append(f"{row.target:<24} {row.node:<28} {row.status:<7} {seconds:>8} {size:>10}  {numerics:<22} "
                     f"{(row.commit or '-')[:12]}")
    failed = [row for row in rows if row.failed]
    ok = f"{len(rows) - len(failed)} of {len(rows)} targets ok"
    lines.append(ok + (f", {len(failed)} failed:" if failed else ""))
    lines += [f"  {row.target}: {row.error}" for row in failed]
    return "\n".join(lines)
