"""Publish and fetch artifacts on the Hugging Face Hub.

One repo holds many variants, each in `<target>/<variant>/` where the variant names the torch
release and machine (`torch2.13.0-cu128-sm90`, `torch2.13.0-cu128-sm80-ptx` for multi-arch kernels,
`torch2.13.0-cpu-x86_64-avx512`); `index.json` at the root lists every variant with its fingerprint,
and `README.md` is a generated model card. A push is exactly one commit (files, index and card
together); a pull downloads only the variant that fits this machine into the standard HF cache.
Tokens come from huggingface_hub's usual places and are never printed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import (
    AotbuildError,
    CorruptArtifactError,
    HubError,
    IncompatibleArtifactError,
    NoMatchingVariantError,
    UntrustedCodeError,
)
from ..spec.manifest import (
    MANIFEST_FIELDS,
    MANIFEST_NAME,
    check_compatible,
    check_relative_path,
    environment,
    missing_field,
    read_manifest,
    verify_files,
)

INDEX_NAME = "index.json"
_SAFE_PATH = re.compile(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+")  # target/variant, nothing else
CARD_NAME = "README.md"
PUSH_ATTEMPTS = 5  # commits refused because another push landed first are redone on the new head
HF_PREFIX = "hf://"


# What choosing a variant reads of each index.json entry, with its JSON type.
INDEX_FIELDS = {"path": str, "target": str, "pipeline": str, "dtype": str, "environment": dict}


def _read_index(path: Path) -> dict[str, Any]:
    """The repo's index.json, its structure checked: a malformed one is said to be, not reported
    as a failed fetch."""
    try:
        index = json.loads(path.read_text())
    except ValueError:
        index = None
    if not isinstance(index, dict) or not isinstance(index.get("variants"), list):
        raise HubError(f"{path.name} of this repo is not an aotbuild index (no list of variants)")
    for i, entry in enumerate(index["variants"]):
        problem = missing_field(entry, INDEX_FIELDS)
        if problem is None and isinstance(entry["environment"], dict):
            problem = missing_field(entry["environment"], MANIFEST_FIELDS["environment"])
            problem = problem and f"has an environment that {problem}"
        if problem:
            raise HubError(f"{path.name} of this repo is malformed: its variant {i} {problem}",
                           hint="push a variant again (aotbuild push rewrites the index), or tell the repo's owner")
    return index


def check_trusted(artifact: str | os.PathLike, trust_remote_code: bool) -> None:
    """A Hub artifact holds native code (compiled libraries) that loading runs in this process:
    it is loaded only when the caller says so, as transformers asks for `trust_remote_code`.
    Local folders are the caller's own.

    Raises:
        UntrustedCodeError: naming the repo and the flag.
    """
    if isinstance(artifact, str) and artifact.startswith("hf://") and not trust_remote_code:
        raise UntrustedCodeError(
            f"{artifact} holds native code (compiled libraries) that loading it runs in this process, and aotbuild "
            f"loads code from a Hub repo only when you trust it",
            hint="if you trust that repo: trust_remote_code=True in Python, --trust-remote-code on the command line")


def file_at_commit(repo_id: str, revision: str | None, filename: str, cache_dir: str | os.PathLike | None = None,
                   local_files_only: bool = False) -> tuple[str, Path]:
    """(the commit `revision` names now, the repo's root file `filename` downloaded at it): the
    one resolution a load makes, everything else is then fetched at that commit. Offline
    (HF_HUB_OFFLINE=1, or `local_files_only`), the commit the cache last resolved the revision to.
    huggingface_hub's exceptions go to the caller."""
    from huggingface_hub import hf_hub_download

    path = Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir, endpoint=hub_endpoint(),
                                local_files_only=local_files_only))
    return path.parent.name, path  # .../snapshots/<commit>/<filename>


# How long a connection to the Hub may take before it counts as unreachable: huggingface_hub
# retries an unreachable Hub for ~25 s before it looks in the cache.
PROBE_SECONDS = 3.0


def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached from here (its name does not resolve, its port refuses or does
    not answer within PROBE_SECONDS), or None: it can be, or HF_HUB_OFFLINE is set (huggingface_hub
    then asks nothing), or a proxy is configured (the proxy decides what is reachable)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    proxies = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    if constants.HF_HUB_OFFLINE or any(os.environ.get(name) for name in proxies):
        return None
    url = urlsplit(hub_endpoint() or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=PROBE_SECONDS):
            return None
    except OSError as exc:
        return f"{url.hostname}:{port}: {exc.strerror or type(exc).__name__}"


