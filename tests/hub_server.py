"""A Hugging Face hub on 127.0.0.1 for the tests: it serves model repos from local folders and answers what
huggingface_hub asks of the real hub (the repo info, the recursive tree listing, and each file's resolve
with the headers hf_hub_download reads: X-Repo-Commit, ETag, Content-Length), with the hub's error codes
(X-Error-Code: RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo). Point HF_ENDPOINT at `url` in
the processes under test: what they download and what they skip is then decided by the real
huggingface_hub and zerotrain code, and `downloads` records every file body served.

    with LocalHub() as hub:
        hub.add("org/tiny-flux", folder)                      # branch main
        hub.add("org/tiny-flux", other, revision="v1")        # a tag
        hub.add("org/gated", folder, gated_token="hf_secret") # 401 without that token
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf")}
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Revision:
    commit: str
    folder: Path

    def files(self) -> dict[str, Path]:
        return {p.relative_to(self.folder).as_posix(): p for p in sorted(self.folder.rglob("*")) if p.is_file()}


@dataclass
class Repo:
    revisions: dict[str, Revision] = field(default_factory=dict)
    """Branch or tag name, and commit sha, -> what it holds."""
    gated_token: str | None = None


def _sha(*parts: str) -> str:
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()


class LocalHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.downloads: list[tuple[str, str, str]] = []
        """(repo, revision as asked, file) of every file body sent (GET of a resolve)."""
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo_id: str, folder: Path, revision: str = "main", gated_token: str | None = None) -> str:
        """Serve `folder` as `revision` of `repo_id`; returns its commit sha."""
        repo = self.repos.setdefault(repo_id, Repo())
        repo.gated_token = gated_token or repo.gated_token
        commit = _sha(repo_id, revision, *(f"{k}:{p.stat().st_size}" for k, p in Revision(
            "", folder).files().items()))
        repo.revisions[revision] = repo.revisions[commit] = Revision(commit, Path(folder))
        return commit

    def downloaded(self, repo_id: str) -> list[str]:
        return [name for repo, _, name in self.downloads if repo == repo_id]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _fail(self, status: int, code: str, message: str) -> None:
                data = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _json(self, value: object, commit: str | None = None) -> None:
                data = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if commit:
                    self.send_header("X-Repo-Commit", commit)
                self.end_headers()
                self.wfile.write(data)

            def _repo(self, repo_id: str, revision: str) -> Revision | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._fail(401, "RepoNotFound", f"Repository Not Found for url: {self.path}.")
                    return None
                if repo.gated_token and self.headers.get("authorization") != f"Bearer {repo.gated_token}":
                    self._fail(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                                 "to it and be authenticated to access it. Please log in.")
                    return None
                found = repo.revisions.get(revision)
                if found is None:
                    self._fail(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return found

            def _answer(self, body: bool) -> None:
                path = urlsplit(self.path).path
                hub.requests.append((self.command, path))
                parts = [unquote(p) for p in path.strip("/").split("/")]
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                    repo_id, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
                    found = self._repo(repo_id, revision)
                    if found is None:
                        return
                    files = found.files()
                    if kind == "revision":
                        self._json({"id": repo_id, "modelId": repo_id, "sha": found.commit, "private": False,
                                    "gated": bool(hub.repos[repo_id].gated_token),
                                    "siblings": [{"rfilename": name} for name in files]})
                        return
                    under = "/".join(parts[6:])
                    entries = [{"type": "file", "oid": _sha(name, str(p.stat().st_size)), "size": p.stat().st_size,
                                "path": name} for name, p in files.items() if name.startswith(under)]
                    folders = sorted({name.rsplit("/", 1)[0] for name in files if "/" in name})
                    entries += [{"type": "directory", "oid": _sha(d), "size": 0, "path": d} for d in folders]
                    self._json(entries)
                    return
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                    found = self._repo(repo_id, revision)
                    if found is None:
                        return
                    file = found.files().get(name)
                    if file is None:
                        self._fail(404, "EntryNotFound", f"{name} does not exist on \"{revision}\"")
                        return
                    data = file.read_bytes()
                    self.send_response(200)
                    self.send_header("X-Repo-Commit", found.commit)
                    self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("Content-Type", "application/octet-stream")
                    self.end_headers()
                    if body:
                        self.wfile.write(data)
                        hub.downloads.append((repo_id, revision, name))
                    return
                self._fail(404, "NotFound", f"no route for {path}")

        return Handler
