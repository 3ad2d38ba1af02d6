"""One shard from the Hub into the Hugging Face cache, hashed as its bytes arrive.

The file is streamed through huggingface_hub's shared HTTP client (``get_session()``, which
retries 429 / 5xx answers: ``quantize.hub.retry``) from ``hf_hub_url`` into
``blobs/<hash>.incomplete``; the sha256 (LFS files) or git blob sha1 (others) is updated with
every chunk, so the finished file is never read again to check it. A dropped connection
resumes from the last byte received with an HTTP range request (bounded exponential backoff,
:func:`quantize.hub.retry.waits`); a partial file left by a killed run is resumed the same way
(its bytes so far are hashed once, from disk). Only a file whose hash and size equal the Hub's
listing is renamed to ``blobs/<hash>`` and linked from ``snapshots/<commit>/<path>``, the
layout ``hf_hub_download`` writes, so an offline run and every huggingface_hub program find it.
"""

import hashlib
import logging
import os
import time
from pathlib import Path

from quantize.hub.retry import MAX_RETRIES, waits

__all__ = ["CHUNK", "Mismatch", "blob_name", "fetch_to_cache"]

log = logging.getLogger("spark_quant.hub")

CHUNK = 8 * 2**20
"""Bytes per read of a partial file left by a killed run (hashed before resuming it)."""


class Mismatch(Exception):
    """The bytes received do not hash to the Hub's listed sha256 / blob id (or have another
    size); the partial file is already deleted."""


def blob_name(entry: dict) -> str:
    """Cache blob name of a listed file: its LFS sha256, else its git blob id."""
    return entry.get("sha256") or entry["blob_id"]


def _hasher(entry: dict, size: int):
    if entry.get("sha256"):
        return hashlib.sha256()
    h = hashlib.sha1()
    h.update(b"blob %d\0" % size)
    return h


def fetch_to_cache(repo: str, commit: str, path: str, entry: dict, storage: Path,
                   on_bytes=None, sleep=time.sleep) -> Path:
    """Download ``path`` of ``repo@commit`` into the cache folder ``storage``
    (``.../models--org--name``) unless its blob is already there; return the snapshot path.

    Args:
        entry: the listing of the file: ``size`` (bytes), ``sha256`` (LFS, or None) and
            ``blob_id`` (git sha1). on_bytes: called with the number of bytes of each chunk
            written (progress, tests).

    Raises:
        Mismatch: the received bytes differ from the listing (the partial file is deleted).
        huggingface_hub / httpx2 errors: the request failed after the retries (the caller
            turns them into a SourceError with ``hub_errors``); OSError: the disk.
    """
    import httpx2
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    size, name = int(entry["size"]), blob_name(entry)
    blob = storage / "blobs" / name
    pointer = storage / "snapshots" / commit / path
    if not blob.is_file():
        blob.parent.mkdir(parents=True, exist_ok=True)
        part = blob.with_name(name + ".incomplete")
        h = _hasher(entry, size)
        have = part.stat().st_size if part.is_file() else 0
        if have > size:
            part.unlink()
            have = 0
        if have:  # a killed run's partial file: hash what is there, fetch the rest
            with open(part, "rb") as f:
                while b := f.read(CHUNK):
                    h.update(b)
        url = hf_hub_url(repo, path, revision=commit)
        failures: list[float | None] = []
        with open(part, "ab") as f:
            while have < size:
                headers = build_hf_headers()
                if have:
                    headers["Range"] = f"bytes={have}-"
                try:
                    with get_session().stream("GET", url, headers=headers) as r:
                        if r.status_code >= 400:
                            r.read()
                            hf_raise_for_status(r)
                        if have and r.status_code == 200:  # the server ignored the range
                            f.seek(0)
                            f.truncate()
                            h, have = _hasher(entry, size), 0
                        for chunk in r.iter_bytes():  # as received: a drop loses nothing
                            if have + len(chunk) > size:
                                raise Mismatch(f"the Hub sent more than the {size} bytes listed")
                            f.write(chunk)
                            h.update(chunk)
                            have += len(chunk)
                            failures.clear()  # progress: the retry budget starts again
                            if on_bytes is not None:
                                on_bytes(len(chunk))
                    if have < size:
                        raise httpx2.RemoteProtocolError(f"response ended at byte {have} of {size}")
                except httpx2.TransportError as e:
                    if len(failures) >= MAX_RETRIES:
                        raise
                    failures.append(None)
                    wait = waits(failures)[-1]
                    log.warning("Hub: %s: %s at byte %d of %d; resuming in %gs (%d/%d)", path,
                                e or type(e).__name__, have, size, wait, len(failures), MAX_RETRIES)
                    f.flush()
                    sleep(wait)
                except Mismatch:
                    f.close()
                    part.unlink(missing_ok=True)
                    raise
            f.flush()
            os.fsync(f.fileno())
        if h.hexdigest() != name:
            part.unlink(missing_ok=True)
            raise Mismatch(f"{'sha256' if entry.get('sha256') else 'git blob sha1'} of the "
                           f"received bytes is {h.hexdigest()}")
        os.replace(part, blob)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if not pointer.exists():
        if pointer.is_symlink():
            pointer.unlink()
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    return pointer
