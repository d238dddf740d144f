"""A Hugging Face Hub stand-in on loopback, speaking the part of the Hub's HTTP API that
huggingface_hub's `HfApi.model_info(files_metadata=True)` and `hf_hub_download` call:

- `GET /api/models/{repo}[/revision/{revision}]?blobs=true`: the repo's commit and files (`siblings`
  with `size`, `blobId`, and `lfs: {size, sha256, pointerSize}` for LFS files);
- `HEAD` and `GET /{repo}/resolve/{revision}/{path}`: the file, with `X-Repo-Commit`, `ETag` (the git
  blob id) and, for LFS files, `X-Linked-Etag` (the sha256) and `X-Linked-Size`; `Range: bytes=N-`.

Errors as the Hub sends them (`X-Error-Code` read by `hf_raise_for_status`): `RepoNotFound` (401
without a token, as the Hub answers for private and missing repos alike; 404 with one),
`RevisionNotFound`, `EntryNotFound`, `GatedRepo`, and 401 "Invalid credentials in Authorization
header" for a wrong token. Faults can be injected (`fail`): a status code or a connection cut off
mid-body, for the first N matching requests. Every request is recorded (`requests`).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    private: bool = False
    gated: bool = False


@dataclass
class Fault:
    method: str
    path_part: str  # matched anywhere in the path
    kind: str  # "503" (or any status) | "reset" (headers, half the body, then the connection closed)
    times: int


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    authorization: str | None
    status: int


class FakeHub:
    def __init__(self, token: str | None = None) -> None:
        self.token = token  # the one token that reads private repos
        self.repos: dict[str, Repo] = {}
        self.faults: list[Fault] = []
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- the Hub's content -------------------------------------------------------------------------
    def push(self, repo_id: str, files: dict[str, bytes], branch: str = "main", private: bool = False,
             gated: bool = False) -> str:
        """A commit on `branch` adding (or replacing) `files`; returns its id (40 hex digits)."""
        with self._lock:
            repo = self.repos.setdefault(repo_id, Repo(private=private, gated=gated))
            parent = repo.refs.get(branch)
            tree = dict(repo.commits.get(parent, {})) if parent else {}
            tree.update(files)
            commit = hashlib.sha1(json.dumps([parent, sorted((p, git_blob_id(b)) for p, b in tree.items())])
                                  .encode()).hexdigest()
            repo.commits[commit] = tree
            repo.refs[branch] = commit
            return commit

    def fail(self, method: str, path_part: str, kind: str = "503", times: int = 1) -> None:
        with self._lock:
            self.faults.append(Fault(method, path_part, kind, times))

    def seen(self, method: str, path_part: str = "") -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if r.method == method and path_part in r.path]

    def _fault(self, method: str, path: str) -> str | None:
        with self._lock:
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and fault.path_part in path:
                    fault.times -= 1
                    return fault.kind
        return None


def _sibling(path: str, data: bytes) -> dict:
    if path.endswith(LFS_SUFFIXES):
        sha = hashlib.sha256(data).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()
        return {"rfilename": path, "size": len(data), "blobId": git_blob_id(pointer),
                "lfs": {"size": len(data), "sha256": sha, "pointerSize": len(pointer)}}
    return {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's names
            self._serve("GET")

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve("HEAD")

        # -- answers -----------------------------------------------------------------------------
        def _send(self, method: str, status: int, body: bytes = b"", headers: dict | None = None) -> None:
            path = urlsplit(self.path).path
            with hub._lock:
                hub.requests.append(Seen(method, path, self.headers.get("authorization"), status))
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)

        def _error(self, method: str, status: int, code: str | None, message: str) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._send(method, status, json.dumps({"error": message}).encode(), headers)

        def _repo(self, method: str, repo_id: str) -> Repo | None:
            auth = self.headers.get("authorization")
            if auth is not None and auth != f"Bearer {hub.token}":
                self._error(method, 401, None, "Invalid credentials in Authorization header")
                return None
            repo = hub.repos.get(repo_id)
            if repo is None or repo.private and auth is None:
                # The Hub answers a missing repo and a private one alike: 401 without a token, 404 with one.
                self._error(method, 404 if auth else 401, "RepoNotFound", "Repository not found")
                return None
            if repo.gated and auth is None:
                self._error(method, 401, "GatedRepo", "Access to this model is restricted")
                return None
            return repo

        def _commit(self, method: str, repo: Repo, revision: str) -> str | None:
            commit = repo.refs.get(revision) or (revision if revision in repo.commits else None)
            if commit is None:
                self._error(method, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return commit

        def _serve(self, method: str) -> None:
            path = urlsplit(self.path).path
            fault = hub._fault(method, path)
            if fault is not None and fault != "reset":
                self._error(method, int(fault), None, "injected fault")
                return
            parts = [unquote(p) for p in path.split("/") if p]
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._info(method, parts)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file(method, parts, fault == "reset")
            else:
                self._error(method, 404, None, "no such route")

        def _info(self, method: str, parts: list[str]) -> None:
            repo_id = "/".join(parts[2:4])
            revision = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
            repo = self._repo(method, repo_id)
            commit = repo and self._commit(method, repo, revision)
            if commit is None:
                return
            tree = repo.commits[commit]
            body = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.private,
                    "siblings": [_sibling(p, b) for p, b in sorted(tree.items())]}
            self._send(method, 200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def _file(self, method: str, parts: list[str], reset: bool) -> None:
            repo_id, revision, file_path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo = self._repo(method, repo_id)
            commit = repo and self._commit(method, repo, revision)
            if commit is None:
                return
            data = repo.commits[commit].get(file_path)
            if data is None:
                self._error(method, 404, "EntryNotFound", f"{file_path} does not exist on {revision}")
                return
            sibling = _sibling(file_path, data)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{sibling["blobId"]}"',
                       "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
            if "lfs" in sibling:
                headers.update({"X-Linked-Etag": f'"{sibling["lfs"]["sha256"]}"', "X-Linked-Size": str(len(data))})
            status, body = 200, data
            ranged = self.headers.get("range", "")
            if method == "GET" and ranged.startswith("bytes=") and ranged.endswith("-"):
                start = int(ranged[6:-1])
                status, body = 206, data[start:]
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if reset and method == "GET":
                with hub._lock:
                    hub.requests.append(Seen(method, "/".join(["", *parts]), self.headers.get("authorization"), 0))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self._send(method, status, body, headers)

    return Handler
