"""Fault soak (issue 17, kind 6): kill -9, a full disk and a changed source shard at seeded
random points of every stage of a many-shard conversion, then ``--resume``, and every file's
sha256 compared with an uninterrupted build.

    PYTHONPATH=. python scripts/fault_soak.py --shards 64 --points 3 --workers 2

Stages and where a fault strikes (each point is the k-th such event of the whole run, every
process counted together, k drawn with ``--seed`` from the count an uninterrupted run has):

- read      a source shard opened (pre-flight's header reads and the reader's)
- quantize  an NVFP4 kernel call (``Prepared.quantize`` of any kernel)
- write     an output shard's temp file fully written, not yet fsynced or renamed; before the
            resume the temp file is cut to half and a ``.tmpXXXXXX`` left as safetensors'
            ``save_file`` leaves one (a kill in the middle of the write)
- rename    any ``os.replace`` into the output folder (shard, ledger, index, config, manifest)
- manifest  the finish: index, carried files, config, manifest renames and the ledgers' removal
- download  (Hub source, tests/hub_server.py) the k-th shard request; also a partial and a
            corrupt partial ``.incomplete`` left in the cache
- upload    the k-th LFS object PUT, the preupload call, the commit call

The faults are observed from outside the product: Python audit events (``open``,
``os.chmod``, ``os.rename``, ``os.remove``) and a wrapper around the kernels' ``quantize``,
installed by a ``sitecustomize`` this script writes and puts first on ``PYTHONPATH`` for the
child (and so for ``--workers`` processes, which are spawned). The fault is acted on in the
child at that exact point: SIGKILL to the whole process group (``kill -9`` of quantize and its
workers at once), the output file system filled, or a source shard changed. No sleeps: a point
is defined by what the run does, not by time.

Prints a table stage x fault -> outcome (exit code, first error line, sha256 equal after
resume) and exits 1 if any resumed build differs from the uninterrupted one, any fault ended
without a clear error, or a Hub repo showed weights without their card.
"""

import argparse
import hashlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("read", "quantize", "write", "rename", "manifest")

