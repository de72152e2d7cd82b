"""A local stand-in for the Hugging Face Hub, for tests of the real ``huggingface_hub`` client.

It listens on 127.0.0.1 (a free port) with the standard library's ``ThreadingHTTPServer``, keeps
repos in memory and speaks the endpoints ``huggingface_hub`` 2.4.0 uses to download
(``snapshot_download``) and to upload (``create_repo`` / ``get_paths_info`` / ``create_commit``
over the legacy LFS protocol, i.e. with ``HF_HUB_DISABLE_XET=1``). See
``/work/shared/knowledge/hub-protocol.md`` for what the client asks.

Knobs for tests (all thread-safe):

* ``add_repo`` / ``commit_files`` seed repos server-side; ``head``, ``history``, ``files_at`` read back.
* ``fail(method, path_glob, status, times, error_code, headers, echo_auth)``: answer the next ``times``
  matching requests with ``status`` (e.g. N times 503 then success, a 404 with ``X-Error-Code``, a 500 on
  the commit POST, a 429 with ``Retry-After``); ``echo_auth`` puts the request's ``Authorization`` header
  into the error message, as a careless proxy might (what the client does with it is then under test).
* ``truncate(repo, path, at, times)``: the next ``times`` GETs of a file announce the full length but
  send only ``at`` body bytes and drop the connection (the client should resume with ``Range``).
  ``reset(...)`` does the same but aborts the connection with a TCP RST ("connection reset by peer");
  ``stall(repo, path, seconds, at, times)`` sends ``at`` bytes and then nothing for ``seconds``.
* ``corrupt(repo, path)``: every GET of that file serves bytes of the right size with wrong content.
* ``log`` / ``requests(...)`` / ``file_requests()``: what was asked (method, path, query, status,
  range, monotonic time ``t``, and only *whether* an ``Authorization`` header was present — never its value).

``client_env`` and ``run_python`` run a client session in a subprocess (huggingface_hub reads
``HF_ENDPOINT``/``HF_HOME``/``HF_HUB_OFFLINE`` at import time); ``download`` runs our ``fetch_hf``
that way, as the CLI would (``Run``: exit code, output, the ``error:`` lines). ``assert_secret_absent``
is the token-leak check: no output stream, file name or file content may hold the secret.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".onnx", ".gguf", ".npz", ".npy", ".h5",
                ".msgpack", ".zip", ".tar", ".gz", ".zst", ".mlmodel", ".weights")
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = b"".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n".encode() for s in LFS_SUFFIXES)


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256(data)}\nsize {len(data)}\n".encode()


def wants_lfs(path: str, size: int, sample: bytes = b"") -> bool:
    """The server's choice between LFS and a regular git blob (suffix, binary sample or size)."""
    return path.endswith(LFS_SUFFIXES) or b"\0" in sample or size >= LFS_MIN_SIZE


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool
    sha1: str = field(init=False)
    sha256: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "sha1", git_sha1(self.data))
        object.__setattr__(self, "sha256", sha256(self.data))

    @property
    def etag(self) -> str:
        """What the Hub sends as ETag: sha256 for LFS files, the git blob sha1 otherwise."""
        return self.sha256 if self.lfs else self.sha1

    def tree_entry(self, path: str) -> dict:
        if not self.lfs:
            return {"type": "file", "path": path, "size": len(self.data), "oid": self.sha1}
        pointer = lfs_pointer(self.data)
        return {"type": "file", "path": path, "size": len(self.data), "oid": git_sha1(pointer),
                "lfs": {"oid": self.sha256, "size": len(self.data), "pointerSize": len(pointer)}}


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    files: dict[str, Blob]
    operations: list[str] = field(default_factory=list)  # "add path" / "delete path", in payload order


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    lfs_store: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes (uploaded LFS objects)

    def resolve(self, rev: str) -> Commit | None:
        oid = self.branches.get(rev, rev)
        return self.commits.get(oid)


