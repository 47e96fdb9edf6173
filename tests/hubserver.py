"""A local, in-memory Hugging Face Hub for tests (stdlib only).

It speaks the subset of the Hub HTTP protocol that `huggingface_hub` (checked against 2.4.0) uses to create repos and
branches, commit files (regular + git-LFS "basic" transfer), list trees and download files, so tests can run the real
client against it: point `HF_ENDPOINT` (subprocesses) or `endpoint=` (in-process) at `FakeHub.url`. Xet must be off
(`HF_HUB_DISABLE_XET=1`): the fake has no Xet endpoints.

    with FakeHub() as hub:
        HfApi(endpoint=hub.url, token="hf_x").create_repo("org/repo")
        ...
        assert len(hub.commits("org/repo")) == 2

Every request is recorded in `hub.requests`; `hub.fail_next[kind] = status` makes the next request of that kind fail.
Kinds: create_repo, delete_repo, validate_yaml, repo_info, tree, paths_info, refs, list_commits, create_branch,
delete_branch, preupload, commit, lfs_batch, lfs_upload, lfs_verify, resolve. Note the client retries 5xx answers
(sleeping 1 s, 2 s, ...) on preupload, lfs_* and tree, so a one-shot 500 there only slows it down (a failed resolve HEAD
is retried once too, when the file is not cached); commit, create_repo, create_branch and repo_info are not retried.
Unknown routes answer 404 and are recorded too.

To try push -> pull -> run with no account and no network, run it from the checkout (it prints
the variables to export; its repos live in memory until Ctrl-C):

    python -m tests.hubserver [--port 8765]
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import socket
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

# The real Hub decides with .gitattributes and a binary sniff; tests only need a predictable rule.
LFS_SUFFIXES = (".pt2", ".safetensors", ".bin")
LFS_THRESHOLD = 1_000_000

_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_PLURAL = {"models": "model", "datasets": "dataset", "spaces": "space"}
# Words that follow the repo id in /api/{type}s/... urls (so "ns/name" vs bare "name" can be told apart).
_API_ACTIONS = {"revision", "tree", "preupload", "commit", "branch", "refs", "paths-info", "commits"}
# (method, api action) -> request kind; the kind names the handler and the `fail_next` key.
_KINDS = {
    ("GET", None): "repo_info",
    ("GET", "revision"): "repo_info",
    ("GET", "tree"): "tree",
    ("POST", "paths-info"): "paths_info",
    ("GET", "refs"): "refs",
    ("GET", "commits"): "list_commits",
    ("POST", "preupload"): "preupload",
    ("POST", "commit"): "commit",
    ("POST", "branch"): "create_branch",
    ("DELETE", "branch"): "delete_branch",
}
_LFS_BATCH = re.compile(r"/(?:(datasets|spaces)/)?(.+)\.git/info/lfs/objects/batch")
_RESOLVE = re.compile(r"/(?:(datasets|spaces)/)?(.+?)/resolve/([^/]+)/(.+)")  # the revision is one quoted segment
# Everything that changes state needs a token. LFS upload does not: on the real Hub it is a pre-signed S3 url and the
# client sends no Authorization header there.
_WRITE_KINDS = {"create_repo", "delete_repo", "create_branch", "delete_branch", "preupload", "commit", "lfs_batch",
                "lfs_verify"}


class HubError(Exception):
    """An error answer. `code` goes to X-Error-Code, which the client maps to RepositoryNotFoundError etc."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.headers = status, code, dict(headers or {})
        if code:
            self.headers["X-Error-Code"] = code
        self.headers["X-Error-Message"] = message.encode("ascii", "replace").decode()  # headers must be latin-1


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _json(obj, status: int = 200, content_type: str = "application/json"):
    return status, {"Content-Type": content_type}, json.dumps(obj).encode()


