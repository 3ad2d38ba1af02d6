"""Build manifest and the resume ledger.

- ``spark_quant_manifest.json`` is written last: its presence marks a complete build. It
  holds per-file sha256 and size, the source (path or repo@revision, layout, shard header
  digests), the tool version, the recipe and its hash, and the conversion summary. It holds
  no timestamps, so an interrupted-then-resumed build is byte-identical to a clean one.
- ``.spark-quant-progress.json`` is the ledger of finished output shards while a build runs:
  the job fingerprint (options + source headers + decisions) and each shard's sha256. It is
  removed when the build completes. When several ranks convert (quantize/parallel.py), each
  keeps ``.spark-quant-progress.rank<r>.json``; a resume reads them all, whatever the number
  of ranks then.
"""

import hashlib
import json
from pathlib import Path

from formats.checkpoint import write_json_atomic
from formats.shards import sha256_file
from quantize.errors import OutputError

__all__ = ["MANIFEST_NAME", "PROGRESS_NAME", "Ledger", "fingerprint", "remove_ledgers",
           "write_manifest"]

MANIFEST_NAME = "spark_quant_manifest.json"
PROGRESS_NAME = ".spark-quant-progress.json"
_PROGRESS_GLOB = ".spark-quant-progress*.json"


def _is_ledger(rel: str) -> bool:
    return Path(rel).match(_PROGRESS_GLOB)


def fingerprint(obj) -> str:
    """sha256 of a JSON-serialisable description of the job (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


class Ledger:
    """Which output shards are finished, for ``--resume``."""

    def __init__(self, out: Path, job: str, resume: bool, rank: int | None = None):
        name = PROGRESS_NAME if rank is None else f".spark-quant-progress.rank{rank}.json"
        self.path = Path(out) / name
        self.out = Path(out)
        self.done: dict[str, str] = {}
        if resume:
            for p in sorted(self.out.glob(_PROGRESS_GLOB)):
                data = json.loads(p.read_text())
                if data.get("job") != job:
                    raise OutputError(
                        f"{out} holds a different build (options or source changed); use a new "
                        "--out or delete the folder", key=p.name)
                self.done.update(data.get("shards", {}))
        self.job = job
        self._save()

    def is_done(self, shard: str) -> bool:
        """True when ``shard`` was finished by an earlier run and its bytes still match."""
        want = self.done.get(shard)
        p = self.out / shard
        return want is not None and p.is_file() and sha256_file(p) == want

    def mark(self, shard: str) -> str:
        digest = sha256_file(self.out / shard)
        self.done[shard] = digest
        self._save()
        return digest

    def _save(self) -> None:
        write_json_atomic({"job": self.job, "shards": self.done}, self.path)

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)


def remove_ledgers(out: Path) -> None:
    """Delete every rank's ledger (the build is complete)."""
    for p in Path(out).glob(_PROGRESS_GLOB):
        p.unlink(missing_ok=True)


def write_manifest(out: Path, info: dict, digests: dict[str, str] | None = None) -> dict:
    """Hash every file in ``out`` (except the manifest and ledger) into ``info["files"]`` and
    write the manifest atomically. ``digests`` (file name -> sha256 the ledgers recorded when
    the shards were written or verified on resume) saves hashing those files again. Returns
    the manifest dict."""
    out = Path(out)
    digests = digests or {}
    files = {}
    for p in sorted(out.rglob("*")):
        rel = str(p.relative_to(out))
        if p.is_file() and rel != MANIFEST_NAME and not _is_ledger(rel) and not rel.endswith(".tmp"):
            files[rel] = {"sha256": digests.get(rel) or sha256_file(p), "bytes": p.stat().st_size}
    manifest = dict(info, files=files)
    write_json_atomic(manifest, out / MANIFEST_NAME)
    return manifest
