"""Hostile and damaged safetensors headers, and reads from shards that change under us."""

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from formats.shards import ShardReader, read_header
from quantize.base.errors import SourceError


def raw_shard(path, header: dict, data: bytes = b"", hlen: int | None = None):
    """A safetensors file with exactly this header JSON and data section."""
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if hlen is None else hlen) + h + data)
    return path


def test_reference_layout_is_read(tmp_path):
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b": torch.ones(4, dtype=torch.bfloat16)}, str(tmp_path / "x.safetensors"))
    h = read_header(tmp_path / "x.safetensors")
    assert (h["a"].dtype, h["a"].shape, h["a"].nbytes) == ("F32", (2, 3), 24)
    r = ShardReader(tmp_path)
    assert torch.equal(r.get("x.safetensors", "a"), torch.arange(6.0).reshape(2, 3))
    assert torch.equal(r.get("x.safetensors", "a", rows=(1, 2)), torch.tensor([[3.0, 4.0, 5.0]]))
    assert r.get("x.safetensors", "b").dtype == torch.bfloat16
    r.close()


@pytest.mark.parametrize("header,data,hlen,message", [
    # a header length far past the file: refused before reading (or allocating) it
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, 2**60,
     r"header length 1152921504606846976 exceeds the 100000000-byte limit safetensors allows"),
    # a tensor declaring 16 EiB in a 64-byte data section: refused before any allocation
    ({"a": {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 64]}}, b"\0" * 64, None,
     r"tensor a declares bytes \[0, 64\) but needs 18446744073709551616 inside a data section "
     r"of 64 bytes"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None,
     r"tensor a declares bytes \[0, 16\) but needs 16 inside a data section of 8 bytes "
     r"\(truncated or corrupt\)"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24, None,
     r"tensors a and b overlap"),
    ({"a": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, b"\0" * 16, None,
     r"malformed header entry for a"),
    ({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     r"malformed header entry for a"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": "0-8"}}, b"\0" * 8, None,
     r"malformed header entry for a"),
    ({"a": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     r"tensor a has unknown dtype Q4_K"),
])
def test_hostile_headers_refused(tmp_path, header, data, hlen, message):
    p = raw_shard(tmp_path / "x.safetensors", header, data, hlen)
    with pytest.raises(SourceError, match=message) as e:
        read_header(p)
    assert e.value.shard == "x.safetensors"


@pytest.mark.parametrize("raw,message", [
    (b"[1, 2, 3]", "header is not a JSON object"),
    (b"{\"a\": ", "header is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "header is not valid JSON"),  # recursion bomb
    (b"\xff\xfe{}", "header is not valid JSON"),
])
def test_unparseable_headers_refused(tmp_path, raw, message):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(SourceError, match=message):
        read_header(p)


def test_shard_truncated_while_open_is_an_error_not_sigbus(tmp_path):
    """safetensors' mmap-based reader dies with SIGBUS (exit 135, no message) when a shard it
    has open is truncated; ours reports the shard. Run in a child so a crash cannot take
    pytest down."""
    save_file({"a": torch.ones(256, 256), "b": torch.ones(256, 256)}, str(tmp_path / "x.safetensors"))
    size = (tmp_path / "x.safetensors").stat().st_size
    code = (
        "import os, sys; from pathlib import Path\n"
        "from formats.shards import ShardReader\n"
        "from quantize.base.errors import SourceError\n"
        f"d = Path({str(tmp_path)!r}); r = ShardReader(d)\n"
        "r.get('x.safetensors', 'a')\n"
        "os.truncate(d / 'x.safetensors', 256 * 256 * 4)\n"
        "try:\n    r.get('x.safetensors', 'b')\n"
        "except SourceError as e:\n    print(e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (
        f"shard x.safetensors changed while it was being read ({size} -> 262144 bytes): "
        "truncated or replaced during the run; restore it and rerun with --resume")


def test_short_read_is_named(tmp_path, monkeypatch):
    """A read that hits the end of the file (size unchanged as far as fstat knows) is an
    error naming the tensor and the byte where the file ended."""
    save_file({"a": torch.ones(64, 64)}, str(tmp_path / "x.safetensors"))
    r = ShardReader(tmp_path)
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 0)
    with pytest.raises(SourceError, match=r"cannot read tensor a from shard x.safetensors: the "
                                          r"file ends at byte \d+ \(truncated during the run\)"):
        r.get("x.safetensors", "a")
    r.close()


def test_written_shard_is_readable_by_others_and_leaves_no_temp(tmp_path):
    """safetensors writes through a 0600 temp file; a build must be readable by an engine
    running as another user, like any new file under the umask."""
    from formats.shards import _UMASK, write_shard_atomic

    write_shard_atomic({"a": torch.ones(2)}, tmp_path / "x.safetensors")
    assert (tmp_path / "x.safetensors").stat().st_mode & 0o777 == 0o666 & ~_UMASK
    assert os.listdir(tmp_path) == ["x.safetensors"]


def test_shard_digest_from_memory_equals_the_file_digest(tmp_path, monkeypatch):
    """write_shard_atomic(sha256=True) hashes the tensors in memory beside the write and
    returns the file's sha256: the predicted header is safetensors' own, byte for byte, for
    every dtype it writes, a scalar, an empty tensor and escaped metadata; with a wrong
    prediction it hashes the file instead."""
    import formats.shards as shards
    from formats.shards import (
        TORCH_DTYPES,
        safetensors_prefix,
        sha256_file,
        write_shard_atomic,
    )

    g = torch.Generator().manual_seed(0)
    t = {"w.weight_packed": torch.randint(0, 255, (64, 24), generator=g, dtype=torch.uint8),
         "w.weight_scale": torch.rand(64, 3, generator=g).to(torch.float8_e4m3fn),
         "w.weight_global_scale": torch.tensor([448.0 * 6 / 0.3]),
         "norm.weight": torch.rand(33, generator=g).to(torch.bfloat16),
         "k_scale": torch.tensor(0.5), "empty": torch.zeros(0, 4), "big": torch.rand(7, 5, dtype=torch.float64)}
    t.update({f"all.{d}": torch.zeros(3, dtype=dt) for d, dt in TORCH_DTYPES.items()})
    meta = {"format": 'p"t \\ é'}
    p = tmp_path / "x.safetensors"
    digest = write_shard_atomic(t, p, metadata=meta, sha256=True)
    assert digest == sha256_file(p)
    prefix, order = safetensors_prefix(t, meta)
    assert p.read_bytes()[: len(prefix)] == prefix
    assert order[:3] == ["all.U64", "all.I64", "all.F64"] and order[-1] == "all.BOOL"

    def wrong(tensors, metadata):
        prefix, order = safetensors_prefix(tensors, metadata)
        return prefix[:-1] + b"!", order

    monkeypatch.setattr(shards, "safetensors_prefix", wrong)
    q = tmp_path / "y.safetensors"
    assert write_shard_atomic(t, q, sha256=True) == sha256_file(q)
    assert write_shard_atomic(t, tmp_path / "z.safetensors") is None
    assert safetensors_prefix(t, {"a": "1", "b": "2"}) is None  # hash-ordered keys

def _direct_case(tmp_path):
    """A shard whose large tensors start at offsets that are not multiples of 4096."""
    g = torch.Generator().manual_seed(0)
    t = {"a_small": torch.rand(3, generator=g),  # F32: first, shifts what follows off 4 KiB
         "b": torch.randint(0, 255, (1111, 1000), generator=g, dtype=torch.uint8),
         "c": torch.rand(700, 513, generator=g).to(torch.bfloat16)}
    save_file(t, str(tmp_path / "x.safetensors"))
    return t


@pytest.mark.parametrize("part_bytes", [4 << 20, 300_000])
def test_direct_reads_equal_buffered_reads(tmp_path, monkeypatch, part_bytes):
    """O_DIRECT reads of tensors of 1 MiB or more (aligned spans around unaligned offsets),
    in one request or split in parts read at once, give the same tensors, whole and by rows,
    as reads through the page cache; each owns memory of its own."""
    import formats.shards as shards
    from formats.shards import DIRECT_MIN_BYTES

    monkeypatch.setattr(shards, "DIRECT_PART_BYTES", part_bytes)

    t = _direct_case(tmp_path)
    assert t["b"].nbytes >= DIRECT_MIN_BYTES and read_header(tmp_path / "x.safetensors")["b"].offset % 4096
    d, b = ShardReader(tmp_path, direct=True), ShardReader(tmp_path)
    for name in t:
        x = d.get("x.safetensors", name)
        assert torch.equal(x, t[name]) and torch.equal(x, b.get("x.safetensors", name))
        assert x.is_contiguous() and x.dtype == t[name].dtype
    assert torch.equal(d.get("x.safetensors", "b", rows=(17, 1100)), t["b"][17:1100])
    x = d.get("x.safetensors", "b")
    y = d.get("x.safetensors", "b")
    x.fill_(0)
    assert torch.equal(y, t["b"])
    d.close()
    b.close()


@pytest.mark.parametrize("part_bytes", [4 << 20, 300_000])
def test_direct_read_truncated_file_is_named(tmp_path, monkeypatch, part_bytes):
    """A file cut short inside a large tensor: the O_DIRECT read (whole, or the first of its
    parts) ends early and the error names the tensor (the size check is bypassed here to
    reach the read itself)."""
    import formats.shards as shards

    monkeypatch.setattr(shards, "DIRECT_PART_BYTES", part_bytes)
    _direct_case(tmp_path)
    p = tmp_path / "x.safetensors"
    r = ShardReader(tmp_path, direct=True)
    fd, st, header, dfd = r._handle("x.safetensors")
    if dfd is None:
        pytest.skip("this file system has no O_DIRECT")
    os.truncate(p, header["b"].offset + 5000)
    r._open["x.safetensors"] = (fd, os.fstat(fd), header, dfd)
    with pytest.raises(SourceError, match=r"cannot read tensor b from shard x.safetensors: the "
                                          r"file ends at byte \d+ \(truncated during the run\)"):
        r.get("x.safetensors", "b")
    r.close()


def test_direct_refused_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """Where the file system refuses O_DIRECT (tmpfs: EINVAL at open, or at the first read)
    the reader reads through the page cache, with the same result."""
    import errno

    t = _direct_case(tmp_path)
    real_open, real_preadv = os.open, os.preadv

    def no_direct_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct_open)
    r = ShardReader(tmp_path, direct=True)
    assert torch.equal(r.get("x.safetensors", "b"), t["b"]) and r._open["x.safetensors"][3] is None
    r.close()
    monkeypatch.setattr(os, "open", real_open)

    direct_fds = set()

    def open_tracking(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def preadv_einval(fd, bufs, off):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "open", open_tracking)
    monkeypatch.setattr(os, "preadv", preadv_einval)
    r = ShardReader(tmp_path, direct=True)
    assert torch.equal(r.get("x.safetensors", "b"), t["b"]) and r._open["x.safetensors"][3] is None
    assert torch.equal(r.get("x.safetensors", "c"), t["c"])
    r.close()


def test_direct_handle_is_the_checked_file(tmp_path, monkeypatch):
    """A shard replaced (renamed over) between the plain open and the O_DIRECT open: the
    O_DIRECT handle points at another file, so it is not used, and every tensor comes from the
    file whose size and mtime are checked, never a mix of the two."""
    t = _direct_case(tmp_path)
    p = tmp_path / "x.safetensors"
    zeros = {k: torch.zeros_like(v) for k, v in t.items()}
    save_file(zeros, str(tmp_path / "new.safetensors"))
    real_open = os.open

    def swap_then_open(path, flags, *a):
        if flags & os.O_DIRECT:
            os.replace(tmp_path / "new.safetensors", p)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", swap_then_open)
    r = ShardReader(tmp_path, direct=True)
    assert torch.equal(r.get("x.safetensors", "b"), t["b"])
    assert torch.equal(r.get("x.safetensors", "a_small"), t["a_small"])
    assert r._open["x.safetensors"][3] is None
    r.close()
