"""Build manifest and the resume ledger.

- ``spark_quant_manifest.json`` is written last: its presence marks a complete build. It
  holds per-file sha256 and size, the source (path or repo@revision, layout, shard header
  digests), the tool version, the recipe and its hash, and the conversion summary. It holds
  no timestamps, so an interrupted-then-resumed build is byte-identical to a clean one.
- ``.spark-quant-progress.json`` is the ledger of finished output shards while a build runs:
  the job fingerprint (options + source headers + decisions) and each shard's sha256, plus the
  amax of every tensor read so far (float32 as ``float.hex``, exact), so a resumed run gets a
  fused group's shared global scale without re-reading (or re-downloading) finished shards,
  and each finished shard's data findings (all-zero weights, block scales at the e4m3 floor)
  so a resumed build reports the same notes as an uninterrupted one. It is removed when the
  build completes. When several ranks convert (quantize/convert/parallel.py), each keeps
  ``.spark-quant-progress.rank<r>.json``; a resume reads them all, whatever the number of
  ranks then.
- ``.spark-quant-stats.json`` (:data:`CHECK_STATS_NAME`) holds what ``quantize check``'s scale
  rule would find in each output shard, counted by the converter from the tensors it wrote,
  so ``quantize check`` on a fresh build reads headers and a few scalars instead of every
  block scale (``quantize.inspect.check``). Layout (:func:`write_check_stats`)::

      {"version": 1,
       "shards": {"model-00001-of-00003.safetensors": {
           "file": [size, mtime_ns, ctime_ns, inode],  # os.stat right after the shard's rename
           "sha256": "<hex>",                          # of the shard as written
           "scales": 42,                               # scale tensors counted (all of the shard's)
           "faults": {"<tensor>": 3}}}}                # only tensors with values the rule flags

  It describes the files of this folder as they were written, not the build's content, so it
  is local: not listed in the manifest, not uploaded (a dot file), never compared between
  builds. A shard whose size, mtime, ctime or inode differs from ``file`` changed after the
  build, and ``quantize check`` reads its scales again. The file's own mtime is later than
  every recorded ctime (:func:`write_check_stats` waits for the file-system clock to tick
  when they fall in one tick), so any later write to a shard gives it a new ctime, however
  coarse the clock (git's "racily clean" index entries are the same problem).

Every string in the manifest passes through ``quantize.base.redact`` (no tokens in manifests,
and no absolute local paths: ``unlocal``, since the manifest is published with the build). The
source is named by its Hub repo id and commit (when it came from the Hub) and by
``source.path``, the source folder's name (``source_path``); :func:`recorded_source` finds it
again next to the build, in the working directory or in the Hugging Face cache.
"""

import hashlib
import json
import os
import time
from pathlib import Path

from formats.checkpoint import write_json_atomic
from formats.shards import is_temp_name, sha256_file
from quantize.base.errors import OutputError
from quantize.base.redact import redact_obj, unlocal_obj

__all__ = ["EVAL_FOLDER", "MANIFEST_NAME", "PROGRESS_NAME", "CHECK_STATS_NAME", "Ledger", "file_identity",
           "write_check_stats", "load_check_stats", "fingerprint", "has_ledger",
           "is_ledger_name", "remove_ledgers", "write_manifest", "resume_hint", "already_complete",
           "source_path", "recorded_source"]

MANIFEST_NAME = "spark_quant_manifest.json"
EVAL_FOLDER = "eval"
"""The folder ``quantize eval BUILD`` writes its report into by default (``BUILD/eval``): made
after the build, so not in its manifest; ``quantize verify`` reads past it and says so."""
PROGRESS_NAME = ".spark-quant-progress.json"
_PROGRESS_GLOB = ".spark-quant-progress*.json"
CHECK_STATS_NAME = ".spark-quant-stats.json"
_CHECK_STATS_VERSION = 1


def is_ledger_name(rel: str) -> bool:
    """True for the resume ledger of a single run or of one rank (a path relative to the
    build folder)."""
    return Path(rel).match(_PROGRESS_GLOB)


