"""A local stand-in for the Hugging Face Hub that the real ``huggingface_hub`` client talks to.

It serves exactly the routes ``huggingface_hub`` 2.x calls for what spark-quant does (read in
``huggingface_hub/hf_api.py``, ``file_download.py``, ``_commit_api.py``, ``lfs.py``):

- ``GET /api/models/{repo}[/revision/{rev}]`` (``model_info``, ``?blobs=true`` for sizes and LFS)
- ``HEAD|GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag`` / ``X-Linked-Etag`` /
  ``X-Linked-Size`` and HTTP ranges (``hf_hub_download``, ``parse_safetensors_file_metadata``)
- ``POST /api/validate-yaml``, ``POST /api/repos/create``, ``POST /api/models/{repo}/branch/{b}``
- ``POST /api/models/{repo}/preupload/{rev}`` (upload mode and remote oid per file)
- ``POST /{repo}.git/info/lfs/objects/batch`` + ``PUT /lfs-upload/{oid}`` (LFS basic transfer;
  objects already stored get no ``actions``, which is how an upload resumes)
- ``POST /api/models/{repo}/commit/{rev}`` (ndjson: header, file, lfsFile, deletedFile)

It does not speak the Xet CAS protocol: upload tests set ``HF_HUB_DISABLE_XET=1`` so the client
uses LFS. It listens on 127.0.0.1 only, logs every request, can run a hook on chosen events (to
kill a client mid-transfer), and shuts itself down after ``lifetime`` seconds.

``bandwidth`` (bytes/s, all downloads together) makes it a link of fixed speed
(scripts/bench_hub.py); ``corrupt`` serves a flipped byte in a file's body (a bad link or
CDN), ``drop`` ends a response early (a dropped connection).
"""

import base64
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
ROOT = Path(__file__).resolve().parents[1]


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Blob:
    """One file version: its bytes (in memory or a local file), sizes and hashes."""

    data: bytes | None = None
    path: Path | None = None

    def __post_init__(self):
        raw = self.data if self.data is not None else Path(self.path).read_bytes()
        self.size = len(raw)
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.oid = git_oid(raw)

    def read(self, start: int = 0, end: int | None = None) -> bytes:
        end = self.size if end is None else end
        if self.data is not None:
            return self.data[start:end]
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size > 10 * 2**20


class FakeRepo:
    def __init__(self, repo_id: str, private: bool = False, card_data: dict | None = None):
        self.repo_id, self.private, self.card_data = repo_id, private, card_data
        self.commits: dict[str, dict[str, Blob]] = {}
        self.branches: dict[str, str] = {}
        self.commit({}, "main", "initial commit")

    def commit(self, files: dict[str, Blob], branch: str, message: str) -> str:
        parent = self.branches.get(branch, "")
        tree = dict(self.commits.get(parent, {}))
        tree.update(files)
        sha = hashlib.sha1(json.dumps([parent, message, sorted((p, b.oid) for p, b in tree.items())]
                                      ).encode()).hexdigest()
        self.commits[sha] = tree
        self.branches[branch] = sha
        return sha

    def resolve(self, rev: str) -> str | None:
        rev = unquote(rev)
        if rev in self.branches:
            return self.branches[rev]
        return rev if rev in self.commits else None

    def files(self, branch: str = "main") -> dict[str, Blob]:
        return self.commits[self.branches[branch]]