def _read_body(rfile, headers: dict) -> bytes:
    if "content-length" in headers:
        return rfile.read(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":  # streamed file uploads may come chunked
        chunks = []
        while size := int(rfile.readline().split(b";")[0].strip() or b"0", 16):
            chunks.append(rfile.read(size))
            rfile.readline()
        while rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(chunks)
    return b""


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keep-alive like the real Hub; every reply carries a Content-Length and every body is read in full.
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        self.server.hub._conns.add(self.connection)

    def finish(self):
        self.server.hub._conns.discard(self.connection)
        super().finish()

    def do_GET(self):
        self.server.hub._serve(self)

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def log_message(self, *args):  # keep test output quiet (requests are recorded instead)
        pass


class FakeHub:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        """`token`: if set, only `Bearer <token>` is accepted on write endpoints; otherwise any bearer token is."""
        self.host, self.token = host, token
        self.requests: list[dict] = []
        self.repos: dict[str, dict] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 -> content, shared by all repos like the Hub's LFS store
        self.fail_next: dict[str, int] = {}
        # Another client's work that lands just before the next commit request is served: a race
        # between two pushes, made deterministic. Runs outside the lock, so it may call the server.
        self.before_next_commit: Callable[[], None] | None = None
        self._lock = threading.RLock()
        self._conns: set[socket.socket] = set()
        self._oids = itertools.count()
        self._thread: threading.Thread | None = None
        self._server = self._bind(port)  # bound now so that `url` is known before start()
        self.port = self._server.server_address[1]
        self.url = f"http://{host}:{self.port}"

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def _bind(self, port: int) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer((self.host, port), _Handler)
        server.daemon_threads = True
        server.hub = self
        return server

    def start(self) -> FakeHub:
        if self._thread is None:
            if self._server is None:  # restarted after stop(): same port and state, e.g. to simulate an outage
                self._server = self._bind(self.port)
            self._thread = threading.Thread(target=self._server.serve_forever, name="FakeHub", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
        self._server = None
        # Keep-alive connections would otherwise still be served by their handler threads after stop().
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- state helpers for tests -----------------------------------------------------------------------------------

    def commits(self, repo_id: str, branch: str = "main") -> list[dict]:
        """History of `branch` (or "refs/pr/N"), oldest first, the empty initial commit included."""
        with self._lock:
            return list(self.repos[repo_id]["branches"][branch])

    def create_repo(self, repo_id: str, repo_type: str = "model", private: bool = False) -> dict:
        with self._lock:
            initial = self._new_commit(None, {}, {}, "initial commit")
            self.repos[repo_id] = {"type": repo_type, "private": private, "created": _now(),
                                   "branches": {"main": [initial]}, "next_pr": 1}
            return self.repos[repo_id]

    # -- HTTP plumbing ---------------------------------------------------------------------------------------------

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        split = urlsplit(handler.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        headers = {k.lower(): v for k, v in handler.headers.items()}
        body = _read_body(handler.rfile, headers)
        base = f"http://{headers.get('host') or f'{self.host}:{self.port}'}"  # urls in answers use the client's host
        if handler.command == "POST" and "/commit/" in split.path and (hook := self.before_next_commit):
            self.before_next_commit = None
            hook()
        try:
            with self._lock:  # one request at a time: commits are trivially atomic
                status, out_headers, payload = self._route(handler.command, split.path, query, headers, body, base)
        except HubError as e:
            status, out_headers, payload = e.status, e.headers, json.dumps({"error": str(e)}).encode()
            out_headers.setdefault("Content-Type", "application/json")
        except Exception as e:  # a bug in the fake: answer 500 so the test sees it in `requests`
            status, out_headers, payload = 500, {}, json.dumps({"error": f"FakeHub crashed: {e!r}"}).encode()
        with self._lock:  # recorded before answering, so the record exists once the client has its response
            self.requests.append({"method": handler.command, "path": split.path, "query": query,
                                  "headers": headers, "status": status})
        handler.send_response(status)
        for key, value in out_headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(payload)))  # for HEAD: the size a GET would return
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(payload)

    def _route(self, method, path, query, headers, body, base):
        if path == "/api/repos/create" and method == "POST":
            kind, args = "create_repo", (body, base)
        elif path == "/api/repos/delete" and method == "DELETE":
            kind, args = "delete_repo", (body,)
        elif path == "/api/validate-yaml" and method == "POST":  # create_commit sends any README.md here first
            kind, args = "validate_yaml", ()
        elif m := re.fullmatch(r"/api/(models|datasets|spaces)/(.+)", path):
            segs = m[2].split("/")  # still url-quoted: revisions like refs%2Fpr%2F1 stay one segment
            n = 2 if len(segs) >= 2 and segs[1] not in _API_ACTIONS else 1
            repo_id, rest = "/".join(segs[:n]), segs[n:]
            kind = _KINDS.get((method, rest[0] if rest else None))
            revision = unquote(rest[1]) if len(rest) > 1 else "main"
            args = (_PLURAL[m[1]], repo_id, revision, unquote("/".join(rest[2:])), query, headers, body, base)
        elif method == "POST" and (m := _LFS_BATCH.fullmatch(path)):
            kind, args = "lfs_batch", (_PLURAL.get(m[1], "model"), m[2], headers, body, base)
        elif method == "PUT" and (m := re.fullmatch(r"/_lfs/upload/([0-9a-f]{64})", path)):
            kind, args = "lfs_upload", (m[1], body)
        elif method == "POST" and path == "/_lfs/verify":
            kind, args = "lfs_verify", (body,)
        elif method in ("GET", "HEAD") and (m := _RESOLVE.fullmatch(path)):
            kind, args = "resolve", (_PLURAL.get(m[1], "model"), m[2], unquote(m[3]), unquote(m[4]), headers)
        else:
            kind = None
        if kind is None:
            raise HubError(404, f"FakeHub has no route for {method} {path}")
        if (status := self.fail_next.pop(kind, None)) is not None:
            raise HubError(status, f"FakeHub: injected failure for {kind!r}")
        if kind in _WRITE_KINDS:
            self._check_auth(headers, repo_scoped=kind not in ("create_repo", "delete_repo"))
        return getattr(self, f"_{kind}")(*args)

    def _check_auth(self, headers: dict, repo_scoped: bool) -> None:
        auth = headers.get("authorization", "")
        if self.token is not None and auth.startswith("Bearer ") and auth[7:] != self.token:
            raise HubError(401, "Invalid credentials in Authorization header")
        if not auth.startswith("Bearer ") or not auth[7:].strip():
            # The client turns the Hub's 401 on repo urls into RepositoryNotFoundError, but only for https urls:
            # say it explicitly so that tests over http see what production code would.
            raise HubError(401, "Invalid username or password.", "RepoNotFound" if repo_scoped else None)

    # -- repo / revision lookup ------------------------------------------------------------------------------------

    def _repo(self, repo_type: str, repo_id: str, headers: dict) -> dict:
        repo = self.repos.get(repo_id)
        if repo is None or repo["type"] != repo_type or (repo["private"] and "authorization" not in headers):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _history(self, repo: dict, revision: str) -> tuple[str | None, list[dict]]:
        """(branch name or None for a commit hash, history up to and including the revision's commit)."""
        branch = revision.removeprefix("refs/heads/")
        if branch in repo["branches"]:
            return branch, repo["branches"][branch]
        if re.fullmatch(r"[0-9a-f]{40}", revision):
            for history in repo["branches"].values():
                for i, commit in enumerate(history):
                    if commit["oid"] == revision:
                        return None, history[: i + 1]
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _new_commit(self, parent: dict | None, files: dict, lfs: dict, message: str, description: str = "") -> dict:
        seed = json.dumps([next(self._oids), parent and parent["oid"], message, sorted(lfs.items()),
                           sorted((p, git_blob_sha1(d)) for p, d in files.items())])
        return {"oid": hashlib.sha1(seed.encode()).hexdigest(), "files": files, "lfs": lfs, "message": message,
                "description": description, "parent": parent and parent["oid"], "date": _now()}

    def _file_entry(self, commit: dict, path: str) -> dict:
        data = commit["files"][path]
        entry = {"type": "file", "path": path, "size": len(data)}
        if sha256 := commit["lfs"].get(path):
            # Like git: the blob is the LFS pointer file, the content is addressed by its sha256.
            pointer = _lfs_pointer(sha256, len(data))
            entry["oid"] = git_blob_sha1(pointer)
            entry["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": len(pointer)}
        else:
            entry["oid"] = git_blob_sha1(data)
        return entry

    def _dir_entry(self, commit: dict, path: str) -> dict:
        return {"type": "directory", "path": path, "size": 0,
                "oid": hashlib.sha1(f"{commit['oid']}:{path}".encode()).hexdigest()}

    @staticmethod
    def _last_commit(history: list[dict], path: str) -> dict:
        """The newest commit of `history` that changed `path` (the `lastCommit` of an expanded tree entry)."""
        for newer, older in zip(reversed(history), list(reversed(history))[1:] + [None], strict=True):
            before = (older["files"].get(path), older["lfs"].get(path)) if older else (None, None)
            if (newer["files"].get(path), newer["lfs"].get(path)) != before:
                return {"id": newer["oid"], "title": newer["message"], "date": newer["date"]}
        return {"id": history[-1]["oid"], "title": history[-1]["message"], "date": history[-1]["date"]}

    # -- API endpoints ---------------------------------------------------------------------------------------------

    def _create_repo(self, body, base):
        payload = json.loads(body or b"{}")
        name, org = payload.get("name", ""), payload.get("organization")
        repo_id = name if "/" in name or not org else f"{org}/{name}"
        repo_type = payload.get("type") or "model"
        url = f"{base}/{_URL_PREFIX[repo_type]}{repo_id}"
        if repo_id in self.repos:
            # The client reads `url` even from this 409 when exist_ok=True.
            return _json({"error": "You already created this repo", "url": url}, 409)
        private = bool(payload.get("private")) or payload.get("visibility") == "private"
        self.create_repo(repo_id, repo_type, private)
        return _json({"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self, body):
        payload = json.loads(body or b"{}")
        name, org = payload.get("name", ""), payload.get("organization")
        repo_id = name if "/" in name or not org else f"{org}/{name}"
        if self.repos.pop(repo_id, None) is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return _json({})

    def _validate_yaml(self):
        return _json({"errors": [], "warnings": []})

    def _repo_info(self, repo_type, repo_id, revision, _path, query, headers, _body, _base):
        repo = self._repo(repo_type, repo_id, headers)
        history = self._history(repo, revision)[1]
        commit = history[-1]
        siblings = []
        for path in sorted(commit["files"]):
            entry = self._file_entry(commit, path)
            sibling = {"rfilename": path, "size": entry["size"], "blobId": entry["oid"]}
            if lfs := entry.get("lfs"):
                sibling["lfs"] = {"size": lfs["size"], "sha256": lfs["oid"], "pointerSize": lfs["pointerSize"]}
            siblings.append(sibling)
        info = {"id": repo_id, "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "author": repo_id.split("/")[0],
                "sha": commit["oid"], "siblings": siblings, "private": repo["private"], "gated": False,
                "disabled": False, "lastModified": commit["date"], "createdAt": repo["created"], "tags": [],
                "downloads": 0, "likes": 0}
        if repo_type == "model":
            info["modelId"] = repo_id
        return _json(info)

    def _tree(self, repo_type, repo_id, revision, path, query, headers, _body, _base):
        repo = self._repo(repo_type, repo_id, headers)
        history = self._history(repo, revision)[1]
        commit = history[-1]
        recursive = query.get("recursive", "").lower() in ("1", "true")
        expand = query.get("expand", "").lower() in ("1", "true")
        path = path.strip("/")
        prefix = f"{path}/" if path else ""
        below = [p for p in sorted(commit["files"]) if p.startswith(prefix)]
        if path and not below:
            raise HubError(404, f"{path} does not exist on {revision}", "EntryNotFound")
        entries: dict[str, dict] = {}
        for file_path in below:
            parts = file_path[len(prefix):].split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                dir_path = prefix + "/".join(parts[:depth])
                entries.setdefault(dir_path, self._dir_entry(commit, dir_path))
            if recursive or len(parts) == 1:
                entries[file_path] = self._file_entry(commit, file_path)
                if expand:
                    entries[file_path]["lastCommit"] = self._last_commit(history, file_path)
        # One page, no Link header: the client's paginator then stops.
        return _json(list(entries.values()))

    def _paths_info(self, repo_type, repo_id, revision, _path, _query, headers, body, _base):
        repo = self._repo(repo_type, repo_id, headers)
        commit = self._history(repo, revision)[1][-1]
        form = parse_qs(body.decode(), keep_blank_values=True)  # sent form-encoded: paths=a&paths=b&expand=False
        out = []
        for path in form.get("paths", []):
            path = path.strip("/")
            if path in commit["files"]:
                out.append(self._file_entry(commit, path))
            elif any(p.startswith(f"{path}/") for p in commit["files"]):
                out.append(self._dir_entry(commit, path))
        return _json(out)

    def _refs(self, repo_type, repo_id, _revision, _path, query, headers, _body, _base):
        repo = self._repo(repo_type, repo_id, headers)

        def ref(name):
            full = name if name.startswith("refs/") else f"refs/heads/{name}"
            return {"name": name, "ref": full, "targetCommit": repo["branches"][name][-1]["oid"]}

        branches = [ref(name) for name in repo["branches"] if not name.startswith("refs/pr/")]
        out = {"branches": branches, "converts": [], "tags": []}
        if query.get("include_prs"):
            out["pullRequests"] = [ref(name) for name in repo["branches"] if name.startswith("refs/pr/")]
        return _json(out)

    def _list_commits(self, repo_type, repo_id, revision, _path, _query, headers, _body, _base):
        repo = self._repo(repo_type, repo_id, headers)
        history = self._history(repo, revision)[1]
        return _json([{"id": c["oid"], "title": c["message"], "message": c["description"], "authors": [],
                       "date": c["date"]} for c in reversed(history)])

    def _create_branch(self, repo_type, repo_id, branch, _path, _query, headers, body, _base):
        repo = self._repo(repo_type, repo_id, headers)
        if branch in repo["branches"]:
            raise HubError(409, f"Reference refs/heads/{branch} already exists")
        starting_point = json.loads(body or b"{}").get("startingPoint") or "main"
        repo["branches"][branch] = list(self._history(repo, starting_point)[1])
        return _json({})

    def _delete_branch(self, repo_type, repo_id, branch, _path, _query, headers, _body, _base):
        repo = self._repo(repo_type, repo_id, headers)
        if branch not in repo["branches"] or branch == "main":
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        del repo["branches"][branch]
        return _json({})

    def _preupload(self, repo_type, repo_id, revision, _path, _query, headers, body, _base):
        repo = self._repo(repo_type, repo_id, headers)
        commit = self._history(repo, revision)[1][-1]
        files = []
        for f in json.loads(body)["files"]:
            path, size = f["path"], f["size"]
            mode = "lfs" if size >= LFS_THRESHOLD or path.endswith(LFS_SUFFIXES) else "regular"
            # `oid` of the file already there (sha256 if LFS, git sha1 otherwise): the client drops unchanged files.
            oid = None
            if path in commit["files"]:
                oid = commit["lfs"].get(path) or git_blob_sha1(commit["files"][path])
            files.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return _json({"files": files, "commitOid": commit["oid"]})

    def _commit(self, repo_type, repo_id, revision, _path, query, headers, body, base):
        repo = self._repo(repo_type, repo_id, headers)
        create_pr = query.get("create_pr") == "1"
        branch, history = self._history(repo, revision)
        if branch is None and not create_pr:
            raise HubError(400, f"Cannot commit to a commit hash ({revision}), only to a branch")
        try:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            header = next(line["value"] for line in lines if line["key"] == "header")
        except (ValueError, KeyError, StopIteration) as e:
            raise HubError(400, f"Malformed commit payload: {e!r}") from None
        parent = history[-1]
        if (expected := header.get("parentCommit")) and not parent["oid"].startswith(expected):
            raise HubError(412, f"Parent commit {expected} is not the head of {revision} ({parent['oid']})")
        # Work on copies and touch the repo only once every operation has been checked: all or nothing.
        files, lfs = dict(parent["files"]), dict(parent["lfs"])
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"]) if value.get("encoding") == "base64" \
                    else value["content"].encode()
                lfs.pop(value["path"], None)
            elif key == "lfsFile":
                oid = value["oid"]
                if oid not in self.lfs or ("size" in value and len(self.lfs[oid]) != value["size"]):
                    raise HubError(422, f"LFS object {oid} for {value['path']} was never uploaded")
                files[value["path"]], lfs[value["path"]] = self.lfs[oid], oid
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, f"A file with this name doesn't exist: {value['path']}", "EntryNotFound")
                lfs.pop(value["path"], None)
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                doomed = [p for p in files if p.startswith(prefix)]
                if not doomed:
                    raise HubError(404, f"A folder with this name doesn't exist: {value['path']}", "EntryNotFound")
                for p in doomed:
                    files.pop(p)
                    lfs.pop(p, None)
            elif key != "header":
                raise HubError(400, f"Unknown commit operation {key!r}")
        commit = self._new_commit(parent, files, lfs, header.get("summary", ""), header.get("description", ""))
        repo_url = f"{base}/{_URL_PREFIX[repo_type]}{repo_id}"
        out = {"success": True, "commitOid": commit["oid"], "commitUrl": f"{repo_url}/commit/{commit['oid']}",
               "commitMessage": commit["message"], "hookOutput": ""}
        if create_pr:
            number = repo["next_pr"]
            repo["next_pr"] += 1
            repo["branches"][f"refs/pr/{number}"] = [*history, commit]
            out["pullRequestUrl"] = f"{repo_url}/discussions/{number}"
        else:
            history.append(commit)
        return _json(out)

    # -- git-lfs -----------------------------------------------------------------------------------------------------

    def _lfs_batch(self, repo_type, repo_id, headers, body, base):
        self._repo(repo_type, repo_id, headers)
        payload = json.loads(body)
        objects = []
        for obj in payload.get("objects", []):
            oid, size = obj["oid"], obj["size"]
            out = {"oid": oid, "size": size}
            if oid not in self.lfs:  # already stored => no actions, the client skips the upload
                # No `header.chunk_size` => the client does a single "basic" PUT, never multipart.
                out.update(authenticated=True, actions={"upload": {"href": f"{base}/_lfs/upload/{oid}"},
                                                        "verify": {"href": f"{base}/_lfs/verify"}})
            objects.append(out)
        return _json({"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                     content_type="application/vnd.git-lfs+json")

    def _lfs_upload(self, oid, body):
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, f"Uploaded content does not match sha256 {oid}")
        self.lfs[oid] = body
        return 200, {"ETag": f'"{hashlib.md5(body).hexdigest()}"'}, b""

    def _lfs_verify(self, body):
        payload = json.loads(body)
        data = self.lfs.get(payload.get("oid"))
        if data is None or len(data) != payload.get("size"):
            raise HubError(404, f"LFS object {payload.get('oid')} not found")
        return _json({"success": True})

    # -- downloads -------------------------------------------------------------------------------------------------

    def _resolve(self, repo_type, repo_id, revision, path, headers):
        repo = self._repo(repo_type, repo_id, headers)
        commit = self._history(repo, revision)[1][-1]
        if path not in commit["files"]:
            # X-Repo-Commit lets the client cache the absence of the file (.no_exist).
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit["oid"]})
        entry = self._file_entry(commit, path)
        data = commit["files"][path]
        out = {"X-Repo-Commit": commit["oid"], "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if lfs := entry.get("lfs"):
            # The Hub would redirect to a CDN; we serve the bytes ourselves, with the headers of the redirect.
            out.update({"ETag": f'"{lfs["oid"]}"', "X-Linked-Etag": f'"{lfs["oid"]}"', "X-Linked-Size": str(len(data))})
        else:
            out["ETag"] = f'"{entry["oid"]}"'
        if rng := re.fullmatch(r"bytes=(\d+)-(\d*)", headers.get("range", "")):
            start, end = int(rng[1]), int(rng[2]) if rng[2] else len(data) - 1
            if start >= len(data):
                raise HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{len(data)}"})
            end = min(end, len(data) - 1)
            out["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return 206, out, data[start : end + 1]
        return 200, out, data


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted, printing what a shell needs to point huggingface_hub at it."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m tests.hubserver", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default: 8765; 0: any free one)")
    port = parser.parse_args(argv).port
    try:
        hub = FakeHub(port=port).start()
    except OSError as exc:
        raise SystemExit(f"error: cannot listen on 127.0.0.1:{port}: {exc.strerror}; pick another --port") from None
    print(f"a local Hub at {hub.url} (in memory, any token). In another shell:\n"
          f"  export HF_ENDPOINT={hub.url} HF_TOKEN=hf_local HF_HUB_DISABLE_XET=1\n"
          f"  aotbuild push --target cpu-tiny-sdxl --repo me/tiny-sdxl\n"
          f"  aotbuild run --artifact hf://me/tiny-sdxl --trust-remote-code --prompt 'a red fox' --output fox.png\n"
          f"Ctrl-C stops it (its repos are lost).", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        hub.stop()


if __name__ == "__main__":
    main()
