"""Build manifest and the resume ledger.

- ``spark_quant_manifest.json`` is written last: its presence marks a complete build. It
  holds per-file sha256 and size, the source (path or repo@revision, layout, shard header
  digests), the tool version, the recipe and its hash, and the conversion summary. It holds
  no timestamps, so an interrupted-then-resumed build is byte-identical to a clean one.
- ``.spark-quant-progress.json`` is the ledger of finished output shards while a build runs:
  the job fingerprint (options + source headers + decisions), each shard's sha256, and the
  per-shard data findings (all-zero tensors, block scales at the e4m3 floor) so that a resumed
  build reports the same notes as an uninterrupted one. It is removed when the build
  completes.

Every string in the manifest passes through ``quantize.redact`` (no tokens in manifests).
"""

import hashlib
import json
from pathlib import Path

from formats.checkpoint import write_json_atomic
from formats.shards import is_temp_name, sha256_file
from quantize.errors import OutputError
from quantize.redact import redact_obj

__all__ = ["MANIFEST_NAME", "PROGRESS_NAME", "Ledger", "fingerprint", "write_manifest",
           "resume_hint"]

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
        self.stats: dict[str, dict] = {}
        if resume and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                done, stats = dict(data.get("shards", {})), dict(data.get("stats", {}))
            except (OSError, ValueError, TypeError, AttributeError) as e:
                raise OutputError(f"the progress ledger {self.path} is unreadable ({e}); delete it "
                                  "to redo every shard, or use a new --out", key=PROGRESS_NAME) from None
            if data.get("job") != job:
                raise OutputError(
                    f"{out} holds a different build (options or source changed); use a new --out "
                    "or delete the folder", key=PROGRESS_NAME)
            self.done, self.stats = done, stats
        self.job = job
        self._save()

    def is_done(self, shard: str) -> bool:
        """True when ``shard`` was finished by an earlier run and its bytes still match."""
        want = self.done.get(shard)
        p = self.out / shard
        return want is not None and p.is_file() and sha256_file(p) == want

    def mark(self, shard: str, stats: dict | None = None) -> str:
        """Record ``shard`` as finished (its sha256) with its data findings ``stats``."""
        digest = sha256_file(self.out / shard)
        self.done[shard] = digest
        self.stats[shard] = stats or {}
        self._save()
        return digest

    def _save(self) -> None:
        write_json_atomic({"job": self.job, "shards": self.done, "stats": self.stats}, self.path)

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)


def resume_hint(out: Path) -> str | None:
    """How far an interrupted build in ``out`` got and how to continue it, or None when
    ``out`` holds no progress ledger."""
    try:
        done = len(json.loads((Path(out) / PROGRESS_NAME).read_text()).get("shards", {}))
    except (OSError, ValueError, AttributeError):
        return None
    return (f"{done} output shard(s) are finished in {out}; fix the cause and rerun the same "
            "command with --resume to continue")


def write_manifest(out: Path, info: dict) -> dict:
    """Hash every file in ``out`` (except the manifest and ledger) into ``info["files"]`` and
    write the manifest atomically. Returns the manifest dict."""
    out = Path(out)
    files = {}
    for p in sorted(out.rglob("*")):
        rel = str(p.relative_to(out))
        if p.is_file() and rel not in (MANIFEST_NAME, PROGRESS_NAME) and not is_temp_name(p.name):
            files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = redact_obj(dict(info, files=files))
    write_json_atomic(manifest, out / MANIFEST_NAME)
    return manifest
