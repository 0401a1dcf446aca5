"""A minimal Hugging Face Hub on 127.0.0.1, for `HF_ENDPOINT`: serves model repos
from local folders with the endpoints huggingface_hub's `snapshot_download`
and `hf_hub_download` use, so downloads in tests are real HTTP downloads
through huggingface_hub's own code, with no network.

Endpoints (as huggingface_hub 1.x/2.x calls them):
- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: model info
  with `sha` (the commit) and `siblings` (`HfApi.model_info` / `repo_info`).
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=..`: the file listing
  (`HfApi.list_repo_tree`, which snapshot_download uses and caches as
  `trees/<commit>.json`): `type`, `path`, `size`, `oid` (git blob sha1), and
  `lfs` {`oid` (sha256), `size`, `pointerSize`} for large files.
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: a regular file answers 200 with
  `X-Repo-Commit`, `ETag` (its git blob sha1) and `Content-Length`; an LFS file
  (weights) answers 302 with `X-Repo-Commit`, `X-Linked-Etag` (sha256),
  `X-Linked-Size` and a `Location` on a second origin standing in for the
  CDN, as the Hub does, so huggingface_hub takes the metadata from the
  redirect and downloads from the "CDN" without following it on HEAD.
- `HEAD`/`GET /blobs/{sha256}` on the CDN origin, with `Range` support (206).
Errors carry `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound)
as huggingface_hub's error mapping expects. Every request is logged in
`HubServer.requests` so tests can tell whether a command touched the network.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".onnx")


@dataclass
class HubFile:
    path: str
    data: bytes
    lfs: bool

    @property
    def blob_sha1(self) -> str:  # git's object id of the file (the Hub's ETag of a regular file)
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def sha256(self) -> str:  # an LFS file's id (the Hub's X-Linked-Etag)
        return hashlib.sha256(self.data).hexdigest()


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, HubFile] = field(default_factory=dict)

    @classmethod
    def from_folder(cls, repo_id: str, folder: Path) -> "HubRepo":
        repo = cls(repo_id)
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                rel = p.relative_to(folder).as_posix()
                repo.files[rel] = HubFile(rel, p.read_bytes(), rel.endswith(LFS_SUFFIXES))
        return repo

    @property
    def commit(self) -> str:
        """A stable 40-hex commit id derived from the contents (changes when any file changes)."""
        h = hashlib.sha1()
        for f in sorted(self.files.values(), key=lambda f: f.path):
            h.update(f.path.encode() + b"\0" + f.blob_sha1.encode())
        return h.hexdigest()

    def resolves(self, revision: str) -> bool:
        return revision in ("main", self.commit)


class HubServer:
    """`with HubServer({"org/name": folder}) as hub:` then `HF_ENDPOINT=hub.url`."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = {rid: HubRepo.from_folder(rid, Path(folder)) for rid, folder in repos.items()}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, hub and CDN
        self._blobs = {f.sha256: f for r in self.repos.values() for f in r.files.values() if f.lfs}
        self._hub = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(cdn=False))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(cdn=True))
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self._hub, self._cdn)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    def __enter__(self) -> "HubServer":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for s in (self._hub, self._cdn):
            s.shutdown()
            s.server_close()

    def downloads(self) -> list[str]:
        """Paths of file bodies served (GET of a resolve or blob URL)."""
        return [p for m, p in self.requests if m == "GET" and ("/resolve/" in p or p.startswith("/blobs/"))]

    # -- request handling ------------------------------------------------------------------------

    def _handler(self, cdn: bool):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: tests read hub.requests instead
                pass

            def do_HEAD(self) -> None:
                self._dispatch(body=False)

            def do_GET(self) -> None:
                self._dispatch(body=True)

            def _dispatch(self, body: bool) -> None:
                path = urlsplit(self.path).path
                hub.requests.append((self.command, path))
                if cdn:
                    return self._blob(path, body)
                if path.startswith("/api/models/"):
                    return self._api(path[len("/api/models/"):])
                for repo in hub.repos.values():
                    prefix = f"/{repo.repo_id}/resolve/"
                    if path.startswith(prefix):
                        revision, _, file = path[len(prefix):].partition("/")
                        return self._resolve(repo, unquote(revision), unquote(file), body)
                self._error(404, "RepoNotFound", "Repository not found")

            # model info and file listing
            def _api(self, rest: str) -> None:
                repo = next((r for r in hub.repos.values()
                             if rest == r.repo_id or rest.startswith(r.repo_id + "/")), None)
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found")
                rest = rest[len(repo.repo_id):].lstrip("/")
                m = re.fullmatch(r"(revision|tree)/([^/]+)(?:/(.*))?", rest) if rest else None
                kind, revision, sub = (m.group(1), unquote(m.group(2)), unquote(m.group(3) or "")) if m \
                    else ("revision", "main", "")
                if rest and m is None:
                    return self._error(404, None, "Not found")
                if not repo.resolves(revision):
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", repo)
                if kind == "revision":
                    return self._json({
                        "id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit, "private": False,
                        "disabled": False, "gated": False, "tags": [], "downloads": 0, "likes": 0,
                        "lastModified": "2024-01-01T00:00:00.000Z",
                        "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                    }, repo)
                return self._json(self._tree(repo, sub), repo)

            def _tree(self, repo: HubRepo, sub: str) -> list[dict]:
                entries, dirs = [], set()
                for f in sorted(repo.files.values(), key=lambda f: f.path):
                    if sub and not f.path.startswith(sub.rstrip("/") + "/"):
                        continue
                    parts = f.path.split("/")
                    for i in range(1, len(parts)):
                        dirs.add("/".join(parts[:i]))
                    entry = {"type": "file", "oid": f.blob_sha1, "size": len(f.data), "path": f.path}
                    if f.lfs:
                        entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
                    entries.append(entry)
                tree_ids = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "path": d}
                            for d in sorted(dirs) if not sub or d.startswith(sub.rstrip("/") + "/")]
                return tree_ids + entries

            # file contents
            def _resolve(self, repo: HubRepo, revision: str, name: str, body: bool) -> None:
                if not repo.resolves(revision):
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", repo)
                f = repo.files.get(name)
                if f is None:
                    return self._error(404, "EntryNotFound", f"{name} does not exist", repo)
                if f.lfs:  # as the Hub: metadata on the redirect, the bytes on the CDN
                    self.send_response(302)
                    self.send_header("X-Repo-Commit", repo.commit)
                    self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                    self.send_header("X-Linked-Size", str(len(f.data)))
                    self.send_header("ETag", f'"{f.blob_sha1}"')
                    self.send_header("Location", f"{hub.cdn_url}/blobs/{f.sha256}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._bytes(f.data, body, {"X-Repo-Commit": repo.commit, "ETag": f'"{f.blob_sha1}"'})

            def _blob(self, path: str, body: bool) -> None:
                f = hub._blobs.get(path.removeprefix("/blobs/"))
                if f is None:
                    return self._error(404, None, "No such blob")
                self._bytes(f.data, body, {"ETag": f'"{f.sha256}"'})

            def _bytes(self, data: bytes, body: bool, headers: dict[str, str]) -> None:
                start, end, status = 0, len(data), 200
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "") or "")
                if m:
                    start = int(m.group(1))
                    end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
                    status = 206
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Type", "application/octet-stream")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.send_header("Content-Length", str(end - start))
                self.end_headers()
                if body:
                    self.wfile.write(data[start:end])

            def _json(self, payload, repo: HubRepo | None = None, status: int = 200,
                      headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                if repo is not None:
                    self.send_header("X-Repo-Commit", repo.commit)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _error(self, status: int, code: str | None, message: str, repo: HubRepo | None = None) -> None:
                headers = {"X-Error-Code": code, "X-Error-Message": message} if code else None
                self._json({"error": message}, repo, status, headers)

        return Handler
