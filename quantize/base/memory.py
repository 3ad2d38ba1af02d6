"""Keep peak RSS bounded when large tensors are allocated and freed over and over (glibc)."""

import ctypes

__all__ = ["CONVERT_MMAP_THRESHOLD", "bound_allocator", "free_heap_bytes", "release_freed_memory"]

try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim
except (OSError, AttributeError):  # not glibc
    _LIBC = None


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)  # glibc >= 2.33
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _Mallinfo2

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

CONVERT_MMAP_THRESHOLD = 32 << 20
"""The converter's threshold: glibc's largest (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit).
A routed-expert weight (GLM-5.3-Flash: 2048 x 6144, 12 MiB as FP8) and the kernel's buffers
for it then come from the heap and are reused weight after weight; served by a fresh mmap
each, every page of them is faulted in and zeroed again, which measured as much CPU as the
quantization arithmetic itself (scripts/bench_convert.py). Larger tensors are still mapped
and unmapped on their own, and ``release_freed_memory`` after each shard returns the heap's
free pages beyond what the next shards reuse, so peak RSS stays flat in the number of shards
(FC-04)."""


def bound_allocator(mmap_threshold: int = 1 << 20, one_arena: bool = False) -> None:
    """Serve every allocation of ``mmap_threshold`` bytes or more with its own mmap (glibc
    ``mallopt``), and keep up to that much free memory at the top of each heap.

    glibc otherwise raises its mmap threshold after the first large free and carves later
    tensors out of the heap, where fragmentation makes peak RSS creep up shard after shard
    (or layer after layer); with a fixed threshold peak RSS stays flat (FC-04).

    ``one_arena``: threads started afterwards share the main heap (``M_ARENA_MAX`` 1). The
    converter's stages allocate in one thread and free in another (the reader's buffers die
    in the quantizer, the quantizer's in the writer); with an arena per thread each arena
    keeps its own free memory, and the total free grew shard after shard. Shared, the memory
    one stage frees is what the next allocates (free memory flat at about 0.5 GB over 7
    shards of 0.3 GB where per-thread arenas climbed past 0.7 GB).
    """
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
        _LIBC.mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold)
        if one_arena:
            _LIBC.mallopt(_M_ARENA_MAX, 1)


def free_heap_bytes() -> int | None:
    """Bytes glibc holds free in its heaps (``mallinfo2().fordblks``, every arena); ``None``
    where that cannot be asked (not glibc, or glibc older than 2.33)."""
    return None if _MALLINFO2 is None else int(_MALLINFO2().fordblks)


def release_freed_memory(keep: int = 0) -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``) when more than ``keep``
    bytes lie free.

    ``keep`` is memory the caller will allocate again soon (the next shard's buffers): handed
    back, every page of it is faulted in and zeroed again, which measured 0.85 CPU s per 2 G
    elements converted (12% of the run, scripts/bench_convert.py); kept, peak RSS still does
    not grow with the number of shards, since the free memory is capped at ``keep``. Where
    the free bytes cannot be read, it always trims.
    """
    if _LIBC is None:
        return
    free = free_heap_bytes() if keep else None
    if free is None or free > keep:
        _LIBC.malloc_trim(0)
