"""The only code that opens weight files: lazy safetensors reads and atomic shard writes."""

import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantize.errors import OutputError, SourceError

__all__ = ["TensorInfo", "read_header", "ShardReader", "write_shard_atomic", "sha256_file",
           "prefetch_file", "DTYPE_BYTES", "dtype_name"]

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2,
               "U32": 4, "U64": 8}
_TORCH_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
                torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
                torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
MAX_HEADER_BYTES = 100_000_000  # same bound safetensors itself enforces
_UMASK = os.umask(0)
os.umask(_UMASK)


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors header dtype string of a torch dtype (``torch.float8_e4m3fn`` -> ``F8_E4M3``)."""
    return _TORCH_NAMES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as declared in a shard header (safetensors dtype string, shape, bytes)."""

    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header without reading tensor data.

    Checks the header length, JSON, dtypes, and that every tensor's byte range lies inside the
    file, is consistent with its shape and does not overlap another, before anything is
    allocated.

    Returns:
        tensor name -> TensorInfo (``__metadata__`` skipped).

    Raises:
        SourceError: naming the shard (and tensor) on a missing, empty, truncated or
            malformed file.
    """
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
        try:
            header = json.loads(f.read(hlen))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SourceError(f"shard {name}: header is not valid JSON ({e})", shard=name) from None
    data_len = size - 8 - hlen
    out: dict[str, TensorInfo] = {}
    spans = []
    if not isinstance(header, dict):
        raise SourceError(f"shard {name}: header is not a JSON object", shard=name)
    for key, v in header.items():
        if key == "__metadata__":
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
                raise SourceError(f"shard {name}: __metadata__ must map strings to strings",
                                  shard=name, key="__metadata__")
            continue
        try:
            dtype, shape, (start, end) = v["dtype"], tuple(int(d) for d in v["shape"]), v["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SourceError(f"shard {name}: malformed header entry for {key}", shard=name,
                              tensor=key) from None
        if dtype not in DTYPE_BYTES:
            raise SourceError(f"shard {name}: tensor {key} has unknown dtype {dtype}", shard=name,
                              tensor=key)
        info = TensorInfo(key, name, dtype, shape)
        if not (0 <= start <= end <= data_len) or end - start != info.nbytes:
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


class ShardReader:
    """Lazy tensor reads from a folder of safetensors shards, a few open files at a time.

    Each ``get`` reads one tensor (safetensors ``safe_open``, memory-mapped), so memory holds
    only what the caller keeps. ``locate(shard) -> Path`` says where a shard file is (default
    ``folder / shard``); a Hub source passes one that downloads the shard on first use.
    """

    def __init__(self, folder: Path, max_open: int = 4,
                 locate: Callable[[str], Path] | None = None):
        self.folder = Path(folder)
        self.max_open = max_open
        self.locate = locate or (lambda shard: self.folder / shard)
        self._open: dict[str, object] = {}

    def get(self, shard: str, name: str) -> torch.Tensor:
        """Read tensor ``name`` from ``shard`` (a file name inside the folder), CPU, own memory."""
        h = self._open.pop(shard, None)
        if h is None:
            if len(self._open) >= self.max_open:
                self._open.pop(next(iter(self._open)))
            h = safe_open(str(self.locate(shard)), framework="pt", device="cpu")
        self._open[shard] = h
        try:
            return h.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise SourceError(f"cannot read tensor {name} from shard {shard}: {e}", shard=shard,
                              tensor=name) from None

    def drop(self, shard: str) -> None:
        """Close ``shard`` (unmap it) so its file can be deleted."""
        self._open.pop(shard, None)

    def close(self) -> None:
        self._open.clear()


def prefetch_file(path: Path) -> None:
    """Ask the kernel to start reading ``path`` into the page cache now, in large sequential
    requests (``posix_fadvise WILLNEED``), so that later lazy (memory-mapped) reads find the
    bytes there instead of faulting them in page by page. Best effort: returns at once, and
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


def write_shard_atomic(tensors: dict[str, torch.Tensor], path: Path,
                       metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors shard to ``path`` through a temp name, fsync, then rename.

    A crash leaves at most a ``*.tmp`` file, never a complete-looking shard.

    Raises:
        OutputError: naming the shard when the write fails (disk full, read-only, ...).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(tmp),
                  metadata=metadata or {"format": "pt"})
        os.chmod(tmp, 0o666 & ~_UMASK)  # readable like any other output file, not 0600
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:  # OSError, or safetensors' own error on a failed write
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise OutputError(f"cannot write shard {path.name} in {path.parent}: {e}",
                          shard=path.name) from None
