"""Keep peak RSS bounded when large tensors are allocated and freed over and over (glibc)."""

import ctypes

__all__ = ["CONVERT_MMAP_THRESHOLD", "bound_allocator", "release_freed_memory"]

try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim
except (OSError, AttributeError):  # not glibc
    _LIBC = None

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
_M_MMAP_THRESHOLD = -3

CONVERT_MMAP_THRESHOLD = 32 << 20
"""The converter's threshold: glibc's largest (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit).
A routed-expert weight (GLM-5.3-Flash: 2048 x 6144, 12 MiB as FP8) and the kernel's buffers
for it then come from the heap and are reused weight after weight; served by a fresh mmap
each, every page of them is faulted in and zeroed again, which measured as much CPU as the
quantization arithmetic itself (scripts/bench_convert.py). Larger tensors are still mapped
and unmapped on their own, and ``release_freed_memory`` after each shard returns the heap's
free pages, so peak RSS stays flat in the number of shards (FC-04)."""


def bound_allocator(mmap_threshold: int = 1 << 20) -> None:
    """Serve every allocation of ``mmap_threshold`` bytes or more with its own mmap (glibc
    ``mallopt``), and keep up to that much free memory at the top of each heap.

    glibc otherwise raises its mmap threshold after the first large free and carves later
    tensors out of the heap, where fragmentation makes peak RSS creep up shard after shard
    (or layer after layer); with a fixed threshold peak RSS stays flat (FC-04).
    """
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
        _LIBC.mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold)


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