class FakeHub:
    """Start with ``with FakeHub(token=...) as hub:``; ``hub.url`` is the HF_ENDPOINT."""

    def __init__(self, token: str | None = None, lifetime: float = 300.0):
        self.token, self.lifetime = token, lifetime
        self.repos: dict[str, FakeRepo] = {}
        self.lfs: dict[str, bytes] = {}
        self.log: list[dict] = []
        self.times: list[float] = []  # time.monotonic() of each log entry
        self.hooks: list = []  # called with each event dict; may kill a client
        self.reject_yaml: str | None = None
        self.watch: Path | None = None  # a cache dir: sample its blob bytes at each shard GET
        self.samples: list[dict] = []
        # injected failures: {"method", "path" (regex, re.search), "status", "retry_after"
        # (header value or None), "times"}; each matching request is answered with the status
        # until "times" runs out (a flaky Hub: 429 rate limits, 503 overload)
        self.flaky: list[dict] = []
        self.failed: list[dict] = []  # the requests answered by an injected failure
        # {"path" (regex), "offset" (byte of the file), "times"}: that byte is served flipped
        # in each matching download (GET of a range holding it) until "times" runs out
        self.corrupt: list[dict] = []
        # {"path" (regex), "after" (bytes of the response body), "times"}: the connection is
        # closed after that many bytes of a matching download's body
        self.drop: list[dict] = []
        self.bandwidth: float | None = None  # bytes/s shared by every download, None: no limit
        self._link = threading.Lock()
        self._link_t = 0.0  # when the link is free again (time.monotonic)
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self._timer = threading.Timer(self.lifetime, self.close)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()

    def serve_folder(self, repo_id: str, folder: Path, private: bool = False,
                     card_data: dict | None = None) -> str:
        """Publish every file of ``folder`` as one commit on ``main``; returns the commit."""
        repo = self.repos.setdefault(repo_id, FakeRepo(repo_id, private, card_data))
        files = {str(p.relative_to(folder)): Blob(path=p) for p in sorted(Path(folder).rglob("*"))
                 if p.is_file()}
        return repo.commit(files, "main", "upload folder")

    def event(self, **ev) -> bool:
        """Log ``ev`` (its time.monotonic() in ``times``) and run the hooks;
        True when a hook acted (e.g. killed the client)."""
        with self._lock:
            self.log.append(ev)
            self.times.append(time.monotonic())
        return any([hook(ev) for hook in list(self.hooks)])

    def _take(self, path: str, table: list[dict]) -> dict | None:
        with self._lock:
            hit = next((f for f in table if f["times"] > 0 and re.search(f["path"], path)), None)
            if hit is not None:
                hit["times"] -= 1
            return hit

    def send_throttled(self, wfile, data: bytes) -> None:
        """Write ``data`` at most at ``bandwidth`` bytes/s, counted over every download at
        once (one link), in 1 MiB pieces."""
        piece = 2**20
        for i in range(0, len(data), piece):
            chunk = data[i:i + piece]
            if self.bandwidth:
                with self._link:
                    now = time.monotonic()
                    self._link_t = max(self._link_t, now) + len(chunk) / self.bandwidth
                    wait = self._link_t - now
                if wait > 0:
                    time.sleep(wait)
            wfile.write(chunk)

    def blob_bytes(self) -> int:
        """Bytes of every LFS blob (named by sha256; finished or ``.incomplete``) under the
        watched cache folder: the source shards on disk."""
        return sum(p.stat().st_size for p in self.watch.rglob("blobs/*")
                   if p.is_file() and re.match(r"[0-9a-f]{64}($|\.)", p.name))


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client killed mid-request is expected
        pass