HOOK = r'''
import json, os, sys, threading
_SPEC = os.environ.get("SOAK_FAULT")
if _SPEC:
    import fcntl, signal
    _SPEC = json.loads(_SPEC)
    _TLS = threading.local()
    _OUT, _SRC = _SPEC["out"] + os.sep, _SPEC["src"] + os.sep
    _LEDGER = ".spark-quant-progress"

    def _path(p):
        if isinstance(p, int):
            return None
        try:
            return os.path.abspath(os.fsdecode(p))
        except TypeError:
            return None

    def _stages(event, args):
        """[(stage, what)] this event belongs to."""
        if event == "open":
            p = _path(args[0])
            if p and p.startswith(_SRC) and p.endswith(".safetensors"):
                return [("read", os.path.basename(p))]
        elif event == "os.chmod":
            p = _path(args[0])
            if p and p.startswith(_OUT) and p.endswith(".safetensors.tmp"):
                return [("write", os.path.basename(p)[:-4])]
        elif event == "os.rename":
            p = _path(args[1])
            if p and p.startswith(_OUT):
                name = os.path.basename(p)
                got = [("rename", name)]
                if not name.endswith(".safetensors") and not name.startswith(_LEDGER) \
                        and not name.startswith(".spark-quant-hub"):
                    got.append(("manifest", "rename " + name))
                return got
        elif event == "os.remove":
            p = _path(args[0])
            if p and p.startswith(_OUT) and os.path.basename(p).startswith(_LEDGER):
                return [("manifest", "remove " + os.path.basename(p))]
        return []

    def _bump(stage):
        fd = os.open(_SPEC["counter"], os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 1 << 16, 0)
            counts = json.loads(raw) if raw else {}
            counts[stage] = counts.get(stage, 0) + 1
            data = json.dumps(counts).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            return counts[stage]
        finally:
            os.close(fd)

    def _once(name):
        try:
            os.close(os.open(_SPEC["counter"] + "." + name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def _fill(folder):
        with open(os.path.join(folder, "ballast"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
            try:
                while True:
                    f.write(b"\0" * 512)
            except OSError:
                pass

    def _change(mode, shard):
        p = os.path.join(_SPEC["src"], shard)
        size = os.path.getsize(p)
        if mode == "truncate":
            os.truncate(p, size // 2)
            return
        data = bytearray(open(p, "rb").read())
        data[-1] ^= 0x01  # the last data byte: valid bytes, other values
        if mode == "rewrite":  # in place: same file, same size, new mtime
            fd = os.open(p, os.O_WRONLY)
            os.pwrite(fd, bytes(data[-1:]), size - 1)
            os.close(fd)
        else:  # replace: a new file renamed over it (a re-download)
            with open(p + ".new", "wb") as f:
                f.write(data)
            os.replace(p + ".new", p)

    def _act(stage, what):
        n = _bump(stage) if _SPEC["stage"] in (stage, "census") else 0
        if _SPEC["stage"] == "census":
            with open(_SPEC["counter"] + ".log", "a") as f:
                f.write(f"{stage}\t{what}\n")
            return
        if stage != _SPEC["stage"] or n != _SPEC["n"] or not _once("hit"):
            return
        with open(_SPEC["counter"] + ".hit", "w") as f:
            f.write(f"{stage} #{n} ({what})")
        action = _SPEC["action"]
        if action == "kill":
            os.killpg(0, signal.SIGKILL)
        elif action == "fill":
            _fill(_SPEC["fill"])
        elif action.startswith("change-"):
            _change(action[len("change-"):], what)

    def _audit(event, args):
        if getattr(_TLS, "busy", False) or event not in ("open", "os.chmod", "os.rename", "os.remove"):
            return
        _TLS.busy = True
        try:
            for stage, what in _stages(event, args):
                _act(stage, what)
        finally:
            _TLS.busy = False

    sys.addaudithook(_audit)

    if _SPEC["stage"] in ("quantize", "census"):
        import quantize.convert.pipeline  # noqa: F401  (every kernel class defined)
        from quantize.kernels.prepared import Prepared

        def _wrap(cls):
            real = cls.__dict__["quantize"]

            def quantize(self, scalar):
                if getattr(_TLS, "in_q", False):
                    return real(self, scalar)
                _TLS.in_q = True
                try:
                    _TLS.busy = True
                    try:
                        _act("quantize", type(self).__name__)
                    finally:
                        _TLS.busy = False
                    return real(self, scalar)
                finally:
                    _TLS.in_q = False
            cls.quantize = quantize

        todo = [Prepared]
        while todo:
            c = todo.pop()
            todo += c.__subclasses__()
            if "quantize" in c.__dict__:
                _wrap(c)
'''


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tree_digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder``, but the local check statistics
    (formats.manifest CHECK_STATS_NAME: identities of this folder's files, never equal between
    two builds)."""
    from formats.manifest import CHECK_STATS_NAME

    return {p.relative_to(folder).as_posix(): sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != CHECK_STATS_NAME}


def compare(a: Path, b: Path) -> str:
    """'yes' when every file is byte-identical, else what differs."""
    x, y = tree_digest(a), tree_digest(b)
    if x == y:
        return "yes"
    only = sorted(set(x) ^ set(y))
    diff = sorted(k for k in set(x) & set(y) if x[k] != y[k])
    return "NO (" + ", ".join([*(f"only in one: {k}" for k in only[:3]), *diff[:3]]) + ")"


@dataclass
class Row:
    stage: str
    fault: str
    point: str
    rc: str
    message: str
    resume_rc: str
    equal: str
    ok: bool
    notes: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, work: Path, shards: int, workers: int, seed: int, points: int):
        self.work, self.shards, self.workers = work, shards, workers
        self.rng, self.points = random.Random(seed), points
        self.hook = work / "hook"
        self.hook.mkdir(parents=True, exist_ok=True)
        (self.hook / "sitecustomize.py").write_text(HOOK)
        self.src = work / "src"
        self.rows: list[Row] = []
        self.ids = itertools.count(1)

    # ---- running quantize ----------------------------------------------------------------
    def env(self, fault: dict | None = None, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "SOAK_FAULT"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.hook), str(REPO),
                                                          os.environ.get("PYTHONPATH")]))
        if fault is not None:
            env["SOAK_FAULT"] = json.dumps(fault)
        env.update(extra or {})
        return env

    def quantize(self, args: list[str], fault: dict | None = None) -> tuple[int, str]:
        p = subprocess.run([sys.executable, "-m", "quantize.cli", *map(str, args)], cwd=REPO,
                           env=self.env(fault), capture_output=True, text=True,
                           start_new_session=True, timeout=900)
        return p.returncode, p.stderr

    def nvfp4(self, out: Path, workers: int, resume: bool = False, fault: dict | None = None,
              src: Path | None = None):
        args = ["nvfp4", "--src", src or self.src, "--out", out, "--quiet", "--device", "cpu"]
        if workers > 1:
            args += ["--workers", workers]
        if resume:
            args.append("--resume")
        return self.quantize(args, fault)

    def fault(self, out: Path, stage: str, n: int, action: str, **kw) -> dict:
        counter = self.work / "counters" / f"c{next(self.ids)}"  # next(): safe across threads
        counter.parent.mkdir(exist_ok=True)
        return {"out": str(out), "src": str(kw.pop("src", self.src)), "stage": stage, "n": n,
                "action": action, "counter": str(counter), **kw}

    @staticmethod
    def hit(fault: dict) -> str:
        p = Path(fault["counter"] + ".hit")
        return p.read_text() if p.exists() else "not reached"

    # ---- set-up ---------------------------------------------------------------------------
    def build_source(self) -> None:
        from quantize.data.fixtures import write_synthetic_fp8

        write_synthetic_fp8(self.src, self.shards, 1, hidden=128, inter=64)
        (self.src / "tokenizer_config.json").write_text("{}")
        (self.src / "README.md").write_text("---\nlicense: mit\n---\n# soak source\n")

    def references(self) -> dict[str, int]:
        """Uninterrupted builds, one process and ``workers``; returns the census (events of
        each stage in the ``workers`` run)."""
        self.ref = self.work / "ref1"
        rc, err = self.nvfp4(self.ref, 1)
        assert rc == 0, err
        census = self.fault(self.work / "ref", "census", 0, "none")
        rc, err = self.nvfp4(self.work / "ref", self.workers, fault=census)
        assert rc == 0, err
        eq = compare(self.ref, self.work / "ref")
        self.rows.append(Row("reference", f"--workers {self.workers} vs 1 process", "-", "0",
                             "-", "-", eq, eq == "yes"))
        counts: dict[str, int] = {}
        for line in Path(census["counter"] + ".log").read_text().splitlines():
            stage = line.split("\t")[0]
            counts[stage] = counts.get(stage, 0) + 1
        self.census = counts
        return counts

    # ---- local faults ---------------------------------------------------------------------
    def _resume_and_compare(self, row: Row, out: Path, workers: int, expect_rc: set[int],
                            first: str | None) -> None:
        rc2, err2 = self.nvfp4(out, workers, resume=True)
        row.resume_rc = str(rc2)
        row.equal = compare(self.ref, out) if rc2 == 0 else f"NO (resume failed: {first_line(err2)})"
        row.ok = row.ok and rc2 == 0 and row.equal == "yes" and int(row.rc) in expect_rc
        if first is not None and not row.message.startswith(first):
            row.ok = False
            row.notes.append(f"expected a first line starting {first!r}")

    def kill(self, stage: str, n: int, workers: int) -> Row:
        out = self.work / f"kill-{stage}-{n}-w{workers}"
        f = self.fault(out, stage, n, "kill")
        rc, err = self.nvfp4(out, workers, fault=f)
        row = Row(stage, f"kill -9 (w{workers})", self.hit(f), str(rc), first_line(err) or "-",
                  "", "", rc == -signal.SIGKILL)
        if out.exists():
            for p in list(out.iterdir()):  # what a kill in the middle of a write leaves
                if p.name.endswith(".tmp"):
                    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
            (out / ".tmpK9x2Qa").write_bytes(b"\0" * 999)
            row.notes.append(f"{sum(1 for p in out.glob('*.safetensors'))} shards on disk")
        self._resume_and_compare(row, out, workers, {-signal.SIGKILL}, None)
        return row

    def disk_full(self, stage: str, n: int, workers: int, mount) -> Row | None:
        fs = mount(f"full-{stage}-{n}", 64 << 20)
        if fs is None:
            return None
        out = fs / "out"
        f = self.fault(out, stage, n, "fill", fill=str(fs))
        rc, err = self.nvfp4(out, workers, fault=f)
        row = Row(stage, f"disk full (w{workers})", self.hit(f), str(rc), first_line(err) or "-",
                  "", "", rc == 1)
        lines = err.strip().splitlines()
        preflight = "not enough free disk" in err  # filled while a rank was in pre-flight
        if rc == 0:  # filled after the last write (e.g. before the manifest's rename)
            row.ok = True
            row.notes.append("nothing left to write after the fill: finished")
        elif preflight:
            row.notes.append("refused by pre-flight's free-disk check")
        elif not (rc == 1 and lines and lines[-1].endswith("rerun the same command with "
                                                            "--resume to continue")
                  and "No space left on device" in err):
            row.ok = False
            row.notes.append("expected ENOSPC named and the resume hint as last line")
        (fs / "ballast").unlink(missing_ok=True)
        self._resume_and_compare(row, out, workers, {0, 1}, "error: " if rc else "")
        return row

    def source_change(self, mode: str, n: int, workers: int) -> Row:
        """Change the shard opened at the k-th read event of the run (just before that open),
        restore it, resume."""
        src = self.work / f"src-{mode}-{n}"
        shutil.copytree(self.src, src)
        out = self.work / f"change-{mode}-{n}-w{workers}"
        f = self.fault(out, "read", n, f"change-{mode}", src=str(src))
        rc, err = self.nvfp4(out, workers, fault=f, src=src)
        hit = self.hit(f)
        shard = hit.split("(")[-1].rstrip(")")
        msg = first_line(err) or "-"
        row = Row("read", f"source shard {mode} (w{workers})", hit, str(rc), msg, "", "",
                  rc == 1 and shard in msg)
        if not row.ok:
            row.notes.append(f"expected exit 1 and an error naming {shard}")
        shutil.copy2(self.src / shard, src / shard)
        rc2, err2 = self.nvfp4(out, workers, resume=True, src=src)
        row.resume_rc = str(rc2)
        eq = compare_build(self.ref, out) if rc2 == 0 else f"NO (resume failed: {first_line(err2)})"
        row.equal = eq
        row.ok = row.ok and rc2 == 0 and eq == "yes"
        return row

    def pick(self, stage: str, k: int | None = None) -> list[int]:
        total = self.census.get(stage, 0)
        k = self.points if k is None else k
        return sorted(self.rng.sample(range(1, total + 1), min(k, total)))


def compare_build(ref: Path, out: Path) -> str:
    """As :func:`compare`, the manifest's source path left out (a copy of the source)."""
    from formats.manifest import MANIFEST_NAME

    x, y = tree_digest(ref), tree_digest(out)
    x.pop(MANIFEST_NAME, None), y.pop(MANIFEST_NAME, None)
    if x != y:
        diff = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        return "NO (" + ", ".join(diff[:4]) + ")"
    a, b = (json.loads((p / MANIFEST_NAME).read_text()) for p in (ref, out))
    a["source"].pop("path"), b["source"].pop("path")
    return "yes" if a == b else "NO (manifest)"


