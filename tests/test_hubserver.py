"""The fake Hub (tests/hubserver.py) must be good enough for the real huggingface_hub client: these tests drive it
through the public client API only, so a client upgrade that needs a new endpoint or header shows up here first."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .hubserver import FakeHub

TOKEN = "hf_test_token"
REPO = "org/repo"
BIG = bytes(range(256)) * 8192  # 2 MiB: goes through git-LFS


@pytest.fixture
def hub():
    with FakeHub() as hub:
        yield hub


@pytest.fixture
def cache_dir(tmp_path, monkeypatch, hub) -> Path:
    """The env a test run gets. huggingface_hub reads it at import time, so in this process the constants that matter
    are patched too, and endpoint/cache_dir/token are passed explicitly; subprocesses inherit the env."""
    for key, value in {"HF_HOME": str(tmp_path / "hf_home"), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1",
                       "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": TOKEN}.items():
        monkeypatch.setenv(key, value)
    # Without this the in-process client would try Xet uploads (hf_xet is installed), which the fake can't serve.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    return tmp_path / "cache"


@pytest.fixture
def api(cache_dir, hub) -> HfApi:
    return HfApi(endpoint=hub.url, token=TOKEN)


def _seed(api: HfApi):
    api.create_repo(REPO, exist_ok=True)
    return api.create_commit(REPO, commit_message="seed", operations=[
        CommitOperationAdd("notes.txt", b"hello\n"),
        CommitOperationAdd("x.safetensors", BIG),
        CommitOperationAdd("dir/a.txt", b"a"),
        CommitOperationAdd("dir/b.json", b"{}"),
    ])


def test_create_repo_and_commit_with_lfs(api, hub):
    api.create_repo(REPO, exist_ok=True)
    api.create_repo(REPO, exist_ok=True)  # answered 409, which exist_ok accepts
    ops = [CommitOperationAdd("notes.txt", b"hello\n"), CommitOperationAdd("x.safetensors", BIG)]
    info = api.create_commit(REPO, operations=ops, commit_message="add files")

    commits = hub.commits(REPO)
    assert len(commits) == 2  # the empty initial commit + ours
    assert commits[-1]["oid"] == info.oid and commits[-1]["message"] == "add files"
    assert commits[-1]["files"] == {"notes.txt": b"hello\n", "x.safetensors": BIG}
    assert set(commits[-1]["lfs"]) == {"x.safetensors"}
    assert [r["status"] for r in hub.requests if r["path"] == "/api/repos/create"] == [200, 409]
    uploads = [r for r in hub.requests if r["method"] == "PUT"]
    assert [(r["path"], r["status"]) for r in uploads] == [(f"/_lfs/upload/{commits[-1]['lfs']['x.safetensors']}", 200)]
    (commit_request,) = [r for r in hub.requests if r["path"] == f"/api/models/{REPO}/commit/main"]
    assert commit_request["headers"]["authorization"] == f"Bearer {TOKEN}"

    # Same content again: preupload reports the remote oids, so the client skips the commit altogether.
    ops = [CommitOperationAdd("notes.txt", b"hello\n"), CommitOperationAdd("x.safetensors", BIG)]
    assert api.create_commit(REPO, operations=ops, commit_message="again").oid == info.oid
    assert len(hub.commits(REPO)) == 2


def test_download_snapshot_and_listing(api, hub, cache_dir):
    _seed(api)
    path = hf_hub_download(REPO, "x.safetensors", endpoint=hub.url, cache_dir=cache_dir)
    assert Path(path).read_bytes() == BIG
    assert Path(hf_hub_download(REPO, "notes.txt", endpoint=hub.url, cache_dir=cache_dir)).read_bytes() == b"hello\n"

    n_requests = len(hub.requests)
    folder = Path(snapshot_download(REPO, allow_patterns=["dir/*"], endpoint=hub.url, cache_dir=cache_dir))
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "dir/a.txt", "dir/b.json", "notes.txt", "x.safetensors"]  # the snapshot folder also holds the earlier files
    fetched = {r["path"] for r in hub.requests[n_requests:] if "/resolve/" in r["path"]}
    assert fetched == {f"/{REPO}/resolve/{hub.commits(REPO)[-1]['oid']}/dir/a.txt",
                       f"/{REPO}/resolve/{hub.commits(REPO)[-1]['oid']}/dir/b.json"}

    assert api.list_repo_files(REPO) == ["dir/a.txt", "dir/b.json", "notes.txt", "x.safetensors"]
    top = {e.path: e for e in api.list_repo_tree(REPO, expand=True)}
    assert set(top) == {"dir", "notes.txt", "x.safetensors"}
    assert top["x.safetensors"].lfs.size == len(BIG) and top["x.safetensors"].last_commit.title == "seed"
    assert [f.rfilename for f in api.model_info(REPO, files_metadata=True).siblings] == api.list_repo_files(REPO)


def test_errors_map_to_client_exceptions(api, hub, cache_dir):
    _seed(api)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.txt", endpoint=hub.url, cache_dir=cache_dir)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "notes.txt", revision="nope", endpoint=hub.url, cache_dir=cache_dir)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")
    with pytest.raises(RepositoryNotFoundError):  # the Hub's 401 on a write without token reads as "not found"
        HfApi(endpoint=hub.url, token=False).create_commit(
            REPO, operations=[CommitOperationAdd("x", b"x")], commit_message="anonymous")


def test_offline_snapshot_after_stop(api, hub, cache_dir, tmp_path):
    _seed(api)
    online = snapshot_download(REPO, allow_patterns=["dir/*"], endpoint=hub.url, cache_dir=cache_dir)
    hub.stop()
    script = textwrap.dedent(f"""
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import IncompleteSnapshotError
        print(snapshot_download({REPO!r}, allow_patterns=["dir/*"], cache_dir={str(cache_dir)!r}))
        print(hf_hub_download({REPO!r}, "dir/a.txt", cache_dir={str(cache_dir)!r}))
        try:  # without the patterns, the cached tree listing says files are missing
            snapshot_download({REPO!r}, cache_dir={str(cache_dir)!r})
        except IncompleteSnapshotError:
            print("incomplete")
    """)
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [online, f"{online}/dir/a.txt", "incomplete"]


def test_failed_commit_changes_nothing(api, hub):
    _seed(api)
    before = hub.commits(REPO)
    hub.fail_next["commit"] = 500
    ops = [CommitOperationAdd("new.txt", b"new")]
    with pytest.raises(HfHubHTTPError):
        api.create_commit(REPO, operations=ops, commit_message="fails")
    assert hub.commits(REPO) == before
    assert [r["status"] for r in hub.requests if r["path"].endswith("/commit/main")][-1] == 500
    api.create_commit(REPO, operations=ops, commit_message="works")  # one-shot failure: the retry goes through
    assert len(hub.commits(REPO)) == len(before) + 1

    # A commit pointing at an LFS object that was never uploaded is refused as a whole.
    lines = [{"key": "header", "value": {"summary": "bad", "description": ""}},
             {"key": "file", "value": {"path": "ok.txt", "content": base64.b64encode(b"ok").decode(),
                                       "encoding": "base64"}},
             {"key": "lfsFile", "value": {"path": "ghost.bin", "algo": "sha256", "oid": "0" * 64, "size": 1}}]
    request = urllib.request.Request(f"{hub.url}/api/models/{REPO}/commit/main", method="POST",
                                     data=b"".join(json.dumps(line).encode() + b"\n" for line in lines),
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 422
    assert len(hub.commits(REPO)) == len(before) + 1


def test_branch_and_pull_request(api, hub, cache_dir):
    _seed(api)
    main = hub.commits(REPO)
    api.create_branch(REPO, branch="v1")
    api.create_branch(REPO, branch="v1", exist_ok=True)
    on_branch = api.create_commit(REPO, operations=[CommitOperationAdd("v1.txt", b"1")], commit_message="on v1",
                                  revision="v1")
    pr = api.create_commit(REPO, operations=[CommitOperationAdd("pr.txt", b"pr")], commit_message="pr",
                           create_pr=True)

    assert hub.commits(REPO) == main
    assert [c["oid"] for c in hub.commits(REPO, "v1")] == [c["oid"] for c in main] + [on_branch.oid]
    assert pr.pr_revision == "refs/pr/1" and pr.pr_num == 1
    assert [c["oid"] for c in hub.commits(REPO, "refs/pr/1")] == [c["oid"] for c in main] + [pr.oid]
    assert "v1.txt" not in hub.commits(REPO, "refs/pr/1")[-1]["files"]
    assert api.model_info(REPO, revision="v1").sha == on_branch.oid
    path = hf_hub_download(REPO, "pr.txt", revision="refs/pr/1", endpoint=hub.url, cache_dir=cache_dir)
    assert Path(path).read_bytes() == b"pr"
    refs = api.list_repo_refs(REPO, include_pull_requests=True)
    assert {b.name for b in refs.branches} == {"main", "v1"}
    assert [p.ref for p in refs.pull_requests] == ["refs/pr/1"]