_API_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/(.+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_REPO_OP = re.compile(r"^/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/(.+)$")
_LFS_BATCH = re.compile(r"^/([^/]+/[^/]+)\.git/info/lfs/objects/batch$")
_LFS_PUT = re.compile(r"^/lfs-upload/([0-9a-f]{64})$")


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 30

        def log_message(self, *args):  # quiet
            pass

        # ---- plumbing ----------------------------------------------------------------
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    n = int(self.rfile.readline().split(b";")[0], 16)
                    if n == 0:
                        self.rfile.readline()
                        return bytes(out)
                    out += self.rfile.read(n)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
                  head: bool = False, length: int | None = None) -> None:
            try:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, str(v))
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                if not head:
                    self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _json(self, status: int, obj, headers: dict | None = None) -> None:
            self._send(status, json.dumps(obj).encode(),
                       {"Content-Type": "application/json", **(headers or {})})

        def _error(self, status: int, code: str, msg: str, extra: dict | None = None) -> None:
            self._json(status, {"error": msg}, {"X-Error-Code": code, "X-Error-Message": msg,
                                                **(extra or {})})

        def _authed(self) -> bool:
            return hub.token is None or self.headers.get("Authorization") == f"Bearer {hub.token}"

        def _repo(self, repo_id: str, write: bool = False) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or ((repo.private or write) and not self._authed()):
                self._error(401 if not self._authed() else 404, "RepoNotFound",
                            "Repository not found")
                return None
            return repo

        def _log(self, **kw) -> bool:
            return hub.event(method=self.command, path=urlsplit(self.path).path,
                             range=self.headers.get("Range"), **kw)

        # ---- verbs -------------------------------------------------------------------
        def _flaky(self, body: bool = False) -> bool:
            """Answer with an injected failure when one matches (the request body, if any,
            is read first so the connection stays usable)."""
            path = unquote(urlsplit(self.path).path)
            with hub._lock:
                hit = next((f for f in hub.flaky if f["times"] > 0 and f["method"] == self.command
                            and re.search(f["path"], path)), None)
                if hit is None:
                    return False
                hit["times"] -= 1
                hub.failed.append({"method": self.command, "path": path, "status": hit["status"]})
            if body:
                self._body()
            extra = {"Retry-After": hit["retry_after"]} if hit.get("retry_after") is not None else {}
            self._error(hit["status"], "Flaky", f"injected {hit['status']}", extra)
            return True

        def do_HEAD(self):
            if not self._flaky():
                self._get(head=True)

        def do_GET(self):
            if not self._flaky():
                self._get(head=False)

        def _get(self, head: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            if m := _API_INFO.match(path):
                self._log()
                return self._model_info(m[1], m[2] or "main", parse_qs(url.query))
            if m := _RESOLVE.match(path):
                return self._resolve(m[1], m[2], m[3], head)
            self._log()
            self._error(404, "NotFound", f"no route {path}")

        def _model_info(self, repo_id: str, rev: str, query: dict) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            sha = repo.resolve(rev)
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            blobs = query.get("blobs") == ["true"] or query.get("blobs") == ["True"]
            siblings = []
            for p, b in sorted(repo.commits[sha].items()):
                s = {"rfilename": p}
                if blobs:
                    s.update(size=b.size, blobId=b.oid)
                    if is_lfs(p, b.size):
                        s["lfs"] = {"size": b.size, "sha256": b.sha256, "pointerSize": 134}
                siblings.append(s)
            self._json(200, {"id": repo_id, "sha": sha, "private": repo.private,
                             "siblings": siblings, "cardData": repo.card_data, "tags": []})

        def _resolve(self, repo_id: str, rev: str, rel: str, head: bool) -> None:
            rng = self.headers.get("Range")
            repo = self._repo(repo_id)
            if repo is None:
                return self._log(status=401)
            sha = repo.resolve(rev)
            if sha is None:
                self._log(status=404)
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            blob = repo.commits[sha].get(rel)
            if blob is None:
                self._log(status=404)
                return self._error(404, "EntryNotFound", f"{rel} does not exist",
                                   {"X-Repo-Commit": sha})
            headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if is_lfs(rel, blob.size):
                headers.update({"ETag": f'"{blob.sha256}"', "X-Linked-Etag": f'"{blob.sha256}"',
                                "X-Linked-Size": blob.size})
            else:
                headers["ETag"] = f'"{blob.oid}"'
            start, end, status = 0, blob.size, 200
            if rng and (m := re.match(r"bytes=(\d+)-(\d*)$", rng)):
                start = int(m[1])
                end = min(blob.size, int(m[2]) + 1) if m[2] else blob.size
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{blob.size}"
            full = not head and status == 200
            if full and hub.watch is not None and is_lfs(rel, blob.size):
                hub.samples.append({"file": rel, "size": blob.size, "on_disk": hub.blob_bytes()})
            self._log(file=rel, full=full, head=head, bytes=0 if head else end - start)
            if head:
                return self._send(status, headers=headers, head=True, length=end - start)
            body = blob.read(start, end)
            bad = hub._take(rel, [c for c in hub.corrupt if start <= c["offset"] < end])
            if bad is not None:
                body = bytearray(body)
                body[bad["offset"] - start] ^= 0xFF
                body = bytes(body)
                self._log(file=rel, corrupted=bad["offset"])
            cut = hub._take(rel, [c for c in hub.drop if c["after"] < len(body)])
            try:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, str(v))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if cut is not None:
                    hub.send_throttled(self.wfile, body[:cut["after"]])
                    self.wfile.flush()
                    self.close_connection = True
                    self._log(file=rel, dropped=cut["after"])
                    return
                hub.send_throttled(self.wfile, body)
                self.wfile.flush()
                if full:
                    self._log(file=rel, sent=len(body))
            except (BrokenPipeError, ConnectionResetError):
                pass

        def do_POST(self):
            if self._flaky(body=True):
                return
            path = unquote(urlsplit(self.path).path)
            body = self._body()
            self._log(bytes_in=len(body))
            if path == "/api/validate-yaml":
                return self._validate_yaml(json.loads(body))
            if path == "/api/repos/create":
                return self._create_repo(json.loads(body))
            if m := _LFS_BATCH.match(path):
                return self._lfs_batch(m[1], json.loads(body))
            if m := _REPO_OP.match(path):
                repo = self._repo(m[1], write=True)
                if repo is None:
                    return
                op, rev = m[2], m[3]
                if op == "branch":
                    if rev in repo.branches:
                        return self._error(409, "Conflict", "Reference already exists")
                    repo.branches[rev] = repo.branches["main"]
                    return self._json(200, {})
                if repo.resolve(rev) is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                if op == "preupload":
                    return self._preupload(repo, rev, json.loads(body))
                return self._commit(repo, rev, body)
            self._error(404, "NotFound", f"no route {path}")

        def _validate_yaml(self, req: dict) -> None:
            errors = []
            text = req.get("content", "")
            m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
            try:
                meta = yaml.safe_load(m[1]) if m else {}
                if not isinstance(meta.get("model-index", []), list):
                    errors.append('"model-index" must be an array')
            except yaml.YAMLError as e:
                errors.append(f"YAML: {e}")
            if hub.reject_yaml:
                errors.append(hub.reject_yaml)
            if errors:
                return self._json(400, {"errors": [{"message": e} for e in errors], "warnings": []})
            self._json(200, {"errors": [], "warnings": []})

        def _create_repo(self, req: dict) -> None:
            if not self._authed():
                return self._error(401, "Unauthorized", "Invalid credentials")
            repo_id = f"{req['organization']}/{req['name']}"
            if repo_id in hub.repos:  # the Hub's 409 body carries the url too
                return self._json(409, {"error": "You already created this model repo",
                                        "url": f"{hub.url}/{repo_id}"})
            private = req.get("visibility") == "private" or bool(req.get("private"))
            hub.repos[repo_id] = FakeRepo(repo_id, private)
            self._json(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def _preupload(self, repo: FakeRepo, rev: str, req: dict) -> None:
            tree = repo.commits[repo.resolve(rev)]
            out = []
            for f in req["files"]:
                lfs = is_lfs(f["path"], f["size"])
                old = tree.get(f["path"])
                oid = (old.sha256 if lfs else old.oid) if old is not None else None
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                            "shouldIgnore": False, "oid": oid})
            self._json(200, {"files": out, "commitOid": repo.resolve(rev)})

        def _lfs_batch(self, repo_id: str, req: dict) -> None:
            if self._repo(repo_id, write=True) is None:
                return
            objects = []
            for o in req["objects"]:
                entry = {"oid": o["oid"], "size": o["size"]}
                if o["oid"] not in hub.lfs:
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}
                objects.append(entry)
            self._json(200, {"transfer": "basic", "objects": objects})

        def do_PUT(self):
            if self._flaky(body=True):
                return
            path = urlsplit(self.path).path
            m = _LFS_PUT.match(path)
            if not m:
                self._log()
                return self._error(404, "NotFound", f"no route {path}")
            if self._log(arrived=m[1]):  # the client was killed: this object never arrives
                self.close_connection = True
                return
            body = self._body()
            if hashlib.sha256(body).hexdigest() != m[1]:
                self._log(bytes_in=len(body), stored=False)
                return self._error(400, "BadRequest", "sha256 mismatch")
            hub.lfs[m[1]] = body
            self._send(200)
            self._log(bytes_in=len(body), stored=m[1])

        def _commit(self, repo: FakeRepo, rev: str, body: bytes) -> None:
            lines = [json.loads(x) for x in body.splitlines() if x.strip()]
            header = next(x["value"] for x in lines if x["key"] == "header")
            files = {}
            for x in lines:
                v = x["value"]
                if x["key"] == "file":
                    files[v["path"]] = Blob(data=base64.b64decode(v["content"]))
                elif x["key"] == "lfsFile":
                    if v["oid"] not in hub.lfs:
                        return self._error(422, "BadRequest", f"LFS object {v['oid']} missing")
                    files[v["path"]] = Blob(data=hub.lfs[v["oid"]])
            sha = repo.commit(files, unquote(rev), header["summary"])
            self._json(200, {"commitUrl": f"{hub.url}/{repo.repo_id}/commit/{sha}",
                             "commitOid": sha, "pullRequestUrl": None, "success": True})

    return Handler


def client_env(hub: FakeHub, hf_home: Path, **extra: str) -> dict:
    """The environment of a user pointed at ``hub``: no HF_* from this machine, HF_ENDPOINT at
    the local endpoint, HF_HOME a test folder, plus ``extra`` (HF_TOKEN, HF_HUB_OFFLINE, ...)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **extra)
    return env


def run_quantize(args: list[str], env: dict, hub: FakeHub, kill_on=None,
                 timeout: int = 240) -> tuple[int, str, str]:
    """Run ``quantize ARGS`` in a child process; returns (exit code, stdout, stderr).

    ``kill_on(event)`` true -> the server SIGKILLs the child at that request (and drops the
    request), which is how tests interrupt a download or an upload.
    """
    proc = subprocess.Popen([sys.executable, "-m", "quantize.cli", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def hook(ev):
        if kill_on is not None and kill_on(ev):
            os.kill(proc.pid, signal.SIGKILL)
            return True
        return False

    hub.hooks.append(hook)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        hub.hooks.remove(hook)
    return proc.returncode, out, err