@dataclass
class Fault:
    method: str | None
    path_glob: str
    status: int
    times: int
    error_code: str | None
    message: str
    headers: dict = field(default_factory=dict)
    echo_auth: bool = False


@dataclass
class Cut:
    """A damaged transfer of a file body: after ``at`` bytes, ``how`` = close (FIN), reset (RST) or stall."""
    at: int
    times: int
    how: str = "close"
    seconds: float = 0.0


class HubError(Exception):
    """Raised inside a handler to answer with an HTTP error (and X-Error-Code when given)."""

    def __init__(self, status: int, message: str, error_code: str | None = None, headers: dict | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.error_code, self.headers = status, message, error_code, headers or {}
        self.extra = extra or {}


class HubServer:
    """In-memory Hub on 127.0.0.1:<free port>. Use as a context manager (start/stop)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.repos: dict[str, Repo] = {}
        self.faults: list[Fault] = []
        self.cuts: dict[tuple[str, str], Cut] = {}  # (repo, path) -> how the next GETs are damaged
        self.stopping = threading.Event()  # ends stalls when the server stops
        self.corrupted: set[tuple[str, str]] = set()
        self.log: list[dict] = []
        self.errors: list[str] = []  # internal errors of the stand-in itself (a test should see none)
        self._counter = 0
        self.httpd: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "HubServer":
        server = self

        class Handler(_Handler):
            hub = server

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="hubserver", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.thread.join(timeout=5)
            self.httpd = None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- repos (server side) -----------------------------------------------------------------
    def _new_commit(self, repo: Repo, parent: str | None, message: str, files: dict[str, Blob],
                    operations: list[str] | None = None) -> str:
        self._counter += 1
        material = json.dumps([repo.repo_id, parent, message, self._counter,
                               sorted((p, b.sha1) for p, b in files.items())]).encode()
        oid = hashlib.sha1(material).hexdigest()
        repo.commits[oid] = Commit(oid, parent, message, dict(files), list(operations or []))
        return oid

    def create_repo(self, repo_id: str, *, initial: bool = True) -> Repo:
        """An empty repo; like the Hub, its ``main`` starts with a commit holding ``.gitattributes``."""
        with self.lock:
            repo = self.repos[repo_id] = Repo(repo_id)
            if initial:
                repo.branches["main"] = self._new_commit(
                    repo, None, "initial commit", {".gitattributes": Blob(GITATTRIBUTES, lfs=False)})
            return repo

    def add_repo(self, repo_id: str, files: dict[str, bytes | str], *, message: str = "add files",
                 lfs: set[str] | None = None) -> str:
        """Create ``repo_id`` with ``files`` committed on ``main``; returns the commit oid."""
        self.create_repo(repo_id, initial=False)
        return self.commit_files(repo_id, files, message=message, lfs=lfs)

    def commit_files(self, repo_id: str, files: dict[str, bytes | str], *, message: str = "update",
                     branch: str = "main", delete: tuple[str, ...] = (), lfs: set[str] | None = None) -> str:
        """A server-side commit on ``branch`` (LFS per ``lfs`` or by suffix/size); returns its oid."""
        with self.lock:
            repo = self.repos[repo_id]
            parent = repo.branches.get(branch)
            tree = dict(repo.commits[parent].files) if parent else {}
            operations = [f"delete {path}" for path in delete]
            for path in delete:
                tree.pop(path, None)
            for path, data in files.items():
                operations.append(f"add {path}")
                data = data.encode() if isinstance(data, str) else bytes(data)
                is_lfs = path in lfs if lfs is not None else wants_lfs(path, len(data))
                tree[path] = Blob(data, is_lfs)
                if is_lfs:
                    repo.lfs_store[sha256(data)] = data
            repo.branches[branch] = self._new_commit(repo, parent, message, tree, operations)
            return repo.branches[branch]

    def head(self, repo_id: str, branch: str = "main") -> str:
        with self.lock:
            return self.repos[repo_id].branches[branch]

    def history(self, repo_id: str, branch: str = "main") -> list[str]:
        """Commit oids on ``branch``, newest first."""
        with self.lock:
            repo, out = self.repos[repo_id], []
            oid = repo.branches.get(branch)
            while oid is not None:
                out.append(oid)
                oid = repo.commits[oid].parent
            return out

    def files_at(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        with self.lock:
            return {p: b.data for p, b in self.repos[repo_id].resolve(rev).files.items()}

    def blob(self, repo_id: str, path: str, rev: str = "main") -> Blob:
        with self.lock:
            return self.repos[repo_id].resolve(rev).files[path]

    def commit(self, repo_id: str, oid: str) -> Commit:
        with self.lock:
            return self.repos[repo_id].commits[oid]

    # --- fault injection -----------------------------------------------------------------------
    def fail(self, method: str | None, path_glob: str, status: int = 500, *, times: int = 1,
             error_code: str | None = None, message: str | None = None, headers: dict | None = None,
             echo_auth: bool = False) -> None:
        """Answer the next ``times`` requests matching (method, path glob on the URL path) with ``status``
        (plus ``headers``, e.g. ``Retry-After``; ``echo_auth``: the Authorization header in the message)."""
        with self.lock:
            self.faults.append(Fault(method, path_glob, status, times, error_code,
                                     message or f"injected {status}", dict(headers or {}), echo_auth))

    def truncate(self, repo_id: str, path: str, *, at: int, times: int = 1) -> None:
        """The next ``times`` GETs of ``path`` send ``at`` body bytes (of the announced length) then hang up.

        huggingface_hub 2.4.0 writes a body in 10 MiB chunks and resumes (``Range: bytes=N-``) from what
        it wrote, so a cut inside the first 10 MiB makes it start over without ``Range``."""
        with self.lock:
            self.cuts[(repo_id, path)] = Cut(at, times, "close")

    def reset(self, repo_id: str, path: str, *, at: int, times: int = 1) -> None:
        """Like ``truncate`` but the connection is aborted with a TCP RST after ``at`` bytes
        (the client sees "connection reset by peer"; bytes still in flight may be lost)."""
        with self.lock:
            self.cuts[(repo_id, path)] = Cut(at, times, "reset")

    def stall(self, repo_id: str, path: str, *, seconds: float, at: int = 0, times: int = 1) -> None:
        """The next ``times`` GETs of ``path`` send the headers and ``at`` body bytes, then nothing for
        ``seconds`` (or until the server stops), then hang up."""
        with self.lock:
            self.cuts[(repo_id, path)] = Cut(at, times, "stall", seconds)

    def corrupt(self, repo_id: str, path: str) -> None:
        """Every GET of ``path`` serves wrong bytes of the right size (headers still name the true hash)."""
        with self.lock:
            self.corrupted.add((repo_id, path))

    # --- request log ---------------------------------------------------------------------------
    def requests(self, method: str | None = None, path_glob: str = "*") -> list[dict]:
        with self.lock:
            return [e for e in self.log if (method is None or e["method"] == method)
                    and fnmatch.fnmatchcase(e["path"], path_glob)]

    def file_requests(self) -> list[dict]:
        """HEAD/GET requests of file contents (``/{ns}/{name}/resolve/...``)."""
        return [e for e in self.requests() if "/resolve/" in e["path"]]

    def clear_log(self) -> None:
        with self.lock:
            self.log.clear()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.times > 0 and fault.method in (None, method) and fnmatch.fnmatchcase(path, fault.path_glob):
                    fault.times -= 1
                    return fault
        return None


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"
    server_version = "hubserver/1"

    def log_message(self, format, *args):  # noqa: A002 - silence the default stderr logging
        pass

    # --- plumbing ------------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _record(self, status: int) -> None:
        split = urlsplit(self.path)
        with self.hub.lock:
            self.hub.log.append({
                "method": self.command, "path": split.path, "query": split.query, "status": status,
                "auth": "authorization" in {k.lower() for k in self.headers.keys()},
                "range": self.headers.get("Range"), "t": time.monotonic(),
            })

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              content_type: str = "application/json", length: int | None = None) -> None:
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, value, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(value).encode(), headers)

    def _error(self, err: HubError) -> None:
        headers = dict(err.headers)
        headers["X-Error-Message"] = err.message
        if err.error_code:
            headers["X-Error-Code"] = err.error_code
        self._json({**err.extra, "error": err.message}, err.status, headers)

    def _handle(self) -> None:
        split = urlsplit(self.path)
        body = self._body() if self.command in ("POST", "PUT") else b""
        try:
            fault = self.hub._take_fault(self.command, split.path)
            if fault is not None:
                message = fault.message
                if fault.echo_auth:
                    message += f" (Authorization: {self.headers.get('Authorization', 'none')})"
                raise HubError(fault.status, message, fault.error_code, fault.headers)
            self._route([unquote(s) for s in split.path.split("/")[1:]], parse_qs(split.query), body)
        except HubError as err:
            self._error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # a bug in the stand-in: make it visible to the test
            with self.hub.lock:
                self.hub.errors.append(f"{self.command} {split.path}: {type(exc).__name__}: {exc}")
            try:
                self._error(HubError(500, f"hubserver internal error: {type(exc).__name__}: {exc}"))
            except OSError:
                self.close_connection = True

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _handle

    # --- routing -------------------------------------------------------------------------------
    def _repo(self, ns: str, name: str) -> Repo:
        repo = self.hub.repos.get(f"{ns}/{name}")
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _commit(self, repo: Repo, rev: str) -> Commit:
        commit = repo.resolve(rev)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return commit

    def _need_auth(self) -> None:
        if "authorization" not in {k.lower() for k in self.headers.keys()}:
            raise HubError(401, "Invalid username or password.")

    def _route(self, seg: list[str], query: dict, body: bytes) -> None:
        m, resolved = self.command, None
        with self.hub.lock:
            if seg[:2] == ["api", "models"] and len(seg) >= 4:
                repo, rest = self._repo(seg[2], seg[3]), seg[4:]
                if m == "GET" and (rest == [] or (len(rest) == 2 and rest[0] == "revision")):
                    return self._repo_info(repo, rest[1] if rest else "main")
                if m == "GET" and len(rest) >= 2 and rest[0] == "tree":
                    return self._tree(repo, rest[1], "/".join(rest[2:]), query)
                if m == "POST" and len(rest) == 2 and rest[0] == "paths-info":
                    return self._paths_info(repo, rest[1], body)
                if m == "POST" and len(rest) == 2 and rest[0] == "preupload":
                    return self._preupload(repo, rest[1], body)
                if m == "POST" and len(rest) == 2 and rest[0] == "commit":
                    return self._commit_post(repo, rest[1], body)
                if len(rest) >= 1 and rest[0] == "xet-write-token":
                    raise HubError(501, "hubserver speaks no Xet: set HF_HUB_DISABLE_XET=1")
            elif seg == ["api", "repos", "create"] and m == "POST":
                return self._create_repo(body)
            elif seg == ["api", "validate-yaml"] and m == "POST":
                return self._json({"errors": [], "warnings": []})
            elif len(seg) == 6 and seg[1].endswith(".git") and seg[2:] == ["info", "lfs", "objects", "batch"]:
                return self._lfs_batch(self._repo(seg[0], seg[1][:-4]), body)
            elif seg[:2] == ["_lfs", "upload"] and len(seg) == 5 and m == "PUT":
                return self._lfs_put(self._repo(seg[2], seg[3]), seg[4], body)
            elif seg[:2] == ["_lfs", "verify"] and len(seg) == 4 and m == "POST":
                return self._lfs_verify(self._repo(seg[2], seg[3]), body)
            elif len(seg) >= 5 and seg[2] == "resolve" and m in ("GET", "HEAD"):
                repo = self._repo(seg[0], seg[1])
                commit = self._commit(repo, seg[3])
                path = "/".join(seg[4:])
                blob = commit.files.get(path)
                if blob is None:
                    raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.oid})
                key = (repo.repo_id, path)
                cut = self.hub.cuts.get(key)
                if m == "GET" and cut is not None and cut.times > 0:
                    cut.times -= 1
                else:
                    cut = None
                resolved = (commit, blob, cut, key in self.hub.corrupted)
        if resolved is not None:
            return self._resolve(*resolved)  # file bodies are sent outside the lock
        raise HubError(404, f"hubserver: no route for {m} /{'/'.join(seg)}")

    # --- download --------------------------------------------------------------------------------
    def _repo_info(self, repo: Repo, rev: str) -> None:
        commit = self._commit(repo, rev)
        self._json({"id": repo.repo_id, "modelId": repo.repo_id, "sha": commit.oid, "private": False,
                    "siblings": [{"rfilename": p} for p in sorted(commit.files)]})

    def _entries(self, commit: Commit, prefix: str, recursive: bool) -> list[dict]:
        prefix = prefix.strip("/")
        base = f"{prefix}/" if prefix else ""
        files, dirs = [], set()
        for path in sorted(commit.files):
            if not path.startswith(base):
                continue
            rest = path[len(base):]
            parts = rest.split("/")
            for i in range(1, len(parts)):
                if recursive or i == 1:
                    dirs.add(base + "/".join(parts[:i]))
            if recursive or len(parts) == 1:
                files.append(commit.files[path].tree_entry(path))
        folders = [{"type": "directory", "path": d, "size": 0, "oid": hashlib.sha1(d.encode()).hexdigest()}
                   for d in sorted(dirs)]
        return folders + files

    def _tree(self, repo: Repo, rev: str, path: str, query: dict) -> None:
        commit = self._commit(repo, rev)
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        if path and path not in commit.files and not any(p.startswith(path.strip("/") + "/") for p in commit.files):
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        self._json(self._entries(commit, path, recursive))

    def _resolve(self, commit: Commit, blob: Blob, cut: Cut | None, corrupt: bool) -> None:
        data = blob.data
        if corrupt and data:
            data = bytes(b ^ 0x5A for b in data)
        size = len(data)
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{blob.etag}"', "Accept-Ranges": "bytes"}
        if blob.lfs:
            headers["X-Linked-Etag"] = f'"{blob.sha256}"'
            headers["X-Linked-Size"] = str(size)
        status, start = 200, 0
        rng = self.headers.get("Range")
        if rng and self.command == "GET":
            try:
                first, _, last = rng.strip().removeprefix("bytes=").partition("-")
                start = int(first)
                end = int(last) if last else size - 1
            except ValueError:
                raise HubError(416, f"bad Range {rng!r}") from None
            if start >= size or end < start:
                raise HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            end = min(end, size - 1)
            data = data[start:end + 1]
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        if cut is not None and self.command == "GET":
            self._record(status)
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:cut.at])
            self.wfile.flush()
            self.close_connection = True
            if cut.how == "stall":
                self.hub.stopping.wait(cut.seconds)
            elif cut.how == "reset":
                self._abort()
            return
        self._send(status, data, headers, content_type="application/octet-stream")

    def _abort(self) -> None:
        """Close the connection with a TCP RST instead of a FIN (SO_LINGER on, timeout 0)."""
        time.sleep(0.2)  # let the client read what was sent: an RST discards data still in flight
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()  # drop the makefile() reference so close() really closes the socket
        self.connection.close()

    # --- upload ----------------------------------------------------------------------------------
    def _create_repo(self, body: bytes) -> None:
        self._need_auth()
        payload = json.loads(body or b"{}")
        if payload.get("type", "model") not in (None, "model"):
            raise HubError(400, "hubserver only serves model repos")
        repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:
            raise HubError(409, "You already created this model repo", extra={"url": url})
        self.hub.create_repo(repo_id)
        self._json({"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]})

    def _paths_info(self, repo: Repo, rev: str, body: bytes) -> None:
        commit = self._commit(repo, rev)
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            paths = json.loads(body or b"{}").get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        out = []
        for path in paths:
            path = path.strip("/")
            if path in commit.files:
                out.append(commit.files[path].tree_entry(path))
            elif any(p.startswith(path + "/") for p in commit.files):
                out.append({"type": "directory", "path": path, "size": 0,
                            "oid": hashlib.sha1(path.encode()).hexdigest()})
        self._json(out)

    def _preupload(self, repo: Repo, rev: str, body: bytes) -> None:
        self._need_auth()
        commit = self._commit(repo, rev)
        out = []
        for f in json.loads(body)["files"]:
            sample = base64.b64decode(f.get("sample", ""))
            mode = "lfs" if wants_lfs(f["path"], int(f["size"]), sample) else "regular"
            entry = {"path": f["path"], "uploadMode": mode, "shouldIgnore": False}
            existing = commit.files.get(f["path"])
            if existing is not None:
                entry["oid"] = existing.sha256 if mode == "lfs" else existing.sha1
            out.append(entry)
        self._json({"files": out, "commitOid": commit.oid})

    def _lfs_batch(self, repo: Repo, body: bytes) -> None:
        self._need_auth()
        payload = json.loads(body)
        if payload.get("operation") != "upload":
            raise HubError(400, "hubserver: only LFS uploads are supported")
        ns, name = repo.repo_id.split("/")
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in repo.lfs_store:
                entry["authenticated"] = True
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.url}/_lfs/upload/{ns}/{name}/{obj['oid']}"},
                    "verify": {"href": f"{self.hub.url}/_lfs/verify/{ns}/{name}"},
                }
            objects.append(entry)
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                   content_type="application/vnd.git-lfs+json")

    def _lfs_put(self, repo: Repo, oid: str, body: bytes) -> None:
        if sha256(body) != oid:
            raise HubError(400, f"LFS object content does not match its oid {oid}")
        repo.lfs_store[oid] = body
        self._send(200, b"", content_type="text/plain")

    def _lfs_verify(self, repo: Repo, body: bytes) -> None:
        self._need_auth()
        obj = json.loads(body)
        data = repo.lfs_store.get(obj["oid"])
        if data is None or len(data) != obj["size"]:
            raise HubError(404, f"LFS object {obj['oid']} not found")
        self._json({})

    def _commit_post(self, repo: Repo, rev: str, body: bytes) -> None:
        self._need_auth()
        if rev not in repo.branches:
            if rev in repo.commits:
                raise HubError(400, "Cannot commit on a commit hash, only on a branch")
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        parent = repo.branches[rev]
        tree = dict(repo.commits[parent].files)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "commit payload must start with a header line")
        header = lines[0]["value"]
        if header.get("parentCommit") not in (None, parent):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        operations = []
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            operations.append(f"{'delete' if key.startswith('deleted') else 'add'} {value['path']}")
            if key == "file":
                tree[value["path"]] = Blob(base64.b64decode(value["content"]), lfs=False)
            elif key == "lfsFile":
                data = repo.lfs_store.get(value["oid"])
                if data is None or ("size" in value and value["size"] != len(data)):
                    raise HubError(422, f"LFS object {value['oid']} of {value['path']} was never uploaded")
                tree[value["path"]] = Blob(data, lfs=True)
            elif key == "deletedFile":
                if tree.pop(value["path"], None) is None:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                for path in [p for p in tree if p.startswith(value["path"].rstrip("/") + "/")]:
                    del tree[path]
            else:
                raise HubError(400, f"hubserver: unsupported commit operation {key!r}")
        message = header.get("summary", "")
        if header.get("description"):
            message += "\n\n" + header["description"]
        oid = self.hub._new_commit(repo, parent, message, tree, operations)
        repo.branches[rev] = oid
        self._json({"success": True, "commitOid": oid, "commitUrl": f"{self.hub.url}/{repo.repo_id}/commit/{oid}",
                    "hookOutput": "", "pullRequestUrl": None})


# --- running a client session in a subprocess ------------------------------------------------
def client_env(hub: HubServer, hf_home: str | Path, *, token: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a client process talking to ``hub`` only (no real token, no Xet, no telemetry).

    ``token``: put it in ``HF_TOKEN`` and let huggingface_hub send it implicitly, as in production
    (without it, implicit tokens are disabled: nothing from this machine can reach the stand-in)."""
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith(("HF_", "HUGGINGFACE", "HUGGING_FACE"))}
    env.update({
        "HF_ENDPOINT": hub.url,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "HF_HUB_ETAG_TIMEOUT": "5",
        "HF_HUB_DOWNLOAD_TIMEOUT": "5",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    if token is not None:
        env["HF_TOKEN"] = token
        del env["HF_HUB_DISABLE_IMPLICIT_TOKEN"]
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(code: str, env: dict[str, str], *args: str, timeout: float = 60,
               cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this venv; returns the completed process (text mode)."""
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


# fetch_hf through the CLI wrapper (errors.main_guard): a PipelineError is one ``error: ...`` line on
# stderr and exit code 1. On success: the snapshot, the sha256 of its files and their blob names.
DOWNLOAD = r'''
import hashlib, json, sys
from pathlib import Path
from recurrent_coreai.util.errors import main_guard
from recurrent_coreai.hub.download import fetch_hf

@main_guard
def main():
    args = json.loads(sys.argv[1])
    snapshot = fetch_hf(args["repo"], args["revision"], args.get("allow_patterns"))
    files = sorted(p for p in snapshot.rglob("*") if p.is_file())
    print(json.dumps({"snapshot": str(snapshot),
                      "files": {p.relative_to(snapshot).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                                for p in files},
                      "blobs": {p.relative_to(snapshot).as_posix(): Path(p.resolve()).name for p in files}}))

sys.exit(main())
'''


class Run:
    """A finished client session: exit code, output, the JSON result (last stdout line, on success)
    and the ``error:`` lines of stderr."""

    def __init__(self, proc: subprocess.CompletedProcess, seconds: float = 0.0):
        self.rc, self.stdout, self.stderr, self.seconds = proc.returncode, proc.stdout, proc.stderr, seconds
        lines = proc.stdout.strip().splitlines()
        self.result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
        self.errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]

    @property
    def files(self) -> dict[str, str]:
        """sha256 of every file of the returned snapshot."""
        return self.result["files"]

    def one_error(self) -> str:
        """The single ``error:`` line of a failed run (and nothing like a traceback)."""
        assert self.rc == 1, self
        assert "Traceback" not in self.stderr, self
        assert len(self.errors) == 1, self
        return self.errors[0]

    def __repr__(self) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


def run_client(code: str, env: dict[str, str], *args: str, timeout: float = 60) -> Run:
    start = time.monotonic()
    proc = run_python(code, env, *args, timeout=timeout)
    return Run(proc, time.monotonic() - start)


def download(hub: HubServer, hf_home: str | Path, revision: str, *, repo: str, allow_patterns=None,
             token: str | None = None, **env: str) -> Run:
    """``fetch_hf(repo, revision, allow_patterns)`` in a fresh client process against ``hub``."""
    args = json.dumps({"repo": repo, "revision": revision, "allow_patterns": allow_patterns})
    return run_client(DOWNLOAD, client_env(hub, hf_home, token=token, **env), args)


def assert_secret_absent(secret: str, outputs: list[str], *roots: str | Path) -> None:
    """The token-leak check: ``secret`` (or a 12-character piece of it) is in none of ``outputs``
    (stdout/stderr of a client) and in no file name or file content below ``roots``."""
    pieces = {secret, secret[:12], secret[-12:]}
    for i, text in enumerate(outputs):
        for piece in pieces:
            assert piece not in text, f"output #{i} holds (part of) the secret"
    for root in roots:
        for path in Path(root).rglob("*"):
            for piece in pieces:
                assert piece not in str(path), f"a file name holds (part of) the secret: {path}"
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                for piece in pieces:
                    assert piece.encode() not in data, f"{path} holds (part of) the secret"