def fingerprint(obj) -> str:
    """sha256 of a JSON-serialisable description of the job (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


class Ledger:
    """Which output shards are finished, for ``--resume``.

    Each entry records the output shard's sha256 and the (size, mtime_ns) of every source
    shard it was computed from, so a re-downloaded or edited source shard is converted again.
    """

    def __init__(self, out: Path, job: str, resume: bool, rank: int | None = None):
        name = PROGRESS_NAME if rank is None else f".spark-quant-progress.rank{rank}.json"
        self.path = Path(out) / name
        self.out = Path(out)
        self.done: dict[str, dict] = {}
        self.amax: dict[str, dict] = {}  # source shard -> {"id": identity, "values": {name: hex}}
        if resume:
            for p in sorted(self.out.glob(_PROGRESS_GLOB)):
                try:
                    data = json.loads(p.read_text())
                    job_seen, done = data["job"], data["shards"]
                    if not isinstance(done, dict):
                        raise TypeError("shards is not an object")
                except (OSError, ValueError, KeyError, TypeError) as e:
                    raise OutputError(f"resume ledger {p} is corrupt ({e}); delete it to "
                                      "start this build over", key=p.name) from None
                if job_seen != job:
                    raise OutputError(
                        f"{out} holds a different build (options or source changed); use a new "
                        "--out or delete the folder", key=p.name)
                self.done.update(done)
                self.amax.update(data.get("amax") or {})
        self.job = job
        self._save()

    def is_done(self, shard: str, sources: dict[str, list[int]]) -> bool:
        """True when ``shard`` was finished by an earlier run from the same source files
        (size and mtime) and its bytes still match."""
        entry = self.done.get(shard)
        p = self.out / shard
        return (isinstance(entry, dict) and entry.get("sources") == sources and p.is_file()
                and sha256_file(p) == entry.get("sha256"))

    def known_amax(self, identity) -> dict[str, float]:
        """Recorded amax values (exact float32) of tensors whose source shard still has the
        identity it had when they were read (``identity(shard)``, e.g. ShardFiles.identity)."""
        out = {}
        for shard, entry in self.amax.items():
            try:
                same = entry.get("id") == identity(shard)
            except OSError:  # a local source shard that is gone: its values are not trusted
                same = False
            if same:
                out.update({n: float.fromhex(v) for n, v in entry.get("values", {}).items()})
        return out

    def mark(self, shard: str, sources: dict[str, list], amax: dict[str, dict] | None = None,
             stats: dict | None = None, digest: str | None = None) -> str:
        """Record ``shard`` finished (sha256, source identities, its data findings ``stats``)
        and the amaxes known so far (``{source shard: {"id": identity, "values": {tensor:
        float}}}``). ``digest``: the shard's sha256 when the writer already has it
        (``formats.shards.write_shard_atomic``), else the file is hashed."""
        digest = digest or sha256_file(self.out / shard)
        self.done[shard] = {"sha256": digest, "sources": sources, "stats": stats or {}}
        for src, entry in (amax or {}).items():
            self.amax[src] = {"id": entry["id"],
                              "values": {n: float(v).hex() for n, v in sorted(entry["values"].items())}}
        self._save()
        return digest

    def stats(self, shard: str) -> dict:
        """Data findings recorded for a finished ``shard`` (empty if none)."""
        entry = self.done.get(shard)
        return entry.get("stats", {}) if isinstance(entry, dict) else {}

    def _save(self) -> None:
        write_json_atomic({"job": self.job, "shards": self.done, "amax": self.amax}, self.path)


def has_ledger(out: Path) -> bool:
    """True when ``out`` holds the resume ledger of some rank."""
    return any(Path(out).glob(_PROGRESS_GLOB))


def remove_ledgers(out: Path) -> None:
    """Delete every rank's ledger (the build is complete)."""
    for p in Path(out).glob(_PROGRESS_GLOB):
        p.unlink(missing_ok=True)


def resume_hint(out: Path) -> str | None:
    """How far an interrupted build in ``out`` got (over every rank's ledger) and how to
    continue it, or None when ``out`` holds no progress ledger."""
    done, found = 0, False
    for p in Path(out).glob(_PROGRESS_GLOB):
        try:
            done += len(json.loads(p.read_text()).get("shards", {}))
            found = True
        except (OSError, ValueError, AttributeError):
            continue
    if not found:
        return None
    return (f"{done} output shard(s) are finished in {out}; fix the cause and rerun the same "
            "command with --resume to continue")


def already_complete(out: Path) -> str:
    """What is said of an ``out`` that holds a finished build (its :data:`MANIFEST_NAME`):
    there is nothing to resume, the build is kept, and a new build needs an empty folder
    (``quantize nvfp4 --resume`` and pre-flight of such an ``--out``)."""
    return (f"{out} is already complete (it has its {MANIFEST_NAME}): nothing to resume, the "
            f"build is kept as it is; `quantize verify {out}` checks it, and a new build needs an "
            "empty --out")


def write_manifest(out: Path, info: dict, digests: dict[str, str] | None = None) -> dict:
    """Hash every file in ``out`` (except the manifest, ledgers and the local check
    statistics) into ``info["files"]`` and
    write the manifest atomically. ``digests`` (file name -> sha256 the ledgers recorded when
    the shards were written or verified on resume) saves hashing those files again. Returns
    the manifest dict."""
    out = Path(out)
    digests = digests or {}
    files = {}
    for p in sorted(out.rglob("*")):
        rel = str(p.relative_to(out))
        if (p.is_file() and rel not in (MANIFEST_NAME, CHECK_STATS_NAME) and not is_ledger_name(rel)
                and not is_temp_name(p.name)):
            files[rel] = {"sha256": digests.get(rel) or sha256_file(p), "bytes": p.stat().st_size}
    manifest = unlocal_obj(redact_obj(dict(info, files=files)))
    write_json_atomic(manifest, out / MANIFEST_NAME)
    return manifest


