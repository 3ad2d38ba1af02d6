"""The only code that opens weight files: lazy safetensors reads and atomic shard writes."""

import errno
import hashlib
import json
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantize.base.errors import OutputError, SourceError

__all__ = ["TensorInfo", "read_header", "read_metadata", "ShardReader", "write_shard_atomic", "sha256_file",
           "safetensors_prefix", "DIRECT_MIN_BYTES", "prefetch_file", "DTYPE_BYTES", "TORCH_DTYPES", "dtype_name", "discard",
           "is_temp_name"]

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2,
               "U32": 4, "U64": 8}
MAX_HEADER_BYTES = 100_000_000  # same bound safetensors itself enforces
_UMASK = os.umask(0)
os.umask(_UMASK)
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "U32": torch.uint32,
                "U64": torch.uint64}
_TORCH_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors header dtype string of a torch dtype (``torch.float8_e4m3fn`` -> ``F8_E4M3``)."""
    return _TORCH_NAMES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as declared in a shard header (safetensors dtype string, shape, bytes).

    ``offset`` is the absolute byte offset of the tensor's data in the shard file.
    """

    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _header_size(path: Path) -> tuple[int, int]:
    """(file size, header length) of a shard, checked before anything else is read."""
    name = path.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise SourceError(f"shard {name} does not exist", shard=name) from None
    if size < 8:
        raise SourceError(f"shard {name} is empty or truncated ({size} bytes)", shard=name)
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
    if hlen > MAX_HEADER_BYTES:
        raise SourceError(f"shard {name}: header length {hlen} exceeds the {MAX_HEADER_BYTES}"
                          "-byte limit safetensors allows", shard=name)
    if 8 + hlen > size:
        raise SourceError(f"shard {name}: header length {hlen} exceeds the file ({size} bytes)",
                          shard=name)
    return size, hlen


def _entry(name: str, key: str, v) -> tuple[str, tuple[int, ...], int, int]:
    """dtype, shape, start, end of one header entry; every field type-checked (JSON from
    anyone's repo: no floats, negative dims or strings where integers belong)."""
    try:
        dtype, shape, offsets = v["dtype"], v["shape"], v["data_offsets"]
        ints = [*shape, *offsets]
        if (not isinstance(dtype, str) or not isinstance(shape, list) or len(offsets) != 2
                or not all(type(i) is int and i >= 0 for i in ints)):
            raise TypeError
    except (KeyError, TypeError):
        raise SourceError(f"shard {name}: malformed header entry for {key}", shard=name,
                          tensor=key) from None
    return dtype, tuple(shape), offsets[0], offsets[1]


