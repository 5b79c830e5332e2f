"""A loopback server speaking the part of the Hugging Face Hub's HTTP API that huggingface_hub uses to
list and download model files, with counters and fault injection for tests.

Endpoints (as huggingface_hub 1.x/2.x calls them; headers checked against its file_download.py and
utils/_http.py):

- GET  /api/models/{repo}[/revision/{rev}][?blobs=true]   model_info: `sha`, `siblings` (with blobs:
  `size`, `blobId`, and `lfs: {sha256, size, pointerSize}` for LFS files)
- GET  /api/models/{repo}/tree/{rev}[?recursive=true]     list_repo_tree (snapshot_download), one page
- HEAD/GET /{repo}/resolve/{rev}/{path}                   `X-Repo-Commit`, `ETag` (git blob sha1, or the
  LFS sha256), `X-Linked-Etag` / `X-Linked-Size` for LFS files, `Accept-Ranges`, Range → 206 + Content-Range

Errors carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound) and
`X-Error-Message` headers, which huggingface_hub's hf_raise_for_status maps to its error classes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    lfs: tuple[str, ...] = ("*.safetensors",)
    token: str | None = None  # private: this bearer token is required
    branches: dict[str, str] = field(default_factory=dict)  # name → commit

    def is_lfs(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in self.lfs)

    @property
    def commit(self) -> str:
        h = hashlib.sha1()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        return h.hexdigest()

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(name) else git_blob_sha1(data)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


class FakeHub:
    """Start with `with FakeHub() as hub:`; `hub.url` is the HF_ENDPOINT."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.valid_tokens: set[str] = set()
        self.missing: set[tuple[str, str]] = set()  # (repo, file): listed, but resolve answers 404 EntryNotFound
        self.cut_after: dict[tuple[str, str], int] = {}  # (repo, file) → the next GET drops the connection after n bytes
        self.tamper: dict[tuple[str, str], bytes] = {}  # (repo, file) → bytes served instead of the listed ones
        self.served_bytes: dict[str, int] = {}  # file → body bytes sent
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo_id: str, files: dict[str, bytes], **kw: Any) -> Repo:
        repo = Repo(files=dict(files), **kw)
        self.repos[repo_id] = repo
        if repo.token:
            self.valid_tokens.add(repo.token)
        return repo

    def gets(self, suffix: str = "") -> list[Request]:
        """GETs of files (resolve), optionally of one file."""
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.path.endswith(suffix)]

    def api_calls(self) -> list[Request]:
        return [r for r in self.requests if r.path.startswith("/api/")]

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.served_bytes.clear()

    # ---- HTTP ----

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._route(head=True)

            def do_GET(self) -> None:
                self._route(head=False)

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
                self.send_response(status)
                headers = {"Content-Length": str(len(body)), **(headers or {})}
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, status: int, code: str | None, message: str, head: bool, extra: dict[str, str] | None = None) -> None:
                headers = {"Content-Type": "application/json", **(extra or {})}
                if code:
                    headers["X-Error-Code"] = code
                headers["X-Error-Message"] = message
                self._send(status, json.dumps({"error": message}).encode(), headers, head)

            def _route(self, head: bool) -> None:
                url = urlparse(self.path)
                path = unquote(url.path)
                auth = self.headers.get("Authorization")
                with hub._lock:
                    hub.requests.append(Request(self.command, path, self.headers.get("Range"), auth))
                token = auth.split(" ", 1)[1] if auth and auth.lower().startswith("bearer ") else None
                if token is not None and token not in hub.valid_tokens:
                    return self._error(401, None, "Invalid credentials in Authorization header", head)
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/(.+))?", path)
                if m:
                    return self._api(m.group(1), m.group(2), m.group(3) or "main", parse_qs(url.query), token, head)
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m:
                    return self._resolve(m.group(1), m.group(2), m.group(3), token, head)
                self._error(404, None, "no such endpoint", head)

            def _repo(self, repo_id: str, rev: str, token: str | None, head: bool) -> tuple[Repo, str] | None:
                repo = hub.repos.get(repo_id)
                if repo is None or (repo.token and token != repo.token):
                    # like the hub: a private repo without its token is indistinguishable from a missing one
                    self._error(401 if token is None else 404, "RepoNotFound", "Repository not found", head)
                    return None
                commit = repo.commit
                if rev not in ("main", commit) and rev not in repo.branches:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
                    return None
                return repo, repo.branches.get(rev, commit)

            def _api(self, repo_id: str, kind: str | None, rev: str, query: dict[str, list[str]], token: str | None, head: bool) -> None:
                if kind == "tree":
                    rev = rev.split("/", 1)[0]
                found = self._repo(repo_id, rev, token, head)
                if found is None:
                    return
                repo, commit = found
                if kind == "tree":
                    entries = []
                    for name, data in sorted(repo.files.items()):
                        e: dict[str, Any] = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
                        if repo.is_lfs(name):
                            e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                        entries.append(e)
                    return self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head)
                blobs = query.get("blobs", ["false"])[0].lower() == "true"
                siblings = []
                for name, data in sorted(repo.files.items()):
                    s: dict[str, Any] = {"rfilename": name}
                    if blobs:
                        s.update(size=len(data), blobId=git_blob_sha1(data))
                        if repo.is_lfs(name):
                            s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                    siblings.append(s)
                info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": bool(repo.token), "siblings": siblings}
                self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)

            def _resolve(self, repo_id: str, rev: str, name: str, token: str | None, head: bool) -> None:
                found = self._repo(repo_id, rev, token, head)
                if found is None:
                    return
                repo, commit = found
                if name not in repo.files or (repo_id, name) in hub.missing:
                    return self._error(404, "EntryNotFound", f"{name} does not exist on \"{rev}\"", head,
                                       {"X-Repo-Commit": commit})
                data = hub.tamper.get((repo_id, name), repo.files[name])
                headers = {"X-Repo-Commit": commit, "ETag": f'"{repo.etag(name)}"', "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream"}
                if repo.is_lfs(name):
                    headers["X-Linked-Etag"] = f'"{repo.etag(name)}"'
                    headers["X-Linked-Size"] = str(len(data))
                status, start = 200, 0
                rng = self.headers.get("Range")
                if rng:
                    m = re.fullmatch(r"bytes=(\d+)-", rng)
                    start = int(m.group(1)) if m else 0
                    if start >= len(data):
                        return self._error(416, None, "Requested Range Not Satisfiable", head,
                                           {"Content-Range": f"bytes */{len(data)}"})
                    status = 206
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                body = data[start:]
                cut = None if head else hub.cut_after.pop((repo_id, name), None)
                if cut is not None:
                    # announce the whole body, send part of it, drop the connection: a network failure mid-file
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    with hub._lock:
                        hub.served_bytes[name] = hub.served_bytes.get(name, 0) + cut
                    self.close_connection = True
                    return
                headers["Content-Length"] = str(len(body))
                self._send(status, body, headers, head)
                if not head:
                    with hub._lock:
                        hub.served_bytes[name] = hub.served_bytes.get(name, 0) + len(body)

        return Handler