def first_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    return lines[0] if lines else ""


class Mounts:
    """tmpfs file systems of a given size (root only), unmounted at the end."""

    def __init__(self, base: Path):
        self.base, self.points, self.reason = base, [], None

    def __call__(self, name: str, size: int) -> Path | None:
        if self.reason:
            return None
        point = self.base / name
        point.mkdir(parents=True)
        if shutil.which("mount") is None:
            self.reason = "no mount command"
            return None
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                             capture_output=True, text=True)
        if res.returncode:
            self.reason = f"cannot mount a tmpfs ({res.stderr.strip() or res.returncode}); needs root"
            return None
        self.points.append(point)
        return point

    def close(self) -> None:
        for p in reversed(self.points):
            subprocess.run(["umount", "-l", str(p)], capture_output=True)


# ---- Hub: download and upload ---------------------------------------------------------------

HUB_REPO, TOKEN = "org/soak-fp8", "hf_soak_token"


def hub_download(soak: Soak, points: int, mount) -> Path:
    """Convert from the local Hub endpoint: an uninterrupted reference, then a kill at the
    k-th shard request (plus a partial and a corrupt partial download left in the cache),
    each resumed; and a full HF_HOME disk at the k-th shard request. Returns the reference
    build (its manifest names the Hub repo)."""
    from tests.hub_server import FakeHub, client_env, run_quantize

    work = soak.work / "hub"
    with FakeHub(token=TOKEN, lifetime=3600) as hub:
        hub.serve_folder(HUB_REPO, soak.src, card_data={"license": "mit"})

        def run(out, hf_home, kill_on=None, resume=False):
            args = ["nvfp4", "--src", HUB_REPO, "--out", str(out), "--quiet", "--device", "cpu"]
            env = client_env(hub, hf_home, HF_TOKEN=TOKEN)
            return run_quantize(args + (["--resume"] if resume else []), env, hub,
                                kill_on=kill_on, timeout=900)

        ref = work / "ref"
        rc, _, err = run(ref, work / "hf-ref")
        assert rc == 0, err
        from formats.manifest import MANIFEST_NAME

        x, y = tree_digest(soak.ref), tree_digest(ref)  # the weights equal a local-folder build's
        eq = "yes" if set(x) == set(y) and all(x[k] == y[k] for k in x if k != MANIFEST_NAME) else "NO"
        soak.rows.append(Row("download", "none (Hub source vs local folder)", "-", "0", "-", "-",
                             eq + " (manifest names the repo)", eq == "yes"))
        shards = sorted(p.name for p in soak.src.glob("*.safetensors"))
        picks = sorted(random.Random(soak.rng.random()).sample(range(1, len(shards) + 1),
                                                               min(points, len(shards))))
        for partial in ("none", "half", "corrupt"):
            for k in picks:
                out, hf_home = work / f"kill-{partial}-{k}", work / f"hf-{partial}-{k}"
                seen = {"n": 0}

                def kill_on(ev, k=k, seen=seen):
                    if ev.get("full") and ev["file"].endswith(".safetensors"):
                        seen["n"] += 1
                        return seen["n"] == k
                    return False

                rc, _, err = run(out, hf_home, kill_on)
                point = f"shard request #{k} ({shards[k - 1]})"
                note = []
                if partial != "none":  # as if killed with part of the shard received
                    data = (soak.src / shards[k - 1]).read_bytes()
                    blobs = next(hf_home.glob("hub/models--*/blobs"), None)
                    if blobs is not None:
                        part = bytearray(data[: len(data) // 2])
                        if partial == "corrupt":
                            part[len(part) // 2] ^= 0xFF
                        (blobs / f"{hashlib.sha256(data).hexdigest()}.incomplete").write_bytes(part)
                        note.append(f"{partial} .incomplete left in the cache")
                row = Row("download", f"kill -9, {partial} partial", point, str(rc),
                          first_line(err) or "-", "", "", rc == -signal.SIGKILL, note)
                rc2, _, err2 = run(out, hf_home, resume=True)
                row.resume_rc = str(rc2)
                row.equal = compare_build(ref, out) if rc2 == 0 else f"NO ({first_line(err2)})"
                row.ok = row.ok and rc2 == 0 and row.equal == "yes"
                soak.rows.append(row)
        # a full disk under HF_HOME (the download cache) at the k-th shard request
        for k in picks[:1]:
            fs = mount(f"hf-full-{k}", 16 << 20)
            if fs is None:
                break
            out, hf_home = work / f"full-{k}", fs / "hf"
            seen = {"n": 0}

            def fill_on(ev, k=k, seen=seen, fs=fs):
                if ev.get("full") and ev["file"].endswith(".safetensors"):
                    seen["n"] += 1
                    if seen["n"] == k:
                        with open(fs / "ballast", "wb", buffering=0) as f:
                            try:
                                while True:
                                    f.write(b"\0" * 4096)
                            except OSError:
                                pass
                return False

            hub.hooks.append(fill_on)
            try:
                rc, _, err = run(out, hf_home)
            finally:
                hub.hooks.remove(fill_on)
            msg = first_line(err) or "-"
            row = Row("download", "disk full (HF_HOME)", f"shard request #{k} ({shards[k - 1]})",
                      str(rc), msg, "", "", rc == 1 and shards[k - 1] in msg)
            if not row.ok:
                row.notes.append(f"expected exit 1 and an error naming {shards[k - 1]}")
            (fs / "ballast").unlink()
            rc2, _, err2 = run(out, hf_home, resume=True)
            row.resume_rc = str(rc2)
            row.equal = compare_build(ref, out) if rc2 == 0 else f"NO ({first_line(err2)})"
            row.ok = row.ok and rc2 == 0 and row.equal == "yes"
            soak.rows.append(row)
    return ref


def hub_upload(soak: Soak, build: Path, points: int) -> None:
    """Upload ``build`` (with a passed eval gate) to the local Hub endpoint, killed at the k-th
    LFS PUT, at the preupload call and at the commit call; rerun. Every commit of the repo
    must hold the whole build and its card (never weights without the card)."""
    from tests.hub_server import FakeHub, client_env, run_quantize
    from tests.quantize.test_upload import PLAN, REPORT

    up = soak.work / "hub" / "upload-build"
    shutil.copytree(build, up)
    (up / "eval").mkdir()
    (up / "eval" / "report.json").write_text(json.dumps(REPORT))
    (up / "plan.json").write_text(json.dumps(PLAN))
    local = {k: v for k, v in tree_digest(up).items() if k != "README.md"}
    n_lfs = sum(1 for k in local if k.endswith(".safetensors"))
    picks = sorted(random.Random(soak.rng.random()).sample(range(1, n_lfs + 1), min(points, n_lfs)))
    cases = [(f"LFS PUT #{k}", "PUT", k) for k in picks] + [("preupload call", "preupload", 1),
                                                            ("commit call", "commit", 1)]
    for i, (point, what, k) in enumerate(cases):
        with FakeHub(token=TOKEN, lifetime=3600) as hub:
            seen = {"n": 0}

            def kill_on(ev, what=what, k=k, seen=seen):
                hitp = (ev.get("arrived") if what == "PUT" else
                        ev["method"] == "POST" and f"/{what}/" in ev["path"])
                if hitp:
                    seen["n"] += 1
                    return seen["n"] == k
                return False

            env = client_env(hub, soak.work / "hub" / f"hf-up-{i}", HF_TOKEN=TOKEN,
                             HF_HUB_DISABLE_XET="1")
            args = ["upload", str(up), "--repo", "me/soak-nvfp4"]
            rc, _, err = run_quantize(args, env, hub, kill_on=kill_on, timeout=900)
            row = Row("upload", "kill -9", point, str(rc), first_line(err) or "-", "", "",
                      rc == -signal.SIGKILL)
            repo = hub.repos.get("me/soak-nvfp4")
            before = len(repo.commits) - 1 if repo else 0
            rc2, _, err2 = run_quantize(args, env, hub, timeout=900)
            row.resume_rc = str(rc2)
            repo = hub.repos["me/soak-nvfp4"]
            trees = [t for t in repo.commits.values() if t]  # every commit but the empty first
            whole = all(set(t) == set(local) | {"README.md"} for t in trees)
            files = repo.files()
            same = rc2 == 0 and all(hashlib.sha256(files[k].read()).hexdigest() == v
                                    for k, v in local.items()) and set(files) == set(local) | {"README.md"}
            row.equal = ("yes" if same else "NO") + f"; {len(trees)} commit(s), each weights + card: " \
                + ("yes" if whole else "NO")
            row.notes.append(f"{before} commit(s) after the kill")
            row.ok = row.ok and same and whole
            soak.rows.append(row)


# ---- report ---------------------------------------------------------------------------------

def render(rows: list[Row]) -> str:
    head = ("stage", "fault", "point", "exit", "first line of stderr", "resume exit",
            "sha256 equal", "ok")
    body = [(r.stage, r.fault, r.point, r.rc, r.message[:110] + ("..." if len(r.message) > 110 else ""),
             r.resume_rc, r.equal + ("" if not r.notes else " [" + "; ".join(r.notes) + "]"),
             "ok" if r.ok else "FAIL") for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=64, help="source shards (default 64)")
    ap.add_argument("--points", type=int, default=3, help="random kill points per stage")
    ap.add_argument("--workers", type=int, default=2, help="--workers of the faulted runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--faults", default="kill,disk,source,download,upload",
                    help="comma list of kill, disk, source, download, upload")
    ap.add_argument("--single", type=int, default=1,
                    help="kill points per stage also run with one process (default 1)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="local faults (kill, source change) run this many at a time (default 1)")
    ap.add_argument("--work", type=Path, help="work folder (default: a temp folder, removed)")
    return ap.parse_args(argv)


def soak_rows(a: argparse.Namespace, work: Path) -> list[Row]:
    """Run the soak ``a`` describes in ``work``; the table's rows, in the same order whatever
    ``a.jobs``. With ``--jobs J`` the local faults (kill, source change) run J at a time: each
    has its own output folder, counter and process group, and its point is an event of its own
    run, so running beside another changes no point and no outcome (only the wall time: each
    faulted run spends most of its time importing torch in the parent and in each worker,
    leaving a core idle). Disk-full faults (shared tmpfs mounts) and the Hub faults run alone."""
    faults, stages = set(a.faults.split(",")), [s for s in a.stages.split(",") if s]
    mounts = Mounts(work / "mnt")
    printing = threading.Lock()
    try:
        soak = Soak(work, a.shards, a.workers, a.seed, a.points)
        soak.build_source()
        census = soak.references()
        print(f"source: {a.shards} shards; events of an uninterrupted --workers {a.workers} run: "
              + ", ".join(f"{s} {census.get(s, 0)}" for s in STAGES), flush=True)

        def guarded(what, fn, *args) -> list[Row]:
            try:
                got = fn(*args)
                rows = [] if got is None else [got]
            except Exception as e:  # a broken case is a failed row, the soak goes on
                rows = [Row(what, "soak error", "-", "-", f"{type(e).__name__}: {e}", "-", "-",
                            False)]
            with printing:
                for r in rows:
                    print(render([r]).splitlines()[-1], flush=True)
            return rows

        # every point is drawn here, in one order, before anything runs: the seed alone sets them
        early, late = [], []  # [(may run beside others, () -> rows)], before / after the Hub
        if "source" in faults:
            reads = soak.census.get("read", 0)
            for mode in ("truncate", "rewrite", "replace"):
                # a read event past pre-flight's header reads: the converter's own reading
                for n in sorted(soak.rng.sample(range(reads // 2 + 1, reads + 1), 1)):
                    early.append((True, lambda mode=mode, n=n: guarded(
                        "read", soak.source_change, mode, n, a.workers)))
        if "download" in faults or "upload" in faults:
            box = {}

            def hub() -> list[Row]:  # its functions add their rows to soak.rows
                n = len(soak.rows)
                errors = guarded("download", lambda: box.update(ref=hub_download(
                    soak, a.points if "download" in faults else 0, mounts)))
                if "upload" in faults and "ref" in box:
                    errors += guarded("upload", hub_upload, soak, box["ref"], a.points)
                got = soak.rows[n:]
                del soak.rows[n:]
                with printing:
                    for r in got:
                        print(render([r]).splitlines()[-1], flush=True)
                return got + errors

            # the Hub draws its points from the seed as it runs: it runs before later draws
            soak.rows += run_tasks(early, a.jobs) + hub()
            early = []
        for stage in stages:
            if "kill" in faults:
                for n in soak.pick(stage):
                    late.append((True, lambda stage=stage, n=n: guarded(
                        stage, soak.kill, stage, n, a.workers)))
                for n in soak.pick(stage, a.single) if a.workers > 1 else []:
                    late.append((True, lambda stage=stage, n=n: guarded(
                        stage, soak.kill, stage, n, 1)))
            if "disk" in faults:
                picks = soak.pick(stage, 1)

                def disk(stage=stage, picks=picks) -> list[Row]:
                    rows = [r for n in picks
                            for r in guarded(stage, soak.disk_full, stage, n, a.workers, mounts)]
                    if mounts.reason:
                        rows.append(Row(stage, "disk full", "-", "-", f"skipped: {mounts.reason}",
                                        "-", "-", True))
                    return rows
                late.append((False, disk))
        soak.rows += run_tasks(early + late, a.jobs)
        return soak.rows
    finally:
        mounts.close()


def run_tasks(tasks: list, jobs: int) -> list[Row]:
    """Run ``tasks`` [(may run beside others, () -> rows)]: those that may, ``jobs`` at a
    time, the others alone after them; the rows in the tasks' order."""
    out: list[list[Row] | None] = [None] * len(tasks)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {i: pool.submit(fn) for i, (shared, fn) in enumerate(tasks) if shared}
        for i, f in futures.items():
            out[i] = f.result()
    for i, (shared, fn) in enumerate(tasks):
        if not shared:
            out[i] = fn()
    return [r for rows in out for r in rows]


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="fault-soak-"))
    try:
        rows = soak_rows(a, work)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(render(rows))
    bad = [r for r in rows if not r.ok]
    print(f"{len(rows)} faults tried, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
