"""Build manifest and the resume ledger.

- ``spark_quant_manifest.json`` is written last: its presence marks a complete build. It
  holds per-file sha256 and size, the source (path or repo@revision, layout, shard header
  digests), the tool version, the recipe and its hash, and the conversion summary. It holds
  no timestamps, so an interrupted-then-resumed build is byte-identical to a clean one.
- ``.spark-quant-progress.json`` is the ledger of finished output shards while a build runs:
  the job fingerprint (options + source headers + decisions) and each shard's sha256, plus the
  amax of every tensor read so far (float32 as ``float.hex``, exact), so a resumed run gets a
  fused group's shared global scale without re-reading (or re-downloading) finished shards.
  It is removed when the build completes.
"""

import hashlib
import json
from pathlib import Path

from formats.checkpoint import write_json_atomic
from formats.shards import sha256_file
from quantize.errors import OutputError

__all__ = ["MANIFEST_NAME", "PROGRESS_NAME", "Ledger", "fingerprint", "write_manifest"]

MANIFEST_NAME = "spark_quant_manifest.json"
PROGRESS_NAME = ".spark-quant-progress.json"


def fingerprint(obj) -> str:
    """sha256 of a JSON-serialisable description of the job (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


class Ledger:
    """Which output shards are finished, for ``--resume``."""

    def __init__(self, out: Path, job: str, resume: bool):
        self.path = Path(out) / PROGRESS_NAME
        self.out = Path(out)
        self.done: dict[str, str] = {}
        self.amax: dict[str, float] = {}
        if resume and self.path.exists():
            data = json.loads(self.path.read_text())
            if data.get("job") != job:
                raise OutputError(
                    f"{out} holds a different build (options or source changed); use a new --out "
                    "or delete the folder", key=PROGRESS_NAME)
            self.done = data.get("shards", {})
            self.amax = {k: float.fromhex(v) for k, v in data.get("amax", {}).items()}
        self.job = job
        self._save()

    def is_done(self, shard: str) -> bool:
        """True when ``shard`` was finished by an earlier run and its bytes still match."""
        want = self.done.get(shard)
        p = self.out / shard
        return want is not None and p.is_file() and sha256_file(p) == want

    def mark(self, shard: str, amax: dict[str, float] | None = None) -> str:
        """Record ``shard`` as finished (its sha256) and the tensor amaxes known so far."""
        digest = sha256_file(self.out / shard)
        self.done[shard] = digest
        self.amax.update(amax or {})
        self._save()
        return digest

    def _save(self) -> None:
        write_json_atomic({"job": self.job, "shards": self.done,
                           "amax": {k: float(v).hex() for k, v in sorted(self.amax.items())}},
                          self.path)

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)


def write_manifest(out: Path, info: dict) -> dict:
    """Hash every file in ``out`` (except the manifest and ledger) into ``info["files"]`` and
    write the manifest atomically. Returns the manifest dict."""
    out = Path(out)
    files = {}
    for p in sorted(out.rglob("*")):
        rel = str(p.relative_to(out))
        if p.is_file() and rel not in (MANIFEST_NAME, PROGRESS_NAME) and not rel.endswith(".tmp"):
            files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = dict(info, files=files)
    write_json_atomic(manifest, out / MANIFEST_NAME)
    return manifest