def read_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (``{}`` when it has none); e.g. transformers
    writes ``{"format": "pt"}``, TensorFlow ``tf``, Flax ``flax``, MLX ``mlx``.

    Raises:
        SourceError: naming the shard on a missing, truncated or malformed header.
    """
    _, hlen = _header_size(path)
    with open(path, "rb") as f:
        f.seek(8)
        raw = f.read(hlen)
    try:
        meta = json.loads(raw).get("__metadata__") or {}
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError) as e:
        raise SourceError(f"shard {path.name}: header is not valid JSON ({str(e)[:80]})",
                          shard=path.name) from None
    return meta if isinstance(meta, dict) else {}


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header without reading tensor data.

    Checks the header length, JSON, dtypes, and that every tensor's byte range lies inside the
    file, is consistent with its shape and does not overlap another, before anything is
    allocated. Header fields are type-checked (non-negative integer dims and offsets;
    ``__metadata__`` strings only).

    Returns:
        tensor name -> TensorInfo (``__metadata__`` skipped).

    Raises:
        SourceError: naming the shard (and tensor) on a missing, empty, truncated or
            malformed file.
    """
    name = path.name
    size, hlen = _header_size(path)
    with open(path, "rb") as f:
        f.seek(8)
        raw = f.read(hlen)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SourceError(f"shard {name}: header is not valid JSON ({str(e)[:80]})",
                          shard=name) from None
    if not isinstance(header, dict):
        raise SourceError(f"shard {name}: header is not a JSON object", shard=name)
    data_start = 8 + hlen
    data_len = size - data_start
    out: dict[str, TensorInfo] = {}
    spans = []
    for key, v in header.items():
        if key == "__metadata__":
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
                raise SourceError(f"shard {name}: __metadata__ must map strings to strings",
                                  shard=name, key="__metadata__")
            continue
        dtype, shape, start, end = _entry(name, key, v)
        if dtype not in DTYPE_BYTES:
            raise SourceError(f"shard {name}: tensor {key} has unknown dtype {dtype}", shard=name,
                              tensor=key)
        info = TensorInfo(key, name, dtype, shape, data_start + start)
        if not (start <= end <= data_len) or end - start != info.nbytes:
            raise SourceError(
                f"shard {name}: tensor {key} declares bytes [{start}, {end}) but needs "
                f"{info.nbytes} inside a data section of {data_len} bytes (truncated or corrupt)",
                shard=name, tensor=key)
        spans.append((start, end, key))
        out[key] = info
    spans.sort()
    for (s0, e0, k0), (s1, e1, k1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise SourceError(f"shard {name}: tensors {k0} and {k1} overlap", shard=name, tensor=k1)
    return out


DIRECT_MIN_BYTES = 1 << 20
"""Tensors of at least this many bytes are read with ``O_DIRECT`` where the file system
allows it (:class:`ShardReader`); smaller ones (scales, norms) through the page cache."""
_DIRECT_ALIGN = 4096  # offset, length and buffer alignment that O_DIRECT accepts on any device
DIRECT_PARTS = 2
DIRECT_PART_BYTES = 4 << 20
"""An O_DIRECT read of at least ``2 * DIRECT_PART_BYTES`` is split into ``DIRECT_PARTS``
requests issued at once (threads of :func:`_direct_pool`, GIL released in the read)."""
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _direct_pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(DIRECT_PARTS, thread_name_prefix="direct-read")
        return _POOL


def _open_direct(path: Path, st: os.stat_result) -> int | None:
    """An O_DIRECT handle on ``path`` if it is still the file ``st`` describes; ``None`` where
    the file system has no O_DIRECT (EINVAL) or the file was replaced since (the caller then
    reads the file it checked through the page cache)."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    dst = os.fstat(dfd)
    if (dst.st_ino, dst.st_dev) != (st.st_ino, st.st_dev):
        os.close(dfd)
        return None
    return dfd


class ShardReader:
    """Tensor reads from a folder of safetensors shards with plain positioned reads.

    Each ``get`` reads one tensor (or a range of its rows) into memory the caller owns, so
    memory holds only what the caller keeps. Reads are ``pread``, not ``mmap``: a shard that
    is truncated while open (a re-download, a full disk elsewhere) gives a short read and a
    clear error instead of a SIGBUS that kills the process without a message. Before each
    read the file's size and mtime are compared with those seen when its header was parsed,
    and, with ``expect(shard) -> (size, mtime_ns) | None``, at open with those pre-flight saw
    (a shard changed mid-run before the reader reached it, docs/faults.md). ``locate(shard) -> Path`` says where a shard file is (default ``folder / shard``); a Hub
    source passes one that downloads the shard on first use.

    With ``direct``, tensors of :data:`DIRECT_MIN_BYTES` or more are read with ``O_DIRECT``
    (Linux): the disk writes straight into the tensor's memory, with no page-cache copy. A
    checkpoint is read once, so the cache gains nothing, and filling it cost about 1 CPU
    second per GB read on the 2-core machine of scripts/bench_convert.py (plus, on a unified
    memory machine such as GB10, memory the GPU then lacks). Where the file system refuses
    O_DIRECT (ramfs, tmpfs before Linux 6.6, some network file systems) reads go through the
    page cache.
    """

    def __init__(self, folder: Path, max_open: int = 4,
                 locate: Callable[[str], Path] | None = None, direct: bool = False,
                 expect: Callable[[str], tuple[int, int] | None] | None = None):
        self.folder = Path(folder)
        self.expect = expect
        self.max_open = max_open
        self.locate = locate or (lambda shard: self.folder / shard)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._open: dict[str, tuple[int, os.stat_result, dict[str, TensorInfo], int | None]] = {}

    def _close(self, h) -> None:
        os.close(h[0])
        if h[3] is not None:
            os.close(h[3])

    def _handle(self, shard: str):
        h = self._open.pop(shard, None)
        if h is None:
            if len(self._open) >= self.max_open:
                self._close(self._open.pop(next(iter(self._open))))
            path = self.locate(shard)
            fd = os.open(path, os.O_RDONLY)
            st = os.fstat(fd)
            seen = self.expect(shard) if self.expect is not None else None
            if seen is not None and seen != (st.st_size, st.st_mtime_ns):
                os.close(fd)
                raise SourceError(
                    f"shard {shard} changed since pre-flight read its header ({seen[0]} -> "
                    f"{st.st_size} bytes, modification time changed: {seen[1] != st.st_mtime_ns}): "
                    "truncated or replaced during the run; restore it and rerun with --resume",
                    shard=shard)
            header = read_header(path)
            h = (fd, st, header, _open_direct(path, st) if self.direct else None)
        self._open[shard] = h
        return h

    def get(self, shard: str, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Read tensor ``name`` from ``shard`` (a file name inside the folder), CPU, own memory.

        Args:
            rows: optional ``(start, stop)`` along dim 0: only those rows are read.

        Raises:
            SourceError: naming tensor and shard when the tensor is not in the header or the
                file changed or was truncated since its header was read.
        """
        fd, st, header, dfd = self._handle(shard)
        info = header.get(name)
        if info is None:
            raise SourceError(f"tensor {name} is not in shard {shard}", shard=shard, tensor=name)
        now = os.fstat(fd)
        if (now.st_size, now.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            raise SourceError(
                f"shard {shard} changed while it was being read ({st.st_size} -> {now.st_size} "
                "bytes): truncated or replaced during the run; restore it and rerun with --resume",
                shard=shard, tensor=name)
        shape, offset, nbytes = list(info.shape), info.offset, info.nbytes
        if rows is not None:
            row_bytes = nbytes // shape[0] if shape and shape[0] else 0
            start, stop = max(0, rows[0]), min(shape[0], rows[1])
            shape[0] = max(0, stop - start)
            offset, nbytes = offset + start * row_bytes, shape[0] * row_bytes
        buf = None
        if dfd is not None and nbytes >= DIRECT_MIN_BYTES:
            buf = self._read_direct(dfd, offset, nbytes, shard, name)
            if buf is None:  # refused at read time: the page cache from now on
                os.close(dfd)
                self._open[shard] = (fd, st, header, None)
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self._read_into(fd, memoryview(buf.numpy()), offset, nbytes, shard, name)
        return buf.view(TORCH_DTYPES[info.dtype]).reshape(shape)

    @staticmethod
    def _read_into(fd: int, view: memoryview, offset: int, nbytes: int, shard: str, name: str,
                   align: int = 1) -> None:
        got = 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], offset + got)
            got += n
            if n == 0 or (got < nbytes and got % align):  # an O_DIRECT read ends at EOF only
                raise SourceError(
                    f"cannot read tensor {name} from shard {shard}: the file ends at byte "
                    f"{offset + got} (truncated during the run); restore it and rerun with "
                    "--resume", shard=shard, tensor=name)

    def _read_direct(self, dfd: int, offset: int, nbytes: int, shard: str, name: str):
        """The bytes ``[offset, offset + nbytes)`` as a uint8 tensor viewing an aligned buffer
        read with O_DIRECT from the aligned span around them, in up to
        :data:`DIRECT_PARTS` parts read at once (one request at a time left the disk of
        scripts/bench_convert.py at 0.8 GB/s, two at 1.3); ``None`` when the kernel refuses
        O_DIRECT for this file after all (EINVAL)."""
        a = _DIRECT_ALIGN
        lo = offset - offset % a
        need = offset + nbytes - lo
        span = -(-need // a) * a
        raw = torch.empty(span + a, dtype=torch.uint8)
        pad = -raw.data_ptr() % a
        view = memoryview(raw.numpy())[pad: pad + span]
        parts = max(1, min(DIRECT_PARTS, need // DIRECT_PART_BYTES))
        step = -(-need // parts // a) * a
        cuts = [(b, min(need, b + step)) for b in range(0, need, step)]

        def part(cut: tuple[int, int]) -> None:
            b, e = cut
            self._read_into(dfd, view[b: b + -(-(e - b) // a) * a], lo + b, e - b, shard, name,
                            align=a)

        try:
            if len(cuts) == 1:
                part(cuts[0])
            else:
                for f in [_direct_pool().submit(part, c) for c in cuts]:
                    f.result()
        except OSError as e:
            if e.errno == errno.EINVAL:
                return None
            raise
        start = pad + offset - lo
        return raw[start: start + nbytes]

    def drop(self, shard: str) -> None:
        """Close ``shard`` so its file can be deleted."""
        h = self._open.pop(shard, None)
        if h is not None:
            self._close(h)

    def close(self) -> None:
        for h in self._open.values():
            self._close(h)
        self._open.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: os may already be gone
            pass


def prefetch_file(path: Path) -> None:
    """Ask the kernel to start reading ``path`` into the page cache now, in large sequential
    requests (``posix_fadvise WILLNEED``), so that later per-tensor reads find the bytes
    there instead of waiting on the disk tensor by tensor. Best effort: returns at once, and
    does nothing for a missing file or where fadvise does not exist."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


_WRITE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E8M0",
                "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
"""The order in which safetensors lays tensors out in a file: by dtype, in this order (its
``Dtype`` enum, descending, so wider types come first and stay aligned), then by name."""


def safetensors_prefix(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[str]] | None:
    """The bytes ``safetensors.torch.save_file(tensors, metadata=metadata)`` writes before the
    tensor data (8-byte little-endian header length, the JSON header padded with spaces to a
    multiple of 8), and the tensor names in the order their bytes follow.

    Lets a writer hash a shard from memory while the file is being written. safetensors' own
    rules (``safetensors/src/tensor.rs``: ``prepare`` sorts, ``Metadata`` serializes with
    serde_json); a caller must still compare the result with the file's first bytes, and
    ``None`` is returned where a dtype is not one this knows, or for more than one metadata
    key (safetensors writes them in hash order).
    """
    if metadata and len(metadata) > 1:
        return None  # safetensors writes metadata from a Rust HashMap: its key order varies
    rank = {d: i for i, d in enumerate(_WRITE_ORDER)}
    names = {}
    for n, t in tensors.items():
        d = _TORCH_NAMES.get(t.dtype)
        if d is None:
            return None
        names[n] = d
    order = sorted(tensors, key=lambda n: (rank[names[n]], n))
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for n in order:
        t = tensors[n]
        header[n] = {"dtype": names[n], "shape": list(t.shape),
                     "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def _hash_from_memory(prefix: bytes, tensors: list[torch.Tensor], out: list[str]) -> None:
    """Append the sha256 of ``prefix`` and the tensors' bytes to ``out``; nothing on failure
    (the caller then hashes the file)."""
    try:
        h = hashlib.sha256(prefix)
        for t in tensors:
            if t.nbytes:
                h.update(t.reshape(-1).view(torch.uint8).numpy())  # releases the GIL
        out.append(h.hexdigest())
    except Exception:
        pass


def is_temp_name(name: str) -> bool:
    """True for a leftover of an interrupted write: our ``<name>.tmp`` files, and the
    ``.tmpXXXXXX`` files safetensors' ``save_file`` writes before renaming (a kill in the
    middle of ``save_file`` leaves one behind)."""
    return name.endswith(".tmp") or name.startswith(".tmp")


def discard(path: Path) -> None:
    """Remove a temp file if it exists; a failure to remove (read-only folder) is ignored,
    since the caller is already reporting the error that made it a leftover."""
    try:
        Path(path).unlink(missing_ok=True)
    except OSError:
        pass


def write_shard_atomic(tensors: dict[str, torch.Tensor], path: Path,
                       metadata: dict[str, str] | None = None, sha256: bool = False) -> str | None:
    """Write a safetensors shard to ``path`` through a temp name, fsync, then rename.

    A crash leaves at most temp files (:func:`is_temp_name`), never a complete-looking shard.
    The shard gets the permissions of an ordinary new file (``0o666`` minus the umask), not
    the ``0o600`` of the temp file safetensors writes through, so an engine running as
    another user can read the build.

    Once on disk, the file's pages are dropped from the page cache (``POSIX_FADV_DONTNEED``):
    a converter writes each shard once, and the freed pages serve the next shard's write;
    left cached, every write took fresh pages, which cost the 2-core machine of
    scripts/bench_convert.py about 1 CPU second per GB written.

    With ``sha256``, returns the file's hex sha256, computed from the tensors in memory in a
    second thread while safetensors writes (both release the GIL), so hashing adds no time
    to the write on a machine with a core to spare. The header is predicted
    (:func:`safetensors_prefix`) and compared with the file's before the rename; where they
    differ, the file is hashed instead, so the digest is always that of the file.

    Raises:
        OutputError: naming the shard when the write fails (disk full, read-only, ...).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tensors = {k: v.contiguous() for k, v in sorted(tensors.items())}
    metadata = metadata or {"format": "pt"}
    pre = safetensors_prefix(tensors, metadata) if sha256 else None
    digest: list[str] = []
    hasher = None
    if pre is not None:
        hasher = threading.Thread(target=_hash_from_memory, name="sha256", daemon=True,
                                  args=(pre[0], [tensors[n] for n in pre[1]], digest))
        hasher.start()
    try:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        finally:
            if hasher is not None:
                hasher.join()
        os.chmod(tmp, 0o666 & ~_UMASK)  # readable like any other output file, not 0600
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
            same = bool(digest) and f.read(len(pre[0])) == pre[0]  # digest: pre was predicted
            if sha256 and not same:
                digest[:] = [sha256_file(tmp)]
            if hasattr(os, "posix_fadvise"):  # on disk now: hand its cached pages back
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, path)
        return digest[0] if sha256 else None
    except Exception as e:  # OSError, or safetensors' own error on a failed write
        discard(tmp)
        raise OutputError(f"cannot write shard {path.name} in {path.parent}: {e}",
                          shard=path.name) from None