def commit_of(repo_id: str, revision: str | None, filename: str) -> str:
    """The commit `revision` names now (a commit names itself, with no request)."""
    if revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    return file_at_commit(repo_id, revision, filename)[0]


def pinned(spec: str) -> str:
    """`hf://org/name@<commit>` for `hf://org/name[@revision]`: the revision resolved now, so that
    every replica of a deployment loads the same commit whatever lands on the branch later."""
    repo_id, revision = parse_repo(spec)
    try:
        return f"{HF_PREFIX}{repo_id}@{commit_of(repo_id, revision, INDEX_NAME)}"
    except Exception as exc:  # HTTP, network, offline with nothing cached
        raise _hub_error(f"resolving {repo_id}@{revision or 'main'}", exc) from None


def parse_repo(spec: str) -> tuple[str, str | None]:
    """"hf://org/name@rev" or "org/name@rev" -> ("org/name", "rev" or None)."""
    text = spec[len(HF_PREFIX):] if spec.startswith(HF_PREFIX) else spec
    repo_id, _, revision = text.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise AotbuildError(f"{spec!r} is not a Hub repo; expected org/name[@revision]")
    return repo_id, revision or None


def variant_id(env: dict[str, Any]) -> str:
    """The folder name of an environment: the exact torch release (compiled code is tied to it,
    and the runtime refuses another) and the machine kind."""
    release = env["torch"].split("+")[0]
    if env["device_type"] == "cuda":
        cuda = (env.get("cuda") or "unknown").replace(".", "")
        ptx = "-ptx" if env.get("gpu_multi_arch") else ""  # also runs on later GPUs (manifest.gpu_fits)
        return f"torch{release}-cu{cuda}-sm{env.get('gpu_capability', '?').replace('.', '')}{ptx}"
    machine = env["platform"].split("-", 1)[-1]
    return f"torch{release}-cpu-{machine}-{env['cpu_isa'].lower()}"


def index_entry(path: str, manifest: dict[str, Any], bench: dict[str, Any] | None) -> dict[str, Any]:
    """What index.json says of one variant: enough to choose it without downloading it."""
    target = manifest["target"]
    worst = max((v.get("numerics", {}).get("max_rel_error", 0.0) for c in manifest["components"].values()
                 for v in c["variants"]), default=None)
    entry = {
        "path": path, "target": target["name"], "pipeline": target["pipeline"], "dtype": target["dtype"],
        "source": manifest["source"], "environment": manifest["environment"],
        "shapes": [f"{s['batch']}x{s['height']}x{s['width']}" for s in target["shapes"]],
        "dynamic": target.get("dynamic"), "recipe": sorted(target["optimize"]),
        "max_rel_error": worst, "aotbuild": manifest["aotbuild"],
    }
    if bench:
        aot = bench.get("summary", {}).get("aot", {})
        entry["bench"] = {k: aot.get(k, {}).get("median") for k in ("first_image_s", "steady_step_s", "peak_rss_mib")}
    return entry