def source_path(source: Path) -> str:
    """The manifest's ``source.path``: the source folder's name. Never an absolute path (the
    manifest is published; a Hub source is also named by ``repo`` and ``commit``), and never
    one that depends on where the build is written (builds stay byte-identical)."""
    return Path(source).resolve().name


def _hub_snapshot(repo: str, commit: str) -> Path:
    """Where huggingface_hub keeps a snapshot of model ``repo`` at ``commit``:
    ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``, then
    ``models--ORG--NAME/snapshots/COMMIT``."""
    hub = os.environ.get("HF_HUB_CACHE") or (
        Path(os.environ["HF_HOME"]) / "hub" if os.environ.get("HF_HOME")
        else Path.home() / ".cache" / "huggingface" / "hub")
    return Path(hub) / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


def recorded_source(build: Path, manifest: dict, roots: tuple[Path, ...] = ()) -> Path | None:
    """The source folder the manifest of ``build`` records, found on this machine: an absolute
    ``source.path`` (as older builds recorded it) as it is; else the folder of that name next to
    the build, in the working directory or under one of ``roots``; else, for a Hub source
    (``repo`` and ``commit``), its snapshot in the Hugging Face cache. A candidate counts when
    it holds ``config.json`` and every source shard the manifest lists. Returns the resolved
    folder, or None."""
    src = (manifest.get("source") or {}) if isinstance(manifest, dict) else {}
    path, shards = src.get("path"), src.get("shards") or {}
    candidates = []
    if isinstance(path, str) and path and path not in (".", ".."):
        if Path(path).is_absolute():
            candidates.append(Path(path))
        else:
            candidates += [Path(build).resolve().parent / path, Path.cwd() / path,
                           *(Path(r) / path for r in roots)]
    if isinstance(src.get("repo"), str) and isinstance(src.get("commit"), str):
        candidates.append(_hub_snapshot(src["repo"], src["commit"]))
    for c in candidates:
        if (c / "config.json").is_file() and all((c / s).is_file() for s in shards):
            return c.resolve()
    return None


def file_identity(path: Path) -> list[int]:
    """``[size, mtime_ns, ctime_ns, inode]`` of a file: what changes when its bytes do (a
    write in place sets mtime and ctime, a replacement gives a new inode, and ctime cannot be
    set back the way ``touch -d`` sets mtime back)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def write_check_stats(out: Path, shards: dict[str, dict], max_wait_s: float = 1.0) -> None:
    """Write :data:`CHECK_STATS_NAME` (layout in the module docstring) with ``shards``: shard
    file name -> ``{"file": file_identity, "sha256", "scales", "faults"}``.

    Then, while the file's mtime is not later than every recorded ctime (written in the
    same tick of a coarse file-system clock), its mtime is set to now again, for at most
    ``max_wait_s``; a shard still in that tick is then read by ``quantize check`` (see
    :func:`load_check_stats`).

    Raises:
        OutputError: the file cannot be written.
    """
    path = Path(out) / CHECK_STATS_NAME
    write_json_atomic({"version": _CHECK_STATS_VERSION, "shards": dict(sorted(shards.items()))}, path)
    newest = max((r["file"][2] for r in shards.values()), default=0)
    deadline = time.monotonic() + max_wait_s
    while os.stat(path).st_mtime_ns <= newest and time.monotonic() < deadline:
        time.sleep(0.001)
        os.utime(path)


def load_check_stats(out: Path) -> tuple[dict[str, dict] | None, str | None]:
    """The shard records of :data:`CHECK_STATS_NAME` in ``out`` that still describe their file.

    A record is kept when the shard's :func:`file_identity` equals its ``file`` and its ctime
    is older than the stats file's mtime (else a write in the same clock tick could hide).

    Returns:
        ``(records, problem)``: ``records`` is None when the file is absent (``problem``
        None) or unreadable (``problem`` says why); otherwise shard -> record for the shards
        unchanged since the build, and ``problem`` lists the recorded shards that changed
        (None when none did).
    """
    path = Path(out) / CHECK_STATS_NAME
    try:
        data = json.loads(path.read_text())
        stamp = os.stat(path).st_mtime_ns
        if data.get("version") != _CHECK_STATS_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {_CHECK_STATS_VERSION}")
        shards = data["shards"]
        for rec in shards.values():
            if not (isinstance(rec["file"], list) and len(rec["file"]) == 4 and isinstance(rec["scales"], int)
                    and all(isinstance(v, int) for v in rec["faults"].values())):
                raise TypeError("malformed shard record")
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{CHECK_STATS_NAME} is unreadable ({e})"
    kept, changed = {}, []
    for shard, rec in sorted(shards.items()):
        try:
            now = file_identity(Path(out) / shard)
        except OSError:
            now = None
        if now == rec["file"] and rec["file"][2] < stamp:
            kept[shard] = rec
        else:
            changed.append(shard)
    problem = None
    if changed:
        problem = (f"{len(changed)} shard(s) changed or copied since the build ({', '.join(changed[:3])}"
                   f"{' ...' if len(changed) > 3 else ''}: size, mtime, ctime or inode differ from "
                   f"{CHECK_STATS_NAME})")
    return kept, problem