def model_card(repo_id: str, index: dict[str, Any]) -> str:
    """A README.md for the repo: metadata, a table of variants, usage."""
    variants = index["variants"]
    pipelines = sorted({v["pipeline"] for v in variants})
    sources = sorted({v["source"]["id"] for v in variants if "/" in v["source"]["id"]
                      and not v["source"]["id"].startswith(("random:", "/", "."))})
    tags = ["aotbuild", "aotinductor", "torch-export", "diffusers", *pipelines]
    lines = ["---", "library_name: aotbuild", "tags:", *[f"- {t}" for t in tags]]
    if sources:
        lines += ["base_model:", *[f"- {s}" for s in sources]]
    lines += ["---", "", f"# {repo_id}", "",
              "Ahead-of-time compiled (torch.export + AOTInductor) diffusers components built with aotbuild. "
              "Each folder is one variant for one target, torch release and machine; `index.json` lists them.",
              "", "| variant | pipeline | device | torch | dtype | shapes | recipe | max rel. error | "
              "first image (s) | steady step (s) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v in variants:
        env, bench = v["environment"], v.get("bench") or {}
        device = f"{env.get('gpu_name', 'cuda')} sm{env.get('gpu_capability')}" if env["device_type"] == "cuda" \
            else f"cpu {env['cpu_isa']}"
        shapes = ", ".join(v["shapes"]) + (" + dynamic" if v.get("dynamic") else "")

        def num(x: Any) -> str:
            return "-" if x is None else f"{x:.3g}"

        lines.append(f"| `{v['path']}` | {v['pipeline']} | {device} | {env['torch']} | {v['dtype']} | {shapes} | "
                     f"{', '.join(['dtype', *v['recipe']])} | {num(v['max_rel_error'])} | "
                     f"{num(bench.get('first_image_s'))} | {num(bench.get('steady_step_s'))} |")
    lines += ["", "## Usage", "",
              "Each variant holds native code (compiled libraries) that loading runs in your process: load it "
              "only if you trust this repo, and say so.", "", "```python", "import aotbuild", "",
              "# picks the variant that fits this machine",
              f'pipe = aotbuild.load_pipeline("hf://{repo_id}", trust_remote_code=True)',
              'image = pipe("a red fox in the snow").images[0]', "```", "",
              f"or `aotbuild pull {repo_id} --trust-remote-code` to download the fitting variant into the Hugging "
              f"Face cache.", ""]
    return "\n".join(lines)


@dataclass
class PushResult:
    repo_id: str
    path: str
    operations: list[str] = field(default_factory=list)
    commit_url: str | None = None
    pr_url: str | None = None
    commit: str | None = None  # the commit's id
    unchanged: bool = False  # the branch already held exactly this: no commit was made (`commit` is its head)
    unreachable: str | None = None  # a dry run's: why the Hub could not be asked what it holds


def hub_endpoint() -> str | None:
    """The Hub to talk to: HF_ENDPOINT as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def hub_api(token: str | None = None) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub_endpoint(), token=token)


def _hub_error(action: str, exc: Exception) -> HubError:
    """The failure in one line (huggingface_hub's messages carry the URL and the server's message,
    never the token), with what to check: the token, the repo id, the network."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    status = getattr(getattr(exc, "response", None), "status_code", None)
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    if status in (401, 403):
        hint = ("check the token: `hf auth login` or HF_TOKEN (a push needs one that can write to the repo); a "
                "private or gated repo needs one that can read it")
    elif status == 404 or "RepositoryNotFoundError" in kinds or "RevisionNotFoundError" in kinds:
        hint = ("check the repo id and revision for a typo; a private repo also answers 404 without a token that can "
                "read it")
    elif kinds & {"ConnectError", "ConnectionError", "ConnectTimeout", "Timeout", "OfflineModeIsEnabled",
                  "LocalEntryNotFoundError"}:  # the last: neither on the Hub (unreachable) nor in the cache
        hint = (f"the Hub ({hub_endpoint() or 'huggingface.co'}) cannot be reached from here, or, offline, this is "
                f"not in the cache: HF_HUB_OFFLINE=1 uses what is cached without trying, HF_ENDPOINT names a mirror")
    else:
        hint = None
    return HubError(f"{action} failed: {first_line}", hint=hint)


def _fetch_error(repo_id: str, revision: str | None, unreachable: str | None, exc: Exception) -> HubError:
    if unreachable is None:
        return _hub_error(f"fetching {repo_id}@{revision or 'main'}", exc)
    return HubError(f"fetching {repo_id}@{revision or 'main'} failed: the Hub cannot be reached from here "
                    f"({unreachable}) and the cache holds no copy of it",
                    hint="check the network, or HF_ENDPOINT for a mirror; once fetched, a variant loads from the cache "
                         "with no network (HF_HUB_OFFLINE=1 skips trying)")


def push(folder: str | os.PathLike, repo_id: str, *, revision: str | None = None, private: bool = False,
         create_pr: bool = False, dry_run: bool = False, token: str | None = None) -> PushResult:
    """Upload one artifact folder as one variant, with index.json and README.md, in one commit.

    Raises:
        CorruptArtifactError: the folder fails its own hashes (nothing is uploaded).
        HubError: a Hub request failed; no commit was made.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import HfHubHTTPError

    folder = Path(folder)
    manifest = read_manifest(folder)
    verify_files(folder, manifest)
    path = f"{manifest['target']['name']}/{variant_id(manifest['environment'])}"
    bench_file = folder / "bench.json"
    bench = json.loads(bench_file.read_text()) if bench_file.is_file() else None
    local = [MANIFEST_NAME, *manifest["files"]] + (["bench.json"] if bench else [])
    api = hub_api(token)
    description = (f"{manifest['target']['name']} built by aotbuild {manifest['aotbuild']} "
                   f"with torch {manifest['environment']['torch']}")
    try:
        if not dry_run:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if revision:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
        offline = hub_unreachable() if dry_run else None  # a dry run lists the commit as for a new repo
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            head, remote, index = (None, [], {"variants": []}) if offline else _remote_state(api, repo_id, revision,
                                                                                             dry_run)
            index["variants"] = sorted([v for v in index["variants"] if v["path"] != path]
                                       + [index_entry(path, manifest, bench)], key=lambda v: v["path"])
            operations: list[Any] = [CommitOperationAdd(f"{path}/{rel}", str(folder / rel)) for rel in local]
            operations += [CommitOperationDelete(f) for f in remote if f.startswith(path + "/")
                           and f[len(path) + 1:] not in local]
            operations += [
                CommitOperationAdd(INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode()),
                CommitOperationAdd(CARD_NAME, model_card(repo_id, index).encode()),
            ]
            result = PushResult(repo_id, path, [_describe(op) for op in operations], unreachable=offline)
            if dry_run:
                return result
            try:
                # Against the head the index was read at: a push that landed meanwhile makes the Hub
                # refuse (412) instead of this commit silently dropping its variant from index.json.
                info = api.create_commit(repo_id, operations, commit_message=f"aotbuild: {path}",
                                         commit_description=description, revision=revision,
                                         create_pr=create_pr, parent_commit=head)
                break
            except HfHubHTTPError as exc:
                if getattr(exc.response, "status_code", None) != 412 or attempt == PUSH_ATTEMPTS:
                    raise
    except AotbuildError:
        raise
    except Exception as exc:  # HTTP errors, the client's connection errors, offline mode, bad repo ids
        raise _hub_error(f"push to {repo_id}", exc) from None
    result.commit_url, result.pr_url, result.commit = info.commit_url, info.pr_url, info.oid
    result.unchanged = head is not None and info.oid == head  # huggingface_hub skips a commit of no changes
    return result


def _remote_state(api: Any, repo_id: str, revision: str | None, dry_run: bool) -> tuple[str | None, list[str], dict]:
    """(head commit, files, index) of the branch, all as of one commit; (None, [], empty index) for
    a repo or branch that does not exist yet (a dry run creates nothing)."""
    from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError

    try:
        info = api.repo_info(repo_id, revision=revision)
    except RevisionNotFoundError:
        return None, [], {"variants": []}
    except HfHubHTTPError as exc:  # a repo that does not exist yet (dry run)
        if not dry_run or getattr(exc.response, "status_code", None) != 404:
            raise
        return None, [], {"variants": []}
    remote = [sibling.rfilename for sibling in info.siblings or []]
    index = {"variants": []}
    if INDEX_NAME in remote:
        index = _read_index(Path(api.hf_hub_download(repo_id, INDEX_NAME, revision=info.sha)))
    return info.sha, remote, index


def _describe(op: Any) -> str:
    if type(op).__name__ == "CommitOperationDelete":
        return f"delete {op.path_in_repo}"
    return f"add {op.path_in_repo} ({op.upload_info.size} bytes)"


def _check_variant_path(repo_id: str, path: Any) -> None:
    """An index entry's path is `target/variant` inside the repo, checked before anything is downloaded."""
    try:
        check_relative_path(path, "index.json names a variant")
        safe = bool(_SAFE_PATH.fullmatch(path))
    except CorruptArtifactError:
        safe = False
    if not safe:
        raise HubError(f"{repo_id}: index.json names an invalid variant path {path!r}")


@dataclass
class Resolved:
    """A Hub variant downloaded into the HF cache."""

    folder: Path
    repo_id: str
    revision: str | None
    commit: str
    variant: str


def choose_variant(index: dict[str, Any], *, device: str, dtype: str | None = None,
                   variant: str | None = None, pipeline: str | None = None,
                   here: dict[str, Any] | None = None) -> dict[str, Any]:
    """The index entry to use here. `variant` names a variant path (`target/torch...`, or its last
    part), or a target, whose variants are then chosen among. Of the variants that fit this machine
    (`here`, by default this one's `environment`), one built for exactly this machine comes first
    (the same CPU ISA; the same GPU, with its own kernels before PTX compiled for it). When the
    fitting variants belong to several targets, the caller must name one: which target is meant
    is never guessed.

    Raises:
        NoMatchingVariantError: listing what the repo has and what this machine is.
    """
    entries = [v for v in index.get("variants", []) if pipeline is None or v["pipeline"] == pipeline]
    if variant and variant in {v["path"].split("/")[0] for v in entries}:  # a target: choose among its variants
        entries = [v for v in entries if v["path"].split("/")[0] == variant]
    elif variant:
        chosen = [v for v in entries if v["path"] == variant] or [v for v in entries
                                                                   if v["path"].endswith("/" + variant)]
        if len(chosen) > 1:
            raise NoMatchingVariantError(f"variant {variant!r} is ambiguous: {', '.join(v['path'] for v in chosen)}")
        if not chosen:
            raise NoMatchingVariantError(f"no variant {variant!r}; the repo has: "
                                         f"{', '.join(v['path'] for v in entries) or 'nothing'}")
        return chosen[0]
    here = environment(device) if here is None else here
    fitting = []
    for entry in entries:
        try:
            check_compatible({"environment": entry["environment"], "target": {"dtype": entry["dtype"]}},
                             device=device, dtype=dtype, here=here)
        except IncompatibleArtifactError:
            continue
        fitting.append(entry)
    if not fitting:
        available = ", ".join(f"{v['path']} (torch {v['environment']['torch']}, {v['dtype']})" for v in entries)
        wanted = f"{variant_id(here)}, torch {here['torch']}" + (f", {dtype}" if dtype else "")
        raise NoMatchingVariantError(f"no variant fits this machine ({wanted}); the repo has: {available or 'nothing'}",
                                     hint="build one here (aotbuild build) and push it, or name one with --variant")
    targets = sorted({v["path"].split("/")[0] for v in fitting})
    if len(targets) > 1:
        raise NoMatchingVariantError(f"variants of {len(targets)} targets fit this machine: {', '.join(targets)}; "
                                     f"which one is meant is not guessed",
                                     hint="name the target: variant=\"NAME\" in Python, --variant NAME on the "
                                          "command line")
    # Built for exactly this machine first: same CPU ISA, same GPU, its own kernels before PTX.
    fitting.sort(key=lambda v: (v["environment"].get("cpu_isa") != here.get("cpu_isa"),
                                v["environment"].get("gpu_capability") != here.get("gpu_capability"),
                                bool(v["environment"].get("gpu_multi_arch")), v["path"]))
    return fitting[0]


def resolve(spec: str, *, variant: str | None = None, device: str | None = None, dtype: str | None = None,
            pipeline: str | None = None, cache_dir: str | os.PathLike | None = None, verify: bool = True,
            manifest_only: bool = False) -> Resolved:
    """Download the fitting variant of `org/name[@revision]` (only its files; `manifest_only`: its
    manifest alone, for `inspect`) at the one commit the revision resolves to, and return its
    folder. Offline (HF_HUB_OFFLINE=1, or a Hub that cannot be reached) it comes from the cache.
    `verify` hashes every file before returning (`aotbuild pull`); loading checks the files itself
    (`runtime.open_artifact_files`)."""
    import torch
    from huggingface_hub import snapshot_download

    repo_id, revision = parse_repo(spec)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    endpoint = hub_endpoint()
    unreachable = hub_unreachable()  # then the cache, at once, instead of retrying the network
    wanted = [f"{{}}/{MANIFEST_NAME}"] if manifest_only else ["{}/*", "{}/**"]
    try:
        # The revision is resolved once: the index and the variant's files come from that one commit,
        # even when a push lands on the branch meanwhile.
        commit, index_file = file_at_commit(repo_id, revision, INDEX_NAME, cache_dir, unreachable is not None)
        entry = choose_variant(_read_index(index_file), device=device, dtype=dtype, variant=variant,
                               pipeline=pipeline)
        _check_variant_path(repo_id, entry.get("path"))
        snapshot = Path(snapshot_download(repo_id, revision=commit, cache_dir=cache_dir, endpoint=endpoint,
                                          allow_patterns=[w.format(entry["path"]) for w in wanted],
                                          local_files_only=unreachable is not None))
    except AotbuildError:
        raise
    except Exception as exc:  # HTTP, network (the HTTP client's own errors too), a bad repo id
        raise _fetch_error(repo_id, revision, unreachable, exc) from None
    folder = snapshot / entry["path"]
    manifest = read_manifest(folder)  # refuses file paths outside the variant's folder
    if verify and not manifest_only:
        try:
            verify_files(folder, manifest)
        except CorruptArtifactError as exc:
            # The HF cache trusts its blobs: pulling again reuses the damaged file until it is removed.
            raise CorruptArtifactError(exc.message, hint=f"delete the damaged file from the Hugging Face cache "
                                                      f"({snapshot}) and pull again") from None
    return Resolved(folder, repo_id, revision, snapshot.name, entry["path"])
